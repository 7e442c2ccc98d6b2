//! Glue kernels of the GPU runner: column gathers that split fused projections, row gathers and scatters, the fused
//! residual add + RMSNorm,
//! the dt and Gated DeltaNet gate activations, elementwise gate / bias / split SwiGLU, vocab-parallel
//! embedding, the MoE finish (routed + gated shared expert), and the Mamba-2 gated norm split across tensor-parallel
//! ranks (local squared sums, all-reduced by the caller, then applied).

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{after_launch, check_strided, fits_grid_y, fits_u32, grid_1d, per_row, vectors};
use crate::cuda::device::{CudaDevice, Elem};
use crate::cuda::{check_len, driver_err, ensure, Result};

fn rows_of(op: &'static str, what: &str, len: usize, width: usize) -> Result<usize> {
    ensure(op, width > 0 && len.is_multiple_of(width), || {
        format!("{what} of {len} is not a whole number of rows of {width}")
    })?;
    Ok(len / width)
}

fn fits_i32(op: &'static str, what: &str, v: usize) -> Result<()> {
    ensure(op, v <= i32::MAX as usize, || format!("{what} = {v} exceeds i32"))
}

/// `out[r, j] = src[r, idx[j]]`: `src` `[rows, src_width]`, `out` `[rows, idx.len()]`. An index outside the row gives
/// NaN.
pub fn gather_cols<T: Elem>(
    dev: &CudaDevice,
    src: &impl DevicePtr<T>,
    rows: usize,
    src_width: usize,
    idx: &impl DevicePtr<i32>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "gather_cols";
    let n = idx.len();
    check_len(OP, "src", src.len(), rows * src_width)?;
    check_len(OP, "out", out.len(), rows * n)?;
    fits_i32(OP, "src_width", src_width)?;
    fits_i32(OP, "columns", n)?;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let (rows_u, w_i, n_i) = (rows as u64, src_width as i32, n as i32);
    let (sp, _gs) = src.device_ptr(dev.stream());
    let (ip, _gi) = idx.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("gather_cols_{}", T::NAME),
        grid_cols(rows, n),
        sp,
        ip,
        op,
        rows_u,
        w_i,
        n_i
    )
}

/// `out[r, j] = src[r, start + j]` for `n` columns: [`gather_cols`] of a contiguous range, copied in 16-byte vectors
/// when the range and the pointers allow.
pub fn copy_cols<T: Elem>(
    dev: &CudaDevice,
    src: &impl DevicePtr<T>,
    rows: usize,
    src_width: usize,
    start: usize,
    n: usize,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    copy_block(dev, src, rows, src_width, start, n, out, n, 0)
}

/// `out[r, out_start + j] = src[r, start + j]` for `n` columns: a block of rows `src_width` apart copied into rows
/// `out_width` apart (joining vocabulary slices into whole rows, `engine/src/gpu/whole_rows.rs`), in 16-byte vectors
/// when the offsets, widths and pointers allow.
#[allow(clippy::too_many_arguments)]
pub fn copy_block<T: Elem>(
    dev: &CudaDevice,
    src: &impl DevicePtr<T>,
    rows: usize,
    src_width: usize,
    start: usize,
    n: usize,
    out: &mut impl DevicePtrMut<T>,
    out_width: usize,
    out_start: usize,
) -> Result<()> {
    const OP: &str = "copy_block";
    ensure(OP, start + n <= src_width, || {
        format!("columns {start}..{} are outside a row of {src_width}", start + n)
    })?;
    ensure(OP, out_start + n <= out_width, || {
        format!(
            "output columns {out_start}..{} are outside a row of {out_width}",
            out_start + n
        )
    })?;
    check_strided(OP, "src", src.len(), rows, src_width, start + n)?;
    check_strided(OP, "out", out.len(), rows, out_width, out_start + n)?;
    fits_i32(OP, "src_width", src_width)?;
    fits_i32(OP, "out_width", out_width)?;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let (rows_u, w_i, start_i, n_i) = (rows as u64, src_width as i32, start as i32, n as i32);
    let (ow_i, os_i) = (out_width as i32, out_start as i32);
    let (sp, _gs) = src.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    let (name, per_thread) = match vectors::<T>(&[sp, op], &[src_width, start, n, out_width, out_start]) {
        Some(v) => (format!("copy_cols_vec_{}", T::NAME), v),
        None => (format!("copy_cols_{}", T::NAME), 1),
    };
    launch!(
        dev,
        name,
        grid_cols(rows, n / per_thread),
        sp,
        op,
        rows_u,
        w_i,
        start_i,
        n_i,
        ow_i,
        os_i
    )
}

