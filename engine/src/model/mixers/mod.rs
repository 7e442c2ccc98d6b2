//! Sequence mixers: the layers that carry state across tokens.

pub mod mamba2;
