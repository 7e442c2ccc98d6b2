//! rewind-engine: everything that is neither an actor nor a kernel — model families, checkpoints, tokenizer and chat
//! templates, sampling, and generation.

pub mod checkpoint;
pub mod decode;
pub mod error;
pub mod generate;
pub mod generation_config;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod grammar;
pub mod init;
pub mod model;
pub mod plan;
pub mod presets;
pub mod progress;
pub mod rank;
pub mod sample;
pub mod sched;
pub mod shard;
pub mod spec;
pub mod state;
pub mod tokenizer;
pub mod tools;
pub mod words;

pub use error::{EngineError, Result};
