//! Launch wrappers of the serial speculative baseline (`kernels/spec_baseline.cu`): the verify of `t` tokens of a
//! recurrent sequence that runs the recurrence position by position from the slot's state and writes the state after
//! every position as a snapshot (ReplaySSM Alg. 3 for Mamba-2, Alg. 5 / 7 for Gated DeltaNet), and the commit that
//! makes snapshot `accepted − 1` the slot's state. This is the engine-without-replay path the replay kernels are
//! measured against; its `t` full-state writes per verify are its cost, so they are not optimised away.
//!
//! Snapshot pools are `[slots, snap_t, state]` f32 and indexed by slot like the state pool (`[slots, state]`), so a
//! commit in a later step, in another batch, finds a slot's snapshots; `snap_t` (the pool's snapshots per slot) is
//! taken from the pools' lengths and bounds `t`.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{after_launch, fits_grid_y, pool_slots, with_shared_memory};
use crate::cpu::gdn::GdnDims;
use crate::cpu::mamba2::Mamba2Dims;
use crate::cuda::device::{CudaDevice, Elem};
use crate::cuda::{check_len, driver_err, ensure, Result};

/// Warps per block (`SB_WARPS` in the kernels); each owns one state row at a time.
const WARPS: usize = 4;

/// The largest state key dim (Mamba-2 `state_dim`, GDN `k_dim`): 32 lanes × 8 values a row.
pub const SPEC_MAX_KEY_DIM: usize = 256;

/// The most tokens one row of a baseline verify takes (the replay kernels' bound, so both paths accept the same
/// windows).
pub const SPEC_MAX_T: usize = super::REPLAY_MAX_T;

/// Blocks a launch aims for per SM (4 warps each): below this, a head's rows are split between more blocks.
const BLOCKS_PER_SM_TARGET: usize = 8;

/// The dynamic shared memory a block may use past the default 48 KiB (Hopper and Blackwell: 227 KiB).
const MAX_SHARED: usize = 227 * 1024;

/// How many blocks share one head's `rows` state rows: enough for the grid to fill the device, at least one row per
/// warp.
fn splits(dev: &CudaDevice, batch: usize, heads: usize, rows: usize) -> usize {
    let target = dev.sm_count() * BLOCKS_PER_SM_TARGET;
    target
        .div_ceil((batch * heads).max(1))
        .clamp(1, rows.div_ceil(WARPS).max(1))
}

/// Snapshots per slot of a snapshot pool over `num_slots` slots of `state_len` values; an error unless it is a
/// whole number of at least `t`.
fn snapshots_per_slot(op: &'static str, len: usize, num_slots: usize, state_len: usize, t: usize) -> Result<usize> {
    let per_slot = num_slots * state_len;
    ensure(op, per_slot > 0 && len.is_multiple_of(per_slot), || {
        format!("snapshot pool of {len} is not a whole number of [{num_slots} slots, state {state_len}] layers")
    })?;
    let snap_t = len / per_slot;
    ensure(op, t <= snap_t, || {
        format!("{t} tokens need {t} snapshots per slot; the pool holds {snap_t}")
    })?;
    Ok(snap_t)
}

/// Checks the launch's token count and key dim, and returns its shared memory: the per-draft inputs of one block.
fn check_launch(op: &'static str, batch: usize, t: usize, key_dim: usize, rows_per_block: usize) -> Result<usize> {
    ensure(op, (1..=SPEC_MAX_T).contains(&t), || {
        format!("{t} tokens per row lie outside 1..={SPEC_MAX_T}")
    })?;
    ensure(op, (1..=SPEC_MAX_KEY_DIM).contains(&key_dim), || {
        format!("state key dim {key_dim} is outside 1..={SPEC_MAX_KEY_DIM}")
    })?;
    fits_grid_y(op, "batch", batch)?;
    let bytes = 4 * t * (2 * key_dim + rows_per_block + 2);
    ensure(op, bytes <= MAX_SHARED, || {
        format!("{bytes} bytes of shared memory per block exceed {MAX_SHARED}")
    })?;
    Ok(bytes)
}

/// Whether every state row can move 16 bytes at a time: a key dim of whole float4s and 16-byte aligned pools.
fn vectorised(key_dim: usize, pointers: &[u64]) -> bool {
    key_dim.is_multiple_of(4) && pointers.iter().all(|p| p.is_multiple_of(16))
}

/// The launch of a verify kernel over `heads · splits` blocks per row.
fn verify_config(heads: usize, splits: usize, batch: usize, shared: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((heads * splits) as u32, batch as u32, 1),
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    }
}

