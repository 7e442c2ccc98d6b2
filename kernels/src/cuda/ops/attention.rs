//! Attention over a paged KV cache: writing new K/V rows into the pages, and causal attention (decode and prefill)
//! reading K/V through a per-slot block table.
//!
//! Two implementations, one job each: bf16 storage at head dims 64 / 128 / 256 (every real model) runs the
//! tensor-core kernels of `attention_flash.cu` (a decode tiling for `t · group ≤ 16` query rows per KV head, a
//! FlashAttention-2 prefill tiling otherwise, both split over the keys when the grid would not fill the GPU);
//! f32 storage (the engine's f32 activation mode, the precision oracle) and other head dims run the SIMT kernel of
//! `attention.cu`.

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::attention_flash;
use super::{after_launch, fits_grid_y, fits_u32, grid_1d};
use crate::cuda::device::{CudaDevice, Elem};
use crate::cuda::{check_len, driver_err, ensure, Result};
use cudarc::driver::CudaSlice;

/// Shape of a paged KV cache: K and V pools of `[num_blocks, block_size, kv_heads, head_dim]` each, and a block table of
/// `[num_slots, blocks_per_slot]` block ids (position `p` of slot `s` lives in block `table[s][p / block_size]`, row
/// `p % block_size`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedKv {
    /// Blocks in each pool.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Channels per head (at most 256).
    pub head_dim: usize,
    /// Rows of the block table (sequence slots).
    pub num_slots: usize,
    /// Block ids per slot: the longest sequence is `blocks_per_slot · block_size` tokens.
    pub blocks_per_slot: usize,
}

impl PagedKv {
    /// Elements of one pool (K or V).
    pub fn pool_len(&self) -> usize {
        self.num_blocks * self.block_size * self.kv_heads * self.head_dim
    }

    fn check<T>(
        &self,
        op: &'static str,
        k_pool: &impl DevicePtr<T>,
        v_pool: &impl DevicePtr<T>,
        table: &impl DevicePtr<i32>,
    ) -> Result<()> {
        ensure(op, (1..=256).contains(&self.head_dim), || {
            format!("head_dim {} is outside 1..=256", self.head_dim)
        })?;
        ensure(op, self.block_size > 0 && self.kv_heads > 0, || {
            format!("bad layout {self:?}")
        })?;
        check_len(op, "k_pool", k_pool.len(), self.pool_len())?;
        check_len(op, "v_pool", v_pool.len(), self.pool_len())?;
        check_len(op, "block_table", table.len(), self.num_slots * self.blocks_per_slot)?;
        // Pools may pass 2³² elements (256 sequences × 32K tokens × 8 × 128 is 8.6 G): every kernel indexes them in
        // 64 bits; block ids are i32.
        ensure(op, self.num_blocks <= i32::MAX as usize, || {
            format!("{} blocks exceed i32", self.num_blocks)
        })?;
        ensure(op, self.blocks_per_slot * self.block_size <= i32::MAX as usize, || {
            "sequence capacity exceeds i32".into()
        })
    }
}

/// Writes row `i` of `k_new` / `v_new` (`[n, kv_heads, head_dim]`) at position `positions[i]` of slot `slots[i]` of the
/// pools. A row whose slot, position or block id is out of range is skipped.
#[allow(clippy::too_many_arguments)]
pub fn kv_write<T: Elem>(
    dev: &CudaDevice,
    layout: PagedKv,
    k_new: &impl DevicePtr<T>,
    v_new: &impl DevicePtr<T>,
    slots: &impl DevicePtr<i32>,
    positions: &impl DevicePtr<i32>,
    block_table: &impl DevicePtr<i32>,
    k_pool: &mut impl DevicePtrMut<T>,
    v_pool: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "kv_write";
    let n = slots.len();
    let row = layout.kv_heads * layout.head_dim;
    check_len(OP, "positions", positions.len(), n)?;
    check_len(OP, "k_new", k_new.len(), n * row)?;
    check_len(OP, "v_new", v_new.len(), n * row)?;
    ensure(
        OP,
        (1..=256).contains(&layout.head_dim) && layout.block_size > 0,
        || format!("bad layout {layout:?}"),
    )?;
    check_len(OP, "k_pool", k_pool.len(), layout.pool_len())?;
    check_len(OP, "v_pool", v_pool.len(), layout.pool_len())?;
    check_len(
        OP,
        "block_table",
        block_table.len(),
        layout.num_slots * layout.blocks_per_slot,
    )?;
    fits_u32(OP, "rows", n * row)?;
    if n == 0 {
        return Ok(());
    }
    let (ns, bps, nb) = (
        layout.num_slots as i32,
        layout.blocks_per_slot as i32,
        layout.num_blocks as i32,
    );
    let (n_i, kvh, hd, bs) = (
        n as i32,
        layout.kv_heads as i32,
        layout.head_dim as i32,
        layout.block_size as i32,
    );
    let (kp, _gk) = k_new.device_ptr(dev.stream());
    let (vp, _gv) = v_new.device_ptr(dev.stream());
    let (sp, _gs) = slots.device_ptr(dev.stream());
    let (pp, _gp) = positions.device_ptr(dev.stream());
    let (tp, _gt) = block_table.device_ptr(dev.stream());
    let (kpool, _gkp) = k_pool.device_ptr_mut(dev.stream());
    let (vpool, _gvp) = v_pool.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("kv_write_{}", T::NAME),
        grid_1d(n * row),
        kp,
        vp,
        sp,
        pp,
        tp,
        ns,
        bps,
        nb,
        kpool,
        vpool,
        n_i,
        kvh,
        hd,
        bs
    )
}

