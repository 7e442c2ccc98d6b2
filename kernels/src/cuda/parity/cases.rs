//! The case table: conversions, activations, norms, RoPE, embedding, GEMMs and NVRTC behaviour (the recurrent ops
//! are in `cases_ssm`). Shapes come from `targets.md` (Nemotron-H-8B, Nemotron-Nano-9B-v2, Qwen3.5-4B/9B, ...) plus
//! small odd ones that leave partial blocks and warps.

use half::bf16;

use super::{
    cases_accept, cases_chain, cases_chain_spec, cases_gemv_quant, cases_glue, cases_head, cases_moe, cases_replay,
    cases_sample, cases_seq, cases_spec_baseline, cases_ssm, rounded, tol, Case, Check, Ctx, Rng,
};
use crate::cpu;
use crate::cpu::norm::GateOrder;
use crate::cuda::ops::{self, Activation};
use crate::cuda::{nvrtc, CudaError, Elem, Result};

/// Every parity case, in the order the selftest prints them.
pub fn all() -> Vec<Case> {
    let mut cases = Vec::new();
    cases.push(Case::new("nvrtc_error_log", "-", "broken source", nvrtc_error_log));
    cases.push(Case::new("nvrtc_cache", "-", "module act", nvrtc_cache));
    for n in [1_000_003usize, 8 * 4096 + 5] {
        cases.push(Case::new("cast", "f32→bf16", format!("[{n}]"), move |cx, rng| {
            cast_to_bf16(cx, rng, n)
        }));
        cases.push(Case::new("cast", "bf16→f32", format!("[{n}]"), move |cx, rng| {
            cast_to_f32(cx, rng, n)
        }));
    }
    for (f, scale) in [
        (Activation::Silu, 8.0f32),
        (Activation::Sigmoid, 8.0),
        (Activation::Softplus, 30.0),
        (Activation::Relu2, 4.0),
    ] {
        for (n, what) in [
            (8 * 21504, "8 × 21504, Nemotron-H-8B MLP"),
            (3 * 9216 + 7, "3 × 9216 + 7 (scalar)"),
        ] {
            both!(cases, "activation", format!("{f:?} [{what}]"), activation(f, n, scale));
        }
    }
    for (rows, dim, what) in [
        (4, 9216, "Qwen3.5-4B MLP"),
        (3, 12288, "Qwen3.5-9B MLP"),
        (1, 1000, "odd"),
        (1, 1001, "odd, not a whole vector (scalar)"),
    ] {
        both!(cases, "swiglu", format!("[{rows}, {dim}] {what}"), swiglu(rows * dim));
    }
    for (rows, dim, offset, what) in [
        (4, 4096, 0.0f32, "Nemotron-H-8B"),
        (2, 4480, 0.0, "Nemotron-Nano-9B-v2"),
        (7, 2560, 1.0, "Qwen3.5-4B, zero-centred"),
        (3, 100, 1.0, "odd, zero-centred"),
    ] {
        both!(
            cases,
            "rms_norm",
            format!("[{rows}, {dim}] {what}"),
            rms_norm(rows, dim, offset)
        );
    }
    for (rows, dim, group, order, what) in [
        (3, 8192, 1024, GateOrder::BeforeNorm, "Nemotron-H-8B Mamba"),
        (2, 10240, 1280, GateOrder::BeforeNorm, "Nemotron-Nano-9B-v2 Mamba"),
        (4 * 32, 128, 128, GateOrder::AfterNorm, "Qwen3.5-4B GDN, per head"),
        (2, 96, 32, GateOrder::BeforeNorm, "odd"),
        (2, 96, 32, GateOrder::AfterNorm, "odd"),
    ] {
        let shape = format!("[{rows}, {dim}] group {group} {order:?}, {what}");
        both!(
            cases,
            "gated_rms_norm",
            shape,
            gated_rms_norm(rows, dim, group, order, 0, dim)
        );
    }
    // z read in place out of the projection's rows, as the GPU runner does (Nemotron-H-8B: z at column 0 of 18 560;
    // Qwen3.5-4B: at column 8192 of 12 352, the last row ending before the buffer does).
    both!(
        cases,
        "gated_rms_norm",
        "[64, 8192] group 1024 BeforeNorm, z at column 0 of 18560, Nemotron-H-8B Mamba",
        gated_rms_norm(64, 8192, 1024, GateOrder::BeforeNorm, 0, 18560)
    );
    both!(
        cases,
        "gated_rms_norm",
        "[8, 4096] group 128 AfterNorm, z at column 8192 of 12352, Qwen3.5-4B GDN",
        gated_rms_norm(8, 4096, 128, GateOrder::AfterNorm, 8192, 12352)
    );
    for (rows, heads, dim, offset, stride, scale, what) in [
        (64, 1, 128, 0, 128, 1.0, "Qwen3.5-4B q/k heads"),
        (3, 1, 100, 0, 100, 1.0, "odd"),
        (
            64,
            16,
            128,
            0,
            8192,
            0.088_388_35,
            "Qwen3.5-4B q in place in the conv output, scaled",
        ),
        (64, 16, 128, 2048, 8192, 1.0, "Qwen3.5-4B k in place in the conv output"),
        (5, 3, 20, 7, 97, 0.5, "odd, strided"),
    ] {
        let shape =
            format!("{rows} rows × {heads} heads of {dim} at column {offset} of {stride}, scale {scale}, {what}");
        both!(
            cases,
            "l2_norm",
            shape,
            l2_norm(rows, heads, dim, offset, stride, scale)
        );
    }
    for (rows, heads, head_dim, rotary, theta, what) in [
        (9, 16, 256, 64, 1.0e7f32, "Qwen3.5-4B q, partial 0.25"),
        (9, 4, 256, 64, 1.0e7, "Qwen3.5-4B k"),
        (5, 8, 128, 128, 1.0e6, "full rotary"),
        (3, 3, 20, 12, 1.0e4, "odd"),
    ] {
        let shape = format!("[{rows}, {heads}, {head_dim}] rotary {rotary}, {what}");
        both!(cases, "rope", shape, rope(rows, heads, head_dim, rotary, theta));
    }
    for (vocab, dim, n, what) in [
        (8192, 4096, 37, "Nemotron-H-8B width"),
        (1000, 2560, 5, "Qwen3.5-4B width"),
    ] {
        both!(
            cases,
            "embedding",
            format!("vocab {vocab} × {dim}, {n} ids, {what}"),
            embedding(vocab, dim, n)
        );
    }
    for (rows, k, n, what) in [
        (8, 4096, 18560, "Nemotron-H-8B Mamba in_proj"),
        (5, 2560, 9216, "Qwen3.5-4B MLP gate"),
        (64, 4096, 4096, "Nemotron-H-8B o_proj, 64 rows"),
        (3, 100, 37, "odd"),
    ] {
        both!(
            cases,
            "linear",
            format!("[{rows}, {k}] · [{n}, {k}]ᵀ {what}"),
            linear(rows, k, n)
        );
    }
    for (rows, k, n, what) in [
        (1, 4096, 18560, "Nemotron-H-8B Mamba in_proj, decode at batch 1"),
        (5, 4096, 21504, "Nemotron-H-8B MLP up, a verify of T = 4"),
        (8, 21504, 4096, "Nemotron-H-8B MLP down, 8 rows"),
        (1, 4096, 32768, "an LM-head chunk"),
        (2, 2560, 9217, "Qwen3.5-4B width, odd columns"),
        (3, 104, 37, "small, odd"),
    ] {
        both!(
            cases,
            "gemv",
            format!("[{rows}, {k}] · [{n}, {k}]ᵀ {what}"),
            gemv(rows, k, n)
        );
    }
    cases_gemv_quant::register(&mut cases);
    for (rows, k, n, bias, what) in [
        (8, 4096, 4096, true, "Nemotron-H-8B width, bias"),
        (5, 2560, 9216, false, "Qwen3.5-4B MLP gate"),
        (3, 104, 40, true, "small, bias"),
    ] {
        let shape = format!("[{rows}, {k}] · [{n}, {k}]ᵀ {what}");
        cases.push(Case::new("linear_lt", "bf16", shape, move |cx, rng| {
            linear_lt(cx, rng, rows, k, n, bias)
        }));
    }
    cases_ssm::register(&mut cases);
    cases_replay::register(&mut cases);
    cases_spec_baseline::register(&mut cases);
    cases_seq::register(&mut cases);
    cases_moe::register(&mut cases);
    cases_glue::register(&mut cases);
    cases_sample::register(&mut cases);
    cases_head::register(&mut cases);
    cases_accept::register(&mut cases);
    cases_chain::register(&mut cases);
    cases_chain_spec::register(&mut cases);
    cases
}

