//! Cases for the glue kernels of the GPU runner (column gathers, fused residual RMSNorm, gate activations, elementwise
//! ops, vocab-parallel embedding, MoE finish, the rank-split Mamba-2 gated norm). Shapes are the real ones (hidden 4096 / 5120, Nemotron-H-8B in_proj 18560, vocab
//! 131072 / 248320 / 262144, 1 and 64 rows) plus odd ones that leave partial blocks.

use super::{rounded, tol, Case, Check, Ctx, Rng};
use crate::cpu;
use crate::cpu::act::{sigmoid, silu, softplus};
use crate::cuda::ops;
use crate::cuda::{CudaSlice, Elem, Result};

/// Registers the glue cases.
pub(super) fn register(cases: &mut Vec<Case>) {
    for (rows, width, n, what) in [
        (64, 18560, 8192, "Nemotron-H-8B in_proj → z, 64 rows"),
        (1, 18560, 10240, "Nemotron-H-8B in_proj → xBC, 1 row"),
        (5, 8192, 4096, "Qwen3.5-4B q|gate de-interleave"),
        (3, 37, 50, "odd, random columns with repeats"),
    ] {
        both!(
            cases,
            "gather_cols",
            format!("[{rows}, {width}] → {n} columns, {what}"),
            gather_cols(rows, width, n)
        );
    }
    for (rows, width, start, n, what) in [
        (256, 10240, 0, 8192, "Nemotron-H-8B conv output → x, 256 rows (vectors)"),
        (64, 12352, 4096, 4096, "Qwen3.5-4B conv output → v (vectors)"),
        (7, 100, 3, 50, "odd (scalar)"),
    ] {
        both!(
            cases,
            "copy_cols",
            format!("[{rows}, {width}] columns {start}..{}, {what}", start + n),
            copy_cols(rows, width, start, n)
        );
    }
    for (rows, width, n, out_width, out_start, what) in [
        (
            3,
            124_160,
            124_160,
            248_320,
            124_160,
            "Qwen3.5-4B vocabulary slice 2 of 2 into whole rows (vectors)",
        ),
        (
            5,
            65_537,
            65_536,
            131_073,
            65_537,
            "a slice narrower than the rows it sits in (scalar)",
        ),
        (2, 100, 37, 80, 0, "odd (scalar)"),
    ] {
        both!(
            cases,
            "copy_block",
            format!(
                "[{rows}, {width}] → [{rows}, {out_width}] columns {out_start}..{}, {what}",
                out_start + n
            ),
            copy_block(rows, width, n, out_width, out_start)
        );
    }
    for (src_rows, dst_rows, n, width, outside, what) in [
        (
            64,
            24,
            16,
            4096,
            false,
            "MTP input rows from a step's rows, hidden 4096",
        ),
        (5, 9, 4, 2560, false, "saved rows into a slot's place, hidden 2560"),
        (7, 7, 5, 37, true, "odd, with a pair outside each matrix"),
    ] {
        both!(
            cases,
            "copy_rows",
            format!("{n} of [{src_rows}, {width}] → [{dst_rows}, {width}], {what}"),
            copy_rows(src_rows, dst_rows, n, width, outside)
        );
    }
    for (rows, dim, offset, residual, what) in [
        (64, 4096, 0.0f32, true, "Nemotron-H-8B, residual"),
        (1, 5120, 1.0, true, "5120 zero-centred, residual"),
        (64, 2560, 1.0, false, "Qwen3.5-4B, no residual"),
        (3, 100, 0.0, true, "odd"),
    ] {
        let shape = format!("[{rows}, {dim}] offset {offset}, residual {residual}, {what}");
        both!(cases, "add_rms_norm", shape, add_rms_norm(rows, dim, offset, residual));
    }
    for (rows, width, col, n, lo, hi, what) in [
        (
            64,
            18560,
            18432,
            128,
            0.0f32,
            f32::INFINITY,
            "Nemotron-H-8B dt, no clamp",
        ),
        (1, 18560, 18432, 128, 1e-3, 0.1, "Nemotron-H-8B dt, clamp [1e-3, 0.1]"),
        (7, 33, 5, 20, 0.5, 0.25, "odd, lo > hi"),
    ] {
        let shape = format!("[{rows}, {width}] cols {col}..+{n}, clamp [{lo}, {hi}], {what}");
        both!(cases, "dt_softplus", shape, dt_softplus(rows, width, col, n, lo, hi));
    }
    for (rows, width, b_col, a_col, n, what) in [
        (64, 64, 0, 32, 32, "Qwen3.5-4B in_proj_ba, 64 rows"),
        (1, 12352, 12288, 12320, 32, "fused projection tail, 1 row"),
        (5, 29, 3, 17, 9, "odd"),
    ] {
        let shape = format!("[{rows}, {width}] b {b_col}, a {a_col}, {n} heads, {what}");
        both!(cases, "gdn_gates", shape, gdn_gates(rows, width, b_col, a_col, n));
    }
    for (n, what) in [(64 * 4096, "[64, 4096]"), (1000, "odd")] {
        both!(cases, "sigmoid_mul", what, sigmoid_mul(n));
    }
    for (rows, inter, what) in [
        (64, 9216, "Qwen3.5-4B MLP"),
        (1, 12288, "Qwen3.5-9B MLP"),
        (3, 37, "odd"),
    ] {
        both!(
            cases,
            "swiglu_split",
            format!("[{rows}, 2 × {inter}] {what}"),
            swiglu_split(rows, inter)
        );
    }
    for (rows, dim, what) in [(64, 4096, "hidden 4096"), (1, 5120, "hidden 5120"), (3, 37, "odd")] {
        both!(
            cases,
            "add_bias",
            format!("[{rows}, {dim}] {what}"),
            add_bias(rows, dim)
        );
    }
    for (local, dim, start, n, what) in [
        (4096, 4096, 8192, 64, "rank slice of width 4096, 64 ids"),
        (2048, 5120, 0, 1, "first rank, width 5120, 1 id"),
        (37, 100, 50, 20, "odd"),
    ] {
        let shape = format!("rows {start}..{} × {dim}, {n} ids, {what}", start + local);
        both!(cases, "embed_rows_f32", shape, embed_rows(local, dim, start, n));
    }
    for (rows, dim, shared, gate, what) in [
        (64, 2048, true, true, "Qwen3-Next gated shared expert"),
        (64, 2688, true, false, "Nemotron-3-Nano shared expert"),
        (1, 4096, false, false, "no shared expert"),
        (3, 37, true, true, "odd"),
    ] {
        let shape = format!("[{rows}, {dim}] shared {shared}, gate {gate}, {what}");
        both!(cases, "moe_finish", shape, moe_finish(rows, dim, shared, gate));
    }
    for (rows, total, group, ranks, what) in [
        (64, 8192, 1024, 2, "Nemotron-H-8B Mamba, tp 2"),
        (1, 10240, 1280, 4, "Nemotron-Nano-9B-v2 Mamba, tp 4"),
        (5, 120, 40, 4, "odd, groups straddle ranks"),
    ] {
        let shape = format!("[{rows}, {total}] group {group}, tp {ranks}, {what}");
        both!(
            cases,
            "gated_norm_split",
            shape,
            gated_norm_split(rows, total, group, ranks)
        );
    }
}

