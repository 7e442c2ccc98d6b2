//! The scheduler's side of speculative decoding: which sequences may be drafted for, the drafts a step carries, and
//! the accepted count a verify reports (the slot then commits its input token and those drafts).

use super::{SchedError, Scheduler};

impl Scheduler {
    /// Request ids whose next step samples a new token (running past their prompt, nothing in flight): the
    /// sequences a drafter may propose for.
    pub fn draft_ready(&self) -> Vec<u64> {
        self.running
            .iter()
            .filter(|r| !r.prefilling() && r.verifying.is_none() && r.in_state + 1 == r.stream_len())
            .map(|r| r.id)
            .collect()
    }

    /// Sets the drafts request `id` verifies in the next step (dropped if that step cannot sample it).
    pub fn propose(&mut self, id: u64, drafts: Vec<u32>) -> Result<(), SchedError> {
        let r = self
            .running
            .iter_mut()
            .find(|r| r.id == id)
            .ok_or(SchedError::NotRunning { id })?;
        r.drafts = drafts;
        Ok(())
    }

    /// Records that the verify request `id` ran in the step just planned accepted `accepted` of its drafts: the
    /// slot keeps its input token and those drafts (committed at the start of the next step), and the rejected
    /// drafts leave the stream. The accepted drafts and the token after them follow through
    /// [`Scheduler::sampled`], in order.
    pub fn verified(&mut self, id: u64, accepted: usize) -> Result<(), SchedError> {
        let r = self
            .running
            .iter_mut()
            .find(|r| r.id == id)
            .ok_or(SchedError::NotRunning { id })?;
        let Some(k) = r.verifying.take() else {
            return Err(SchedError::NotVerifying { id });
        };
        let accepted = accepted.min(k);
        r.in_state -= k - accepted;
        r.pending_commit = Some(1 + accepted);
        Ok(())
    }

    /// Records that the verify request `id` ran in the step just planned accepted `accepted` of its drafts but yields
    /// no token after them (a constrained request whose grammar does not allow the row's pick: that position must be
    /// sampled with the grammar's mask, which a verify's rows do not take). The slot keeps its input token and the
    /// accepted drafts but the last, and that last token (the input token when none was accepted) becomes the input
    /// the next step feeds again, so the position after it is computed afresh. The accepted drafts follow through
    /// [`Scheduler::sampled`], in order.
    pub fn verified_unresolved(&mut self, id: u64, accepted: usize) -> Result<(), SchedError> {
        let r = self
            .running
            .iter_mut()
            .find(|r| r.id == id)
            .ok_or(SchedError::NotRunning { id })?;
        let Some(k) = r.verifying.take() else {
            return Err(SchedError::NotVerifying { id });
        };
        let accepted = accepted.min(k);
        r.in_state -= k + 1 - accepted;
        r.pending_commit = Some(accepted);
        Ok(())
    }

    /// Records what a chain of verifies ([`Step::spec_chain`]) did for request `id`: the drafts each step accepted,
    /// in order. Every step but the last was committed on the ranks; the last one's input token and accepted drafts
    /// are committed at the start of the next step, as after a single verify. The blocks reserved for longer
    /// outcomes return to the pool. The tokens (each step's accepted drafts and the token after them) follow through
    /// [`Scheduler::sampled`], in order.
    ///
    /// [`Step::spec_chain`]: super::Step::spec_chain
    pub fn chain_verified(&mut self, id: u64, accepted: &[usize]) -> Result<(), SchedError> {
        let bs = self.config.kv_block_size;
        let r = self
            .running
            .iter_mut()
            .find(|r| r.id == id)
            .ok_or(SchedError::NotRunning { id })?;
        let (Some(k), Some((&last, steps))) = (r.verifying.take(), accepted.split_last()) else {
            return Err(SchedError::NotVerifying { id });
        };
        // Planned as one verify: `in_state` counted its whole window from the chain's first position.
        let first = r.in_state - (1 + k);
        let committed: usize = steps.iter().map(|&a| 1 + a.min(k)).sum();
        r.in_state = first + committed + 1 + last.min(k);
        r.pending_commit = Some(1 + last.min(k));
        // The ranks hold the blocks of the committed tokens and of the last window until its commit.
        let keep = (first + committed + 1 + k).div_ceil(bs).min(r.blocks);
        self.free_blocks += r.blocks - keep;
        r.blocks = keep;
        Ok(())
    }
}
