//! Mixture-of-experts on the GPU: routing (softmax top-k, grouped sigmoid with correction bias), grouping the
//! assignments by expert on the device, one grouped GEMM launch over every expert, and the weighted combine.
//!
//! A routed MLP is: [`route_softmax`] or [`route_sigmoid_grouped`] → [`moe_align`] → [`moe_gemm`] with the token
//! gather (up, and gate for gated experts) → an activation ([`super::activation`], [`super::swiglu`]) →
//! [`moe_gemm`] without gather (down) → [`moe_combine`]. Nothing goes back to the host in between: the GEMM grid is
//! sized by bounds known on the host (the token count bounds any expert's rows; rows / tile + experts bounds the row
//! tiles of all experts) and blocks past the real work exit at once. bf16 GEMMs run on tensor cores (`moe_tc.cu`).

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{after_launch, fits_grid_y, fits_u32, grid_1d, with_shared_memory};
use crate::cuda::device::{CudaDevice, Elem};
use crate::cuda::{check_len, driver_err, ensure, Result};

/// Block width of the routing kernels.
const ROUTE_THREADS: u32 = 256;
/// Most expert groups `route_sigmoid_grouped` takes (`ROUTE_MAX_GROUPS` in `moe_route.cu`).
const MAX_GROUPS: usize = 64;

fn check_route(op: &'static str, logits: usize, experts: usize, top_k: usize) -> Result<usize> {
    ensure(op, experts > 0 && (1..=experts).contains(&top_k), || {
        format!("top_k {top_k} is outside 1..={experts}")
    })?;
    ensure(op, experts <= 8192, || format!("{experts} experts exceed 8192"))?;
    ensure(op, logits.is_multiple_of(experts), || {
        format!("logits of {logits} are not a whole number of rows of {experts}")
    })?;
    let tokens = logits / experts;
    fits_u32(op, "tokens", tokens)?;
    Ok(tokens)
}

fn route_cfg(tokens: usize, experts: usize, top_k: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (tokens as u32, 1, 1),
        block_dim: (ROUTE_THREADS, 1, 1),
        shared_mem_bytes: ((2 * experts + top_k) * 4) as u32,
    }
}

/// Softmax routing (see [`crate::cpu::moe::route_softmax`]): `logits` `[tokens, experts]` f32 → `ids` and `weights`
/// `[tokens, top_k]`, picks by decreasing probability (ties to the lower id), renormalised with `norm_topk_prob`.
pub fn route_softmax(
    dev: &CudaDevice,
    logits: &impl DevicePtr<f32>,
    experts: usize,
    top_k: usize,
    norm_topk_prob: bool,
    ids: &mut impl DevicePtrMut<i32>,
    weights: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "route_softmax";
    let tokens = check_route(OP, logits.len(), experts, top_k)?;
    check_len(OP, "ids", ids.len(), tokens * top_k)?;
    check_len(OP, "weights", weights.len(), tokens * top_k)?;
    if tokens == 0 {
        return Ok(());
    }
    let (e_i, k_i, norm) = (experts as i32, top_k as i32, norm_topk_prob as i32);
    let (lp, _gl) = logits.device_ptr(dev.stream());
    let (ip, _gi) = ids.device_ptr_mut(dev.stream());
    let (wp, _gw) = weights.device_ptr_mut(dev.stream());
    launch!(
        dev,
        "route_softmax",
        route_cfg(tokens, experts, top_k),
        lp,
        ip,
        wp,
        e_i,
        k_i,
        norm
    )
}

/// Parameters of grouped sigmoid routing (Nemotron-H's router).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SigmoidRouting {
    /// Routed experts.
    pub experts: usize,
    /// Experts picked per token.
    pub top_k: usize,
    /// Groups of consecutive experts (at most 64).
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// Divide the picked scores by their sum (+1e-20).
    pub norm_topk_prob: bool,
    /// Factor on the final weights.
    pub routed_scaling_factor: f32,
}

