//! The model-level GPU check: teacher-forced logits against the CPU f32 reference.
//!
//! The CPU model generates greedily from each prompt, recording its logits at every position; the GPU then runs the
//! same prompt (prefill, in chunks) and is fed the CPU's tokens one step at a time (decode, all sequences in one
//! batch), so both see identical inputs however their argmaxes differ. Per position the error is
//! `max|Δlogit| / max|logit_cpu|`; the GPU's argmax must equal the CPU's wherever the CPU's top-two margin exceeds the
//! tolerance (relative to the same scale).
//!
//! The first sequence is also snapshotted after its prompt and restored into another slot, which decodes beside it in
//! the same batches: a restore must continue exactly ([`SNAPSHOT_TOLERANCE`]; at more than two ranks within the
//! all-reduce's rounding, [`snapshot_tolerance`]).
//!
//! The reference is the model the GPU actually serves: the checkpoint's weights rounded the way the GPU stores them
//! ([`GpuRounded`]: with `--dtype bf16` every weight rounded to bf16 but the f32 per-head parameters, biases and
//! routers), computed in f32 on the CPU; with `--dtype f32` the checkpoint as it is. For a bf16 checkpoint that is the checkpoint itself; the f32
//! fixtures of F1, with random weights and tiny widths, move by 2e-2 to 1.0 relative from that rounding alone
//! (`cargo run --release -p rewind-engine --example bf16_sensitivity`), so the report also gives the distance to the
//! unrounded f32 model as information.

use std::path::Path;

use serde::Serialize;

use half::bf16;

use super::{gpu_group, GpuDtype, GpuOptions};
use crate::checkpoint::SafetensorsSource;
use crate::decode::{Decoder, DecoderConfig, FormChoice};
use crate::error::{EngineError, Result};
use crate::model::tensors::TensorSource;
use crate::model::ModelConfig;
use crate::rank::{Batch, GraphStats, Program, Rows, SeqKind, SeqStep, StepPlan};
use crate::sample::argmax;
use crate::shard::ShardedModel;
use rewind_kernels::cuda::parity::worse;

/// How far a sequence restored from a snapshot may drift from the original decoded in the same batch: rows of one
/// batch go through the same kernels, so only a lost or altered state bit would show.
pub const SNAPSHOT_TOLERANCE: f64 = 1e-6;

/// The restored copy's bound at `tp` ranks storing `dtype`. Up to two ranks every row's all-reduce is one addition
/// (`a + b == b + a` exactly), so the copy stays within [`SNAPSHOT_TOLERANCE`]. With more, NCCL's ring starts each
/// chunk of the buffer at a different rank, so rows at different offsets are summed in different orders: the copy then
/// differs by that rounding, ≈ 1e-6 of the logits in f32 and ≈ 1e-3 in bf16 (measured at TP 4 on 4 × H200,
/// `bench/results/gpu-multi-gpu-2026-11-26.md`); the bound keeps an order of magnitude above that and well below the
/// form's own tolerance, so a lost or altered state row still shows.
pub fn snapshot_tolerance(tp: usize, dtype: GpuDtype) -> f64 {
    match (tp <= 2, dtype) {
        (true, _) => SNAPSHOT_TOLERANCE,
        (false, GpuDtype::F32) => 1e-5,
        (false, GpuDtype::Bf16) => 1e-2,
    }
}

/// How the GPU stores a checkpoint tensor (mirrors `gpu::layers`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    /// Kept in f32: `A_log`, `dt_bias`, `D`, GEMM biases, MoE routers and their correction bias.
    F32,
    /// In the storage type (bf16 or f32, `--dtype`): everything else.
    Stored,
}

/// The storage class of tensor `name`.
pub fn stored_as(name: &str) -> Stored {
    let router = name.ends_with(".gate.weight") && !name.contains("shared_expert_gate");
    let gemm_bias = name.ends_with(".bias") && !name.contains("conv1d");
    if name.ends_with("A_log")
        || name.ends_with("dt_bias")
        || name.ends_with(".D")
        || name.ends_with("e_score_correction_bias")
        || router
        || gemm_bias
    {
        Stored::F32
    } else {
        Stored::Stored
    }
}

