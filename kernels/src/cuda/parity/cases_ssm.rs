//! Cases for the recurrent ops: causal conv1d with a state pool, the Mamba-2 and Gated DeltaNet decode steps. Each
//! batch row uses a random distinct slot of a pool with spare slots, and the whole pool is compared afterwards, so a
//! write to the wrong slot fails as surely as a wrong value.

use cudarc::driver::CudaSlice;

use super::{rounded, tol, Case, Check, Ctx, Rng};
use crate::cpu;
use crate::cpu::gdn::GdnDims;
use crate::cpu::mamba2::Mamba2Dims;
use crate::cuda::ops::{self, ConvDims, ReplayRow};
use crate::cuda::{Elem, Result};

/// Registers the recurrent-op cases.
pub(super) fn register(cases: &mut Vec<Case>) {
    for (batch, seq, channels, k, bias, what) in [
        (6, 1, 10240, 4, true, "Nemotron-H-8B decode"),
        (2, 37, 10240, 4, true, "Nemotron-H-8B prefill"),
        (6, 1, 8192, 4, false, "Qwen3.5-4B decode"),
        (3, 2, 8192, 4, false, "Qwen3.5-4B, 2 tokens < K − 1"),
        (3, 5, 70, 3, true, "odd"),
    ] {
        let shape = format!("batch {batch} × seq {seq} × {channels}, K {k}, bias {bias}, {what}");
        let pool = batch + 3;
        // A decode or verify appends its rows after the history (a ring of K − 1 + T rows); a prompt chunk rewrites
        // the history in place.
        let append = seq <= 5;
        let cap = if append { k - 1 + seq.max(4) } else { k - 1 + 4 };
        let packed = InRow::packed(channels);
        both!(
            cases,
            "conv1d",
            format!("{shape}, ring {cap}, append {append}"),
            conv1d(batch, seq, channels, k, bias, true, pool, cap, append, packed)
        );
    }
    // Batches wide enough for the vector kernel, reading the channels in place out of the projection's rows as the
    // GPU runner does (Nemotron-H-8B: xBC at column 8192 of 18 560; Qwen3.5-4B: q, k, v at column 0 of 12 352), a
    // verify's 4 tokens a row, and a row stride that rules the vectors out.
    for (batch, seq, channels, k, bias, offset, stride, what) in [
        (64, 1, 10240, 4, true, 8192, 18560, "Nemotron-H-8B decode"),
        (64, 4, 10240, 4, true, 8192, 18560, "Nemotron-H-8B verify"),
        (64, 1, 8192, 4, false, 0, 12352, "Qwen3.5-4B decode"),
        (48, 4, 8192, 4, false, 0, 12352, "Qwen3.5-4B verify"),
        (64, 2, 8192, 3, true, 0, 8192, "K 3 (vectors)"),
        (64, 1, 8192, 4, false, 3, 8201, "unaligned rows (scalar)"),
        (
            64,
            1,
            8192,
            4,
            false,
            3,
            8200,
            "aligned stride, unaligned start (scalar)",
        ),
    ] {
        let cap = k - 1 + 4;
        let shape = format!("batch {batch} × seq {seq} × {channels}, K {k}, at column {offset} of {stride}, {what}");
        let layout = InRow { offset, stride };
        both!(
            cases,
            "conv1d",
            shape,
            conv1d(batch, seq, channels, k, bias, true, batch + 2, cap, true, layout)
        );
    }
    both!(
        cases,
        "conv1d",
        "batch 2 × seq 4 × 33, K 4, no SiLU, odd, ring 3 (history only)",
        conv1d(2, 4, 33, 4, false, false, 4, 3, false, InRow::packed(33))
    );
    both!(
        cases,
        "conv1d",
        "batch 3 × seq 37 × 70, K 3, prompt chunk, ring 6",
        conv1d(3, 37, 70, 3, true, true, 5, 6, false, InRow::packed(70))
    );
    // Runs of tokens: a prompt chunk shorter than the history (one run keeps part of the old history), one whose last
    // run is a single token, and an append of more tokens than a run (every run appends its own).
    both!(
        cases,
        "conv1d",
        "batch 2 × seq 2 × 33, K 4, prompt chunk shorter than the history, ring 5",
        conv1d(2, 2, 33, 4, true, true, 4, 5, false, InRow::packed(33))
    );
    both!(
        cases,
        "conv1d",
        "batch 1 × seq 1025 × 8192 at column 0 of 12352, K 4, Qwen3.5-4B prompt chunk, ring 7",
        conv1d(
            1,
            1025,
            8192,
            4,
            false,
            true,
            3,
            7,
            false,
            InRow {
                offset: 0,
                stride: 12352
            }
        )
    );
    both!(
        cases,
        "conv1d",
        "batch 64 × seq 2 × 8192, K 4, prompt chunks shorter than the history at a vector-sized batch (scalar)",
        conv1d(64, 2, 8192, 4, false, true, 66, 7, false, InRow::packed(8192))
    );
    both!(
        cases,
        "conv1d",
        "batch 2 × seq 37 × 70, K 4, append 37 rows, ring 40",
        conv1d(2, 37, 70, 4, true, true, 4, 40, true, InRow::packed(70))
    );
    let nemotron_8b = Mamba2Dims {
        heads: 128,
        head_dim: 64,
        state_dim: 128,
        groups: 8,
    };
    let nemotron_nano = Mamba2Dims {
        heads: 64,
        head_dim: 64,
        state_dim: 128,
        groups: 8,
    };
    let odd_m = Mamba2Dims {
        heads: 6,
        head_dim: 5,
        state_dim: 20,
        groups: 2,
    };
    for (dims, batch, what) in [
        (nemotron_8b, 6, "Nemotron-H-8B"),
        (nemotron_nano, 3, "Nemotron-3-Nano-30B-A3B"),
        (odd_m, 2, "odd"),
    ] {
        let shape = format!(
            "batch {batch}, {} heads × {}, state {}, {} groups, {what}",
            dims.heads, dims.head_dim, dims.state_dim, dims.groups
        );
        both!(cases, "mamba2_step", shape, mamba2_step(dims, batch, batch + 3));
    }
    let qwen35_4b = GdnDims {
        k_heads: 16,
        v_heads: 32,
        k_dim: 128,
        v_dim: 128,
    };
    let qwen35_122b = GdnDims {
        k_heads: 16,
        v_heads: 64,
        k_dim: 128,
        v_dim: 128,
    };
    let odd_g = GdnDims {
        k_heads: 2,
        v_heads: 6,
        k_dim: 40,
        v_dim: 24,
    };
    for (dims, batch, what) in [
        (qwen35_4b, 6, "Qwen3.5-4B"),
        (qwen35_122b, 2, "Qwen3.5-122B-A10B"),
        (odd_g, 3, "odd"),
    ] {
        let shape = format!(
            "batch {batch}, {}/{} heads × {}/{}, {what}",
            dims.k_heads, dims.v_heads, dims.k_dim, dims.v_dim
        );
        both!(cases, "gdn_step", shape, gdn_step(dims, batch, batch + 3));
    }
}

