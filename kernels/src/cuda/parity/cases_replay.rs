//! Cases for the input-replay kernels against their CPU twins (`cpu::replay_mamba2`, `cpu::replay_gdn`). Every launch
//! mixes rows of different forms — replay without and with a flush, kv-only, kv-only compressing in the same step —
//! with random ring starts and lengths (wrapping), in slots of a pool with spare slots; the whole state and ring pools
//! are compared afterwards, so a write to the wrong slot or row fails as surely as a wrong value.

use cudarc::driver::CudaSlice;

use super::{rounded, tol, Case, Check, Ctx, Rng};
use crate::cpu;
use crate::cpu::gdn::GdnDims;
use crate::cpu::mamba2::Mamba2Dims;
use crate::cpu::replay_gdn::{self, GdnRingBuf, GdnTokens};
use crate::cpu::replay_mamba2::{self, Mamba2RingBuf, Mamba2Tokens};
use crate::cuda::ops::{self, ReplayRow, ReplayShape};
use crate::cuda::{Elem, Result};

/// What a row's step does with its checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RowKind {
    /// Replay, output only.
    Replay,
    /// Replay with the flush (a decode folds its own entry too, a verify only the history).
    Flush,
    /// Kv-only: no checkpoint.
    KvOnly,
    /// Kv-only whose step also compresses every entry, its own included, into a fresh checkpoint (decode only).
    Compress,
}

const KINDS_STEP: [RowKind; 4] = [RowKind::Replay, RowKind::Flush, RowKind::KvOnly, RowKind::Compress];
const KINDS_VERIFY: [RowKind; 3] = [RowKind::Replay, RowKind::Flush, RowKind::KvOnly];
/// A fold alone (`t = 0`): a flush of the history, or a kv-only ring's compress.
const KINDS_FOLD: [RowKind; 2] = [RowKind::Flush, RowKind::Compress];

/// Ring capacities: replay slots `L`, kv-only slots `threshold + T` (the pool holds the larger).
const L: usize = 16;
const KV_CAP: usize = 40;

/// Registers the replay cases.
pub(super) fn register(cases: &mut Vec<Case>) {
    let m8b = Mamba2Dims {
        heads: 128,
        head_dim: 64,
        state_dim: 128,
        groups: 8,
    };
    let m_odd = Mamba2Dims {
        heads: 6,
        head_dim: 5,
        state_dim: 20,
        groups: 2,
    };
    for (dims, what) in [(m8b, "Nemotron-H-8B"), (m_odd, "odd")] {
        // t = 10: a kv-only prompt piece (the GDN kernel takes it in three blocks of at most 4 tokens).
        for t in [1usize, 4, 10, 0] {
            let shape = format!(
                "t {t}, {} heads × {}, state {}, {} groups, mixed forms, {what}",
                dims.heads, dims.head_dim, dims.state_dim, dims.groups
            );
            both!(cases, "mamba2_replay", shape, mamba2_replay(dims, t, 2));
        }
    }
    let g4b = GdnDims {
        k_heads: 16,
        v_heads: 32,
        k_dim: 128,
        v_dim: 128,
    };
    let g_odd = GdnDims {
        k_heads: 2,
        v_heads: 6,
        k_dim: 40,
        v_dim: 24,
    };
    // Dims that are not multiples of 4: the kernel's one-column loads and its last, partly clamped 4-row chunk.
    let g_ragged = GdnDims {
        k_heads: 2,
        v_heads: 6,
        k_dim: 38,
        v_dim: 22,
    };
    let cases_gdn = [
        (g4b, "Qwen3.5-4B", &[1usize, 4, 10, 0][..]),
        (g_odd, "odd", &[1, 4, 10, 0][..]),
        // t = 3: one partial block of the kernel's 4 tokens.
        (g_ragged, "ragged", &[1, 3, 10, 0][..]),
    ];
    for (dims, what, ts) in cases_gdn {
        for &t in ts {
            let shape = format!(
                "t {t}, {}/{} heads × {}/{}, mixed forms, {what}",
                dims.k_heads, dims.v_heads, dims.k_dim, dims.v_dim
            );
            both!(cases, "gdn_replay", shape, gdn_replay(dims, t, 2));
        }
    }
    // Enough (row, head) items that each warp streams several chunks of its head, so the checkpoint pipeline refills
    // and reuses its stages (small launches split a head's rows so finely that a warp takes one or two chunks). On
    // 132 SMs: a decode and a 2-token verify over 20 / 21 rows, 5 chunks a warp (three stages); 704 rows of ragged
    // dims, one warp a head, 18 chunks each through the one-column path.
    for (t, copies) in [(1usize, 5usize), (2, 7)] {
        let rows = copies * if t == 1 { KINDS_STEP.len() } else { KINDS_VERIFY.len() };
        let shape = format!("t {t}, 16/32 heads × 128/128, {rows} rows (5 chunks a warp), Qwen3.5-4B");
        both!(cases, "gdn_replay", shape, gdn_replay(g4b, t, copies));
    }
    let g_long = GdnDims {
        k_heads: 2,
        v_heads: 6,
        k_dim: 38,
        v_dim: 70,
    };
    both!(
        cases,
        "gdn_replay",
        "t 1, 2/6 heads × 38/70, 704 rows (18 chunks a warp), ragged",
        gdn_replay(g_long, 1, 176)
    );
    let m_long = Mamba2Dims {
        heads: 6,
        head_dim: 70,
        state_dim: 22,
        groups: 2,
    };
    both!(
        cases,
        "mamba2_replay",
        "t 1, 6 heads × 70, state 22, 2 groups, 704 rows (18 chunks a warp), ragged",
        mamba2_replay(m_long, 1, 176)
    );
    // 66 rows of a verify: 2112 (row, head) items, so on 132 SMs two warps share a head, 64 value rows each (two
    // 32-row passes of the row loops).
    both!(
        cases,
        "gdn_replay",
        "t 4, 16/32 heads × 128/128, 66 rows (64 value rows a warp), Qwen3.5-4B",
        gdn_replay(g4b, 4, 22)
    );
}

