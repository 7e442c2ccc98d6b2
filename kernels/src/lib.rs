//! rewind-kernels: the compute primitives of rewind.
//!
//! `cpu` holds the f32 reference implementation of every op. It is exact and readable on purpose: every other backend
//! (the CUDA kernels) and every other decode form is checked against it. `cuda` (feature `cuda`, on by default; it
//! builds without CUDA installed) holds the GPU twins.
//!
//! Conventions shared by every op: tensors are row-major, contiguous `f32` slices; shapes are passed explicitly and
//! written in the docs as `[rows, cols]`; HF linear weights are `[out, in]`.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

/// Errors raised by kernel entry points that validate their arguments.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A slice did not have the length its shape implies.
    #[error("{op}: `{arg}` has {got} elements, expected {expected}")]
    Shape {
        op: &'static str,
        arg: &'static str,
        got: usize,
        expected: usize,
    },
}
