//! Cases for MoE: both routers against their CPU twins (ids exact, weights to f32 tolerance), and the grouped expert
//! pass (device-side grouping, grouped GEMMs, activation, combine) against a CPU loop over experts.
//!
//! At the real shapes a full set of distinct expert weights would take minutes to draw on the host, so the weights of
//! expert `e` there are copy `e % distinct` of a few distinct random experts, expanded on the device; `distinct` is
//! prime and not a divisor of the expert count, so an off-by-one expert still reads different weights. The odd shapes
//! use fully distinct experts.

use super::{rounded, tol, Case, Check, Ctx, Rng};
use crate::cpu;
use crate::cuda::ops::{self, Activation, MoeKernel, SigmoidRouting};
use crate::cuda::{CudaSlice, Elem, Result};

/// One grouped-expert case.
#[derive(Clone, Copy, Debug)]
struct ExpertCase {
    tokens: usize,
    hidden: usize,
    inter: usize,
    experts: usize,
    top_k: usize,
    /// SwiGLU with separate gate and up weights (Qwen) rather than relu² of up (Nemotron-H).
    gated: bool,
    /// Distinct expert weight sets (see the module docs).
    distinct: usize,
}

/// Registers the MoE cases.
pub(super) fn register(cases: &mut Vec<Case>) {
    for (tokens, experts, top_k, norm, what) in [
        (64, 512, 10, true, "Qwen3-Next 512 experts top-10"),
        (64, 256, 8, true, "Qwen3.5-35B-A3B 256 experts top-8"),
        (5, 37, 3, false, "odd, no renormalisation"),
    ] {
        let shape = format!("{tokens} tokens, {experts} experts top-{top_k}, norm {norm}, {what}");
        cases.push(Case::new("route_softmax", "f32", shape, move |cx, rng| {
            route_softmax(cx, rng, tokens, experts, top_k, norm)
        }));
    }
    let sig = |experts, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor| SigmoidRouting {
        experts,
        top_k,
        n_group,
        topk_group,
        norm_topk_prob,
        routed_scaling_factor,
    };
    for (tokens, cfg, what) in [
        (64, sig(128, 6, 1, 1, true, 2.5), "Nemotron-3-Nano 128 experts top-6"),
        (64, sig(512, 22, 1, 1, true, 5.0), "Nemotron-3-Super 512 experts top-22"),
        (33, sig(256, 8, 8, 4, true, 2.5), "8 groups, keep 4"),
        (
            7,
            sig(24, 3, 4, 2, false, 1.0),
            "odd, 4 groups, keep 2, no renormalisation",
        ),
    ] {
        let shape = format!(
            "{tokens} tokens, {} experts top-{}, groups {}/{}, {what}",
            cfg.experts, cfg.top_k, cfg.topk_group, cfg.n_group
        );
        cases.push(Case::new("route_sigmoid_grouped", "f32", shape, move |cx, rng| {
            route_sigmoid(cx, rng, tokens, cfg)
        }));
    }
    let ex = |tokens, hidden, inter, experts, top_k, gated, distinct| ExpertCase {
        tokens,
        hidden,
        inter,
        experts,
        top_k,
        gated,
        distinct,
    };
    for (c, what) in [
        (ex(64, 2688, 1856, 128, 6, false, 7), "Nemotron-3-Nano, relu²"),
        (ex(64, 2048, 512, 512, 10, true, 7), "Qwen3-Next, SwiGLU"),
        (ex(9, 100, 37, 10, 3, false, 10), "odd, relu²"),
        (ex(9, 100, 37, 10, 3, true, 10), "odd, SwiGLU"),
        // Tensor-core edges: partial column tiles (136, 72 are not multiples of 64), experts with several 16-row
        // tiles (240 rows over 16 experts), and a prefill-sized pass that Auto sends to the 64-row tiling.
        (ex(60, 136, 72, 16, 4, false, 16), "ragged tiles, relu²"),
        (ex(60, 136, 72, 16, 4, true, 16), "ragged tiles, SwiGLU"),
        (
            ex(256, 2048, 512, 32, 8, true, 7),
            "prefill 256 tokens, 32 experts top-8, SwiGLU",
        ),
    ] {
        let shape = format!(
            "{} tokens, {} experts top-{}, hidden {} expert {}, {what}",
            c.tokens, c.experts, c.top_k, c.hidden, c.inter
        );
        both!(cases, "moe_experts", shape, moe_experts(c));
    }
}

/// A check that holds or not (rel_err 0 or ∞).
fn verdict(output: &'static str, ok: bool) -> Check {
    Check {
        output,
        rel_err: if ok { 0.0 } else { f64::INFINITY },
        threshold: 0.0,
    }
}

