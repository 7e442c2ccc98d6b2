//! One forward step of a rank over `rows` tokens: one sequence's prompt chunk (`seqs = 1`, `t = rows`), one token of
//! each of `rows` sequences (decode, `t = 1`), or `t` tokens of each of `seqs` sequences (verify). Everything stays on
//! the device; the caller uploads the step's metadata (tokens, slots, positions, lengths, block table and the replay
//! rows: each sequence's slot, ring position, fold and conv head) into the scratch first.
//!
//! The SSM layers run either the chunked scan into one slot's checkpoint (a prompt chunk in the recurrent or replay
//! form) or the replay kernels over every row at once, whatever its form: a recurrent row is a replay row with an
//! empty ring that folds its own entry, a kv-only row reads no checkpoint. Batches of recurrent rows alone take the
//! recurrent step kernels (decode) or the speculative baseline (verify: per-draft state snapshots, see [`SsmRun`]).
//!
//! Per block: `h = rms_norm(x += y_prev)`, the mixer writes its (partial) output `y` in f32, and with tensor
//! parallelism `y` is all-reduced. The residual stream stays f32; activations and weights are bf16 with f32
//! accumulation; SSM states are f32.

use rewind_kernels::cuda::ops;
use rewind_kernels::cuda::timing::StageMarks;
use rewind_kernels::cuda::{Blas, CudaDevice, CudaSlice, DevicePtr, DevicePtrMut, Elem};

use super::ffn;
use super::layers::{GpuAttention, GpuBlock, GpuMixer};
use super::scratch::Scratch;
use super::ssm_layers::{self, SsmPools};
use super::state::LayerPool;
use super::{Act, DeviceComm};
use crate::error::{EngineError, Result};

/// The shape of one step.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Step {
    /// Tokens in the step.
    pub(crate) rows: usize,
    /// Sequences in the step (1 for a prompt chunk).
    pub(crate) seqs: usize,
    /// Tokens per sequence (`rows / seqs`).
    pub(crate) t: usize,
    /// The reference's prompt numerics: prompts longer than one token clamp the Mamba-2 `dt`.
    pub(crate) clamp: bool,
    /// How the SSM layers run.
    pub(crate) ssm: SsmRun,
    /// Ring rows per slot in the pools, and the conv ring's rows per slot (`K − 1 + T`).
    pub(crate) ring_rows: usize,
    pub(crate) conv_rows: usize,
}

/// How a step's SSM layers run.
#[derive(Clone, Copy, Debug)]
pub(crate) enum SsmRun {
    /// A decode batch whose rows are all recurrent: the recurrent step kernels, which read and write each state once
    /// (the replay kernels serve mixed batches; for recurrent rows alone they are slower so far).
    Recurrent,
    /// A prompt chunk of one sequence: the chunked scan into slot `slot`'s checkpoint; the conv history is rewritten.
    Chunked { slot: usize },
    /// The replay kernels over the step's replay rows (uploaded), `t` tokens each. A prompt chunk of a kv-only
    /// sequence longer than `piece` runs in pieces of `piece` tokens, replay row `p` describing piece `p`. The conv
    /// rows are appended (decode, verify) or the history rewritten (`prompt`).
    Replay { max_m: usize, piece: usize, prompt: bool },
    /// A verify batch whose rows are all recurrent: the speculative baseline (ReplaySSM Alg. 3 / 7) runs the
    /// recurrence token by token from each slot's state, which it only reads, and writes the state after every token
    /// to the slot's snapshots; the commit (`gpu/steps.rs`) then copies snapshot `accepted − 1` into the state. The
    /// conv rows are appended, as for any verify.
    Baseline,
}

impl Step {
    /// The replay launches: `(first replay row, first token row, sequences, tokens each)`.
    pub(crate) fn replay_launches(&self, piece: usize) -> Vec<(usize, usize, usize, usize)> {
        if self.seqs > 1 || self.t <= piece {
            return vec![(0, 0, self.seqs, self.t)];
        }
        (0..self.t.div_ceil(piece))
            .map(|p| (p, p * piece, 1, piece.min(self.t - p * piece)))
            .collect()
    }

    pub(crate) fn conv_append(&self) -> bool {
        matches!(
            self.ssm,
            SsmRun::Replay { prompt: false, .. } | SsmRun::Recurrent | SsmRun::Baseline
        )
    }
}

/// What a forward needs besides the weights and pools.
pub(crate) struct Cx<'a, A: Act> {
    pub(crate) dev: &'a CudaDevice,
    pub(crate) blas: &'a Blas,
    pub(crate) s: &'a mut Scratch<A>,
    pub(crate) comm: Option<&'a dyn DeviceComm>,
    pub(crate) hidden: usize,
    pub(crate) max_seqs: usize,
    pub(crate) eps: f32,
    pub(crate) offset: f32,
    /// The stage profile's events (`GpuOptions::stage_profile`): one mark after each block, named by its mixer.
    pub(crate) marks: Option<&'a mut StageMarks>,
    /// The block table the attention layers read: the scratch's (`None`), or the MTP layer's own, which maps its
    /// draft rows past the target's blocks (`gpu/mtp.rs`).
    pub(crate) table: Option<&'a CudaSlice<i32>>,
}

