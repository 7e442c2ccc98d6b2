//! Skinny GEMMs for a few rows (`gemv.cu`): `out[rows, n] = x[rows, k] · w[n, k]ᵀ` with bf16 operands and f32
//! accumulation, for the decode steps at small batch and one sequence's verify, where a GEMM is one pass over the
//! weights and cuBLAS's kernels for that shape leave part of the memory bandwidth unused. The CPU twin is the linear
//! layer of [`crate::cpu::gemm::linear`]; [`gemv_supported`] says which calls it takes (the rest go to cuBLAS).

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use super::after_launch;
use crate::cuda::device::{CudaDevice, Elem};
use crate::cuda::{check_linear, driver_err, ensure, Result};

/// Most rows one launch takes (`GEMV_MAX_ROWS` in `gemv.cu`).
pub const GEMV_MAX_ROWS: usize = 8;
/// Most rows at which the kernel beats cuBLAS on every measured shape (H100, `bench/results/gpu-gemv-2026-11-25.md`:
/// 1.08–1.66× at 1 and 2 rows; even at 4–5; 0.44–0.84× at 8, where every weight chunk meets 8 rows of x loaded
/// through L1). The engine sends only these to it.
pub const GEMV_FASTER_ROWS: usize = 2;
/// Output columns per warp (`GEMV_COLS`) and threads per block.
const COLS: usize = 2;
const THREADS: u32 = 128;

/// Whether [`gemv`] takes this call: 1 ..= [`GEMV_MAX_ROWS`] rows, `k` a multiple of 8 and both operands 16-byte
/// aligned (the kernel reads 8 bf16 at a time).
pub fn gemv_supported(
    dev: &CudaDevice,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    rows: usize,
    k: usize,
) -> bool {
    let (xp, _gx) = x.device_ptr(dev.stream());
    let (wp, _gw) = w.device_ptr(dev.stream());
    (1..=GEMV_MAX_ROWS).contains(&rows) && k.is_multiple_of(8) && k > 0 && xp % 16 == 0 && wp % 16 == 0
}

/// `out[rows, n] = x[rows, k] · w[n, k]ᵀ`, stored as `O`; see the module docs. The caller checks
/// [`gemv_supported`] first (an unsupported call is an error naming why).
pub fn gemv<O: Elem>(
    dev: &CudaDevice,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    out: &mut impl DevicePtrMut<O>,
    rows: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    const OP: &str = "gemv";
    check_linear(OP, [x.len(), w.len(), out.len()], rows, k, n)?;
    ensure(OP, gemv_supported(dev, x, w, rows, k), || {
        format!("{rows} rows × k {k}: needs 1..={GEMV_MAX_ROWS} rows, k a multiple of 8 and 16-byte aligned operands")
    })?;
    ensure(OP, k <= i32::MAX as usize && n <= i32::MAX as usize, || {
        format!("k {k} or n {n} exceeds i32")
    })?;
    if n == 0 {
        return Ok(());
    }
    let warps = n.div_ceil(COLS);
    let blocks = warps.div_ceil(THREADS as usize / 32);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rows_i, k_i, n_i) = (rows as i32, k as i32, n as i32);
    let (xp, _gx) = x.device_ptr(dev.stream());
    let (wp, _gw) = w.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(dev, format!("gemv_{}", O::NAME), cfg, xp, wp, op, rows_i, k_i, n_i)
}