/// A tensor source whose values are rounded as the GPU with activation type `dtype` stores them.
pub struct GpuRounded<'a> {
    pub inner: &'a mut dyn TensorSource,
    pub dtype: GpuDtype,
}

impl TensorSource for GpuRounded<'_> {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let v = self.inner.take(name, shape)?;
        let round = self.dtype == GpuDtype::Bf16 && stored_as(name) != Stored::F32;
        Ok(if round {
            v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect()
        } else {
            v
        })
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        self.inner.shape_of(name)
    }

    fn finish(&mut self, keep_prefixes: &[&str], ignore_prefixes: &[&str]) -> Result<()> {
        self.inner.finish(keep_prefixes, ignore_prefixes)
    }
}

/// The outcome for one model.
#[derive(Clone, Debug, Serialize)]
pub struct TeacherForcedReport {
    /// Sequences checked together (one decode batch).
    pub sequences: usize,
    /// Positions compared over all sequences (prompt positions and decode steps).
    pub positions: usize,
    /// Worst `max|Δ| / max|cpu|` over the positions, against the CPU running the weights the GPU stores.
    pub worst_rel: f64,
    /// The same against the CPU running the checkpoint's unrounded weights (information: what weight rounding moves).
    pub worst_rel_unrounded: f64,
    /// Positions whose CPU top-two margin exceeds the tolerance, and how many of them the GPU's argmax missed.
    pub argmax_checked: usize,
    pub argmax_mismatches: usize,
    pub tolerance: f64,
    pub tp: usize,
    /// The first sequence snapshotted after its prompt and restored into another slot, both decoded in the same
    /// batches: the worst `max|Δ| / max|original|` between their logits (a restore must continue exactly).
    pub snapshot_rel: f64,
    /// The decode steps' final hidden rows (`Batch::hidden`, what MTP drafts from) through the CPU's final norm and
    /// head, against the GPU's own logits of the same rows: the worst relative error (the hidden rows must be the
    /// residual stream the GPU's head read).
    pub hidden_rel: f64,
    /// Activation storage type on the GPU.
    pub dtype: String,
    /// The GPU's decode form.
    pub form: String,
    /// The first rank's CUDA-graph counters after the check: with graphs on, the decode steps must have replayed.
    pub graphs: Option<GraphStats>,
    pub pass: bool,
    /// Per sequence: the error at each position (prompt positions first, then decode steps).
    pub per_position: Vec<Vec<f64>>,
}

pub(super) fn rel(gpu: &[f32], cpu: &[f32]) -> f64 {
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

/// Per prompt: the tokens fed after it and the logits at every position.
type Teacher = Vec<(Vec<u32>, Vec<Vec<f32>>)>;

/// The CPU's logits per position (`[prompt + steps]` rows) for `prompt` followed by `steps` tokens: the `forced` ones
/// when given, else its own greedy picks, which are returned. The CPU engine at TP = 1 in the recurrent form.
pub(super) fn cpu_rows(
    model: ShardedModel,
    prompts: &[Vec<u32>],
    steps: usize,
    forced: Option<&[Vec<u32>]>,
) -> Result<Teacher> {
    let vocab = model.config().vocab_size;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) + steps;
    let mut dec = Decoder::single(model, DecoderConfig::new(1, longest))?;
    let mut out = Vec::with_capacity(prompts.len());
    for (p, prompt) in prompts.iter().enumerate() {
        let slot = dec.start(FormChoice::Recurrent)?;
        let all = dec.prefill(slot, prompt, Rows::All)?;
        let mut rows: Vec<Vec<f32>> = all.chunks_exact(vocab).map(<[f32]>::to_vec).collect();
        let mut tokens = Vec::with_capacity(steps);
        for i in 0..steps {
            let next = match forced {
                Some(f) => f[p][i],
                None => argmax(rows.last().expect("a prompt has logits")),
            };
            tokens.push(next);
            rows.push(dec.decode(&[(slot, next)])?);
        }
        dec.release(slot)?;
        out.push((tokens, rows));
    }
    Ok(out)
}

