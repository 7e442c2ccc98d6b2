//! Rotary position embedding, NeoX style (`rotate_half`), on the leading `rotary_dim` channels of each head.
//!
//! Numerics follow transformers' default rope exactly: `inv_freq[j] = 1 / theta^((2j) / rotary_dim)` computed in f32,
//! the angle `position · inv_freq[j]` as one f32 product, `cos`/`sin` in f32, and the channel pairing of
//! `cat(freqs, freqs)` with `rotate_half`: channel `j` pairs with channel `j + rotary_dim / 2`.
//!
//! Qwen3.5's multimodal rope (`mrope_section`, interleaved) computes the same angles for three position rows
//! (temporal, height, width) and then takes, per frequency index, the angle of one of the rows. For text every
//! token's three position ids are equal (`Qwen3_5TextModel.forward` expands one `arange` to all rows), so the
//! recomposition picks identical values and the result is this plain rope. The test `mrope_text_reduces_to_rope`
//! re-implements the recomposition and checks that.

/// The inverse frequencies of the rotary embedding, `rotary_dim / 2` of them, exactly as transformers computes them.
pub fn inv_freq(rotary_dim: usize, theta: f32) -> Vec<f32> {
    (0..rotary_dim / 2)
        .map(|j| 1.0 / theta.powf((2 * j) as f32 / rotary_dim as f32))
        .collect()
}