/// `dst[d, :] = src[s, :]` for each `(s, d)` row pair of `pairs` (`[n, 2]`), rows `width` wide: a gather and a
/// scatter of whole rows in one launch (the MTP layer's input and saved rows, `engine/src/gpu/mtp.rs`). The pairs are
/// device data: a pair naming a row outside `src` or `dst` is skipped. Pairs must not name one `dst` row twice.
pub fn copy_rows<T: Elem>(
    dev: &CudaDevice,
    src: &impl DevicePtr<T>,
    pairs: &impl DevicePtr<i32>,
    width: usize,
    dst: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "copy_rows";
    let src_rows = rows_of(OP, "src", src.len(), width)?;
    let dst_rows = rows_of(OP, "dst", dst.len(), width)?;
    ensure(OP, pairs.len().is_multiple_of(2), || {
        format!("{} pair words are not whole (source, destination) pairs", pairs.len())
    })?;
    let n = pairs.len() / 2;
    fits_i32(OP, "width", width)?;
    fits_u32(OP, "pairs", n)?;
    if n == 0 {
        return Ok(());
    }
    let (w_i, src_rows, dst_rows) = (width as i32, src_rows as i64, dst_rows as i64);
    let (sp, _gs) = src.device_ptr(dev.stream());
    let (dp, _gd) = dst.device_ptr_mut(dev.stream());
    let (pp, _gp) = pairs.device_ptr(dev.stream());
    launch!(
        dev,
        format!("copy_rows_{}", T::NAME),
        per_row(n, 1, width.min(256)),
        sp,
        dp,
        pp,
        w_i,
        src_rows,
        dst_rows
    )
}

