//! The Mamba-2 mixer of Nemotron-H (`NemotronHMamba2Mixer` in transformers), on the CPU.
//!
//! `in_proj → [z | xBC | dt]`; depthwise causal conv (+ bias) and SiLU over `xBC`; split `x | B | C`;
//! `dt = clamp(softplus(dt + dt_bias))`; `A = −exp(A_log)`; the SSD scan with the `D·x` skip; gated RMSNorm with the gate
//! applied first (`rms(y·silu(z))·w`, per group of `d_inner / n_groups` channels); `out_proj`.
//!
//! Like transformers 5.17, only the multi-token (prefill) path clamps `dt` to `spec.time_step_limit` (the config parser
//! sets it to `(time_step_min, inf)`, which is what the reference uses; `config.time_step_limit` is ignored there too);
//! the one-token decode path does not clamp at all. Matching both paths exactly matters: random and real checkpoints do
//! produce `softplus(dt + dt_bias) < time_step_min`, and clamping decode too moved logits by 2e-4 relative on a random
//! `init-model` checkpoint. Prefill and decode therefore agree token for token only where the clamp does not bite.

use rewind_kernels::cpu::act::{silu, softplus};
use rewind_kernels::cpu::conv::causal_conv1d;
use rewind_kernels::cpu::gemm::linear;
use rewind_kernels::cpu::mamba2::Mamba2Dims;
#[cfg(test)]
use rewind_kernels::cpu::mamba2::{mamba2_chunked, mamba2_step};
#[cfg(test)]
use rewind_kernels::cpu::norm::{gated_rms_norm, GateOrder};

use crate::error::{EngineError, Result};
use crate::model::spec::Mamba2Spec;
use crate::model::tensors::TensorSource;

/// One sequence's recurrent state for one Mamba-2 layer, for the mixer's own tests (the engine keeps state in the
/// slot pools of `crate::state` and runs the mixer through `crate::decode`).
#[cfg(test)]
#[derive(Clone, Debug, PartialEq)]
pub struct Mamba2State {
    /// The last `K − 1` pre-conv `xBC` inputs, oldest first: `[K − 1, conv_dim]`.
    pub conv: Vec<f32>,
    /// The SSM state, `[heads, head_dim, state_dim]`.
    pub ssm: Vec<f32>,
}

/// A loaded Mamba-2 mixer.
#[derive(Clone, Debug)]
pub struct Mamba2Mixer {
    pub(crate) spec: Mamba2Spec,
    /// `[d_in_proj, hidden]`, rows ordered `[z (d_inner) | xBC (conv_dim) | dt (heads)]`.
    pub(crate) in_proj: Vec<f32>,
    pub(crate) in_proj_bias: Option<Vec<f32>>,
    /// `[conv_dim, K]`.
    pub(crate) conv_w: Vec<f32>,
    pub(crate) conv_b: Option<Vec<f32>>,
    pub(crate) dt_bias: Vec<f32>,
    /// `A = −exp(A_log)`, computed once at load.
    pub(crate) a: Vec<f32>,
    pub(crate) d_skip: Vec<f32>,
    pub(crate) norm_w: Vec<f32>,
    /// `[hidden, d_inner]`.
    pub(crate) out_proj: Vec<f32>,
    pub(crate) out_proj_bias: Option<Vec<f32>>,
}

fn d_inner(spec: &Mamba2Spec) -> usize {
    spec.heads * spec.head_dim
}

fn conv_dim(spec: &Mamba2Spec) -> usize {
    d_inner(spec) + 2 * spec.groups * spec.state_dim
}