/// Warps per block of `attn_paged` (items of (query, head) each) and keys per staged tile: as in `attention.cu`.
const ATTN_WARPS: usize = 8;
const ATTN_KEYS: usize = 32;

pub use attention_flash::AttentionPlan;

/// Causal attention of the last `t` tokens of `slots.len()` sequences over their paged K/V (see
/// [`crate::cpu::attention::causal_attention`]): decode is `t = 1` with a batch, a verify step a few tokens per row,
/// prefill one sequence with `t` tokens (after any number of cached ones).
///
/// `q`, `out`: `[batch, t, heads, head_dim]`; `slots`: `[batch]`; `lens`: `[num_slots]`, the tokens cached per slot
/// *including* the `t` being attended from (write them with [`kv_write`] first), so query `i` of row `b` sits at
/// position `lens[slots[b]] − t + i` and sees keys `0 ..= lens − t + i`. Query head `h` reads KV head
/// `h / (heads / kv_heads)`. `scores = q·kᵀ·scale`, softmax in f32, then `·v` (bf16 storage: the probabilities enter
/// the `·v` product rounded to bf16, as in FlashAttention). A row whose slot is out of range or whose length is below
/// `t` or beyond the slot's capacity gets NaN outputs.
/// A block id outside the pool reads block 0 instead (the table is trusted; this only keeps reads in bounds).
/// bf16 at head dims 64, 128 and 256 runs on tensor cores (see the module docs); the kernel and key splits chosen
/// are [`paged_attention_plan`]'s.
///
/// `workspace` holds the split-KV partials when the plan splits the keys: at least
/// [`paged_attention_workspace_len`] floats. Callers that capture the step in a CUDA graph pass one they own; with
/// `None` the partials are allocated on the stream for the call.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention<T: Elem>(
    dev: &CudaDevice,
    layout: PagedKv,
    heads: usize,
    t: usize,
    q: &impl DevicePtr<T>,
    k_pool: &impl DevicePtr<T>,
    v_pool: &impl DevicePtr<T>,
    block_table: &impl DevicePtr<i32>,
    lens: &impl DevicePtr<i32>,
    slots: &impl DevicePtr<i32>,
    scale: f32,
    out: &mut impl DevicePtrMut<T>,
    workspace: Option<&mut CudaSlice<f32>>,
) -> Result<()> {
    const OP: &str = "paged_attention";
    layout.check(OP, k_pool, v_pool, block_table)?;
    let PagedKv { kv_heads, head_dim, .. } = layout;
    ensure(OP, heads > 0 && heads.is_multiple_of(kv_heads), || {
        format!("heads {heads} is not a multiple of kv_heads {kv_heads}")
    })?;
    let batch = slots.len();
    check_len(OP, "lens", lens.len(), layout.num_slots)?;
    check_len(OP, "q", q.len(), batch * t * heads * head_dim)?;
    check_len(OP, "out", out.len(), batch * t * heads * head_dim)?;
    fits_grid_y(OP, "batch", batch)?;
    fits_grid_y(OP, "kv_heads", kv_heads)?;
    fits_u32(OP, "q", q.len())?;
    if batch == 0 || t == 0 {
        return Ok(());
    }
    let ints = [
        layout.num_slots as i32,
        layout.blocks_per_slot as i32,
        layout.num_blocks as i32,
        t as i32,
        heads as i32,
        kv_heads as i32,
        layout.block_size as i32,
    ];
    let (qp, _gq) = q.device_ptr(dev.stream());
    let (kp, _gk) = k_pool.device_ptr(dev.stream());
    let (vp, _gv) = v_pool.device_ptr(dev.stream());
    let (tp, _gt) = block_table.device_ptr(dev.stream());
    let (lp, _gl) = lens.device_ptr(dev.stream());
    let (sp, _gs) = slots.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    let ptrs = [qp, kp, vp, tp, lp, sp, op];
    if T::NAME == "bf16" && attention_flash::supported(head_dim) {
        let capacity = layout.blocks_per_slot * layout.block_size;
        let (plan, smem) = attention_flash::plan(dev, batch, t, heads, kv_heads, head_dim, capacity)?;
        fits_u32(OP, "partials", plan.splits * q.len())?;
        return attention_flash::launch(
            dev, &plan, smem, ptrs, ints, scale, batch, kv_heads, head_dim, workspace,
        );
    }
    simt(dev, T::NAME, ptrs, ints, scale, batch, head_dim)
}

