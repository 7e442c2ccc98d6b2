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
}