/// Grouped sigmoid routing with correction bias (see [`crate::cpu::moe::route_sigmoid_grouped`]): `logits`
/// `[tokens, experts]` f32, `correction_bias` `[experts]` f32 → `ids`, `weights` `[tokens, top_k]`.
pub fn route_sigmoid_grouped(
    dev: &CudaDevice,
    cfg: SigmoidRouting,
    logits: &impl DevicePtr<f32>,
    correction_bias: &impl DevicePtr<f32>,
    ids: &mut impl DevicePtrMut<i32>,
    weights: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "route_sigmoid_grouped";
    let SigmoidRouting {
        experts,
        top_k,
        n_group,
        topk_group,
        norm_topk_prob,
        routed_scaling_factor,
    } = cfg;
    let tokens = check_route(OP, logits.len(), experts, top_k)?;
    ensure(
        OP,
        (1..=MAX_GROUPS).contains(&n_group) && experts.is_multiple_of(n_group),
        || format!("n_group {n_group} must divide {experts} experts and be at most {MAX_GROUPS}"),
    )?;
    ensure(OP, (1..=n_group).contains(&topk_group), || {
        format!("topk_group {topk_group} is outside 1..={n_group}")
    })?;
    let per_group = experts / n_group;
    ensure(OP, top_k <= topk_group * per_group, || {
        "top_k exceeds the experts of the kept groups".into()
    })?;
    ensure(OP, topk_group == n_group || per_group >= 2, || {
        "groups need at least two experts".into()
    })?;
    check_len(OP, "correction_bias", correction_bias.len(), experts)?;
    check_len(OP, "ids", ids.len(), tokens * top_k)?;
    check_len(OP, "weights", weights.len(), tokens * top_k)?;
    if tokens == 0 {
        return Ok(());
    }
    let (e_i, k_i, g_i, kg_i, norm) = (
        experts as i32,
        top_k as i32,
        n_group as i32,
        topk_group as i32,
        norm_topk_prob as i32,
    );
    let scaling = routed_scaling_factor;
    let (lp, _gl) = logits.device_ptr(dev.stream());
    let (bp, _gb) = correction_bias.device_ptr(dev.stream());
    let (ip, _gi) = ids.device_ptr_mut(dev.stream());
    let (wp, _gw) = weights.device_ptr_mut(dev.stream());
    launch!(
        dev,
        "route_sigmoid_grouped",
        route_cfg(tokens, experts, top_k),
        lp,
        bp,
        ip,
        wp,
        e_i,
        k_i,
        g_i,
        kg_i,
        norm,
        scaling
    )
}

/// Groups `ids` (`[tokens, top_k]`) by expert on the device: `offsets` (`[experts + 1]`) delimits each expert's run of
/// `rows` (`[tokens · top_k]`, the token of each grouped row), and `pos` (`[tokens · top_k]`) is where each assignment
/// landed (−1 for an id out of range). Row order inside a run is unspecified and affects no result.
pub fn moe_align(
    dev: &CudaDevice,
    ids: &impl DevicePtr<i32>,
    top_k: usize,
    experts: usize,
    offsets: &mut impl DevicePtrMut<i32>,
    rows: &mut impl DevicePtrMut<i32>,
    pos: &mut impl DevicePtrMut<i32>,
) -> Result<()> {
    const OP: &str = "moe_align";
    let n = ids.len();
    ensure(OP, top_k > 0 && n.is_multiple_of(top_k), || {
        format!("{n} ids are not a whole number of tokens of {top_k}")
    })?;
    ensure(OP, (1..=12_000).contains(&experts), || {
        format!("{experts} experts outside 1..=12000")
    })?;
    check_len(OP, "offsets", offsets.len(), experts + 1)?;
    check_len(OP, "rows", rows.len(), n)?;
    check_len(OP, "pos", pos.len(), n)?;
    fits_u32(OP, "ids", n)?;
    let (n_i, k_i, e_i) = (n as i32, top_k as i32, experts as i32);
    let (ip, _gi) = ids.device_ptr(dev.stream());
    let (op, _go) = offsets.device_ptr_mut(dev.stream());
    let (rp, _gr) = rows.device_ptr_mut(dev.stream());
    let (pp, _gp) = pos.device_ptr_mut(dev.stream());
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: (experts * 4) as u32,
    };
    launch!(dev, "moe_align", cfg, ip, n_i, k_i, e_i, op, rp, pp)
}

/// Which kernel runs a grouped expert GEMM ([`moe_gemm_using`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeKernel {
    /// The tensor-core kernel for bf16 with `in_dim % 8 == 0` (the M64 tiling when the average expert has at least
    /// [`MOE_M64_ROWS`] rows, else M16); the SIMT kernel otherwise.
    Auto,
    /// The SIMT kernel of `moe.cu` (f32 or bf16, any shape).
    Simt,
    /// Tensor cores, one m16 tile of rows per block (decode: weights read once per 16 rows of an expert).
    TensorM16,
    /// Tensor cores, 64 rows per block (prefill).
    TensorM64,
}