/// Validates `spec`. `whole` is false for a tensor-parallel shard, whose heads may cover groups unevenly (the shard
/// expands B/C to its heads itself, see `crate::shard`).
fn check_spec(spec: &Mamba2Spec, whole: bool) -> Result<()> {
    let positive = [
        ("hidden_size", spec.hidden),
        ("mamba_num_heads", spec.heads),
        ("mamba_head_dim", spec.head_dim),
        ("ssm_state_size", spec.state_dim),
        ("n_groups", spec.groups),
        ("conv_kernel", spec.conv_kernel),
        ("chunk_size", spec.chunk_size),
        ("norm group size", spec.norm_group_size),
    ];
    if let Some((field, _)) = positive.iter().find(|(_, v)| *v == 0) {
        return Err(EngineError::config(*field, "must be positive"));
    }
    if whole && !spec.heads.is_multiple_of(spec.groups) {
        return Err(EngineError::config(
            "n_groups",
            format!(
                "mamba_num_heads ({}) is not a multiple of n_groups ({})",
                spec.heads, spec.groups
            ),
        ));
    }
    if !d_inner(spec).is_multiple_of(spec.norm_group_size) {
        return Err(EngineError::config(
            "n_groups",
            format!(
                "the gated-norm group size {} does not divide d_inner {}",
                spec.norm_group_size,
                d_inner(spec)
            ),
        ));
    }
    let (lo, hi) = spec.time_step_limit;
    if lo.is_nan() || hi.is_nan() || lo > hi {
        return Err(EngineError::config(
            "time_step_limit",
            format!("({lo}, {hi}) is not a range"),
        ));
    }
    if spec.norm_eps.is_nan() || spec.norm_eps <= 0.0 {
        return Err(EngineError::config("layer_norm_epsilon", "must be positive"));
    }
    Ok(())
}

impl Mamba2Mixer {
    /// Loads the mixer's tensors named `{prefix}in_proj.weight` etc.; `prefix` ends with '.', e.g.
    /// `"backbone.layers.3.mixer."`.
    pub fn load(spec: &Mamba2Spec, src: &mut dyn TensorSource, prefix: &str) -> Result<Self> {
        Self::load_checked(spec, src, prefix, true)
    }

    /// Loads one tensor-parallel rank's slice: `spec` describes the rank's heads and the B/C groups it holds, which
    /// need not divide its heads evenly (so [`Mamba2Mixer::forward`] must not be used; a shard runs
    /// [`Mamba2Mixer::scan_outputs`] with its own scan and norm).
    pub fn load_shard(spec: &Mamba2Spec, src: &mut dyn TensorSource, prefix: &str) -> Result<Self> {
        Self::load_checked(spec, src, prefix, false)
    }

    fn load_checked(spec: &Mamba2Spec, src: &mut dyn TensorSource, prefix: &str, whole: bool) -> Result<Self> {
        check_spec(spec, whole)?;
        let (hidden, heads, di, cd) = (spec.hidden, spec.heads, d_inner(spec), conv_dim(spec));
        let d_in_proj = di + cd + heads;
        let name = |n: &str| format!("{prefix}{n}");
        let in_proj = src.take(&name("in_proj.weight"), &[d_in_proj, hidden])?;
        let in_proj_bias = match spec.proj_bias {
            true => Some(src.take(&name("in_proj.bias"), &[d_in_proj])?),
            false => None,
        };
        let conv_w = src.take(&name("conv1d.weight"), &[cd, 1, spec.conv_kernel])?;
        let conv_b = match spec.conv_bias {
            true => Some(src.take(&name("conv1d.bias"), &[cd])?),
            false => None,
        };
        let dt_bias = src.take(&name("dt_bias"), &[heads])?;
        let a_log = src.take(&name("A_log"), &[heads])?;
        let d_skip = src.take(&name("D"), &[heads])?;
        let norm_w = src.take(&name("norm.weight"), &[di])?;
        let out_proj = src.take(&name("out_proj.weight"), &[hidden, di])?;
        let out_proj_bias = match spec.proj_bias {
            true => Some(src.take(&name("out_proj.bias"), &[hidden])?),
            false => None,
        };
        Ok(Mamba2Mixer {
            spec: spec.clone(),
            in_proj,
            in_proj_bias,
            conv_w,
            conv_b,
            dt_bias,
            a: a_log.iter().map(|v| -v.exp()).collect(),
            d_skip,
            norm_w,
            out_proj,
            out_proj_bias,
        })
    }