/// `out = x · Wᵀ (+ b)`.
pub(super) fn lin<A: Act, O: Elem>(
    blas: &Blas,
    dev: &CudaDevice,
    x: &impl DevicePtr<A>,
    l: &super::weights::DeviceLinear<A>,
    out: &mut impl DevicePtrMut<O>,
    rows: usize,
) -> Result<()> {
    A::gemm(dev, blas, x, &l.w, out, rows, l.in_dim, l.out_dim)?;
    if let Some(b) = &l.b {
        ops::add_bias(dev, out, b)?;
    }
    Ok(())
}

fn all_reduce(comm: Option<&dyn DeviceComm>, buf: &mut CudaSlice<f32>, n: usize) -> Result<()> {
    if let Some(c) = comm {
        c.all_reduce_f32(&mut buf.slice_mut(..n))?;
    }
    Ok(())
}

/// Runs the blocks over the step: on return `x` holds the residual stream before the final norm and `y` the last
/// block's output (not yet added). `snapshots` holds each layer's baseline snapshot pool (`None` where there is
/// none: [`super::state::alloc_snapshots`]).
pub(crate) fn blocks<A: Act>(
    cx: &mut Cx<A>,
    blocks: &[GpuBlock<A>],
    pools: &mut [LayerPool<A>],
    snapshots: &mut [Option<CudaSlice<f32>>],
    step: Step,
) -> Result<()> {
    let (rows, hid) = (step.rows, cx.hidden);
    let layers = blocks.iter().zip(pools.iter_mut()).zip(snapshots.iter_mut());
    for (i, ((block, pool), snaps)) in layers.enumerate() {
        {
            let s = &mut *cx.s;
            let mut x = s.x.slice_mut(..rows * hid);
            let mut h = s.h.slice_mut(..rows * hid);
            if i == 0 {
                ops::add_rms_norm(
                    cx.dev,
                    &mut x,
                    None::<&CudaSlice<f32>>,
                    &block.norm,
                    cx.eps,
                    cx.offset,
                    &mut h,
                )?;
            } else {
                ops::add_rms_norm(
                    cx.dev,
                    &mut x,
                    Some(&s.y.slice(..rows * hid)),
                    &block.norm,
                    cx.eps,
                    cx.offset,
                    &mut h,
                )?;
            }
        }
        match (&block.mixer, pool) {
            (
                GpuMixer::Mamba2(m),
                LayerPool::Ssm {
                    conv,
                    ssm,
                    ring_a,
                    ring_f,
                    ring_b,
                },
            ) => ssm_layers::mamba2(
                cx,
                m,
                conv,
                SsmPools {
                    ssm,
                    ring_a,
                    ring_f,
                    ring_b,
                    snapshots: snaps.as_mut(),
                },
                step,
            )?,
            (
                GpuMixer::Gdn(m),
                LayerPool::Ssm {
                    conv,
                    ssm,
                    ring_a,
                    ring_f,
                    ring_b,
                },
            ) => ssm_layers::gdn(
                cx,
                m,
                conv,
                SsmPools {
                    ssm,
                    ring_a,
                    ring_f,
                    ring_b,
                    snapshots: snaps.as_mut(),
                },
                step,
            )?,
            (GpuMixer::Attention(a), LayerPool::Kv { k, v, layout }) => attention(cx, a, k, v, *layout, step)?,
            (GpuMixer::Mlp(m), LayerPool::None) => {
                let s = &mut *cx.s;
                ffn::mlp(cx.dev, cx.blas, m, s, rows, hid, false)?
            }
            (GpuMixer::Moe(m), LayerPool::None) => ffn::moe(cx, m, step)?,
            _ => return Err(EngineError::Gpu("a layer and its state pool disagree".into())),
        }
        all_reduce(cx.comm, &mut cx.s.y, rows * hid)?;
        if let Some(m) = cx.marks.as_deref_mut() {
            m.mark(cx.dev, mixer_stage(&block.mixer))?;
        }
    }
    Ok(())
}

/// The stage a block's end closes in the stage profile: its mixer's kind (the block's norm and all-reduce count with
/// it). SSM and attention blocks mark their own stages before: an SSM block (`ssm_layers.rs`) `in_proj` with the
/// block's norm, `conv` with the gathers, gates and norms of its inputs, `ssm` the scan or replay kernel; an attention
/// block `qkv` (norm, projections, q/k norms, rope, KV write) and `core` (paged attention and its gate). Their end
/// closes `out`: the (gated) norm, the output projection and the all-reduce.
fn mixer_stage<A: Act>(mixer: &GpuMixer<A>) -> &'static str {
    match mixer {
        GpuMixer::Mamba2(_) => "mamba2 out",
        GpuMixer::Gdn(_) => "gdn out",
        GpuMixer::Attention(_) => "attention out",
        GpuMixer::Mlp(_) => "mlp",
        GpuMixer::Moe(_) => "moe",
    }
}

