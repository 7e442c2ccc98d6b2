//! rewind-engine: everything that is neither an actor nor a kernel — model families, checkpoints, tokenizer and chat
//! templates, sampling, and generation.

pub mod error;
pub mod generation_config;
pub mod model;
pub mod sample;
pub mod tokenizer;

pub use error::{EngineError, Result};
