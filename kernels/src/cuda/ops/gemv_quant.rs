//! Skinny GEMMs on quantized weights (`gemv_quant.cu`): `out[rows, n] = x[rows, k] · W[n, k]ᵀ` in f32 with `W` kept
//! in its published FP8 or NVFP4 layout and decoded in registers, for the decode steps at small batch, whose time is
//! the weights' bytes. The activations `x` are bf16 or f32 ([`Elem`]); the output is f32. The CPU twins, and the
//! layouts, are in [`crate::cpu::gemv_quant`]; [`gemv_quant_supported`] says which calls the kernels take.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::after_launch;
use crate::cpu::gemv_quant::{FP8_BLOCK, NVFP4_GROUP};
use crate::cuda::device::{CudaDevice, Elem};
use crate::cuda::{check_len, driver_err, ensure, Result};

/// Most rows one launch takes (`QGEMV_MAX_ROWS` in `gemv_quant.cu`).
pub const GEMV_QUANT_MAX_ROWS: usize = 8;
/// Output columns per warp (`QGEMV_COLS`) and threads per block.
const COLS: usize = 2;
const THREADS: u32 = 128;

/// A quantized weight layout the kernels read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantLayout {
    /// E4M3 codes, f32 scales per 128 × 128 block.
    Fp8Block,
    /// E4M3 codes, one f32 scale per tensor or per output row.
    Fp8Scaled,
    /// E2M1 codes two per byte, E4M3 scales per 16 elements, an f32 global scale.
    Nvfp4,
}

impl QuantLayout {
    /// Elements of a row each lane reads per 16-byte load of codes: `k` must be a multiple of it.
    pub fn k_multiple(self) -> usize {
        match self {
            QuantLayout::Fp8Block | QuantLayout::Fp8Scaled => 16,
            QuantLayout::Nvfp4 => 32,
        }
    }
}

/// Whether the kernels take this call: 1 ..= [`GEMV_QUANT_MAX_ROWS`] rows, `k` a positive multiple of
/// [`QuantLayout::k_multiple`], and `x` and the codes `w` 16-byte aligned (the kernels read 16 bytes at a time).
/// [`gemv_nvfp4`] also needs its scales 2-byte aligned (it reads a word's two scales at once), which it checks.
pub fn gemv_quant_supported<T: Elem>(
    dev: &CudaDevice,
    layout: QuantLayout,
    x: &impl DevicePtr<T>,
    w: &impl DevicePtr<u8>,
    rows: usize,
    k: usize,
) -> bool {
    let (xp, _gx) = x.device_ptr(dev.stream());
    let (wp, _gw) = w.device_ptr(dev.stream());
    (1..=GEMV_QUANT_MAX_ROWS).contains(&rows)
        && k > 0
        && k.is_multiple_of(layout.k_multiple())
        && xp % 16 == 0
        && wp % 16 == 0
}

