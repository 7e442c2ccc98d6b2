//! Causal softmax attention with grouped KV heads (GQA), shaped as GEMMs so long prompts stay fast.
//!
//! Numerics match transformers' `eager_attention_forward`: `scores = (q · kᵀ) · scale`, masked positions excluded,
//! softmax in f32 with the row maximum subtracted, then `· v`.

use super::gemm::{matmul_nn, matmul_nt};

/// Query rows processed per GEMM: bounds the score buffer at `QUERY_BLOCK · s` floats for long prompts.
const QUERY_BLOCK: usize = 128;

/// Copies head `head` of a `[rows, heads, head_dim]` tensor into a contiguous `[rows, head_dim]` buffer.
fn gather_head(x: &[f32], rows: usize, heads: usize, head_dim: usize, head: usize, out: &mut Vec<f32>) {
    out.clear();
    out.reserve(rows * head_dim);
    for r in 0..rows {
        let start = (r * heads + head) * head_dim;
        out.extend_from_slice(&x[start..start + head_dim]);
    }
}

/// Causal attention of `t` queries over `s` cached keys/values.
///
/// - `q`: `[t, heads, head_dim]`; query `i` sits at absolute position `q_offset + i`.
/// - `k`, `v`: `[s, kv_heads, head_dim]`, positions `0..s`, with `q_offset + t <= s`.
/// - Query `i` attends to keys `0..=q_offset + i`. Query head `h` reads KV head `h / (heads / kv_heads)`.
/// - `out`: `[t, heads, head_dim]`, overwritten.
#[allow(clippy::too_many_arguments)]
pub fn causal_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    t: usize,
    s: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    q_offset: usize,
    scale: f32,
    out: &mut [f32],
) {
    assert!(
        kv_heads > 0 && heads.is_multiple_of(kv_heads),
        "causal_attention: heads must be a multiple of kv_heads"
    );
    assert_eq!(q.len(), t * heads * head_dim, "causal_attention: q");
    assert_eq!(k.len(), s * kv_heads * head_dim, "causal_attention: k");
    assert_eq!(v.len(), s * kv_heads * head_dim, "causal_attention: v");
    assert_eq!(out.len(), t * heads * head_dim, "causal_attention: out");
    assert!(q_offset + t <= s, "causal_attention: queries reach past the last key");
    if t == 0 || heads == 0 || head_dim == 0 {
        return;
    }
    let group = heads / kv_heads;
    let (mut kh, mut vh, mut qh) = (Vec::new(), Vec::new(), Vec::new());
    let mut scores = Vec::new();
    let mut ctx = Vec::new();
    for kvh in 0..kv_heads {
        gather_head(k, s, kv_heads, head_dim, kvh, &mut kh);
        gather_head(v, s, kv_heads, head_dim, kvh, &mut vh);
        for h in kvh * group..(kvh + 1) * group {
            gather_head(q, t, heads, head_dim, h, &mut qh);
            for b0 in (0..t).step_by(QUERY_BLOCK) {
                let b1 = (b0 + QUERY_BLOCK).min(t);
                let rows = b1 - b0;
                // Keys past the block's last query are masked for every row of the block: leave them out.
                let keys = q_offset + b1;
                scores.resize(rows * keys, 0.0);
                matmul_nt(
                    &qh[b0 * head_dim..b1 * head_dim],
                    &kh[..keys * head_dim],
                    &mut scores,
                    rows,
                    head_dim,
                    keys,
                );
                for (r, row) in scores.chunks_exact_mut(keys).enumerate() {
                    let visible = q_offset + b0 + r + 1;
                    let (live, masked) = row.split_at_mut(visible);
                    let mut max = f32::NEG_INFINITY;
                    for x in live.iter_mut() {
                        *x *= scale;
                        max = max.max(*x);
                    }
                    let mut sum = 0.0f32;
                    for x in live.iter_mut() {
                        *x = (*x - max).exp();
                        sum += *x;
                    }
                    let inv = 1.0 / sum;
                    for x in live.iter_mut() {
                        *x *= inv;
                    }
                    masked.fill(0.0);
                }
                ctx.resize(rows * head_dim, 0.0);
                matmul_nn(&scores, &vh[..keys * head_dim], &mut ctx, rows, keys, head_dim);
                for (r, c) in ctx.chunks_exact(head_dim).enumerate() {
                    let start = ((b0 + r) * heads + h) * head_dim;
                    out[start..start + head_dim].copy_from_slice(c);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random(len: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// Per query, per head, in f64: the definition with no blocking and no GEMMs.
    #[allow(clippy::too_many_arguments)]
    fn naive(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        t: usize,
        heads: usize,
        kv_heads: usize,
        d: usize,
        q_offset: usize,
        scale: f32,
    ) -> Vec<f32> {
        let mut out = vec![0.0f32; t * heads * d];
        for i in 0..t {
            for h in 0..heads {
                let kvh = h / (heads / kv_heads);
                let qi = &q[(i * heads + h) * d..][..d];
                let n = q_offset + i + 1;
                let logits: Vec<f64> = (0..n)
                    .map(|j| {
                        let kj = &k[(j * kv_heads + kvh) * d..][..d];
                        qi.iter().zip(kj).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64
                    })
                    .collect();
                let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
                let z: f64 = w.iter().sum();
                for c in 0..d {
                    let acc: f64 = (0..n).map(|j| w[j] * v[(j * kv_heads + kvh) * d + c] as f64).sum();
                    out[(i * heads + h) * d + c] = (acc / z) as f32;
                }
            }
        }
        out
    }

    #[test]
    fn matches_naive_with_gqa_offset_and_blocks() {
        // heads / kv_heads = 3; t > QUERY_BLOCK exercises the blocking; q_offset > 0 a prompt after cached tokens.
        for &(t, q_offset, heads, kv_heads, d) in
            &[(1, 0, 3, 1, 8), (5, 7, 6, 2, 16), (150, 20, 3, 1, 8), (4, 0, 2, 2, 4)]
        {
            let s = q_offset + t;
            let q = random(t * heads * d, 1);
            let k = random(s * kv_heads * d, 2);
            let v = random(s * kv_heads * d, 3);
            let scale = 1.0 / (d as f32).sqrt();
            let mut out = vec![f32::NAN; t * heads * d];
            causal_attention(&q, &k, &v, t, s, heads, kv_heads, d, q_offset, scale, &mut out);
            let r = naive(&q, &k, &v, t, heads, kv_heads, d, q_offset, scale);
            for (a, b) in out.iter().zip(&r) {
                assert!((a - b).abs() < 1e-5, "t={t} off={q_offset}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn keys_after_the_query_do_not_matter() {
        // s larger than q_offset + t: the extra keys (future positions) must be ignored entirely.
        let (t, heads, kv_heads, d) = (3, 4, 2, 8);
        let q = random(t * heads * d, 5);
        let mut k = random(6 * kv_heads * d, 6);
        let mut v = random(6 * kv_heads * d, 7);
        let mut a = vec![0.0; t * heads * d];
        causal_attention(&q, &k, &v, t, 6, heads, kv_heads, d, 1, 0.3, &mut a);
        for x in k[4 * kv_heads * d..].iter_mut().chain(v[4 * kv_heads * d..].iter_mut()) {
            *x = 100.0;
        }
        let mut b = vec![0.0; t * heads * d];
        causal_attention(&q, &k, &v, t, 6, heads, kv_heads, d, 1, 0.3, &mut b);
        assert_eq!(a, b);
        // The first query of a fresh sequence sees only itself: its output is its own value row.
        let mut c = vec![0.0; t * heads * d];
        causal_attention(&q, &k, &v, t, 6, heads, kv_heads, d, 0, 0.3, &mut c);
        for h in 0..heads {
            let kvh = h / 2;
            assert_eq!(&c[h * d..(h + 1) * d], &v[kvh * d..(kvh + 1) * d]);
        }
    }
}
