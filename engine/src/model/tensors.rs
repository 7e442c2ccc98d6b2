//! Where a model's weights come from: a [`TensorSource`] hands out named tensors as f32 after checking their shapes.

use crate::error::{EngineError, Result};

/// A source of named weight tensors (a safetensors checkpoint, or the random initialiser of `init-model`).
///
/// Every tensor is taken at most once; after loading, the source reports names that were never taken
/// (see [`TensorSource::finish`]), so a checkpoint with unexpected tensors is an error rather than silently ignored.
pub trait TensorSource {
    /// Takes tensor `name`, checks that its shape equals `shape` and returns its elements as f32, row-major.
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>>;

    /// Whether a tensor called `name` exists (and has not been taken yet).
    fn contains(&self, name: &str) -> bool;

    /// The shape of tensor `name`, if present. Used where a checkpoint may store one of several layouts.
    fn shape_of(&self, name: &str) -> Option<Vec<usize>>;

    /// Ends loading: fails with [`EngineError::UnexpectedTensors`] if a tensor was not taken and does not start with
    /// one of `keep_prefixes` (e.g. `mtp.` tensors kept for the MTP drafter) or `ignore_prefixes` (e.g. a vision tower).
    fn finish(&mut self, keep_prefixes: &[&str], ignore_prefixes: &[&str]) -> Result<()>;
}

/// Takes `name` if present, `None` otherwise.
pub fn take_opt(src: &mut dyn TensorSource, name: &str, shape: &[usize]) -> Result<Option<Vec<f32>>> {
    if src.contains(name) {
        src.take(name, shape).map(Some)
    } else {
        Ok(None)
    }
}

/// Builds the error for a tensor whose shape does not match.
pub fn shape_error(name: &str, found: &[usize], expected: &[usize]) -> EngineError {
    EngineError::TensorShape {
        name: name.to_string(),
        found: found.to_vec(),
        expected: expected.to_vec(),
    }
}
