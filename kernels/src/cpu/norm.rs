//! RMSNorm variants: plain (`w·x̂`), zero-centred (`(1+w)·x̂`) and grouped gated norms.

use super::act::silu;

/// Where the gate of a gated RMSNorm is applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateOrder {
    /// `rms(x · silu(z)) · w` — Mamba-2 / Nemotron-H (`norm_before_gate = False`).
    BeforeNorm,
    /// `rms(x) · w · silu(z)` — Gated DeltaNet (Qwen3-Next, Qwen3.5).
    AfterNorm,
}

fn normalise_row(row: &[f32], eps: f32, out: &mut [f32]) {
    let ms = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for (o, v) in out.iter_mut().zip(row) {
        *o = v * inv;
    }
}

/// RMSNorm over rows of width `weight.len()`: `out = x / rms(x) · (offset + w)`.
///
/// `offset` is 0 for the plain form and 1 for the zero-centred form Qwen3-Next and Qwen3.5 use.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, offset: f32, out: &mut [f32]) {
    let dim = weight.len();
    assert!(
        dim > 0 && x.len().is_multiple_of(dim),
        "rms_norm: input is not a whole number of rows"
    );
    assert_eq!(x.len(), out.len(), "rms_norm: out");
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        normalise_row(xr, eps, or);
        for (o, w) in or.iter_mut().zip(weight) {
            *o *= offset + w;
        }
    }
}

/// RMSNorm that allocates its output.
pub fn rms_norm_vec(x: &[f32], weight: &[f32], eps: f32, offset: f32) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    rms_norm(x, weight, eps, offset, &mut out);
    out
}

/// Gated RMSNorm over rows of width `weight.len()`, normalising each run of `group_size` channels separately.
pub fn gated_rms_norm(
    x: &[f32],
    z: &[f32],
    weight: &[f32],
    group_size: usize,
    eps: f32,
    order: GateOrder,
    out: &mut [f32],
) {
    let dim = weight.len();
    assert!(
        dim > 0 && group_size > 0 && dim.is_multiple_of(group_size),
        "gated_rms_norm: group size must divide the row"
    );
    assert!(
        x.len().is_multiple_of(dim),
        "gated_rms_norm: input is not a whole number of rows"
    );
    assert_eq!(x.len(), z.len(), "gated_rms_norm: gate");
    assert_eq!(x.len(), out.len(), "gated_rms_norm: out");
    let mut tmp = vec![0.0f32; group_size];
    for ((xr, zr), or) in x
        .chunks_exact(dim)
        .zip(z.chunks_exact(dim))
        .zip(out.chunks_exact_mut(dim))
    {
        for g in 0..dim / group_size {
            let r = g * group_size..(g + 1) * group_size;
            match order {
                GateOrder::BeforeNorm => {
                    for ((t, xv), zv) in tmp.iter_mut().zip(&xr[r.clone()]).zip(&zr[r.clone()]) {
                        *t = xv * silu(*zv);
                    }
                    normalise_row(&tmp, eps, &mut or[r.clone()]);
                    for (o, w) in or[r.clone()].iter_mut().zip(&weight[r.clone()]) {
                        *o *= w;
                    }
                }
                GateOrder::AfterNorm => {
                    normalise_row(&xr[r.clone()], eps, &mut or[r.clone()]);
                    for ((o, w), zv) in or[r.clone()].iter_mut().zip(&weight[r.clone()]).zip(&zr[r.clone()]) {
                        *o *= w * silu(*zv);
                    }
                }
            }
        }
    }
}

/// L2-normalises each row of width `dim` in place: `x / sqrt(Σx² + eps)` (fla's `l2norm`, as Gated DeltaNet uses).
pub fn l2_norm_rows(x: &mut [f32], dim: usize, eps: f32) {
    assert!(
        dim > 0 && x.len().is_multiple_of(dim),
        "l2_norm_rows: input is not a whole number of rows"
    );
    for row in x.chunks_exact_mut(dim) {
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
        for v in row {
            *v *= inv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_and_zero_centred() {
        let x = [3.0, 4.0];
        let rms = (12.5f32 + 1e-6).sqrt();
        let mut out = [0.0; 2];
        rms_norm(&x, &[2.0, 1.0], 1e-6, 0.0, &mut out);
        assert!((out[0] - 6.0 / rms).abs() < 1e-6 && (out[1] - 4.0 / rms).abs() < 1e-6);
        rms_norm(&x, &[2.0, 1.0], 1e-6, 1.0, &mut out);
        assert!((out[0] - 9.0 / rms).abs() < 1e-6 && (out[1] - 8.0 / rms).abs() < 1e-6);
    }

    #[test]
    fn gated_orders_differ_and_group() {
        let x = [1.0, -2.0, 0.5, 3.0];
        let z = [0.3, -1.0, 2.0, 0.1];
        let w = [1.0, 0.5, 2.0, 1.5];
        let mut before = [0.0; 4];
        let mut after = [0.0; 4];
        gated_rms_norm(&x, &z, &w, 2, 1e-5, GateOrder::BeforeNorm, &mut before);
        gated_rms_norm(&x, &z, &w, 2, 1e-5, GateOrder::AfterNorm, &mut after);
        // Group 2 of the after-norm form depends only on x[2..4].
        let n = ((0.25f32 + 9.0) / 2.0 + 1e-5).sqrt();
        assert!((after[2] - 0.5 / n * 2.0 * silu(2.0)).abs() < 1e-6);
        let g: Vec<f32> = (0..2).map(|i| x[i] * silu(z[i])).collect();
        let n0 = ((g[0] * g[0] + g[1] * g[1]) / 2.0 + 1e-5).sqrt();
        assert!((before[1] - g[1] / n0 * 0.5).abs() < 1e-6);
        assert!((before[0] - after[0]).abs() > 1e-3);
    }

    #[test]
    fn l2_rows_are_unit() {
        let mut x = [3.0, 4.0, 0.0, 5.0];
        l2_norm_rows(&mut x, 2, 0.0);
        assert_eq!(x, [0.6, 0.8, 0.0, 1.0]);
    }
}
