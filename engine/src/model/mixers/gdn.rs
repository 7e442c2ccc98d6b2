//! The Gated DeltaNet mixer of Qwen3-Next (`Qwen3NextGatedDeltaNet`) and Qwen3.5 (`Qwen3_5GatedDeltaNet`), on the CPU.
//!
//! Per token: one input projection to `[q | k | v | z | b | a]`; depthwise causal conv over `q | k | v` and SiLU;
//! q, k L2-normalised per head (eps 1e-6) and q scaled by `1/√k_dim`; `β = sigmoid(b)`,
//! `g = −exp(A_log)·softplus(a + dt_bias)`; the gated delta rule (chunked for a prompt, one step for a single token);
//! RMSNorm per value head, then the `silu(z)` gate; `out_proj`.

use rewind_kernels::cpu::act::{sigmoid, silu, softplus};
use rewind_kernels::cpu::conv::causal_conv1d;
use rewind_kernels::cpu::gdn::GdnDims;
#[cfg(test)]
use rewind_kernels::cpu::gdn::{gdn_chunked, gdn_step};
use rewind_kernels::cpu::gemm::linear;
use rewind_kernels::cpu::norm::{gated_rms_norm, l2_norm_rows, GateOrder};

use crate::error::{EngineError, Result};
use crate::model::spec::{GdnLayout, GdnSpec};
use crate::model::tensors::TensorSource;

/// The epsilon of the q / k L2 norm (`l2norm(..., eps=1e-6)` in the reference).
const L2_EPS: f32 = 1e-6;

/// One sequence's recurrent state in a Gated DeltaNet layer, for the mixer's own tests (the engine keeps state in the
/// slot pools of `crate::state` and runs the mixer through `crate::decode`).
#[cfg(test)]
#[derive(Clone, Debug, PartialEq)]
pub struct GdnState {
    /// The last `K − 1` conv inputs, oldest first: `[K − 1, conv_dim]` with channels `q | k | v`.
    pub conv: Vec<f32>,
    /// The delta-rule state `[v_heads, v_dim, k_dim]` (the transpose of transformers' `[k_dim, v_dim]` per head).
    pub ssm: Vec<f32>,
}

/// A Gated DeltaNet layer's weights, with the input projections stored in one `[q | k | v | z | b | a]` matrix whatever
/// the checkpoint's layout, so the forward pass does one projection GEMM.
pub struct GdnMixer {
    pub(crate) spec: GdnSpec,
    /// `[conv_dim + value_dim + 2·v_heads, hidden]`, rows `q | k | v | z | b | a`, heads in order within each.
    pub(crate) in_proj: Vec<f32>,
    /// `[conv_dim, K]`.
    pub(crate) conv: Vec<f32>,
    pub(crate) dt_bias: Vec<f32>,
    /// `−exp(A_log)`, per value head.
    pub(crate) neg_a: Vec<f32>,
    /// `[v_head_dim]`, shared by every value head.
    pub(crate) norm: Vec<f32>,
    /// `[hidden, value_dim]`.
    pub(crate) out_proj: Vec<f32>,
}

/// Sizes derived from a spec.
#[derive(Clone, Copy)]
struct Sizes {
    key_dim: usize,
    value_dim: usize,
    conv_dim: usize,
    proj_dim: usize,
}

fn sizes(s: &GdnSpec) -> Sizes {
    let key_dim = s.k_heads * s.k_head_dim;
    let value_dim = s.v_heads * s.v_head_dim;
    let conv_dim = 2 * key_dim + value_dim;
    Sizes {
        key_dim,
        value_dim,
        conv_dim,
        proj_dim: conv_dim + value_dim + 2 * s.v_heads,
    }
}

