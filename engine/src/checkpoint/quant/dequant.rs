//! Exact dequantization of quantized weights to f32, one function per published layout. Weights are
//! `[lead.., out, in]` (`lead` for stacked experts), row-major; every scale layout is checked by the caller
//! (`super::QuantizedWeight`), so these only compute. Each row is dequantized by `rewind_kernels::cpu::quant`, the
//! definition the quantized GEMVs' CPU twins share.

use rayon::prelude::*;
use rewind_kernels::cpu::quant::{dequant_fp8_row, dequant_fp8_row_scaled, dequant_nvfp4_row};

/// Rows converted per parallel task.
const ROWS: usize = 64;

fn split(shape: &[usize]) -> (usize, usize, usize) {
    let cols = shape.last().copied().unwrap_or(1);
    let rows = shape.len().checked_sub(2).map_or(1, |i| shape[i]);
    let lead = shape.iter().rev().skip(2).product();
    (lead, rows, cols)
}

/// Fine-grained FP8: `w[o, i] = e4m3(codes[o, i]) · scales[o / b0, i / b1]` per matrix, blocks `[b0, b1]`
/// (partial at the edges), `scales` `[lead.., ⌈out / b0⌉, ⌈in / b1⌉]`.
pub fn fp8_blocks(codes: &[u8], shape: &[usize], scales: &[f32], block: [usize; 2]) -> Vec<f32> {
    let (_, rows, cols) = split(shape);
    let (brows, bcols) = (rows.div_ceil(block[0]), cols.div_ceil(block[1]));
    let mut out = vec![0f32; codes.len()];
    out.par_chunks_mut(cols * ROWS)
        .zip(codes.par_chunks(cols * ROWS))
        .enumerate()
        .for_each(|(t, (dst, src))| {
            for (r, (d, s)) in dst.chunks_mut(cols).zip(src.chunks(cols)).enumerate() {
                let row = t * ROWS + r;
                let (m, o) = (row / rows, row % rows);
                let scale_row = &scales[(m * brows + o / block[0]) * bcols..][..bcols];
                dequant_fp8_row(s, scale_row, block[1], d);
            }
        });
    out
}

/// FP8 with one scale per tensor (`scales.len() == 1`) or per output row (`scales.len() == lead · out`).
pub fn fp8_scaled(codes: &[u8], shape: &[usize], scales: &[f32]) -> Vec<f32> {
    let (_, _, cols) = split(shape);
    let mut out = vec![0f32; codes.len()];
    out.par_chunks_mut(cols * ROWS)
        .zip(codes.par_chunks(cols * ROWS))
        .enumerate()
        .for_each(|(t, (dst, src))| {
            for (r, (d, s)) in dst.chunks_mut(cols).zip(src.chunks(cols)).enumerate() {
                let scale = if scales.len() == 1 {
                    scales[0]
                } else {
                    scales[t * ROWS + r]
                };
                dequant_fp8_row_scaled(s, scale, d);
            }
        });
    out
}