/// A check that holds or not (rel_err 0 or ∞).
fn verdict(output: &'static str, ok: bool) -> Check {
    Check {
        output,
        rel_err: if ok { 0.0 } else { f64::INFINITY },
        threshold: 0.0,
    }
}

fn target(cx: &Ctx) -> Result<String> {
    nvrtc::target_for(cx.dev.arch(), &nvrtc::supported_archs()?)
}

/// A source with an error must come back as `Compile` with NVRTC's log naming the culprit.
fn nvrtc_error_log(cx: &Ctx, _rng: &mut Rng) -> Result<Vec<Check>> {
    let src = "extern \"C\" __global__ void k(float* x) { x[0] = undefined_in_selftest; }\n";
    let ok = match nvrtc::compile("selftest_broken", src, &target(cx)?) {
        Err(CudaError::Compile { log, .. }) => log.contains("undefined_in_selftest"),
        _ => false,
    };
    Ok(vec![verdict("log", ok)])
}

/// After the device opened, every module is in the on-disk cache, so asking again must hit it.
fn nvrtc_cache(cx: &Ctx, _rng: &mut Rng) -> Result<Vec<Check>> {
    let module = nvrtc::MODULES.iter().find(|m| m.name == "act").copied();
    let ok = match module {
        Some(m) => nvrtc::cache_dir().is_some() && nvrtc::compile_cached(&m, cx.dev.arch())?.cached,
        None => false,
    };
    Ok(vec![verdict("cached", ok)])
}

