//! The SSM mixers of a forward step (`gpu/forward.rs`): the projection and conv front, the scan in the form the step
//! asks for (chunked scan, recurrent step kernels, or the replay kernels over every row), the gated norm and the output
//! projection; and the fold pass that runs before a step for sequences whose rings must first go into their
//! checkpoints.

use rewind_kernels::cpu::norm::GateOrder;
use rewind_kernels::cuda::ops::{self, ConvDims, ReplayShape, MAX_CHUNK, REPLAY_META, SPEC_COMMIT_META};
use rewind_kernels::cuda::{CudaDevice, CudaSlice};

use super::forward::{lin, stage, Cx, SsmRun, Step};
use super::layers::{GatedNorm, GpuBlock, GpuGdn, GpuMamba2, GpuMixer};
use super::scratch::Scratch;
use super::state::LayerPool;
use super::weights::{Cols, DeviceLinear};
use super::Act;
use crate::error::{EngineError, Result};

/// The SSM mixers' shared front: `proj = h · in_projᵀ` into `s.proj`, the conv channels (`conv_cols`; read in place
/// when they are a range, else gathered into `s.a` first) run through the causal conv with SiLU over the step's slots
/// (advancing their conv state), leaving `[rows, conv channels]` in `s.b`.
#[allow(clippy::too_many_arguments)]
fn project_and_conv<A: Act>(
    cx: &mut Cx<A>,
    in_proj: &DeviceLinear<A>,
    conv_cols: &Cols,
    conv_w: &CudaSlice<A>,
    conv_b: Option<&CudaSlice<A>>,
    kernel: usize,
    conv: &mut CudaSlice<A>,
    step: Step,
    proj_stage: &'static str,
) -> Result<()> {
    let (dev, rows, hid) = (cx.dev, step.rows, cx.hidden);
    let s = &mut *cx.s;
    let (cd, wp) = (conv_cols.len(), in_proj.out_dim);
    let mut proj = s.proj.slice_mut(..rows * wp);
    lin(cx.blas, dev, &s.h.slice(..rows * hid), in_proj, &mut proj, rows)?;
    stage(&mut cx.marks, dev, proj_stage)?;
    let (x, x_stride) = conv_cols.strided(dev, &s.proj, rows, wp, &mut s.a)?;
    let dims = ConvDims {
        batch: step.seqs,
        seq: step.t,
        channels: cd,
        x_stride,
        k: kernel,
        slots: cx.max_seqs,
        capacity: step.conv_rows,
        append: step.conv_append(),
    };
    // A prompt in pieces has one replay row per piece, all naming its slot and conv head: row 0 serves the conv.
    ops::causal_conv1d(
        dev,
        dims,
        &x,
        conv_w,
        conv_b,
        conv,
        &s.meta.slice(..step.seqs * REPLAY_META),
        true,
        &mut s.b.slice_mut(..rows * cd),
    )
    .map_err(Into::into)
}

/// One SSM layer's checkpoint and input-ring pools, and its baseline snapshots when the rank keeps them.
pub(crate) struct SsmPools<'a, A: Act> {
    pub(crate) ssm: &'a mut CudaSlice<f32>,
    pub(crate) ring_a: &'a mut CudaSlice<A>,
    pub(crate) ring_f: &'a mut CudaSlice<f32>,
    pub(crate) ring_b: &'a mut CudaSlice<A>,
    pub(crate) snapshots: Option<&'a mut CudaSlice<f32>>,
}

/// The layer's snapshot pool, for a baseline verify; the steps refuse a recurrent verify on a rank without them, so
/// this error means a step slipped past that check.
fn snapshot_pool(snapshots: Option<&mut CudaSlice<f32>>) -> Result<&mut CudaSlice<f32>> {
    snapshots.ok_or_else(|| EngineError::Gpu("a recurrent verify on an SSM layer without snapshots".into()))
}

