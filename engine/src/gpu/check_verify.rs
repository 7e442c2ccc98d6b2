//! The GPU's speculative path checked against its own plain decoding and against the CPU decoder: the same prompts,
//! teacher-forced with the CPU reference's greedy tokens, once decoded token by token in the recurrent form (the
//! reference) and once verified in windows of `T` tokens in a given form — replay and kv-only (drafts in the rings,
//! rolled back by a pointer move) or recurrent (the speculative baseline: one state snapshot per draft, committed by
//! a copy) — with an oracle drafter whose drafts are the teacher's tokens, each corrupted with probability `p` (so
//! acceptance is controlled on random weights). Each verify accepts the tokens up to the first corrupted draft and
//! commits them in the next step; the verified rows of the accepted tokens must match the GPU's recurrent rows and
//! the CPU decoder's rows at the same positions, and everything after a rejection is rolled back (a wrong rollback
//! or commit shows in every later row).

use std::path::Path;

use serde::Serialize;

use super::check::{cpu_rows, rel};
use super::{gpu_group, GpuOptions};
use crate::checkpoint::SafetensorsSource;
use crate::decode::FormChoice;
use crate::error::{EngineError, Result};
use crate::model::ModelConfig;
use crate::rank::{Batch, Commit, Program, Rows, SeqKind, SeqStep, StepPlan};
use crate::shard::ShardedModel;
use rewind_kernels::cuda::parity::{worse, Rng};

/// The outcome of a verify check.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyReport {
    pub form: String,
    pub dtype: String,
    /// Verify window `T`.
    pub window: usize,
    /// Probability that a draft is corrupted.
    pub corrupt: f64,
    /// Positions compared (accepted rows).
    pub positions: usize,
    /// Verify steps run and the tokens they accepted (the mean acceptance is `accepted / verifies`).
    pub verifies: usize,
    pub accepted: usize,
    /// Worst `max|Δ| / max|reference|` of a verified row against the recurrent row at its position.
    pub worst_rel: f64,
    /// The same against the CPU decoder's row (the recurrent form, f32, on the weights the GPU stores).
    pub worst_rel_cpu: f64,
    pub tolerance: f64,
    pub pass: bool,
}

/// Runs the check for the checkpoint in `dir`: `steps` teacher tokens after each prompt (all decoded together), the
/// GPU verifying in `form` with windows of `opts.max_verify` tokens.
// The step index addresses every sequence's teacher tokens and positions at once.
#[allow(clippy::needless_range_loop)]
pub fn verify_forced(
    dir: &Path,
    prompts: &[Vec<u32>],
    steps: usize,
    opts: &GpuOptions,
    form: FormChoice,
    corrupt: f64,
    tolerance: f64,
) -> Result<VerifyReport> {
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(EngineError::InvalidInput(
            "the verify check needs non-empty prompts".into(),
        ));
    }
    let window = opts.max_verify;
    let config = ModelConfig::from_dir(dir)?;
    let vocab = config.vocab_size;
    // The CPU decoder's greedy tokens, and its rows at every position (prompt rows first).
    let (teacher, cpu): (Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>) = {
        let mut src = SafetensorsSource::open(dir)?;
        let mut rounded = super::check::GpuRounded {
            inner: &mut src,
            dtype: opts.dtype,
        };
        let cpu = ShardedModel::load(config, 1, 0, &mut rounded)?;
        cpu_rows(cpu, prompts, steps, None)?.into_iter().unzip()
    };
    // The reference: the recurrent form, one token a step.
    let reference: Vec<Vec<Vec<f32>>> = {
        let (mut gpu, _) = gpu_group(dir, opts)?;
        let (slots, _) = gpu.prefill_prompts(prompts, FormChoice::Recurrent)?;
        let mut rows = vec![Vec::with_capacity(steps); prompts.len()];
        for i in 0..steps {
            let plan = StepPlan {
                commits: Vec::new(),
                program: Program::Batch(Batch {
                    seqs: slots
                        .iter()
                        .enumerate()
                        .map(|(k, &slot)| SeqStep {
                            slot,
                            kind: SeqKind::Decode,
                            position: prompts[k].len() + i,
                            tokens: vec![teacher[k][i]],
                            form: FormChoice::Recurrent,
                            rows: Rows::Last,
                            sample: None,
                            spec: None,
                            logprobs: None,
                        })
                        .collect(),
                    full_logits: true,
                    hidden: false,
                    mtp: Vec::new(),
                }),
            };
            let logits = gpu.step(plan)?.logits.unwrap_or_default();
            for (k, row) in logits.chunks_exact(vocab).enumerate() {
                rows[k].push(row.to_vec());
            }
        }
        rows
    };
    let (mut gpu, _) = gpu_group(dir, opts)?;
    let (slots, _) = gpu.prefill_prompts(prompts, form)?;
    let mut rng = Rng::new(0x05ee_d0fd_2af7);
    let mut done = vec![0usize; prompts.len()];
    let mut commits: Vec<Commit> = Vec::new();
    let (mut worst, mut worst_cpu) = (0.0f64, 0.0f64);
    let (mut positions, mut verifies, mut accepted_total) = (0usize, 0usize, 0usize);
    while done.iter().any(|&d| d < steps) || !commits.is_empty() {
        let mut seqs = Vec::new();
        let mut accepts = Vec::new();
        for (k, &slot) in slots.iter().enumerate() {
            let i = done[k];
            if i >= steps {
                continue;
            }
            let w = window.min(steps - i);
            // The first token is the committed one; drafts after it may be corrupted.
            let mut tokens = teacher[k][i..i + w].to_vec();
            let mut accept = w;
            for (j, tok) in tokens.iter_mut().enumerate().skip(1) {
                if f64::from(rng.unit()) < corrupt {
                    *tok = (*tok + 1) % vocab as u32;
                    accept = accept.min(j);
                }
            }
            seqs.push(SeqStep {
                slot,
                kind: SeqKind::Verify,
                position: prompts[k].len() + i,
                tokens,
                form,
                rows: Rows::All,
                sample: None,
                spec: None,
                logprobs: None,
            });
            accepts.push((k, slot, i, w, accept));
        }
        if seqs.is_empty() {
            break;
        }
        let out = gpu.step(
            StepPlan::batch(seqs)
                .with_commits(std::mem::take(&mut commits))
                .with_logits(true),
        )?;
        let logits = out.logits.unwrap_or_default();
        let mut row = 0;
        for (k, slot, i, w, accept) in accepts {
            for j in 0..accept {
                let got = &logits[(row + j) * vocab..(row + j + 1) * vocab];
                worst = worse(worst, rel(got, &reference[k][i + j]));
                let at_cpu = cpu[k].get(prompts[k].len() + i + j).ok_or_else(|| {
                    EngineError::Gpu(format!(
                        "the CPU reference has no row at position {}",
                        prompts[k].len() + i + j
                    ))
                })?;
                worst_cpu = worse(worst_cpu, rel(got, at_cpu));
                positions += 1;
            }
            row += w;
            verifies += 1;
            accepted_total += accept;
            done[k] = i + accept;
            // The last verify of a sequence needs no commit: nothing follows it.
            if done[k] < steps {
                commits.push(Commit { slot, accepted: accept });
            }
        }
    }
    Ok(VerifyReport {
        form: form.name().to_string(),
        dtype: opts.dtype.to_string(),
        window,
        corrupt,
        positions,
        verifies,
        accepted: accepted_total,
        worst_rel: worst,
        worst_rel_cpu: worst_cpu,
        tolerance,
        pass: worst <= tolerance && worst_cpu <= tolerance && positions == steps * prompts.len(),
    })
}
