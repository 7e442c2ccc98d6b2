//! Cases for the sequence ops: paged-KV attention (decode and prefill, with the K/V write) and the chunked prefill
//! scans of Mamba-2 and Gated DeltaNet. Pools have spare slots and blocks in a shuffled order, and the whole pool is
//! compared after the write, so a row written to the wrong page fails.

use super::{rounded, tol, Case, Check, Ctx, Rng};
use crate::cpu;
use crate::cpu::gdn::GdnDims;
use crate::cpu::mamba2::Mamba2Dims;
use crate::cuda::ops::{self, PagedKv};
use crate::cuda::{Elem, Result};

/// One paged-attention case: `batch` rows of `t` new tokens each, at total lengths `t ..= max_len`.
#[derive(Clone, Copy, Debug)]
struct AttnCase {
    batch: usize,
    t: usize,
    max_len: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
}

/// Registers the attention and chunked-scan cases.
pub(super) fn register(cases: &mut Vec<Case>) {
    let attn = |batch, t, max_len, heads, kv_heads, head_dim, block_size| AttnCase {
        batch,
        t,
        max_len,
        heads,
        kv_heads,
        head_dim,
        block_size,
    };
    for (c, what) in [
        (attn(6, 1, 3000, 32, 8, 128, 16), "decode, 32/8 × 128"),
        (attn(4, 1, 1500, 16, 4, 256, 16), "decode, Qwen3.5-4B 16/4 × 256"),
        (attn(4, 1, 1500, 16, 2, 256, 16), "decode, Qwen3.5 16/2 × 256"),
        (attn(3, 1, 70, 32, 2, 128, 16), "decode, Nemotron-Nano 32/2 × 128"),
        (attn(1, 1024, 1024, 32, 8, 128, 16), "prefill 1024, 32/8 × 128"),
        (attn(1, 1024, 1024, 16, 4, 256, 16), "prefill 1024, 16/4 × 256"),
        (
            attn(1, 300, 817, 16, 2, 256, 16),
            "prefill 300 after 517 cached, 16/2 × 256",
        ),
        (attn(1, 200, 333, 8, 8, 64, 16), "prefill 200 after 133, 8/8 × 64"),
        // Real shapes at full batch and long contexts (bf16: the tensor-core kernels, with key splits where the grid
        // is small; f32: the SIMT kernel).
        (attn(32, 1, 4096, 32, 8, 128, 16), "decode batch 32 × 4096, 32/8 × 128"),
        (
            attn(32, 1, 4096, 16, 2, 256, 16),
            "decode batch 32 × 4096, Qwen3.5 16/2 × 256",
        ),
        (
            attn(32, 1, 4096, 16, 4, 256, 16),
            "decode batch 32 × 4096, Qwen3.5-4B 16/4 × 256",
        ),
        (attn(1, 1, 16384, 32, 8, 128, 16), "decode batch 1 × 16K, 32/8 × 128"),
        (attn(2, 1, 32768, 16, 2, 256, 16), "decode 2 × 32K, 16/2 × 256"),
        (attn(4, 1, 500, 4, 2, 64, 16), "decode, default models 4/2 × 64"),
        (
            attn(4, 4, 2000, 32, 8, 128, 16),
            "verify 4 tokens, 32/8 × 128 (16 rows per KV head)",
        ),
        (
            attn(3, 3, 3000, 16, 2, 256, 16),
            "verify 3 tokens, 16/2 × 256 (24 rows per KV head)",
        ),
        (
            attn(1, 1024, 2048, 32, 8, 128, 16),
            "prefill 1024 after 1024 cached, 32/8 × 128",
        ),
        (
            attn(1, 1024, 3072, 16, 2, 256, 16),
            "prefill 1024 after 2048 cached, 16/2 × 256",
        ),
        (
            attn(1, 64, 8192, 32, 8, 128, 16),
            "chunk of 64 after 8128 cached, 32/8 × 128",
        ),
        (attn(2, 7, 300, 8, 2, 128, 5), "2 rows × 7 tokens, 8/2 × 128, block 5"),
        (attn(3, 1, 41, 6, 3, 40, 5), "odd decode"),
        (attn(2, 7, 19, 6, 2, 40, 5), "odd, 2 rows × 7 tokens"),
    ] {
        let shape = format!(
            "batch {} × t {}, len ≤ {}, {}/{} heads × {}, block {}, {what}",
            c.batch, c.t, c.max_len, c.heads, c.kv_heads, c.head_dim, c.block_size
        );
        both!(cases, "paged_attention", shape, paged_attention(c));
    }
    let nemotron_8b = Mamba2Dims {
        heads: 128,
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
    for (dims, seq, chunk, what) in [
        (nemotron_8b, 1024, 64, "Nemotron-H-8B, prompt 1024"),
        (nemotron_8b, 1000, 64, "Nemotron-H-8B, 1000 tokens"),
        (
            Mamba2Dims {
                heads: 8,
                head_dim: 64,
                state_dim: 64,
                groups: 2,
            },
            100,
            64,
            "state 64, one short chunk after a full one",
        ),
        (odd_m, 77, 16, "odd"),
        (odd_m, 5, 16, "odd, one short chunk"),
    ] {
        let shape = format!(
            "seq {seq}, chunk {chunk}, {} heads × {}, state {}, {} groups, {what}",
            dims.heads, dims.head_dim, dims.state_dim, dims.groups
        );
        both!(cases, "mamba2_chunked", shape, mamba2_chunked(dims, seq, chunk));
    }
    let qwen35_4b = GdnDims {
        k_heads: 16,
        v_heads: 32,
        k_dim: 128,
        v_dim: 128,
    };
    let odd_g = GdnDims {
        k_heads: 2,
        v_heads: 6,
        k_dim: 40,
        v_dim: 24,
    };
    for (dims, seq, chunk, what) in [
        (qwen35_4b, 1024, 64, "Qwen3.5-4B, prompt 1024"),
        (qwen35_4b, 1000, 64, "Qwen3.5-4B, 1000 tokens"),
        (
            GdnDims {
                k_heads: 2,
                v_heads: 6,
                k_dim: 128,
                v_dim: 128,
            },
            100,
            64,
            "2/6 heads, one short chunk after a full one",
        ),
        (odd_g, 77, 16, "odd, k_dim ≠ v_dim"),
        (odd_g, 5, 16, "odd, one short chunk"),
    ] {
        let shape = format!(
            "seq {seq}, chunk {chunk}, {}/{} heads × {}/{}, {what}",
            dims.k_heads, dims.v_heads, dims.k_dim, dims.v_dim
        );
        both!(cases, "gdn_chunked", shape, gdn_chunked(dims, seq, chunk));
    }
}

fn to_i32(v: &[usize]) -> Vec<i32> {
    v.iter().map(|&x| x as i32).collect()
}

fn paged_attention<T: Elem>(cx: &Ctx, rng: &mut Rng, c: AttnCase) -> Result<Vec<Check>> {
    let AttnCase {
        batch,
        t,
        max_len,
        heads,
        kv_heads,
        head_dim: d,
        block_size: bs,
    } = c;
    let num_slots = batch + 2;
    let bps = max_len.div_ceil(bs);
    let num_blocks = num_slots * bps + 3;
    let layout = PagedKv {
        num_blocks,
        block_size: bs,
        kv_heads,
        head_dim: d,
        num_slots,
        blocks_per_slot: bps,
    };
    // Every slot owns distinct blocks, in shuffled order.
    let order = rng.distinct(num_blocks, num_blocks);
    let table: Vec<usize> = order[..num_slots * bps].to_vec();
    let slots = rng.distinct(batch, num_slots);
    let mut lens = vec![0usize; num_slots];
    for (b, &s) in slots.iter().enumerate() {
        lens[s] = if b == 0 { max_len } else { rng.below(t, max_len + 1) };
    }
    if batch > 1 {
        lens[slots[batch - 1]] = t;
    }
    let row = kv_heads * d;
    let mut k_pool = rounded::<T>(&rng.uniform_vec(layout.pool_len(), 1.0));
    let mut v_pool = rounded::<T>(&rng.uniform_vec(layout.pool_len(), 1.0));
    let q = rounded::<T>(&rng.uniform_vec(batch * t * heads * d, 1.0));
    let k_new = rounded::<T>(&rng.uniform_vec(batch * t * row, 1.0));
    let v_new = rounded::<T>(&rng.uniform_vec(batch * t * row, 1.0));
    let (mut w_slots, mut w_pos) = (Vec::new(), Vec::new());
    for &s in &slots {
        for i in 0..t {
            w_slots.push(s);
            w_pos.push(lens[s] - t + i);
        }
    }
    let dev = cx.dev;
    let mut dk = dev.upload_as::<T>(&k_pool)?;
    let mut dv = dev.upload_as::<T>(&v_pool)?;
    let dtable = dev.upload(&to_i32(&table))?;
    let (dws, dwp) = (dev.upload(&to_i32(&w_slots))?, dev.upload(&to_i32(&w_pos))?);
    let (dkn, dvn) = (dev.upload_as::<T>(&k_new)?, dev.upload_as::<T>(&v_new)?);
    ops::kv_write(dev, layout, &dkn, &dvn, &dws, &dwp, &dtable, &mut dk, &mut dv)?;
    let (dq, dlens, dslots) = (
        dev.upload_as::<T>(&q)?,
        dev.upload(&to_i32(&lens))?,
        dev.upload(&to_i32(&slots))?,
    );
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = dev.alloc_nan::<T>(batch * t * heads * d)?;
    ops::paged_attention(
        dev, layout, heads, t, &dq, &dk, &dv, &dtable, &dlens, &dslots, scale, &mut out, None,
    )?;

    // The CPU side: the same writes, then a gather of each row's pages into contiguous K/V.
    let at = |slot: usize, p: usize| (table[slot * bps + p / bs] * bs + p % bs) * row;
    for (i, (&s, &p)) in w_slots.iter().zip(&w_pos).enumerate() {
        let dst = at(s, p);
        k_pool[dst..dst + row].copy_from_slice(&k_new[i * row..(i + 1) * row]);
        v_pool[dst..dst + row].copy_from_slice(&v_new[i * row..(i + 1) * row]);
    }
    let per_row = t * heads * d;
    let mut want = vec![0.0f32; batch * per_row];
    for (b, &s) in slots.iter().enumerate() {
        let len = lens[s];
        let (mut kc, mut vc) = (Vec::with_capacity(len * row), Vec::with_capacity(len * row));
        for p in 0..len {
            kc.extend_from_slice(&k_pool[at(s, p)..at(s, p) + row]);
            vc.extend_from_slice(&v_pool[at(s, p)..at(s, p) + row]);
        }
        cpu::attention::causal_attention(
            &q[b * per_row..(b + 1) * per_row],
            &kc,
            &vc,
            t,
            len,
            heads,
            kv_heads,
            d,
            len - t,
            scale,
            &mut want[b * per_row..(b + 1) * per_row],
        );
    }
    Ok(vec![
        Check::new("out", &dev.download_f32(&out)?, &want, tol::<T>()),
        Check::new("k_pool", &dev.download_f32(&dk)?, &k_pool, 0.0),
        Check::new("v_pool", &dev.download_f32(&dv)?, &v_pool, 0.0),
    ])
}

fn mamba2_chunked<T: Elem>(cx: &Ctx, rng: &mut Rng, dims: Mamba2Dims, seq: usize, chunk: usize) -> Result<Vec<Check>> {
    let (h, p, n, g) = (dims.heads, dims.head_dim, dims.state_dim, dims.groups);
    let x = rounded::<T>(&rng.uniform_vec(seq * h * p, 1.0));
    let dt: Vec<f32> = (0..seq * h)
        .map(|_| cpu::act::softplus(rng.uniform(-3.0, 1.0)))
        .collect();
    let a: Vec<f32> = (0..h).map(|_| -rng.uniform(0.0, 2.7).exp()).collect();
    let b = rounded::<T>(&rng.uniform_vec(seq * g * n, 1.0));
    let c = rounded::<T>(&rng.uniform_vec(seq * g * n, 1.0));
    let d: Vec<f32> = rng.uniform_vec(h, 1.0);
    let mut state = rng.uniform_vec(h * p * n, 1.0);
    let dev = cx.dev;
    let dx = dev.upload_as::<T>(&x)?;
    let (ddt, da, dd) = (dev.upload(&dt)?, dev.upload(&a)?, dev.upload(&d)?);
    let (db, dc) = (dev.upload_as::<T>(&b)?, dev.upload_as::<T>(&c)?);
    let mut ws = dev.alloc_nan::<f32>(ops::mamba2_chunked_workspace(dims, seq, chunk))?;
    // (y, final state) of one GPU run from the initial state.
    let mut run = |kernel: ops::ScanKernel| -> Result<(Vec<f32>, Vec<f32>)> {
        let mut dstate = dev.upload(&state)?;
        let mut y = dev.alloc_nan::<T>(seq * h * p)?;
        ops::mamba2_chunked_using(
            dev,
            kernel,
            dims,
            seq,
            chunk,
            &mut dstate,
            &dx,
            &ddt,
            &da,
            &db,
            &dc,
            &dd,
            &mut y,
            &mut ws,
        )?;
        Ok((dev.download_f32(&y)?, dev.download(&dstate)?))
    };
    let (y, got_state) = run(ops::ScanKernel::Auto)?;
    let simt = if ops::mamba2_tensor_cores::<T>(dims, chunk) {
        Some(run(ops::ScanKernel::Simt)?)
    } else {
        None
    };
    let mut want = vec![0.0; seq * h * p];
    cpu::mamba2::mamba2_chunked(dims, seq, chunk, &mut state, &x, &dt, &a, &b, &c, &d, &mut want);
    Ok(scan_checks::<T>(["y", "y (SIMT)"], (y, got_state), simt, &want, &state))
}

fn gdn_chunked<T: Elem>(cx: &Ctx, rng: &mut Rng, dims: GdnDims, seq: usize, chunk: usize) -> Result<Vec<Check>> {
    let (hk, hv, dk, dv) = (dims.k_heads, dims.v_heads, dims.k_dim, dims.v_dim);
    let mut q = rng.uniform_vec(seq * hk * dk, 1.0);
    let mut k = rng.uniform_vec(seq * hk * dk, 1.0);
    cpu::norm::l2_norm_rows(&mut q, dk, 1e-6);
    cpu::norm::l2_norm_rows(&mut k, dk, 1e-6);
    let scale = 1.0 / (dk as f32).sqrt();
    q.iter_mut().for_each(|v| *v *= scale);
    let (q, k) = (rounded::<T>(&q), rounded::<T>(&k));
    let v = rounded::<T>(&rng.uniform_vec(seq * hv * dv, 1.0));
    let g: Vec<f32> = (0..seq * hv)
        .map(|_| -rng.uniform(-1.0, 1.0).exp() * cpu::act::softplus(rng.uniform(-2.0, 2.0)))
        .collect();
    let beta: Vec<f32> = (0..seq * hv)
        .map(|_| cpu::act::sigmoid(rng.uniform(-2.0, 2.0)))
        .collect();
    let mut state = rng.uniform_vec(dims.state_len(), 0.5);
    let dev = cx.dev;
    let (dq, dk_, dv_) = (
        dev.upload_as::<T>(&q)?,
        dev.upload_as::<T>(&k)?,
        dev.upload_as::<T>(&v)?,
    );
    let (dg, db) = (dev.upload(&g)?, dev.upload(&beta)?);
    let mut ws = dev.alloc_nan::<f32>(ops::gdn_chunked_workspace(dims, seq, chunk))?;
    let mut run = |kernel: ops::ScanKernel| -> Result<(Vec<f32>, Vec<f32>)> {
        let mut dstate = dev.upload(&state)?;
        let mut out = dev.alloc_nan::<T>(seq * hv * dv)?;
        ops::gdn_chunked_using(
            dev,
            kernel,
            dims,
            seq,
            chunk,
            &mut dstate,
            &dq,
            &dk_,
            &dv_,
            &dg,
            &db,
            &mut out,
            &mut ws,
        )?;
        Ok((dev.download_f32(&out)?, dev.download(&dstate)?))
    };
    let got = run(ops::ScanKernel::Auto)?;
    let simt = if ops::gdn_tensor_cores::<T>(dims, chunk) {
        Some(run(ops::ScanKernel::Simt)?)
    } else {
        None
    };
    let mut want = vec![0.0; seq * hv * dv];
    cpu::gdn::gdn_chunked(dims, seq, chunk, &mut state, &q, &k, &v, &g, &beta, &mut want);
    Ok(scan_checks::<T>(["out", "out (SIMT)"], got, simt, &want, &state))
}

/// The checks of a chunked scan: its output and final state against the CPU, and where tensor cores ran (`simt`
/// holds the SIMT kernels' run of the same case) both runs. Tensor cores round their MMA operands (decay-scaled inputs,
/// carried states) to bf16, as mamba_ssm and fla do, so their final state is checked at bf16's threshold; the SIMT
/// kernels keep f32's.
fn scan_checks<T: Elem>(
    names: [&'static str; 2],
    (out, state): (Vec<f32>, Vec<f32>),
    simt: Option<(Vec<f32>, Vec<f32>)>,
    want: &[f32],
    want_state: &[f32],
) -> Vec<Check> {
    let mut checks = vec![Check::new(names[0], &out, want, tol::<T>())];
    match simt {
        Some((simt_out, simt_state)) => {
            checks.push(Check::new("state (tensor cores)", &state, want_state, tol::<T>()));
            checks.push(Check::new(names[1], &simt_out, want, tol::<T>()));
            checks.push(Check::new("state (SIMT)", &simt_state, want_state, tol::<f32>()));
        }
        None => checks.push(Check::new("state", &state, want_state, tol::<f32>())),
    }
    checks
}