/// Validates `s`. `whole` is false for a tensor-parallel shard, whose value heads may cover key heads unevenly (the
/// shard expands q/k to its value heads itself, see `crate::shard`).
fn validate(s: &GdnSpec, whole: bool) -> Result<()> {
    let positive = [
        ("hidden_size", s.hidden),
        ("linear_num_key_heads", s.k_heads),
        ("linear_num_value_heads", s.v_heads),
        ("linear_key_head_dim", s.k_head_dim),
        ("linear_value_head_dim", s.v_head_dim),
        ("linear_conv_kernel_dim", s.conv_kernel),
        ("chunk_size", s.chunk_size),
    ];
    for (field, v) in positive {
        if v == 0 {
            return Err(EngineError::config(field, "must be positive"));
        }
    }
    if whole && !s.v_heads.is_multiple_of(s.k_heads) {
        return Err(EngineError::config(
            "linear_num_value_heads",
            format!(
                "{} is not a multiple of linear_num_key_heads ({})",
                s.v_heads, s.k_heads
            ),
        ));
    }
    Ok(())
}

/// Copies `rows` rows of width `width` starting at row `from` of `src` onto the end of `dst`.
fn push_rows(dst: &mut Vec<f32>, src: &[f32], width: usize, from: usize, rows: usize) {
    dst.extend_from_slice(&src[from * width..(from + rows) * width]);
}

/// Reorders Qwen3-Next's interleaved `in_proj_qkvz` `[k_heads · (2·dk + 2·r·dv), hidden]` and `in_proj_ba`
/// `[k_heads · 2r, hidden]` (`r = v_heads / k_heads`) into `[q | k | v | z | b | a]` rows, as
/// `fix_query_key_value_ordering` does to the projected activations: each key-head group holds
/// `[q (dk) | k (dk) | v (r·dv) | z (r·dv)]` and `[b (r) | a (r)]`, and value head `g·r + i` is the `i`-th of group `g`.
fn deinterleave(s: &GdnSpec, qkvz: &[f32], ba: &[f32]) -> Vec<f32> {
    let (dk, dv, h) = (s.k_head_dim, s.v_head_dim, s.hidden);
    let r = s.v_heads / s.k_heads;
    let group = 2 * dk + 2 * r * dv;
    let mut w = Vec::with_capacity(sizes(s).proj_dim * h);
    // (offset inside a qkvz group, rows per group) for q, k, v, z in turn.
    for (offset, rows) in [(0, dk), (dk, dk), (2 * dk, r * dv), (2 * dk + r * dv, r * dv)] {
        for g in 0..s.k_heads {
            push_rows(&mut w, qkvz, h, g * group + offset, rows);
        }
    }
    for offset in [0, r] {
        for g in 0..s.k_heads {
            push_rows(&mut w, ba, h, g * 2 * r + offset, r);
        }
    }
    w
}

impl GdnMixer {
    /// Loads a layer's weights; `prefix` ends with '.', e.g. `"model.layers.0.linear_attn."`.
    pub fn load(spec: &GdnSpec, src: &mut dyn TensorSource, prefix: &str) -> Result<Self> {
        Self::load_checked(spec, src, prefix, true)
    }

    /// Loads one tensor-parallel rank's slice: `spec` describes the rank's value heads and the key heads they read,
    /// which need not divide evenly (so [`GdnMixer::forward`] must not be used; a shard runs
    /// [`GdnMixer::forward_with`] with a scan that expands q/k to its value heads).
    pub fn load_shard(spec: &GdnSpec, src: &mut dyn TensorSource, prefix: &str) -> Result<Self> {
        Self::load_checked(spec, src, prefix, false)
    }

