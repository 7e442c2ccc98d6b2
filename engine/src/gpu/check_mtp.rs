//! MTP drafting on the GPU ranks (`gpu/mtp.rs`) checked against the CPU ranks' (`rank/mtp_cpu.rs`, the reference):
//! a GPU group and a CPU group loaded with the checkpoint's MTP layer run the same plans, every sequence asking for
//! the layer's drafts, and every proposal (the position and token the ranks judged, and the drafts) is compared.
//!
//! The plans cover the MTP bookkeeping's paths: each prompt in two chunks (the first reports no row, so its last row
//! waits for the second's token, and the second repairs it), then verifies whose drafts are the previous proposal's,
//! committed in full (the ranks' own verdict), and every third one cut a token shorter with a token forced after the
//! cut (as a stop string or a grammar would: the ranks repair the row before it, or restart their KV when that row
//! is gone), followed by a decode. Sequences are batched together, so one step mixes decodes and verifies of
//! different lengths. The CPU's proposals drive the plans; the GPU must propose the same.
//!
//! The whole sequence of plans runs twice on the same groups (fresh slots the second time), so that with CUDA graphs
//! on the second pass replays the MTP graphs the first captured (`gpu/graphs.rs`), catch-ups and draft loops alike;
//! with graphs on, the check passes only when the MTP layer's graphs were replayed.

use std::path::Path;

use serde::Serialize;

use super::{gpu_group, GpuOptions};
use crate::decode::{DecoderConfig, FormChoice};
use crate::error::{EngineError, Result};
use crate::model::ModelConfig;
use crate::rank::{
    Batch, Commit, CpuLauncher, CpuOptions, GraphStats, MtpProposal, MtpRequest, Program, RankGroup, Rows, SeqKind,
    SeqStep, StepPlan, StepResult,
};

/// The outcome of an MTP check.
#[derive(Clone, Debug, Serialize)]
pub struct MtpReport {
    pub form: String,
    pub dtype: String,
    /// Drafts per proposal (the verify window less its first token).
    pub window: usize,
    /// Plans run after the prompts.
    pub steps: usize,
    /// Proposals compared, and how many of the GPU's equal the CPU's (position, token and drafts).
    pub proposals: usize,
    pub proposals_equal: usize,
    /// Drafts compared where both proposals judged the step alike, and how many are equal.
    pub drafts: usize,
    pub drafts_equal: usize,
    /// Verifies cut short with another token forced after the cut (the repair and restart paths).
    pub cuts: usize,
    /// Passes over the plans (the second replays the graphs the first captured).
    pub passes: usize,
    /// The first GPU rank's CUDA-graph counters after the check (`mtp_replayed`: the MTP layer's replays).
    pub graphs: Option<GraphStats>,
    /// The first proposal that differs, in words.
    pub first_mismatch: Option<String>,
    /// Every proposal equal.
    pub pass: bool,
}

/// What a sequence runs next.
#[derive(Clone, Debug)]
enum Next {
    Decode { position: usize, token: u32 },
    Verify { position: usize, tokens: Vec<u32> },
}

/// One sequence's step of a plan.
fn seq(slot: usize, kind: SeqKind, position: usize, tokens: Vec<u32>, form: FormChoice, rows: Rows) -> SeqStep {
    SeqStep {
        slot,
        kind,
        position,
        tokens,
        form,
        rows,
        sample: None,
        spec: None,
        logprobs: None,
    }
}

/// A plan of `seqs` (one per prompt, in prompt order), each asking for `window` drafts, after `commits`.
fn plan(seqs: Vec<SeqStep>, commits: Vec<Commit>, window: usize) -> StepPlan {
    let mtp = seqs.iter().map(|s| MtpRequest { slot: s.slot, window }).collect();
    StepPlan {
        commits,
        program: Program::Batch(Batch {
            seqs,
            full_logits: false,
            hidden: false,
            mtp,
        }),
    }
}

/// The two groups, each with its own slots (one per prompt, in prompt order).
struct Groups {
    gpu: RankGroup,
    cpu: RankGroup,
    gpu_slots: Vec<usize>,
    cpu_slots: Vec<usize>,
}

impl Groups {
    /// Runs `make(slots)` on both groups; returns their answers (GPU, CPU).
    fn step(&mut self, make: impl Fn(&[usize]) -> StepPlan) -> Result<(StepResult, StepResult)> {
        let g = self.gpu.step(make(&self.gpu_slots))?;
        let c = self.cpu.step(make(&self.cpu_slots))?;
        Ok((g, c))
    }
}

