//! Launch wrappers of the input-replay kernels (`kernels/replay_mamba2.cu`, `kernels/replay_gdn.cu`, sharing
//! `kernels/replay_common.cuh`): one launch steps a batch of sequences, each row's form, ring position and flush given
//! as data ([`ReplayRow`]), so a batch may mix forms and flushes.

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{after_launch, fits_grid_y, pool_slots};
use crate::cpu::gdn::GdnDims;
use crate::cpu::mamba2::Mamba2Dims;
use crate::cuda::device::{CudaDevice, Elem, SharedLimits};
use crate::cuda::{check_len, driver_err, ensure, Result};

/// `i32`s per row of the metadata array the replay and conv kernels read.
pub const REPLAY_META: usize = 8;

/// The most tokens one row of a replay launch may append (a verify window, or a kv-only prompt piece).
pub const REPLAY_MAX_T: usize = 16;

/// The most values per lane a state row is split into: state (key) dims up to 256.
const MAX_KEY_DIM: usize = 256;

/// Warps per block (each warp serves one (row, head) item on its own), and state rows per streamed chunk
/// (`RP_CHUNK` in `replay_common.cuh`).
const MAX_WARPS: usize = 8;
const CHUNK: usize = 4;

/// Warps one SM can hold of a replay kernel: `__launch_bounds__(256, 3)` lets the compiler use up to 85 registers
/// a thread, and 64 Ki registers hold 24 warps of those.
const SM_WARPS: usize = 24;

/// Warps one SM can hold of the kernel variant that runs `t` tokens of `kind` (register budget only). GDN's 4-token
/// variant is built for 2 blocks of 256 threads an SM (`GDN_MIN_BLOCKS` in `replay_gdn.cu`: 128 registers a thread,
/// 16 warps), which made its verify steps of T = 4 / 6 1.04–1.33× faster on an H100 despite a third fewer warps: its
/// 4-token accumulators are short of registers at 85. The same for Mamba-2's verify steps made them 0.81–0.89× as
/// fast (one-token loops, which fit 85), so every other variant keeps 3 blocks (`bench/results/gpu-ncu-2026-11-26.md`).
fn sm_warps(kind: ReplayKind, t: usize) -> usize {
    match kind {
        ReplayKind::Gdn(_) if gdn_token_block(t) > 1 => 16,
        ReplayKind::Gdn(_) | ReplayKind::Mamba2(_) => SM_WARPS,
    }
}

/// The kernel variant for a state key dim: columns are split in groups of 32 (`NC` in the replay kernels).
fn column_groups(key_dim: usize) -> usize {
    key_dim.div_ceil(32).next_power_of_two()
}

/// The GDN kernel variant for `t` tokens a row: how many it handles together (`SB` in `replay_gdn.cu`). Blocks of 4
/// made a verify of T = 4 1.4–1.6× and T = 6 1.8× faster on an H100, but T = 2 0.74× at batch 256 (half the
/// accumulators idle yet holding registers), and a decode needs none: steps of up to 2 tokens take 1
/// (`bench/results/gpu-replay-kernels-2026-11-26.md`). The Mamba-2 kernel takes its tokens one at a time: blocks of
/// 4 made its verify 0.74–0.86× as fast.
fn gdn_token_block(t: usize) -> usize {
    if t <= 2 {
        1
    } else {
        4
    }
}

/// One row of a replay (or conv) launch: where the sequence's state and entries live and what the step does with its
/// checkpoint. The host decides every field and moves its counters after the launch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayRow {
    /// State, ring and conv slot.
    pub slot: usize,
    /// Physical ring row of logical entry 0.
    pub ring_start: usize,
    /// Committed entries `h`.
    pub ring_len: usize,
    /// The slot's logical ring capacity (at most the pool's rows per slot).
    pub ring_cap: usize,
    /// After the readout the checkpoint becomes the state after logical entries `0 .. fold` (0: not written).
    pub fold: usize,
    /// The checkpoint holds the state before entry 0 (false: a zero state, the kv-only form).
    pub read_state: bool,
    /// Physical row of the oldest conv history row.
    pub conv_head: usize,
}

