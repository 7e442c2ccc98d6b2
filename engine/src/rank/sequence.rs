//! One sequence of a [`RankGroup`] as the generation loop's backend ([`SequenceStepper`]): prompt, then one token
//! per step, with the greedy pick or the sampled token chosen by the ranks (or by the coordinator under tensor
//! parallelism) so that no logits cross to the caller unless it asks.

use super::group::RankGroup;
use super::plan::{Rows, SampleRow, SeqKind, SeqStep, StepPlan};
use crate::decode::FormChoice;
use crate::error::{EngineError, Result};
use crate::generate::SequenceStepper;
use crate::sample::Sampler;

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
        let plan = StepPlan {
            commits: Vec::new(),
            seqs: vec![SeqStep {
                slot: self.slot,
                kind,
                position: self.position,
                tokens: tokens.to_vec(),
                form: self.form,
                rows,
                sample: None,
            }],
            full_logits: logits,
        };
        let out = self.group.step(plan)?;
        self.position += tokens.len();
        Ok(out)
    }

    fn one_token(&mut self, token: u32, sample: Option<SampleRow>, logits: bool) -> Result<super::StepResult> {
        let plan = StepPlan {
            commits: Vec::new(),
            seqs: vec![SeqStep {
                slot: self.slot,
                kind: SeqKind::Decode,
                position: self.position,
                tokens: vec![token],
                form: self.form,
                rows: Rows::Last,
                sample,
            }],
            full_logits: logits,
        };
        let out = self.group.step(plan)?;
        self.position += 1;
        Ok(out)
    }
}

fn logits_of(out: super::StepResult) -> Result<Vec<f32>> {
    out.logits
        .ok_or_else(|| EngineError::InvalidInput("the step returned no logits".into()))
}

impl SequenceStepper for GroupSequence<'_> {
    fn context_limit(&self) -> usize {
        self.limit
    }

    fn prefill(&mut self, prompt: &[u32]) -> Result<Vec<f32>> {
        logits_of(self.run(SeqKind::Prefill, prompt, Rows::Last, true)?)
    }

    fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        logits_of(self.one_token(token, None, true)?)
    }

    fn decode_greedy(&mut self, token: u32) -> Result<Option<u32>> {
        let out = self.one_token(token, None, false)?;
        Ok(out.rows.first().map(|r| r.argmax))
    }

    fn decode_sampled(&mut self, token: u32, sampler: &mut Sampler, history: &[u32]) -> Result<Option<u32>> {
        let p = sampler.params();
        let row = SampleRow {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            history: if p.repetition_penalty != 1.0 {
                history.to_vec()
            } else {
                Vec::new()
            },
            uniform: sampler.uniform(),
        };
        let out = self.one_token(token, Some(row), false)?;
        Ok(out.sampled.first().copied().flatten())
    }
}

impl Drop for GroupSequence<'_> {
    fn drop(&mut self) {
        // A release fails only for a slot that is not open (this one is) or a rank that stopped, which has already
        // failed a step.
        let _ = self.group.release(self.slot);
    }
}