/// The checks every quantized GEMV makes: operand lengths, the kernel's contract, and the grid.
fn check<T: Elem>(
    op: &'static str,
    dev: &CudaDevice,
    layout: QuantLayout,
    x: &impl DevicePtr<T>,
    w: &impl DevicePtr<u8>,
    out_len: usize,
    [rows, k, n]: [usize; 3],
) -> Result<LaunchConfig> {
    check_len(op, "x", x.len(), rows * k)?;
    let codes = match layout {
        QuantLayout::Nvfp4 => n * k / 2,
        _ => n * k,
    };
    check_len(op, "w", w.len(), codes)?;
    check_len(op, "out", out_len, rows * n)?;
    ensure(op, gemv_quant_supported(dev, layout, x, w, rows, k), || {
        format!(
            "{rows} rows × k {k}: needs 1..={GEMV_QUANT_MAX_ROWS} rows, k a positive multiple of {} and 16-byte \
             aligned x and w",
            layout.k_multiple()
        )
    })?;
    ensure(op, k <= i32::MAX as usize && n <= i32::MAX as usize, || {
        format!("k {k} or n {n} exceeds i32")
    })?;
    let blocks = n.div_ceil(COLS).div_ceil(THREADS as usize / 32);
    Ok(LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Fine-grained FP8: `out[r, o] = Σ_i x[r, i] · e4m3(w[o, i]) · scale_inv[o / 128, i / 128]`. `x`: `[rows, k]`; `w`:
/// `[n, k]` E4M3 codes; `scale_inv`: `[⌈n / 128⌉, ⌈k / 128⌉]` f32 (partial blocks at the edges); `out`: `[rows, n]`.
/// CPU twin: [`crate::cpu::gemv_quant::gemv_fp8_block`].
#[allow(clippy::too_many_arguments)]
pub fn gemv_fp8_block<T: Elem>(
    dev: &CudaDevice,
    x: &impl DevicePtr<T>,
    w: &impl DevicePtr<u8>,
    scale_inv: &impl DevicePtr<f32>,
    out: &mut impl DevicePtrMut<f32>,
    rows: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    const OP: &str = "gemv_fp8_block";
    let cfg = check(OP, dev, QuantLayout::Fp8Block, x, w, out.len(), [rows, k, n])?;
    check_len(
        OP,
        "scale_inv",
        scale_inv.len(),
        n.div_ceil(FP8_BLOCK) * k.div_ceil(FP8_BLOCK),
    )?;
    if n == 0 {
        return Ok(());
    }
    let (rows_i, k_i, n_i) = (rows as i32, k as i32, n as i32);
    let (xp, _gx) = x.device_ptr(dev.stream());
    let (wp, _gw) = w.device_ptr(dev.stream());
    let (sp, _gs) = scale_inv.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("gemv_fp8_block_{}", T::NAME),
        cfg,
        xp,
        wp,
        sp,
        op,
        rows_i,
        k_i,
        n_i
    )
}

/// FP8 with one f32 scale per tensor (`scales.len() == 1`) or per output row (`scales.len() == n`), as ModelOpt's
/// FP8 checkpoints store `weight_scale`: `out[r, o] = Σ_i x[r, i] · e4m3(w[o, i]) · scale`. CPU twin:
/// [`crate::cpu::gemv_quant::gemv_fp8_scaled`].
#[allow(clippy::too_many_arguments)]
pub fn gemv_fp8_scaled<T: Elem>(
    dev: &CudaDevice,
    x: &impl DevicePtr<T>,
    w: &impl DevicePtr<u8>,
    scales: &impl DevicePtr<f32>,
    out: &mut impl DevicePtrMut<f32>,
    rows: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    const OP: &str = "gemv_fp8_scaled";
    let cfg = check(OP, dev, QuantLayout::Fp8Scaled, x, w, out.len(), [rows, k, n])?;
    ensure(OP, scales.len() == 1 || scales.len() == n, || {
        format!(
            "`scales` has {} elements, expected 1 (per tensor) or {n} (per output row)",
            scales.len()
        )
    })?;
    if n == 0 {
        return Ok(());
    }
    let per_row = i32::from(scales.len() == n && n != 1);
    let (rows_i, k_i, n_i) = (rows as i32, k as i32, n as i32);
    let (xp, _gx) = x.device_ptr(dev.stream());
    let (wp, _gw) = w.device_ptr(dev.stream());
    let (sp, _gs) = scales.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("gemv_fp8_scaled_{}", T::NAME),
        cfg,
        xp,
        wp,
        sp,
        per_row,
        op,
        rows_i,
        k_i,
        n_i
    )
}

/// NVFP4: `out[r, o] = Σ_i x[r, i] · e2m1(w[o, i]) · (e4m3(scales[o, i / 16]) · global)`. `w`: `[n, k / 2]`, two E2M1
/// codes per byte (element `2j` in the low nibble); `scales`: `[n, k / 16]` E4M3 codes, 2-byte aligned; `global`:
/// the tensor's `weight_scale_2`. CPU twin: [`crate::cpu::gemv_quant::gemv_nvfp4`].
#[allow(clippy::too_many_arguments)]
pub fn gemv_nvfp4<T: Elem>(
    dev: &CudaDevice,
    x: &impl DevicePtr<T>,
    w: &impl DevicePtr<u8>,
    scales: &impl DevicePtr<u8>,
    global: f32,
    out: &mut impl DevicePtrMut<f32>,
    rows: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    const OP: &str = "gemv_nvfp4";
    let cfg = check(OP, dev, QuantLayout::Nvfp4, x, w, out.len(), [rows, k, n])?;
    check_len(OP, "scales", scales.len(), n * k / NVFP4_GROUP)?;
    let (sp, _gs) = scales.device_ptr(dev.stream());
    ensure(OP, sp % 2 == 0, || "`scales` must be 2-byte aligned".into())?;
    if n == 0 {
        return Ok(());
    }
    let (rows_i, k_i, n_i) = (rows as i32, k as i32, n as i32);
    let (xp, _gx) = x.device_ptr(dev.stream());
    let (wp, _gw) = w.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("gemv_nvfp4_{}", T::NAME),
        cfg,
        xp,
        wp,
        sp,
        global,
        op,
        rows_i,
        k_i,
        n_i
    )
}