/// NVFP4: two E2M1 elements per byte (element `2j` in the low nibble, `2j + 1` in the high one), one E4M3 scale per
/// `group` consecutive elements of a row, and the tensor's f32 `global` scale: `w = e2m1 · e4m3(scale) · global`.
/// `shape` is the logical (unpacked) shape.
pub fn nvfp4(packed: &[u8], shape: &[usize], scales: &[u8], global: f32, group: usize) -> Vec<f32> {
    let (_, _, cols) = split(shape);
    let groups = cols / group;
    let n = packed.len() * 2;
    let mut out = vec![0f32; n];
    out.par_chunks_mut(cols * ROWS)
        .zip(packed.par_chunks(cols / 2 * ROWS))
        .enumerate()
        .for_each(|(t, (dst, src))| {
            for (r, (d, s)) in dst.chunks_mut(cols).zip(src.chunks(cols / 2)).enumerate() {
                let row_scales = &scales[(t * ROWS + r) * groups..][..groups];
                dequant_nvfp4_row(s, row_scales, global, group, d);
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rewind_kernels::cpu::quant::{f32_to_e2m1, f32_to_e4m3};

    #[test]
    fn block_scales_apply_per_block_with_partial_edges() {
        // 3 × 5 with 2 × 2 blocks: scale grid 2 × 3, edge blocks partial.
        let shape = [3, 5];
        let codes = vec![f32_to_e4m3(1.0); 15];
        let scales = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let w = fp8_blocks(&codes, &shape, &scales, [2, 2]);
        #[rustfmt::skip]
        let want = [1.0, 1.0, 2.0, 2.0, 3.0,
                    1.0, 1.0, 2.0, 2.0, 3.0,
                    4.0, 4.0, 5.0, 5.0, 6.0];
        assert_eq!(w, want);
        // Stacked: the second matrix reads the second scale grid.
        let codes = vec![f32_to_e4m3(0.5); 2 * 15];
        let scales: Vec<f32> = (1..=12).map(|x| x as f32).collect();
        let w = fp8_blocks(&codes, &[2, 3, 5], &scales, [2, 2]);
        assert_eq!(w[15], 0.5 * 7.0);
        assert_eq!(w[29], 0.5 * 12.0);
    }

    #[test]
    fn per_tensor_and_per_row_scales() {
        let codes: Vec<u8> = [1.0, -2.0, 0.5, 4.0].iter().map(|&x| f32_to_e4m3(x)).collect();
        assert_eq!(fp8_scaled(&codes, &[2, 2], &[0.5]), [0.5, -1.0, 0.25, 2.0]);
        assert_eq!(fp8_scaled(&codes, &[2, 2], &[1.0, 10.0]), [1.0, -2.0, 5.0, 40.0]);
    }

    /// The quantized GEMVs' CPU twins (the GPU kernels' references) compute what the reader's weights give: each
    /// equals dequantizing here and an f32 GEMM, up to the order of the f32 sums, on random codes and scales with
    /// partial FP8 blocks on both edges.
    #[test]
    fn the_quantized_gemv_twins_equal_dequant_then_gemm() {
        use rand::{Rng, SeedableRng};
        use rewind_kernels::cpu::gemm::matmul_nt;
        use rewind_kernels::cpu::gemv_quant::{gemv_fp8_block, gemv_fp8_scaled, gemv_nvfp4, FP8_BLOCK};

        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(45);
        // k = 2 blocks + 48 and n = 1 block + 3: partial blocks on both edges (NVFP4 needs only k % 16).
        let (rows, k, n) = (3, 2 * FP8_BLOCK + 48, FP8_BLOCK + 3);
        let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let codes: Vec<u8> = (0..n * k)
            .map(|_| rng.random::<u8>())
            .map(|b| if b & 0x7f == 0x7f { b ^ 1 } else { b })
            .collect();
        let check = |what: &str, got: Vec<f32>, w: &[f32]| {
            let mut want = vec![0f32; rows * n];
            matmul_nt(&x, w, &mut want, rows, k, n);
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                // The sums' rounding is bounded by k units of the sum of magnitudes.
                let (r, o) = (i / n, i % n);
                let mag: f32 = (0..k).map(|j| (x[r * k + j] * w[o * k + j]).abs()).sum();
                assert!(
                    (g - e).abs() <= mag * k as f32 * f32::EPSILON,
                    "{what} [{r}, {o}]: {g} vs {e}"
                );
            }
        };

        let grid = n.div_ceil(FP8_BLOCK) * k.div_ceil(FP8_BLOCK);
        let scale_inv: Vec<f32> = (0..grid).map(|_| rng.random_range(1e-4..1e-2)).collect();
        let w = fp8_blocks(&codes, &[n, k], &scale_inv, [FP8_BLOCK, FP8_BLOCK]);
        check("fp8 blocks", gemv_fp8_block(&x, &codes, &scale_inv, rows, k, n), &w);

        for scales in [vec![0.03f32], (0..n).map(|_| rng.random_range(1e-4..1e-2)).collect()] {
            let w = fp8_scaled(&codes, &[n, k], &scales);
            check("fp8 scaled", gemv_fp8_scaled(&x, &codes, &scales, rows, k, n), &w);
        }

        let packed = &codes[..n * k / 2];
        let group_scales: Vec<u8> = (0..n * k / 16)
            .map(|_| f32_to_e4m3(rng.random_range(0.01..400.0)))
            .collect();
        let w = nvfp4(packed, &[n, k], &group_scales, 0.002, 16);
        check("nvfp4", gemv_nvfp4(&x, packed, &group_scales, 0.002, rows, k, n), &w);
    }

    #[test]
    fn nvfp4_unpacks_low_nibble_first_with_group_and_global_scales() {
        // One row of 32: two groups of 16, scales 1 and 2, global 0.5.
        let vals: Vec<f32> = (0..32).map(|i| [0.5, -1.0, 6.0, 3.0][i % 4]).collect();
        let packed: Vec<u8> = vals
            .chunks(2)
            .map(|p| f32_to_e2m1(p[0]) | (f32_to_e2m1(p[1]) << 4))
            .collect();
        let scales = [f32_to_e4m3(1.0), f32_to_e4m3(2.0)];
        let w = nvfp4(&packed, &[1, 32], &scales, 0.5, 16);
        for (i, &v) in vals.iter().enumerate() {
            let s = if i < 16 { 0.5 } else { 1.0 };
            assert_eq!(w[i], v * s, "element {i}");
        }
    }
}
