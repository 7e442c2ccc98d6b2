//! One forward step of a rank over `rows` tokens: one sequence's prompt chunk (`seqs = 1`, `t = rows`), one token of
//! each of `rows` sequences (decode, `t = 1`), or `t` tokens of each of `seqs` sequences (verify). Everything stays on
//! the device; the caller uploads the step's metadata (tokens, slots, positions, lengths, block table and the replay
//! rows: each sequence's slot, ring position, fold and conv head) into the scratch first.
//!
//! The SSM layers run either the chunked scan into one slot's checkpoint (a prompt chunk in the recurrent or replay
//! form) or the replay kernels over every row at once, whatever its form: a recurrent row is a replay row with an
//! empty ring that folds its own entry, a kv-only row reads no checkpoint.
//!
//! Per block: `h = rms_norm(x += y_prev)`, the mixer writes its (partial) output `y` in f32, and with tensor
//! parallelism `y` is all-reduced. The residual stream stays f32; activations and weights are bf16 with f32
//! accumulation; SSM states are f32.

use rewind_kernels::cpu::norm::GateOrder;
use rewind_kernels::cuda::ops::{self, ConvDims, ReplayShape, MAX_CHUNK, REPLAY_META};
use rewind_kernels::cuda::{Blas, CudaDevice, CudaSlice, DevicePtr, DevicePtrMut, Elem};

use super::ffn;
use super::layers::{GatedNorm, GpuAttention, GpuBlock, GpuGdn, GpuMamba2, GpuMixer};
use super::scratch::Scratch;
use super::state::LayerPool;
use super::weights::DeviceLinear;
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
}

impl Step {
    /// The replay launches: `(first replay row, first token row, sequences, tokens each)`.
    fn replay_launches(&self, piece: usize) -> Vec<(usize, usize, usize, usize)> {
        if self.seqs > 1 || self.t <= piece {
            return vec![(0, 0, self.seqs, self.t)];
        }
        (0..self.t.div_ceil(piece))
            .map(|p| (p, p * piece, 1, piece.min(self.t - p * piece)))
            .collect()
    }

