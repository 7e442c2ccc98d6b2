//! A [`TensorSource`] that hands a rank's mixers their slices: each request by local name is cut, by the rank's
//! plan, out of the checkpoint tensor it comes from.

use std::collections::HashMap;

use super::plan::LocalTensor;
use crate::error::{EngineError, Result};
use crate::model::tensors::{shape_error, TensorSource};

/// Wraps a whole-model source for one rank.
///
/// A checkpoint tensor feeding several local tensors (Qwen3-Next's fused `in_proj_qkvz` gives both `in_proj_qkv` and
/// `in_proj_z`) is taken once and kept until its last slice is cut. Names the plan does not list pass through.
/// The whole tensor is read and the slice copied out: the rank holds only its slice once loading returns.
pub struct ShardSource<'a> {
    inner: &'a mut dyn TensorSource,
    planned: HashMap<String, LocalTensor>,
    /// Slices still to cut per checkpoint tensor.
    uses: HashMap<String, usize>,
    cache: HashMap<String, Vec<f32>>,
}

impl<'a> ShardSource<'a> {
    /// A source answering for `tensors` (a rank plan's tensors) out of `inner`.
    pub fn new<'t>(inner: &'a mut dyn TensorSource, tensors: impl IntoIterator<Item = &'t LocalTensor>) -> Self {
        let mut planned = HashMap::new();
        let mut uses = HashMap::new();
        for t in tensors {
            *uses.entry(t.source.clone()).or_insert(0) += 1;
            planned.insert(t.name.clone(), t.clone());
        }
        ShardSource {
            inner,
            planned,
            uses,
            cache: HashMap::new(),
        }
    }
}

impl TensorSource for ShardSource<'_> {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let Some(local) = self.planned.remove(name) else {
            return self.inner.take(name, shape);
        };
        let local_shape = local.local_shape();
        if local_shape != shape {
            return Err(shape_error(name, &local_shape, shape));
        }
        let data = match self.cache.remove(&local.source) {
            Some(d) => d,
            None => self.inner.take(&local.source, &local.source_shape)?,
        };
        let left = self.uses.get_mut(&local.source).map(|u| {
            *u -= 1;
            *u
        });
        if left.unwrap_or(0) > 0 {
            let out = local.apply(&data);
            self.cache.insert(local.source.clone(), data);
            Ok(out)
        } else {
            Ok(local.apply_owned(data))
        }
    }

    fn contains(&self, name: &str) -> bool {
        match self.planned.get(name) {
            Some(t) => self.cache.contains_key(&t.source) || self.inner.contains(&t.source),
            None => self.inner.contains(name),
        }
    }

    fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        match self.planned.get(name) {
            Some(t) => self.contains(name).then(|| t.local_shape()),
            None => self.inner.shape_of(name),
        }
    }

    fn finish(&mut self, keep_prefixes: &[&str], ignore_prefixes: &[&str]) -> Result<()> {
        // A planned slice that no loader asked for means the plan and the mixers disagree.
        let mut unused: Vec<&str> = self
            .planned
            .iter()
            .filter(|(_, t)| self.cache.contains_key(&t.source) || self.inner.contains(&t.source))
            .map(|(n, _)| n.as_str())
            .collect();
        if !unused.is_empty() {
            unused.sort();
            return Err(EngineError::UnexpectedTensors(format!(
                "planned for this rank but never loaded: {unused:?}"
            )));
        }
        self.inner.finish(keep_prefixes, ignore_prefixes)
    }
}