impl ReplayRow {
    /// The row as the kernels read it.
    pub fn encode(&self) -> [i32; REPLAY_META] {
        [
            self.slot as i32,
            self.ring_start as i32,
            self.ring_len as i32,
            self.ring_cap as i32,
            self.fold as i32,
            self.read_state as i32,
            self.conv_head as i32,
            0,
        ]
    }

    /// Every row, flattened.
    pub fn encode_all(rows: &[ReplayRow]) -> Vec<i32> {
        rows.iter().flat_map(|r| r.encode()).collect()
    }
}

/// What a replay launch needs besides its tensors.
#[derive(Clone, Copy, Debug)]
pub struct ReplayShape {
    /// Rows (sequences).
    pub batch: usize,
    /// Tokens each row appends (0: a fold alone).
    pub t: usize,
    /// Ring rows per slot in the pools.
    pub ring_rows: usize,
    /// The largest `h + t` of any row (sizes the shared memory).
    pub max_m: usize,
}

/// Scratch floats of one warp: the kernels' layout in `replay_mamba2.cu` / `replay_gdn.cu`.
fn warp_scratch(kind: ReplayKind, t: usize, max_m: usize) -> usize {
    let floats = match kind {
        ReplayKind::Mamba2(d) => {
            let (n, p) = (d.state_dim, d.head_dim);
            t * n + 2 * max_m + t * max_m + max_m + t + 1 + t * p
        }
        ReplayKind::Gdn(d) => {
            let dk = d.k_dim;
            2 * t * dk
                + max_m
                + 2 * max_m * t
                + 2 * max_m
                + 2 * t * t
                + 2 * t
                + 2
                + max_m
                + 3 * t * CHUNK
                + 2 * t * d.v_dim
                + max_m * CHUNK
        }
    };
    // Each warp's slice starts 16-byte aligned: the vectors at its head are read 16 bytes at a time.
    floats.next_multiple_of(4)
}

/// How a replay launch is laid out: warps per block, and each warp's scratch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplayGeometry {
    /// Warps per block, one (row, head) item each.
    pub warps: usize,
    /// Scratch floats per warp.
    pub scratch: usize,
}

/// Warps per SM a launch of one token a row (a decode, or a fold alone) aims to keep busy: below this, each head's
/// rows are split between several warps.
const WARPS_PER_SM_TARGET: usize = 32;

/// The same for a verify (two or more tokens a row). Every warp of a split head repeats the head's per-token work
/// (the key products over the ring, the B·C weights, GDN's triangular solve), which grows with the tokens while each
/// warp's share of the state shrinks, so verifies split less: on an H100 at batch 64 the GDN verify of T = 4 ran
/// 1.31× faster with 8 than with 32, T = 6 1.39×, while flush steps of one token lost 5–19 % at 8
/// (`bench/results/gpu-replay-splits-2026-11-27.md`).
const VERIFY_WARPS_PER_SM_TARGET: usize = 8;