/// Applies rotary embedding in place to `x` laid out `[seq, heads, head_dim]`; row `i` sits at position `positions[i]`.
///
/// Only the first `rotary_dim` channels of each head rotate (partial rotary); the rest are left untouched.
pub fn apply_rope(
    x: &mut [f32],
    seq: usize,
    heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    positions: &[usize],
    theta: f32,
) {
    assert_eq!(x.len(), seq * heads * head_dim, "apply_rope: x");
    assert_eq!(positions.len(), seq, "apply_rope: positions");
    assert!(
        rotary_dim.is_multiple_of(2) && rotary_dim <= head_dim,
        "apply_rope: rotary_dim must be even and at most head_dim"
    );
    if rotary_dim == 0 || heads == 0 {
        return;
    }
    let half = rotary_dim / 2;
    let inv = inv_freq(rotary_dim, theta);
    let mut cos = vec![0.0f32; half];
    let mut sin = vec![0.0f32; half];
    for (row, &p) in x.chunks_exact_mut(heads * head_dim).zip(positions) {
        for ((c, s), f) in cos.iter_mut().zip(sin.iter_mut()).zip(&inv) {
            let angle = p as f32 * f;
            *c = angle.cos();
            *s = angle.sin();
        }
        for head in row.chunks_exact_mut(head_dim) {
            let (lo, hi) = head[..rotary_dim].split_at_mut(half);
            for j in 0..half {
                let (a, b) = (lo[j], hi[j]);
                // x·cos + rotate_half(x)·sin, with rotate_half(x) = [−x_hi, x_lo].
                lo[j] = a * cos[j] - b * sin[j];
                hi[j] = b * cos[j] + a * sin[j];
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

    /// The textbook formula, element by element, in f64 for the rotation itself.
    fn naive(x: &[f32], heads: usize, head_dim: usize, rotary_dim: usize, positions: &[usize], theta: f32) -> Vec<f32> {
        let half = rotary_dim / 2;
        let mut out = x.to_vec();
        for (i, &p) in positions.iter().enumerate() {
            for h in 0..heads {
                let base = (i * heads + h) * head_dim;
                for c in 0..rotary_dim {
                    let j = c % half;
                    let inv = 1.0 / theta.powf((2 * j) as f32 / rotary_dim as f32);
                    let angle = (p as f32 * inv) as f64;
                    let rotated = if c < half {
                        -x[base + c + half]
                    } else {
                        x[base + c - half]
                    };
                    out[base + c] = (x[base + c] as f64 * angle.cos() + rotated as f64 * angle.sin()) as f32;
                }
            }
        }
        out
    }

    #[test]
    fn matches_naive_formula_with_partial_rotary() {
        let (seq, heads, head_dim) = (5, 3, 16);
        let positions = [0, 1, 7, 300, 4097];
        for &(rotary_dim, theta) in &[(16, 10_000.0f32), (4, 10_000_000.0), (8, 500_000.0)] {
            let x = random(seq * heads * head_dim, rotary_dim as u64);
            let mut y = x.clone();
            apply_rope(&mut y, seq, heads, head_dim, rotary_dim, &positions, theta);
            let r = naive(&x, heads, head_dim, rotary_dim, &positions, theta);
            for (a, b) in y.iter().zip(&r) {
                assert!((a - b).abs() < 1e-5, "rotary_dim {rotary_dim}: {a} vs {b}");
            }
            // Channels past rotary_dim are untouched, bit for bit.
            for (row_y, row_x) in y.chunks(head_dim).zip(x.chunks(head_dim)) {
                assert_eq!(&row_y[rotary_dim..], &row_x[rotary_dim..]);
            }
        }
    }

    #[test]
    fn position_zero_is_identity_and_rotation_preserves_pair_norms() {
        let x = random(2 * 8, 3);
        let mut y = x.clone();
        apply_rope(&mut y, 1, 2, 8, 8, &[0], 10_000.0);
        assert_eq!(&y[..], &x[..]);
        let mut z = x.clone();
        apply_rope(&mut z, 1, 2, 8, 8, &[123], 10_000.0);
        for h in 0..2 {
            for j in 0..4 {
                let (a, b) = (x[h * 8 + j], x[h * 8 + j + 4]);
                let (c, d) = (z[h * 8 + j], z[h * 8 + j + 4]);
                assert!(((a * a + b * b) - (c * c + d * d)).abs() < 1e-5);
            }
        }
        assert!(z.iter().zip(&x).any(|(a, b)| (a - b).abs() > 1e-3));
    }

    /// Qwen3.5's `Qwen3_5TextRotaryEmbedding.recomposition_frequencies` with `mrope_section`: start from the temporal
    /// row's angles, then overwrite indices `1, 4, 7, ..` (< 3·section[1]) with the height row's and `2, 5, 8, ..`
    /// (< 3·section[2]) with the width row's.
    fn mrope_angles(inv: &[f32], pos_thw: [usize; 3], section: [usize; 3]) -> Vec<f32> {
        let rows: Vec<Vec<f32>> = pos_thw
            .iter()
            .map(|&p| inv.iter().map(|f| p as f32 * f).collect())
            .collect();
        let mut out = rows[0].clone();
        for (dim, offset) in [(1usize, 1usize), (2, 2)] {
            let mut j = offset;
            while j < section[dim] * 3 && j < out.len() {
                out[j] = rows[dim][j];
                j += 3;
            }
        }
        out
    }

    fn rope_with_angles(x: &mut [f32], head_dim: usize, rotary_dim: usize, angles: &[f32]) {
        let half = rotary_dim / 2;
        for head in x.chunks_exact_mut(head_dim) {
            for j in 0..half {
                let (a, b) = (head[j], head[j + half]);
                head[j] = a * angles[j].cos() - b * angles[j].sin();
                head[j + half] = b * angles[j].cos() + a * angles[j].sin();
            }
        }
    }

    #[test]
    fn mrope_text_reduces_to_rope() {
        // Qwen3.5 shapes: head_dim 256, partial_rotary_factor 0.25 → rotary_dim 64, 32 frequencies = 11 + 11 + 10.
        let (heads, head_dim, rotary_dim, theta) = (2, 256, 64, 10_000_000.0f32);
        let section = [11, 11, 10];
        let inv = inv_freq(rotary_dim, theta);
        for &p in &[0usize, 5, 1000, 70_000] {
            let x = random(heads * head_dim, p as u64 + 11);
            let mut plain = x.clone();
            apply_rope(&mut plain, 1, heads, head_dim, rotary_dim, &[p], theta);
            let mut m = x.clone();
            rope_with_angles(&mut m, head_dim, rotary_dim, &mrope_angles(&inv, [p, p, p], section));
            assert_eq!(plain, m, "position {p}");
        }
        // With distinct rows (an image token) the recomposition does matter, so the check above is not vacuous.
        let x = random(heads * head_dim, 99);
        let mut plain = x.clone();
        apply_rope(&mut plain, 1, heads, head_dim, rotary_dim, &[40], theta);
        let mut m = x.clone();
        rope_with_angles(&mut m, head_dim, rotary_dim, &mrope_angles(&inv, [40, 3, 9], section));
        assert_ne!(plain, m);
    }
}
