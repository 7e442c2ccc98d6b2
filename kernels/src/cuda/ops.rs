//! Launch wrappers: one function per kernel, generic over the storage type `T` ([`Elem`]: f32 or bf16).
//!
//! Every wrapper checks each operand's length against the shape before launching (a wrong length on the GPU is an
//! out-of-bounds access, not a panic), checks the launch's result, and with `REWIND_CUDA_SYNC=1` synchronises so an
//! asynchronous fault is reported by the launch that caused it. Work is queued on the device's stream; read results
//! with [`CudaDevice::download`] (which waits) or call [`CudaDevice::synchronize`].
//!
//! Recurrent ops run a batch of rows, each against its own slot of a state pool (`[slots, ...]`); `slots[b]` is the
//! pool index of row `b`. Slots in one batch must be distinct; a slot outside the pool gives that row NaN outputs and
//! leaves the pool untouched.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use super::device::{CudaDevice, Elem};
use super::{check_len, driver_err, ensure, Result};
use crate::cpu::gdn::GdnDims;
use crate::cpu::mamba2::Mamba2Dims;

/// Launches kernel `$name` with `$cfg` and the given arguments, which must be local variables (the launch reads them
/// through pointers).
macro_rules! launch {
    ($dev:expr, $name:expr, $cfg:expr, $($arg:ident),* $(,)?) => {{
        let name: &str = &$name;
        let func = $dev.function(name)?;
        let mut builder = $dev.stream().launch_builder(func);
        $( builder.arg(&$arg); )*
        // SAFETY: the caller checked every operand against the kernel's shape contract; arguments match the kernel's
        // C signature in order and type.
        unsafe { builder.launch($cfg) }.map_err(driver_err(format!("launching {name}")))?;
        after_launch($dev, name)
    }};
}

fn after_launch(dev: &CudaDevice, name: &str) -> Result<()> {
    if dev.sync_each_launch() {
        dev.stream()
            .synchronize()
            .map_err(driver_err(format!("running {name}")))?;
    }
    Ok(())
}