    /// The layer's shape.
    pub fn spec(&self) -> &Mamba2Spec {
        &self.spec
    }

    /// The state of a new sequence: zero conv history and zero SSM state.
    #[cfg(test)]
    pub fn new_state(&self) -> Mamba2State {
        let s = &self.spec;
        Mamba2State {
            conv: vec![0.0; (s.conv_kernel - 1) * conv_dim(s)],
            ssm: vec![0.0; s.heads * s.head_dim * s.state_dim],
        }
    }

    /// The scan's dimensions.
    pub fn dims(&self) -> Mamba2Dims {
        Mamba2Dims {
            heads: self.spec.heads,
            head_dim: self.spec.head_dim,
            state_dim: self.spec.state_dim,
            groups: self.spec.groups,
        }
    }

    /// `A = −exp(A_log)` per head.
    pub fn a(&self) -> &[f32] {
        &self.a
    }

    /// The `D` skip per head.
    pub fn d_skip(&self) -> &[f32] {
        &self.d_skip
    }

    /// Runs `t` tokens (`x` is `[t, hidden]`, the already-normalised block input) and returns `[t, hidden]`, advancing
    /// `state`. `t > 1` uses the chunked scan (prefill), `t == 1` the one-token step (decode). The mixer's tests check
    /// it against a naive reference; the engine runs the mixer through `crate::decode`.
    #[cfg(test)]
    pub fn forward(&self, x: &[f32], t: usize, state: &mut Mamba2State) -> Vec<f32> {
        let s = &self.spec;
        assert_eq!(
            state.ssm.len(),
            s.heads * s.head_dim * s.state_dim,
            "mamba2 mixer: ssm state"
        );
        let (dims, chunk) = (self.dims(), s.chunk_size);
        let ssm = &mut state.ssm;
        self.forward_with(x, t, t > 1, &mut state.conv, |inp, y| {
            if inp.t == 1 {
                mamba2_step(dims, ssm, &inp.x, &inp.dt, &self.a, &inp.b, &inp.c, &self.d_skip, y);
            } else {
                mamba2_chunked(
                    dims,
                    inp.t,
                    chunk,
                    ssm,
                    &inp.x,
                    &inp.dt,
                    &self.a,
                    &inp.b,
                    &inp.c,
                    &self.d_skip,
                    y,
                );
            }
        })
    }

    /// The mixer around a caller-chosen scan: projection, conv (advancing `conv_state`, `[K−1, conv_dim]`), the scan
    /// inputs handed to `scan`, which writes `y` (`[t, heads, head_dim]`, including the `D·x` skip), then the gated
    /// norm and output projection. `prefill` selects the reference's prefill numerics (the `dt` clamp); decode forms and
    /// speculative verification pass `false`. This is how the decode forms (recurrent, replay, kv-only) share one mixer.
    #[cfg(test)]
    pub fn forward_with(
        &self,
        x: &[f32],
        t: usize,
        prefill: bool,
        conv_state: &mut [f32],
        scan: impl FnOnce(&Mamba2Inputs, &mut [f32]),
    ) -> Vec<f32> {
        let s = &self.spec;
        if t == 0 {
            return Vec::new();
        }
        let (y, z) = self.scan_outputs(x, t, prefill, conv_state, scan);
        let mut normed = vec![0.0f32; y.len()];
        gated_rms_norm(
            &y,
            &z,
            &self.norm_w,
            s.norm_group_size,
            s.norm_eps,
            GateOrder::BeforeNorm,
            &mut normed,
        );
        self.project_out(&normed, t)
    }

