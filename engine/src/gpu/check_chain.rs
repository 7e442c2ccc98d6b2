//! Chained decode steps ([`DecodeChain`](crate::rank::DecodeChain), `gpu/chain.rs`) checked on the GPU against the same steps run one
//! plan at a time: the same prompts, decoded greedily and then with filtered sampling (the same draws), once step by
//! step (each step's token read back and fed by the host) and once in chains whose tokens never leave the device.
//! Every step's pick must be the same token and its summary (max logit, log-sum-exp) the same row; a wrong position,
//! length, replay row, flush or fed token shows in every later row. With the self-test's small ring and kv-only
//! threshold the chains cross flushes and the kv-only compress.
//!
//! Under tensor parallelism the ranks sample rows they join from every rank's vocabulary slice
//! (`gpu/whole_rows.rs`); the single steps then also return their logits, joined on the host, and every sampled id
//! must be the CPU twin's draw from that row (`SampleRow::sample`).
//!
//! A last pass of sampled single steps carries an additive bias on every row (a `min_tokens`-masked id, a
//! `logit_bias` ban, a forced or nudged id, as the coordinator sends for presence / frequency penalties, `logit_bias`
//! and `min_tokens`): at every tensor-parallel size each pick must be the CPU twin's draw from the unbiased row the
//! step returns, biased on the host.

use serde::Serialize;

use super::{gpu_group, GpuOptions};
use crate::decode::FormChoice;
use crate::error::{EngineError, Result};
use crate::rank::{ChainSample, ChainedDecode, DecodeChain, Program, RankGroup, SampleRow, StepPlan, StepResult};
use rewind_kernels::cuda::parity::{worse, Rng};
use std::path::Path;

/// The outcome of a chain check.
#[derive(Clone, Debug, Serialize)]
pub struct ChainReport {
    pub form: String,
    pub dtype: String,
    pub sequences: usize,
    pub tp: usize,
    /// Steps in each chain (`1 + chained`), and chains run per mode (greedy, then sampled).
    pub chain_steps: usize,
    pub chains: usize,
    /// Rows compared over both modes.
    pub rows: usize,
    /// Steps whose chained pick differs from the single step's (must be 0).
    pub token_mismatches: usize,
    /// Under tensor parallelism: sampled single-step rows whose id differs from the CPU twin's draw from the row
    /// joined on the host (must be 0), and the rows so compared.
    pub joined_mismatches: usize,
    pub joined_rows: usize,
    /// The biased pass: single-step rows whose device pick (the `logit_bias` kernel, then the sampler) differs from
    /// the CPU twin's on the returned row (must be 0), and the rows so compared.
    pub biased_mismatches: usize,
    pub biased_rows: usize,
    /// Worst relative difference of a row's max logit or log-sum-exp, chained against single steps.
    pub worst_rel: f64,
    pub tolerance: f64,
    pub pass: bool,
}

/// One decode row as both paths report it: the pick fed to the next step, the max logit and the log-sum-exp.
type Row = (u32, f32, f32);

/// The sampling of one mode: `None` for greedy; else filtered sampling with one draw per step.
fn chain_sample(sampled: bool, draws: Vec<f32>) -> Option<ChainSample> {
    sampled.then_some(ChainSample {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.0,
        draws,
    })
}

/// The rows of a step result (or a chain's, step-major) as [`Row`]s.
fn rows_of(out: &StepResult) -> Vec<Row> {
    out.rows
        .iter()
        .zip(&out.sampled)
        .map(|(r, s)| (s.unwrap_or(r.argmax), r.max, r.lse))
        .collect()
}

/// The biased pass's additive bias of sequence `i` at step `k`, ascending ids below `vocab`: a masked id
/// ([`MASKED`](crate::sample::MASKED)), a banned one, and one forced every third step and nudged otherwise.
fn check_bias(vocab: usize, k: usize, i: usize) -> Vec<(u32, f32)> {
    let ids = [3, 11 + i % 64, 100 + k];
    let forced = if k.is_multiple_of(3) { 100.0 } else { 1.5 };
    ids.into_iter()
        .zip([crate::sample::MASKED, -100.0, forced])
        .filter(|&(id, _)| id < vocab)
        .map(|(id, b)| (id as u32, b))
        .collect()
}