/// A grid-stride launch over `n` elements.
fn grid_1d(n: usize) -> LaunchConfig {
    const BLOCK: u32 = 256;
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, 65_535 * 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row (and per group along `y`), with enough threads for `width` elements.
fn per_row(rows: usize, groups: usize, width: usize) -> LaunchConfig {
    let threads = width.next_multiple_of(32).clamp(32, 1024) as u32;
    LaunchConfig {
        grid_dim: (rows as u32, groups as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The kernel `name`, allowed `bytes` of dynamic shared memory (past the 48 KiB a launch gets without asking).
fn with_shared_memory<'a>(dev: &'a CudaDevice, name: &str, bytes: usize) -> Result<&'a cudarc::driver::CudaFunction> {
    let func = dev.function(name)?;
    func.set_attribute(
        cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes as i32,
    )
    .map_err(driver_err(format!("raising the shared memory limit of {name}")))?;
    Ok(func)
}

fn fits_u32(op: &'static str, what: &str, v: usize) -> Result<()> {
    ensure(op, v <= u32::MAX as usize / 2, || format!("{what} = {v} is too large"))
}

fn fits_grid_y(op: &'static str, what: &str, v: usize) -> Result<()> {
    ensure(op, v <= 65_535, || format!("{what} = {v} exceeds 65535"))
}

/// Converts f32 to bf16 (round to nearest even).
pub fn cast_f32_to_bf16(dev: &CudaDevice, x: &impl DevicePtr<f32>, out: &mut impl DevicePtrMut<bf16>) -> Result<()> {
    check_len("cast_f32_to_bf16", "out", out.len(), x.len())?;
    let n = x.len() as u64;
    let (xp, _gx) = x.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(dev, "cast_f32_bf16", grid_1d(x.len()), xp, op, n)
}

/// Widens bf16 to f32.
pub fn cast_bf16_to_f32(dev: &CudaDevice, x: &impl DevicePtr<bf16>, out: &mut impl DevicePtrMut<f32>) -> Result<()> {
    check_len("cast_bf16_to_f32", "out", out.len(), x.len())?;
    let n = x.len() as u64;
    let (xp, _gx) = x.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(dev, "cast_bf16_f32", grid_1d(x.len()), xp, op, n)
}

/// An elementwise activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x · σ(x)`.
    Silu,
    /// `σ(x)`.
    Sigmoid,
    /// PyTorch's softplus (threshold 20).
    Softplus,
    /// `relu(x)²`.
    Relu2,
}

impl Activation {
    fn code(self) -> i32 {
        match self {
            Activation::Silu => 0,
            Activation::Sigmoid => 1,
            Activation::Softplus => 2,
            Activation::Relu2 => 3,
        }
    }

    /// The CPU twin.
    pub fn cpu(self) -> fn(f32) -> f32 {
        match self {
            Activation::Silu => crate::cpu::act::silu,
            Activation::Sigmoid => crate::cpu::act::sigmoid,
            Activation::Softplus => crate::cpu::act::softplus,
            Activation::Relu2 => crate::cpu::act::relu2,
        }
    }
}

/// `out[i] = f(x[i])`.
pub fn activation<T: Elem>(
    dev: &CudaDevice,
    f: Activation,
    x: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    check_len("activation", "out", out.len(), x.len())?;
    let (n, kind) = (x.len() as u64, f.code());
    let (xp, _gx) = x.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    let (name, cfg) = elementwise::<T>("act", x.len(), &[xp, op]);
    launch!(dev, name, cfg, xp, op, n, kind)
}

/// SwiGLU: `out[i] = silu(gate[i]) · up[i]`.
pub fn swiglu<T: Elem>(
    dev: &CudaDevice,
    gate: &impl DevicePtr<T>,
    up: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    check_len("swiglu", "up", up.len(), gate.len())?;
    check_len("swiglu", "out", out.len(), gate.len())?;
    let n = gate.len() as u64;
    let (gp, _gg) = gate.device_ptr(dev.stream());
    let (up_p, _gu) = up.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    let (name, cfg) = elementwise::<T>("swiglu", gate.len(), &[gp, up_p, op]);
    launch!(dev, name, cfg, gp, up_p, op, n)
}

/// The variant and grid of an elementwise kernel over `n` elements: `{base}_vec_{T}`, 16 bytes a thread, when `n` and
/// every pointer allow the vectors, else `{base}_{T}`, one element a thread.
fn elementwise<T: Elem>(base: &str, n: usize, ptrs: &[u64]) -> (String, LaunchConfig) {
    match vectors::<T>(ptrs, &[n]) {
        Some(v) => (format!("{base}_vec_{}", T::NAME), grid_1d(n / v)),
        None => (format!("{base}_{}", T::NAME), grid_1d(n)),
    }
}

/// The elements of `T` in a 16-byte vector (the kernels' `Pack`), when every pointer is 16-byte aligned and every
/// length (a count, stride or offset in elements) a whole number of vectors, so that every vector a kernel moves is
/// aligned; `None` otherwise.
fn vectors<T: Elem>(ptrs: &[u64], lens: &[usize]) -> Option<usize> {
    let v = 16 / std::mem::size_of::<T>();
    (ptrs.iter().all(|p| p % 16 == 0) && lens.iter().all(|n| n.is_multiple_of(v))).then_some(v)
}

/// Checks a strided operand: `rows` rows `stride` apart (at least `width`), of which the last needs only its `width`
/// elements (a column range of a wider buffer may end before the buffer does).
fn check_strided(op: &'static str, what: &str, len: usize, rows: usize, stride: usize, width: usize) -> Result<()> {
    ensure(op, stride >= width, || {
        format!("{what}: rows {stride} apart cannot hold {width} elements each")
    })?;
    let need = if rows == 0 { 0 } else { (rows - 1) * stride + width };
    ensure(op, len >= need, || {
        format!("{what} has {len} elements, {rows} rows {stride} apart need {need}")
    })
}

/// NeoX rotary embedding in place on the first `rotary_dim` channels of each head (see
/// [`crate::cpu::rope::apply_rope`]). `x`: `[rows, heads, head_dim]`; `positions`: `[rows]`; `inv_freq`:
/// `[rotary_dim / 2]` from [`crate::cpu::rope::inv_freq`].
#[allow(clippy::too_many_arguments)]
pub fn rope<T: Elem>(
    dev: &CudaDevice,
    x: &mut impl DevicePtrMut<T>,
    positions: &impl DevicePtr<i32>,
    inv_freq: &impl DevicePtr<f32>,
    rows: usize,
    heads: usize,
    head_dim: usize,
    rotary_dim: usize,
) -> Result<()> {
    const OP: &str = "rope";
    ensure(OP, rotary_dim.is_multiple_of(2) && rotary_dim <= head_dim, || {
        format!("rotary_dim {rotary_dim} must be even and at most head_dim {head_dim}")
    })?;
    check_len(OP, "x", x.len(), rows * heads * head_dim)?;
    check_len(OP, "positions", positions.len(), rows)?;
    check_len(OP, "inv_freq", inv_freq.len(), rotary_dim / 2)?;
    fits_u32(OP, "x", x.len())?;
    if rotary_dim == 0 || rows == 0 || heads == 0 {
        return Ok(());
    }
    let (rows_i, heads_i, hd_i, rd_i) = (rows as i32, heads as i32, head_dim as i32, rotary_dim as i32);
    let (xp, _gx) = x.device_ptr_mut(dev.stream());
    let (pp, _gp) = positions.device_ptr(dev.stream());
    let (fp, _gf) = inv_freq.device_ptr(dev.stream());
    let cfg = grid_1d(rows * heads * rotary_dim / 2);
    launch!(
        dev,
        format!("rope_{}", T::NAME),
        cfg,
        xp,
        pp,
        fp,
        rows_i,
        heads_i,
        hd_i,
        rd_i
    )
}

/// Embedding gather: `out[i] = table[ids[i]]` with `table` `[vocab, dim]`; an id outside the vocabulary gives a NaN
/// row.
pub fn embedding<T: Elem>(
    dev: &CudaDevice,
    table: &impl DevicePtr<T>,
    ids: &impl DevicePtr<i32>,
    dim: usize,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "embedding";
    ensure(OP, dim > 0 && table.len().is_multiple_of(dim), || {
        format!("table of {} is not a whole number of rows of {dim}", table.len())
    })?;
    check_len(OP, "out", out.len(), ids.len() * dim)?;
    fits_u32(OP, "tokens", ids.len())?;
    if ids.is_empty() {
        return Ok(());
    }
    let (dim_i, vocab_i) = (dim as i32, (table.len() / dim).min(i32::MAX as usize) as i32);
    let (tp, _gt) = table.device_ptr(dev.stream());
    let (ip, _gi) = ids.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("embedding_{}", T::NAME),
        per_row(ids.len(), 1, dim.min(256)),
        tp,
        ip,
        op,
        dim_i,
        vocab_i
    )
}

