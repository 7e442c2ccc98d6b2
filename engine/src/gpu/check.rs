//! The model-level GPU check: teacher-forced logits against the CPU f32 reference.
//!
//! The CPU model generates greedily from each prompt, recording its logits at every position; the GPU then runs the
//! same prompt (prefill, in chunks) and is fed the CPU's tokens one step at a time (decode, all sequences in one
//! batch), so both see identical inputs however their argmaxes differ. Per position the error is
//! `max|Δlogit| / max|logit_cpu|`; the GPU's argmax must equal the CPU's wherever the CPU's top-two margin exceeds the
//! tolerance (relative to the same scale).

use std::path::Path;

use serde::Serialize;

use super::{GpuModel, GpuOptions};
use crate::error::{EngineError, Result};
use crate::model::hybrid::Logits;
use crate::model::Model;
use crate::sample::argmax;

/// The outcome for one model.
#[derive(Clone, Debug, Serialize)]
pub struct TeacherForcedReport {
    /// Sequences checked together (one decode batch).
    pub sequences: usize,
    /// Positions compared over all sequences (prompt positions and decode steps).
    pub positions: usize,
    /// Worst `max|Δ| / max|cpu|` over the positions.
    pub worst_rel: f64,
    /// Positions whose CPU top-two margin exceeds the tolerance, and how many of them the GPU's argmax missed.
    pub argmax_checked: usize,
    pub argmax_mismatches: usize,
    pub tolerance: f64,
    pub tp: usize,
    /// Activation storage type on the GPU.
    pub dtype: String,
    pub pass: bool,
    /// Per sequence: the error at each position (prompt positions first, then decode steps).
    pub per_position: Vec<Vec<f64>>,
}

fn rel(gpu: &[f32], cpu: &[f32]) -> f64 {
    let scale = cpu.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs()))).max(1e-30);
    let diff = gpu
        .iter()
        .zip(cpu)
        .fold(0.0f64, |m, (a, b)| m.max(f64::from((a - b).abs())));
    if gpu.iter().any(|v| !v.is_finite()) {
        f64::INFINITY
    } else {
        diff / scale
    }
}

/// `(top, second)` of a row.
fn top_two(row: &[f32]) -> (f32, f32) {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in row {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    (a, b)
}

/// The CPU's greedy run of `prompt` for `steps` tokens: its tokens and its logits per position (`[prompt + steps]`
/// rows, the last position's row being the one that picked the final token).
fn cpu_reference(model: &Model, prompt: &[u32], steps: usize) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let vocab = model.config().vocab_size;
    let mut state = model.new_state();
    let all = model.forward(prompt, &mut state, Logits::All)?;
    let mut rows: Vec<Vec<f32>> = all.chunks_exact(vocab).map(<[f32]>::to_vec).collect();
    let mut tokens = Vec::with_capacity(steps);
    for _ in 0..steps {
        let next = argmax(rows.last().expect("a prompt has logits"));
        tokens.push(next);
        rows.push(model.forward(&[next], &mut state, Logits::Last)?);
    }
    Ok((tokens, rows))
}

/// Runs the check for the checkpoint in `dir` on `prompts` (decoded together as one batch), `steps` tokens each.
pub fn teacher_forced(
    dir: &Path,
    prompts: &[Vec<u32>],
    steps: usize,
    opts: &GpuOptions,
    tolerance: f64,
) -> Result<TeacherForcedReport> {
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(EngineError::InvalidInput(
            "teacher forcing needs non-empty prompts".into(),
        ));
    }
    let cpu = Model::from_dir(dir)?;
    let vocab = cpu.config().vocab_size;
    let refs: Vec<(Vec<u32>, Vec<Vec<f32>>)> = prompts
        .iter()
        .map(|p| cpu_reference(&cpu, p, steps))
        .collect::<Result<_>>()?;
    drop(cpu);
    let mut gpu = GpuModel::load(dir, opts)?;
    let mut got: Vec<Vec<Vec<f32>>> = Vec::with_capacity(prompts.len());
    let mut seqs = Vec::with_capacity(prompts.len());
    for p in prompts {
        let seq = gpu.open()?;
        let all = gpu.prefill(seq, p, Logits::All)?;
        got.push(all.chunks_exact(vocab).map(<[f32]>::to_vec).collect());
        seqs.push(seq);
    }
    for step in 0..steps {
        let batch: Vec<(usize, u32)> = seqs.iter().zip(&refs).map(|(&s, (toks, _))| (s, toks[step])).collect();
        let logits = gpu.decode(&batch)?;
        for (i, row) in logits.chunks_exact(vocab).enumerate() {
            got[i].push(row.to_vec());
        }
    }
    let (mut worst, mut positions, mut checked, mut mismatches) = (0.0f64, 0, 0, 0);
    let mut per_position = Vec::with_capacity(refs.len());
    for ((_, want), have) in refs.iter().zip(&got) {
        let mut errs = Vec::with_capacity(want.len());
        for (w, h) in want.iter().zip(have) {
            positions += 1;
            let e = rel(h, w);
            errs.push(e);
            worst = if e.is_nan() || e > worst { e } else { worst };
            let (top, second) = top_two(w);
            let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            if f64::from(top - second) > tolerance * f64::from(scale) {
                checked += 1;
                if argmax(h) != argmax(w) {
                    mismatches += 1;
                }
            }
        }
        per_position.push(errs);
    }
    let tp = gpu.tp();
    Ok(TeacherForcedReport {
        sequences: prompts.len(),
        positions,
        worst_rel: worst,
        argmax_checked: checked,
        argmax_mismatches: mismatches,
        tolerance,
        tp,
        dtype: opts.dtype.to_string(),
        pass: worst <= tolerance && mismatches == 0,
        per_position,
    })
}
