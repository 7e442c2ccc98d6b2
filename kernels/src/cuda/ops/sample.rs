//! Token selection on the device: row argmax (greedy decoding).

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{after_launch, fits_u32};
use crate::cuda::device::CudaDevice;
use crate::cuda::{check_len, driver_err, ensure, Result};

/// Threads per row of the row-wide selection kernels.
const ROW_THREADS: u32 = 1024;

fn per_row_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn check_rows(op: &'static str, len: usize, rows: usize) -> Result<usize> {
    ensure(op, rows > 0 && len.is_multiple_of(rows), || {
        format!("logits of {len} are not {rows} rows")
    })?;
    let vocab = len / rows;
    ensure(op, vocab > 0 && vocab <= i32::MAX as usize, || {
        format!("vocabulary {vocab} outside 1..=i32::MAX")
    })?;
    fits_u32(op, "rows", rows)?;
    Ok(vocab)
}

/// Per row of `logits` `[rows, vocab]`: the lowest index among the largest values (as
/// [`crate::cpu::sample::argmax`]), or −1 when the row holds a NaN.
pub fn argmax_rows(
    dev: &CudaDevice,
    logits: &impl DevicePtr<f32>,
    rows: usize,
    out: &mut impl DevicePtrMut<i32>,
) -> Result<()> {
    const OP: &str = "argmax_rows";
    check_len(OP, "out", out.len(), rows)?;
    if rows == 0 {
        return check_len(OP, "logits", logits.len(), 0);
    }
    let vocab = check_rows(OP, logits.len(), rows)? as i32;
    let (lp, _gl) = logits.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(dev, "argmax_rows", per_row_cfg(rows), lp, vocab, op)
}
