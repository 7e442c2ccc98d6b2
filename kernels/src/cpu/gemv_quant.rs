//! Skinny GEMMs on quantized weights, `out[rows, n] = x[rows, k] · W[n, k]ᵀ` with `W` stored as a checkpoint
//! publishes it: the CPU twins of the CUDA kernels in `gemv_quant.cu`. Each is, by definition, "dequantize the weight
//! exactly ([`super::quant`]) and multiply in f32": the weight is dequantized a tile of output rows at a time (so a
//! large matrix never exists in f32 whole) and the tile multiplied by [`super::gemm::matmul_nt`].
//!
//! Layouts (weights `[n, k]` row-major, as `W.weight` is stored):
//! - [`gemv_fp8_block`]: E4M3 codes and f32 `weight_scale_inv` per [`FP8_BLOCK`]² block, `[⌈n / 128⌉, ⌈k / 128⌉]`,
//!   partial blocks at the edges (DeepSeek, Qwen3-Next, Qwen3.5);
//! - [`gemv_fp8_scaled`]: E4M3 codes and one f32 scale per tensor or per output row (ModelOpt FP8);
//! - [`gemv_nvfp4`]: E2M1 codes two per byte (low nibble first), `[n, k / 2]`, an E4M3 scale per [`NVFP4_GROUP`]
//!   elements of a row, `[n, k / 16]`, and the tensor's f32 `weight_scale_2` (ModelOpt NVFP4).

use rayon::prelude::*;

use super::gemm::matmul_nt;
use super::quant::{dequant_fp8_row, dequant_fp8_row_scaled, dequant_nvfp4_row};

/// The fine-grained FP8 block edge (rows and columns) the published checkpoints use and the kernels take.
pub const FP8_BLOCK: usize = 128;
/// Elements per E4M3 scale of an NVFP4 row.
pub const NVFP4_GROUP: usize = 16;

/// Output rows of `W` dequantized and multiplied per task.
const TILE: usize = 64;

/// `out[rows, n] = x · Wᵀ` where `dequant(o, row)` writes row `o` of `W` (`k` values) into `row`.
fn tiled(x: &[f32], rows: usize, k: usize, n: usize, dequant: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    assert_eq!(x.len(), rows * k, "quantized gemv: x");
    let tiles: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(TILE))
        .into_par_iter()
        .map(|t| {
            let (first, width) = (t * TILE, TILE.min(n - t * TILE));
            let mut w = vec![0f32; width * k];
            for (j, row) in w.chunks_mut(k.max(1)).enumerate().take(width) {
                dequant(first + j, row);
            }
            let mut part = vec![0f32; rows * width];
            matmul_nt(x, &w, &mut part, rows, k, width);
            (first, part)
        })
        .collect();
    let mut out = vec![0f32; rows * n];
    for (first, part) in tiles {
        let width = part.len() / rows.max(1);
        for r in 0..rows {
            out[r * n + first..][..width].copy_from_slice(&part[r * width..][..width]);
        }
    }
    out
}

/// Fine-grained FP8: `out[r, o] = Σ_i x[r, i] · e4m3(w[o, i]) · scale_inv[o / 128, i / 128]`. `x`: `[rows, k]`; `w`:
/// `[n, k]` E4M3 codes; `scale_inv`: `[⌈n / 128⌉, ⌈k / 128⌉]`.
pub fn gemv_fp8_block(x: &[f32], w: &[u8], scale_inv: &[f32], rows: usize, k: usize, n: usize) -> Vec<f32> {
    let bcols = k.div_ceil(FP8_BLOCK);
    assert_eq!(w.len(), n * k, "gemv_fp8_block: w");
    assert_eq!(
        scale_inv.len(),
        n.div_ceil(FP8_BLOCK) * bcols,
        "gemv_fp8_block: scale_inv"
    );
    tiled(x, rows, k, n, |o, row| {
        let scales = &scale_inv[o / FP8_BLOCK * bcols..][..bcols];
        dequant_fp8_row(&w[o * k..][..k], scales, FP8_BLOCK, row);
    })
}

/// FP8 with one scale per tensor (`scales.len() == 1`) or per output row (`scales.len() == n`):
/// `out[r, o] = Σ_i x[r, i] · e4m3(w[o, i]) · scale`.
pub fn gemv_fp8_scaled(x: &[f32], w: &[u8], scales: &[f32], rows: usize, k: usize, n: usize) -> Vec<f32> {
    assert_eq!(w.len(), n * k, "gemv_fp8_scaled: w");
    assert!(
        scales.len() == 1 || scales.len() == n,
        "gemv_fp8_scaled: {} scales for {n} rows (one, or one per row)",
        scales.len()
    );
    tiled(x, rows, k, n, |o, row| {
        let scale = if scales.len() == 1 { scales[0] } else { scales[o] };
        dequant_fp8_row_scaled(&w[o * k..][..k], scale, row);
    })
}