/// Ends the stage named `label` when the stage profile runs (`GpuOptions::stage_profile`).
pub(crate) fn stage(marks: &mut Option<&mut StageMarks>, dev: &CudaDevice, label: &'static str) -> Result<()> {
    if let Some(m) = marks.as_deref_mut() {
        m.mark(dev, label)?;
    }
    Ok(())
}

fn attention<A: Act>(
    cx: &mut Cx<A>,
    a: &GpuAttention<A>,
    k_pool: &mut CudaSlice<A>,
    v_pool: &mut CudaSlice<A>,
    layout: ops::PagedKv,
    step: Step,
) -> Result<()> {
    let (dev, rows, hid) = (cx.dev, step.rows, cx.hidden);
    let s = &mut *cx.s;
    let table = match cx.table {
        Some(t) => t,
        None => &s.table,
    };
    let sp = &a.spec;
    let (h, kv, d) = (sp.heads, sp.kv_heads, sp.head_dim);
    let (qn, kn) = (rows * h * d, rows * kv * d);
    let hs = s.h.slice(..rows * hid);
    // q → a (gate → e), k → b, v → c.
    match &a.gate_idx {
        Some((qi, gi)) => {
            let w = a.q_proj.out_dim;
            lin(cx.blas, dev, &hs, &a.q_proj, &mut s.proj.slice_mut(..rows * w), rows)?;
            ops::gather_cols(dev, &s.proj.slice(..rows * w), rows, w, qi, &mut s.a.slice_mut(..qn))?;
            ops::gather_cols(dev, &s.proj.slice(..rows * w), rows, w, gi, &mut s.e.slice_mut(..qn))?;
        }
        None => lin(cx.blas, dev, &hs, &a.q_proj, &mut s.a.slice_mut(..qn), rows)?,
    }
    lin(cx.blas, dev, &hs, &a.k_proj, &mut s.b.slice_mut(..kn), rows)?;
    lin(cx.blas, dev, &hs, &a.v_proj, &mut s.c.slice_mut(..kn), rows)?;
    if let (Some(norm), Some((qw, kw))) = (&sp.qk_norm, &a.qk_norm) {
        ops::rms_norm(
            dev,
            &s.a.slice(..qn),
            qw,
            norm.eps,
            norm.offset,
            &mut s.d.slice_mut(..qn),
        )?;
        ops::rms_norm(
            dev,
            &s.b.slice(..kn),
            kw,
            norm.eps,
            norm.offset,
            &mut s.g.slice_mut(..kn),
        )?;
        dev.stream()
            .memcpy_dtod(&s.d.slice(..qn), &mut s.a.slice_mut(..qn))
            .map_err(|e| EngineError::Gpu(format!("copying normalised q: {e}")))?;
        dev.stream()
            .memcpy_dtod(&s.g.slice(..kn), &mut s.b.slice_mut(..kn))
            .map_err(|e| EngineError::Gpu(format!("copying normalised k: {e}")))?;
    }
    if let (Some(rope), Some(inv)) = (&sp.rope, &a.inv_freq) {
        let pos = s.row_pos.slice(..rows);
        ops::rope(dev, &mut s.a.slice_mut(..qn), &pos, inv, rows, h, d, rope.rotary_dim)?;
        ops::rope(dev, &mut s.b.slice_mut(..kn), &pos, inv, rows, kv, d, rope.rotary_dim)?;
    }
    ops::kv_write(
        dev,
        layout,
        &s.b.slice(..kn),
        &s.c.slice(..kn),
        &s.row_slots.slice(..rows),
        &s.row_pos.slice(..rows),
        table,
        k_pool,
        v_pool,
    )?;
    stage(&mut cx.marks, dev, "attention qkv")?;
    ops::paged_attention(
        dev,
        layout,
        h,
        step.t,
        &s.a.slice(..qn),
        k_pool,
        v_pool,
        table,
        &s.lens,
        &s.seq_slots.slice(..step.seqs),
        sp.scale,
        &mut s.d.slice_mut(..qn),
        Some(&mut s.attention_ws),
    )?;
    if a.gate_idx.is_some() {
        ops::sigmoid_mul(dev, &mut s.d.slice_mut(..qn), &s.e.slice(..qn))?;
    }
    stage(&mut cx.marks, dev, "attention core")?;
    lin(
        cx.blas,
        dev,
        &s.d.slice(..qn),
        &a.o_proj,
        &mut s.y.slice_mut(..rows * hid),
        rows,
    )
}