fn pool_slots(op: &'static str, pool: usize, per_slot: usize) -> Result<usize> {
    ensure(op, per_slot > 0 && pool.is_multiple_of(per_slot), || {
        format!("state pool of {pool} is not a whole number of states of {per_slot}")
    })?;
    Ok(pool / per_slot)
}

/// One Mamba-2 decode step for `slots.len()` rows (see [`crate::cpu::mamba2::mamba2_step`]).
///
/// `state_pool`: `[slots, heads, head_dim, state_dim]` f32; `x`, `y`: `[batch, heads, head_dim]`; `dt`:
/// `[batch, heads]` f32 (already softplus'd and clamped); `a`, `d_skip`: `[heads]` f32; `b`, `c`:
/// `[batch, groups, state_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn mamba2_step<T: Elem>(
    dev: &CudaDevice,
    dims: Mamba2Dims,
    state_pool: &mut impl DevicePtrMut<f32>,
    slots: &impl DevicePtr<i32>,
    x: &impl DevicePtr<T>,
    dt: &impl DevicePtr<f32>,
    a: &impl DevicePtr<f32>,
    b: &impl DevicePtr<T>,
    c: &impl DevicePtr<T>,
    d_skip: &impl DevicePtr<f32>,
    y: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "mamba2_step";
    let Mamba2Dims {
        heads,
        head_dim,
        state_dim,
        groups,
    } = dims;
    ensure(
        OP,
        groups > 0 && heads.is_multiple_of(groups) && head_dim > 0 && state_dim > 0,
        || format!("bad dims {dims:?}"),
    )?;
    let batch = slots.len();
    let num_slots = pool_slots(OP, state_pool.len(), heads * head_dim * state_dim)?;
    check_len(OP, "x", x.len(), batch * heads * head_dim)?;
    check_len(OP, "y", y.len(), batch * heads * head_dim)?;
    check_len(OP, "dt", dt.len(), batch * heads)?;
    check_len(OP, "A", a.len(), heads)?;
    check_len(OP, "D", d_skip.len(), heads)?;
    check_len(OP, "B", b.len(), batch * groups * state_dim)?;
    check_len(OP, "C", c.len(), batch * groups * state_dim)?;
    fits_grid_y(OP, "batch", batch)?;
    ensure(OP, state_dim <= 8192, || format!("state_dim {state_dim} exceeds 8192"))?;
    if batch == 0 {
        return Ok(());
    }
    let (slots_i, h_i, p_i, n_i, g_i) = (
        num_slots as i32,
        heads as i32,
        head_dim as i32,
        state_dim as i32,
        groups as i32,
    );
    let (sp, _gs) = state_pool.device_ptr_mut(dev.stream());
    let (ip, _gi) = slots.device_ptr(dev.stream());
    let (xp, _gx) = x.device_ptr(dev.stream());
    let (dtp, _gdt) = dt.device_ptr(dev.stream());
    let (ap, _ga) = a.device_ptr(dev.stream());
    let (bp, _gb) = b.device_ptr(dev.stream());
    let (cp, _gc) = c.device_ptr(dev.stream());
    let (dp, _gd) = d_skip.device_ptr(dev.stream());
    let (yp, _gy) = y.device_ptr_mut(dev.stream());
    let cfg = LaunchConfig {
        grid_dim: (heads as u32, batch as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: (2 * state_dim * 4) as u32,
    };
    launch!(
        dev,
        format!("mamba2_step_{}", T::NAME),
        cfg,
        sp,
        ip,
        slots_i,
        xp,
        dtp,
        ap,
        bp,
        cp,
        dp,
        yp,
        h_i,
        p_i,
        n_i,
        g_i
    )
}

