//! Cases for the skinny GEMMs on quantized weights (`gemv_quant.cu`) against their CPU twins
//! ([`crate::cpu::gemv_quant`]: exact dequantization, then an f32 GEMM). The storage type of a case is that of the
//! activations `x`; the output is f32 in both, so the threshold is the f32 skinny GEMM's (`gemv`): 1e-5. Rows 1, 2, 4
//! and 8 (the kernels' bound) on an odd shape whose FP8 block grid has partial blocks on both edges, a Nemotron-H-8B
//! and a Qwen3.5-4B projection; random codes (every finite E4M3 code, every E2M1 code) and scales.

use super::{rounded, Case, Check, Ctx, Rng};
use crate::cpu;
use crate::cpu::gemv_quant::{FP8_BLOCK, NVFP4_GROUP};
use crate::cpu::quant::f32_to_e4m3;
use crate::cuda::ops;
use crate::cuda::{Elem, Result};

/// The threshold of an f32 output (as `gemv`'s).
const THRESHOLD: f64 = 1e-5;

/// Registers the quantized GEMV cases.
pub(super) fn register(cases: &mut Vec<Case>) {
    let shapes = [
        (2048 + 64, 1000, "odd: partial blocks on both edges"),
        (4096, 18560, "Nemotron-H-8B Mamba in_proj"),
        (9216, 2560, "Qwen3.5-4B MLP down"),
    ];
    for (k, n, what) in shapes {
        for rows in [1, 2, 4, 8] {
            let shape = format!("[{rows}, {k}] · [{n}, {k}]ᵀ {what}");
            both!(cases, "gemv_fp8_block", shape.clone(), fp8_block(rows, k, n));
            both!(
                cases,
                "gemv_fp8_scaled",
                format!("{shape}, per tensor"),
                fp8_scaled(rows, k, n, false)
            );
            both!(
                cases,
                "gemv_fp8_scaled",
                format!("{shape}, per row"),
                fp8_scaled(rows, k, n, true)
            );
            both!(cases, "gemv_nvfp4", shape, nvfp4(rows, k, n));
        }
    }
    cases.push(Case::new(
        "gemv_fp8_block",
        "bf16",
        "[3, 2112] · [1000, 2112]ᵀ, one NaN code (0x7F): its column NaN, the rest as the twin",
        |cx, rng| fp8_nan_code(cx, rng, 3, 2112, 1000),
    ));
}

/// `len` random E4M3 codes, every finite one possible (the NaN codes 0x7F / 0xFF moved to ±448).
fn fp8_codes(rng: &mut Rng, len: usize) -> Vec<u8> {
    random_bytes(rng, len)
        .into_iter()
        .map(|b| if b & 0x7f == 0x7f { b ^ 1 } else { b })
        .collect()
}

