//! [`SafetensorsSource`]: a [`TensorSource`](crate::model::tensors::TensorSource) over a Hugging Face safetensors
//! checkpoint (one file or index + shards), memory-mapped, converting each tensor to f32 when it is taken.
//!
//! `source.rs` finds the shards (single file, index or lone file) and hands tensors out once each; `header.rs` maps a
//! shard and parses its header into byte ranges; `convert.rs` widens the stored dtypes to f32; `quantized.rs` checks a
//! quantized weight's scales and dequantizes it (`crate::checkpoint::quant`).

mod convert;
mod header;
mod quantized;
mod source;
#[cfg(test)]
mod tests;

pub use source::SafetensorsSource;

/// File name of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of the index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