    fn load_checked(spec: &GdnSpec, src: &mut dyn TensorSource, prefix: &str, whole: bool) -> Result<Self> {
        validate(spec, whole)?;
        let z = sizes(spec);
        let (h, vh) = (spec.hidden, spec.v_heads);
        let name = |n: &str| format!("{prefix}{n}");
        let in_proj = match spec.layout {
            GdnLayout::FusedInterleaved => {
                let qkvz = src.take(&name("in_proj_qkvz.weight"), &[z.conv_dim + z.value_dim, h])?;
                let ba = src.take(&name("in_proj_ba.weight"), &[2 * vh, h])?;
                deinterleave(spec, &qkvz, &ba)
            }
            GdnLayout::Split => {
                let mut w = src.take(&name("in_proj_qkv.weight"), &[z.conv_dim, h])?;
                w.reserve((z.value_dim + 2 * vh) * h);
                w.extend(src.take(&name("in_proj_z.weight"), &[z.value_dim, h])?);
                w.extend(src.take(&name("in_proj_b.weight"), &[vh, h])?);
                w.extend(src.take(&name("in_proj_a.weight"), &[vh, h])?);
                w
            }
        };
        let conv = src.take(&name("conv1d.weight"), &[z.conv_dim, 1, spec.conv_kernel])?;
        let dt_bias = src.take(&name("dt_bias"), &[vh])?;
        let neg_a = src.take(&name("A_log"), &[vh])?.iter().map(|a| -a.exp()).collect();
        let norm = src.take(&name("norm.weight"), &[spec.v_head_dim])?;
        let out_proj = src.take(&name("out_proj.weight"), &[h, z.value_dim])?;
        Ok(GdnMixer {
            spec: spec.clone(),
            in_proj,
            conv,
            dt_bias,
            neg_a,
            norm,
            out_proj,
        })
    }

    /// The layer's spec.
    pub fn spec(&self) -> &GdnSpec {
        &self.spec
    }

    /// The delta-rule dimensions of this layer.
    pub fn dims(&self) -> GdnDims {
        GdnDims {
            k_heads: self.spec.k_heads,
            v_heads: self.spec.v_heads,
            k_dim: self.spec.k_head_dim,
            v_dim: self.spec.v_head_dim,
        }
    }

    /// The state of a new sequence: zeros.
    #[cfg(test)]
    pub fn new_state(&self) -> GdnState {
        GdnState {
            conv: vec![0.0; (self.spec.conv_kernel - 1) * sizes(&self.spec).conv_dim],
            ssm: vec![0.0; self.dims().state_len()],
        }
    }

    /// Runs `t` tokens (`x` is `[t, hidden]`, the already-normalised block input) and returns `[t, hidden]`, advancing
    /// `state`. `t > 1` uses the chunked delta rule (prefill), `t == 1` the one-token step (decode). For the mixer's
    /// tests; the engine runs the mixer through `crate::decode`.
    #[cfg(test)]
    pub fn forward(&self, x: &[f32], t: usize, state: &mut GdnState) -> Vec<f32> {
        assert_eq!(state.ssm.len(), self.dims().state_len(), "gdn forward: ssm state");
        let (dims, chunk) = (self.dims(), self.spec.chunk_size);
        let ssm = &mut state.ssm;
        self.forward_with(x, t, &mut state.conv, |inp, out| {
            if inp.t == 1 {
                gdn_step(dims, ssm, &inp.q, &inp.k, &inp.v, &inp.g, &inp.beta, out);
            } else {
                gdn_chunked(dims, inp.t, chunk, ssm, &inp.q, &inp.k, &inp.v, &inp.g, &inp.beta, out);
            }
        })
    }