/// Passes over the plans.
const PASSES: usize = 2;

/// Each prompt's proposal of `r` (the ranks answer one per request, in request order: prompt order here).
fn by_prompt(r: &StepResult, slots: &[usize]) -> Vec<Option<MtpProposal>> {
    slots
        .iter()
        .map(|&s| r.mtp.iter().find(|p| p.slot == s).cloned())
        .collect()
}

/// Runs the check for the checkpoint in `dir` (with an MTP layer): `steps` plans after the prompts, the GPU ranks
/// started with `opts` (its `max_verify` sets the window: `max_verify − 1` drafts), sequences in `form`.
pub fn mtp_forced(
    dir: &Path,
    prompts: &[Vec<u32>],
    steps: usize,
    opts: &GpuOptions,
    form: FormChoice,
) -> Result<MtpReport> {
    if prompts.is_empty() || prompts.iter().any(|p| p.len() < 2) {
        return Err(EngineError::InvalidInput(
            "the MTP check needs prompts of at least two tokens (a prompt runs in two chunks)".into(),
        ));
    }
    if opts.max_verify < 2 {
        return Err(EngineError::InvalidInput(format!(
            "the MTP check verifies drafts: a verify window of {} holds none",
            opts.max_verify
        )));
    }
    let window = opts.max_verify - 1;
    let vocab = ModelConfig::from_dir(dir)?.vocab_size as u32;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) + (steps + 2) * opts.max_verify;
    let cpu_opts = CpuOptions {
        tp: 1,
        decoder: DecoderConfig {
            buffer_len: opts.buffer_len,
            max_verify: opts.max_verify,
            kv_only_threshold: opts.kv_only_threshold,
            ..DecoderConfig::new(prompts.len(), longest)
        },
    };
    let gpu_opts = GpuOptions {
        mtp: true,
        ..opts.clone()
    };
    let (gpu, _) = gpu_group(dir, &gpu_opts)?;
    let cpu = RankGroup::start(&CpuLauncher::new(dir, cpu_opts)?.with_mtp(true))?;
    let mut g = Groups {
        gpu,
        cpu,
        gpu_slots: Vec::new(),
        cpu_slots: Vec::new(),
    };
    let mut report = MtpReport {
        form: form.name().to_string(),
        dtype: opts.dtype.to_string(),
        window,
        steps,
        proposals: 0,
        proposals_equal: 0,
        drafts: 0,
        drafts_equal: 0,
        cuts: 0,
        passes: PASSES,
        graphs: None,
        first_mismatch: None,
        pass: false,
    };
    for _ in 0..PASSES {
        one_pass(&mut g, &mut report, prompts, steps, form, vocab)?;
    }
    report.graphs = g.gpu.health()?.first().and_then(|h| h.graphs);
    // Graphs on (and not switched off by REWIND_CUDA_SYNC=1): the MTP layer's work must have replayed its graphs.
    let replayed = !gpu_opts.cuda_graphs || report.graphs.is_some_and(|g| !g.enabled || g.mtp_replayed > 0);
    report.pass = report.proposals > 0 && report.proposals_equal == report.proposals && replayed;
    Ok(report)
}