fn ids_match(got: &[i32], want: &[usize]) -> bool {
    got.len() == want.len() && got.iter().zip(want).all(|(&g, &w)| g >= 0 && g as usize == w)
}

fn route_softmax(
    cx: &Ctx,
    rng: &mut Rng,
    tokens: usize,
    experts: usize,
    top_k: usize,
    norm: bool,
) -> Result<Vec<Check>> {
    let logits = rng.uniform_vec(tokens * experts, 4.0);
    let dl = cx.dev.upload(&logits)?;
    let mut ids = cx.dev.alloc_zeros::<i32>(tokens * top_k)?;
    let mut w = cx.dev.alloc_nan::<f32>(tokens * top_k)?;
    ops::route_softmax(cx.dev, &dl, experts, top_k, norm, &mut ids, &mut w)?;
    let (want_ids, want_w) = cpu::moe::route_softmax(&logits, tokens, experts, top_k, norm);
    Ok(vec![
        verdict("ids", ids_match(&cx.dev.download(&ids)?, &want_ids)),
        Check::new("weights", &cx.dev.download(&w)?, &want_w, 1e-5),
    ])
}

fn route_sigmoid(cx: &Ctx, rng: &mut Rng, tokens: usize, cfg: SigmoidRouting) -> Result<Vec<Check>> {
    let e = cfg.experts;
    let logits = rng.uniform_vec(tokens * e, 4.0);
    let bias = rng.uniform_vec(e, 0.5);
    let (dl, db) = (cx.dev.upload(&logits)?, cx.dev.upload(&bias)?);
    let mut ids = cx.dev.alloc_zeros::<i32>(tokens * cfg.top_k)?;
    let mut w = cx.dev.alloc_nan::<f32>(tokens * cfg.top_k)?;
    ops::route_sigmoid_grouped(cx.dev, cfg, &dl, &db, &mut ids, &mut w)?;
    let (want_ids, want_w) = cpu::moe::route_sigmoid_grouped(
        &logits,
        tokens,
        e,
        &bias,
        cfg.top_k,
        cfg.n_group,
        cfg.topk_group,
        cfg.norm_topk_prob,
        cfg.routed_scaling_factor,
    );
    Ok(vec![
        verdict("ids", ids_match(&cx.dev.download(&ids)?, &want_ids)),
        Check::new("weights", &cx.dev.download(&w)?, &want_w, 1e-5),
    ])
}

/// `[experts, rows, cols]` weights as `distinct` random sets expanded on the device; returns them and the host sets.
fn expert_weights<T: Elem>(
    cx: &Ctx,
    rng: &mut Rng,
    experts: usize,
    distinct: usize,
    per: usize,
    scale: f32,
) -> Result<(CudaSlice<T>, Vec<f32>)> {
    let host = rounded::<T>(&rng.uniform_vec(distinct * per, scale));
    let sets = cx.dev.upload_as::<T>(&host)?;
    let mut all = cx.dev.alloc::<T>(experts * per)?;
    for e in 0..experts {
        let src = sets.slice((e % distinct) * per..(e % distinct + 1) * per);
        let mut dst = all.slice_mut(e * per..(e + 1) * per);
        cx.dev
            .stream()
            .memcpy_dtod(&src, &mut dst)
            .map_err(crate::cuda::driver_err("expanding expert weights"))?;
    }
    Ok((all, host))
}

