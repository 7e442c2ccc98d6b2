//! Where a model's weights come from: a [`TensorSource`] hands out named tensors as f32 after checking their shapes.

use std::collections::BTreeMap;

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

/// Test support: a checkpoint held in memory.
#[cfg(test)]
pub(crate) mod test_support {
    use std::collections::HashMap;

    use super::{shape_error, TensorSource};
    use crate::error::{EngineError, Result};

    /// Named tensors in memory (`name → (shape, data)`); `take` removes a tensor, and `finish` reports what is left,
    /// like a checkpoint.
    #[derive(Clone, Default)]
    pub(crate) struct MapSource(pub(crate) HashMap<String, (Vec<usize>, Vec<f32>)>);

    impl MapSource {
        pub(crate) fn put(&mut self, name: &str, shape: &[usize], data: Vec<f32>) {
            assert_eq!(shape.iter().product::<usize>(), data.len(), "{name}");
            self.0.insert(name.to_string(), (shape.to_vec(), data));
        }

        pub(crate) fn get(&self, name: &str) -> &[f32] {
            &self.0[name].1
        }
    }

    impl TensorSource for MapSource {
        fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
            let (found, data) = self.0.remove(name).ok_or_else(|| EngineError::MissingTensor {
                name: name.to_string(),
                expected: shape.to_vec(),
            })?;
            if found != shape {
                return Err(shape_error(name, &found, shape));
            }
            Ok(data)
        }

        fn contains(&self, name: &str) -> bool {
            self.0.contains_key(name)
        }

        fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
            self.0.get(name).map(|(s, _)| s.clone())
        }

        fn finish(&mut self, keep: &[&str], ignore: &[&str]) -> Result<()> {
            let mut left: Vec<&String> = self
                .0
                .keys()
                .filter(|n| !keep.iter().chain(ignore).any(|p| n.starts_with(p)))
                .collect();
            left.sort();
            if left.is_empty() {
                Ok(())
            } else {
                Err(EngineError::UnexpectedTensors(format!("{left:?}")))
            }
        }
    }
}

/// A [`TensorSource`] that records every requested tensor and hands back zeros (allocated lazily by the OS).
#[derive(Default)]
pub struct ShapeRecorder {
    /// Every tensor requested so far, name → shape.
    pub tensors: BTreeMap<String, Vec<usize>>,
}

impl TensorSource for ShapeRecorder {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        if self.tensors.insert(name.to_string(), shape.to_vec()).is_some() {
            return Err(EngineError::Checkpoint(format!("tensor `{name}` requested twice")));
        }
        Ok(vec![0.0; shape.iter().product()])
    }

    fn contains(&self, _name: &str) -> bool {
        false
    }

    fn shape_of(&self, _name: &str) -> Option<Vec<usize>> {
        None
    }

    fn finish(&mut self, _keep: &[&str], _ignore: &[&str]) -> Result<()> {
        Ok(())
    }
}
