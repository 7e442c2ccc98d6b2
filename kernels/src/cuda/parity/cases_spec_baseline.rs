//! Cases for the serial speculative baseline (`ops::{mamba2_spec_verify, gdn_spec_verify, spec_commit}`) against its
//! CPU twins (`replay_mamba2::{verify_baseline, commit_baseline}`, `replay_gdn::{verify_baseline,
//! commit_baseline}`). A batch of rows in random distinct slots of a pool with spare slots verifies `t` tokens each,
//! then commits a different accepted count per row (0, all `t`, and one in between). The outputs, the whole snapshot
//! pool (random, never zero, before the launch: a snapshot written to the wrong slot or position, or one left out,
//! fails) and the whole state pool after the commit are compared.

use super::{rounded, tol, Case, Check, Ctx, Rng};
use crate::cpu;
use crate::cpu::gdn::GdnDims;
use crate::cpu::mamba2::Mamba2Dims;
use crate::cpu::replay_gdn::{self, GdnTokens};
use crate::cpu::replay_mamba2::{self, Mamba2Tokens};
use crate::cuda::ops::{self, SPEC_COMMIT_META};
use crate::cuda::{Elem, Result};

/// Rows per launch, and snapshots per slot in the pool (the engine's verify window; more than any case's `t`, so the
/// slot stride is exercised).
const BATCH: usize = 3;
const SNAP_T: usize = 8;

/// Registers the baseline cases: the target models' layers at `t` = 1..4 and 8, and an odd shape whose key dim is
/// not a whole number of float4s (the scalar kernels).
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
        state_dim: 18,
        groups: 2,
    };
    let g4b = GdnDims {
        k_heads: 16,
        v_heads: 32,
        k_dim: 128,
        v_dim: 128,
    };
    let g_odd = GdnDims {
        k_heads: 2,
        v_heads: 6,
        k_dim: 38,
        v_dim: 24,
    };
    let runs = [1usize, 2, 3, 4, 8].map(|t| (t, "Nemotron-H-8B", "Qwen3.5-4B", false));
    for (t, m_what, g_what, odd) in runs.into_iter().chain([(3, "odd", "odd", true)]) {
        let (md, gd) = if odd { (m_odd, g_odd) } else { (m8b, g4b) };
        let shape = format!(
            "t {t}, batch {BATCH}, {} heads × {}, state {}, {} groups, {m_what}",
            md.heads, md.head_dim, md.state_dim, md.groups
        );
        both!(cases, "spec_baseline_mamba2", shape, mamba2_baseline(md, t));
        let shape = format!(
            "t {t}, batch {BATCH}, {}/{} heads × {}/{}, {g_what}",
            gd.k_heads, gd.v_heads, gd.k_dim, gd.v_dim
        );
        both!(cases, "spec_baseline_gdn", shape, gdn_baseline(gd, t));
    }
}

/// Each row's accepted count: none, all, and a random one in between.
fn accepted_counts(rng: &mut Rng, t: usize) -> Vec<usize> {
    (0..BATCH)
        .map(|i| match i % 3 {
            0 => 0,
            1 => t,
            _ => rng.below(1, t + 1),
        })
        .collect()
}

fn slots_i32(slots: &[usize]) -> Vec<i32> {
    slots.iter().map(|&s| s as i32).collect()
}

/// The commit rows the kernel reads: `(slot, accepted)` per row.
fn commit_rows(slots: &[usize], accepted: &[usize]) -> Vec<i32> {
    let rows: Vec<i32> = slots
        .iter()
        .zip(accepted)
        .flat_map(|(&s, &a)| [s as i32, a as i32])
        .collect();
    debug_assert_eq!(rows.len(), slots.len() * SPEC_COMMIT_META);
    rows
}