/// Average rows per expert from which [`MoeKernel::Auto`] takes the 64-row tiling: below it most tiles would be
/// padding and the 16-row tiling reads each expert's weights once anyway.
pub const MOE_M64_ROWS: usize = 32;

/// Threads of the tensor-core kernels (`MT_THREADS` in `moe_tc.cu`).
const TC_THREADS: u32 = 128;

/// Dynamic shared memory of a tensor-core tiling (`MtShape<BM>::SMEM` in `moe_tc.cu`): stages × (BM + 64) × 64 bf16.
fn tc_smem(bm: usize) -> usize {
    let stages = if bm == 16 { 4 } else { 3 };
    stages * (bm + 64) * 64 * 2
}

/// Whether the tensor-core kernels take this GEMM.
pub fn moe_tensor_cores<T: Elem>(in_dim: usize) -> bool {
    T::NAME == "bf16" && in_dim.is_multiple_of(8)
}

/// One grouped GEMM over every expert: for each expert `e` and row `r` of its run `offsets[e] .. offsets[e + 1]`,
/// `out[r] = a[src(r)] · w[e]ᵀ` with `w` `[experts, out_dim, in_dim]`, `src(r) = gather[r]` (a token of `a`
/// `[tokens, in_dim]`) when `gather` is given, else `r` (`a` `[rows, in_dim]`). `out`: `[rows, out_dim]`, rows =
/// `offsets[experts]`. `max_rows` bounds every run (the token count). f32 accumulation. The kernel is chosen by
/// [`MoeKernel::Auto`].
#[allow(clippy::too_many_arguments)]
pub fn moe_gemm<T: Elem, G: DevicePtr<i32>>(
    dev: &CudaDevice,
    a: &impl DevicePtr<T>,
    gather: Option<&G>,
    w: &impl DevicePtr<T>,
    offsets: &impl DevicePtr<i32>,
    out: &mut impl DevicePtrMut<T>,
    max_rows: usize,
    in_dim: usize,
    out_dim: usize,
) -> Result<()> {
    moe_gemm_using(
        dev,
        MoeKernel::Auto,
        a,
        gather,
        w,
        offsets,
        out,
        max_rows,
        in_dim,
        out_dim,
    )
}