fn moe_experts<T: Elem>(cx: &Ctx, rng: &mut Rng, c: ExpertCase) -> Result<Vec<Check>> {
    let ExpertCase {
        tokens,
        hidden: h,
        inter: i,
        experts,
        top_k,
        gated,
        distinct,
    } = c;
    let dev = cx.dev;
    let x = rounded::<T>(&rng.uniform_vec(tokens * h, 1.0));
    let mut ids = Vec::with_capacity(tokens * top_k);
    for _ in 0..tokens {
        ids.extend(rng.distinct(top_k, experts));
    }
    let weights: Vec<f32> = (0..tokens * top_k).map(|_| rng.uniform(0.05, 1.0)).collect();
    let (w_up, up_host) = expert_weights::<T>(cx, rng, experts, distinct, i * h, 1.0 / (h as f32).sqrt())?;
    let gate = if gated {
        Some(expert_weights::<T>(
            cx,
            rng,
            experts,
            distinct,
            i * h,
            1.0 / (h as f32).sqrt(),
        )?)
    } else {
        None
    };
    let (w_down, down_host) = expert_weights::<T>(cx, rng, experts, distinct, h * i, 1.0 / (i as f32).sqrt())?;

    let n = tokens * top_k;
    let ids_i32: Vec<i32> = ids.iter().map(|&e| e as i32).collect();
    let (dx, dids, dw) = (dev.upload_as::<T>(&x)?, dev.upload(&ids_i32)?, dev.upload(&weights)?);
    let mut offsets = dev.alloc_zeros::<i32>(experts + 1)?;
    let mut rows = dev.alloc_zeros::<i32>(n)?;
    let mut pos = dev.alloc_zeros::<i32>(n)?;
    ops::moe_align(dev, &dids, top_k, experts, &mut offsets, &mut rows, &mut pos)?;
    // The whole pass with one GEMM kernel; where tensor cores can take both GEMMs, each kernel is checked in turn.
    let pass = |kernel: MoeKernel| -> Result<Vec<f32>> {
        let mut up = dev.alloc_nan::<T>(n * i)?;
        ops::moe_gemm_using(dev, kernel, &dx, Some(&rows), &w_up, &offsets, &mut up, tokens, h, i)?;
        let mut act = dev.alloc_nan::<T>(n * i)?;
        if let Some((w_gate, _)) = &gate {
            let mut g = dev.alloc_nan::<T>(n * i)?;
            ops::moe_gemm_using(dev, kernel, &dx, Some(&rows), w_gate, &offsets, &mut g, tokens, h, i)?;
            ops::swiglu(dev, &g, &up, &mut act)?;
        } else {
            ops::activation(dev, Activation::Relu2, &up, &mut act)?;
        }
        let mut y = dev.alloc_nan::<T>(n * h)?;
        ops::moe_gemm_using::<T, CudaSlice<i32>>(dev, kernel, &act, None, &w_down, &offsets, &mut y, tokens, i, h)?;
        let mut out = dev.alloc_nan::<T>(tokens * h)?;
        ops::moe_combine(dev, &y, &pos, &dw, top_k, false, &mut out)?;
        dev.download_f32(&out)
    };
    let kernels: &[(MoeKernel, &'static str)] = if ops::moe_tensor_cores::<T>(h) && ops::moe_tensor_cores::<T>(i) {
        &[
            (MoeKernel::Simt, "out (SIMT kernel)"),
            (MoeKernel::TensorM16, "out (tensor cores, 16-row tiles)"),
            (MoeKernel::TensorM64, "out (tensor cores, 64-row tiles)"),
        ]
    } else {
        &[(MoeKernel::Auto, "out")]
    };
    let mut got = Vec::with_capacity(kernels.len());
    for &(kernel, output) in kernels {
        got.push((output, pass(kernel)?));
    }

    // CPU: a loop over experts, each one GEMM over its rows, rounding to T where the GPU stores T.
    let groups = cpu::moe::group_by_expert(&ids, &weights, top_k, experts);
    let mut want = vec![0.0f32; tokens * h];
    for e in 0..experts {
        let (toks, ws) = groups.expert(e);
        if toks.is_empty() {
            continue;
        }
        let r = toks.len();
        let set = e % distinct;
        let xs: Vec<f32> = toks
            .iter()
            .flat_map(|&t| x[t * h..(t + 1) * h].iter().copied())
            .collect();
        let mut u = vec![0.0f32; r * i];
        cpu::gemm::matmul_nt(&xs, &up_host[set * i * h..(set + 1) * i * h], &mut u, r, h, i);
        let mut a = rounded::<T>(&u);
        if let Some((_, gate_host)) = &gate {
            let mut gv = vec![0.0f32; r * i];
            cpu::gemm::matmul_nt(&xs, &gate_host[set * i * h..(set + 1) * i * h], &mut gv, r, h, i);
            let mut gv = rounded::<T>(&gv);
            cpu::act::swiglu_inplace(&mut gv, &a);
            a = gv;
        } else {
            cpu::act::map_inplace(&mut a, cpu::act::relu2);
        }
        let a = rounded::<T>(&a);
        let mut yv = vec![0.0f32; r * h];
        cpu::gemm::matmul_nt(&a, &down_host[set * h * i..(set + 1) * h * i], &mut yv, r, i, h);
        let yv = rounded::<T>(&yv);
        for ((&t, &wt), yr) in toks.iter().zip(ws).zip(yv.chunks_exact(h)) {
            for (o, v) in want[t * h..(t + 1) * h].iter_mut().zip(yr) {
                *o += wt * v;
            }
        }
    }
    let want_offsets: Vec<f32> = groups.offsets.iter().map(|&o| o as f32).collect();
    let got_offsets: Vec<f32> = dev.download(&offsets)?.iter().map(|&o| o as f32).collect();
    let mut checks = vec![Check::new("offsets", &got_offsets, &want_offsets, 0.0)];
    checks.extend(
        got.iter()
            .map(|(output, out)| Check::new(output, out, &want, tol::<T>())),
    );
    Ok(checks)
}
