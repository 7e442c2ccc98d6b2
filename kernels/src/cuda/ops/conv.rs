//! The causal conv1d over each sequence's conv-history ring (`kernels/conv.cu`).

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{after_launch, check_strided, fits_grid_y, fits_u32, vectors, REPLAY_META};
use crate::cuda::device::{CudaDevice, Elem};
use crate::cuda::{check_len, driver_err, ensure, Result};

/// The widest kernel the vector conv (`conv1d_vec`) serves.
const CONV_VEC_K: usize = 4;
/// The fewest threads (rows × channel vectors) for which the vector conv is taken: below (a prompt chunk is one row),
/// the scalar kernel, with a thread per channel and run of [`T_CHUNK`] tokens, has far more threads to offer.
const VEC_MIN_THREADS: usize = 16 * 1024;
/// Tokens a thread of the scalar conv walks (its `t_chunk`); at least the widest history (`K − 1 ≤ 7`), so that only
/// a row's first run reads, or rewrites, its history.
const T_CHUNK: usize = 16;
const _: () = assert!(T_CHUNK >= 7);

/// Shape of a batched causal conv1d over a conv-history ring.
#[derive(Clone, Copy, Debug)]
pub struct ConvDims {
    /// Rows (sequences).
    pub batch: usize,
    /// Tokens per row.
    pub seq: usize,
    /// Channels.
    pub channels: usize,
    /// Elements from one input row to the next (at least `channels`): the conv reads its channels in place out of a
    /// wider row, e.g. the projection's.
    pub x_stride: usize,
    /// Kernel width `K` (at most 8).
    pub k: usize,
    /// Slots in the state pool.
    pub slots: usize,
    /// Ring rows per slot (`K − 1 + T`: the history plus a verify window; at least `K − 1`).
    pub capacity: usize,
    /// Decode / verify: write the row's inputs after its history (the host moves the head by the accepted count).
    /// Prompt chunk: replace the history in place by the last `K − 1` inputs.
    pub append: bool,
}

/// Depthwise causal conv1d (see [`crate::cpu::conv::causal_conv1d`]) for `batch` rows of `seq` tokens, optionally
/// followed by SiLU. `x`: `batch · seq` rows of `x_stride` (the channels first); `out`: `[batch, seq, channels]`; `weight`: `[channels, K]`; `bias`: `[channels]`;
/// `state_pool`: `[slots, capacity, channels]`; `meta`: `[batch, 8]` rows of [`ReplayRow`] (slot and conv head).
#[allow(clippy::too_many_arguments)]
pub fn causal_conv1d<T: Elem, B: DevicePtr<T>>(
    dev: &CudaDevice,
    dims: ConvDims,
    x: &impl DevicePtr<T>,
    weight: &impl DevicePtr<T>,
    bias: Option<&B>,
    state_pool: &mut impl DevicePtrMut<T>,
    meta: &impl DevicePtr<i32>,
    apply_silu: bool,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "causal_conv1d";
    let ConvDims {
        batch,
        seq,
        channels,
        x_stride,
        k,
        slots: num_slots,
        capacity,
        append,
    } = dims;
    ensure(OP, (1..=8).contains(&k), || {
        format!("kernel width {k} is outside 1..=8")
    })?;
    ensure(OP, capacity >= k - 1 && capacity > 0, || {
        format!("a conv ring of {capacity} rows cannot hold a history of {}", k - 1)
    })?;
    ensure(OP, !append || k - 1 + seq <= capacity, || {
        format!(
            "{seq} appended rows overflow a conv ring of {capacity} (history {})",
            k - 1
        )
    })?;
    let rows = batch * seq;
    check_strided(OP, "x", x.len(), rows, x_stride, channels)?;
    check_len(OP, "out", out.len(), batch * seq * channels)?;
    check_len(OP, "weight", weight.len(), channels * k)?;
    check_len(OP, "state_pool", state_pool.len(), num_slots * capacity * channels)?;
    check_len(OP, "meta", meta.len(), batch * REPLAY_META)?;
    if let Some(b) = bias {
        check_len(OP, "bias", b.len(), channels)?;
    }
    fits_grid_y(OP, "batch", batch)?;
    fits_grid_y(OP, "runs of tokens", seq.div_ceil(T_CHUNK))?;
    fits_u32(OP, "batch · seq · channels", batch * seq * channels)?;
    fits_u32(OP, "batch · seq · x_stride", rows * x_stride)?;
    if batch == 0 || seq == 0 || channels == 0 {
        return Ok(());
    }
    let (seq_i, ch_i, stride_i, k_i, slots_i, cap_i, silu_i, append_i) = (
        seq as i32,
        channels as i32,
        x_stride as i32,
        k as i32,
        num_slots as i32,
        capacity as i32,
        apply_silu as i32,
        append as i32,
    );
    let (xp, _gx) = x.device_ptr(dev.stream());
    let (wp, _gw) = weight.device_ptr(dev.stream());
    let (bp, _gb) = match bias {
        Some(b) => {
            let (p, g) = b.device_ptr(dev.stream());
            (p, Some(g))
        }
        None => (0, None),
    };
    let (sp, _gs) = state_pool.device_ptr_mut(dev.stream());
    let (ip, _gi) = meta.device_ptr(dev.stream());
    let (op, _go) = out.device_ptr_mut(dev.stream());
    // 16-byte vectors of channels for decode and verify rows when the layout allows them and the batch has the threads
    // to spare; prompt chunks take the scalar kernel, spread over runs of tokens.
    let vec = vectors::<T>(&[xp, sp, op], &[channels, x_stride])
        .filter(|v| append && k <= CONV_VEC_K && batch * channels / v >= VEC_MIN_THREADS);
    if let Some(v) = vec {
        let cfg = LaunchConfig {
            grid_dim: ((channels / v).div_ceil(128) as u32, batch as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let name = format!("conv1d_vec_{}", T::NAME);
        launch!(dev, name, cfg, xp, wp, bp, sp, ip, slots_i, cap_i, op, seq_i, ch_i, stride_i, k_i, silu_i, append_i)
    } else {
        let cfg = LaunchConfig {
            grid_dim: (
                channels.div_ceil(128) as u32,
                batch as u32,
                seq.div_ceil(T_CHUNK) as u32,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (name, chunk_i) = (format!("conv1d_{}", T::NAME), T_CHUNK as i32);
        launch!(
            dev, name, cfg, xp, wp, bp, sp, ip, slots_i, cap_i, op, seq_i, ch_i, stride_i, k_i, silu_i, append_i,
            chunk_i
        )
    }
}
