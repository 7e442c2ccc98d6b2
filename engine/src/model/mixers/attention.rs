//! Causal softmax attention layers: Nemotron-H's plain GQA attention (no RoPE, no biases) and the gated attention of
//! Qwen3-Next / Qwen3.5 (`q_proj` doubled with a sigmoid output gate, zero-centred q/k RMSNorm, partial RoPE).
//!
//! Follows `NemotronHAttention` / `Qwen3NextAttention` / `Qwen3_5Attention` in transformers 5.17:
//! `q_proj(x)` viewed `[t, heads, 2·head_dim]` and chunked on the last axis gives `q_h` then `gate_h` per head;
//! q/k norm over each head's `head_dim`, then RoPE on q and k, then attention, then `· sigmoid(gate)`, then `o_proj`.

use rewind_kernels::cpu::act::sigmoid;
use rewind_kernels::cpu::attention::causal_attention;
use rewind_kernels::cpu::gemm::linear;
use rewind_kernels::cpu::norm::rms_norm;
use rewind_kernels::cpu::rope::apply_rope;

use crate::error::{EngineError, Result};
use crate::model::spec::AttentionSpec;
use crate::model::tensors::TensorSource;

/// The KV cache of one attention layer for one sequence: `k`, `v` as `[len, kv_heads, head_dim]`, growable.
///
/// Rolling back (rejected speculative tokens) is [`KvCache::truncate`].
#[derive(Clone, Debug)]
pub struct KvCache {
    kv_heads: usize,
    head_dim: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvCache {
    /// An empty cache for `kv_heads` heads of `head_dim` channels.
    pub fn new(kv_heads: usize, head_dim: usize) -> Self {
        KvCache {
            kv_heads,
            head_dim,
            k: Vec::new(),
            v: Vec::new(),
        }
    }

    fn row(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Number of cached positions.
    pub fn len(&self) -> usize {
        if self.row() == 0 {
            0
        } else {
            self.k.len() / self.row()
        }
    }

    /// Whether no position is cached.
    pub fn is_empty(&self) -> bool {
        self.k.is_empty()
    }

    /// Drops every position from `len` on; a no-op if the cache is not longer than `len`.
    pub fn truncate(&mut self, len: usize) {
        let n = len * self.row();
        self.k.truncate(n);
        self.v.truncate(n);
    }

    /// Cached keys, `[len, kv_heads, head_dim]`.
    pub fn keys(&self) -> &[f32] {
        &self.k
    }

    /// Cached values, `[len, kv_heads, head_dim]`.
    pub fn values(&self) -> &[f32] {
        &self.v
    }

    /// Appends `k`, `v` rows (`[n, kv_heads, head_dim]` each).
    pub fn append(&mut self, k: &[f32], v: &[f32]) {
        assert!(
            k.len() == v.len() && self.row() > 0 && k.len().is_multiple_of(self.row()),
            "KvCache::append: rows do not match the cache layout"
        );
        self.k.extend_from_slice(k);
        self.v.extend_from_slice(v);
    }
}

/// A linear projection's weight `[out, in]` and optional bias `[out]`.
pub(crate) struct Proj {
    pub(crate) w: Vec<f32>,
    pub(crate) b: Option<Vec<f32>>,
    pub(crate) in_dim: usize,
    pub(crate) out_dim: usize,
}

impl Proj {
    fn load(src: &mut dyn TensorSource, name: &str, out_dim: usize, in_dim: usize, bias: bool) -> Result<Self> {
        let w = src.take(&format!("{name}.weight"), &[out_dim, in_dim])?;
        let b = if bias {
            Some(src.take(&format!("{name}.bias"), &[out_dim])?)
        } else {
            None
        };
        Ok(Proj { w, b, in_dim, out_dim })
    }

    fn apply(&self, x: &[f32], rows: usize) -> Vec<f32> {
        linear(x, &self.w, self.b.as_deref(), rows, self.in_dim, self.out_dim)
    }
}

/// One attention layer's weights.
pub struct AttentionMixer {
    pub(crate) spec: AttentionSpec,
    pub(crate) q_proj: Proj,
    pub(crate) k_proj: Proj,
    pub(crate) v_proj: Proj,
    pub(crate) o_proj: Proj,
    /// `(q_norm, k_norm)` weights, `[head_dim]` each.
    pub(crate) qk_norm: Option<(Vec<f32>, Vec<f32>)>,
}

impl AttentionMixer {
    /// Loads `{prefix}{q,k,v,o}_proj.weight` (+ `.bias` with `spec.bias`) and, with `spec.qk_norm`,
    /// `{prefix}{q,k}_norm.weight`. `prefix` is e.g. `model.layers.3.self_attn.`.
    pub fn load(spec: &AttentionSpec, src: &mut dyn TensorSource, prefix: &str) -> Result<Self> {
        let (h, kv, d) = (spec.heads, spec.kv_heads, spec.head_dim);
        if h == 0 || kv == 0 || d == 0 || !h.is_multiple_of(kv) {
            return Err(EngineError::config(
                "num_key_value_heads",
                format!("{h} attention heads cannot be shared by {kv} KV heads of dim {d}"),
            ));
        }
        if let Some(rope) = &spec.rope {
            if !rope.rotary_dim.is_multiple_of(2) || rope.rotary_dim > d {
                return Err(EngineError::config(
                    "partial_rotary_factor",
                    format!("rotary dim {} must be even and at most head_dim {d}", rope.rotary_dim),
                ));
            }
        }
        let q_out = if spec.output_gate { 2 * h * d } else { h * d };
        let q_proj = Proj::load(src, &format!("{prefix}q_proj"), q_out, spec.hidden, spec.bias)?;
        let k_proj = Proj::load(src, &format!("{prefix}k_proj"), kv * d, spec.hidden, spec.bias)?;
        let v_proj = Proj::load(src, &format!("{prefix}v_proj"), kv * d, spec.hidden, spec.bias)?;
        let o_proj = Proj::load(src, &format!("{prefix}o_proj"), spec.hidden, h * d, spec.bias)?;
        let qk_norm = match spec.qk_norm {
            Some(_) => Some((
                src.take(&format!("{prefix}q_norm.weight"), &[d])?,
                src.take(&format!("{prefix}k_norm.weight"), &[d])?,
            )),
            None => None,
        };
        Ok(AttentionMixer {
            spec: spec.clone(),
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            qk_norm,
        })
    }

    /// The layer's description.
    pub fn spec(&self) -> &AttentionSpec {
        &self.spec
    }

    /// An empty KV cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.spec.kv_heads, self.spec.head_dim)
    }

    /// Runs the layer over `t` rows.
    ///
    /// `x`: `[t, hidden]`, the normalised block input; `pos` is the absolute position of row 0 and must equal
    /// `cache.len()` (the new keys/values are appended to `cache`). Returns `[t, hidden]`.
    pub fn forward(&self, x: &[f32], t: usize, pos: usize, cache: &mut KvCache) -> Vec<f32> {
        let s = &self.spec;
        let (h, kv, d) = (s.heads, s.kv_heads, s.head_dim);
        assert_eq!(x.len(), t * s.hidden, "AttentionMixer::forward: x");
        assert_eq!(
            pos,
            cache.len(),
            "AttentionMixer::forward: pos must equal the cached length"
        );
        let q_full = self.q_proj.apply(x, t);
        let (mut q, gate) = if s.output_gate {
            // Per head the doubled projection holds [q_h | gate_h] (view(.., heads, 2·head_dim).chunk(2, -1)).
            let mut q = Vec::with_capacity(t * h * d);
            let mut gate = Vec::with_capacity(t * h * d);
            for pair in q_full.chunks_exact(2 * d) {
                q.extend_from_slice(&pair[..d]);
                gate.extend_from_slice(&pair[d..]);
            }
            (q, Some(gate))
        } else {
            (q_full, None)
        };
        let mut k = self.k_proj.apply(x, t);
        let v = self.v_proj.apply(x, t);
        if let (Some(norm), Some((qw, kw))) = (&s.qk_norm, &self.qk_norm) {
            let q_in = q.clone();
            rms_norm(&q_in, qw, norm.eps, norm.offset, &mut q);
            let k_in = k.clone();
            rms_norm(&k_in, kw, norm.eps, norm.offset, &mut k);
        }
        if let Some(rope) = &s.rope {
            let positions: Vec<usize> = (pos..pos + t).collect();
            apply_rope(&mut q, t, h, d, rope.rotary_dim, &positions, rope.theta);
            apply_rope(&mut k, t, kv, d, rope.rotary_dim, &positions, rope.theta);
        }
        cache.append(&k, &v);
        let total = cache.len();
        let mut ctx = vec![0.0f32; t * h * d];
        causal_attention(
            &q,
            cache.keys(),
            cache.values(),
            t,
            total,
            h,
            kv,
            d,
            pos,
            s.scale,
            &mut ctx,
        );
        if let Some(gate) = gate {
            for (c, g) in ctx.iter_mut().zip(&gate) {
                *c *= sigmoid(*g);
            }
        }
        self.o_proj.apply(&ctx, t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::mixers::ffn::tests::{random, MapSource};
    use crate::model::spec::{QkNormSpec, RopeSpec};

    fn qwen_spec() -> AttentionSpec {
        // heads / kv_heads = 3, partial rotary (8 of 16 channels), gated, zero-centred q/k norm, biases.
        AttentionSpec {
            hidden: 24,
            heads: 6,
            kv_heads: 2,
            head_dim: 16,
            bias: true,
            rope: Some(RopeSpec {
                theta: 10_000_000.0,
                rotary_dim: 8,
            }),
            qk_norm: Some(QkNormSpec { eps: 1e-6, offset: 1.0 }),
            output_gate: true,
            scale: 0.25,
        }
    }

    fn nemotron_spec() -> AttentionSpec {
        AttentionSpec {
            hidden: 20,
            heads: 3,
            kv_heads: 1,
            head_dim: 8,
            bias: false,
            rope: None,
            qk_norm: None,
            output_gate: false,
            scale: 1.0 / 8f32.sqrt(),
        }
    }

    fn weights(spec: &AttentionSpec, prefix: &str) -> MapSource {
        let (h, kv, d, hid) = (spec.heads, spec.kv_heads, spec.head_dim, spec.hidden);
        let q_out = if spec.output_gate { 2 * h * d } else { h * d };
        let mut src = MapSource::default();
        let mut seed = 10;
        let mut add = |name: &str, shape: &[usize]| {
            seed += 1;
            src.insert(
                &format!("{prefix}{name}"),
                shape,
                random(shape.iter().product(), seed, 0.3),
            );
        };
        for (name, out, inp) in [("q_proj", q_out, hid), ("k_proj", kv * d, hid), ("v_proj", kv * d, hid)] {
            add(&format!("{name}.weight"), &[out, inp]);
            if spec.bias {
                add(&format!("{name}.bias"), &[out]);
            }
        }
        add("o_proj.weight", &[hid, h * d]);
        if spec.bias {
            add("o_proj.bias", &[hid]);
        }
        if spec.qk_norm.is_some() {
            add("q_norm.weight", &[d]);
            add("k_norm.weight", &[d]);
        }
        src
    }

    fn prompt_equals_stepwise(spec: &AttentionSpec) {
        let prefix = "model.layers.3.self_attn.";
        let mut src = weights(spec, prefix);
        let mixer = AttentionMixer::load(spec, &mut src, prefix).expect("load");
        src.assert_all_taken();
        let t = 9;
        let x = random(t * spec.hidden, 77, 1.0);
        let mut whole_cache = mixer.new_cache();
        let whole = mixer.forward(&x, t, 0, &mut whole_cache);
        assert_eq!(whole_cache.len(), t);
        // One token at a time, then a chunk of 4 after 5 steps: every split must agree.
        let mut cache = mixer.new_cache();
        let mut stepwise = Vec::new();
        for i in 0..5 {
            stepwise.extend(mixer.forward(&x[i * spec.hidden..(i + 1) * spec.hidden], 1, i, &mut cache));
        }
        stepwise.extend(mixer.forward(&x[5 * spec.hidden..], 4, 5, &mut cache));
        assert_eq!(cache.len(), t);
        for (a, b) in whole.iter().zip(&stepwise) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{a} vs {b}");
        }
        assert_eq!(whole_cache.keys().len(), cache.keys().len());
        // Rolling back three positions and recomputing them gives the same outputs again.
        cache.truncate(6);
        assert_eq!(cache.len(), 6);
        let again = mixer.forward(&x[6 * spec.hidden..], 3, 6, &mut cache);
        for (a, b) in whole[6 * spec.hidden..].iter().zip(&again) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{a} vs {b}");
        }
    }

    #[test]
    fn qwen_gated_attention_prompt_equals_stepwise() {
        prompt_equals_stepwise(&qwen_spec());
    }

    #[test]
    fn nemotron_attention_prompt_equals_stepwise() {
        prompt_equals_stepwise(&nemotron_spec());
    }

    /// An independent, per-token implementation of the Qwen gated attention in f64, from the reference's formulas.
    #[test]
    fn qwen_gated_attention_matches_reference_formulas() {
        let spec = qwen_spec();
        let prefix = "p.";
        let mut src = weights(&spec, prefix);
        let get = |src: &MapSource, n: &str| src.get(&format!("{prefix}{n}"));
        let (wq, bq) = (get(&src, "q_proj.weight"), get(&src, "q_proj.bias"));
        let (wk, bk) = (get(&src, "k_proj.weight"), get(&src, "k_proj.bias"));
        let (wv, bv) = (get(&src, "v_proj.weight"), get(&src, "v_proj.bias"));
        let (wo, bo) = (get(&src, "o_proj.weight"), get(&src, "o_proj.bias"));
        let (qn, kn) = (get(&src, "q_norm.weight"), get(&src, "k_norm.weight"));
        let mixer = AttentionMixer::load(&spec, &mut src, prefix).expect("load");
        let (t, hid, h, kv, d, rd) = (5, spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, 8);
        let x = random(t * hid, 5, 1.0);
        let mut cache = mixer.new_cache();
        let got = mixer.forward(&x, t, 0, &mut cache);

        let lin = |w: &[f32], b: &[f32], xi: &[f32]| -> Vec<f64> {
            b.iter()
                .enumerate()
                .map(|(o, &bo)| {
                    bo as f64
                        + (0..xi.len())
                            .map(|i| w[o * xi.len() + i] as f64 * xi[i] as f64)
                            .sum::<f64>()
                })
                .collect()
        };
        let norm = |v: &[f64], w: &[f32]| -> Vec<f64> {
            let ms = v.iter().map(|a| a * a).sum::<f64>() / v.len() as f64;
            v.iter()
                .zip(w)
                .map(|(a, wi)| a / (ms + 1e-6).sqrt() * (1.0 + *wi as f64))
                .collect()
        };
        let rope = |v: &mut [f64], p: usize| {
            for j in 0..rd / 2 {
                let ang = p as f64 / 10_000_000f64.powf((2 * j) as f64 / rd as f64);
                let (a, b) = (v[j], v[j + rd / 2]);
                v[j] = a * ang.cos() - b * ang.sin();
                v[j + rd / 2] = b * ang.cos() + a * ang.sin();
            }
        };
        let mut qs = vec![vec![vec![0.0; d]; h]; t];
        let mut gs = qs.clone();
        let mut ks = vec![vec![vec![0.0; d]; kv]; t];
        let mut vs = ks.clone();
        for i in 0..t {
            let xi = &x[i * hid..(i + 1) * hid];
            let qf = lin(&wq, &bq, xi);
            let kf = lin(&wk, &bk, xi);
            let vf = lin(&wv, &bv, xi);
            for hh in 0..h {
                qs[i][hh] = norm(&qf[hh * 2 * d..hh * 2 * d + d], &qn);
                gs[i][hh] = qf[hh * 2 * d + d..(hh + 1) * 2 * d].to_vec();
                rope(&mut qs[i][hh], i);
            }
            for g in 0..kv {
                ks[i][g] = norm(&kf[g * d..(g + 1) * d], &kn);
                rope(&mut ks[i][g], i);
                vs[i][g] = vf[g * d..(g + 1) * d].to_vec();
            }
        }
        for i in 0..t {
            let mut ctx = vec![0.0f64; h * d];
            for hh in 0..h {
                let g = hh / (h / kv);
                let l: Vec<f64> = (0..=i)
                    .map(|j| (0..d).map(|c| qs[i][hh][c] * ks[j][g][c]).sum::<f64>() * 0.25)
                    .collect();
                let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = l.iter().map(|a| (a - m).exp()).sum();
                for c in 0..d {
                    let a: f64 = (0..=i).map(|j| (l[j] - m).exp() / z * vs[j][g][c]).sum();
                    ctx[hh * d + c] = a / (1.0 + (-gs[i][hh][c]).exp());
                }
            }
            for o in 0..hid {
                let r = bo[o] as f64 + (0..h * d).map(|c| wo[o * h * d + c] as f64 * ctx[c]).sum::<f64>();
                let g = got[i * hid + o] as f64;
                assert!((r - g).abs() < 1e-4 * (1.0 + r.abs()), "token {i} out {o}: {g} vs {r}");
            }
        }
    }

    #[test]
    fn load_rejects_bad_head_counts_and_shapes() {
        let mut spec = nemotron_spec();
        spec.kv_heads = 2;
        let mut src = weights(&nemotron_spec(), "");
        assert!(AttentionMixer::load(&spec, &mut src, "").is_err());
        let mut src = weights(&nemotron_spec(), "");
        let mut wide = nemotron_spec();
        wide.hidden = 21;
        assert!(AttentionMixer::load(&wide, &mut src, "").is_err());
    }
}