/// Decodes `steps` steps after each prompt: `chain = 1` one plan per step, else plans chaining `chain` steps.
/// `draws[k][i]` is sequence `i`'s draw at step `k`. Returns per step the rows of every sequence. `joined`: the
/// sampled single steps' draws checked against the CPU twin on the whole logit rows (tensor parallelism, or every
/// size when `biased`: single sampled steps whose rows carry [`check_bias`]), counted as (mismatches, rows).
#[allow(clippy::too_many_arguments)]
fn decode(
    gpu: &mut RankGroup,
    prompts: &[Vec<u32>],
    form: FormChoice,
    sampled: bool,
    draws: &[Vec<f32>],
    chain: usize,
    biased: bool,
    joined: &mut (usize, usize),
) -> Result<Vec<Vec<Row>>> {
    let check_joined = sampled && chain == 1 && (gpu.tp() > 1 || biased);
    let vocab = gpu.vocab_size();
    let (slots, first) = gpu.prefill_prompts(prompts, form)?;
    let mut tokens = first;
    let mut out: Vec<Vec<Row>> = Vec::with_capacity(draws.len());
    for start in (0..draws.len()).step_by(chain) {
        let seqs: Vec<ChainedDecode> = slots
            .iter()
            .enumerate()
            .map(|(i, &slot)| ChainedDecode {
                slot,
                position: prompts[i].len() + start,
                token: tokens[i],
                form,
                sample: chain_sample(sampled, (0..chain).map(|k| draws[start + k][i]).collect()),
            })
            .collect();
        let plan = if chain == 1 {
            let steps = seqs
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let mut step = s.step(0, s.token);
                    if let (true, Some(r)) = (biased, step.sample.as_mut()) {
                        r.bias = check_bias(vocab, start, i);
                    }
                    step
                })
                .collect();
            StepPlan::batch(steps).with_logits(check_joined)
        } else {
            StepPlan {
                commits: Vec::new(),
                program: Program::DecodeChain(DecodeChain { seqs, steps: chain - 1 }),
            }
        };
        // The rows' sampling, kept for the joined check (the plan moves into the step).
        let samples: Vec<Option<SampleRow>> = match (check_joined, plan.as_batch()) {
            (true, Some(b)) => b.seqs.iter().map(|s| s.sample.clone()).collect(),
            _ => Vec::new(),
        };
        let result = gpu.step(plan)?;
        if let (true, Some(logits)) = (check_joined, &result.logits) {
            let vocab = logits.len() / slots.len().max(1);
            for ((sample, row), got) in samples
                .iter()
                .zip(logits.chunks_exact(vocab.max(1)))
                .zip(&result.sampled)
            {
                let want = sample.as_ref().map(|r| r.sample(row));
                joined.0 += usize::from(*got != want);
                joined.1 += 1;
            }
        }
        let rows = rows_of(&result);
        for step in rows.chunks_exact(slots.len()) {
            out.push(step.to_vec());
        }
        tokens = out.last().map(|r| r.iter().map(|x| x.0).collect()).unwrap_or_default();
    }
    for slot in slots {
        gpu.release(slot)?;
    }
    Ok(out)
}

/// Runs the check for the checkpoint in `dir` in `form`: `chains` chains of `1 + chained` steps after each prompt,
/// greedily and then sampled, each against single steps.
pub fn chain_forced(
    dir: &Path,
    prompts: &[Vec<u32>],
    opts: &GpuOptions,
    form: FormChoice,
    chained: usize,
    chains: usize,
    tolerance: f64,
) -> Result<ChainReport> {
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) || chained == 0 || chains == 0 {
        return Err(EngineError::InvalidInput(
            "the chain check needs non-empty prompts and at least one chain of two steps".into(),
        ));
    }
    let (mut gpu, _) = gpu_group(dir, opts)?;
    let steps = chains * (chained + 1);
    let mut rng = Rng::new(0x0c4a_1eed);
    let (mut rows, mut mismatches, mut worst) = (0, 0, 0.0f64);
    let modes = [false, true];
    let mut joined = (0, 0);
    for sampled in modes {
        let draws: Vec<Vec<f32>> = (0..steps)
            .map(|_| (0..prompts.len()).map(|_| rng.unit().min(0.999_999)).collect())
            .collect();
        let single = decode(&mut gpu, prompts, form, sampled, &draws, 1, false, &mut joined)?;
        let chain = decode(
            &mut gpu,
            prompts,
            form,
            sampled,
            &draws,
            chained + 1,
            false,
            &mut joined,
        )?;
        for (a, b) in single.iter().flatten().zip(chain.iter().flatten()) {
            rows += 1;
            mismatches += usize::from(a.0 != b.0);
            for (x, y) in [(a.1, b.1), (a.2, b.2)] {
                let e = f64::from((x - y).abs()) / f64::from(x.abs()).max(1.0);
                worst = worse(worst, if y.is_finite() { e } else { f64::INFINITY });
            }
        }
        if single.len() != chain.len() {
            mismatches += 1;
        }
    }
    let draws: Vec<Vec<f32>> = (0..steps)
        .map(|_| (0..prompts.len()).map(|_| rng.unit().min(0.999_999)).collect())
        .collect();
    let mut biased = (0, 0);
    decode(&mut gpu, prompts, form, true, &draws, 1, true, &mut biased)?;
    Ok(ChainReport {
        form: form.name().to_string(),
        dtype: opts.dtype.to_string(),
        sequences: prompts.len(),
        tp: gpu.tp(),
        chain_steps: chained + 1,
        chains,
        rows,
        token_mismatches: mismatches,
        joined_mismatches: joined.0,
        joined_rows: joined.1,
        biased_mismatches: biased.0,
        biased_rows: biased.1,
        worst_rel: worst,
        tolerance,
        pass: mismatches == 0
            && worst <= tolerance
            && rows == modes.len() * steps * prompts.len()
            && joined.0 == 0
            && joined.1 == if gpu.tp() > 1 { steps * prompts.len() } else { 0 }
            && biased == (0, steps * prompts.len()),
    })
}
