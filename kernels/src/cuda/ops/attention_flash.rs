//! Launch planning for the tensor-core attention kernels of `attention_flash.cu`: which tiling, how many key splits,
//! and the split workspace. Called by [`super::paged_attention`], which owns the operand checks.

use cudarc::driver::{CudaSlice, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{after_launch, with_shared_memory};
use crate::cuda::device::CudaDevice;
use crate::cuda::{driver_err, Result};

/// A split covers at least this many keys: below it the partials' write and merge cost more than the split saves.
const MIN_SPLIT_KEYS: usize = 256;
/// Upper bound on splits (the combine kernel reads every split of a row).
const MAX_SPLITS: usize = 64;

/// Head dims the tensor-core kernels are built for.
pub(super) fn supported(head_dim: usize) -> bool {
    matches!(head_dim, 64 | 128 | 256)
}

/// The tiling of `attention_flash.cu` (`FaShape`): threads and rows per block, keys per staged tile, and the shared
/// memory a block needs (the main loop's Q tile and K/V stages, or the epilogue's f32 rows if larger).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tiling {
    decode: bool,
    threads: u32,
    rows: usize,
    smem: usize,
}

impl Tiling {
    fn new(decode: bool, head_dim: usize) -> Self {
        // Decode: 4 warps over one m16 tile (2 at head dim 256, so that three blocks share an SM); prefill: a warp per
        // 16 rows, 8 warps up to head dim 128, else 4.
        let warps = match (decode, head_dim > 128) {
            (true, true) => 2,
            (true, false) | (false, true) => 4,
            (false, false) => 8,
        };
        let rows = if decode { 16 } else { 16 * warps };
        let keys = match (decode, head_dim > 128) {
            (true, _) => 16 * warps,
            (false, true) => 32,
            (false, false) => 64,
        };
        let copies = if decode { warps } else { 1 };
        let stages = 2;
        let main_loop = (rows * head_dim + 2 * stages * keys * head_dim) * 2;
        let epilogue = copies * rows * (head_dim + 4 + 2) * 4;
        Self {
            decode,
            threads: 32 * warps as u32,
            rows,
            smem: main_loop.max(epilogue),
        }
    }
}

/// How one call is launched: the kernel, its key splits and grid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttentionPlan {
    /// Kernel name (`attn_flash_decode_d128`, or `attn_paged_bf16` for the SIMT kernel).
    pub kernel: String,
    /// Key ranges each (sequence, KV head, row tile) is cut into; above 1 a combine kernel merges them.
    pub splits: usize,
    /// Blocks of the main kernel.
    pub blocks: usize,
    /// Threads per block of the main kernel.
    pub threads: u32,
}

/// Chooses the tiling and the splits: the decode tiling when all query rows of a KV head (`t · group`) fit one m16
/// tile, else the prefill tiling; then at least enough splits that the grid covers the GPU's resident-block slots
/// (`occupancy · SMs`) — twice for the 4-warp decode blocks, whose blocks are short streams of K/V, once for prefill
/// and for head dim 256's 2-warp decode blocks (three share an SM already; doubling their grid cut 4096-key rows
/// into 256-key splits whose merge cost more than the fuller last wave saved: `bench/results/gpu-ncu-2026-11-26.md`)
/// — but no split shorter than [`MIN_SPLIT_KEYS`] of the slot capacity (the host does not know the lengths; the kernel cuts each
/// sequence's own causal range into `splits` pieces). See [`choose_splits`] for the last step.
#[allow(clippy::too_many_arguments)]
pub(super) fn plan(
    dev: &CudaDevice,
    batch: usize,
    t: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
) -> Result<(AttentionPlan, usize)> {
    let group = heads / kv_heads;
    let tiling = Tiling::new(t * group <= 16, head_dim);
    let name = format!(
        "attn_flash_{}_d{head_dim}",
        if tiling.decode { "decode" } else { "prefill" }
    );
    let func = with_shared_memory(dev, &name, tiling.smem)?;
    let per_sm = func
        .occupancy_max_active_blocks_per_multiprocessor(tiling.threads, tiling.smem, None)
        .map_err(driver_err(format!("reading the occupancy of {name}")))?
        .max(1) as usize;
    let row_tiles = (t * group).div_ceil(tiling.rows);
    let base = batch * kv_heads * row_tiles;
    let slots = per_sm * dev.sm_count() * if tiling.decode && tiling.threads > 64 { 2 } else { 1 };
    let splits = choose_splits(
        base,
        per_sm * dev.sm_count(),
        slots,
        capacity.div_ceil(MIN_SPLIT_KEYS).clamp(1, MAX_SPLITS),
    );
    let plan = AttentionPlan {
        kernel: name,
        splits,
        blocks: base * splits,
        threads: tiling.threads,
    };
    Ok((plan, tiling.smem))
}

/// From `target.div_ceil(base)` splits up to twice that (at most `cap`), the fewest whose grid fills its last wave of
/// `wave` resident blocks to 90 %, else the fullest: equal blocks that stream memory finish together, so a last wave
/// a third full costs nearly a whole wave.
fn choose_splits(base: usize, wave: usize, target: usize, cap: usize) -> usize {
    let lo = target.div_ceil(base).clamp(1, cap);
    let hi = (2 * lo).min(cap);
    let fill = |s: usize| (base * s) as f64 / ((base * s).div_ceil(wave) * wave) as f64;
    (lo..=hi)
        .find(|&s| fill(s) >= 0.9)
        .unwrap_or_else(|| (lo..=hi).fold(lo, |best, s| if fill(s) > fill(best) { s } else { best }))
}