fn cast_to_bf16(cx: &Ctx, rng: &mut Rng, n: usize) -> Result<Vec<Check>> {
    let x = rng.uniform_vec(n, 100.0);
    let dx = cx.dev.upload(&x)?;
    let mut out = cx.dev.alloc_nan::<bf16>(n)?;
    ops::cast_f32_to_bf16(cx.dev, &dx, &mut out)?;
    Ok(vec![Check::new(
        "out",
        &cx.dev.download_f32(&out)?,
        &rounded::<bf16>(&x),
        0.0,
    )])
}

fn cast_to_f32(cx: &Ctx, rng: &mut Rng, n: usize) -> Result<Vec<Check>> {
    let x = rounded::<bf16>(&rng.uniform_vec(n, 100.0));
    let dx = cx.dev.upload_as::<bf16>(&x)?;
    let mut out = cx.dev.alloc_nan::<f32>(n)?;
    ops::cast_bf16_to_f32(cx.dev, &dx, &mut out)?;
    Ok(vec![Check::new("out", &cx.dev.download(&out)?, &x, 0.0)])
}

fn activation<T: Elem>(cx: &Ctx, rng: &mut Rng, f: Activation, n: usize, scale: f32) -> Result<Vec<Check>> {
    let x = rounded::<T>(&rng.uniform_vec(n, scale));
    let dx = cx.dev.upload_as::<T>(&x)?;
    let mut out = cx.dev.alloc_nan::<T>(n)?;
    ops::activation(cx.dev, f, &dx, &mut out)?;
    let want: Vec<f32> = x.iter().map(|&v| f.cpu()(v)).collect();
    Ok(vec![Check::new("out", &cx.dev.download_f32(&out)?, &want, tol::<T>())])
}

fn swiglu<T: Elem>(cx: &Ctx, rng: &mut Rng, n: usize) -> Result<Vec<Check>> {
    let gate = rounded::<T>(&rng.uniform_vec(n, 6.0));
    let up = rounded::<T>(&rng.uniform_vec(n, 2.0));
    let (dg, du) = (cx.dev.upload_as::<T>(&gate)?, cx.dev.upload_as::<T>(&up)?);
    let mut out = cx.dev.alloc_nan::<T>(n)?;
    ops::swiglu(cx.dev, &dg, &du, &mut out)?;
    let mut want = gate.clone();
    cpu::act::swiglu_inplace(&mut want, &up);
    Ok(vec![Check::new("out", &cx.dev.download_f32(&out)?, &want, tol::<T>())])
}