    /// The mixer around a caller-chosen delta-rule scan: projection, conv (advancing `conv_state`,
    /// `[K−1, conv_dim]`), activations, L2 norms, `β` and `g`, handed to `scan`, which writes the core output
    /// (`[t, v_heads, v_dim]`); then the gated norm and output projection. The decode forms share the mixer this way.
    pub fn forward_with(
        &self,
        x: &[f32],
        t: usize,
        conv_state: &mut [f32],
        scan: impl FnOnce(&GdnInputs, &mut [f32]),
    ) -> Vec<f32> {
        let s = &self.spec;
        let z = sizes(s);
        let (dk, dv, vh) = (s.k_head_dim, s.v_head_dim, s.v_heads);
        assert_eq!(x.len(), t * s.hidden, "gdn forward: x is not [t, hidden]");
        assert_eq!(
            conv_state.len(),
            (s.conv_kernel - 1) * z.conv_dim,
            "gdn forward: conv state"
        );
        if t == 0 {
            return Vec::new();
        }
        let proj = linear(x, &self.in_proj, None, t, s.hidden, z.proj_dim);
        let column = |from: usize, width: usize| -> Vec<f32> {
            proj.chunks_exact(z.proj_dim)
                .flat_map(|row| row[from..from + width].iter().copied())
                .collect()
        };

        let mixed = column(0, z.conv_dim);
        let mut conv_out = vec![0.0f32; t * z.conv_dim];
        causal_conv1d(&mixed, t, z.conv_dim, &self.conv, None, conv_state, &mut conv_out);
        let (mut q, mut k, mut v) = (
            Vec::with_capacity(t * z.key_dim),
            Vec::with_capacity(t * z.key_dim),
            Vec::with_capacity(t * z.value_dim),
        );
        for row in conv_out.chunks_exact(z.conv_dim) {
            let (qr, rest) = row.split_at(z.key_dim);
            let (kr, vr) = rest.split_at(z.key_dim);
            q.extend(qr.iter().map(|&c| silu(c)));
            k.extend(kr.iter().map(|&c| silu(c)));
            v.extend(vr.iter().map(|&c| silu(c)));
        }
        l2_norm_rows(&mut q, dk, L2_EPS);
        l2_norm_rows(&mut k, dk, L2_EPS);
        let scale = (1.0 / (dk as f64).sqrt()) as f32;
        q.iter_mut().for_each(|c| *c *= scale);

        let gate = column(z.conv_dim, z.value_dim);
        let beta: Vec<f32> = column(z.conv_dim + z.value_dim, vh).into_iter().map(sigmoid).collect();
        let g: Vec<f32> = column(z.conv_dim + z.value_dim + vh, vh)
            .chunks_exact(vh)
            .flat_map(|a| {
                a.iter()
                    .enumerate()
                    .map(|(i, &ai)| self.neg_a[i] * softplus(ai + self.dt_bias[i]))
            })
            .collect();

        let inputs = GdnInputs {
            t,
            q,
            k,
            v,
            g,
            beta,
            conv_in: mixed,
        };
        let mut core = vec![0.0f32; t * z.value_dim];
        scan(&inputs, &mut core);
        // The norm weight is per head width, so every value head is one row of the grouped norm.
        let mut normed = vec![0.0f32; core.len()];
        gated_rms_norm(
            &core,
            &gate,
            &self.norm,
            dv,
            s.norm_eps,
            GateOrder::AfterNorm,
            &mut normed,
        );
        linear(&normed, &self.out_proj, None, t, z.value_dim, s.hidden)
    }
}

/// The delta-rule inputs of `t` tokens, after projection, conv, activations and norms.
pub struct GdnInputs {
    pub t: usize,
    /// `[t, k_heads, k_dim]`, L2-normalised and scaled by `1/√k_dim`.
    pub q: Vec<f32>,
    /// `[t, k_heads, k_dim]`, L2-normalised.
    pub k: Vec<f32>,
    /// `[t, v_heads, v_dim]`.
    pub v: Vec<f32>,
    /// `[t, v_heads]` log-decay.
    pub g: Vec<f32>,
    /// `[t, v_heads]`.
    pub beta: Vec<f32>,
    /// The pre-conv `q | k | v` rows `[t, conv_dim]`: what a conv ring keeps, so a speculative step can roll its
    /// conv history back to any accepted prefix.
    pub conv_in: Vec<f32>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use crate::model::tensors::test_support::MapSource;

    const PREFIX: &str = "model.layers.3.linear_attn.";

    fn spec(layout: GdnLayout, chunk_size: usize) -> GdnSpec {
        GdnSpec {
            hidden: 12,
            k_heads: 2,
            v_heads: 4,
            k_head_dim: 5,
            v_head_dim: 7,
            conv_kernel: 4,
            chunk_size,
            norm_eps: 1e-6,
            layout,
        }
    }

