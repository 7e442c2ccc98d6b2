//! Sequence mixers: the per-layer token-mixing blocks (Mamba-2, Gated DeltaNet, attention).

pub mod gdn;
