//! A rank's layers on the device, built from its CPU mixers (which the tensor-parallel loader already cut to the
//! rank's share): weights in the storage type `A` (bf16, or f32 with `--dtype f32`), per-head parameters and MoE
//! routers in f32, and the column maps that split each projection.

use rewind_kernels::cpu::gdn::GdnDims;
use rewind_kernels::cpu::mamba2::Mamba2Dims;
use rewind_kernels::cuda::{CudaDevice, CudaSlice};

use super::weights::{act_of, f32_of, group_idx, idx_of, range_idx, stored, Cols, DeviceLinear};
use super::Act;
use crate::error::{EngineError, Result};
use crate::model::mixers::attention::{AttentionMixer, Proj};
use crate::model::mixers::ffn::{Linear, Mlp, Moe};
use crate::model::mixers::gdn::GdnMixer;
use crate::model::mixers::mamba2::Mamba2Mixer;
use crate::model::spec::{Activation, AttentionSpec, GdnSpec, Mamba2Spec, MoeSpec, RouterSpec};
use crate::model::Mixer;
use crate::shard::ShardKind;

/// How the Mamba-2 gated norm runs on this rank.
pub(crate) enum GatedNorm {
    /// Every norm group lies inside the rank's channels: the one-kernel grouped norm.
    Local { group: usize },
    /// Some group spans ranks: sums of squares per global group, all-reduced when `all_reduce`, then applied.
    Split {
        first_channel: usize,
        group: usize,
        groups: usize,
        all_reduce: bool,
    },
}

pub(crate) struct GpuMamba2<A: Act> {
    pub(crate) spec: Mamba2Spec,
    /// The scan's dims, with B/C expanded to the rank's virtual groups.
    pub(crate) dims: Mamba2Dims,
    pub(crate) in_proj: DeviceLinear<A>,
    pub(crate) conv_w: CudaSlice<A>,
    pub(crate) conv_b: Option<CudaSlice<A>>,
    pub(crate) dt_bias: CudaSlice<f32>,
    pub(crate) a: CudaSlice<f32>,
    pub(crate) d_skip: CudaSlice<f32>,
    pub(crate) norm_w: CudaSlice<A>,
    pub(crate) out_proj: DeviceLinear<A>,
    pub(crate) norm: GatedNorm,
    /// Column selections: `z` and `xBC` out of the projection; `x`, `B`, `C` (expanded) out of the conv output.
    pub(crate) z_cols: Cols,
    pub(crate) xbc_cols: Cols,
    pub(crate) x_cols: Cols,
    pub(crate) b_cols: Cols,
    pub(crate) c_cols: Cols,
    pub(crate) conv_dim: usize,
}

pub(crate) struct GpuGdn<A: Act> {
    pub(crate) spec: GdnSpec,
    pub(crate) dims: GdnDims,
    pub(crate) in_proj: DeviceLinear<A>,
    pub(crate) conv_w: CudaSlice<A>,
    pub(crate) dt_bias: CudaSlice<f32>,
    pub(crate) neg_a: CudaSlice<f32>,
    /// The per-head norm weight tiled over the rank's value heads (`[value_dim]`).
    pub(crate) norm_w: CudaSlice<A>,
    pub(crate) out_proj: DeviceLinear<A>,
    /// Column selections: the conv's channels and `z` out of the projection; `q`, `k` (expanded) and `v` out of the
    /// conv output.
    pub(crate) mixed_cols: Cols,
    pub(crate) q_cols: Cols,
    pub(crate) k_cols: Cols,
    pub(crate) v_cols: Cols,
    pub(crate) z_cols: Cols,
    pub(crate) conv_dim: usize,
    pub(crate) proj_dim: usize,
    /// Columns of `b` and `a` in the projection.
    pub(crate) b_col: usize,
    pub(crate) a_col: usize,
}

pub(crate) struct GpuAttention<A: Act> {
    pub(crate) spec: AttentionSpec,
    pub(crate) q_proj: DeviceLinear<A>,
    pub(crate) k_proj: DeviceLinear<A>,
    pub(crate) v_proj: DeviceLinear<A>,
    pub(crate) o_proj: DeviceLinear<A>,
    pub(crate) qk_norm: Option<(CudaSlice<A>, CudaSlice<A>)>,
    /// With the output gate: the `q` and `gate` columns of each head's `[q_h | gate_h]` pair.
    pub(crate) gate_idx: Option<(CudaSlice<i32>, CudaSlice<i32>)>,
    pub(crate) inv_freq: Option<CudaSlice<f32>>,
}

pub(crate) struct GpuMlp<A: Act> {
    pub(crate) act: Activation,
    pub(crate) gate: Option<DeviceLinear<A>>,
    pub(crate) up: DeviceLinear<A>,
    pub(crate) down: DeviceLinear<A>,
}

