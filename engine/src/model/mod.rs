//! Models: config parsing per family, layer specs and mixers. The model that stacks them is the tensor-parallel
//! [`crate::shard::ShardedModel`] (one rank for an unsharded model), run by [`crate::decode::Decoder`].

pub mod config;
pub mod json;
pub mod mixers;
pub mod mtp;
pub mod spec;
pub mod tensors;

pub use config::{BlockKind, Family, ModelConfig};
pub use mixers::Mixer;
