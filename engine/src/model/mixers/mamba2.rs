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
mod tests {

    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::model::tensors::test_support::MapSource;

    const PREFIX: &str = "backbone.layers.3.mixer.";

    fn spec(groups: usize, bias: bool, limit: (f32, f32)) -> Mamba2Spec {
        let (heads, head_dim) = (2 * groups, 3);
        Mamba2Spec {
            hidden: 10,
            heads,
            head_dim,
            state_dim: 5,
            groups,
            conv_kernel: 4,
            chunk_size: 4,
            conv_bias: bias,
            proj_bias: bias,
            norm_eps: 1e-5,
            norm_group_size: heads * head_dim / groups,
            time_step_limit: limit,
        }
    }

    fn uniform(rng: &mut ChaCha8Rng, len: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(lo..hi)).collect()
    }

    fn random_weights(s: &Mamba2Spec, rng: &mut ChaCha8Rng) -> MapSource {
        let (di, cd) = (d_inner(s), conv_dim(s));
        let dp = di + cd + s.heads;
        let scale_in = 1.5 / (s.hidden as f32).sqrt();
        let mut src = MapSource::default();
        let mut put = |n: &str, shape: &[usize], lo: f32, hi: f32| {
            let len = shape.iter().product();
            src.put(&format!("{PREFIX}{n}"), shape, uniform(rng, len, lo, hi));
        };
        put("in_proj.weight", &[dp, s.hidden], -scale_in, scale_in);
        put("conv1d.weight", &[cd, 1, s.conv_kernel], -0.6, 0.6);
        put("dt_bias", &[s.heads], -4.0, 1.0);
        put("A_log", &[s.heads], -1.0, 1.5);
        put("D", &[s.heads], -1.0, 1.0);
        put("norm.weight", &[di], 0.5, 1.5);
        put("out_proj.weight", &[s.hidden, di], -0.5, 0.5);
        if s.proj_bias {
            put("in_proj.bias", &[dp], -0.3, 0.3);
            put("out_proj.bias", &[s.hidden], -0.3, 0.3);
        }
        if s.conv_bias {
            put("conv1d.bias", &[cd], -0.3, 0.3);
        }
        src
    }

    fn load(s: &Mamba2Spec, weights: &MapSource) -> Mamba2Mixer {
        let mut src = weights.clone();
        let mixer = Mamba2Mixer::load(s, &mut src, PREFIX).expect("load");
        src.finish(&[], &[]).expect("every tensor taken");
        mixer
    }

    fn rel(got: &[f32], want: &[f32]) -> f64 {
        assert_eq!(got.len(), want.len());
        let diff: f64 = got.iter().zip(want).map(|(g, w)| ((g - w) as f64).powi(2)).sum();
        let norm: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
        (diff / norm).sqrt()
    }

    /// The mixer written out token by token in f64, following transformers' `NemotronHMamba2Mixer` line by line.
    fn naive(s: &Mamba2Spec, w: &MapSource, x: &[f32], t: usize) -> Vec<f32> {
        let g = |n: &str| -> Vec<f64> { w.get(&format!("{PREFIX}{n}")).iter().map(|v| *v as f64).collect() };
        let opt = |n: &str, on: bool, len: usize| if on { g(n) } else { vec![0.0; len] };
        let (di, cd, k, n, p) = (d_inner(s), conv_dim(s), s.conv_kernel, s.state_dim, s.head_dim);
        let dp = di + cd + s.heads;
        let (w_in, b_in) = (g("in_proj.weight"), opt("in_proj.bias", s.proj_bias, dp));
        let (w_conv, b_conv) = (g("conv1d.weight"), opt("conv1d.bias", s.conv_bias, cd));
        let (dt_bias, a_log, d_skip, norm_w) = (g("dt_bias"), g("A_log"), g("D"), g("norm.weight"));
        let (w_out, b_out) = (g("out_proj.weight"), opt("out_proj.bias", s.proj_bias, s.hidden));
        let silu = |v: f64| v / (1.0 + (-v).exp());
        let proj: Vec<Vec<f64>> = (0..t)
            .map(|i| {
                (0..dp)
                    .map(|o| {
                        b_in[o]
                            + (0..s.hidden)
                                .map(|j| w_in[o * s.hidden + j] * x[i * s.hidden + j] as f64)
                                .sum::<f64>()
                    })
                    .collect()
            })
            .collect();
        let mut state = vec![0.0f64; s.heads * p * n];
        let mut out = Vec::new();
        for i in 0..t {
            let conv: Vec<f64> = (0..cd)
                .map(|ch| {
                    let mut acc = b_conv[ch];
                    for j in 0..k {
                        let time = i as isize - (k - 1) as isize + j as isize;
                        if time >= 0 {
                            acc += w_conv[ch * k + j] * proj[time as usize][di + ch];
                        }
                    }
                    silu(acc)
                })
                .collect();
            let (xs, bs, cs) = (&conv[..di], &conv[di..di + s.groups * n], &conv[di + s.groups * n..]);
            let mut y = vec![0.0f64; di];
            for h in 0..s.heads {
                let grp = h / (s.heads / s.groups);
                let raw = proj[i][di + cd + h] + dt_bias[h];
                let sp = if raw > 20.0 { raw } else { raw.exp().ln_1p() };
                let dt = sp.clamp(s.time_step_limit.0 as f64, s.time_step_limit.1 as f64);
                let da = (dt * -a_log[h].exp()).exp();
                for c in 0..p {
                    let xv = xs[h * p + c];
                    let mut acc = 0.0;
                    for m in 0..n {
                        let st = &mut state[(h * p + c) * n + m];
                        *st = da * *st + dt * xv * bs[grp * n + m];
                        acc += *st * cs[grp * n + m];
                    }
                    y[h * p + c] = acc + d_skip[h] * xv;
                }
            }
            let gated: Vec<f64> = (0..di).map(|c| y[c] * silu(proj[i][c])).collect();
            let mut normed = vec![0.0f64; di];
            for (gi, grp) in gated.chunks(s.norm_group_size).enumerate() {
                let var = grp.iter().map(|v| v * v).sum::<f64>() / grp.len() as f64;
                for (c, v) in grp.iter().enumerate() {
                    let ch = gi * s.norm_group_size + c;
                    normed[ch] = norm_w[ch] * v / (var + s.norm_eps as f64).sqrt();
                }
            }
            for o in 0..s.hidden {
                let v = b_out[o] + (0..di).map(|c| w_out[o * di + c] * normed[c]).sum::<f64>();
                out.push(v as f32);
            }
        }
        out
    }

    fn steps(mixer: &Mamba2Mixer, x: &[f32], state: &mut Mamba2State) -> Vec<f32> {
        let hidden = mixer.spec().hidden;
        x.chunks_exact(hidden)
            .flat_map(|row| mixer.forward(row, 1, state))
            .collect()
    }

    #[test]
    fn prompt_matches_reference_and_steps_and_splits() {
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        // The second limit is active for many tokens (dt_bias reaches −4), so the clamp is exercised in every form.
        for (groups, bias, limit) in [
            (1, true, (0.0, f32::INFINITY)),
            (2, false, (0.05, 0.8)),
            (3, true, (0.0, 1.5)),
        ] {
            let s = spec(groups, bias, limit);
            let weights = random_weights(&s, &mut rng);
            let mixer = load(&s, &weights);
            let t = 13;
            let x = uniform(&mut rng, t * s.hidden, -1.0, 1.0);

            let mut whole_state = mixer.new_state();
            let whole = mixer.forward(&x, t, &mut whole_state);
            let reference = naive(&s, &weights, &x, t);
            let e = rel(&whole, &reference);
            assert!(e < 1e-4, "groups {groups}: chunked prompt vs reference: {e:e}");

            // The decode path never clamps, like the reference's: it matches the reference without a clamp.
            let mut step_state = mixer.new_state();
            let stepped = steps(&mixer, &x, &mut step_state);
            let unclamped = spec(groups, bias, (0.0, f32::INFINITY));
            let e = rel(&stepped, &naive(&unclamped, &weights, &x, t));
            assert!(e < 1e-4, "groups {groups}: steps vs unclamped reference: {e:e}");
            if limit != (0.0, f32::INFINITY) {
                // Where the prefill clamp bites, prefill and decode legitimately differ (as in transformers).
                assert!(rel(&stepped, &whole) > 1e-4, "groups {groups}: the clamp never bit");
                continue;
            }
            let e = rel(&stepped, &whole);
            assert!(e < 1e-4, "groups {groups}: steps vs chunked: {e:e}");
            assert!(rel(&step_state.ssm, &whole_state.ssm) < 1e-4);
            // The conv state holds raw projections, which differ in the last bits between 1-row and t-row products.
            assert!(rel(&step_state.conv, &whole_state.conv) < 1e-6);

            // Chunked prefix (not a multiple of the chunk size), a chunked middle, then single steps.
            for cut in [2, 5, 9] {
                let mut state = mixer.new_state();
                let hs = s.hidden;
                let mut split = mixer.forward(&x[..cut * hs], cut, &mut state);
                split.extend(mixer.forward(&x[cut * hs..(cut + 3) * hs], 3, &mut state));
                split.extend(steps(&mixer, &x[(cut + 3) * hs..], &mut state));
                let e = rel(&split, &whole);
                assert!(e < 1e-4, "groups {groups}: split at {cut} vs whole: {e:e}");
                assert!(rel(&state.ssm, &whole_state.ssm) < 1e-4);
                assert!(rel(&state.conv, &whole_state.conv) < 1e-6);
            }
        }
    }

    #[test]
    fn clamp_changes_the_output() {
        // Guards the test above against a limit that never bites.
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let free = spec(2, false, (0.0, f32::INFINITY));
        let clamped = spec(2, false, (0.05, 0.8));
        let weights = random_weights(&free, &mut rng);
        let x = uniform(&mut rng, 6 * free.hidden, -1.0, 1.0);
        let a = load(&free, &weights).forward(&x, 6, &mut load(&free, &weights).new_state());
        let b = load(&clamped, &weights).forward(&x, 6, &mut load(&clamped, &weights).new_state());
        assert!(rel(&b, &a) > 1e-3);
    }

    #[test]
    fn load_rejects_bad_checkpoints_and_specs() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let s = spec(2, true, (0.0, f32::INFINITY));
        let weights = random_weights(&s, &mut rng);

        let mut missing = weights.clone();
        missing.0.remove(&format!("{PREFIX}conv1d.bias"));
        let err = Mamba2Mixer::load(&s, &mut missing, PREFIX).unwrap_err();
        assert!(matches!(err, EngineError::MissingTensor { ref name, .. } if name.ends_with("conv1d.bias")));

        let mut wrong = weights.clone();
        let name = format!("{PREFIX}out_proj.weight");
        wrong.put(&name, &[d_inner(&s), s.hidden], weights.get(&name).to_vec());
        let err = Mamba2Mixer::load(&s, &mut wrong, PREFIX).unwrap_err();
        assert!(matches!(err, EngineError::TensorShape { .. }), "{err}");

        let mut bad = s.clone();
        bad.heads = 3;
        let err = Mamba2Mixer::load(&bad, &mut weights.clone(), PREFIX).unwrap_err();
        assert!(
            matches!(err, EngineError::Config { ref field, .. } if field == "n_groups"),
            "{err}"
        );

        // Without biases in the spec, the bias tensors are left over for `finish` to report.
        let mut extra = weights.clone();
        let no_bias = Mamba2Spec {
            conv_bias: false,
            proj_bias: false,
            ..s.clone()
        };
        Mamba2Mixer::load(&no_bias, &mut extra, PREFIX).expect("load");
        assert!(extra.finish(&[], &[]).is_err());
    }
}