fn random_bytes(rng: &mut Rng, len: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(len + 8);
    while bytes.len() < len {
        bytes.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    bytes.truncate(len);
    bytes
}

/// `x` rounded to the storage type `T`, as the kernel reads it.
fn activations<T: Elem>(rng: &mut Rng, rows: usize, k: usize) -> Vec<f32> {
    rounded::<T>(&rng.uniform_vec(rows * k, 1.0))
}

fn fp8_block<T: Elem>(cx: &Ctx, rng: &mut Rng, rows: usize, k: usize, n: usize) -> Result<Vec<Check>> {
    let x = activations::<T>(rng, rows, k);
    let w = fp8_codes(rng, n * k);
    let grid = n.div_ceil(FP8_BLOCK) * k.div_ceil(FP8_BLOCK);
    let s: Vec<f32> = (0..grid).map(|_| rng.uniform(1e-4, 1e-2)).collect();
    let (dx, dw, ds) = (cx.dev.upload_as::<T>(&x)?, cx.dev.upload(&w)?, cx.dev.upload(&s)?);
    let mut out = cx.dev.alloc_nan::<f32>(rows * n)?;
    ops::gemv_fp8_block(cx.dev, &dx, &dw, &ds, &mut out, rows, k, n)?;
    let want = cpu::gemv_quant::gemv_fp8_block(&x, &w, &s, rows, k, n);
    Ok(vec![Check::new("out", &cx.dev.download(&out)?, &want, THRESHOLD)])
}

fn fp8_scaled<T: Elem>(cx: &Ctx, rng: &mut Rng, rows: usize, k: usize, n: usize, per_row: bool) -> Result<Vec<Check>> {
    let x = activations::<T>(rng, rows, k);
    let w = fp8_codes(rng, n * k);
    let s: Vec<f32> = (0..if per_row { n } else { 1 })
        .map(|_| rng.uniform(1e-4, 1e-2))
        .collect();
    let (dx, dw, ds) = (cx.dev.upload_as::<T>(&x)?, cx.dev.upload(&w)?, cx.dev.upload(&s)?);
    let mut out = cx.dev.alloc_nan::<f32>(rows * n)?;
    ops::gemv_fp8_scaled(cx.dev, &dx, &dw, &ds, &mut out, rows, k, n)?;
    let want = cpu::gemv_quant::gemv_fp8_scaled(&x, &w, &s, rows, k, n);
    Ok(vec![Check::new("out", &cx.dev.download(&out)?, &want, THRESHOLD)])
}

fn nvfp4<T: Elem>(cx: &Ctx, rng: &mut Rng, rows: usize, k: usize, n: usize) -> Result<Vec<Check>> {
    let x = activations::<T>(rng, rows, k);
    let w = random_bytes(rng, n * k / 2);
    // Group scales log-uniform over E4M3's whole range, subnormal codes included.
    let s: Vec<u8> = (0..n * k / NVFP4_GROUP)
        .map(|_| f32_to_e4m3(2f32.powf(rng.uniform(-9.0, 8.8))))
        .collect();
    let global = rng.uniform(1e-4, 1e-3);
    let (dx, dw, ds) = (cx.dev.upload_as::<T>(&x)?, cx.dev.upload(&w)?, cx.dev.upload(&s)?);
    let mut out = cx.dev.alloc_nan::<f32>(rows * n)?;
    ops::gemv_nvfp4(cx.dev, &dx, &dw, &ds, global, &mut out, rows, k, n)?;
    let want = cpu::gemv_quant::gemv_nvfp4(&x, &w, &s, global, rows, k, n);
    Ok(vec![Check::new("out", &cx.dev.download(&out)?, &want, THRESHOLD)])
}

/// A NaN weight code makes its output column NaN in every row, as the CPU twin's NaN weight does; the other columns
/// are unaffected.
fn fp8_nan_code(cx: &Ctx, rng: &mut Rng, rows: usize, k: usize, n: usize) -> Result<Vec<Check>> {
    let x = activations::<half::bf16>(rng, rows, k);
    let mut w = fp8_codes(rng, n * k);
    let at = rng.below(0, n * k);
    w[at] = 0x7f;
    let s: Vec<f32> = (0..n.div_ceil(FP8_BLOCK) * k.div_ceil(FP8_BLOCK))
        .map(|_| rng.uniform(1e-4, 1e-2))
        .collect();
    let (dx, dw, ds) = (
        cx.dev.upload_as::<half::bf16>(&x)?,
        cx.dev.upload(&w)?,
        cx.dev.upload(&s)?,
    );
    let mut out = cx.dev.alloc_nan::<f32>(rows * n)?;
    ops::gemv_fp8_block(cx.dev, &dx, &dw, &ds, &mut out, rows, k, n)?;
    let got = cx.dev.download(&out)?;
    let want = cpu::gemv_quant::gemv_fp8_block(&x, &w, &s, rows, k, n);
    let column = at / k;
    let in_column = |i: usize| i % n == column;
    let nan_ok = (0..rows * n)
        .filter(|&i| in_column(i))
        .all(|i| got[i].is_nan() && want[i].is_nan());
    let (rest, rest_want): (Vec<f32>, Vec<f32>) = (0..rows * n)
        .filter(|&i| !in_column(i))
        .map(|i| (got[i], want[i]))
        .unzip();
    Ok(vec![
        Check {
            output: "NaN column",
            rel_err: if nan_ok { 0.0 } else { f64::INFINITY },
            threshold: 0.0,
        },
        Check::new("other columns", &rest, &rest_want, THRESHOLD),
    ])
}

#[cfg(test)]
mod tests {
    use super::super::cases;

    /// `rewind selftest --device cuda --only gemv_` runs these cases and nothing else (the bf16 `gemv` is not
    /// matched), each kernel at the four row counts, both activation types and every shape.
    #[test]
    fn the_only_filter_gemv_underscore_selects_the_quantized_cases() {
        let all = cases::all();
        let picked: Vec<_> = all.iter().filter(|c| c.op.contains("gemv_")).collect();
        assert!(picked
            .iter()
            .all(|c| c.op.starts_with("gemv_fp8_") || c.op == "gemv_nvfp4"));
        for op in ["gemv_fp8_block", "gemv_fp8_scaled", "gemv_nvfp4"] {
            for dtype in ["f32", "bf16"] {
                let n = picked.iter().filter(|c| c.op == op && c.dtype == dtype).count();
                // 3 shapes × rows 1, 2, 4, 8 (per tensor and per row for the scaled form; one NaN-code case).
                let want = match (op, dtype) {
                    ("gemv_fp8_scaled", _) => 24,
                    ("gemv_fp8_block", "bf16") => 13,
                    _ => 12,
                };
                assert_eq!(n, want, "{op} {dtype}");
            }
        }
    }
}
