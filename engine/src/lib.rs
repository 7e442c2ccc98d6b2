//! rewind-engine: everything that is neither an actor nor a kernel — model families, checkpoints, tokenizer and chat
//! templates, sampling, and generation.

pub mod checkpoint;
pub mod error;
pub mod model;

pub use error::{EngineError, Result};