/// One gated-delta-rule decode step for `slots.len()` rows (see [`crate::cpu::gdn::gdn_step`]).
///
/// `state_pool`: `[slots, v_heads, v_dim, k_dim]` f32; `q`, `k`: `[batch, k_heads, k_dim]` (L2-normalised, q scaled);
/// `v`, `out`: `[batch, v_heads, v_dim]`; `g`, `beta`: `[batch, v_heads]` f32. `k_dim` is at most 256.
#[allow(clippy::too_many_arguments)]
pub fn gdn_step<T: Elem>(
    dev: &CudaDevice,
    dims: GdnDims,
    state_pool: &mut impl DevicePtrMut<f32>,
    slots: &impl DevicePtr<i32>,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    g: &impl DevicePtr<f32>,
    beta: &impl DevicePtr<f32>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "gdn_step";
    let GdnDims {
        k_heads,
        v_heads,
        k_dim,
        v_dim,
    } = dims;
    ensure(OP, k_heads > 0 && v_heads.is_multiple_of(k_heads) && v_dim > 0, || {
        format!("bad dims {dims:?}")
    })?;
    ensure(OP, (1..=256).contains(&k_dim), || {
        format!("k_dim {k_dim} is outside 1..=256")
    })?;
    let batch = slots.len();
    let num_slots = pool_slots(OP, state_pool.len(), dims.state_len())?;
    check_len(OP, "q", q.len(), batch * k_heads * k_dim)?;
    check_len(OP, "k", k.len(), batch * k_heads * k_dim)?;
    check_len(OP, "v", v.len(), batch * v_heads * v_dim)?;
    check_len(OP, "out", out.len(), batch * v_heads * v_dim)?;
    check_len(OP, "g", g.len(), batch * v_heads)?;
    check_len(OP, "beta", beta.len(), batch * v_heads)?;
    fits_grid_y(OP, "batch", batch)?;
    if batch == 0 {
        return Ok(());
    }
    let (slots_i, hk_i, hv_i, dk_i, dv_i) = (
        num_slots as i32,
        k_heads as i32,
        v_heads as i32,
        k_dim as i32,
        v_dim as i32,
    );
    let (sp, _gs) = state_pool.device_ptr_mut(dev.stream());
    let (ip, _gi) = slots.device_ptr(dev.stream());
    let (qp, _gq) = q.device_ptr(dev.stream());
    let (kp, _gk) = k.device_ptr(dev.stream());
    let (vp, _gv) = v.device_ptr(dev.stream());
    let (gp, _gg) = g.device_ptr(dev.stream());
    let (bp, _gb) = beta.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    let cfg = LaunchConfig {
        grid_dim: (v_heads as u32, batch as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: (2 * k_dim * 4) as u32,
    };
    launch!(
        dev,
        format!("gdn_step_{}", T::NAME),
        cfg,
        sp,
        ip,
        slots_i,
        qp,
        kp,
        vp,
        gp,
        bp,
        op,
        hk_i,
        hv_i,
        dk_i,
        dv_i
    )
}

// Declared after `launch!` so the submodules can use it.
mod attention;
mod attention_flash;
mod conv;
mod gemv;
mod gemv_quant;
mod glue;
mod lm_head;
mod moe;
mod norm;
mod replay;
mod sample;
mod scan;
mod spec_baseline;
mod spec_chain;

pub use attention::{
    kv_write, paged_attention, paged_attention_plan, paged_attention_workspace_len, AttentionPlan, PagedKv,
};
pub use conv::{causal_conv1d, ConvDims};
pub use gemv::{gemv, gemv_supported, GEMV_FASTER_ROWS, GEMV_MAX_ROWS};
pub use gemv_quant::{
    gemv_fp8_block, gemv_fp8_scaled, gemv_nvfp4, gemv_quant_supported, QuantLayout, GEMV_QUANT_MAX_ROWS,
};
pub use glue::{
    add_bias, add_rms_norm, copy_block, copy_cols, copy_rows, dt_softplus, embed_rows_f32, gated_norm_apply,
    gated_sq_sums, gather_cols, gdn_gates, moe_finish, sigmoid_mul, swiglu_split,
};
pub use lm_head::{
    decode_summaries, decode_topk, encode_judge, encode_logprob_requests, encode_spec, encode_summary, head_summaries,
    head_summary_merge, head_summary_parts, head_topk_merge, head_topk_parts, parts_for, spec_accept, JUDGE_WORDS,
    PART_WIDTH, SPEC_WORDS, SUMMARY_WORDS, TOPK_WORDS,
};
pub use moe::{
    moe_align, moe_combine, moe_gemm, moe_gemm_using, moe_tensor_cores, route_sigmoid_grouped, route_softmax,
    MoeKernel, SigmoidRouting, MOE_M64_ROWS,
};
pub use norm::{gated_rms_norm, l2_norm, rms_norm};
pub use replay::{
    gdn_replay, mamba2_replay, replay_geometry, ReplayGeometry, ReplayKind, ReplayRow, ReplayShape, REPLAY_MAX_T,
    REPLAY_META,
};
pub use sample::{argmax_rows, chain_pick, logit_bias, repetition_penalty, sample_rows, token_mask};
pub use scan::{
    gdn_chunked, gdn_chunked_using, gdn_chunked_workspace, gdn_tensor_cores, mamba2_chunked, mamba2_chunked_using,
    mamba2_chunked_workspace, mamba2_tensor_cores, ScanKernel, MAX_CHUNK,
};
pub use spec_baseline::{
    gdn_spec_verify, mamba2_spec_verify, spec_commit, SPEC_COMMIT_META, SPEC_MAX_KEY_DIM, SPEC_MAX_T,
};
pub use spec_chain::{chain_advance, chain_draft, chain_spec, ChainParams, DraftMode};
