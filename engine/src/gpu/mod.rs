//! The model on NVIDIA GPUs: bf16 weights and activations with f32 accumulation, f32 SSM state, slot pools and a paged
//! KV cache sized up front from `--gpu-memory-fraction`, and tensor parallelism over NCCL with one rank (thread) per GPU.
//!
//! The CPU engine is the reference: a rank is built from the same tensor-parallel plan and loaders as
//! [`crate::shard::ShardedModel`] (with one rank the plan is the whole model), uploaded layer by layer, and runs the
//! ops of `rewind_kernels::cuda` — chunked scans for prompts, recurrent steps over slot pools for decoding.
//!
//! - [`load`]: [`gpu_group`], the model on GPUs as a [`crate::rank::RankGroup`] (one rank thread per GPU), which the
//!   rest of rewind drives through the [`crate::rank::Rank`] interface like CPU ranks.
//! - [`options`]: devices, memory fraction, pool sizes, storage type; [`check`]: the teacher-forced check against the
//!   CPU.
//! - `rank`: a rank's load, memory plan and steps; `forward` (mixers) and `ffn` (MLP, MoE): the layers; `state`:
//!   device pools; `scratch`: activation buffers; `layers`, `weights`: device copies of the weights; `graphs`: the
//!   CUDA graphs decode and verify steps replay; `mtp_layer` and `mtp`: the checkpoint's MTP layer and the drafts it
//!   proposes on the rank ([`mtp_forced`]: checked against the CPU rank's).

mod chain;
pub mod check;
mod check_chain;
mod check_logprobs;
mod check_mtp;
mod check_verify;
mod ffn;
mod forward;
mod graphs;
mod head;
mod layers;
pub mod load;
mod loaded;
mod mtp;
mod mtp_layer;
mod mtp_plan;
pub mod options;
mod rank;
mod scratch;
mod snapshot;
mod spec_chain;
mod ssm_layers;
pub mod state;
mod steps;
mod store;
mod table_sync;
mod weights;
mod whole_rows;

pub use check::{teacher_forced, TeacherForcedReport};
pub use check_chain::{chain_forced, ChainReport};
pub use check_logprobs::{logprobs_forced, LogprobReport};
pub use check_mtp::{mtp_forced, MtpReport};
pub use check_verify::{verify_forced, VerifyReport};
pub use load::{gpu_group, GpuLauncher, GpuReport};
pub use options::{GpuDtype, GpuOptions};
pub use state::{PoolSizes, BLOCK_SIZE};

use rewind_kernels::cuda::{CudaView, CudaViewMut};

use crate::error::Result;

/// The device collectives a rank needs: an in-place sum across ranks on the rank's stream (the forward pass), and
/// gathers of 32-bit words (a chain's head summaries, `gpu/chain.rs`) and of floats (sampled rows' logit slices,
/// `gpu/whole_rows.rs`).
pub(crate) trait DeviceComm: Send {
    fn all_reduce_f32(&self, buf: &mut CudaViewMut<'_, f32>) -> Result<()>;
    /// Every rank's `send` in rank order into `recv` (`recv.len()` = ranks × `send.len()`).
    fn all_gather_f32(&self, send: &CudaView<'_, f32>, recv: &mut CudaViewMut<'_, f32>) -> Result<()>;
    /// Every rank's `send` in rank order into `recv` (`recv.len()` = ranks × `send.len()`).
    fn all_gather_u32(&self, send: &CudaView<'_, u32>, recv: &mut CudaViewMut<'_, u32>) -> Result<()>;
    /// Whether the communicator was aborted (its generation failed): a step that ran meanwhile, replayed graphs
    /// included, has sums it never received and must fail.
    fn is_aborted(&self) -> bool;
}

impl DeviceComm for rewind_kernels::cuda::nccl::NcclComm {
    fn all_reduce_f32(&self, buf: &mut CudaViewMut<'_, f32>) -> Result<()> {
        Ok(self.all_reduce_sum_f32(buf)?)
    }

    fn all_gather_f32(&self, send: &CudaView<'_, f32>, recv: &mut CudaViewMut<'_, f32>) -> Result<()> {
        Ok(rewind_kernels::cuda::nccl::NcclComm::all_gather_f32(self, send, recv)?)
    }

    fn all_gather_u32(&self, send: &CudaView<'_, u32>, recv: &mut CudaViewMut<'_, u32>) -> Result<()> {
        Ok(rewind_kernels::cuda::nccl::NcclComm::all_gather_u32(self, send, recv)?)
    }

