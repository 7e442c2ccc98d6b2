//! CUDA twins of the CPU ops.
//!
//! Everything here loads CUDA at run time (cudarc's `dynamic-loading`): the crate builds and tests on machines without
//! CUDA, and asking for a device there returns [`CudaError::Unavailable`] instead of failing to link or panicking.
//!
//! - [`device`]: open device N ([`CudaDevice`]), its stream, checked allocation and copies; every kernel module is
//!   compiled when the device opens.
//! - [`nvrtc`]: `.cu` sources (embedded with `include_str!`) compiled by NVRTC for the device's `sm_XY`, with an on-disk
//!   cache keyed by a hash of source, architecture, options and compiler version; a compile error carries NVRTC's log.
//! - [`blas`]: bf16 × bf16 → fp32-accumulated GEMMs in the `x · Wᵀ` shape, through cuBLAS and cuBLASLt.
//! - [`ops`]: launch wrappers for the kernels under `cuda/kernels/`.
//! - [`parity`]: every op against its CPU twin on fresh random inputs (the `rewind selftest` cases).
//! - [`kernel_check`] and [`ptxas`]: every module compiled without a device, with each entry point's registers,
//!   stack and spills (CI and `rewind compile-kernels`).
//! - [`timing`] and [`bench_decode`]: CUDA-event timing, and the SSM decode-kernel sweep of `rewind bench kernels`.
//!
//! Storage follows the design: bf16 weights and activations (or f32, which the parity tests also use to check the
//! kernels' arithmetic tightly), f32 accumulation, f32 recurrent state.

pub mod bench_decode;
pub mod blas;
pub mod device;
pub mod kernel_check;
pub mod nccl;
pub mod nvrtc;
pub mod ops;
pub mod parity;
pub mod ptxas;
pub mod timing;

pub use cudarc::driver::sys::{
    CUgraphInstantiate_flags as GraphInstantiateFlags, CUstreamCaptureMode as GraphCaptureMode,
};
pub use cudarc::driver::{
    CudaGraph, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice,
    ValidAsZeroBits,
};
pub use half::bf16;

pub use blas::Blas;
pub use device::{device_count, CudaDevice, Elem, SharedLimits};

/// Errors of the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable CUDA: the driver or one of the libraries cannot be loaded, or there is no such device.
    #[error("CUDA unavailable: {0}")]
    Unavailable(String),
    /// A driver call failed.
    #[error("CUDA driver error in {context}: {source}")]
    Driver {
        /// What was being done.
        context: String,
        /// The driver's error.
        source: cudarc::driver::DriverError,
    },
    /// NVRTC rejected a kernel source; `log` is the compiler's own output.
    #[error("NVRTC failed to compile {module} for {arch}: {status}\n{log}")]
    Compile {
        /// The kernel module (source file) name.
        module: String,
        /// The target, e.g. `sm_90`.
        arch: String,
        /// NVRTC's status code.
        status: String,
        /// NVRTC's program log.
        log: String,
    },
    /// Any other NVRTC failure (creating the program, reading its output).
    #[error("NVRTC error in {context}: {status}")]
    Nvrtc {
        /// What was being done.
        context: String,
        /// NVRTC's status code.
        status: String,
    },
    /// A cuBLAS or cuBLASLt call failed.
    #[error("cuBLAS error in {context}: {status}")]
    Blas {
        /// What was being done.
        context: String,
        /// The library's status code.
        status: String,
    },
    /// An NCCL call failed.
    #[error("NCCL error in {context}: {status}")]
    Nccl {
        /// What was being done.
        context: String,
        /// NCCL's status code.
        status: String,
    },
    /// An operand does not have the length its shape implies, or a shape is outside what a kernel supports.
    #[error("{op}: {message}")]
    Shape {
        /// The op.
        op: &'static str,
        /// What is wrong.
        message: String,
    },
    /// No kernel of that name was loaded (a wrapper and the `.cu` sources disagree).
    #[error("no CUDA kernel named {0}")]
    MissingKernel(String),
}

/// Result alias of the CUDA backend.
pub type Result<T> = std::result::Result<T, CudaError>;

/// Wraps a driver error with what was being done.
pub(crate) fn driver_err(context: impl Into<String>) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    let context = context.into();
    move |source| CudaError::Driver { context, source }
}

/// Checks that operand `arg` of `op` has `expected` elements.
/// The operands of a linear layer `out[rows, n] = x[rows, k] · w[n, k]ᵀ`, by their lengths.
pub(crate) fn check_linear(op: &'static str, lens: [usize; 3], rows: usize, k: usize, n: usize) -> Result<()> {
    let [x, w, out] = lens;
    check_len(op, "x", x, rows * k)?;
    check_len(op, "w", w, n * k)?;
    check_len(op, "out", out, rows * n)
}

pub(crate) fn check_len(op: &'static str, arg: &str, got: usize, expected: usize) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(CudaError::Shape {
            op,
            message: format!("`{arg}` has {got} elements, expected {expected}"),
        })
    }
}

/// Fails with a shape error unless `cond` holds.
pub(crate) fn ensure(op: &'static str, cond: bool, message: impl FnOnce() -> String) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(CudaError::Shape { op, message: message() })
    }
}
