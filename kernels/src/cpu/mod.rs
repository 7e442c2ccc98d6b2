//! CPU reference ops (f32).

pub mod accept;
pub mod act;
pub mod attention;
pub mod chain;
pub mod conv;
pub mod gdn;
pub mod gemm;
pub mod gemv_quant;
pub mod lm_head;
pub mod mamba2;
pub mod moe;
pub mod norm;
pub mod quant;
pub mod replay_gdn;
pub mod replay_mamba2;
pub mod ring;
pub mod rope;
pub mod sample;
pub mod traffic;