/// Threads over `n` columns along x, rows along y (both grid-stride in the kernels).
fn grid_cols(rows: usize, n: usize) -> LaunchConfig {
    const BLOCK: usize = 256;
    LaunchConfig {
        grid_dim: (
            n.div_ceil(BLOCK).clamp(1, 65_535) as u32,
            rows.clamp(1, 65_535) as u32,
            1,
        ),
        block_dim: (BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Residual add and RMSNorm over rows of `weight.len()`: with `y`, `x += y` (written back); then
/// `out = x · rsqrt(mean(x²) + eps) · (offset + w)` (see [`crate::cpu::norm::rms_norm`]).
pub fn add_rms_norm<T: Elem>(
    dev: &CudaDevice,
    x: &mut impl DevicePtrMut<f32>,
    y: Option<&impl DevicePtr<f32>>,
    weight: &impl DevicePtr<T>,
    eps: f32,
    offset: f32,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "add_rms_norm";
    let dim = weight.len();
    let rows = rows_of(OP, "x", x.len(), dim)?;
    check_len(OP, "out", out.len(), x.len())?;
    if let Some(y) = y {
        check_len(OP, "y", y.len(), x.len())?;
    }
    fits_u32(OP, "rows", rows)?;
    fits_i32(OP, "dim", dim)?;
    if rows == 0 {
        return Ok(());
    }
    let dim_i = dim as i32;
    let (xp, _gx) = x.device_ptr_mut(dev.stream());
    let (yp, _gy) = match y {
        Some(y) => {
            let (p, g) = y.device_ptr(dev.stream());
            (p, Some(g))
        }
        None => (0, None),
    };
    let (wp, _gw) = weight.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("add_rms_norm_{}", T::NAME),
        per_row(rows, 1, dim),
        xp,
        yp,
        wp,
        op,
        dim_i,
        eps,
        offset
    )
}

/// Mamba-2's dt: `out[r, h] = clamp(softplus(src[r, col + h] + bias[h]), lo, hi)` for `h < bias.len()`, with
/// `torch.clamp` semantics (NaN stays NaN; `lo`, `hi` may be infinite). `src` `[rows, src_width]`, `out`
/// `[rows, bias.len()]` f32.
#[allow(clippy::too_many_arguments)]
pub fn dt_softplus<T: Elem>(
    dev: &CudaDevice,
    src: &impl DevicePtr<T>,
    rows: usize,
    src_width: usize,
    col: usize,
    bias: &impl DevicePtr<f32>,
    lo: f32,
    hi: f32,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "dt_softplus";
    let n = bias.len();
    check_len(OP, "src", src.len(), rows * src_width)?;
    check_len(OP, "out", out.len(), rows * n)?;
    ensure(OP, col + n <= src_width, || {
        format!("columns {col}..{} exceed the row of {src_width}", col + n)
    })?;
    fits_i32(OP, "src_width", src_width)?;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let (rows_u, w_i, col_i, n_i) = (rows as u64, src_width as i32, col as i32, n as i32);
    let (sp, _gs) = src.device_ptr(dev.stream());
    let (bp, _gb) = bias.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("dt_softplus_{}", T::NAME),
        grid_1d(rows * n),
        sp,
        rows_u,
        w_i,
        col_i,
        bp,
        n_i,
        lo,
        hi,
        op
    )
}

/// Gated DeltaNet gates, `n = dt_bias.len()`: `beta[r, h] = σ(src[r, b_col + h])` and
/// `g[r, h] = neg_a[h] · softplus(src[r, a_col + h] + dt_bias[h])`. `src` `[rows, src_width]`; `beta`, `g` `[rows, n]`.
#[allow(clippy::too_many_arguments)]
pub fn gdn_gates<T: Elem>(
    dev: &CudaDevice,
    src: &impl DevicePtr<T>,
    rows: usize,
    src_width: usize,
    b_col: usize,
    a_col: usize,
    dt_bias: &impl DevicePtr<f32>,
    neg_a: &impl DevicePtr<f32>,
    beta: &mut impl DevicePtrMut<f32>,
    g: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "gdn_gates";
    let n = dt_bias.len();
    check_len(OP, "src", src.len(), rows * src_width)?;
    check_len(OP, "neg_a", neg_a.len(), n)?;
    check_len(OP, "beta", beta.len(), rows * n)?;
    check_len(OP, "g", g.len(), rows * n)?;
    ensure(OP, b_col + n <= src_width && a_col + n <= src_width, || {
        format!("columns b {b_col}, a {a_col} (+{n}) exceed the row of {src_width}")
    })?;
    fits_i32(OP, "src_width", src_width)?;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let (rows_u, w_i, b_i, a_i, n_i) = (rows as u64, src_width as i32, b_col as i32, a_col as i32, n as i32);
    let (sp, _gs) = src.device_ptr(dev.stream());
    let (dp, _gd) = dt_bias.device_ptr(dev.stream());
    let (ap, _ga) = neg_a.device_ptr(dev.stream());
    let (bp, _gb) = beta.device_ptr_mut(dev.stream());
    let (gp, _gg) = g.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("gdn_gates_{}", T::NAME),
        grid_1d(rows * n),
        sp,
        rows_u,
        w_i,
        b_i,
        a_i,
        dp,
        ap,
        n_i,
        bp,
        gp
    )
}

/// `x *= σ(gate)` elementwise.
pub fn sigmoid_mul<T: Elem>(dev: &CudaDevice, x: &mut impl DevicePtrMut<T>, gate: &impl DevicePtr<T>) -> Result<()> {
    check_len("sigmoid_mul", "gate", gate.len(), x.len())?;
    if x.len() == 0 {
        return Ok(());
    }
    let n = x.len() as u64;
    let cfg = grid_1d(x.len());
    let (xp, _gx) = x.device_ptr_mut(dev.stream());
    let (gp, _gg) = gate.device_ptr(dev.stream());
    launch!(dev, format!("sigmoid_mul_{}", T::NAME), cfg, xp, gp, n)
}

/// SwiGLU of a fused gate|up projection: `x` `[rows, 2·inter]` (gate columns first), `out` `[rows, inter]`,
/// `out[r, j] = silu(x[r, j]) · x[r, inter + j]`.
pub fn swiglu_split<T: Elem>(
    dev: &CudaDevice,
    x: &impl DevicePtr<T>,
    inter: usize,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "swiglu_split";
    let rows = rows_of(OP, "x", x.len(), 2 * inter)?;
    check_len(OP, "out", out.len(), rows * inter)?;
    fits_i32(OP, "inter", inter)?;
    if rows == 0 {
        return Ok(());
    }
    let (rows_u, inter_i) = (rows as u64, inter as i32);
    let (xp, _gx) = x.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("swiglu_split_{}", T::NAME),
        grid_1d(rows * inter),
        xp,
        op,
        rows_u,
        inter_i
    )
}