/// A check that holds or not (rel_err 0 or ∞).
pub(super) fn verdict(output: &'static str, ok: bool) -> Check {
    Check {
        output,
        rel_err: if ok { 0.0 } else { f64::INFINITY },
        threshold: 0.0,
    }
}

fn up<T: Elem>(cx: &Ctx, v: &[f32]) -> Result<CudaSlice<T>> {
    cx.dev.upload_as::<T>(v)
}

fn copy_cols<T: Elem>(
    cx: &Ctx,
    rng: &mut Rng,
    rows: usize,
    width: usize,
    start: usize,
    n: usize,
) -> Result<Vec<Check>> {
    let src = rounded::<T>(&rng.uniform_vec(rows * width, 2.0));
    let ds = up::<T>(cx, &src)?;
    let mut out = cx.dev.alloc_nan::<T>(rows * n)?;
    ops::copy_cols(cx.dev, &ds, rows, width, start, n, &mut out)?;
    let want: Vec<f32> = src.chunks(width).flat_map(|r| r[start..start + n].to_vec()).collect();
    Ok(vec![Check::new("out", &cx.dev.download_f32(&out)?, &want, 0.0)])
}

/// Copies the first `n` columns of `[rows, width]` into columns `out_start..` of `[rows, out_width]`; the rest of
/// the output must keep its NaN.
fn copy_block<T: Elem>(
    cx: &Ctx,
    rng: &mut Rng,
    rows: usize,
    width: usize,
    n: usize,
    out_width: usize,
    out_start: usize,
) -> Result<Vec<Check>> {
    let src = rounded::<T>(&rng.uniform_vec(rows * width, 2.0));
    let ds = up::<T>(cx, &src)?;
    let mut out = cx.dev.alloc_nan::<T>(rows * out_width)?;
    ops::copy_block(cx.dev, &ds, rows, width, 0, n, &mut out, out_width, out_start)?;
    let got = cx.dev.download_f32(&out)?;
    let mut want = vec![f32::NAN; rows * out_width];
    for r in 0..rows {
        want[r * out_width + out_start..r * out_width + out_start + n].copy_from_slice(&src[r * width..r * width + n]);
    }
    let copied: Vec<usize> = (0..rows * out_width)
        .filter(|i| (out_start..out_start + n).contains(&(i % out_width)))
        .collect();
    let untouched = (0..rows * out_width).all(|i| copied.binary_search(&i).is_ok() || got[i].is_nan());
    let pick = |v: &[f32]| copied.iter().map(|&i| v[i]).collect::<Vec<f32>>();
    Ok(vec![
        Check::new("out", &pick(&got), &pick(&want), 0.0),
        verdict("the rest of each row untouched", untouched),
    ])
}

