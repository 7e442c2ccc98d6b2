//! Models: config parsing per family, layer specs, mixers, and the hybrid model that stacks them.

pub mod spec;
pub mod tensors;
