//! Layer mixers: each loads its weights through a `TensorSource` and runs its forward pass on the CPU.

pub mod attention;
pub mod ffn;
pub mod gdn;
pub mod mamba2;
