//! Models: config parsing per family, layer specs, mixers, and the hybrid model that stacks them.

pub mod config;
pub mod hybrid;
pub mod json;
pub mod mixers;
pub mod spec;
pub mod tensors;

pub use config::{BlockKind, Family, ModelConfig};
pub use hybrid::{Logits, Model, SequenceState};
