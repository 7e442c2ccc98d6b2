//! Chunked prefill scans for one sequence: Mamba-2 SSD and the gated delta rule. Both take an f32 workspace, sized by
//! their `*_workspace` function, so a caller can allocate it once per layer shape (and capture the launches in a graph).

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{after_launch, fits_u32, grid_1d, with_shared_memory};
use crate::cpu::gdn::GdnDims;
use crate::cpu::mamba2::Mamba2Dims;
use crate::cuda::device::{CudaDevice, Elem};
use crate::cuda::{check_len, driver_err, ensure, Result};

/// The longest chunk the scan kernels take (their shared-memory tiles are sized for it).
pub const MAX_CHUNK: usize = 64;

fn check_chunk(op: &'static str, chunk: usize) -> Result<()> {
    ensure(op, (1..=MAX_CHUNK).contains(&chunk), || {
        format!("chunk {chunk} is outside 1..={MAX_CHUNK}")
    })
}

/// f32 elements of workspace [`mamba2_chunked`] needs: the per-chunk states and decays.
pub fn mamba2_chunked_workspace(dims: Mamba2Dims, seq: usize, chunk: usize) -> usize {
    let chunks = seq.div_ceil(chunk.max(1));
    chunks * dims.heads * (dims.head_dim * dims.state_dim + 1)
}

/// Which kernels run a chunked scan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanKernel {
    /// Tensor cores where the shape allows ([`mamba2_tensor_cores`]), else the SIMT kernels.
    Auto,
    /// The SIMT kernels (any shape, f32 or bf16): the baseline the timings compare with.
    Simt,
}

/// Whether [`ScanKernel::Auto`] runs this Mamba-2 scan on tensor cores (`ssd_tc.cu`): bf16 storage, chunk 64, head
/// dim 64, state 64 or 128 (every Nemotron-H / Nemotron-3 layer). The chunk states then carry bf16 rounding of the
/// scaled `B` operand (accumulated in f32), as mamba_ssm's do.
pub fn mamba2_tensor_cores<T: Elem>(dims: Mamba2Dims, chunk: usize) -> bool {
    T::NAME == "bf16" && chunk == 64 && dims.head_dim == 64 && matches!(dims.state_dim, 64 | 128)
}

/// The Mamba-2 chunked (SSD) scan over `seq` tokens of one sequence (see [`crate::cpu::mamba2::mamba2_chunked`]):
/// starts from `state` (`[heads, head_dim, state_dim]` f32) and leaves the final state in it.
///
/// `x`, `y`: `[seq, heads, head_dim]`; `dt`: `[seq, heads]` f32 (softplus'd and clamped); `a`, `d_skip`: `[heads]` f32;
/// `b`, `c`: `[seq, groups, state_dim]`; `chunk` at most [`MAX_CHUNK`]; `seq` need not be a multiple of it.
#[allow(clippy::too_many_arguments)]
pub fn mamba2_chunked<T: Elem>(
    dev: &CudaDevice,
    dims: Mamba2Dims,
    seq: usize,
    chunk: usize,
    state: &mut impl DevicePtrMut<f32>,
    x: &impl DevicePtr<T>,
    dt: &impl DevicePtr<f32>,
    a: &impl DevicePtr<f32>,
    b: &impl DevicePtr<T>,
    c: &impl DevicePtr<T>,
    d_skip: &impl DevicePtr<f32>,
    y: &mut impl DevicePtrMut<T>,
    workspace: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    mamba2_chunked_using(
        dev,
        ScanKernel::Auto,
        dims,
        seq,
        chunk,
        state,
        x,
        dt,
        a,
        b,
        c,
        d_skip,
        y,
        workspace,
    )
}