/// One pass over the plans on fresh slots of both groups (released at its end), adding to `report`.
fn one_pass(
    g: &mut Groups,
    report: &mut MtpReport,
    prompts: &[Vec<u32>],
    steps: usize,
    form: FormChoice,
    vocab: u32,
) -> Result<()> {
    let window = report.window;
    for _ in prompts {
        let s = g.gpu.open(form)?;
        g.gpu_slots.push(s);
        let s = g.cpu.open(form)?;
        g.cpu_slots.push(s);
    }
    // The prompts in two chunks: the first reports no row (no proposal yet), the second its last.
    let (g1, c1) = g.step(|slots| {
        let seqs = prompts
            .iter()
            .zip(slots)
            .map(|(p, &s)| seq(s, SeqKind::Prefill, 0, p[..p.len() / 2].to_vec(), form, Rows::None))
            .collect();
        plan(seqs, Vec::new(), window)
    })?;
    if !g1.mtp.is_empty() || !c1.mtp.is_empty() {
        return Err(EngineError::Gpu(format!(
            "a prompt chunk that reports no row got proposals (GPU {}, CPU {})",
            g1.mtp.len(),
            c1.mtp.len()
        )));
    }
    let (g2, c2) = g.step(|slots| {
        let seqs = prompts
            .iter()
            .zip(slots)
            .map(|(p, &s)| {
                let h = p.len() / 2;
                seq(s, SeqKind::Prefill, h, p[h..].to_vec(), form, Rows::Last)
            })
            .collect();
        plan(seqs, Vec::new(), window)
    })?;
    let mut last = compare(report, &g2, &c2, g, "after the prompt")?;
    let mut next: Vec<Next> = last
        .iter()
        .map(|p| Next::Verify {
            position: p.position,
            tokens: std::iter::once(p.token).chain(p.drafts.iter().copied()).collect(),
        })
        .collect();
    let mut commits: Vec<(usize, usize)> = Vec::new();
    let mut verifies = 0usize;
    for step in 0..steps {
        let current = next.clone();
        let pending = std::mem::take(&mut commits);
        let (gr, cr) = g.step(|slots| {
            let seqs = current
                .iter()
                .zip(slots)
                .map(|(n, &s)| match n {
                    Next::Decode { position, token } => {
                        seq(s, SeqKind::Decode, *position, vec![*token], form, Rows::Last)
                    }
                    Next::Verify { position, tokens } => {
                        seq(s, SeqKind::Verify, *position, tokens.clone(), form, Rows::All)
                    }
                })
                .collect();
            let commits = pending
                .iter()
                .map(|&(k, accepted)| Commit {
                    slot: slots[k],
                    accepted,
                })
                .collect();
            plan(seqs, commits, window)
        })?;
        last = compare(report, &gr, &cr, g, &format!("step {step}"))?;
        for (k, (n, p)) in current.iter().zip(&last).enumerate() {
            let verify_of = |p: &MtpProposal| Next::Verify {
                position: p.position,
                tokens: std::iter::once(p.token).chain(p.drafts.iter().copied()).collect(),
            };
            next[k] = match n {
                Next::Decode { .. } => verify_of(p),
                Next::Verify { position, tokens } => {
                    // The CPU ranks' verdict: `accepted` drafts, then their token.
                    let accepted = p.position - position - 1;
                    verifies += 1;
                    if verifies.is_multiple_of(3) {
                        // Cut a token short and force another token after the cut than the one verified there.
                        report.cuts += 1;
                        let cut = accepted;
                        commits.push((k, cut));
                        Next::Decode {
                            position: position + cut,
                            token: (tokens[cut] + 1) % vocab,
                        }
                    } else {
                        commits.push((k, accepted + 1));
                        verify_of(p)
                    }
                }
            };
        }
    }
    for s in std::mem::take(&mut g.gpu_slots) {
        g.gpu.release(s)?;
    }
    for s in std::mem::take(&mut g.cpu_slots) {
        g.cpu.release(s)?;
    }
    Ok(())
}

/// Compares both groups' proposals of one step (one per prompt); returns the CPU's, which drive the next plan.
fn compare(
    report: &mut MtpReport,
    gpu: &StepResult,
    cpu: &StepResult,
    g: &Groups,
    at: &str,
) -> Result<Vec<MtpProposal>> {
    let (gp, cp) = (by_prompt(gpu, &g.gpu_slots), by_prompt(cpu, &g.cpu_slots));
    let mut out = Vec::with_capacity(cp.len());
    for (k, (gp, cp)) in gp.into_iter().zip(cp).enumerate() {
        let cp = cp.ok_or_else(|| EngineError::Gpu(format!("{at}: the CPU ranks proposed nothing for prompt {k}")))?;
        report.proposals += 1;
        let Some(gp) = gp else {
            report
                .first_mismatch
                .get_or_insert_with(|| format!("{at}, prompt {k}: the GPU ranks proposed nothing"));
            out.push(cp);
            continue;
        };
        if (gp.position, gp.token) == (cp.position, cp.token) {
            report.drafts += cp.drafts.len();
            report.drafts_equal += gp.drafts.iter().zip(&cp.drafts).filter(|(a, b)| a == b).count();
        }
        if (gp.position, gp.token, &gp.drafts) == (cp.position, cp.token, &cp.drafts) {
            report.proposals_equal += 1;
        } else {
            report.first_mismatch.get_or_insert_with(|| {
                format!(
                    "{at}, prompt {k}: GPU proposes {:?} after token {} at {}, CPU {:?} after {} at {}",
                    gp.drafts, gp.token, gp.position, cp.drafts, cp.token, cp.position
                )
            });
        }
        out.push(cp);
    }
    Ok(out)
}
