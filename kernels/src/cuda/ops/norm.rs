//! Row norms (`kernels/norm.cu`): RMSNorm, the grouped gated RMSNorm of the SSM mixers, and the per-head L2 norm of
//! Gated DeltaNet's q and k. The gated norm's gate and the L2 norm's input may be read in place out of wider rows.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{after_launch, check_strided, fits_grid_y, fits_u32, per_row};
use crate::cpu::norm::GateOrder;
use crate::cuda::device::{CudaDevice, Elem};
use crate::cuda::{check_len, driver_err, ensure, Result};

/// [`per_row`] with at most 256 threads a block, each looping over several elements: for wide groups whose rows
/// are many, shorter block reductions and more blocks an SM pay more than one element a thread.
fn per_row_capped(rows: usize, groups: usize, width: usize) -> LaunchConfig {
    let mut cfg = per_row(rows, groups, width);
    cfg.block_dim.0 = cfg.block_dim.0.min(256);
    cfg
}

/// RMSNorm over rows of width `weight.len()`: `out = x / rms(x) · (offset + w)` (offset 0 plain, 1 zero-centred).
pub fn rms_norm<T: Elem>(
    dev: &CudaDevice,
    x: &impl DevicePtr<T>,
    weight: &impl DevicePtr<T>,
    eps: f32,
    offset: f32,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "rms_norm";
    let dim = weight.len();
    ensure(OP, dim > 0 && x.len().is_multiple_of(dim), || {
        format!("input of {} is not a whole number of rows of {dim}", x.len())
    })?;
    check_len(OP, "out", out.len(), x.len())?;
    let rows = x.len() / dim;
    fits_u32(OP, "rows", rows)?;
    if rows == 0 {
        return Ok(());
    }
    let dim_i = dim as i32;
    let (xp, _gx) = x.device_ptr(dev.stream());
    let (wp, _gw) = weight.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("rms_norm_{}", T::NAME),
        per_row(rows, 1, dim),
        xp,
        wp,
        op,
        dim_i,
        eps,
        offset
    )
}

/// Gated RMSNorm over rows of width `weight.len()`, normalising each run of `group` channels separately
/// (see [`crate::cpu::norm::gated_rms_norm`]). `z`'s rows are `z_stride` apart (at least the width), so the gate can
/// be read in place out of a wider row.
#[allow(clippy::too_many_arguments)]
pub fn gated_rms_norm<T: Elem>(
    dev: &CudaDevice,
    x: &impl DevicePtr<T>,
    z: &impl DevicePtr<T>,
    z_stride: usize,
    weight: &impl DevicePtr<T>,
    group: usize,
    eps: f32,
    order: GateOrder,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "gated_rms_norm";
    let dim = weight.len();
    ensure(OP, dim > 0 && group > 0 && dim.is_multiple_of(group), || {
        format!("group {group} does not divide the row of {dim}")
    })?;
    ensure(OP, x.len().is_multiple_of(dim), || {
        format!("input of {} is not a whole number of rows of {dim}", x.len())
    })?;
    check_len(OP, "out", out.len(), x.len())?;
    let rows = x.len() / dim;
    check_strided(OP, "z", z.len(), rows, z_stride, dim)?;
    fits_u32(OP, "rows", rows)?;
    fits_u32(OP, "rows · z_stride", rows * z_stride)?;
    fits_grid_y(OP, "groups", dim / group)?;
    if rows == 0 {
        return Ok(());
    }
    let (dim_i, stride_i, group_i) = (dim as i32, z_stride as i32, group as i32);
    let before = i32::from(order == GateOrder::BeforeNorm);
    let (xp, _gx) = x.device_ptr(dev.stream());
    let (zp, _gz) = z.device_ptr(dev.stream());
    let (wp, _gw) = weight.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("gated_rms_norm_{}", T::NAME),
        per_row_capped(rows, dim / group, group),
        xp,
        zp,
        wp,
        op,
        dim_i,
        stride_i,
        group_i,
        eps,
        before
    )
}

/// `out = x / sqrt(Σx² + eps) · scale` per head of `dim` (see [`crate::cpu::norm::l2_norm_rows`]; the scale is the
/// query's): `rows` input rows of `heads` heads each, the rows `x_stride` apart (at least `heads · dim`, so the heads
/// can be read in place out of a wider row); `out` is `[rows, heads, dim]` and may be `x` when `x_stride` is
/// `heads · dim`.
#[allow(clippy::too_many_arguments)]
pub fn l2_norm<T: Elem>(
    dev: &CudaDevice,
    x: &impl DevicePtr<T>,
    rows: usize,
    heads: usize,
    dim: usize,
    x_stride: usize,
    eps: f32,
    scale: f32,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "l2_norm";
    ensure(OP, dim > 0 && heads > 0, || {
        format!("{heads} heads of {dim} is an empty row")
    })?;
    check_strided(OP, "x", x.len(), rows, x_stride, heads * dim)?;
    check_len(OP, "out", out.len(), rows * heads * dim)?;
    fits_u32(OP, "rows · heads", rows * heads)?;
    fits_u32(OP, "rows · x_stride", rows * x_stride)?;
    if rows == 0 {
        return Ok(());
    }
    let (dim_i, heads_i, stride_i) = (dim as i32, heads as i32, x_stride as i32);
    let (xp, _gx) = x.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("l2_norm_{}", T::NAME),
        per_row(rows * heads, 1, dim),
        xp,
        op,
        dim_i,
        heads_i,
        stride_i,
        eps,
        scale
    )
}