/// The rows of a launch: one per kind (`copies` times over), each in a random distinct slot of `pool` (at least
/// 4 · `copies`) with a random ring start and a history that fits its capacity with the step's tokens.
fn plan_rows(rng: &mut Rng, t: usize, copies: usize, pool: usize) -> Vec<(ReplayRow, RowKind)> {
    let kinds: &[RowKind] = match t {
        0 => &KINDS_FOLD,
        1 => &KINDS_STEP,
        _ => &KINDS_VERIFY,
    };
    let all: Vec<RowKind> = (0..copies).flat_map(|_| kinds.iter().copied()).collect();
    let slots = rng.distinct(all.len(), pool);
    all.into_iter()
        .zip(slots)
        .map(|(kind, slot)| {
            let kv = matches!(kind, RowKind::KvOnly | RowKind::Compress);
            let cap = if kv { KV_CAP } else { L };
            let h = rng.below(if t == 0 { 1 } else { 0 }, cap - t.max(1) + 1);
            let fold = match kind {
                RowKind::Replay | RowKind::KvOnly => 0,
                RowKind::Flush if t == 1 => h + 1,
                RowKind::Flush => h,
                RowKind::Compress => h + t,
            };
            let row = ReplayRow {
                slot,
                ring_start: rng.below(0, cap),
                ring_len: h,
                ring_cap: cap,
                fold,
                read_state: !kv,
                conv_head: 0,
            };
            (row, kind)
        })
        .collect()
}

fn shape_of(rows: &[(ReplayRow, RowKind)], t: usize) -> ReplayShape {
    ReplayShape {
        batch: rows.len(),
        t,
        ring_rows: KV_CAP,
        max_m: rows.iter().map(|(r, _)| r.ring_len + t).max().unwrap_or(t).max(1),
    }
}

/// Copies rows `0..cap` of one slot's field (`width` values a row) between a pool and a ring's storage.
fn slot_rows(pool: &mut [f32], ring: &mut [f32], slot: usize, cap: usize, width: usize, to_ring: bool) {
    let at = slot * KV_CAP * width;
    let (p, r) = (&mut pool[at..at + cap * width], &mut ring[..cap * width]);
    if to_ring {
        r.copy_from_slice(p);
    } else {
        p.copy_from_slice(r);
    }
}

/// Uploads `v` into a buffer of at least one element (a fold alone has empty inputs; the device cannot allocate none).
fn padded<T: Elem>(cx: &Ctx, v: &[f32]) -> Result<CudaSlice<T>> {
    if v.is_empty() {
        cx.dev.upload_as::<T>(&[0.0])
    } else {
        cx.dev.upload_as::<T>(v)
    }
}

fn padded_f32(cx: &Ctx, v: &[f32]) -> Result<CudaSlice<f32>> {
    cx.dev.upload(if v.is_empty() { &[0.0] } else { v })
}