/// Copies `n` rows of `[src_rows, width]` to distinct rows of `[dst_rows, width]` (with `outside`, two pairs naming a
/// row outside either matrix are added, and skipped); the other rows must keep their values.
fn copy_rows<T: Elem>(
    cx: &Ctx,
    rng: &mut Rng,
    src_rows: usize,
    dst_rows: usize,
    n: usize,
    width: usize,
    outside: bool,
) -> Result<Vec<Check>> {
    let src = rounded::<T>(&rng.uniform_vec(src_rows * width, 2.0));
    let before = rounded::<T>(&rng.uniform_vec(dst_rows * width, 2.0));
    let dsts = rng.distinct(n, dst_rows);
    let mut pairs: Vec<i32> = dsts
        .iter()
        .flat_map(|&d| [rng.below(0, src_rows) as i32, d as i32])
        .collect();
    if outside {
        pairs.extend([src_rows as i32, 0, 0, -1]);
    }
    let (ds, dp) = (up::<T>(cx, &src)?, cx.dev.upload(&pairs)?);
    let mut dst = up::<T>(cx, &before)?;
    ops::copy_rows(cx.dev, &ds, &dp, width, &mut dst)?;
    let mut want = before;
    for pair in pairs.chunks_exact(2) {
        let (s, d) = (pair[0] as usize, pair[1]);
        if s < src_rows && (0..dst_rows as i32).contains(&d) {
            let d = d as usize;
            want[d * width..(d + 1) * width].copy_from_slice(&src[s * width..(s + 1) * width]);
        }
    }
    Ok(vec![Check::new("dst", &cx.dev.download_f32(&dst)?, &want, 0.0)])
}

fn gather_cols<T: Elem>(cx: &Ctx, rng: &mut Rng, rows: usize, width: usize, n: usize) -> Result<Vec<Check>> {
    let src = rounded::<T>(&rng.uniform_vec(rows * width, 2.0));
    let idx: Vec<usize> = if n <= width {
        let mut d = rng.distinct(n, width);
        // Even row counts take sorted columns, as the runner's contiguous splits; the others a permutation.
        if rows.is_multiple_of(2) {
            d.sort_unstable();
        }
        d
    } else {
        (0..n).map(|_| rng.below(0, width)).collect()
    };
    let idx_i: Vec<i32> = idx.iter().map(|&i| i as i32).collect();
    let (ds, di) = (up::<T>(cx, &src)?, cx.dev.upload(&idx_i)?);
    let mut out = cx.dev.alloc_nan::<T>(rows * n)?;
    ops::gather_cols(cx.dev, &ds, rows, width, &di, &mut out)?;
    let want: Vec<f32> = (0..rows)
        .flat_map(|r| idx.iter().map(move |&c| (r, c)))
        .map(|(r, c)| src[r * width + c])
        .collect();
    Ok(vec![Check::new("out", &cx.dev.download_f32(&out)?, &want, 0.0)])
}

