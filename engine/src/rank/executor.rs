//! The host side of the step programs a rank runs as a loop of single steps: a [`DecodeChain`] fed each step's
//! picks, and a [`VerifyChain`] judged, committed and drafted between its steps. A backend that keeps a chain on
//! the device (the GPU rank, `gpu/chain.rs` and `gpu/spec_chain.rs`) runs the same rules there; the CPU rank runs
//! these loops, which are the twins the device chains are checked against.
//!
//! Both loops see a backend only through [`SingleSteps`]: run one [`Batch`] after some commits, and merge row
//! summaries over the tensor-parallel group, so every rank of a group reaches the same picks and verdicts.

use super::plan::{Batch, Commit, DecodeChain, RowSummary, StepOut, VerifyChain};
use super::spec_chain::ChainLog;
use super::RowPass;
use crate::error::{EngineError, Result};
use crate::spec::accept::accept_summaries;

/// What the host loops need of a backend.
pub(crate) trait SingleSteps {
    /// Runs `commits`, then one step of `batch` (sampling its sampled rows on the rank).
    fn single(&mut self, commits: &[Commit], batch: &Batch) -> Result<StepOut>;

    /// Each row's summary over the whole vocabulary (gathered from every rank of a tensor-parallel group).
    fn merged(&self, rows: &[RowSummary]) -> Result<Vec<RowPass>>;
}

/// Runs a chain of decodes as `1 + steps` single steps, each fed the tokens the one before picked (sampled, else
/// the merged argmax). The rows come back step-major.
pub(crate) fn decode_chain(r: &mut impl SingleSteps, commits: &[Commit], chain: &DecodeChain) -> Result<StepOut> {
    let mut tokens: Vec<u32> = chain.seqs.iter().map(|s| s.token).collect();
    let mut out: Option<StepOut> = None;
    for k in 0..=chain.steps {
        let batch = Batch {
            seqs: chain.seqs.iter().zip(&tokens).map(|(s, &t)| s.step(k, t)).collect(),
            ..Batch::default()
        };
        let next = r.single(if k == 0 { commits } else { &[] }, &batch)?;
        let merged = r.merged(&next.rows)?;
        tokens = merged
            .iter()
            .zip(&next.rows)
            .map(|(m, row)| row.sampled.unwrap_or(m.argmax))
            .collect();
        match &mut out {
            Some(o) => o.rows.extend(next.rows),
            None => out = Some(next),
        }
    }
    out.ok_or_else(|| EngineError::InvalidInput("a chain of no steps".into()))
}

/// Runs a chain of verifies as `1 + steps` single verifies: each judged greedily from its rows' merged summaries
/// (or sampled from their one-pass summaries), committed, and followed by a verify of the next token and the drafts
/// the chain's drafter proposes from the stream. Returns the rows step-major and the chain's log.
pub(crate) fn verify_chain(r: &mut impl SingleSteps, commits: &[Commit], chain: &VerifyChain) -> Result<StepOut> {
    let t = chain.window();
    let mut batch = Batch {
        seqs: chain.seqs.iter().map(|s| s.step()).collect(),
        ..Batch::default()
    };
    let mut streams: Vec<Vec<u32>> = chain.seqs.iter().map(|s| s.stream.clone()).collect();
    let mut commits = commits.to_vec();
    let mut log = ChainLog::default();
    let mut out: Option<StepOut> = None;
    for k in 0..=chain.steps {
        let next = r.single(&commits, &batch)?;
        let merged = r.merged(&next.rows)?;
        commits.clear();
        for (q, s) in batch.seqs.iter_mut().enumerate() {
            let drafts = &s.tokens[1..];
            let sampled = s.spec.map(|sp| (sp.seed, sp.index));
            let v = accept_summaries(&merged[q * t..(q + 1) * t], drafts, sampled)?;
            let (a, y) = (v.accepted, v.token);
            log.drafts.extend_from_slice(drafts);
            log.accepted.push(a);
            log.tokens.push(y);
            if k < chain.steps {
                streams[q].extend_from_slice(&drafts[..a]);
                streams[q].push(y);
                commits.push(Commit {
                    slot: s.slot,
                    accepted: a + 1,
                });
                s.position += a + 1;
                if let Some(sp) = s.spec.as_mut() {
                    sp.index += (a + 1) as u64;
                }
                s.tokens = std::iter::once(y).chain(chain.draft(q, &streams[q], t - 1)).collect();
            }
        }
        match &mut out {
            Some(o) => o.rows.extend(next.rows),
            None => out = Some(next),
        }
    }
    let mut out = out.ok_or_else(|| EngineError::InvalidInput("a chain of no steps".into()))?;
    out.chain = Some(log);
    Ok(out)
}
