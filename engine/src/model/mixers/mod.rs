//! Layer mixers: each loads its weights through a `TensorSource` and runs its forward pass on the CPU.

pub mod attention;
pub mod ffn;
pub mod gdn;
pub mod mamba2;

/// One residual block's mixer.
pub enum Mixer {
    Mamba2(mamba2::Mamba2Mixer),
    Gdn(gdn::GdnMixer),
    Attention(attention::AttentionMixer),
    Mlp(ffn::Mlp),
    Moe(ffn::Moe),
}