fn mamba2_replay<T: Elem>(cx: &Ctx, rng: &mut Rng, dims: Mamba2Dims, t: usize, copies: usize) -> Result<Vec<Check>> {
    let (h, p, n, g) = (dims.heads, dims.head_dim, dims.state_dim, dims.groups);
    let pool = 4 * copies + 4;
    let rows = plan_rows(rng, t, copies, pool);
    let batch = rows.len();
    let sl = h * p * n;
    let mut state = rng.uniform_vec(pool * sl, 1.0);
    let (wx, wdt, wb) = (h * p, h, g * n);
    let mut px = rounded::<T>(&rng.uniform_vec(pool * KV_CAP * wx, 1.0));
    let mut pdt: Vec<f32> = (0..pool * KV_CAP * wdt)
        .map(|_| cpu::act::softplus(rng.uniform(-3.0, 1.0)))
        .collect();
    let mut pb = rounded::<T>(&rng.uniform_vec(pool * KV_CAP * wb, 1.0));
    let a: Vec<f32> = (0..h).map(|_| -rng.uniform(0.0, 2.7).exp()).collect();
    let d: Vec<f32> = rng.uniform_vec(h, 1.0);
    let x = rounded::<T>(&rng.uniform_vec(batch * t * wx, 1.0));
    let dt: Vec<f32> = (0..batch * t * h)
        .map(|_| cpu::act::softplus(rng.uniform(-3.0, 1.0)))
        .collect();
    let b = rounded::<T>(&rng.uniform_vec(batch * t * wb, 1.0));
    let c = rounded::<T>(&rng.uniform_vec(batch * t * wb, 1.0));
    // Each row's ring as the CPU holds it, with the pool's rows as its storage.
    let mut rings: Vec<Mamba2RingBuf> = rows
        .iter()
        .map(|(r, _)| {
            let mut ring = Mamba2RingBuf::new(dims, r.ring_cap);
            slot_rows(&mut px, &mut ring.x, r.slot, r.ring_cap, wx, true);
            slot_rows(&mut pdt, &mut ring.dt, r.slot, r.ring_cap, wdt, true);
            slot_rows(&mut pb, &mut ring.b, r.slot, r.ring_cap, wb, true);
            ring.index.start = r.ring_start;
            ring.index.len = r.ring_len;
            ring
        })
        .collect();
    let shape = shape_of(&rows, t);
    let mut dstate = cx.dev.upload(&state)?;
    let mut drx = cx.dev.upload_as::<T>(&px)?;
    let mut drdt = cx.dev.upload(&pdt)?;
    let mut drb = cx.dev.upload_as::<T>(&pb)?;
    let meta: Vec<ReplayRow> = rows.iter().map(|(r, _)| *r).collect();
    let dmeta = cx.dev.upload(&ReplayRow::encode_all(&meta))?;
    let (dx, ddt) = (padded::<T>(cx, &x)?, padded_f32(cx, &dt)?);
    let (db, dc) = (padded::<T>(cx, &b)?, padded::<T>(cx, &c)?);
    let n_in = (batch * t * wx, batch * t * h, batch * t * wb);
    let (da, dd) = (cx.dev.upload(&a)?, cx.dev.upload(&d)?);
    let mut y = cx.dev.alloc_nan::<T>((batch * t * wx).max(1))?;
    let mut yv = y.slice_mut(..batch * t * wx);
    ops::mamba2_replay(
        cx.dev,
        dims,
        shape,
        &mut dstate,
        &mut drx,
        &mut drdt,
        &mut drb,
        &dmeta,
        &dx.slice(..n_in.0),
        &ddt.slice(..n_in.1),
        &da,
        &db.slice(..n_in.2),
        &dc.slice(..n_in.2),
        &dd,
        &mut yv,
    )?;
    let mut want = vec![0.0f32; batch * t * wx];
    for (i, ((r, kind), ring)) in rows.iter().zip(&mut rings).enumerate() {
        let tok = Mamba2Tokens {
            x: &x[i * t * wx..(i + 1) * t * wx],
            dt: &dt[i * t * h..(i + 1) * t * h],
            b: &b[i * t * wb..(i + 1) * t * wb],
            c: &c[i * t * wb..(i + 1) * t * wb],
        };
        let st = &mut state[r.slot * sl..(r.slot + 1) * sl];
        let out = &mut want[i * t * wx..(i + 1) * t * wx];
        let mut view = ring.view();
        match (t, kind) {
            (0, RowKind::Flush) => {
                replay_mamba2::flush(st, &mut view, r.ring_len, &a);
            }
            (0, _) => {
                replay_mamba2::compress(st, &mut view, &a);
            }
            (1, RowKind::Replay) => {
                replay_mamba2::replay_decode(Some(st), &mut view, tok, &a, &d, out, false);
            }
            (1, RowKind::Flush) => {
                replay_mamba2::replay_decode(Some(st), &mut view, tok, &a, &d, out, true);
            }
            (1, RowKind::KvOnly) => {
                replay_mamba2::replay_decode(None, &mut view, tok, &a, &d, out, false);
            }
            (1, RowKind::Compress) => {
                replay_mamba2::replay_decode(None, &mut view, tok, &a, &d, out, false);
                replay_mamba2::compress(st, &mut view, &a);
            }
            (_, kind) => {
                let flush = *kind == RowKind::Flush;
                let ckpt = (*kind != RowKind::KvOnly).then_some(st);
                replay_mamba2::verify_replay(ckpt, &mut view, tok, &a, &d, out, flush);
            }
        }
        slot_rows(&mut px, &mut ring.x, r.slot, r.ring_cap, wx, false);
        slot_rows(&mut pdt, &mut ring.dt, r.slot, r.ring_cap, wdt, false);
        slot_rows(&mut pb, &mut ring.b, r.slot, r.ring_cap, wb, false);
    }
    let mut checks = vec![
        Check::new("state", &cx.dev.download(&dstate)?, &state, tol::<f32>() * 10.0),
        Check::new("ring x", &cx.dev.download_f32(&drx)?, &px, 0.0),
        Check::new("ring dt", &cx.dev.download(&drdt)?, &pdt, 0.0),
        Check::new("ring B", &cx.dev.download_f32(&drb)?, &pb, 0.0),
    ];
    if t > 0 {
        checks.insert(
            0,
            Check::new(
                "y",
                &cx.dev.download_f32(&y.slice(..batch * t * wx))?,
                &want,
                tol::<T>(),
            ),
        );
    }
    Ok(checks)
}