/// NVFP4: `out[r, o] = Σ_i x[r, i] · e2m1(w[o, i]) · (e4m3(scales[o, i / 16]) · global)`. `w`: `[n, k / 2]`, two
/// E2M1 codes per byte, element `2j` in the low nibble; `scales`: `[n, k / 16]` E4M3 codes; `global` is the
/// tensor's `weight_scale_2`. `k` is a multiple of 16.
pub fn gemv_nvfp4(x: &[f32], w: &[u8], scales: &[u8], global: f32, rows: usize, k: usize, n: usize) -> Vec<f32> {
    assert!(
        k.is_multiple_of(NVFP4_GROUP),
        "gemv_nvfp4: k {k} is not a multiple of {NVFP4_GROUP}"
    );
    let groups = k / NVFP4_GROUP;
    assert_eq!(w.len(), n * k / 2, "gemv_nvfp4: w");
    assert_eq!(scales.len(), n * groups, "gemv_nvfp4: scales");
    tiled(x, rows, k, n, |o, row| {
        dequant_nvfp4_row(
            &w[o * k / 2..][..k / 2],
            &scales[o * groups..][..groups],
            global,
            NVFP4_GROUP,
            row,
        );
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::quant::{f32_to_e2m1, f32_to_e4m3};

    /// Small weights whose every product is exact, so the expected sums are exact too.
    #[test]
    fn fp8_block_scales_follow_the_block_grid_with_partial_edges() {
        // 130 × 132: a 2 × 2 scale grid whose second row and column are partial (2 and 4 wide).
        let (rows, k, n) = (2, 132, 130);
        let w = vec![f32_to_e4m3(0.5); n * k];
        let scale_inv = [1.0, 2.0, 4.0, 8.0];
        let mut x = vec![1.0f32; rows * k];
        x[k..].iter_mut().for_each(|v| *v = -2.0);
        let out = gemv_fp8_block(&x, &w, &scale_inv, rows, k, n);
        // Output row o < 128 sums 128 columns at scale 1 and 4 at scale 2; o ≥ 128 at 4 and 8.
        let top = 0.5 * (128.0 * 1.0 + 4.0 * 2.0);
        let bottom = 0.5 * (128.0 * 4.0 + 4.0 * 8.0);
        for o in 0..n {
            let want = if o < 128 { top } else { bottom };
            assert_eq!(out[o], want, "row 0, column {o}");
            assert_eq!(out[n + o], -2.0 * want, "row 1, column {o}");
        }
    }

    #[test]
    fn fp8_scaled_takes_one_scale_or_one_per_row() {
        let (k, n) = (3, 2);
        let w: Vec<u8> = [1.0, -2.0, 0.5, 4.0, 1.5, -1.0]
            .iter()
            .map(|&v| f32_to_e4m3(v))
            .collect();
        let x = [1.0, 2.0, 4.0];
        assert_eq!(gemv_fp8_scaled(&x, &w, &[0.5], 1, k, n), [-0.5, 1.5]);
        assert_eq!(gemv_fp8_scaled(&x, &w, &[1.0, 10.0], 1, k, n), [-1.0, 30.0]);
    }

    #[test]
    fn nvfp4_reads_low_nibbles_first_and_a_scale_per_16() {
        // One output row of 32: element i is 1 at i = 0, 3 at i = 1 (its high nibble), 6 at i = 17; scales 2 and 4,
        // global 0.25.
        let mut vals = [0.0f32; 32];
        (vals[0], vals[1], vals[17]) = (1.0, 3.0, 6.0);
        let w: Vec<u8> = vals
            .chunks(2)
            .map(|p| f32_to_e2m1(p[0]) | (f32_to_e2m1(p[1]) << 4))
            .collect();
        let scales = [f32_to_e4m3(2.0), f32_to_e4m3(4.0)];
        let mut x = vec![0.0f32; 32];
        (x[0], x[1], x[17]) = (1.0, 10.0, 100.0);
        let out = gemv_nvfp4(&x, &w, &scales, 0.25, 1, 32, 1);
        assert_eq!(out, [1.0 * 0.5 + 30.0 * 0.5 + 600.0 * 1.0]);
    }

    #[test]
    fn tiles_cover_every_output_column() {
        // More columns than one tile, not a whole number of tiles: each column is its own value.
        let (rows, k, n) = (3, 16, TILE * 2 + 5);
        let w: Vec<u8> = (0..n * k)
            .map(|i| f32_to_e4m3(if i % k == 0 { (i / k) as f32 } else { 0.0 }))
            .collect();
        let x: Vec<f32> = (0..rows * k)
            .map(|i| if i % k == 0 { (i / k + 1) as f32 } else { 0.5 })
            .collect();
        let out = gemv_fp8_scaled(&x, &w, &[1.0], rows, k, n);
        for r in 0..rows {
            for o in 0..n {
                let code = f32_to_e4m3(o as f32);
                let want = (r + 1) as f32 * crate::cpu::quant::e4m3_to_f32(code);
                assert_eq!(out[r * n + o], want, "[{r}, {o}]");
            }
        }
    }
}