/// The kernel [`paged_attention`] runs for these shapes, and its key splits (for benchmarks and logs).
pub fn paged_attention_plan<T: Elem>(
    dev: &CudaDevice,
    layout: PagedKv,
    heads: usize,
    t: usize,
    batch: usize,
) -> Result<AttentionPlan> {
    let PagedKv { kv_heads, head_dim, .. } = layout;
    ensure(
        "paged_attention_plan",
        heads > 0 && heads.is_multiple_of(kv_heads),
        || format!("heads {heads} is not a multiple of kv_heads {kv_heads}"),
    )?;
    if T::NAME == "bf16" && attention_flash::supported(head_dim) {
        let capacity = layout.blocks_per_slot * layout.block_size;
        return Ok(attention_flash::plan(dev, batch, t, heads, kv_heads, head_dim, capacity)?.0);
    }
    let group = heads / kv_heads;
    Ok(AttentionPlan {
        kernel: format!("attn_paged_{}", T::NAME),
        splits: 1,
        blocks: (t * group).div_ceil(ATTN_WARPS) * kv_heads * batch,
        threads: 32 * ATTN_WARPS as u32,
    })
}

/// The f32 floats [`paged_attention`]'s split-KV partials take for this shape (0 when the plan does not split):
/// `splits × rows × (head_dim + 2)`, rows = `batch · t · heads`.
pub fn paged_attention_workspace_len<T: Elem>(
    dev: &CudaDevice,
    layout: PagedKv,
    heads: usize,
    t: usize,
    batch: usize,
) -> Result<usize> {
    let plan = paged_attention_plan::<T>(dev, layout, heads, t, batch)?;
    Ok(attention_flash::workspace_len(
        &plan,
        batch * t * heads,
        layout.head_dim,
    ))
}

/// The SIMT kernel (`attn_paged` in `attention.cu`): f32 storage and head dims without a tensor-core build.
fn simt(
    dev: &CudaDevice,
    type_name: &str,
    ptrs: [u64; 7],
    ints: [i32; 7],
    scale: f32,
    batch: usize,
    head_dim: usize,
) -> Result<()> {
    let [qp, kp, vp, tp, lp, sp, op] = ptrs;
    let [ns, bps, nb, t_i, h_i, kvh, bs] = ints;
    let group = (h_i / kvh) as usize;
    let hd = head_dim as i32;
    let smem = (ATTN_KEYS * (2 * head_dim + 1) + ATTN_WARPS * head_dim) * 4;
    let name = format!("attn_paged_{type_name}");
    if smem > 48 * 1024 {
        dev.function(&name)?
            .set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(driver_err(format!("raising the shared memory limit of {name}")))?;
    }
    let cfg = LaunchConfig {
        grid_dim: (
            (t_i as usize * group).div_ceil(ATTN_WARPS) as u32,
            kvh as u32,
            batch as u32,
        ),
        block_dim: (32 * ATTN_WARPS as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    launch!(dev, name, cfg, qp, kp, vp, tp, lp, sp, ns, bps, nb, op, t_i, h_i, kvh, hd, bs, scale)
}