    fn is_aborted(&self) -> bool {
        rewind_kernels::cuda::nccl::NcclComm::is_aborted(self)
    }
}

/// The storage type of weights, activations, conv state and KV cache: bf16 (the default: half the traffic, f32
/// accumulation) or f32 (`--dtype f32`: the engine in full f32, for checking it against the CPU reference). SSM states,
/// the residual stream, MoE routers and per-head parameters are f32 in both.
pub trait Act: rewind_kernels::cuda::Elem {
    /// Widens `x` to f32 into `out` (a copy for f32).
    fn to_f32(
        dev: &rewind_kernels::cuda::CudaDevice,
        x: &impl rewind_kernels::cuda::DevicePtr<Self>,
        out: &mut impl rewind_kernels::cuda::DevicePtrMut<f32>,
    ) -> Result<()>;

    /// `out[rows, out_dim] = x · wᵀ` with f32 accumulation.
    #[allow(clippy::too_many_arguments)]
    fn gemm<O: rewind_kernels::cuda::Elem>(
        dev: &rewind_kernels::cuda::CudaDevice,
        blas: &rewind_kernels::cuda::Blas,
        x: &impl rewind_kernels::cuda::DevicePtr<Self>,
        w: &impl rewind_kernels::cuda::DevicePtr<Self>,
        out: &mut impl rewind_kernels::cuda::DevicePtrMut<O>,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
    ) -> Result<()>;
}

impl Act for half::bf16 {
    fn to_f32(
        dev: &rewind_kernels::cuda::CudaDevice,
        x: &impl rewind_kernels::cuda::DevicePtr<Self>,
        out: &mut impl rewind_kernels::cuda::DevicePtrMut<f32>,
    ) -> Result<()> {
        Ok(rewind_kernels::cuda::ops::cast_bf16_to_f32(dev, x, out)?)
    }

    /// One or two rows (a decode at batch 1 or 2) stream the weights through the skinny GEMM of `gemv.cu`, which
    /// keeps more of the memory bandwidth busy than cuBLAS there (`GEMV_FASTER_ROWS`); the rest go to cuBLAS.
    fn gemm<O: rewind_kernels::cuda::Elem>(
        dev: &rewind_kernels::cuda::CudaDevice,
        blas: &rewind_kernels::cuda::Blas,
        x: &impl rewind_kernels::cuda::DevicePtr<Self>,
        w: &impl rewind_kernels::cuda::DevicePtr<Self>,
        out: &mut impl rewind_kernels::cuda::DevicePtrMut<O>,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
    ) -> Result<()> {
        use rewind_kernels::cuda::ops::{gemv_supported, GEMV_FASTER_ROWS};
        if rows <= GEMV_FASTER_ROWS && gemv_supported(dev, x, w, rows, in_dim) {
            return Ok(rewind_kernels::cuda::ops::gemv(dev, x, w, out, rows, in_dim, out_dim)?);
        }
        Ok(blas.linear(x, w, out, rows, in_dim, out_dim)?)
    }
}

impl Act for f32 {
    fn to_f32(
        dev: &rewind_kernels::cuda::CudaDevice,
        x: &impl rewind_kernels::cuda::DevicePtr<Self>,
        out: &mut impl rewind_kernels::cuda::DevicePtrMut<f32>,
    ) -> Result<()> {
        dev.stream()
            .memcpy_dtod(x, out)
            .map_err(|e| crate::EngineError::Gpu(format!("copying activations: {e}")))
    }

    fn gemm<O: rewind_kernels::cuda::Elem>(
        _dev: &rewind_kernels::cuda::CudaDevice,
        blas: &rewind_kernels::cuda::Blas,
        x: &impl rewind_kernels::cuda::DevicePtr<Self>,
        w: &impl rewind_kernels::cuda::DevicePtr<Self>,
        out: &mut impl rewind_kernels::cuda::DevicePtrMut<O>,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
    ) -> Result<()> {
        Ok(blas.linear_f32(x, w, out, rows, in_dim, out_dim)?)
    }
}

/// The device layer the self-test checks directly (op parity against the CPU twins, the NVRTC cache, NCCL): the
/// engine's window onto `rewind_kernels::cuda`, so the binaries reach CUDA only through the engine.
pub mod device {
    pub use rewind_kernels::cuda::nccl::{all_reduce_check, disable_nvls_unless_set};
    pub use rewind_kernels::cuda::parity::{run_all, worse, CaseResult};
    pub use rewind_kernels::cuda::timing::copy_bandwidth;
    pub use rewind_kernels::cuda::{device_count, nvrtc, Blas, CudaDevice};
}