/// `x[r, j] += bias[j]` over rows of `bias.len()`.
pub fn add_bias<T: Elem>(dev: &CudaDevice, x: &mut impl DevicePtrMut<T>, bias: &impl DevicePtr<f32>) -> Result<()> {
    const OP: &str = "add_bias";
    let dim = bias.len();
    rows_of(OP, "x", x.len(), dim)?;
    fits_i32(OP, "dim", dim)?;
    if x.len() == 0 {
        return Ok(());
    }
    let (n, dim_i) = (x.len() as u64, dim as i32);
    let cfg = grid_1d(x.len());
    let (xp, _gx) = x.device_ptr_mut(dev.stream());
    let (bp, _gb) = bias.device_ptr(dev.stream());
    launch!(dev, format!("add_bias_{}", T::NAME), cfg, xp, bp, n, dim_i)
}

/// Vocab-parallel embedding into f32: `table` `[local_rows, dim]` holds ids `vocab_start .. vocab_start + local_rows`;
/// `out[i] = table[ids[i] − vocab_start]`, or zeros when the id is outside that range (the ranks' rows are summed).
pub fn embed_rows_f32<T: Elem>(
    dev: &CudaDevice,
    table: &impl DevicePtr<T>,
    ids: &impl DevicePtr<i32>,
    dim: usize,
    vocab_start: usize,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "embed_rows_f32";
    let local_rows = rows_of(OP, "table", table.len(), dim)?;
    check_len(OP, "out", out.len(), ids.len() * dim)?;
    fits_u32(OP, "tokens", ids.len())?;
    fits_i32(OP, "dim", dim)?;
    if ids.is_empty() {
        return Ok(());
    }
    let (dim_i, start, local) = (dim as i32, vocab_start as i64, local_rows as i64);
    let (tp, _gt) = table.device_ptr(dev.stream());
    let (ip, _gi) = ids.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("embed_rows_f32_{}", T::NAME),
        per_row(ids.len(), 1, dim.min(256)),
        tp,
        ip,
        op,
        dim_i,
        start,
        local
    )
}

/// Finishes a MoE layer over `rows` tokens of `dim = out.len() / rows`: `out = routed + s · shared` with
/// `s = σ(shared_gate[r])` when a gate (`[rows]`) is given, else 1; without `shared`, `out = routed`.
pub fn moe_finish<T: Elem>(
    dev: &CudaDevice,
    routed: &impl DevicePtr<T>,
    shared: Option<&impl DevicePtr<f32>>,
    shared_gate: Option<&impl DevicePtr<f32>>,
    rows: usize,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "moe_finish";
    check_len(OP, "routed", routed.len(), out.len())?;
    if rows == 0 {
        return check_len(OP, "out", out.len(), 0);
    }
    let dim = rows_of(OP, "out", out.len(), rows).map(|_| out.len() / rows)?;
    ensure(OP, dim > 0, || "empty rows".into())?;
    if let Some(s) = shared {
        check_len(OP, "shared", s.len(), out.len())?;
    }
    if let Some(g) = shared_gate {
        ensure(OP, shared.is_some(), || "a shared gate without a shared expert".into())?;
        check_len(OP, "shared_gate", g.len(), rows)?;
    }
    fits_i32(OP, "dim", dim)?;
    let (n, dim_i) = (out.len() as u64, dim as i32);
    let cfg = grid_1d(out.len());
    let (rp, _gr) = routed.device_ptr(dev.stream());
    let (sp, _gs) = match shared {
        Some(s) => {
            let (p, g) = s.device_ptr(dev.stream());
            (p, Some(g))
        }
        None => (0, None),
    };
    let (gp, _gg) = match shared_gate {
        Some(s) => {
            let (p, g) = s.device_ptr(dev.stream());
            (p, Some(g))
        }
        None => (0, None),
    };
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(dev, format!("moe_finish_{}", T::NAME), cfg, rp, sp, gp, op, n, dim_i)
}