/// Floats of split-KV partials a call of `plan` over `n_rows` query rows needs (0 unsplit).
pub(super) fn workspace_len(plan: &AttentionPlan, n_rows: usize, head_dim: usize) -> usize {
    if plan.splits > 1 {
        plan.splits * n_rows * (head_dim + 2)
    } else {
        0
    }
}

/// Launches the planned kernel (and the combine when split) on raw device pointers the caller has checked.
#[allow(clippy::too_many_arguments)]
pub(super) fn launch(
    dev: &CudaDevice,
    plan: &AttentionPlan,
    smem: usize,
    ptrs: [u64; 7],
    ints: [i32; 7],
    scale: f32,
    batch: usize,
    kv_heads: usize,
    head_dim: usize,
    workspace: Option<&mut CudaSlice<f32>>,
) -> Result<()> {
    let [qp, kp, vp, tp, lp, sp, op] = ptrs;
    let [ns, bps, nb, t_i, h_i, kvh, bs] = ints;
    let (t, heads) = (t_i as usize, h_i as usize);
    let n_rows = batch * t * heads;
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let splits_i = plan.splits as i32;
    // Partials of every (split, output row): O [splits, rows, head_dim] then (m, l) [splits, rows, 2], f32, in the
    // caller's workspace or allocated on the stream (stream-ordered pool allocation) and freed when this call
    // returns, after the combine is queued.
    let need = workspace_len(plan, n_rows, head_dim);
    let mut owned = None;
    let (wo, wm) = if need == 0 {
        (0, 0)
    } else {
        let buf = match workspace {
            Some(ws) if ws.len() >= need => ws,
            Some(ws) => {
                return Err(crate::cuda::CudaError::Shape {
                    op: "paged_attention",
                    message: format!(
                        "the split-KV workspace holds {} floats; {} splits of {n_rows} rows × {head_dim} need {need}",
                        ws.len(),
                        plan.splits
                    ),
                })
            }
            None => owned.insert(dev.alloc::<f32>(need)?),
        };
        let base = buf.device_ptr_mut(dev.stream()).0;
        (base, base + (plan.splits * n_rows * head_dim * 4) as u64)
    };
    let cfg = LaunchConfig {
        grid_dim: ((plan.blocks / (batch * kv_heads)) as u32, kv_heads as u32, batch as u32),
        block_dim: (plan.threads, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    launch!(
        dev,
        plan.kernel,
        cfg,
        qp,
        kp,
        vp,
        tp,
        lp,
        sp,
        ns,
        bps,
        nb,
        op,
        wo,
        wm,
        t_i,
        h_i,
        kvh,
        bs,
        scale_log2,
        splits_i
    )?;
    if need == 0 {
        return Ok(());
    }
    let (rows_i, hd_i) = (n_rows as i32, head_dim as i32);
    let cfg = LaunchConfig {
        grid_dim: (n_rows as u32, 1, 1),
        block_dim: (head_dim as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(dev, "attn_combine_bf16", cfg, wo, wm, op, rows_i, hd_i, splits_i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_fill_the_last_wave() {
        // 256 blocks on 396 slots, at least 2 waves: 4 splits leave the third wave 59 % full, 6 fill 97 %.
        assert_eq!(choose_splits(256, 396, 792, 16), 6);
        // Already 2048 blocks: one split unless a second fills the waves much better (5.2 → 6 waves: 86 %).
        assert_eq!(choose_splits(2048, 396, 396, 64), 2);
        assert_eq!(choose_splits(512, 264, 264, 4), 1);
        // Capped by the capacity (a 128-token slot is never split).
        assert_eq!(choose_splits(8, 396, 792, 1), 1);
        assert_eq!(choose_splits(64, 132, 264, 3), 3);
    }

    #[test]
    fn tilings_fit_shared_memory() {
        // 227 KiB is the per-block limit of sm_90 and sm_100; the epilogue reuses the main loop's space.
        for d in [64, 128, 256] {
            for decode in [true, false] {
                let t = Tiling::new(decode, d);
                assert!(t.smem <= 227 * 1024, "{t:?} at head dim {d}");
            }
        }
        assert_eq!(Tiling::new(true, 128).smem, (16 * 128 + 4 * 64 * 128) * 2);
        assert_eq!(Tiling::new(true, 256).smem, (16 * 256 + 4 * 32 * 256) * 2);
        assert_eq!(Tiling::new(true, 256).threads, 64);
        assert_eq!(Tiling::new(false, 256).smem, (64 * 256 + 4 * 32 * 256) * 2);
        assert_eq!(Tiling::new(false, 128).smem, (128 * 128 + 4 * 64 * 128) * 2);
        assert_eq!(
            (Tiling::new(false, 128).rows, Tiling::new(false, 128).threads),
            (128, 256)
        );
        assert_eq!(
            (Tiling::new(false, 256).rows, Tiling::new(false, 256).threads),
            (64, 128)
        );
    }
}