/// The target for launches of `t` tokens a row, or `REWIND_REPLAY_SM_WARPS` for every launch when set (an integer in
/// 1 ..= 1024, others ignored; an experiment aid for `bench/gpu/env_ab.sh`, read once). Splitting moves no arithmetic
/// between rows, so outputs do not change.
fn warps_per_sm_target(t: usize) -> usize {
    static OVERRIDE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let forced = *OVERRIDE.get_or_init(|| {
        std::env::var("REWIND_REPLAY_SM_WARPS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|v| (1..=1024).contains(v))
    });
    forced.unwrap_or(if t >= 2 {
        VERIFY_WARPS_PER_SM_TARGET
    } else {
        WARPS_PER_SM_TARGET
    })
}

/// How many warps share one head's rows in a launch of `t` tokens a row: enough for `batch · heads · splits` to
/// fill the device, at most one 4-row chunk (`RP_CHUNK / 2` with `RP_RPW = 1`) per warp.
fn row_splits(dev: &CudaDevice, batch: usize, heads: usize, rows: usize, t: usize) -> usize {
    let chunks = rows.div_ceil(CHUNK);
    let target = dev.sm_count() * warps_per_sm_target(t);
    target.div_ceil((batch * heads).max(1)).clamp(1, chunks.max(1))
}

impl ReplayGeometry {
    /// Dynamic shared memory of one block, in bytes.
    pub fn shared_bytes(&self) -> usize {
        self.warps * self.scratch * 4
    }

    /// Warps an SM holds of this layout for `t` tokens of `kind`: the register budget's blocks or shared memory's.
    fn resident(&self, kind: ReplayKind, t: usize, shared: SharedLimits) -> usize {
        let per_block = self.shared_bytes() + shared.reserved_per_block;
        self.warps * (sm_warps(kind, t) / self.warps).min(shared.per_sm / per_block)
    }
}

/// The layout of a launch of `t` tokens per row and rings of at most `max_m` entries on a device with `shared`: the
/// warps per block (1 … 8) that let an SM hold the most warps, given each warp's scratch (a verify's scratch is
/// several times a decode's, and these kernels are latency-bound, so resident warps are their speed); an error when
/// one warp's scratch cannot fit a block.
pub fn replay_geometry(kind: ReplayKind, t: usize, max_m: usize, shared: SharedLimits) -> Result<ReplayGeometry> {
    let scratch = warp_scratch(kind, t, max_m);
    let bytes = scratch * 4;
    let max_block = shared.per_block;
    ensure("replay", bytes <= max_block, || {
        format!("{t} tokens over rings of {max_m} entries need {bytes} bytes of shared memory per warp (> {max_block})")
    })?;
    let resident = |w: usize| ReplayGeometry { warps: w, scratch }.resident(kind, t, shared);
    let warps = (1..=MAX_WARPS)
        .filter(|&w| w * bytes <= max_block)
        .max_by_key(|&w| (resident(w), w))
        .unwrap_or(1);
    Ok(ReplayGeometry { warps, scratch })
}

/// Which family a replay launch serves.
#[derive(Clone, Copy, Debug)]
pub enum ReplayKind {
    /// Mamba-2 (heads split into B/C groups).
    Mamba2(Mamba2Dims),
    /// Gated DeltaNet (value heads reading key heads).
    Gdn(GdnDims),
}

fn check_shape(op: &'static str, shape: ReplayShape, key_dim: usize) -> Result<()> {
    ensure(op, shape.t <= REPLAY_MAX_T, || {
        format!("{} tokens per row exceed {REPLAY_MAX_T}", shape.t)
    })?;
    ensure(op, (1..=MAX_KEY_DIM).contains(&key_dim), || {
        format!("state key dim {key_dim} is outside 1..={MAX_KEY_DIM}")
    })?;
    ensure(op, shape.max_m >= shape.t && shape.max_m <= shape.ring_rows, || {
        format!(
            "max_m {} must lie in {}..={} (ring rows)",
            shape.max_m, shape.t, shape.ring_rows
        )
    })?;
    fits_grid_y(op, "batch", shape.batch)
}

/// Raises the kernel's dynamic shared memory limit when a launch needs more than the default 48 KiB.
fn shared_limit(dev: &CudaDevice, name: &str, bytes: usize) -> Result<()> {
    if bytes > 48 * 1024 {
        dev.function(name)?
            .set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(driver_err(format!("raising the shared memory limit of {name}")))?;
    }
    Ok(())
}

/// A Mamba-2 replay step (ReplaySSM Alg. 2 / 4 and the fold; CPU twins `replay_mamba2::{replay_decode,
/// verify_replay, flush, compress}`). `state_pool`: `[slots, heads, head_dim, state_dim]` f32; `meta`: `[batch, 8]`
/// ([`ReplayRow`]); `x`, `y`: `[batch, t, heads, head_dim]`; `dt`: `[batch, t, heads]` f32; `b`, `c`:
/// `[batch, t, groups, state_dim]`; `a`, `d_skip`: `[heads]` f32. Each row's `t` entries are written to its ring at
/// logical `h .. h + t`; its checkpoint is written when `fold > 0`.
#[allow(clippy::too_many_arguments)]
pub fn mamba2_replay<T: Elem>(
    dev: &CudaDevice,
    dims: Mamba2Dims,
    shape: ReplayShape,
    state_pool: &mut impl DevicePtrMut<f32>,
    ring_x: &mut impl DevicePtrMut<T>,
    ring_dt: &mut impl DevicePtrMut<f32>,
    ring_b: &mut impl DevicePtrMut<T>,
    meta: &impl DevicePtr<i32>,
    x: &impl DevicePtr<T>,
    dt: &impl DevicePtr<f32>,
    a: &impl DevicePtr<f32>,
    b: &impl DevicePtr<T>,
    c: &impl DevicePtr<T>,
    d_skip: &impl DevicePtr<f32>,
    y: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "mamba2_replay";
    let Mamba2Dims {
        heads,
        head_dim,
        state_dim,
        groups,
    } = dims;
    ensure(OP, groups > 0 && heads.is_multiple_of(groups) && head_dim > 0, || {
        format!("bad dims {dims:?}")
    })?;
    check_shape(OP, shape, state_dim)?;
    let ReplayShape {
        batch,
        t,
        ring_rows,
        max_m,
    } = shape;
    let num_slots = pool_slots(OP, state_pool.len(), heads * head_dim * state_dim)?;
    check_len(OP, "ring x", ring_x.len(), num_slots * ring_rows * heads * head_dim)?;
    check_len(OP, "ring dt", ring_dt.len(), num_slots * ring_rows * heads)?;
    check_len(OP, "ring B", ring_b.len(), num_slots * ring_rows * groups * state_dim)?;
    check_len(OP, "meta", meta.len(), batch * REPLAY_META)?;
    check_len(OP, "x", x.len(), batch * t * heads * head_dim)?;
    check_len(OP, "y", y.len(), batch * t * heads * head_dim)?;
    check_len(OP, "dt", dt.len(), batch * t * heads)?;
    check_len(OP, "A", a.len(), heads)?;
    check_len(OP, "D", d_skip.len(), heads)?;
    check_len(OP, "B", b.len(), batch * t * groups * state_dim)?;
    check_len(OP, "C", c.len(), batch * t * groups * state_dim)?;
    if batch == 0 {
        return Ok(());
    }
    let geo = replay_geometry(ReplayKind::Mamba2(dims), t, max_m, dev.shared_limits())?;
    let smem = geo.shared_bytes();
    let scratch_i = geo.scratch as i32;
    let splits = row_splits(dev, batch, heads, head_dim, t);
    let splits_i = splits as i32;
    let name = format!("mamba2_replay_nc{}_{}", column_groups(state_dim), T::NAME);
    shared_limit(dev, &name, smem)?;
    let (slots_i, rows_i, t_i, h_i, p_i, n_i, g_i, m_i) = (
        num_slots as i32,
        ring_rows as i32,
        t as i32,
        heads as i32,
        head_dim as i32,
        state_dim as i32,
        groups as i32,
        max_m as i32,
    );
    let s = dev.stream();
    let (sp, _g0) = state_pool.device_ptr_mut(s);
    let (rxp, _g1) = ring_x.device_ptr_mut(s);
    let (rdp, _g2) = ring_dt.device_ptr_mut(s);
    let (rbp, _g3) = ring_b.device_ptr_mut(s);
    let (mp, _g4) = meta.device_ptr(s);
    let (xp, _g5) = x.device_ptr(s);
    let (dtp, _g6) = dt.device_ptr(s);
    let (ap, _g7) = a.device_ptr(s);
    let (bp, _g8) = b.device_ptr(s);
    let (cp, _g9) = c.device_ptr(s);
    let (dp, _g10) = d_skip.device_ptr(s);
    let (yp, _g11) = y.device_ptr_mut(s);
    let cfg = LaunchConfig {
        grid_dim: ((heads * splits).div_ceil(geo.warps) as u32, batch as u32, 1),
        block_dim: (32 * geo.warps as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    launch!(
        dev, name, cfg, sp, rxp, rdp, rbp, mp, slots_i, rows_i, xp, dtp, ap, bp, cp, dp, yp, t_i, h_i, p_i, n_i, g_i,
        m_i, scratch_i, splits_i
    )
}

/// A Gated DeltaNet replay step (ReplaySSM Alg. 6 / 8 and the fold; CPU twins `replay_gdn::{replay_decode,
/// verify_replay, flush, compress}`). `state_pool`: `[slots, v_heads, v_dim, k_dim]` f32; rings `u`
/// `[slots, R, v_heads, v_dim]`, `k` `[slots, R, k_heads, k_dim]`, `g` `[slots, R, v_heads]` (f32); `meta`:
/// `[batch, 8]`; `q`, `k`: `[batch, t, k_heads, k_dim]`; `v`, `out`: `[batch, t, v_heads, v_dim]`; `g`, `beta`:
/// `[batch, t, v_heads]` f32.
#[allow(clippy::too_many_arguments)]
pub fn gdn_replay<T: Elem>(
    dev: &CudaDevice,
    dims: GdnDims,
    shape: ReplayShape,
    state_pool: &mut impl DevicePtrMut<f32>,
    ring_u: &mut impl DevicePtrMut<T>,
    ring_k: &mut impl DevicePtrMut<T>,
    ring_g: &mut impl DevicePtrMut<f32>,
    meta: &impl DevicePtr<i32>,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    g: &impl DevicePtr<f32>,
    beta: &impl DevicePtr<f32>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "gdn_replay";
    let GdnDims {
        k_heads,
        v_heads,
        k_dim,
        v_dim,
    } = dims;
    ensure(OP, k_heads > 0 && v_heads.is_multiple_of(k_heads) && v_dim > 0, || {
        format!("bad dims {dims:?}")
    })?;
    check_shape(OP, shape, k_dim)?;
    let ReplayShape {
        batch,
        t,
        ring_rows,
        max_m,
    } = shape;
    let num_slots = pool_slots(OP, state_pool.len(), dims.state_len())?;
    check_len(OP, "ring u", ring_u.len(), num_slots * ring_rows * v_heads * v_dim)?;
    check_len(OP, "ring k", ring_k.len(), num_slots * ring_rows * k_heads * k_dim)?;
    check_len(OP, "ring g", ring_g.len(), num_slots * ring_rows * v_heads)?;
    check_len(OP, "meta", meta.len(), batch * REPLAY_META)?;
    check_len(OP, "q", q.len(), batch * t * k_heads * k_dim)?;
    check_len(OP, "k", k.len(), batch * t * k_heads * k_dim)?;
    check_len(OP, "v", v.len(), batch * t * v_heads * v_dim)?;
    check_len(OP, "out", out.len(), batch * t * v_heads * v_dim)?;
    check_len(OP, "g", g.len(), batch * t * v_heads)?;
    check_len(OP, "beta", beta.len(), batch * t * v_heads)?;
    if batch == 0 {
        return Ok(());
    }
    let geo = replay_geometry(ReplayKind::Gdn(dims), t, max_m, dev.shared_limits())?;
    let smem = geo.shared_bytes();
    let scratch_i = geo.scratch as i32;
    let splits = row_splits(dev, batch, v_heads, v_dim, t);
    let splits_i = splits as i32;
    let name = format!(
        "gdn_replay_nc{}_sb{}_{}",
        column_groups(k_dim),
        gdn_token_block(t),
        T::NAME
    );
    shared_limit(dev, &name, smem)?;
    let (slots_i, rows_i, t_i, hk_i, hv_i, dk_i, dv_i, m_i) = (
        num_slots as i32,
        ring_rows as i32,
        t as i32,
        k_heads as i32,
        v_heads as i32,
        k_dim as i32,
        v_dim as i32,
        max_m as i32,
    );
    let s = dev.stream();
    let (sp, _g0) = state_pool.device_ptr_mut(s);
    let (rup, _g1) = ring_u.device_ptr_mut(s);
    let (rkp, _g2) = ring_k.device_ptr_mut(s);
    let (rgp, _g3) = ring_g.device_ptr_mut(s);
    let (mp, _g4) = meta.device_ptr(s);
    let (qp, _g5) = q.device_ptr(s);
    let (kp, _g6) = k.device_ptr(s);
    let (vp, _g7) = v.device_ptr(s);
    let (gp, _g8) = g.device_ptr(s);
    let (bp, _g9) = beta.device_ptr(s);
    let (op, _g10) = out.device_ptr_mut(s);
    let cfg = LaunchConfig {
        grid_dim: ((v_heads * splits).div_ceil(geo.warps) as u32, batch as u32, 1),
        block_dim: (32 * geo.warps as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    launch!(
        dev, name, cfg, sp, rup, rkp, rgp, mp, slots_i, rows_i, qp, kp, vp, gp, bp, op, t_i, hk_i, hv_i, dk_i, dv_i,
        m_i, scratch_i, splits_i
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const GDN: ReplayKind = ReplayKind::Gdn(GdnDims {
        k_heads: 16,
        v_heads: 32,
        k_dim: 128,
        v_dim: 128,
    });
    const MAMBA2: ReplayKind = ReplayKind::Mamba2(Mamba2Dims {
        heads: 128,
        head_dim: 64,
        state_dim: 128,
        groups: 8,
    });

    const HOPPER: SharedLimits = SharedLimits::HOPPER;

    fn resident(kind: ReplayKind, t: usize, geo: ReplayGeometry, shared: SharedLimits) -> usize {
        geo.resident(kind, t, shared)
    }

    #[test]
    fn geometry_keeps_the_most_warps_resident() {
        // A100's limits beside Hopper's: 163 KiB a block, 164 KiB an SM.
        let a100 = SharedLimits {
            per_block: 163 * 1024,
            per_sm: 164 * 1024,
            reserved_per_block: 1024,
        };
        for shared in [HOPPER, a100] {
            for kind in [GDN, MAMBA2] {
                for t in [0, 1, 2, 4, 6, 16] {
                    let geo = replay_geometry(kind, t, 16 + t, shared).unwrap();
                    assert!((1..=MAX_WARPS).contains(&geo.warps));
                    assert!(geo.shared_bytes() <= shared.per_block);
                    // No other warp count that fits a block keeps more warps on an SM.
                    for w in 1..=MAX_WARPS {
                        let other = ReplayGeometry { warps: w, ..geo };
                        if other.shared_bytes() <= shared.per_block {
                            assert!(
                                resident(kind, t, other, shared) <= resident(kind, t, geo, shared),
                                "{kind:?} t {t}: {w} warps beat {}",
                                geo.warps
                            );
                        }
                    }
                }
            }
        }
        // A decode's small scratch fills the register limit with full blocks, and so does a GDN verify of 4 tokens
        // (9.3 KiB of scratch a warp), whose variant's budget of 128 registers holds two blocks of 8.
        let decode = replay_geometry(GDN, 1, 17, HOPPER).unwrap();
        assert_eq!((decode.warps, resident(GDN, 1, decode, HOPPER)), (8, 24));
        let verify = replay_geometry(GDN, 4, 20, HOPPER).unwrap();
        assert_eq!((verify.warps, resident(GDN, 4, verify, HOPPER)), (8, 16));
        // A 16-token kv-only piece over a 32-entry ring needs 39 KiB a warp: five fit a Hopper SM, in one block;
        // an A100 block holds four.
        let piece = replay_geometry(GDN, 16, 32, HOPPER).unwrap();
        assert_eq!((piece.warps, resident(GDN, 16, piece, HOPPER)), (5, 5));
        let piece = replay_geometry(GDN, 16, 32, a100).unwrap();
        assert_eq!((piece.warps, resident(GDN, 16, piece, a100)), (4, 4));
    }

    #[test]
    fn a_scratch_larger_than_a_block_is_refused() {
        let huge = ReplayKind::Gdn(GdnDims {
            k_heads: 1,
            v_heads: 1,
            k_dim: 4096,
            v_dim: 4096,
        });
        assert!(replay_geometry(huge, 16, 1 << 14, HOPPER).is_err());
    }
}