/// Checks the shared shape contract of the split gated norm; returns the local channel count `di`.
fn check_gated(op: &'static str, y: usize, z: usize, rows: usize, first: usize, gs: usize, ng: usize) -> Result<usize> {
    ensure(op, rows > 0 && gs > 0, || "rows and group_size must be positive".into())?;
    let di = rows_of(op, "y", y, rows)?;
    check_len(op, "z", z, y)?;
    ensure(op, di > 0 && (first + di).div_ceil(gs) <= ng, || {
        format!("channels {first}..{} fall outside {ng} groups of {gs}", first + di)
    })?;
    fits_i32(op, "first_channel + di", first + di)?;
    fits_i32(op, "groups", ng)?;
    Ok(di)
}

/// Local part of Mamba-2's gated RMSNorm under tensor parallelism: `y`, `z` `[rows, di]` hold this rank's channels
/// `first_channel ..`; `sums[r, g] = Σ (y · silu(z))²` over the local channels of norm group `g` (global channel
/// `/ group_size`), `[rows, num_groups]`, zero where no local channel falls. The caller all-reduces `sums`.
#[allow(clippy::too_many_arguments)]
pub fn gated_sq_sums<T: Elem>(
    dev: &CudaDevice,
    y: &impl DevicePtr<T>,
    z: &impl DevicePtr<T>,
    rows: usize,
    first_channel: usize,
    group_size: usize,
    num_groups: usize,
    sums: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "gated_sq_sums";
    if rows == 0 {
        return check_len(OP, "y", y.len(), 0);
    }
    let di = check_gated(OP, y.len(), z.len(), rows, first_channel, group_size, num_groups)?;
    check_len(OP, "sums", sums.len(), rows * num_groups)?;
    fits_u32(OP, "rows", rows)?;
    fits_grid_y(OP, "num_groups", num_groups)?;
    let (di_i, first_i, gs_i, ng_i) = (di as i32, first_channel as i32, group_size as i32, num_groups as i32);
    let (yp, _gy) = y.device_ptr(dev.stream());
    let (zp, _gz) = z.device_ptr(dev.stream());
    let (sp, _gs) = sums.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("gated_sq_sums_{}", T::NAME),
        per_row(rows, num_groups, group_size.min(di)),
        yp,
        zp,
        sp,
        di_i,
        first_i,
        gs_i,
        ng_i
    )
}

/// Applies the all-reduced sums of [`gated_sq_sums`]: `out[r, c] = (y · silu(z)) · rsqrt(sums[r, g] / group_size +
/// eps) · weight[c]` with `g = (first_channel + c) / group_size`; `weight` `[di]` is this rank's slice.
#[allow(clippy::too_many_arguments)]
pub fn gated_norm_apply<T: Elem>(
    dev: &CudaDevice,
    y: &impl DevicePtr<T>,
    z: &impl DevicePtr<T>,
    sums: &impl DevicePtr<f32>,
    weight: &impl DevicePtr<T>,
    rows: usize,
    first_channel: usize,
    group_size: usize,
    num_groups: usize,
    eps: f32,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "gated_norm_apply";
    if rows == 0 {
        return check_len(OP, "y", y.len(), 0);
    }
    let di = check_gated(OP, y.len(), z.len(), rows, first_channel, group_size, num_groups)?;
    check_len(OP, "sums", sums.len(), rows * num_groups)?;
    check_len(OP, "weight", weight.len(), di)?;
    check_len(OP, "out", out.len(), y.len())?;
    let (rows_u, di_i, first_i, gs_i, ng_i) = (
        rows as u64,
        di as i32,
        first_channel as i32,
        group_size as i32,
        num_groups as i32,
    );
    let (yp, _gy) = y.device_ptr(dev.stream());
    let (zp, _gz) = z.device_ptr(dev.stream());
    let (sp, _gs) = sums.device_ptr(dev.stream());
    let (wp, _gw) = weight.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("gated_norm_apply_{}", T::NAME),
        grid_1d(rows * di),
        yp,
        zp,
        sp,
        wp,
        op,
        rows_u,
        di_i,
        first_i,
        gs_i,
        ng_i,
        eps
    )
}