fn add_rms_norm<T: Elem>(
    cx: &Ctx,
    rng: &mut Rng,
    rows: usize,
    dim: usize,
    offset: f32,
    residual: bool,
) -> Result<Vec<Check>> {
    let x = rng.uniform_vec(rows * dim, 2.0);
    let y = rng.uniform_vec(rows * dim, 1.0);
    let w: Vec<f32> = (0..dim).map(|_| rng.uniform(0.5 - offset, 1.5 - offset)).collect();
    let w = rounded::<T>(&w);
    let eps = 1e-5;
    let mut dx = cx.dev.upload(&x)?;
    let dy = cx.dev.upload(&y)?;
    let dw = up::<T>(cx, &w)?;
    let mut out = cx.dev.alloc_nan::<T>(rows * dim)?;
    ops::add_rms_norm(cx.dev, &mut dx, residual.then_some(&dy), &dw, eps, offset, &mut out)?;
    let sum: Vec<f32> = if residual {
        x.iter().zip(&y).map(|(a, b)| a + b).collect()
    } else {
        x
    };
    let want = cpu::norm::rms_norm_vec(&sum, &w, eps, offset);
    Ok(vec![
        Check::new("x", &cx.dev.download(&dx)?, &sum, 0.0),
        Check::new("out", &cx.dev.download_f32(&out)?, &want, tol::<T>()),
    ])
}

/// `torch.clamp`: NaN stays NaN, `lo > hi` gives `hi`.
fn clamp_torch(x: f32, lo: f32, hi: f32) -> f32 {
    let r = if x < lo { lo } else { x };
    if r > hi {
        hi
    } else {
        r
    }
}

/// Splits NaN positions off a comparison: both sides must be NaN at the same places; the rest compare as usual.
fn nan_split(got: &[f32], want: &[f32]) -> (bool, Vec<f32>, Vec<f32>) {
    let same = got.len() == want.len() && got.iter().zip(want).all(|(g, w)| g.is_nan() == w.is_nan());
    let clean = |v: &[f32]| {
        v.iter()
            .map(|x| if x.is_nan() { 0.0 } else { *x })
            .collect::<Vec<f32>>()
    };
    (same, clean(got), clean(want))
}

#[allow(clippy::too_many_arguments)]
fn dt_softplus<T: Elem>(
    cx: &Ctx,
    rng: &mut Rng,
    rows: usize,
    width: usize,
    col: usize,
    n: usize,
    lo: f32,
    hi: f32,
) -> Result<Vec<Check>> {
    let mut src = rounded::<T>(&rng.uniform_vec(rows * width, 8.0));
    // A NaN input must come out NaN, and large inputs take softplus's linear branch.
    src[col + n / 2] = f32::NAN;
    src[(rows - 1) * width + col] = 25.0;
    let bias = rng.uniform_vec(n, 4.0);
    let (ds, db) = (up::<T>(cx, &src)?, cx.dev.upload(&bias)?);
    let mut out = cx.dev.alloc_nan::<f32>(rows * n)?;
    ops::dt_softplus(cx.dev, &ds, rows, width, col, &db, lo, hi, &mut out)?;
    let want: Vec<f32> = (0..rows * n)
        .map(|i| clamp_torch(softplus(src[(i / n) * width + col + i % n] + bias[i % n]), lo, hi))
        .collect();
    let (same_nan, got, want) = nan_split(&cx.dev.download(&out)?, &want);
    Ok(vec![verdict("nan", same_nan), Check::new("out", &got, &want, 1e-5)])
}

fn gdn_gates<T: Elem>(
    cx: &Ctx,
    rng: &mut Rng,
    rows: usize,
    width: usize,
    b_col: usize,
    a_col: usize,
    n: usize,
) -> Result<Vec<Check>> {
    let src = rounded::<T>(&rng.uniform_vec(rows * width, 8.0));
    let dt_bias = rng.uniform_vec(n, 3.0);
    let neg_a: Vec<f32> = (0..n).map(|_| -rng.uniform(0.01, 16.0)).collect();
    let ds = up::<T>(cx, &src)?;
    let (dd, da) = (cx.dev.upload(&dt_bias)?, cx.dev.upload(&neg_a)?);
    let mut beta = cx.dev.alloc_nan::<f32>(rows * n)?;
    let mut g = cx.dev.alloc_nan::<f32>(rows * n)?;
    ops::gdn_gates(cx.dev, &ds, rows, width, b_col, a_col, &dd, &da, &mut beta, &mut g)?;
    let want_b: Vec<f32> = (0..rows * n)
        .map(|i| sigmoid(src[(i / n) * width + b_col + i % n]))
        .collect();
    let want_g: Vec<f32> = (0..rows * n)
        .map(|i| neg_a[i % n] * softplus(src[(i / n) * width + a_col + i % n] + dt_bias[i % n]))
        .collect();
    Ok(vec![
        Check::new("beta", &cx.dev.download(&beta)?, &want_b, 1e-5),
        Check::new("g", &cx.dev.download(&g)?, &want_g, 1e-5),
    ])
}