fn rms_norm<T: Elem>(cx: &Ctx, rng: &mut Rng, rows: usize, dim: usize, offset: f32) -> Result<Vec<Check>> {
    let x = rounded::<T>(&rng.uniform_vec(rows * dim, 2.0));
    let w: Vec<f32> = (0..dim)
        .map(|_| {
            if offset == 0.0 {
                rng.uniform(0.5, 1.5)
            } else {
                rng.uniform(-0.5, 0.5)
            }
        })
        .collect();
    let w = rounded::<T>(&w);
    let eps = 1e-5;
    let (dx, dw) = (cx.dev.upload_as::<T>(&x)?, cx.dev.upload_as::<T>(&w)?);
    let mut out = cx.dev.alloc_nan::<T>(rows * dim)?;
    ops::rms_norm(cx.dev, &dx, &dw, eps, offset, &mut out)?;
    let want = cpu::norm::rms_norm_vec(&x, &w, eps, offset);
    Ok(vec![Check::new("out", &cx.dev.download_f32(&out)?, &want, tol::<T>())])
}

#[allow(clippy::too_many_arguments)]
fn gated_rms_norm<T: Elem>(
    cx: &Ctx,
    rng: &mut Rng,
    rows: usize,
    dim: usize,
    group: usize,
    order: GateOrder,
    z_offset: usize,
    z_stride: usize,
) -> Result<Vec<Check>> {
    let x = rounded::<T>(&rng.uniform_vec(rows * dim, 2.0));
    let z_wide = rounded::<T>(&rng.uniform_vec(rows * z_stride, 4.0));
    let z: Vec<f32> = z_wide
        .chunks(z_stride)
        .flat_map(|r| r[z_offset..z_offset + dim].to_vec())
        .collect();
    let w: Vec<f32> = (0..dim).map(|_| rng.uniform(0.5, 1.5)).collect();
    let w = rounded::<T>(&w);
    let eps = 1e-6;
    let (dx, dz, dw) = (
        cx.dev.upload_as::<T>(&x)?,
        cx.dev.upload_as::<T>(&z_wide)?,
        cx.dev.upload_as::<T>(&w)?,
    );
    let mut out = cx.dev.alloc_nan::<T>(rows * dim)?;
    let dz = dz.slice(z_offset..);
    ops::gated_rms_norm(cx.dev, &dx, &dz, z_stride, &dw, group, eps, order, &mut out)?;
    let mut want = vec![0.0; rows * dim];
    cpu::norm::gated_rms_norm(&x, &z, &w, group, eps, order, &mut want);
    Ok(vec![Check::new("out", &cx.dev.download_f32(&out)?, &want, tol::<T>())])
}

#[allow(clippy::too_many_arguments)]
fn l2_norm<T: Elem>(
    cx: &Ctx,
    rng: &mut Rng,
    rows: usize,
    heads: usize,
    dim: usize,
    offset: usize,
    stride: usize,
    scale: f32,
) -> Result<Vec<Check>> {
    let wide = rounded::<T>(&rng.uniform_vec(rows * stride, 3.0));
    let eps = 1e-6;
    let dx = cx.dev.upload_as::<T>(&wide)?;
    let mut out = cx.dev.alloc_nan::<T>(rows * heads * dim)?;
    let x = dx.slice(offset..);
    ops::l2_norm(cx.dev, &x, rows, heads, dim, stride, eps, scale, &mut out)?;
    let mut want: Vec<f32> = wide
        .chunks(stride)
        .flat_map(|r| r[offset..offset + heads * dim].to_vec())
        .collect();
    cpu::norm::l2_norm_rows(&mut want, dim, eps);
    want.iter_mut().for_each(|v| *v *= scale);
    Ok(vec![Check::new("out", &cx.dev.download_f32(&out)?, &want, tol::<T>())])
}

fn rope<T: Elem>(
    cx: &Ctx,
    rng: &mut Rng,
    rows: usize,
    heads: usize,
    head_dim: usize,
    rotary: usize,
    theta: f32,
) -> Result<Vec<Check>> {
    let x = rounded::<T>(&rng.uniform_vec(rows * heads * head_dim, 1.0));
    // Position 0 and a long-context position among random ones.
    let mut positions: Vec<usize> = (0..rows).map(|_| rng.below(0, 200_000)).collect();
    positions[0] = 0;
    if rows > 1 {
        positions[rows - 1] = 262_143;
    }
    let pos_i32: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    let mut dx = cx.dev.upload_as::<T>(&x)?;
    let dp = cx.dev.upload(&pos_i32)?;
    let df = cx.dev.upload(&cpu::rope::inv_freq(rotary, theta))?;
    ops::rope(cx.dev, &mut dx, &dp, &df, rows, heads, head_dim, rotary)?;
    let mut want = x.clone();
    cpu::rope::apply_rope(&mut want, rows, heads, head_dim, rotary, &positions, theta);
    Ok(vec![Check::new("x", &cx.dev.download_f32(&dx)?, &want, tol::<T>())])
}