/// Runs the commit on the device and its twin on `state`, and returns the compared state pool.
#[allow(clippy::too_many_arguments)]
fn commit_and_check(
    cx: &Ctx,
    sl: usize,
    dstate: &mut cudarc::driver::CudaSlice<f32>,
    dsnaps: &cudarc::driver::CudaSlice<f32>,
    slots: &[usize],
    accepted: &[usize],
    state: &mut [f32],
    snaps: &[f32],
    commit: impl Fn(&mut [f32], &[f32], usize),
) -> Result<Check> {
    let dcommits = cx.dev.upload(&commit_rows(slots, accepted))?;
    ops::spec_commit(cx.dev, sl, dstate, dsnaps, &dcommits)?;
    for (&slot, &acc) in slots.iter().zip(accepted) {
        let per = &snaps[slot * SNAP_T * sl..(slot + 1) * SNAP_T * sl];
        commit(&mut state[slot * sl..(slot + 1) * sl], per, acc);
    }
    Ok(Check::new(
        "committed state",
        &cx.dev.download(dstate)?,
        state,
        tol::<f32>(),
    ))
}

fn mamba2_baseline<T: Elem>(cx: &Ctx, rng: &mut Rng, dims: Mamba2Dims, t: usize) -> Result<Vec<Check>> {
    let (h, p, n, g) = (dims.heads, dims.head_dim, dims.state_dim, dims.groups);
    let pool = BATCH + 2;
    let slots = rng.distinct(BATCH, pool);
    let sl = h * p * n;
    let (wx, wb) = (h * p, g * n);
    let mut state = rng.uniform_vec(pool * sl, 1.0);
    let mut snaps = rng.uniform_vec(pool * SNAP_T * sl, 1.0);
    let a: Vec<f32> = (0..h).map(|_| -rng.uniform(0.0, 2.7).exp()).collect();
    let d: Vec<f32> = rng.uniform_vec(h, 1.0);
    let x = rounded::<T>(&rng.uniform_vec(BATCH * t * wx, 1.0));
    let dt: Vec<f32> = (0..BATCH * t * h)
        .map(|_| cpu::act::softplus(rng.uniform(-3.0, 1.0)))
        .collect();
    let b = rounded::<T>(&rng.uniform_vec(BATCH * t * wb, 1.0));
    let c = rounded::<T>(&rng.uniform_vec(BATCH * t * wb, 1.0));
    let accepted = accepted_counts(rng, t);
    let mut dstate = cx.dev.upload(&state)?;
    let mut dsnaps = cx.dev.upload(&snaps)?;
    let dslots = cx.dev.upload(&slots_i32(&slots))?;
    let (dx, db, dc) = (
        cx.dev.upload_as::<T>(&x)?,
        cx.dev.upload_as::<T>(&b)?,
        cx.dev.upload_as::<T>(&c)?,
    );
    let (ddt, da, dd) = (cx.dev.upload(&dt)?, cx.dev.upload(&a)?, cx.dev.upload(&d)?);
    let mut y = cx.dev.alloc_nan::<T>(BATCH * t * wx)?;
    ops::mamba2_spec_verify(
        cx.dev,
        dims,
        t,
        &dstate,
        &mut dsnaps,
        &dslots,
        &dx,
        &ddt,
        &da,
        &db,
        &dc,
        &dd,
        &mut y,
    )?;
    let mut want = vec![0.0f32; BATCH * t * wx];
    for (r, &slot) in slots.iter().enumerate() {
        let tok = Mamba2Tokens {
            x: &x[r * t * wx..(r + 1) * t * wx],
            dt: &dt[r * t * h..(r + 1) * t * h],
            b: &b[r * t * wb..(r + 1) * t * wb],
            c: &c[r * t * wb..(r + 1) * t * wb],
        };
        replay_mamba2::verify_baseline(
            dims,
            &state[slot * sl..(slot + 1) * sl],
            tok,
            &a,
            &d,
            &mut snaps[slot * SNAP_T * sl..(slot + 1) * SNAP_T * sl],
            &mut want[r * t * wx..(r + 1) * t * wx],
        );
    }
    let mut checks = vec![
        Check::new("y", &cx.dev.download_f32(&y)?, &want, tol::<T>()),
        Check::new("snapshots", &cx.dev.download(&dsnaps)?, &snaps, tol::<f32>()),
    ];
    checks.push(commit_and_check(
        cx,
        sl,
        &mut dstate,
        &dsnaps,
        &slots,
        &accepted,
        &mut state,
        &snaps,
        |st, per, acc| {
            replay_mamba2::commit_baseline(dims, st, per, acc);
        },
    )?);
    Ok(checks)
}