fn sigmoid_mul<T: Elem>(cx: &Ctx, rng: &mut Rng, n: usize) -> Result<Vec<Check>> {
    let x = rounded::<T>(&rng.uniform_vec(n, 4.0));
    let gate = rounded::<T>(&rng.uniform_vec(n, 8.0));
    let (mut dx, dg) = (up::<T>(cx, &x)?, up::<T>(cx, &gate)?);
    ops::sigmoid_mul(cx.dev, &mut dx, &dg)?;
    let want: Vec<f32> = x.iter().zip(&gate).map(|(v, g)| v * sigmoid(*g)).collect();
    Ok(vec![Check::new("x", &cx.dev.download_f32(&dx)?, &want, tol::<T>())])
}

fn swiglu_split<T: Elem>(cx: &Ctx, rng: &mut Rng, rows: usize, inter: usize) -> Result<Vec<Check>> {
    let x = rounded::<T>(&rng.uniform_vec(rows * 2 * inter, 6.0));
    let dx = up::<T>(cx, &x)?;
    let mut out = cx.dev.alloc_nan::<T>(rows * inter)?;
    ops::swiglu_split(cx.dev, &dx, inter, &mut out)?;
    let mut want = Vec::with_capacity(rows * inter);
    for row in x.chunks_exact(2 * inter) {
        let mut gate = row[..inter].to_vec();
        cpu::act::swiglu_inplace(&mut gate, &row[inter..]);
        want.extend(gate);
    }
    Ok(vec![Check::new("out", &cx.dev.download_f32(&out)?, &want, tol::<T>())])
}

fn add_bias<T: Elem>(cx: &Ctx, rng: &mut Rng, rows: usize, dim: usize) -> Result<Vec<Check>> {
    let x = rounded::<T>(&rng.uniform_vec(rows * dim, 4.0));
    let bias = rng.uniform_vec(dim, 2.0);
    let (mut dx, db) = (up::<T>(cx, &x)?, cx.dev.upload(&bias)?);
    ops::add_bias(cx.dev, &mut dx, &db)?;
    let want: Vec<f32> = x.iter().enumerate().map(|(i, v)| v + bias[i % dim]).collect();
    Ok(vec![Check::new("x", &cx.dev.download_f32(&dx)?, &want, tol::<T>())])
}

fn embed_rows<T: Elem>(
    cx: &Ctx,
    rng: &mut Rng,
    local: usize,
    dim: usize,
    start: usize,
    n: usize,
) -> Result<Vec<Check>> {
    let table = rounded::<T>(&rng.uniform_vec(local * dim, 1.0));
    // Ids before, inside and after this rank's slice, with both edges of the slice.
    let mut ids: Vec<usize> = (0..n).map(|_| rng.below(0, start + 2 * local)).collect();
    ids[0] = start;
    if n > 3 {
        ids[1] = start + local - 1;
        ids[2] = start + local;
        ids[3] = start.saturating_sub(1);
    }
    let ids_i: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
    let (dt, di) = (up::<T>(cx, &table)?, cx.dev.upload(&ids_i)?);
    let mut out = cx.dev.alloc_nan::<f32>(n * dim)?;
    ops::embed_rows_f32(cx.dev, &dt, &di, dim, start, &mut out)?;
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&id| {
            let row = (start..start + local)
                .contains(&id)
                .then(|| &table[(id - start) * dim..(id - start + 1) * dim]);
            (0..dim).map(move |j| row.map_or(0.0, |r| r[j]))
        })
        .collect();
    Ok(vec![Check::new("out", &cx.dev.download(&out)?, &want, 0.0)])
}

fn moe_finish<T: Elem>(
    cx: &Ctx,
    rng: &mut Rng,
    rows: usize,
    dim: usize,
    shared: bool,
    gate: bool,
) -> Result<Vec<Check>> {
    let routed = rounded::<T>(&rng.uniform_vec(rows * dim, 2.0));
    let sh = rng.uniform_vec(rows * dim, 2.0);
    let gt = rng.uniform_vec(rows, 6.0);
    let dr = up::<T>(cx, &routed)?;
    let (ds, dg) = (cx.dev.upload(&sh)?, cx.dev.upload(&gt)?);
    let mut out = cx.dev.alloc_nan::<f32>(rows * dim)?;
    ops::moe_finish(cx.dev, &dr, shared.then_some(&ds), gate.then_some(&dg), rows, &mut out)?;
    let want: Vec<f32> = (0..rows * dim)
        .map(|i| {
            let s = if gate { sigmoid(gt[i / dim]) } else { 1.0 };
            if shared {
                routed[i] + s * sh[i]
            } else {
                routed[i]
            }
        })
        .collect();
    Ok(vec![Check::new("out", &cx.dev.download(&out)?, &want, 1e-6)])
}