fn embedding<T: Elem>(cx: &Ctx, rng: &mut Rng, vocab: usize, dim: usize, n: usize) -> Result<Vec<Check>> {
    let table = rounded::<T>(&rng.uniform_vec(vocab * dim, 1.0));
    let mut ids: Vec<usize> = (0..n).map(|_| rng.below(0, vocab)).collect();
    ids[0] = 0;
    ids[n - 1] = vocab - 1;
    let ids_i32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
    let (dt, di) = (cx.dev.upload_as::<T>(&table)?, cx.dev.upload(&ids_i32)?);
    let mut out = cx.dev.alloc_nan::<T>(n * dim)?;
    ops::embedding(cx.dev, &dt, &di, dim, &mut out)?;
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&i| table[i * dim..(i + 1) * dim].iter().copied())
        .collect();
    Ok(vec![Check::new("out", &cx.dev.download_f32(&out)?, &want, 0.0)])
}

/// bf16 operands; `T` is the output storage. The reference multiplies the same bf16 values in f32.
fn linear<T: Elem>(cx: &Ctx, rng: &mut Rng, rows: usize, k: usize, n: usize) -> Result<Vec<Check>> {
    let x = rounded::<bf16>(&rng.uniform_vec(rows * k, 1.0));
    let w = rounded::<bf16>(&rng.uniform_vec(n * k, 1.0));
    let (dx, dw) = (cx.dev.upload_as::<bf16>(&x)?, cx.dev.upload_as::<bf16>(&w)?);
    let mut out = cx.dev.alloc_nan::<T>(rows * n)?;
    cx.blas.linear(&dx, &dw, &mut out, rows, k, n)?;
    let mut want = vec![0.0; rows * n];
    cpu::gemm::matmul_nt(&x, &w, &mut want, rows, k, n);
    let threshold = if T::NAME == "f32" { 1e-3 } else { 1e-2 };
    Ok(vec![Check::new("out", &cx.dev.download_f32(&out)?, &want, threshold)])
}

/// The skinny GEMM of `gemv.cu` against the same reference as [`linear`].
fn gemv<T: Elem>(cx: &Ctx, rng: &mut Rng, rows: usize, k: usize, n: usize) -> Result<Vec<Check>> {
    let x = rounded::<bf16>(&rng.uniform_vec(rows * k, 1.0));
    let w = rounded::<bf16>(&rng.uniform_vec(n * k, 1.0));
    let (dx, dw) = (cx.dev.upload_as::<bf16>(&x)?, cx.dev.upload_as::<bf16>(&w)?);
    let mut out = cx.dev.alloc_nan::<T>(rows * n)?;
    ops::gemv(cx.dev, &dx, &dw, &mut out, rows, k, n)?;
    let mut want = vec![0.0; rows * n];
    cpu::gemm::matmul_nt(&x, &w, &mut want, rows, k, n);
    let threshold = if T::NAME == "f32" { 1e-5 } else { 1e-2 };
    Ok(vec![Check::new("out", &cx.dev.download_f32(&out)?, &want, threshold)])
}

fn linear_lt(cx: &Ctx, rng: &mut Rng, rows: usize, k: usize, n: usize, bias: bool) -> Result<Vec<Check>> {
    let x = rounded::<bf16>(&rng.uniform_vec(rows * k, 1.0));
    let w = rounded::<bf16>(&rng.uniform_vec(n * k, 1.0));
    let b = bias.then(|| rounded::<bf16>(&rng.uniform_vec(n, 4.0)));
    let (dx, dw) = (cx.dev.upload_as::<bf16>(&x)?, cx.dev.upload_as::<bf16>(&w)?);
    let db = b.as_ref().map(|b| cx.dev.upload_as::<bf16>(b)).transpose()?;
    let mut out = cx.dev.alloc_nan::<bf16>(rows * n)?;
    cx.blas.linear_lt(&dx, &dw, db.as_ref(), &mut out, rows, k, n)?;
    let want = cpu::gemm::linear(&x, &w, b.as_deref(), rows, k, n);
    Ok(vec![Check::new("out", &cx.dev.download_f32(&out)?, &want, 1e-2)])
}
