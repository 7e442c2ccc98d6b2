//! One sequence of a [`RankGroup`], stepped by hand (`rewind logits`, `rewind perplexity`, the tests' references):
//! each [`GroupSequence::run`] is one step of that sequence alone. Serving many sequences is the actor runtime's job.

use super::group::RankGroup;
use super::plan::{Rows, SeqKind, SeqStep, StepPlan};
use crate::decode::FormChoice;
use crate::error::Result;

/// A sequence opened on a [`RankGroup`]; released when dropped.
pub struct GroupSequence<'g> {
    group: &'g mut RankGroup,
    slot: usize,
    form: FormChoice,
    position: usize,
    limit: usize,
}

impl<'g> GroupSequence<'g> {
    /// Opens a sequence decoded in `form` that may grow to `limit` tokens (at most the group's context).
    pub fn open(group: &'g mut RankGroup, form: FormChoice, limit: usize) -> Result<Self> {
        let limit = limit.min(group.books().max_context());
        let slot = group.open(form)?;
        Ok(GroupSequence {
            group,
            slot,
            form,
            position: 0,
            limit,
        })
    }

    /// The sequence's slot.
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// Runs `tokens` as one step of `kind`; returns the step's logits `[rows, vocab]` when `logits`, else nothing.
    pub fn run(&mut self, kind: SeqKind, tokens: &[u32], rows: Rows, logits: bool) -> Result<super::StepResult> {
        if self.position + tokens.len() > self.limit {
            return Err(crate::EngineError::InvalidInput(format!(
                "{} more tokens would take the sequence past the {} it was opened for",
                tokens.len(),
                self.limit
            )));
        }
        let plan = StepPlan::batch(vec![SeqStep {
            slot: self.slot,
            kind,
            position: self.position,
            tokens: tokens.to_vec(),
            form: self.form,
            rows,
            sample: None,
            spec: None,
            logprobs: None,
        }])
        .with_logits(logits);
        let out = self.group.step(plan)?;
        self.position += tokens.len();
        Ok(out)
    }

    /// Keeps the first `kept` tokens (the input token and `kept − 1` drafts) of the verify just run
    /// ([`SeqKind::Verify`] through [`GroupSequence::run`]): a commit-only step, after which the sequence continues
    /// after them.
    pub fn commit(&mut self, verified: usize, kept: usize) -> Result<()> {
        if kept == 0 || kept > verified || verified > self.position {
            return Err(crate::EngineError::InvalidInput(format!(
                "cannot keep {kept} of a verify of {verified} tokens"
            )));
        }
        let plan = StepPlan::commits(vec![super::plan::Commit {
            slot: self.slot,
            accepted: kept,
        }]);
        self.group.step(plan)?;
        self.position -= verified - kept;
        Ok(())
    }
}

impl Drop for GroupSequence<'_> {
    fn drop(&mut self) {
        // A release fails only for a slot that is not open (this one is) or a rank that stopped, which has already
        // failed a step.
        let _ = self.group.release(self.slot);
    }
}