/// The rank-split gated norm: each rank's local sums on the device, summed on the host (the all-reduce), applied per
/// rank; compared with the loops of the engine's CPU shard (`engine/src/shard/model.rs`, fn `mamba2`) per rank.
fn gated_norm_split<T: Elem>(
    cx: &Ctx,
    rng: &mut Rng,
    rows: usize,
    total: usize,
    group: usize,
    ranks: usize,
) -> Result<Vec<Check>> {
    let groups = total / group;
    let di = total / ranks;
    let y = rounded::<T>(&rng.uniform_vec(rows * total, 2.0));
    let z = rounded::<T>(&rng.uniform_vec(rows * total, 4.0));
    let w = rounded::<T>(&(0..total).map(|_| rng.uniform(0.5, 1.5)).collect::<Vec<f32>>());
    let eps = 1e-5;
    let local = |v: &[f32], rank: usize| -> Vec<f32> {
        v.chunks_exact(total)
            .flat_map(|row| row[rank * di..(rank + 1) * di].iter().copied())
            .collect()
    };
    // CPU twin, per rank then all-reduced, as the shard does it.
    let mut want_sums = vec![0.0f32; rows * groups];
    let mut rank_sums = Vec::new();
    for rank in 0..ranks {
        let first = rank * di;
        let gated: Vec<f32> = local(&y, rank)
            .iter()
            .zip(&local(&z, rank))
            .map(|(y, z)| y * silu(*z))
            .collect();
        let mut sums = vec![0.0f32; rows * groups];
        for (row, sum) in gated.chunks_exact(di).zip(sums.chunks_exact_mut(groups)) {
            for (c, v) in row.iter().enumerate() {
                sum[(first + c) / group] += v * v;
            }
        }
        want_sums.iter_mut().zip(&sums).for_each(|(a, b)| *a += b);
        rank_sums.push((gated, sums));
    }
    let (mut sums_err, mut out_err) = (0.0f64, 0.0f64);
    let mut got_sums_total = vec![0.0f32; rows * groups];
    let mut dys = Vec::new();
    for (rank, (_, want)) in rank_sums.iter().enumerate() {
        let first = rank * di;
        let (dy, dz) = (up::<T>(cx, &local(&y, rank))?, up::<T>(cx, &local(&z, rank))?);
        let mut ds = cx.dev.alloc_nan::<f32>(rows * groups)?;
        ops::gated_sq_sums(cx.dev, &dy, &dz, rows, first, group, groups, &mut ds)?;
        let got = cx.dev.download(&ds)?;
        sums_err = super::worse(sums_err, super::rel_err(&got, want));
        got_sums_total.iter_mut().zip(&got).for_each(|(a, b)| *a += b);
        dys.push((dy, dz));
    }
    let dsum = cx.dev.upload(&want_sums)?;
    for (rank, ((dy, dz), (gated, _))) in dys.iter().zip(&rank_sums).enumerate() {
        let first = rank * di;
        let wl = &w[first..first + di];
        let dw = up::<T>(cx, wl)?;
        let mut out = cx.dev.alloc_nan::<T>(rows * di)?;
        ops::gated_norm_apply(cx.dev, dy, dz, &dsum, &dw, rows, first, group, groups, eps, &mut out)?;
        let mut want = Vec::with_capacity(rows * di);
        for (row, sum) in gated.chunks_exact(di).zip(want_sums.chunks_exact(groups)) {
            for (c, v) in row.iter().enumerate() {
                let ms = sum[(first + c) / group] / group as f32;
                want.push(v * (1.0 / (ms + eps).sqrt()) * wl[c]);
            }
        }
        out_err = super::worse(out_err, super::rel_err(&cx.dev.download_f32(&out)?, &want));
    }
    Ok(vec![
        Check {
            output: "sums",
            rel_err: sums_err,
            threshold: 1e-5,
        },
        Check::new("sums_reduced", &got_sums_total, &want_sums, 1e-5),
        Check {
            output: "out",
            rel_err: out_err,
            threshold: tol::<T>(),
        },
    ])
}