/// [`moe_gemm`] with the kernel named (the parity cases and timings run each one); a tensor-core kernel asked for a
/// shape it cannot take is an error.
#[allow(clippy::too_many_arguments)]
pub fn moe_gemm_using<T: Elem, G: DevicePtr<i32>>(
    dev: &CudaDevice,
    kernel: MoeKernel,
    a: &impl DevicePtr<T>,
    gather: Option<&G>,
    w: &impl DevicePtr<T>,
    offsets: &impl DevicePtr<i32>,
    out: &mut impl DevicePtrMut<T>,
    max_rows: usize,
    in_dim: usize,
    out_dim: usize,
) -> Result<()> {
    const OP: &str = "moe_gemm";
    ensure(OP, in_dim > 0 && out_dim > 0, || "empty dimension".into())?;
    let experts = offsets.len().saturating_sub(1);
    ensure(OP, experts > 0, || "no experts".into())?;
    check_len(OP, "w", w.len(), experts * out_dim * in_dim)?;
    ensure(OP, a.len().is_multiple_of(in_dim), || {
        format!("a of {} is not a whole number of rows of {in_dim}", a.len())
    })?;
    let rows = out.len() / out_dim;
    check_len(OP, "out", out.len(), rows * out_dim)?;
    if let Some(g) = gather {
        check_len(OP, "gather", g.len(), rows)?;
    } else {
        check_len(OP, "a", a.len(), rows * in_dim)?;
    }
    ensure(OP, experts <= 65_535, || format!("{experts} experts exceed 65535"))?;
    fits_u32(OP, "a", a.len())?;
    fits_u32(OP, "out", out.len())?;
    let tensor = moe_tensor_cores::<T>(in_dim);
    let bm = match kernel {
        MoeKernel::Auto if tensor => Some(if rows >= MOE_M64_ROWS * experts { 64 } else { 16 }),
        MoeKernel::Auto | MoeKernel::Simt => None,
        MoeKernel::TensorM16 | MoeKernel::TensorM64 => {
            ensure(OP, tensor, || {
                format!(
                    "the tensor-core kernels take bf16 with in_dim a multiple of 8, not {} with in_dim {in_dim}",
                    T::NAME
                )
            })?;
            Some(if kernel == MoeKernel::TensorM16 { 16 } else { 64 })
        }
    };
    match bm {
        Some(bm) => fits_grid_y(OP, "row tiles", rows.div_ceil(bm) + experts)?,
        None => fits_grid_y(OP, "row tiles", max_rows.div_ceil(64))?,
    }
    if rows == 0 || max_rows == 0 {
        return Ok(());
    }
    let (k_i, n_i, e_i) = (in_dim as i32, out_dim as i32, experts as i32);
    let (ap, _ga) = a.device_ptr(dev.stream());
    let (gp, _gg) = match gather {
        Some(g) => {
            let (p, guard) = g.device_ptr(dev.stream());
            (p, Some(guard))
        }
        None => (0, None),
    };
    let (wp, _gw) = w.device_ptr(dev.stream());
    let (offp, _goff) = offsets.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    // cp.async moves 16-byte chunks: with in_dim % 8 == 0 every row is aligned once the bases are (always, for
    // allocations and whole-row slices). A misaligned base falls back under Auto and is an error when named.
    let aligned = ap % 16 == 0 && wp % 16 == 0;
    ensure(OP, aligned || kernel == MoeKernel::Auto || bm.is_none(), || {
        "the tensor-core kernels need 16-byte aligned a and w".into()
    })?;
    if let Some(bm) = bm.filter(|_| aligned) {
        let name = format!("moe_gemm_tc_m{bm}");
        let smem = tc_smem(bm);
        with_shared_memory(dev, &name, smem)?;
        let cfg = LaunchConfig {
            grid_dim: (out_dim.div_ceil(64) as u32, (rows.div_ceil(bm) + experts) as u32, 1),
            block_dim: (TC_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        return launch!(dev, name, cfg, ap, gp, wp, offp, op, k_i, n_i, e_i);
    }
    let cfg = LaunchConfig {
        grid_dim: (
            out_dim.div_ceil(64) as u32,
            max_rows.div_ceil(64) as u32,
            experts as u32,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(
        dev,
        format!("moe_gemm_{}", T::NAME),
        cfg,
        ap,
        gp,
        wp,
        offp,
        op,
        k_i,
        n_i
    )
}

/// `out[t] (+)= Σ_k weights[t, k] · y[pos[t, k]]` over `top_k` assignments per token, in `k` order, skipping `pos`
/// −1. `y`: `[rows, dim]`; `pos`, `weights`: `[tokens, top_k]`; `out`: `[tokens, dim]`, added to with `accumulate`.
pub fn moe_combine<T: Elem>(
    dev: &CudaDevice,
    y: &impl DevicePtr<T>,
    pos: &impl DevicePtr<i32>,
    weights: &impl DevicePtr<f32>,
    top_k: usize,
    accumulate: bool,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "moe_combine";
    ensure(OP, top_k > 0 && pos.len().is_multiple_of(top_k), || {
        format!("pos of {} is not a whole number of tokens of {top_k}", pos.len())
    })?;
    check_len(OP, "weights", weights.len(), pos.len())?;
    let tokens = pos.len() / top_k;
    ensure(OP, tokens > 0 && out.len().is_multiple_of(tokens), || {
        format!("out of {} is not {tokens} rows", out.len())
    })?;
    let dim = out.len() / tokens;
    ensure(OP, dim > 0 && y.len().is_multiple_of(dim), || {
        format!("y of {} is not a whole number of rows of {dim}", y.len())
    })?;
    fits_u32(OP, "out", out.len())?;
    fits_u32(OP, "y", y.len())?;
    let (t_i, k_i, d_i, acc) = (tokens as i32, top_k as i32, dim as i32, accumulate as i32);
    let (yp, _gy) = y.device_ptr(dev.stream());
    let (pp, _gp) = pos.device_ptr(dev.stream());
    let (wp, _gw) = weights.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    launch!(
        dev,
        format!("moe_combine_{}", T::NAME),
        grid_1d(tokens * dim),
        yp,
        pp,
        wp,
        op,
        t_i,
        k_i,
        d_i,
        acc
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_core_tilings_fit_shared_memory_and_take_only_aligned_bf16() {
        // Hopper and Blackwell give a block at most 227 KiB; these must also leave room for several blocks per SM.
        assert_eq!(tc_smem(16), 4 * 80 * 64 * 2);
        assert_eq!(tc_smem(64), 3 * 128 * 64 * 2);
        assert!(tc_smem(64) <= 64 * 1024);
        assert!(moe_tensor_cores::<half::bf16>(2688));
        assert!(!moe_tensor_cores::<half::bf16>(100));
        assert!(!moe_tensor_cores::<f32>(2688));
    }
}