pub(crate) struct GpuMoe<A: Act> {
    pub(crate) spec: MoeSpec,
    /// The router `[experts, hidden]` in f32: its logits pick experts, so they are computed in f32 from an f32 input.
    pub(crate) router: CudaSlice<f32>,
    pub(crate) correction_bias: Option<CudaSlice<f32>>,
    /// `[experts, up_rows, d]` and `[experts, d, intermediate]`, `d` the experts' width
    /// ([`MoeSpec::expert_dim`]: the latent size of a latent MoE, else the hidden size).
    pub(crate) up: CudaSlice<A>,
    pub(crate) down: CudaSlice<A>,
    /// A latent MoE's `fc1_latent_proj` (hidden → latent) and `fc2_latent_proj` (latent → hidden), cuBLAS GEMMs.
    pub(crate) latent: Option<(DeviceLinear<A>, DeviceLinear<A>)>,
    pub(crate) shared: Option<GpuMlp<A>>,
    pub(crate) shared_gate: Option<DeviceLinear<A>>,
}

pub(crate) enum GpuMixer<A: Act> {
    Mamba2(Box<GpuMamba2<A>>),
    Gdn(Box<GpuGdn<A>>),
    Attention(Box<GpuAttention<A>>),
    Mlp(Box<GpuMlp<A>>),
    Moe(Box<GpuMoe<A>>),
}

pub(crate) struct GpuBlock<A: Act> {
    pub(crate) norm: CudaSlice<A>,
    pub(crate) mixer: GpuMixer<A>,
}

fn wrong(kind: &str) -> EngineError {
    EngineError::InvalidInput(format!("tensor-parallel plan does not describe a {kind} layer"))
}

fn linear<A: Act>(dev: &CudaDevice, l: &Linear) -> Result<DeviceLinear<A>> {
    DeviceLinear::new(dev, &l.w, l.b.as_deref(), l.out_dim, l.in_dim)
}

fn proj<A: Act>(dev: &CudaDevice, p: &Proj) -> Result<DeviceLinear<A>> {
    DeviceLinear::new(dev, &p.w, p.b.as_deref(), p.out_dim, p.in_dim)
}

impl<A: Act> GpuBlock<A> {
    /// Uploads one block of a rank.
    pub(crate) fn upload(dev: &CudaDevice, norm: &[f32], mixer: &Mixer, shard: &ShardKind) -> Result<Self> {
        let mixer = match mixer {
            Mixer::Mamba2(m) => GpuMixer::Mamba2(Box::new(mamba2(dev, m, shard)?)),
            Mixer::Gdn(m) => GpuMixer::Gdn(Box::new(gdn(dev, m, shard)?)),
            Mixer::Attention(m) => GpuMixer::Attention(Box::new(attention(dev, m)?)),
            Mixer::Mlp(m) => GpuMixer::Mlp(Box::new(mlp(dev, m)?)),
            Mixer::Moe(m) => GpuMixer::Moe(Box::new(moe(dev, m)?)),
        };
        Ok(GpuBlock {
            norm: act_of(dev, norm)?,
            mixer,
        })
    }
}

fn mamba2<A: Act>(dev: &CudaDevice, m: &Mamba2Mixer, shard: &ShardKind) -> Result<GpuMamba2<A>> {
    let ShardKind::Mamba2 {
        split,
        norm_group_size,
        norm_groups,
        all_reduce_norm,
    } = shard
    else {
        return Err(wrong("Mamba-2"));
    };
    let s = m.spec().clone();
    let (p, n) = (s.head_dim, s.state_dim);
    let di = s.heads * p;
    let held = split.groups.len();
    let conv_dim = di + 2 * held * n;
    let dims = Mamba2Dims {
        heads: s.heads,
        head_dim: p,
        state_dim: n,
        groups: split.virtual_groups.len(),
    };
    let first = split.heads.start * p;
    let norm = if !all_reduce_norm && first.is_multiple_of(*norm_group_size) && di.is_multiple_of(*norm_group_size) {
        GatedNorm::Local {
            group: *norm_group_size,
        }
    } else {
        GatedNorm::Split {
            first_channel: first,
            group: *norm_group_size,
            groups: *norm_groups,
            all_reduce: *all_reduce_norm,
        }
    };
    let d_in_proj = di + conv_dim + s.heads;
    Ok(GpuMamba2 {
        dims,
        in_proj: DeviceLinear::new(dev, &m.in_proj, m.in_proj_bias.as_deref(), d_in_proj, s.hidden)?,
        conv_w: act_of(dev, &m.conv_w)?,
        conv_b: m.conv_b.as_deref().map(|b| act_of(dev, b)).transpose()?,
        dt_bias: f32_of(dev, &m.dt_bias)?,
        a: f32_of(dev, &m.a)?,
        d_skip: f32_of(dev, &m.d_skip)?,
        norm_w: act_of(dev, &m.norm_w)?,
        out_proj: DeviceLinear::new(dev, &m.out_proj, m.out_proj_bias.as_deref(), s.hidden, di)?,
        norm,
        z_cols: Cols::new(dev, &range_idx(0, di))?,
        xbc_cols: Cols::new(dev, &range_idx(di, conv_dim))?,
        x_cols: Cols::new(dev, &range_idx(0, di))?,
        b_cols: Cols::new(dev, &group_idx(di, n, &split.virtual_groups))?,
        c_cols: Cols::new(dev, &group_idx(di + held * n, n, &split.virtual_groups))?,
        conv_dim,
        spec: s,
    })
}

