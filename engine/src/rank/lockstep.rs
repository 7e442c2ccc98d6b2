//! The coordinator's half of a step, as two plain functions both drivers call (the synchronous
//! [`super::RankGroup`] and the actor runtime's coordinator): [`prepare`] checks a plan against the [`Books`] and
//! builds what every rank receives; [`finish`] records the step in the books and merges the ranks' answers into
//! one whole-vocabulary result.
//!
//! Every rank samples its sampled rows itself; under tensor parallelism each joins a row from every rank's slice of
//! the vocabulary and samples it with the function a whole-vocabulary rank uses, so the ranks answer the same ids
//! ([`finish`] checks that they do).

use std::sync::Arc;

use super::books::Books;
use super::plan::{Program, StepOut, StepPlan};
use super::spec_chain::ChainLog;
use super::vocab::merge_step;
use crate::error::{EngineError, Result};
use rewind_kernels::cpu::lm_head::RowPass;

/// The whole-vocabulary answer to one step: per reported row (in plan order) its summary, the token chosen for it
/// when the plan asked to sample, and the logits `[rows, vocab]` when the plan asked for them.
#[derive(Clone, Debug, PartialEq)]
pub struct StepResult {
    pub rows: Vec<RowPass>,
    pub sampled: Vec<Option<u32>>,
    pub logits: Option<Vec<f32>>,
    /// `[rows, hidden]` final hidden states, when the plan asked for them (the rows [`Batch::hidden`](super::Batch::hidden) names).
    pub hidden: Option<Vec<f32>>,
    /// What a chain of verifies drafted and judged ([`Program::VerifyChain`]).
    pub chain: Option<ChainLog>,
    /// The ranks' MTP proposals ([`Batch::mtp`](super::Batch::mtp)), one per request, the same on every rank.
    pub mtp: Vec<super::mtp::MtpProposal>,
}

/// Checks `plan` against `books` (a bad plan fails here, before any rank computes) and builds what every rank runs.
/// Every rank samples its sampled rows itself, a tensor-parallel one from the whole rows it joins from every rank's
/// slice, so every rank answers the same ids.
pub fn prepare(books: &Books, plan: &StepPlan) -> Result<Arc<StepPlan>> {
    books.validate(plan)?;
    Ok(Arc::new(plan.clone()))
}

/// Records the step `plan` (which every rank ran) in `books` and merges the ranks' answers `outs` (rank order);
/// a row with a NaN or an infinity fails the step.
pub fn finish(books: &mut Books, plan: &StepPlan, outs: &[StepOut], vocab: usize) -> Result<StepResult> {
    books.apply(plan)?;
    // A chain of verifies: every rank judged alike, so their logs agree; the books settle what was committed.
    let chain = match &plan.program {
        Program::Batch(_) | Program::DecodeChain(_) => None,
        Program::VerifyChain(c) => {
            let log = outs.first().and_then(|o| o.chain.clone()).ok_or_else(|| {
                EngineError::InvalidInput("a rank answered a chain of verifies without its log".into())
            })?;
            if let Some(r) = outs.iter().position(|o| o.chain.as_ref() != Some(&log)) {
                return Err(EngineError::Communicator(format!(
                    "rank {r} judged a chain of verifies differently from rank 0"
                )));
            }
            books.settle_chain(c, &log)?;
            Some(log)
        }
    };
    let mtp = outs.first().map(|o| o.mtp.clone()).unwrap_or_default();
    if let Some(r) = outs.iter().position(|o| o.mtp != mtp) {
        return Err(EngineError::Communicator(format!(
            "rank {r} proposed other MTP drafts than rank 0"
        )));
    }
    let asked = plan.as_batch().map_or(0, |b| b.mtp.len());
    if mtp.len() > asked {
        return Err(EngineError::InvalidInput(format!(
            "the ranks answered {} MTP proposals for {asked} requests",
            mtp.len()
        )));
    }
    let merged = merge_step(outs, vocab)?;
    if let Some(row) = merged.rows.iter().position(RowPass::poisoned) {
        return Err(EngineError::NonFinite {
            position: row_position(plan, row),
        });
    }
    Ok(StepResult {
        rows: merged.rows,
        sampled: merged.sampled,
        logits: if plan.full_logits() { merged.logits } else { None },
        hidden: if plan.hidden() { merged.hidden } else { None },
        chain,
        mtp,
    })
}

/// The position of reported row `row` of `plan` (for error messages).
fn row_position(plan: &StepPlan, row: usize) -> usize {
    match &plan.program {
        Program::Batch(b) => {
            let mut row = row;
            for s in &b.seqs {
                let n = s.row_count();
                if row < n {
                    return s.position + s.tokens.len() - n + row;
                }
                row -= n;
            }
            0
        }
        // Step-major: step `row / seqs`, one row per sequence.
        Program::DecodeChain(c) => {
            let n = c.seqs.len().max(1);
            c.seqs.get(row % n).map_or(0, |s| s.position + row / n)
        }
        // Step-major, each step a whole window per sequence (at a position the log knows; the first step's is
        // given).
        Program::VerifyChain(c) => {
            let t = c.window().max(1);
            let i = row % (t * c.seqs.len()).max(1);
            c.seqs.get(i / t).map_or(0, |s| s.position + i % t)
        }
    }
}