pub(crate) fn mamba2<A: Act>(
    cx: &mut Cx<A>,
    m: &GpuMamba2<A>,
    conv: &mut CudaSlice<A>,
    pools: SsmPools<'_, A>,
    step: Step,
) -> Result<()> {
    project_and_conv(
        cx,
        &m.in_proj,
        &m.xbc_cols,
        &m.conv_w,
        m.conv_b.as_ref(),
        m.spec.conv_kernel,
        conv,
        step,
        "mamba2 in_proj",
    )?;
    let (dev, rows, hid) = (cx.dev, step.rows, cx.hidden);
    let s = &mut *cx.s;
    let d = m.dims;
    let di = d.heads * d.head_dim;
    let (cd, wp) = (m.conv_dim, m.in_proj.out_dim);
    let bc = d.groups * d.state_dim;
    let proj = s.proj.slice(..rows * wp);
    let conv_out = s.b.slice(..rows * cd);
    m.x_cols
        .gather(dev, &conv_out, rows, cd, &mut s.c.slice_mut(..rows * di))?;
    m.b_cols
        .gather(dev, &conv_out, rows, cd, &mut s.d.slice_mut(..rows * bc))?;
    m.c_cols
        .gather(dev, &conv_out, rows, cd, &mut s.e.slice_mut(..rows * bc))?;
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
    stage(&mut cx.marks, dev, "mamba2 conv")?;
    let state_len = d.heads * d.head_dim * d.state_dim;
    let SsmPools {
        ssm,
        ring_a,
        ring_f,
        ring_b,
        snapshots,
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
        SsmRun::Baseline => ops::mamba2_spec_verify(
            dev,
            d,
            step.t,
            ssm,
            snapshot_pool(snapshots)?,
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
    stage(&mut cx.marks, dev, "mamba2 ssm")?;
    let y = s.g.slice(..rows * di);
    let mut normed = s.b.slice_mut(..rows * di);
    match m.norm {
        GatedNorm::Local { group } => {
            let (z, z_stride) = m.z_cols.strided(dev, &s.proj, rows, wp, &mut s.a)?;
            ops::gated_rms_norm(
                dev,
                &y,
                &z,
                z_stride,
                &m.norm_w,
                group,
                m.spec.norm_eps,
                GateOrder::BeforeNorm,
                &mut normed,
            )?
        }
        GatedNorm::Split {
            first_channel,
            group,
            groups,
            all_reduce: reduce,
        } => {
            m.z_cols.gather(dev, &proj, rows, wp, &mut s.a.slice_mut(..rows * di))?;
            let z = s.a.slice(..rows * di);
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

pub(crate) fn gdn<A: Act>(
    cx: &mut Cx<A>,
    m: &GpuGdn<A>,
    conv: &mut CudaSlice<A>,
    pools: SsmPools<'_, A>,
    step: Step,
) -> Result<()> {
    project_and_conv(
        cx,
        &m.in_proj,
        &m.mixed_cols,
        &m.conv_w,
        None,
        m.spec.conv_kernel,
        conv,
        step,
        "gdn in_proj",
    )?;
    let (dev, rows, hid) = (cx.dev, step.rows, cx.hidden);
    let s = &mut *cx.s;
    let d = m.dims;
    let (cd, wp) = (m.conv_dim, m.proj_dim);
    let (qk, vd) = (d.k_heads * d.k_dim, d.v_heads * d.v_dim);
    let proj = s.proj.slice(..rows * wp);
    let conv_out = s.b.slice(..rows * cd);
    // q, k: expanded to the virtual key heads, L2-normalised (q also scaled), read in place out of the conv output
    // when they are ranges; v as is.
    let q_scale = (1.0 / (d.k_dim as f64).sqrt()) as f32;
    for (cols, scale, out) in [(&m.q_cols, q_scale, &mut s.d), (&m.k_cols, 1.0, &mut s.e)] {
        let (src, stride) = cols.strided(dev, &s.b, rows, cd, &mut s.c)?;
        let mut out = out.slice_mut(..rows * qk);
        ops::l2_norm(dev, &src, rows, d.k_heads, d.k_dim, stride, 1e-6, scale, &mut out)?;
    }
    m.v_cols
        .gather(dev, &conv_out, rows, cd, &mut s.c.slice_mut(..rows * vd))?;
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
    stage(&mut cx.marks, dev, "gdn conv")?;
    let SsmPools {
        ssm,
        ring_a,
        ring_f,
        ring_b,
        snapshots,
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
        SsmRun::Baseline => ops::gdn_spec_verify(
            dev,
            d,
            step.t,
            ssm,
            snapshot_pool(snapshots)?,
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
    stage(&mut cx.marks, dev, "gdn ssm")?;
    let (z, z_stride) = m.z_cols.strided(dev, &s.proj, rows, wp, &mut s.a)?;
    ops::gated_rms_norm(
        dev,
        &s.g.slice(..rows * vd),
        &z,
        z_stride,
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

/// The baseline's commit in every SSM layer (`ops::spec_commit`): each slot of the `rows` commits uploaded to
/// `s.commits` (slot, accepted) takes its snapshot `accepted − 1` as its state; `accepted = 0` keeps the state. The
/// state pools hold `max_seqs` slots.
pub(crate) fn commit_baseline<A: Act>(
    dev: &CudaDevice,
    pools: &mut [LayerPool<A>],
    snapshots: &[Option<CudaSlice<f32>>],
    s: &Scratch<A>,
    rows: usize,
    max_seqs: usize,
) -> Result<()> {
    let commits = s.commits.slice(..rows * SPEC_COMMIT_META);
    for (pool, snaps) in pools.iter_mut().zip(snapshots) {
        let (LayerPool::Ssm { ssm, .. }, Some(snaps)) = (pool, snaps) else {
            continue;
        };
        let state_len = ssm.len() / max_seqs.max(1);
        ops::spec_commit(dev, state_len, ssm, snaps, &commits)?;
    }
    Ok(())
}
