//! Chained decode steps ([`super::SchedConfig::decode_steps`]): when the final plan of a step may run several
//! decode steps (or verifies) back to back on the ranks, and the KV blocks that reserves.

use super::{Scheduler, Step, StepWork};

/// Whether a request's steps may chain on the ranks. The ranks then decide several tokens before the coordinator
/// sees the first, so the coordinator allows none where a token must be seen before the next runs (a session turn,
/// a repetition penalty, a speculative verify judged on whole rows on the host, ...).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Chain {
    /// Every step alone.
    #[default]
    None,
    /// Its decodes ([`Step::chained`]) and, when it speculates, its verifies ([`Step::spec_chain`]).
    All,
}

impl Chain {
    /// Whether its steps may chain.
    pub fn chains(self) -> bool {
        self == Chain::All
    }
}

impl Scheduler {
    /// Chains the final plan's decode steps (sets [`Step::chained`]) as far as every sequence allows, when the step is
    /// nothing but sampled decodes: no commits, preemptions, prompt chunks, verifies or replayed tokens, and every
    /// running sequence is in it, past its first step and allowed to chain its decodes ([`Request::chain`]).
    /// Chaining holds the whole batch for the chained steps, so it waits while anything else wants a step: a running
    /// sequence left out of this one (no budget or blocks for it), or a waiting request that could start next step (a
    /// free slot and its first chunk's blocks: chaining would delay its first token by the chained steps). A request
    /// waiting for blocks does not stop a chain: it starts only once a sequence finishes, which a chain delays by
    /// fewer steps.
    ///
    /// The chain is as long as every sequence's context and the KV blocks allow: the largest count whose extra
    /// blocks, summed over the batch, the free pool holds (never preempting anyone). It may run past a sequence's
    /// last token (max_tokens) when no request waits: that sequence finishes inside the chain and its later tokens
    /// are dropped (as vLLM's multi-step scheduling does), instead of the whole batch stepping singly for it. With a
    /// request waiting, the chain ends at the first sequence's last token, so its slot frees on time. The blocks are
    /// reserved and the in-state counts advanced now, so the sampled tokens that follow ([`Scheduler::sampled`])
    /// leave each unfinished sequence ready for its next decode.
    pub(in crate::sched) fn chain(&mut self, step: &mut Step) {
        if self.config.decode_steps < 2
            || !step.commits.is_empty()
            || !step.preempted.is_empty()
            || step.work.is_empty()
            || step.work.len() != self.running.len()
            || self.could_admit()
        {
            return;
        }
        let mut c = self.config.decode_steps - 1;
        // The tokens each sequence may still generate after this step's one: fewest and most.
        let (mut fewest, mut most) = (usize::MAX, 0);
        for p in &step.work {
            let Some(r) = self.running.iter().find(|r| r.id == p.id) else {
                return;
            };
            if p.fresh || !r.chain.chains() || !matches!(p.work, StepWork::Decode { sample: true, .. }) {
                return;
            }
            // `in_state` already counts this step's token.
            c = c.min(self.config.max_context.saturating_sub(r.in_state));
            let left = r.max_tokens.saturating_sub(r.generated.len() + 1);
            fewest = fewest.min(left);
            most = most.max(left);
        }
        c = c.min(if self.waiting.is_empty() { most } else { fewest });
        while c > 0 && self.chain_blocks(c) > self.free_blocks {
            c -= 1;
        }
        if c == 0 {
            return;
        }
        for i in 0..self.running.len() {
            let extra = self
                .blocks_for(self.running[i].in_state + c)
                .saturating_sub(self.running[i].blocks);
            self.free_blocks -= extra;
            let r = &mut self.running[i];
            r.blocks += extra;
            r.in_state += c;
        }
        step.chained = c;
    }

    /// Chains the final plan's verifies ([`Step::spec_chain`]) when it is nothing but verifies of one window by every
    /// running sequence, each allowed to chain its verifies ([`Request::chain`]: a request whose drafter the ranks
    /// can run), beside at most the commits of their last verifies, and no request waits. Each chained step may
    /// commit a whole window, so the chain is as long as every sequence's context and the free KV blocks allow for
    /// that (reserved now, never by preempting anyone; [`Scheduler::chain_verified`] returns what was not used), and
    /// no longer than whole windows need to reach every sequence's last token. Tokens past a sequence's last are
    /// dropped, as in a chain of decodes.
    pub(in crate::sched) fn chain_verifies(&mut self, step: &mut Step) {
        if self.config.decode_steps < 2
            || !step.preempted.is_empty()
            || step.work.is_empty()
            || step.work.len() != self.running.len()
            || !self.waiting.is_empty()
        {
            return;
        }
        let mut window = None;
        let mut c = self.config.decode_steps - 1;
        // The most tokens a sequence may still generate, this step's included.
        let mut most = 0;
        for p in &step.work {
            let Some(r) = self.running.iter().find(|r| r.id == p.id) else {
                return;
            };
            let StepWork::Verify { tokens, .. } = &p.work else {
                return;
            };
            if p.fresh || !r.chain.chains() || *window.get_or_insert(tokens.len()) != tokens.len() {
                return;
            }
            // `in_state` already counts this step's window.
            c = c.min(self.config.max_context.saturating_sub(r.in_state) / tokens.len());
            most = most.max(r.max_tokens.saturating_sub(r.generated.len()));
        }
        let Some(t) = window else { return };
        // Steps that accept whole windows reach every sequence's last token in `most / t` steps: a longer chain
        // could only run windows past every sequence's end.
        c = c.min(most.div_ceil(t).saturating_sub(1));
        let need = |s: &Self, c: usize| -> usize {
            s.running
                .iter()
                .map(|r| s.blocks_for(r.in_state + c * t).saturating_sub(r.blocks))
                .sum()
        };
        while c > 0 && need(self, c) > self.free_blocks {
            c -= 1;
        }
        if c == 0 {
            return;
        }
        for i in 0..self.running.len() {
            let extra = self
                .blocks_for(self.running[i].in_state + c * t)
                .saturating_sub(self.running[i].blocks);
            self.free_blocks -= extra;
            self.running[i].blocks += extra;
        }
        step.chained = c;
        step.spec_chain = true;
    }

    /// Whether the first waiting request could start in the next step (a free slot, and its first chunk's blocks
    /// free after this step's): chaining would hold it back for the whole chain.
    pub(in crate::sched) fn could_admit(&self) -> bool {
        !self.free_slots.is_empty()
            && self
                .waiting
                .values()
                .next()
                .is_some_and(|w| self.first_chunk(w, self.config.max_batch_tokens).is_some())
    }

    /// The KV blocks the running sequences need beyond those they hold to take `c` more tokens each.
    fn chain_blocks(&self, c: usize) -> usize {
        self.running
            .iter()
            .map(|r| self.blocks_for(r.in_state + c).saturating_sub(r.blocks))
            .sum()
    }
}