    fn conv_append(&self) -> bool {
        matches!(self.ssm, SsmRun::Replay { prompt: false, .. } | SsmRun::Recurrent)
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
    A::gemm(blas, x, &l.w, out, rows, l.in_dim, l.out_dim)?;
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
/// block's output (not yet added).
pub(crate) fn blocks<A: Act>(
    cx: &mut Cx<A>,
    blocks: &[GpuBlock<A>],
    pools: &mut [LayerPool<A>],
    step: Step,
) -> Result<()> {
    let (rows, hid) = (step.rows, cx.hidden);
    for (i, (block, pool)) in blocks.iter().zip(pools.iter_mut()).enumerate() {
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
            ) => mamba2(
                cx,
                m,
                conv,
                SsmPools {
                    ssm,
                    ring_a,
                    ring_f,
                    ring_b,
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
            ) => gdn(
                cx,
                m,
                conv,
                SsmPools {
                    ssm,
                    ring_a,
                    ring_f,
                    ring_b,
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
    }
    Ok(())
}

/// The SSM mixers' shared front: `proj = h · in_projᵀ` into `s.proj`, the conv channels (`conv_idx`) gathered out of
/// it and run through the causal conv with SiLU over the step's slots (advancing their conv state), leaving
/// `[rows, conv channels]` in `s.b`.
#[allow(clippy::too_many_arguments)]
fn project_and_conv<A: Act>(
    cx: &mut Cx<A>,
    in_proj: &DeviceLinear<A>,
    conv_idx: &CudaSlice<i32>,
    conv_w: &CudaSlice<A>,
    conv_b: Option<&CudaSlice<A>>,
    kernel: usize,
    conv: &mut CudaSlice<A>,
    step: Step,
) -> Result<()> {
    let (dev, rows, hid) = (cx.dev, step.rows, cx.hidden);
    let s = &mut *cx.s;
    let (cd, wp) = (conv_idx.len(), in_proj.out_dim);
    let mut proj = s.proj.slice_mut(..rows * wp);
    lin(cx.blas, dev, &s.h.slice(..rows * hid), in_proj, &mut proj, rows)?;
    ops::gather_cols(dev, &proj, rows, wp, conv_idx, &mut s.a.slice_mut(..rows * cd))?;
    let dims = ConvDims {
        batch: step.seqs,
        seq: step.t,
        channels: cd,
        k: kernel,
        slots: cx.max_seqs,
        capacity: step.conv_rows,
        append: step.conv_append(),
    };
    // A prompt in pieces has one replay row per piece, all naming its slot and conv head: row 0 serves the conv.
    ops::causal_conv1d(
        dev,
        dims,
        &s.a.slice(..rows * cd),
        conv_w,
        conv_b,
        conv,
        &s.meta.slice(..step.seqs * REPLAY_META),
        true,
        &mut s.b.slice_mut(..rows * cd),
    )
    .map_err(Into::into)
}

/// One SSM layer's checkpoint and input-ring pools.
pub(crate) struct SsmPools<'a, A: Act> {
    ssm: &'a mut CudaSlice<f32>,
    ring_a: &'a mut CudaSlice<A>,
    ring_f: &'a mut CudaSlice<f32>,
    ring_b: &'a mut CudaSlice<A>,
}

fn mamba2<A: Act>(
    cx: &mut Cx<A>,
    m: &GpuMamba2<A>,
    conv: &mut CudaSlice<A>,
    pools: SsmPools<'_, A>,
    step: Step,
) -> Result<()> {
    project_and_conv(
        cx,
        &m.in_proj,
        &m.xbc_idx,
        &m.conv_w,
        m.conv_b.as_ref(),
        m.spec.conv_kernel,
        conv,
        step,
    )?;
    let (dev, rows, hid) = (cx.dev, step.rows, cx.hidden);
    let s = &mut *cx.s;
    let d = m.dims;
    let di = d.heads * d.head_dim;
    let (cd, wp) = (m.conv_dim, m.in_proj.out_dim);
    let bc = d.groups * d.state_dim;
    let proj = s.proj.slice(..rows * wp);
    let conv_out = s.b.slice(..rows * cd);
    ops::gather_cols(dev, &conv_out, rows, cd, &m.x_idx, &mut s.c.slice_mut(..rows * di))?;
    ops::gather_cols(dev, &conv_out, rows, cd, &m.b_idx, &mut s.d.slice_mut(..rows * bc))?;
    ops::gather_cols(dev, &conv_out, rows, cd, &m.c_idx, &mut s.e.slice_mut(..rows * bc))?;
    let (lo, hi) = if step.clamp {
        m.spec.time_step_limit
    } else {
        (f32::NEG_INFINITY, f32::INFINITY)
    };
    ops::dt_softplus(
        dev,
        &proj,
        rows,
        wp,
        di + cd,
        &m.dt_bias,
        lo,
        hi,
        &mut s.f0.slice_mut(..rows * d.heads),
    )?;
    let state_len = d.heads * d.head_dim * d.state_dim;
    let SsmPools {
        ssm,
        ring_a,
        ring_f,
        ring_b,
    } = pools;
    match step.ssm {
        SsmRun::Chunked { slot } => ops::mamba2_chunked(
            dev,
            d,
            rows,
            m.spec.chunk_size.min(MAX_CHUNK),
            &mut ssm.slice_mut(slot * state_len..(slot + 1) * state_len),
            &s.c.slice(..rows * di),
            &s.f0.slice(..rows * d.heads),
            &m.a,
            &s.d.slice(..rows * bc),
            &s.e.slice(..rows * bc),
            &m.d_skip,
            &mut s.g.slice_mut(..rows * di),
            &mut s.ws,
        )?,
        SsmRun::Recurrent => ops::mamba2_step(
            dev,
            d,
            ssm,
            &s.seq_slots.slice(..step.seqs),
            &s.c.slice(..rows * di),
            &s.f0.slice(..rows * d.heads),
            &m.a,
            &s.d.slice(..rows * bc),
            &s.e.slice(..rows * bc),
            &m.d_skip,
            &mut s.g.slice_mut(..rows * di),
        )?,
        SsmRun::Replay { max_m, piece, .. } => {
            for (m0, r0, batch, t) in step.replay_launches(piece) {
                let (r1, shape) = (
                    r0 + batch * t,
                    ReplayShape {
                        batch,
                        t,
                        ring_rows: step.ring_rows,
                        max_m,
                    },
                );
                ops::mamba2_replay(
                    dev,
                    d,
                    shape,
                    ssm,
                    ring_a,
                    ring_f,
                    ring_b,
                    &s.meta.slice(m0 * REPLAY_META..(m0 + batch) * REPLAY_META),
                    &s.c.slice(r0 * di..r1 * di),
                    &s.f0.slice(r0 * d.heads..r1 * d.heads),
                    &m.a,
                    &s.d.slice(r0 * bc..r1 * bc),
                    &s.e.slice(r0 * bc..r1 * bc),
                    &m.d_skip,
                    &mut s.g.slice_mut(r0 * di..r1 * di),
                )?;
            }
        }
    }
    ops::gather_cols(dev, &proj, rows, wp, &m.z_idx, &mut s.a.slice_mut(..rows * di))?;
    let (y, z) = (s.g.slice(..rows * di), s.a.slice(..rows * di));
    let mut normed = s.b.slice_mut(..rows * di);
    match m.norm {
        GatedNorm::Local { group } => ops::gated_rms_norm(
            dev,
            &y,
            &z,
            &m.norm_w,
            group,
            m.spec.norm_eps,
            GateOrder::BeforeNorm,
            &mut normed,
        )?,
        GatedNorm::Split {
            first_channel,
            group,
            groups,
            all_reduce: reduce,
        } => {
            let mut sums = s.f1.slice_mut(..rows * groups);
            ops::gated_sq_sums(dev, &y, &z, rows, first_channel, group, groups, &mut sums)?;
            if reduce {
                if let Some(c) = cx.comm {
                    c.all_reduce_f32(&mut sums)?;
                }
            }
            ops::gated_norm_apply(
                dev,
                &y,
                &z,
                &sums,
                &m.norm_w,
                rows,
                first_channel,
                group,
                groups,
                m.spec.norm_eps,
                &mut normed,
            )?;
        }
    }
    lin(
        cx.blas,
        dev,
        &normed,
        &m.out_proj,
        &mut s.y.slice_mut(..rows * hid),
        rows,
    )
}

fn gdn<A: Act>(
    cx: &mut Cx<A>,
    m: &GpuGdn<A>,
    conv: &mut CudaSlice<A>,
    pools: SsmPools<'_, A>,
    step: Step,
) -> Result<()> {
    project_and_conv(
        cx,
        &m.in_proj,
        &m.mixed_idx,
        &m.conv_w,
        None,
        m.spec.conv_kernel,
        conv,
        step,
    )?;
    let (dev, rows, hid) = (cx.dev, step.rows, cx.hidden);
    let s = &mut *cx.s;
    let d = m.dims;
    let (cd, wp) = (m.conv_dim, m.proj_dim);
    let (qk, vd) = (d.k_heads * d.k_dim, d.v_heads * d.v_dim);
    let proj = s.proj.slice(..rows * wp);
    let conv_out = s.b.slice(..rows * cd);
    // q, k: expanded to the virtual key heads, L2-normalised (q also scaled); v as is.
    ops::gather_cols(dev, &conv_out, rows, cd, &m.q_idx, &mut s.c.slice_mut(..rows * qk))?;
    ops::l2_norm(
        dev,
        &s.c.slice(..rows * qk),
        d.k_dim,
        1e-6,
        &mut s.d.slice_mut(..rows * qk),
    )?;
    ops::scale(
        dev,
        &mut s.d.slice_mut(..rows * qk),
        (1.0 / (d.k_dim as f64).sqrt()) as f32,
    )?;
    ops::gather_cols(dev, &conv_out, rows, cd, &m.k_idx, &mut s.c.slice_mut(..rows * qk))?;
    ops::l2_norm(
        dev,
        &s.c.slice(..rows * qk),
        d.k_dim,
        1e-6,
        &mut s.e.slice_mut(..rows * qk),
    )?;
    ops::gather_cols(dev, &conv_out, rows, cd, &m.v_idx, &mut s.c.slice_mut(..rows * vd))?;
    let nv = d.v_heads;
    ops::gdn_gates(
        dev,
        &proj,
        rows,
        wp,
        m.b_col,
        m.a_col,
        &m.dt_bias,
        &m.neg_a,
        &mut s.f0.slice_mut(..rows * nv),
        &mut s.f1.slice_mut(..rows * nv),
    )?;
    let SsmPools {
        ssm,
        ring_a,
        ring_f,
        ring_b,
    } = pools;
    match step.ssm {
        SsmRun::Chunked { slot } => ops::gdn_chunked(
            dev,
            d,
            rows,
            m.spec.chunk_size.min(MAX_CHUNK),
            &mut ssm.slice_mut(slot * d.state_len()..(slot + 1) * d.state_len()),
            &s.d.slice(..rows * qk),
            &s.e.slice(..rows * qk),
            &s.c.slice(..rows * vd),
            &s.f1.slice(..rows * nv),
            &s.f0.slice(..rows * nv),
            &mut s.g.slice_mut(..rows * vd),
            &mut s.ws,
        )?,
        SsmRun::Recurrent => ops::gdn_step(
            dev,
            d,
            ssm,
            &s.seq_slots.slice(..step.seqs),
            &s.d.slice(..rows * qk),
            &s.e.slice(..rows * qk),
            &s.c.slice(..rows * vd),
            &s.f1.slice(..rows * nv),
            &s.f0.slice(..rows * nv),
            &mut s.g.slice_mut(..rows * vd),
        )?,
        SsmRun::Replay { max_m, piece, .. } => {
            for (m0, r0, batch, t) in step.replay_launches(piece) {
                let (r1, shape) = (
                    r0 + batch * t,
                    ReplayShape {
                        batch,
                        t,
                        ring_rows: step.ring_rows,
                        max_m,
                    },
                );
                ops::gdn_replay(
                    dev,
                    d,
                    shape,
                    ssm,
                    ring_a,
                    ring_b,
                    ring_f,
                    &s.meta.slice(m0 * REPLAY_META..(m0 + batch) * REPLAY_META),
                    &s.d.slice(r0 * qk..r1 * qk),
                    &s.e.slice(r0 * qk..r1 * qk),
                    &s.c.slice(r0 * vd..r1 * vd),
                    &s.f1.slice(r0 * nv..r1 * nv),
                    &s.f0.slice(r0 * nv..r1 * nv),
                    &mut s.g.slice_mut(r0 * vd..r1 * vd),
                )?;
            }
        }
    }
    ops::gather_cols(dev, &proj, rows, wp, &m.z_idx, &mut s.a.slice_mut(..rows * vd))?;
    ops::gated_rms_norm(
        dev,
        &s.g.slice(..rows * vd),
        &s.a.slice(..rows * vd),
        &m.norm_w,
        d.v_dim,
        m.spec.norm_eps,
        GateOrder::AfterNorm,
        &mut s.b.slice_mut(..rows * vd),
    )?;
    lin(
        cx.blas,
        dev,
        &s.b.slice(..rows * vd),
        &m.out_proj,
        &mut s.y.slice_mut(..rows * hid),
        rows,
    )
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
        &s.table,
        k_pool,
        v_pool,
    )?;
    ops::paged_attention(
        dev,
        layout,
        h,
        step.t,
        &s.a.slice(..qn),
        k_pool,
        v_pool,
        &s.table,
        &s.lens,
        &s.seq_slots.slice(..step.seqs),
        sp.scale,
        &mut s.d.slice_mut(..qn),
    )?;
    if a.gate_idx.is_some() {
        ops::sigmoid_mul(dev, &mut s.d.slice_mut(..qn), &s.e.slice(..qn))?;
    }
    lin(
        cx.blas,
        dev,
        &s.d.slice(..qn),
        &a.o_proj,
        &mut s.y.slice_mut(..rows * hid),
        rows,
    )
}

/// Folds the committed ring entries of `batch` sequences into their checkpoints in every SSM layer (a flush, or a
/// kv-only ring's compress from a zero state): the replay kernels with no tokens, over the replay rows uploaded to
/// the scratch (`fold = h`). `max_m` is the largest `h`.
pub(crate) fn fold<A: Act>(
    dev: &CudaDevice,
    blocks: &[GpuBlock<A>],
    pools: &mut [LayerPool<A>],
    s: &mut Scratch<A>,
    batch: usize,
    max_m: usize,
    ring_rows: usize,
) -> Result<()> {
    let shape = ReplayShape {
        batch,
        t: 0,
        ring_rows,
        max_m,
    };
    let meta = s.meta.slice(..batch * REPLAY_META);
    for (block, pool) in blocks.iter().zip(pools.iter_mut()) {
        let LayerPool::Ssm {
            ssm,
            ring_a,
            ring_f,
            ring_b,
            ..
        } = pool
        else {
            continue;
        };
        match &block.mixer {
            GpuMixer::Mamba2(m) => ops::mamba2_replay(
                dev,
                m.dims,
                shape,
                ssm,
                ring_a,
                ring_f,
                ring_b,
                &meta,
                &s.c.slice(..0),
                &s.f0.slice(..0),
                &m.a,
                &s.d.slice(..0),
                &s.e.slice(..0),
                &m.d_skip,
                &mut s.g.slice_mut(..0),
            )?,
            GpuMixer::Gdn(m) => ops::gdn_replay(
                dev,
                m.dims,
                shape,
                ssm,
                ring_a,
                ring_b,
                ring_f,
                &meta,
                &s.d.slice(..0),
                &s.e.slice(..0),
                &s.c.slice(..0),
                &s.f1.slice(..0),
                &s.f0.slice(..0),
                &mut s.g.slice_mut(..0),
            )?,
            _ => return Err(EngineError::Gpu("an SSM pool beside a layer without one".into())),
        }
    }
    Ok(())
}