    /// The first half of [`Mamba2Mixer::forward_with`]: projection, conv and `scan`; returns the scan output `y` and
    /// the gate `z`, both `[t, d_inner]`, for a caller that normalises itself (a tensor-parallel shard whose norm groups
    /// span ranks).
    pub fn scan_outputs(
        &self,
        x: &[f32],
        t: usize,
        prefill: bool,
        conv_state: &mut [f32],
        scan: impl FnOnce(&Mamba2Inputs, &mut [f32]),
    ) -> (Vec<f32>, Vec<f32>) {
        let s = &self.spec;
        let (hidden, heads, di, cd) = (s.hidden, s.heads, d_inner(s), conv_dim(s));
        let gn = s.groups * s.state_dim;
        assert_eq!(x.len(), t * hidden, "mamba2 mixer: input is not [t, hidden]");
        assert_eq!(conv_state.len(), (s.conv_kernel - 1) * cd, "mamba2 mixer: conv state");
        if t == 0 {
            return (Vec::new(), Vec::new());
        }
        let d_in_proj = di + cd + heads;
        let proj = linear(x, &self.in_proj, self.in_proj_bias.as_deref(), t, hidden, d_in_proj);

        let mut z = Vec::with_capacity(t * di);
        let mut xbc = Vec::with_capacity(t * cd);
        let mut dt = Vec::with_capacity(t * heads);
        // The reference clamps on its chunked (multi-token) path only; see the module docs.
        let (lo, hi) = if prefill {
            s.time_step_limit
        } else {
            (f32::NEG_INFINITY, f32::INFINITY)
        };
        for row in proj.chunks_exact(d_in_proj) {
            z.extend_from_slice(&row[..di]);
            xbc.extend_from_slice(&row[di..di + cd]);
            // `torch.clamp` semantics: a NaN stays NaN rather than being pulled into the range.
            dt.extend(row[di + cd..].iter().zip(&self.dt_bias).map(|(v, bias)| {
                let d = softplus(v + bias);
                if d < lo {
                    lo
                } else if d > hi {
                    hi
                } else {
                    d
                }
            }));
        }

        let mut conv_out = vec![0.0f32; t * cd];
        causal_conv1d(
            &xbc,
            t,
            cd,
            &self.conv_w,
            self.conv_b.as_deref(),
            conv_state,
            &mut conv_out,
        );
        let mut inputs = Mamba2Inputs {
            t,
            x: Vec::with_capacity(t * di),
            dt,
            b: Vec::with_capacity(t * gn),
            c: Vec::with_capacity(t * gn),
            conv_in: Vec::new(),
        };
        for row in conv_out.chunks_exact(cd) {
            inputs.x.extend(row[..di].iter().map(|v| silu(*v)));
            inputs.b.extend(row[di..di + gn].iter().map(|v| silu(*v)));
            inputs.c.extend(row[di + gn..].iter().map(|v| silu(*v)));
        }

        inputs.conv_in = xbc;
        let mut y = vec![0.0f32; t * di];
        scan(&inputs, &mut y);

        (y, z)
    }

    /// The gated norm's weight, `[d_inner]`.
    pub fn norm_weight(&self) -> &[f32] {
        &self.norm_w
    }

    /// `out_proj` (+ bias) of the normalised `[t, d_inner]` activations: `[t, hidden]`.
    pub fn project_out(&self, normed: &[f32], t: usize) -> Vec<f32> {
        let s = &self.spec;
        linear(
            normed,
            &self.out_proj,
            self.out_proj_bias.as_deref(),
            t,
            d_inner(s),
            s.hidden,
        )
    }
}

/// The scan inputs of `t` tokens, after projection, conv and activation.
pub struct Mamba2Inputs {
    pub t: usize,
    /// `[t, heads, head_dim]`.
    pub x: Vec<f32>,
    /// `[t, heads]`, after softplus (and the prefill clamp).
    pub dt: Vec<f32>,
    /// `[t, groups, state_dim]`.
    pub b: Vec<f32>,
    /// `[t, groups, state_dim]`.
    pub c: Vec<f32>,
    /// The pre-conv `xBC` rows `[t, conv_dim]`: what a conv ring keeps, so a speculative step can roll its conv
    /// history back to any accepted prefix.
    pub conv_in: Vec<f32>,
}

#[cfg(test)]
mod tests;
