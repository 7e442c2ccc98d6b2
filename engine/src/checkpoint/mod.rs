//! Hugging Face safetensors checkpoints: loading them as a [`TensorSource`](crate::model::tensors::TensorSource)
//! ([`SafetensorsSource`]) and writing them ([`CheckpointWriter`], [`write_streaming`]).

pub mod quant;
pub mod reader;
pub mod writer;

pub use reader::{SafetensorsSource, INDEX_FILE, SINGLE_FILE};
pub use writer::{write_stored, write_streaming, CheckpointWriter, StoredTensor, WriteDtype};