fn gdn<A: Act>(dev: &CudaDevice, m: &GdnMixer, shard: &ShardKind) -> Result<GpuGdn<A>> {
    let ShardKind::Gdn(split) = shard else {
        return Err(wrong("Gated DeltaNet"));
    };
    let s = m.spec().clone();
    let (dk, dv, vh) = (s.k_head_dim, s.v_head_dim, s.v_heads);
    let key_dim = s.k_heads * dk;
    let value_dim = vh * dv;
    let conv_dim = 2 * key_dim + value_dim;
    let proj_dim = conv_dim + value_dim + 2 * vh;
    let dims = GdnDims {
        k_heads: split.virtual_groups.len(),
        v_heads: vh,
        k_dim: dk,
        v_dim: dv,
    };
    let tiled: Vec<f32> = (0..vh).flat_map(|_| m.norm.iter().copied()).collect();
    Ok(GpuGdn {
        dims,
        in_proj: DeviceLinear::new(dev, &m.in_proj, None, proj_dim, s.hidden)?,
        conv_w: act_of(dev, &m.conv)?,
        dt_bias: f32_of(dev, &m.dt_bias)?,
        neg_a: f32_of(dev, &m.neg_a)?,
        norm_w: act_of(dev, &tiled)?,
        out_proj: DeviceLinear::new(dev, &m.out_proj, None, s.hidden, value_dim)?,
        mixed_cols: Cols::new(dev, &range_idx(0, conv_dim))?,
        q_cols: Cols::new(dev, &group_idx(0, dk, &split.virtual_groups))?,
        k_cols: Cols::new(dev, &group_idx(key_dim, dk, &split.virtual_groups))?,
        v_cols: Cols::new(dev, &range_idx(2 * key_dim, value_dim))?,
        z_cols: Cols::new(dev, &range_idx(conv_dim, value_dim))?,
        conv_dim,
        proj_dim,
        b_col: conv_dim + value_dim,
        a_col: conv_dim + value_dim + vh,
        spec: s,
    })
}

/// An attention block's mixer on the device (the target's and the MTP layer's, `gpu/mtp_layer.rs`).
pub(super) fn attention<A: Act>(dev: &CudaDevice, m: &AttentionMixer) -> Result<GpuAttention<A>> {
    let s = m.spec().clone();
    let (h, d) = (s.heads, s.head_dim);
    let gate_idx = if s.output_gate {
        let q: Vec<usize> = (0..h).flat_map(|hh| hh * 2 * d..hh * 2 * d + d).collect();
        let g: Vec<usize> = (0..h).flat_map(|hh| hh * 2 * d + d..(hh + 1) * 2 * d).collect();
        Some((idx_of(dev, &q)?, idx_of(dev, &g)?))
    } else {
        None
    };
    let inv_freq = match &s.rope {
        Some(r) => Some(f32_of(
            dev,
            &rewind_kernels::cpu::rope::inv_freq(r.rotary_dim, r.theta),
        )?),
        None => None,
    };
    let qk_norm = match &m.qk_norm {
        Some((q, k)) => Some((act_of(dev, q)?, act_of(dev, k)?)),
        None => None,
    };
    Ok(GpuAttention {
        q_proj: proj(dev, &m.q_proj)?,
        k_proj: proj(dev, &m.k_proj)?,
        v_proj: proj(dev, &m.v_proj)?,
        o_proj: proj(dev, &m.o_proj)?,
        qk_norm,
        gate_idx,
        inv_freq,
        spec: s,
    })
}

/// A dense MLP on the device (a block, a shared expert, an MTP layer's FFN).
pub(super) fn mlp<A: Act>(dev: &CudaDevice, m: &Mlp) -> Result<GpuMlp<A>> {
    Ok(GpuMlp {
        act: m.spec().act,
        gate: m.gate.as_ref().map(|g| linear(dev, g)).transpose()?,
        up: linear(dev, &m.up)?,
        down: linear(dev, &m.down)?,
    })
}

/// A mixture of experts on the device (a block, an MTP layer's FFN).
pub(super) fn moe<A: Act>(dev: &CudaDevice, m: &Moe) -> Result<GpuMoe<A>> {
    let s = m.spec().clone();
    let correction_bias = match (&s.router, &m.correction_bias) {
        (RouterSpec::SigmoidGrouped { .. }, Some(b)) => Some(f32_of(dev, b)?),
        _ => None,
    };
    Ok(GpuMoe {
        router: f32_of(dev, &m.router)?,
        correction_bias,
        up: stored(dev, &m.up)?,
        down: stored(dev, &m.down)?,
        latent: m
            .latent
            .as_ref()
            .map(|(fc1, fc2)| Ok::<_, EngineError>((linear(dev, fc1)?, linear(dev, fc2)?)))
            .transpose()?,
        shared: m.shared.as_ref().map(|sh| mlp(dev, sh)).transpose()?,
        shared_gate: m
            .shared_gate
            .as_deref()
            .map(|g| DeviceLinear::new(dev, g, None, 1, s.hidden))
            .transpose()?,
        spec: s,
    })
}