/// The baseline verify of `t` tokens per row for Mamba-2 (CPU twin `replay_mamba2::verify_baseline`, run per row).
///
/// `state_pool`: `[slots, heads, head_dim, state_dim]` f32, only read; `snapshots`: `[slots, snap_t, heads, head_dim,
/// state_dim]` f32 (`snap_t ≥ t`), snapshot `s < t` of row `b`'s slot written with the state after its token `s`;
/// `slots`: `[batch]`, distinct; `x`, `y`: `[batch, t, heads, head_dim]`; `dt`: `[batch, t, heads]` f32 (softplus'd);
/// `a`, `d_skip`: `[heads]` f32; `b`, `c`: `[batch, t, groups, state_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn mamba2_spec_verify<T: Elem>(
    dev: &CudaDevice,
    dims: Mamba2Dims,
    t: usize,
    state_pool: &impl DevicePtr<f32>,
    snapshots: &mut impl DevicePtrMut<f32>,
    slots: &impl DevicePtr<i32>,
    x: &impl DevicePtr<T>,
    dt: &impl DevicePtr<f32>,
    a: &impl DevicePtr<f32>,
    b: &impl DevicePtr<T>,
    c: &impl DevicePtr<T>,
    d_skip: &impl DevicePtr<f32>,
    y: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "mamba2_spec_verify";
    let Mamba2Dims {
        heads,
        head_dim,
        state_dim,
        groups,
    } = dims;
    ensure(OP, groups > 0 && heads.is_multiple_of(groups) && head_dim > 0, || {
        format!("bad dims {dims:?}")
    })?;
    let batch = slots.len();
    let state_len = heads * head_dim * state_dim;
    let num_slots = pool_slots(OP, state_pool.len(), state_len)?;
    let snap_t = snapshots_per_slot(OP, snapshots.len(), num_slots, state_len, t)?;
    check_len(OP, "x", x.len(), batch * t * heads * head_dim)?;
    check_len(OP, "y", y.len(), batch * t * heads * head_dim)?;
    check_len(OP, "dt", dt.len(), batch * t * heads)?;
    check_len(OP, "A", a.len(), heads)?;
    check_len(OP, "D", d_skip.len(), heads)?;
    check_len(OP, "B", b.len(), batch * t * groups * state_dim)?;
    check_len(OP, "C", c.len(), batch * t * groups * state_dim)?;
    let split = splits(dev, batch, heads, head_dim);
    let shared = check_launch(OP, batch, t, state_dim, head_dim.div_ceil(split))?;
    if batch == 0 {
        return Ok(());
    }
    let s = dev.stream();
    let (sp, _g0) = state_pool.device_ptr(s);
    let (np, _g1) = snapshots.device_ptr_mut(s);
    let name = format!(
        "spec_mamba2_verify_{}_{}",
        if vectorised(state_dim, &[sp, np]) { "v4" } else { "v1" },
        T::NAME
    );
    if shared > 48 * 1024 {
        with_shared_memory(dev, &name, shared)?;
    }
    let (ip, _g2) = slots.device_ptr(s);
    let (xp, _g3) = x.device_ptr(s);
    let (dtp, _g4) = dt.device_ptr(s);
    let (ap, _g5) = a.device_ptr(s);
    let (bp, _g6) = b.device_ptr(s);
    let (cp, _g7) = c.device_ptr(s);
    let (dp, _g8) = d_skip.device_ptr(s);
    let (yp, _g9) = y.device_ptr_mut(s);
    let (slots_i, snap_i, t_i, h_i, p_i, n_i, g_i, split_i) = (
        num_slots as i32,
        snap_t as i32,
        t as i32,
        heads as i32,
        head_dim as i32,
        state_dim as i32,
        groups as i32,
        split as i32,
    );
    let cfg = verify_config(heads, split, batch, shared);
    launch!(dev, name, cfg, sp, np, ip, slots_i, snap_i, xp, dtp, ap, bp, cp, dp, yp, t_i, h_i, p_i, n_i, g_i, split_i)
}

