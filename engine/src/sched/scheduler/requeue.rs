//! Sending running sequences back to the queue: preemption by recompute (a sequence that needs a KV block none can
//! give), every sequence after a fault, and draining when the engine can no longer serve. A requeued sequence keeps
//! what it generated and the chunks its prompt ran in, so its rebuild repeats its first run exactly.

use super::{Request, Scheduler, Step, Waiting};

impl Scheduler {
    /// Frees running sequence `i`'s slot and blocks and queues it again with what it generated.
    pub(super) fn preempt(&mut self, i: usize, step: &mut Step) {
        let r = self.running.remove(i);
        step.work.retain(|p| p.id != r.id);
        self.free_slots.push(r.slot);
        self.free_blocks += r.blocks;
        step.preempted.push((r.id, r.slot));
        self.waiting.insert(
            (-i64::from(r.priority), r.arrival),
            Waiting {
                request: Request {
                    id: r.id,
                    prompt: r.history[..r.prompt_len].to_vec(),
                    max_tokens: r.max_tokens,
                    priority: r.priority,
                    restored: r.restored,
                    chain: r.chain,
                },
                arrival: r.arrival,
                generated: r.generated,
                chunks: if r.replay.is_empty() {
                    r.chunks
                } else {
                    // Preempted again before its replay ended: the earlier run's chunks still hold.
                    r.chunks.into_iter().chain(r.replay).collect()
                },
                cut: r.cut,
            },
        );
    }

    /// Sends every running sequence back to the queue with what it generated (after a fault: the ranks restart
    /// empty, and each sequence is re-prefilled with its history when admitted again). Returns their ids.
    pub fn requeue_all(&mut self) -> Vec<u64> {
        let mut scratch = Step::default();
        while !self.running.is_empty() {
            self.preempt(self.running.len() - 1, &mut scratch);
        }
        scratch.preempted.into_iter().map(|(id, _)| id).collect()
    }

    /// Makes waiting request `id` prefill from its first token rather than from the saved state of its leading
    /// `restored` tokens, which was lost (the ranks restarted without it): an earlier run's chunks are kept, after
    /// the lost tokens in chunks of at most a step's budget. Returns whether it was waiting with such a state.
    pub fn unrestore(&mut self, id: u64) -> bool {
        let budget = self.config.max_batch_tokens.max(1);
        let Some(w) = self.waiting.values_mut().find(|w| w.request.id == id) else {
            return false;
        };
        let lost = std::mem::take(&mut w.request.restored);
        if lost == 0 {
            return false;
        }
        if !w.chunks.is_empty() {
            let mut chunks: Vec<usize> = (0..lost).step_by(budget).map(|at| budget.min(lost - at)).collect();
            chunks.append(&mut w.chunks);
            w.chunks = chunks;
        }
        true
    }

    /// Removes every request, waiting or running (the engine can no longer serve); returns their ids.
    pub fn drain(&mut self) -> Vec<u64> {
        let mut ids = self.requeue_all();
        ids.extend(self.waiting.values().map(|w| w.request.id));
        self.waiting.clear();
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}