fn slots_i32(slots: &[usize]) -> Vec<i32> {
    slots.iter().map(|&s| s as i32).collect()
}

/// Where a conv's input channels sit in their rows: from column `offset` of rows `stride` wide.
#[derive(Clone, Copy)]
struct InRow {
    offset: usize,
    stride: usize,
}

impl InRow {
    fn packed(channels: usize) -> InRow {
        InRow {
            offset: 0,
            stride: channels,
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn conv1d<T: Elem>(
    cx: &Ctx,
    rng: &mut Rng,
    batch: usize,
    seq: usize,
    channels: usize,
    k: usize,
    bias: bool,
    silu: bool,
    pool: usize,
    cap: usize,
    append: bool,
    layout: InRow,
) -> Result<Vec<Check>> {
    let slots = rng.distinct(batch, pool);
    let heads: Vec<usize> = (0..batch).map(|_| rng.below(0, cap)).collect();
    let InRow { offset, stride } = layout;
    let wide = rounded::<T>(&rng.uniform_vec(batch * seq * stride, 1.0));
    let x: Vec<f32> = wide
        .chunks(stride)
        .flat_map(|r| r[offset..offset + channels].to_vec())
        .collect();
    let w = rounded::<T>(&rng.uniform_vec(channels * k, 0.5));
    let b = bias.then(|| rounded::<T>(&rng.uniform_vec(channels, 0.5)));
    let per_slot = cap * channels;
    let mut state = rounded::<T>(&rng.uniform_vec(pool * per_slot, 1.0));
    let (dx, dw) = (cx.dev.upload_as::<T>(&wide)?, cx.dev.upload_as::<T>(&w)?);
    let db: Option<CudaSlice<T>> = b.as_ref().map(|b| cx.dev.upload_as::<T>(b)).transpose()?;
    let mut dstate = cx.dev.upload_as::<T>(&state)?;
    let rows: Vec<ReplayRow> = slots
        .iter()
        .zip(&heads)
        .map(|(&slot, &conv_head)| ReplayRow {
            slot,
            conv_head,
            ..ReplayRow::default()
        })
        .collect();
    let dmeta = cx.dev.upload(&ReplayRow::encode_all(&rows))?;
    let mut out = cx.dev.alloc_nan::<T>(batch * seq * channels)?;
    let dims = ConvDims {
        batch,
        seq,
        channels,
        x_stride: stride,
        k,
        slots: pool,
        capacity: cap,
        append,
    };
    ops::causal_conv1d(
        cx.dev,
        dims,
        &dx.slice(offset..),
        &dw,
        db.as_ref(),
        &mut dstate,
        &dmeta,
        silu,
        &mut out,
    )?;
    let mut want = vec![0.0; batch * seq * channels];
    let row = seq * channels;
    for (r, (&s, &head)) in slots.iter().zip(&heads).enumerate() {
        let ring = &mut state[s * per_slot..(s + 1) * per_slot];
        let at = |j: usize| (head + j) % cap * channels;
        let mut window: Vec<f32> = (0..k - 1)
            .flat_map(|j| ring[at(j)..at(j) + channels].to_vec())
            .collect();
        let xs = &x[r * row..(r + 1) * row];
        cpu::conv::causal_conv1d(
            xs,
            seq,
            channels,
            &w,
            b.as_deref(),
            &mut window,
            &mut want[r * row..(r + 1) * row],
        );
        if append {
            for t in 0..seq {
                let p = at(k - 1 + t);
                ring[p..p + channels].copy_from_slice(&xs[t * channels..(t + 1) * channels]);
            }
        } else {
            for j in 0..k - 1 {
                let p = at(j);
                ring[p..p + channels].copy_from_slice(&window[j * channels..(j + 1) * channels]);
            }
        }
    }
    if silu {
        cpu::act::map_inplace(&mut want, cpu::act::silu);
    }
    Ok(vec![
        Check::new("out", &cx.dev.download_f32(&out)?, &want, tol::<T>()),
        Check::new("state", &cx.dev.download_f32(&dstate)?, &state, tol::<T>()),
    ])
}

fn mamba2_step<T: Elem>(cx: &Ctx, rng: &mut Rng, dims: Mamba2Dims, batch: usize, pool: usize) -> Result<Vec<Check>> {
    let (h, p, n, g) = (dims.heads, dims.head_dim, dims.state_dim, dims.groups);
    let slots = rng.distinct(batch, pool);
    let x = rounded::<T>(&rng.uniform_vec(batch * h * p, 1.0));
    let dt: Vec<f32> = (0..batch * h)
        .map(|_| cpu::act::softplus(rng.uniform(-3.0, 1.0)))
        .collect();
    let a: Vec<f32> = (0..h).map(|_| -rng.uniform(0.0, 2.7).exp()).collect();
    let b = rounded::<T>(&rng.uniform_vec(batch * g * n, 1.0));
    let c = rounded::<T>(&rng.uniform_vec(batch * g * n, 1.0));
    let d: Vec<f32> = rng.uniform_vec(h, 1.0);
    let per_slot = h * p * n;
    let mut state = rng.uniform_vec(pool * per_slot, 1.0);
    let mut dstate = cx.dev.upload(&state)?;
    let dslots = cx.dev.upload(&slots_i32(&slots))?;
    let dx = cx.dev.upload_as::<T>(&x)?;
    let (ddt, da, dd) = (cx.dev.upload(&dt)?, cx.dev.upload(&a)?, cx.dev.upload(&d)?);
    let (db, dc) = (cx.dev.upload_as::<T>(&b)?, cx.dev.upload_as::<T>(&c)?);
    let mut y = cx.dev.alloc_nan::<T>(batch * h * p)?;
    ops::mamba2_step(
        cx.dev,
        dims,
        &mut dstate,
        &dslots,
        &dx,
        &ddt,
        &da,
        &db,
        &dc,
        &dd,
        &mut y,
    )?;
    let mut want = vec![0.0; batch * h * p];
    for (r, &s) in slots.iter().enumerate() {
        cpu::mamba2::mamba2_step(
            dims,
            &mut state[s * per_slot..(s + 1) * per_slot],
            &x[r * h * p..(r + 1) * h * p],
            &dt[r * h..(r + 1) * h],
            &a,
            &b[r * g * n..(r + 1) * g * n],
            &c[r * g * n..(r + 1) * g * n],
            &d,
            &mut want[r * h * p..(r + 1) * h * p],
        );
    }
    Ok(vec![
        Check::new("y", &cx.dev.download_f32(&y)?, &want, tol::<T>()),
        Check::new("state", &cx.dev.download(&dstate)?, &state, tol::<f32>()),
    ])
}

fn gdn_step<T: Elem>(cx: &Ctx, rng: &mut Rng, dims: GdnDims, batch: usize, pool: usize) -> Result<Vec<Check>> {
    let (hk, hv, dk, dv) = (dims.k_heads, dims.v_heads, dims.k_dim, dims.v_dim);
    let slots = rng.distinct(batch, pool);
    // q and k arrive L2-normalised, q scaled by 1/√d_k, as the mixer prepares them.
    let mut q = rng.uniform_vec(batch * hk * dk, 1.0);
    let mut k = rng.uniform_vec(batch * hk * dk, 1.0);
    cpu::norm::l2_norm_rows(&mut q, dk, 1e-6);
    cpu::norm::l2_norm_rows(&mut k, dk, 1e-6);
    let scale = 1.0 / (dk as f32).sqrt();
    q.iter_mut().for_each(|v| *v *= scale);
    let (q, k) = (rounded::<T>(&q), rounded::<T>(&k));
    let v = rounded::<T>(&rng.uniform_vec(batch * hv * dv, 1.0));
    let g: Vec<f32> = (0..batch * hv)
        .map(|_| -rng.uniform(-1.0, 1.0).exp() * cpu::act::softplus(rng.uniform(-2.0, 2.0)))
        .collect();
    let beta: Vec<f32> = (0..batch * hv)
        .map(|_| cpu::act::sigmoid(rng.uniform(-2.0, 2.0)))
        .collect();
    let per_slot = dims.state_len();
    let mut state = rng.uniform_vec(pool * per_slot, 0.5);
    let mut dstate = cx.dev.upload(&state)?;
    let dslots = cx.dev.upload(&slots_i32(&slots))?;
    let (dq, dk_, dv_) = (
        cx.dev.upload_as::<T>(&q)?,
        cx.dev.upload_as::<T>(&k)?,
        cx.dev.upload_as::<T>(&v)?,
    );
    let (dg, db) = (cx.dev.upload(&g)?, cx.dev.upload(&beta)?);
    let mut out = cx.dev.alloc_nan::<T>(batch * hv * dv)?;
    ops::gdn_step(cx.dev, dims, &mut dstate, &dslots, &dq, &dk_, &dv_, &dg, &db, &mut out)?;
    let mut want = vec![0.0; batch * hv * dv];
    let (qk_row, v_row) = (hk * dk, hv * dv);
    for (r, &s) in slots.iter().enumerate() {
        cpu::gdn::gdn_step(
            dims,
            &mut state[s * per_slot..(s + 1) * per_slot],
            &q[r * qk_row..(r + 1) * qk_row],
            &k[r * qk_row..(r + 1) * qk_row],
            &v[r * v_row..(r + 1) * v_row],
            &g[r * hv..(r + 1) * hv],
            &beta[r * hv..(r + 1) * hv],
            &mut want[r * v_row..(r + 1) * v_row],
        );
    }
    Ok(vec![
        Check::new("out", &cx.dev.download_f32(&out)?, &want, tol::<T>()),
        Check::new("state", &cx.dev.download(&dstate)?, &state, tol::<f32>()),
    ])
}
