//! CPU reference ops (f32).

pub mod act;
pub mod conv;
pub mod gemm;
pub mod mamba2;
pub mod norm;