/// [`mamba2_chunked`] with the kernels named.
#[allow(clippy::too_many_arguments)]
pub fn mamba2_chunked_using<T: Elem>(
    dev: &CudaDevice,
    kernel: ScanKernel,
    dims: Mamba2Dims,
    seq: usize,
    chunk: usize,
    state: &mut impl DevicePtrMut<f32>,
    x: &impl DevicePtr<T>,
    dt: &impl DevicePtr<f32>,
    a: &impl DevicePtr<f32>,
    b: &impl DevicePtr<T>,
    c: &impl DevicePtr<T>,
    d_skip: &impl DevicePtr<f32>,
    y: &mut impl DevicePtrMut<T>,
    workspace: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "mamba2_chunked";
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
    check_chunk(OP, chunk)?;
    let per_head = head_dim * state_dim;
    check_len(OP, "state", state.len(), heads * per_head)?;
    check_len(OP, "x", x.len(), seq * heads * head_dim)?;
    check_len(OP, "y", y.len(), seq * heads * head_dim)?;
    check_len(OP, "dt", dt.len(), seq * heads)?;
    check_len(OP, "A", a.len(), heads)?;
    check_len(OP, "D", d_skip.len(), heads)?;
    check_len(OP, "B", b.len(), seq * groups * state_dim)?;
    check_len(OP, "C", c.len(), seq * groups * state_dim)?;
    let need = mamba2_chunked_workspace(dims, seq, chunk);
    ensure(OP, workspace.len() >= need, || {
        format!("workspace of {} is below the {need} needed", workspace.len())
    })?;
    fits_u32(OP, "workspace", need)?;
    fits_u32(OP, "x", x.len())?;
    if seq == 0 {
        return Ok(());
    }
    let chunks = seq.div_ceil(chunk);
    let (seq_i, h_i, p_i, n_i, g_i, c_i, nc_i, ph_i) = (
        seq as i32,
        heads as i32,
        head_dim as i32,
        state_dim as i32,
        groups as i32,
        chunk as i32,
        chunks as i32,
        per_head as i32,
    );
    let (wp, _gw) = workspace.device_ptr_mut(dev.stream());
    let decay = wp + (chunks * heads * per_head * 4) as u64;
    let (sp, _gs) = state.device_ptr_mut(dev.stream());
    let (xp, _gx) = x.device_ptr(dev.stream());
    let (dtp, _gdt) = dt.device_ptr(dev.stream());
    let (ap, _ga) = a.device_ptr(dev.stream());
    let (bp, _gb) = b.device_ptr(dev.stream());
    let (cp, _gc) = c.device_ptr(dev.stream());
    let (dp, _gd) = d_skip.device_ptr(dev.stream());
    let (yp, _gy) = y.device_ptr_mut(dev.stream());
    // 16-byte rows for cp.async: the shapes guarantee it once the bases are aligned (always, for whole-row slices).
    let aligned = [xp, bp, cp, yp].iter().all(|p| p % 16 == 0);
    let tensor = kernel == ScanKernel::Auto && mamba2_tensor_cores::<T>(dims, chunk) && aligned;
    if tensor {
        let n = state_dim;
        let (state_smem, out_smem) = ((64 * 64 + 64 * n) * 2, (2 * 64 * n + 64 * 64 + 64 * n) * 2);
        let (state_k, out_k) = (format!("ssd_tc_state_n{n}"), format!("ssd_tc_out_n{n}"));
        for (name, smem) in [(&state_k, state_smem), (&out_k, out_smem)] {
            with_shared_memory(dev, name, smem)?;
        }
        let cfg = |smem: usize| LaunchConfig {
            grid_dim: (chunks as u32, heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        launch!(
            dev,
            state_k,
            cfg(state_smem),
            xp,
            dtp,
            ap,
            bp,
            wp,
            decay,
            seq_i,
            h_i,
            g_i
        )?;
        launch!(
            dev,
            format!("ssd_state_scan_{}", T::NAME),
            grid_1d(heads * per_head),
            sp,
            wp,
            decay,
            nc_i,
            h_i,
            ph_i
        )?;
        return launch!(
            dev,
            out_k,
            cfg(out_smem),
            xp,
            dtp,
            ap,
            bp,
            cp,
            dp,
            wp,
            yp,
            seq_i,
            h_i,
            g_i
        );
    }
    let per_chunk = LaunchConfig {
        grid_dim: (chunks as u32, heads as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(
        dev,
        format!("ssd_chunk_state_{}", T::NAME),
        per_chunk,
        xp,
        dtp,
        ap,
        bp,
        wp,
        decay,
        seq_i,
        h_i,
        p_i,
        n_i,
        g_i,
        c_i
    )?;
    launch!(
        dev,
        format!("ssd_state_scan_{}", T::NAME),
        grid_1d(heads * per_head),
        sp,
        wp,
        decay,
        nc_i,
        h_i,
        ph_i
    )?;
    launch!(
        dev,
        format!("ssd_chunk_out_{}", T::NAME),
        per_chunk,
        xp,
        dtp,
        ap,
        bp,
        cp,
        dp,
        wp,
        yp,
        seq_i,
        h_i,
        p_i,
        n_i,
        g_i,
        c_i
    )
}

/// f32 elements of workspace [`gdn_chunked`] needs: `U`, `W` and the masked chunk scores.
pub fn gdn_chunked_workspace(dims: GdnDims, seq: usize, chunk: usize) -> usize {
    let chunks = seq.div_ceil(chunk.max(1));
    seq * dims.v_heads * (dims.v_dim + dims.k_dim) + chunks * dims.v_heads * chunk * chunk
}

/// The chunked gated delta rule over `seq` tokens of one sequence (see [`crate::cpu::gdn::gdn_chunked`]): starts from
/// `state` (`[v_heads, v_dim, k_dim]` f32) and leaves the final state in it.
///
/// `q`, `k`: `[seq, k_heads, k_dim]` (L2-normalised, q scaled); `v`, `out`: `[seq, v_heads, v_dim]`; `g`, `beta`:
/// `[seq, v_heads]` f32. `k_dim` is at most 256, `chunk` at most [`MAX_CHUNK`].
#[allow(clippy::too_many_arguments)]
pub fn gdn_chunked<T: Elem>(
    dev: &CudaDevice,
    dims: GdnDims,
    seq: usize,
    chunk: usize,
    state: &mut impl DevicePtrMut<f32>,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    g: &impl DevicePtr<f32>,
    beta: &impl DevicePtr<f32>,
    out: &mut impl DevicePtrMut<T>,
    workspace: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    gdn_chunked_using(
        dev,
        ScanKernel::Auto,
        dims,
        seq,
        chunk,
        state,
        q,
        k,
        v,
        g,
        beta,
        out,
        workspace,
    )
}

/// Whether [`ScanKernel::Auto`] runs this gated-delta-rule scan on tensor cores (`gdn_tc.cu`): bf16 storage, chunk
/// 64, key and value heads of 128 (every Qwen3-Next / Qwen3.5 layer). Its MMA operands (T, W, the scores, V′ and the
/// state) are rounded to bf16 for the products, accumulated in f32, as fla's kernels do.
pub fn gdn_tensor_cores<T: Elem>(dims: GdnDims, chunk: usize) -> bool {
    T::NAME == "bf16" && chunk == 64 && dims.k_dim == 128 && dims.v_dim == 128
}

/// Block of state rows one `gdn_tc_scan` block owns (`GT_BV` in `gdn_tc.cu`).
const GDN_TC_ROWS: usize = 16;

/// [`gdn_chunked`] with the kernels named.
#[allow(clippy::too_many_arguments)]
pub fn gdn_chunked_using<T: Elem>(
    dev: &CudaDevice,
    kernel: ScanKernel,
    dims: GdnDims,
    seq: usize,
    chunk: usize,
    state: &mut impl DevicePtrMut<f32>,
    q: &impl DevicePtr<T>,
    k: &impl DevicePtr<T>,
    v: &impl DevicePtr<T>,
    g: &impl DevicePtr<f32>,
    beta: &impl DevicePtr<f32>,
    out: &mut impl DevicePtrMut<T>,
    workspace: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "gdn_chunked";
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
    check_chunk(OP, chunk)?;
    check_len(OP, "state", state.len(), dims.state_len())?;
    check_len(OP, "q", q.len(), seq * k_heads * k_dim)?;
    check_len(OP, "k", k.len(), seq * k_heads * k_dim)?;
    check_len(OP, "v", v.len(), seq * v_heads * v_dim)?;
    check_len(OP, "out", out.len(), seq * v_heads * v_dim)?;
    check_len(OP, "g", g.len(), seq * v_heads)?;
    check_len(OP, "beta", beta.len(), seq * v_heads)?;
    let need = gdn_chunked_workspace(dims, seq, chunk);
    ensure(OP, workspace.len() >= need, || {
        format!("workspace of {} is below the {need} needed", workspace.len())
    })?;
    fits_u32(OP, "workspace", need)?;
    if seq == 0 {
        return Ok(());
    }
    let chunks = seq.div_ceil(chunk);
    let (seq_i, hk, hv, dk, dv, c_i) = (
        seq as i32,
        k_heads as i32,
        v_heads as i32,
        k_dim as i32,
        v_dim as i32,
        chunk as i32,
    );
    let (up, _gw) = workspace.device_ptr_mut(dev.stream());
    let wp = up + (seq * v_heads * v_dim * 4) as u64;
    let scp = wp + (seq * v_heads * k_dim * 4) as u64;
    let (sp, _gs) = state.device_ptr_mut(dev.stream());
    let (qp, _gq) = q.device_ptr(dev.stream());
    let (kp, _gk) = k.device_ptr(dev.stream());
    let (vp, _gv) = v.device_ptr(dev.stream());
    let (gp, _gg) = g.device_ptr(dev.stream());
    let (bp, _gb) = beta.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    let aligned = [qp, kp, vp, op].iter().all(|p| p % 16 == 0);
    if kernel == ScanKernel::Auto && gdn_tensor_cores::<T>(dims, chunk) && aligned {
        // Shared memory of gdn_tc_prep (K, Q, βV; A and T in f32; T in bf16) and gdn_tc_scan (W, Q, scaled K, the
        // scores, V', the state rows).
        let prep_smem = 3 * 64 * 128 * 2 + 2 * 64 * 64 * 4 + 64 * 64 * 2;
        let scan_smem = 3 * 64 * 128 * 2 + 64 * 64 * 2 + 64 * GDN_TC_ROWS * 2 + GDN_TC_ROWS * 128 * 2;
        with_shared_memory(dev, "gdn_tc_prep", prep_smem)?;
        with_shared_memory(dev, "gdn_tc_scan", scan_smem)?;
        let cfg = |grid: (u32, u32, u32), smem: usize| LaunchConfig {
            grid_dim: grid,
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        launch!(
            dev,
            "gdn_tc_prep",
            cfg((chunks as u32, v_heads as u32, 1), prep_smem),
            qp,
            kp,
            vp,
            gp,
            bp,
            up,
            wp,
            scp,
            seq_i,
            hk,
            hv
        )?;
        return launch!(
            dev,
            "gdn_tc_scan",
            cfg(((v_dim / GDN_TC_ROWS) as u32, v_heads as u32, 1), scan_smem),
            qp,
            kp,
            gp,
            up,
            wp,
            scp,
            sp,
            op,
            seq_i,
            hk,
            hv
        );
    }
    let prep = LaunchConfig {
        grid_dim: (chunks as u32, v_heads as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(
        dev,
        format!("gdn_chunk_prep_{}", T::NAME),
        prep,
        qp,
        kp,
        vp,
        gp,
        bp,
        up,
        wp,
        scp,
        seq_i,
        hk,
        hv,
        dk,
        dv,
        c_i
    )?;
    let scan = LaunchConfig {
        grid_dim: (v_dim.div_ceil(4) as u32, v_heads as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(
        dev,
        format!("gdn_chunk_scan_{}", T::NAME),
        scan,
        qp,
        kp,
        gp,
        up,
        wp,
        scp,
        sp,
        op,
        seq_i,
        hk,
        hv,
        dk,
        dv,
        c_i
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mamba2_tensor_cores_take_the_nemotron_shapes_only() {
        let dims = |head_dim, state_dim| Mamba2Dims {
            heads: 128,
            head_dim,
            state_dim,
            groups: 8,
        };
        assert!(mamba2_tensor_cores::<half::bf16>(dims(64, 128), 64));
        assert!(mamba2_tensor_cores::<half::bf16>(dims(64, 64), 64));
        assert!(!mamba2_tensor_cores::<half::bf16>(dims(64, 128), 32));
        assert!(!mamba2_tensor_cores::<half::bf16>(dims(80, 128), 64));
        assert!(!mamba2_tensor_cores::<half::bf16>(dims(64, 256), 64));
        assert!(!mamba2_tensor_cores::<f32>(dims(64, 128), 64));
    }
}