fn gdn_baseline<T: Elem>(cx: &Ctx, rng: &mut Rng, dims: GdnDims, t: usize) -> Result<Vec<Check>> {
    let (hk, hv, dk, dv) = (dims.k_heads, dims.v_heads, dims.k_dim, dims.v_dim);
    let pool = BATCH + 2;
    let slots = rng.distinct(BATCH, pool);
    let sl = dims.state_len();
    let (wk, wv) = (hk * dk, hv * dv);
    let mut state = rng.uniform_vec(pool * sl, 0.5);
    let mut snaps = rng.uniform_vec(pool * SNAP_T * sl, 0.5);
    // q and k arrive L2-normalised, q scaled by 1/√d_k, as the mixer prepares them.
    let normed = |rng: &mut Rng, scale: f32| {
        let mut v = rng.uniform_vec(BATCH * t * wk, 1.0);
        cpu::norm::l2_norm_rows(&mut v, dk, 1e-6);
        v.iter_mut().for_each(|x| *x *= scale);
        rounded::<T>(&v)
    };
    let q = normed(rng, 1.0 / (dk as f32).sqrt());
    let k = normed(rng, 1.0);
    let v = rounded::<T>(&rng.uniform_vec(BATCH * t * wv, 1.0));
    let g: Vec<f32> = (0..BATCH * t * hv)
        .map(|_| -rng.uniform(-1.0, 1.0).exp() * cpu::act::softplus(rng.uniform(-2.0, 2.0)))
        .collect();
    let beta: Vec<f32> = (0..BATCH * t * hv)
        .map(|_| cpu::act::sigmoid(rng.uniform(-2.0, 2.0)))
        .collect();
    let accepted = accepted_counts(rng, t);
    let mut dstate = cx.dev.upload(&state)?;
    let mut dsnaps = cx.dev.upload(&snaps)?;
    let dslots = cx.dev.upload(&slots_i32(&slots))?;
    let (dq, dk_, dv_) = (
        cx.dev.upload_as::<T>(&q)?,
        cx.dev.upload_as::<T>(&k)?,
        cx.dev.upload_as::<T>(&v)?,
    );
    let (dg, dbeta) = (cx.dev.upload(&g)?, cx.dev.upload(&beta)?);
    let mut out = cx.dev.alloc_nan::<T>(BATCH * t * wv)?;
    ops::gdn_spec_verify(
        cx.dev,
        dims,
        t,
        &dstate,
        &mut dsnaps,
        &dslots,
        &dq,
        &dk_,
        &dv_,
        &dg,
        &dbeta,
        &mut out,
    )?;
    let mut want = vec![0.0f32; BATCH * t * wv];
    for (r, &slot) in slots.iter().enumerate() {
        let tok = GdnTokens {
            q: &q[r * t * wk..(r + 1) * t * wk],
            k: &k[r * t * wk..(r + 1) * t * wk],
            v: &v[r * t * wv..(r + 1) * t * wv],
            g: &g[r * t * hv..(r + 1) * t * hv],
            beta: &beta[r * t * hv..(r + 1) * t * hv],
        };
        let at = slot * SNAP_T * sl;
        replay_gdn::verify_baseline(
            dims,
            &state[slot * sl..(slot + 1) * sl],
            tok,
            &mut snaps[at..at + t * sl],
            &mut want[r * t * wv..(r + 1) * t * wv],
        );
    }
    let mut checks = vec![
        Check::new("out", &cx.dev.download_f32(&out)?, &want, tol::<T>()),
        Check::new("snapshots", &cx.dev.download(&dsnaps)?, &snaps, tol::<f32>()),
    ];
    checks.push(commit_and_check(
        cx,
        sl,
        &mut dstate,
        &dsnaps,
        &slots,
        &accepted,
        &mut state,
        &snaps,
        |st, per, acc| {
            replay_gdn::commit_baseline(dims, st, per, acc);
        },
    )?);
    Ok(checks)
}
