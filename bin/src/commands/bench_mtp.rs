//! `rewind bench --mtp-draft`: what drafting a window with the checkpoint's MTP layer on the GPU ranks costs, beside
//! the verify step it feeds. Each sequence verifies the ranks' own last proposal (its token and drafts) and commits
//! the ranks' verdict, as the coordinator does, so the layer's catch-up runs the rows a real step leaves (the
//! accepted rows and the bonus row) and the draft loop its `T` steps; the ranks time that work between two CUDA events
//! (`GpuOptions::time_mtp`, with CUDA graphs as the ranks run them) and the bench reads the stage from their health.

use std::time::Instant;

use anyhow::{Context, Result};
use rewind_engine::decode::FormChoice;
use rewind_engine::rank::{
    Batch, Commit, MtpProposal, MtpRequest, Program, RankGroup, Rows, SeqKind, SeqStep, StageTime, StepPlan,
    MTP_DRAFT_STAGE,
};

use super::bench::tokens;

/// Untimed steps before the timed ones: the second sighting of each shape captures its graphs.
const WARMUP: usize = 3;

/// One measure of MTP drafting over a batch.
#[derive(Clone, Copy, Debug)]
pub(super) struct MtpDraftCost {
    /// Wall milliseconds per step: the verify, its commit and the MTP work, read back.
    pub step_ms: f64,
    /// Device milliseconds per step of the MTP work (catch-up and draft loop), from the ranks' events.
    pub draft_ms: f64,
    /// Drafts accepted per sequence and step (random weights accept few).
    pub accepted: f64,
}

/// A step of `b` sequences in `slots`: each verifies its proposal and asks for `window` more drafts, after `commits`.
fn plan(props: &[MtpProposal], form: FormChoice, window: usize, commits: Vec<Commit>) -> StepPlan {
    let seqs = props
        .iter()
        .map(|p| SeqStep {
            slot: p.slot,
            kind: SeqKind::Verify,
            position: p.position,
            tokens: std::iter::once(p.token).chain(p.drafts.iter().copied()).collect(),
            form,
            rows: Rows::All,
            sample: None,
            spec: None,
            logprobs: None,
        })
        .collect();
    StepPlan {
        commits,
        program: Program::Batch(Batch {
            seqs,
            full_logits: false,
            hidden: false,
            mtp: props.iter().map(|p| MtpRequest { slot: p.slot, window }).collect(),
        }),
    }
}

/// The proposal of `slot` among a step's, which must be there.
fn proposal_of(all: &[MtpProposal], slot: usize) -> Result<MtpProposal> {
    all.iter()
        .find(|p| p.slot == slot)
        .cloned()
        .with_context(|| format!("the ranks proposed no MTP drafts for slot {slot}"))
}

/// The MTP stage of the first rank's health (the ranks of a group run it in lockstep).
fn draft_stage(group: &RankGroup) -> Result<StageTime> {
    let stages = group
        .health()?
        .into_iter()
        .next()
        .and_then(|h| h.stages)
        .context("the ranks report no stage times: they were not started to time their MTP work")?;
    Ok(stages.stages.get(MTP_DRAFT_STAGE).copied().unwrap_or_default())
}

/// Opens `b` sequences of `prompt` random tokens (seeded by `seed`), prefilled with the MTP layer following, then
/// times `steps` verify steps of `window` drafts each after [`WARMUP`] untimed ones; releases the sequences.
pub(super) fn measure(
    group: &mut RankGroup,
    form: FormChoice,
    b: usize,
    prompt: usize,
    window: usize,
    steps: usize,
    seed: u64,
) -> Result<MtpDraftCost> {
    anyhow::ensure!(window > 0 && steps > 0, "an MTP draft measure needs drafts and steps");
    let vocab = group.vocab_size();
    let mut props = Vec::with_capacity(b);
    for i in 0..b {
        let slot = group.open(form)?;
        let prefill = StepPlan {
            commits: Vec::new(),
            program: Program::Batch(Batch {
                seqs: vec![SeqStep {
                    slot,
                    kind: SeqKind::Prefill,
                    position: 0,
                    tokens: tokens(prompt, vocab, 1000 + i as u64 + seed),
                    form,
                    rows: Rows::Last,
                    sample: None,
                    spec: None,
                    logprobs: None,
                }],
                full_logits: false,
                hidden: false,
                mtp: vec![MtpRequest { slot, window }],
            }),
        };
        let out = group.step(prefill)?;
        props.push(proposal_of(&out.mtp, slot)?);
    }
    let mut commits = Vec::new();
    let mut accepted = 0usize;
    let step = |group: &mut RankGroup, props: &mut [MtpProposal], commits: &mut Vec<Commit>| -> Result<usize> {
        let out = group.step(plan(props, form, window, std::mem::take(commits)))?;
        let mut kept = 0;
        for p in props.iter_mut() {
            let next = proposal_of(&out.mtp, p.slot)?;
            // The verdict: the drafts accepted and the token after them.
            let moved = next
                .position
                .checked_sub(p.position)
                .filter(|&m| m >= 1)
                .with_context(|| {
                    format!(
                        "slot {}: the ranks' next proposal at {} does not follow the verify at {}",
                        p.slot, next.position, p.position
                    )
                })?;
            commits.push(Commit {
                slot: p.slot,
                accepted: moved,
            });
            kept += moved - 1;
            *p = next;
        }
        Ok(kept)
    };
    for _ in 0..WARMUP {
        step(group, &mut props, &mut commits)?;
    }
    group.synchronize()?;
    let before = draft_stage(group)?;
    let t0 = Instant::now();
    for _ in 0..steps {
        accepted += step(group, &mut props, &mut commits)?;
    }
    group.synchronize()?;
    let secs = t0.elapsed().as_secs_f64();
    let after = draft_stage(group)?;
    for p in &props {
        group.release(p.slot)?;
    }
    let runs = after.count.saturating_sub(before.count);
    anyhow::ensure!(
        runs == steps as u64,
        "the ranks timed {runs} MTP drafting runs over {steps} steps"
    );
    Ok(MtpDraftCost {
        step_ms: 1e3 * secs / steps as f64,
        draft_ms: after.ns.saturating_sub(before.ns) as f64 / 1e6 / steps as f64,
        accepted: accepted as f64 / (steps * b) as f64,
    })
}