/// Runs the check for the checkpoint in `dir` on `prompts` (decoded together as one batch), `steps` tokens each, the
/// GPU decoding in `form` (the CPU reference is always the recurrent form).
pub fn teacher_forced(
    dir: &Path,
    prompts: &[Vec<u32>],
    steps: usize,
    opts: &GpuOptions,
    form: FormChoice,
    tolerance: f64,
) -> Result<TeacherForcedReport> {
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(EngineError::InvalidInput(
            "teacher forcing needs non-empty prompts".into(),
        ));
    }
    let config = ModelConfig::from_dir(dir)?;
    let vocab = config.vocab_size;
    // The CPU model of the weights the GPU stores (loaded twice: the reference decoder takes one).
    let rounded_model = || -> Result<ShardedModel> {
        let mut src = SafetensorsSource::open(dir)?;
        let mut rounded = GpuRounded {
            inner: &mut src,
            dtype: opts.dtype,
        };
        ShardedModel::load(config.clone(), 1, 0, &mut rounded)
    };
    let refs = cpu_rows(rounded_model()?, prompts, steps, None)?;
    let cpu = rounded_model()?;
    // The unrounded model, teacher-forced with the same tokens.
    let forced: Vec<Vec<u32>> = refs.iter().map(|(t, _)| t.clone()).collect();
    let unrounded: Vec<Vec<Vec<f32>>> = cpu_rows(ShardedModel::from_dir(dir, 1, 0)?, prompts, steps, Some(&forced))?
        .into_iter()
        .map(|(_, rows)| rows)
        .collect();
    let (mut gpu, _) = gpu_group(dir, opts)?;
    let mut got: Vec<Vec<Vec<f32>>> = Vec::with_capacity(prompts.len());
    let mut seqs = Vec::with_capacity(prompts.len());
    for p in prompts {
        let slot = gpu.open(form)?;
        let out = gpu.step(StepPlan {
            commits: Vec::new(),
            program: Program::Batch(Batch {
                seqs: vec![SeqStep {
                    slot,
                    kind: SeqKind::Prefill,
                    position: 0,
                    tokens: p.clone(),
                    form,
                    rows: Rows::All,
                    sample: None,
                    spec: None,
                    logprobs: None,
                }],
                full_logits: true,
                hidden: false,
                mtp: Vec::new(),
            }),
        })?;
        let all = out.logits.unwrap_or_default();
        got.push(all.chunks_exact(vocab).map(<[f32]>::to_vec).collect());
        seqs.push((slot, p.len()));
    }
    // A copy of the first sequence, restored from its snapshot, decodes beside it with the same tokens.
    let snap = gpu.snapshot(seqs[0].0)?;
    let copy = gpu.restore(&snap)?;
    let mut copy_rel = 0.0f64;
    let mut hidden_rel = 0.0f64;
    for step in 0..steps {
        let plan = StepPlan {
            commits: Vec::new(),
            program: Program::Batch(Batch {
                seqs: seqs
                    .iter()
                    .chain(std::iter::once(&(copy, seqs[0].1)))
                    .zip(refs.iter().chain(std::iter::once(&refs[0])))
                    .map(|(&(slot, len), (toks, _))| SeqStep {
                        slot,
                        kind: SeqKind::Decode,
                        position: len + step,
                        tokens: vec![toks[step]],
                        form,
                        rows: Rows::Last,
                        sample: None,
                        spec: None,
                        logprobs: None,
                    })
                    .collect(),
                full_logits: true,
                hidden: true,
                mtp: Vec::new(),
            }),
        };
        let out = gpu.step(plan)?;
        let logits = out.logits.unwrap_or_default();
        let hidden = out.hidden.unwrap_or_default();
        // The CPU head over the GPU's hidden rows must give the GPU's logits (to the GPU's activation precision).
        let from_hidden = cpu.head(&hidden);
        if from_hidden.len() != logits.len() {
            hidden_rel = f64::INFINITY;
        }
        for (a, b) in from_hidden.chunks_exact(vocab).zip(logits.chunks_exact(vocab)) {
            hidden_rel = worse(hidden_rel, rel(b, a));
        }
        let rows: Vec<&[f32]> = logits.chunks_exact(vocab).collect();
        for (i, row) in rows.iter().take(seqs.len()).enumerate() {
            got[i].push(row.to_vec());
        }
        copy_rel = worse(copy_rel, rel(rows[seqs.len()], rows[0]));
    }
    let (mut worst, mut positions, mut checked, mut mismatches) = (0.0f64, 0, 0, 0);
    let mut per_position = Vec::with_capacity(refs.len());
    let worst_unrounded = unrounded
        .iter()
        .zip(&got)
        .flat_map(|(u, have)| u.iter().zip(have).map(|(w, h)| rel(h, w)))
        .fold(0.0f64, worse);
    for ((_, want), have) in refs.iter().zip(&got) {
        let mut errs = Vec::with_capacity(want.len());
        for (w, h) in want.iter().zip(have) {
            positions += 1;
            let e = rel(h, w);
            errs.push(e);
            worst = worse(worst, e);
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
    let graphs = gpu.health()?.first().and_then(|h| h.graphs);
    // Graphs on (and not switched off by REWIND_CUDA_SYNC): the repeated decode shapes must have replayed.
    let graphs_ok = !opts.cuda_graphs || steps < 3 || graphs.is_some_and(|g| !g.enabled || g.replayed > 0);
    Ok(TeacherForcedReport {
        sequences: prompts.len(),
        positions,
        worst_rel: worst,
        worst_rel_unrounded: worst_unrounded,
        argmax_checked: checked,
        argmax_mismatches: mismatches,
        tolerance,
        tp,
        snapshot_rel: copy_rel,
        hidden_rel,
        dtype: opts.dtype.to_string(),
        form: form.name().to_string(),
        graphs,
        pass: worst <= tolerance
            && mismatches == 0
            && copy_rel <= snapshot_tolerance(tp, opts.dtype)
            && hidden_rel <= tolerance
            && graphs_ok,
        per_position,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_classes_follow_the_gpu_layers() {
        for (name, want) in [
            ("backbone.layers.0.mixer.A_log", Stored::F32),
            ("backbone.layers.0.mixer.D", Stored::F32),
            ("backbone.layers.0.mixer.dt_bias", Stored::F32),
            ("backbone.layers.1.mixer.gate.weight", Stored::F32),
            ("backbone.layers.1.mixer.gate.e_score_correction_bias", Stored::F32),
            ("model.layers.2.mlp.gate.weight", Stored::F32),
            ("model.layers.2.self_attn.q_proj.bias", Stored::F32),
            ("backbone.layers.0.mixer.conv1d.weight", Stored::Stored),
            ("backbone.layers.0.mixer.conv1d.bias", Stored::Stored),
            ("backbone.layers.0.mixer.norm.weight", Stored::Stored),
            ("model.layers.3.self_attn.q_norm.weight", Stored::Stored),
            ("backbone.norm_f.weight", Stored::Stored),
            ("model.layers.0.input_layernorm.weight", Stored::Stored),
            ("model.layers.2.mlp.shared_expert_gate.weight", Stored::Stored),
            ("model.layers.2.mlp.gate_proj.weight", Stored::Stored),
            ("model.layers.0.linear_attn.in_proj_qkvz.weight", Stored::Stored),
            ("backbone.embeddings.weight", Stored::Stored),
            ("lm_head.weight", Stored::Stored),
        ] {
            assert_eq!(stored_as(name), want, "{name}");
        }
    }

    #[test]
    fn restored_copies_are_exact_up_to_two_ranks_only() {
        for dtype in [GpuDtype::F32, GpuDtype::Bf16] {
            assert_eq!(snapshot_tolerance(1, dtype), SNAPSHOT_TOLERANCE);
            assert_eq!(snapshot_tolerance(2, dtype), SNAPSHOT_TOLERANCE);
        }
        // Above two ranks: looser than exact, still far inside each dtype's logits bound.
        assert!(snapshot_tolerance(4, GpuDtype::F32) > SNAPSHOT_TOLERANCE);
        assert!(snapshot_tolerance(4, GpuDtype::F32) < 1e-4);
        assert!(snapshot_tolerance(4, GpuDtype::Bf16) < 2e-2);
    }
}