    fn uniform(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-scale..scale)).collect()
    }

    /// The layer's weights as separate q, k, v, z, b, a matrices (heads in order), plus the shared tensors.
    struct Weights {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        z: Vec<f32>,
        b: Vec<f32>,
        a: Vec<f32>,
    }

    fn random_weights(rng: &mut ChaCha8Rng, s: &GdnSpec) -> Weights {
        let (h, kd, vd) = (s.hidden, s.k_heads * s.k_head_dim, s.v_heads * s.v_head_dim);
        let w = 1.0 / (h as f32).sqrt();
        Weights {
            q: uniform(rng, kd * h, w),
            k: uniform(rng, kd * h, w),
            v: uniform(rng, vd * h, w),
            z: uniform(rng, vd * h, w),
            b: uniform(rng, s.v_heads * h, w),
            a: uniform(rng, s.v_heads * h, w),
        }
    }

    /// Builds Qwen3-Next's interleaved tensors by hand: per key-head group, `q_g, k_g, v_g, z_g` rows for `qkvz` and
    /// `b_g, a_g` rows for `ba`, where group `g` owns value heads `g·r .. (g+1)·r`.
    fn interleave(s: &GdnSpec, w: &Weights) -> (Vec<f32>, Vec<f32>) {
        let (h, dk, dv, r) = (s.hidden, s.k_head_dim, s.v_head_dim, s.v_heads / s.k_heads);
        let (mut qkvz, mut ba) = (Vec::new(), Vec::new());
        let rows = |m: &[f32], first: usize, n: usize| m[first * h..(first + n) * h].to_vec();
        for g in 0..s.k_heads {
            qkvz.extend(rows(&w.q, g * dk, dk));
            qkvz.extend(rows(&w.k, g * dk, dk));
            qkvz.extend(rows(&w.v, g * r * dv, r * dv));
            qkvz.extend(rows(&w.z, g * r * dv, r * dv));
            ba.extend(rows(&w.b, g * r, r));
            ba.extend(rows(&w.a, g * r, r));
        }
        (qkvz, ba)
    }

    fn source(rng: &mut ChaCha8Rng, s: &GdnSpec, w: &Weights) -> MapSource {
        let (h, kd, vd, vh) = (s.hidden, s.k_heads * s.k_head_dim, s.v_heads * s.v_head_dim, s.v_heads);
        let conv_dim = 2 * kd + vd;
        let mut src = MapSource::default();
        let name = |n: &str| format!("{PREFIX}{n}");
        match s.layout {
            GdnLayout::FusedInterleaved => {
                let (qkvz, ba) = interleave(s, w);
                src.put(&name("in_proj_qkvz.weight"), &[conv_dim + vd, h], qkvz);
                src.put(&name("in_proj_ba.weight"), &[2 * vh, h], ba);
            }
            GdnLayout::Split => {
                let qkv = [w.q.as_slice(), &w.k, &w.v].concat();
                src.put(&name("in_proj_qkv.weight"), &[conv_dim, h], qkv);
                src.put(&name("in_proj_z.weight"), &[vd, h], w.z.clone());
                src.put(&name("in_proj_b.weight"), &[vh, h], w.b.clone());
                src.put(&name("in_proj_a.weight"), &[vh, h], w.a.clone());
            }
        }
        src.put(
            &name("conv1d.weight"),
            &[conv_dim, 1, s.conv_kernel],
            uniform(rng, conv_dim * s.conv_kernel, 0.8),
        );
        src.put(&name("dt_bias"), &[vh], uniform(rng, vh, 1.0));
        // A in [0.01, 16] as the reference initialises it.
        let a_log = (0..vh).map(|_| rng.random_range(0.01f32..16.0).ln()).collect();
        src.put(&name("A_log"), &[vh], a_log);
        src.put(
            &name("norm.weight"),
            &[s.v_head_dim],
            (0..s.v_head_dim).map(|_| rng.random_range(0.5..1.5)).collect(),
        );
        src.put(
            &name("out_proj.weight"),
            &[h, vd],
            uniform(rng, h * vd, 1.0 / (vd as f32).sqrt()),
        );
        src
    }

    fn rel(got: &[f32], want: &[f32]) -> f32 {
        assert_eq!(got.len(), want.len());
        let d: f32 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
        let n: f32 = want.iter().map(|b| b * b).sum();
        (d / n).sqrt()
    }

    fn load(s: &GdnSpec, src: &mut MapSource) -> GdnMixer {
        let m = GdnMixer::load(s, src, PREFIX).expect("load");
        src.finish(&[], &[]).expect("every tensor taken");
        m
    }

    #[test]
    fn prompt_steps_and_mixed_agree() {
        for layout in [GdnLayout::FusedInterleaved, GdnLayout::Split] {
            for chunk in [4, 64] {
                let mut rng = ChaCha8Rng::seed_from_u64(42);
                let s = spec(layout, chunk);
                let w = random_weights(&mut rng, &s);
                let m = load(&s, &mut source(&mut rng, &s, &w));
                let t = 19;
                let x = uniform(&mut rng, t * s.hidden, 2.0);

                let mut whole = m.new_state();
                let prompt = m.forward(&x, t, &mut whole);
                assert!(prompt.iter().all(|v| v.is_finite()) && prompt.iter().any(|v| v.abs() > 1e-3));

                let mut one = m.new_state();
                let steps: Vec<f32> = x
                    .chunks_exact(s.hidden)
                    .flat_map(|xt| m.forward(xt, 1, &mut one))
                    .collect();
                assert!(
                    rel(&steps, &prompt) < 1e-4,
                    "{layout:?}/{chunk}: steps {}",
                    rel(&steps, &prompt)
                );
                assert!(rel(&one.ssm, &whole.ssm) < 1e-4 && rel(&one.conv, &whole.conv) < 1e-5);

                // A chunked prefix, then steps, then another chunked run.
                let mut mixed = m.new_state();
                let (p, d) = (11, 3);
                let mut out = m.forward(&x[..p * s.hidden], p, &mut mixed);
                for i in p..p + d {
                    out.extend(m.forward(&x[i * s.hidden..(i + 1) * s.hidden], 1, &mut mixed));
                }
                out.extend(m.forward(&x[(p + d) * s.hidden..], t - p - d, &mut mixed));
                assert!(
                    rel(&out, &prompt) < 1e-4,
                    "{layout:?}/{chunk}: mixed {}",
                    rel(&out, &prompt)
                );
                assert!(rel(&mixed.ssm, &whole.ssm) < 1e-4 && rel(&mixed.conv, &whole.conv) < 1e-5);
            }
        }
    }

    #[test]
    fn deinterleave_matches_hand_built_layout() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let fused = spec(GdnLayout::FusedInterleaved, 64);
        let split = spec(GdnLayout::Split, 64);
        let w = random_weights(&mut rng, &fused);
        let mut rng_a = ChaCha8Rng::seed_from_u64(10);
        let mut rng_b = ChaCha8Rng::seed_from_u64(10);
        let mf = load(&fused, &mut source(&mut rng_a, &fused, &w));
        let ms = load(&split, &mut source(&mut rng_b, &split, &w));
        let want = [w.q.as_slice(), &w.k, &w.v, &w.z, &w.b, &w.a].concat();
        assert_eq!(mf.in_proj, want);
        assert_eq!(ms.in_proj, want);
        let x = uniform(&mut rng, 5 * fused.hidden, 1.0);
        let (mut sf, mut ss) = (mf.new_state(), ms.new_state());
        assert_eq!(mf.forward(&x, 5, &mut sf), ms.forward(&x, 5, &mut ss));
    }

    #[test]
    fn missing_and_misshapen_tensors_are_errors() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let s = spec(GdnLayout::Split, 64);
        let w = random_weights(&mut rng, &s);
        let mut src = source(&mut rng, &s, &w);
        src.0.remove(&format!("{PREFIX}dt_bias"));
        assert!(matches!(
            GdnMixer::load(&s, &mut src, PREFIX),
            Err(EngineError::MissingTensor { .. })
        ));
        let mut src = source(&mut rng, &s, &w);
        src.put(
            &format!("{PREFIX}norm.weight"),
            &[s.v_head_dim + 1],
            vec![1.0; s.v_head_dim + 1],
        );
        assert!(matches!(
            GdnMixer::load(&s, &mut src, PREFIX),
            Err(EngineError::TensorShape { .. })
        ));
        let bad = GdnSpec {
            v_heads: 3,
            ..s.clone()
        };
        assert!(matches!(
            GdnMixer::load(&bad, &mut src, PREFIX),
            Err(EngineError::Config { .. })
        ));
    }
}