/// The baseline verify of `t` tokens per row for Gated DeltaNet (CPU twin `replay_gdn::verify_baseline`, run per
/// row).
///
/// `state_pool`: `[slots, v_heads, v_dim, k_dim]` f32, only read; `snapshots`: `[slots, snap_t, v_heads, v_dim,
/// k_dim]` f32 (`snap_t ≥ t`); `slots`: `[batch]`, distinct; `q`, `k`: `[batch, t, k_heads, k_dim]` (L2-normalised,
/// q scaled); `v`, `out`: `[batch, t, v_heads, v_dim]`; `g`, `beta`: `[batch, t, v_heads]` f32.
#[allow(clippy::too_many_arguments)]
pub fn gdn_spec_verify<T: Elem>(
    dev: &CudaDevice,
    dims: GdnDims,
    t: usize,
    state_pool: &impl DevicePtr<f32>,
    snapshots: &mut impl DevicePtrMut<f32>,
    slots: &impl DevicePtr<i32>,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    g: &impl DevicePtr<f32>,
    beta: &impl DevicePtr<f32>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "gdn_spec_verify";
    let GdnDims {
        k_heads,
        v_heads,
        k_dim,
        v_dim,
    } = dims;
    ensure(OP, k_heads > 0 && v_heads.is_multiple_of(k_heads) && v_dim > 0, || {
        format!("bad dims {dims:?}")
    })?;
    let batch = slots.len();
    let state_len = dims.state_len();
    let num_slots = pool_slots(OP, state_pool.len(), state_len)?;
    let snap_t = snapshots_per_slot(OP, snapshots.len(), num_slots, state_len, t)?;
    check_len(OP, "q", q.len(), batch * t * k_heads * k_dim)?;
    check_len(OP, "k", k.len(), batch * t * k_heads * k_dim)?;
    check_len(OP, "v", v.len(), batch * t * v_heads * v_dim)?;
    check_len(OP, "out", out.len(), batch * t * v_heads * v_dim)?;
    check_len(OP, "g", g.len(), batch * t * v_heads)?;
    check_len(OP, "beta", beta.len(), batch * t * v_heads)?;
    let split = splits(dev, batch, v_heads, v_dim);
    let shared = check_launch(OP, batch, t, k_dim, v_dim.div_ceil(split))?;
    if batch == 0 {
        return Ok(());
    }
    let s = dev.stream();
    let (sp, _g0) = state_pool.device_ptr(s);
    let (np, _g1) = snapshots.device_ptr_mut(s);
    let name = format!(
        "spec_gdn_verify_{}_{}",
        if vectorised(k_dim, &[sp, np]) { "v4" } else { "v1" },
        T::NAME
    );
    if shared > 48 * 1024 {
        with_shared_memory(dev, &name, shared)?;
    }
    let (ip, _g2) = slots.device_ptr(s);
    let (qp, _g3) = q.device_ptr(s);
    let (kp, _g4) = k.device_ptr(s);
    let (vp, _g5) = v.device_ptr(s);
    let (gp, _g6) = g.device_ptr(s);
    let (bp, _g7) = beta.device_ptr(s);
    let (op, _g8) = out.device_ptr_mut(s);
    let (slots_i, snap_i, t_i, hk_i, hv_i, dk_i, dv_i, split_i) = (
        num_slots as i32,
        snap_t as i32,
        t as i32,
        k_heads as i32,
        v_heads as i32,
        k_dim as i32,
        v_dim as i32,
        split as i32,
    );
    let cfg = verify_config(v_heads, split, batch, shared);
    launch!(dev, name, cfg, sp, np, ip, slots_i, snap_i, qp, kp, vp, gp, bp, op, t_i, hk_i, hv_i, dk_i, dv_i, split_i)
}

/// `i32`s per row of a commit launch: slot, accepted.
pub const SPEC_COMMIT_META: usize = 2;

/// The baseline commit (CPU twins `replay_mamba2::commit_baseline`, `replay_gdn::commit_baseline`): for each row of
/// `commits` (`[rows, 2]`: slot, accepted) with `accepted > 0`, the slot's state in `state_pool` (`[slots,
/// state_len]` f32) becomes its snapshot `accepted − 1` of `snapshots` (`[slots, snap_t, state_len]`); `accepted = 0`
/// keeps the state. The counts are device data: the caller checks `accepted ≤` the drafts its verify wrote (a slot
/// or count out of range writes nothing).
pub fn spec_commit(
    dev: &CudaDevice,
    state_len: usize,
    state_pool: &mut impl DevicePtrMut<f32>,
    snapshots: &impl DevicePtr<f32>,
    commits: &impl DevicePtr<i32>,
) -> Result<()> {
    const OP: &str = "spec_commit";
    ensure(OP, commits.len().is_multiple_of(SPEC_COMMIT_META), || {
        format!("commits of {} are not whole (slot, accepted) rows", commits.len())
    })?;
    let rows = commits.len() / SPEC_COMMIT_META;
    let num_slots = pool_slots(OP, state_pool.len(), state_len)?;
    let snap_t = snapshots_per_slot(OP, snapshots.len(), num_slots, state_len, 0)?;
    fits_grid_y(OP, "rows", rows)?;
    if rows == 0 {
        return Ok(());
    }
    // A commit needs the snapshots its verify wrote: an empty pool here is a rank sized without them, not a no-op.
    ensure(OP, snap_t > 0, || {
        format!("{rows} commits but the snapshot pool holds no snapshots")
    })?;
    let s = dev.stream();
    let (sp, _g0) = state_pool.device_ptr_mut(s);
    let (np, _g1) = snapshots.device_ptr(s);
    let (cp, _g2) = commits.device_ptr(s);
    let vec = vectorised(state_len, &[sp, np]);
    const BLOCK: usize = 256;
    let items = if vec { state_len / 4 } else { state_len };
    let cfg = LaunchConfig {
        grid_dim: (items.div_ceil(BLOCK).clamp(1, 512) as u32, rows as u32, 1),
        block_dim: (BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (slots_i, snap_i, len_u, vec_i) = (num_slots as i32, snap_t as i32, state_len as u64, i32::from(vec));
    launch!(dev, "spec_commit", cfg, sp, np, cp, slots_i, snap_i, len_u, vec_i)
}
