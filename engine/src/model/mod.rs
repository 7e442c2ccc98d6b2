//! Models: config parsing per family, layer specs, mixers, and the hybrid model that stacks them.

pub mod mixers;
pub mod spec;
pub mod tensors;