/// `copies` rows of each kind: 2 for the mixed-form cases; more to make the launch wide enough that each warp sweeps
/// its head's value rows more than 32 at a time (the row loops' second pass).
fn gdn_replay<T: Elem>(cx: &Ctx, rng: &mut Rng, dims: GdnDims, t: usize, copies: usize) -> Result<Vec<Check>> {
    let (hk, hv, dk, dv) = (dims.k_heads, dims.v_heads, dims.k_dim, dims.v_dim);
    let pool = 4 * copies + 4;
    let rows = plan_rows(rng, t, copies, pool);
    let batch = rows.len();
    let sl = dims.state_len();
    let mut state = rng.uniform_vec(pool * sl, 0.5);
    let (wu, wk, wg) = (hv * dv, hk * dk, hv);
    let normed = |rng: &mut Rng, n: usize, scale: f32| {
        let mut v = rng.uniform_vec(n, 1.0);
        cpu::norm::l2_norm_rows(&mut v, dk, 1e-6);
        v.iter_mut().for_each(|x| *x *= scale);
        rounded::<T>(&v)
    };
    let gate = |rng: &mut Rng| -rng.uniform(-1.0, 1.0).exp() * cpu::act::softplus(rng.uniform(-2.0, 2.0));
    let mut pu = rounded::<T>(&rng.uniform_vec(pool * KV_CAP * wu, 0.5));
    let mut pk = normed(rng, pool * KV_CAP * wk, 1.0);
    let mut pg: Vec<f32> = (0..pool * KV_CAP * wg).map(|_| gate(rng)).collect();
    let q = normed(rng, batch * t * wk, 1.0 / (dk as f32).sqrt());
    let k = normed(rng, batch * t * wk, 1.0);
    let v = rounded::<T>(&rng.uniform_vec(batch * t * wu, 1.0));
    let g: Vec<f32> = (0..batch * t * hv).map(|_| gate(rng)).collect();
    let beta: Vec<f32> = (0..batch * t * hv)
        .map(|_| cpu::act::sigmoid(rng.uniform(-2.0, 2.0)))
        .collect();
    let mut rings: Vec<GdnRingBuf> = rows
        .iter()
        .map(|(r, _)| {
            let mut ring = GdnRingBuf::new(dims, r.ring_cap);
            slot_rows(&mut pu, &mut ring.u, r.slot, r.ring_cap, wu, true);
            slot_rows(&mut pk, &mut ring.k, r.slot, r.ring_cap, wk, true);
            slot_rows(&mut pg, &mut ring.g, r.slot, r.ring_cap, wg, true);
            ring.index.start = r.ring_start;
            ring.index.len = r.ring_len;
            ring
        })
        .collect();
    let shape = shape_of(&rows, t);
    let mut dstate = cx.dev.upload(&state)?;
    let mut dru = cx.dev.upload_as::<T>(&pu)?;
    let mut drk = cx.dev.upload_as::<T>(&pk)?;
    let mut drg = cx.dev.upload(&pg)?;
    let meta: Vec<ReplayRow> = rows.iter().map(|(r, _)| *r).collect();
    let dmeta = cx.dev.upload(&ReplayRow::encode_all(&meta))?;
    let (dq, dk_, dv_) = (padded::<T>(cx, &q)?, padded::<T>(cx, &k)?, padded::<T>(cx, &v)?);
    let (dg, dbeta) = (padded_f32(cx, &g)?, padded_f32(cx, &beta)?);
    let n_in = (batch * t * wk, batch * t * wu, batch * t * hv);
    let mut out = cx.dev.alloc_nan::<T>((batch * t * wu).max(1))?;
    let mut ov = out.slice_mut(..batch * t * wu);
    ops::gdn_replay(
        cx.dev,
        dims,
        shape,
        &mut dstate,
        &mut dru,
        &mut drk,
        &mut drg,
        &dmeta,
        &dq.slice(..n_in.0),
        &dk_.slice(..n_in.0),
        &dv_.slice(..n_in.1),
        &dg.slice(..n_in.2),
        &dbeta.slice(..n_in.2),
        &mut ov,
    )?;
    let mut want = vec![0.0f32; batch * t * wu];
    for (i, ((r, kind), ring)) in rows.iter().zip(&mut rings).enumerate() {
        let tok = GdnTokens {
            q: &q[i * t * wk..(i + 1) * t * wk],
            k: &k[i * t * wk..(i + 1) * t * wk],
            v: &v[i * t * wu..(i + 1) * t * wu],
            g: &g[i * t * hv..(i + 1) * t * hv],
            beta: &beta[i * t * hv..(i + 1) * t * hv],
        };
        let st = &mut state[r.slot * sl..(r.slot + 1) * sl];
        let o = &mut want[i * t * wu..(i + 1) * t * wu];
        let mut view = ring.view();
        match (t, kind) {
            (0, RowKind::Flush) => {
                replay_gdn::flush(st, &mut view, r.ring_len);
            }
            (0, _) => {
                replay_gdn::compress(st, &mut view);
            }
            (1, RowKind::Replay) => {
                replay_gdn::replay_decode(Some(st), &mut view, tok, o, false);
            }
            (1, RowKind::Flush) => {
                replay_gdn::replay_decode(Some(st), &mut view, tok, o, true);
            }
            (1, RowKind::KvOnly) => {
                replay_gdn::replay_decode(None, &mut view, tok, o, false);
            }
            (1, RowKind::Compress) => {
                replay_gdn::replay_decode(None, &mut view, tok, o, false);
                replay_gdn::compress(st, &mut view);
            }
            (_, kind) => {
                let flush = *kind == RowKind::Flush;
                let ckpt = (*kind != RowKind::KvOnly).then_some(st);
                replay_gdn::verify_replay(ckpt, &mut view, tok, o, flush);
            }
        }
        slot_rows(&mut pu, &mut ring.u, r.slot, r.ring_cap, wu, false);
        slot_rows(&mut pk, &mut ring.k, r.slot, r.ring_cap, wk, false);
        slot_rows(&mut pg, &mut ring.g, r.slot, r.ring_cap, wg, false);
    }
    let mut checks = vec![
        Check::new("state", &cx.dev.download(&dstate)?, &state, tol::<f32>() * 10.0),
        Check::new("ring u", &cx.dev.download_f32(&dru)?, &pu, tol::<T>()),
        Check::new("ring k", &cx.dev.download_f32(&drk)?, &pk, 0.0),
        Check::new("ring g", &cx.dev.download(&drg)?, &pg, 0.0),
    ];
    if t > 0 {
        checks.insert(
            0,
            Check::new(
                "out",
                &cx.dev.download_f32(&out.slice(..batch * t * wu))?,
                &want,
                tol::<T>(),
            ),
        );
    }
    Ok(checks)
}
