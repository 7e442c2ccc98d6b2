//! CPU reference ops (f32).

pub mod act;
pub mod conv;
pub mod gdn;
pub mod gemm;
pub mod norm;
