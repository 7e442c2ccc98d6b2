//! The checkpoint directory as a [`TensorSource`]: which shards to open (single file, index or lone file), checks
//! that the index and the shards agree, and taking each tensor at most once.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use safetensors::tensor::Dtype;

use super::convert::to_f32;
use super::header::{map_file, parse_header, Entry};
use super::{INDEX_FILE, SINGLE_FILE};
use crate::checkpoint::quant::{Method, Quantization};
use crate::error::{EngineError, Result};
use crate::model::tensors::{shape_error, TensorSource};

/// How many leftover names [`EngineError::UnexpectedTensors`] spells out before summarising.
const LIST_MAX: usize = 10;

/// One memory-mapped safetensors file.
#[derive(Debug)]
pub(super) struct Shard {
    pub(super) path: PathBuf,
    pub(super) mmap: Mmap,
}

/// A safetensors checkpoint directory opened for loading.
///
/// Every shard is memory-mapped once; tensors are converted to f32 only when taken, so peak memory is the converted
/// model plus whatever pages the OS keeps cached.
#[derive(Debug)]
pub struct SafetensorsSource {
    dir: PathBuf,
    pub(super) shards: Vec<Shard>,
    pub(super) entries: BTreeMap<String, Entry>,
    pub(super) taken: HashSet<String>,
    kept: Vec<String>,
    /// How the checkpoint's quantized weights are stored (from its configuration), if it has any.
    pub(super) quant: Option<Quantization>,
}

impl SafetensorsSource {
    /// Opens the checkpoint in `dir`.
    ///
    /// Looks, in the order transformers does, for `model.safetensors`, then `model.safetensors.index.json` (sharded),
    /// then a lone `*.safetensors` file. Several `*.safetensors` files without an index are ambiguous and an error.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join(SINGLE_FILE);
        let index = dir.join(INDEX_FILE);
        if single.is_file() {
            return Self::from_files(dir, vec![single], None);
        }
        if index.is_file() {
            return Self::open_index(dir, &index);
        }
        let listing = std::fs::read_dir(dir).map_err(|e| EngineError::io(dir, e))?;
        let mut found = Vec::new();
        for entry in listing {
            let path = entry.map_err(|e| EngineError::io(dir, e))?.path();
            if path.is_file() && path.extension().is_some_and(|x| x == "safetensors") {
                found.push(path);
            }
        }
        found.sort();
        match found.len() {
            0 => Err(EngineError::Checkpoint(format!(
                "no model weights in {}: expected {SINGLE_FILE}, {INDEX_FILE} or a single *.safetensors file",
                dir.display()
            ))),
            1 => Self::from_files(dir, found, None),
            _ => Err(EngineError::Checkpoint(format!(
                "{} holds {} *.safetensors files ({}) but no {INDEX_FILE} saying which tensor is where",
                dir.display(),
                found.len(),
                found.iter().map(|p| file_name(p)).collect::<Vec<_>>().join(", ")
            ))),
        }
    }

    /// Opens one safetensors file on its own (its directory's configuration still says how it is quantized).
    pub fn open_file(path: &Path) -> Result<Self> {
        let dir = path.parent().unwrap_or(Path::new("."));
        Self::from_files(dir, vec![path.to_path_buf()], None)
    }

    /// Opens a sharded checkpoint through its index's `weight_map`.
    fn open_index(dir: &Path, index: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(index).map_err(|e| EngineError::io(index, e))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| EngineError::Json {
            path: index.to_path_buf(),
            message: e.to_string(),
        })?;
        let bad = |message: String| EngineError::Checkpoint(format!("{}: {message}", index.display()));
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("no `weight_map` object".to_string()))?;
        let mut weight_map = BTreeMap::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| bad(format!("`weight_map` entry for tensor `{name}` is not a file name")))?;
            // The index is input: a shard name must not reach outside the checkpoint directory.
            if file.is_empty() || file.contains('/') || file.contains('\\') || file == "." || file == ".." {
                return Err(bad(format!(
                    "tensor `{name}` maps to `{file}`, which is not a plain file name"
                )));
            }
            weight_map.insert(name.clone(), file.to_string());
        }
        let files: BTreeSet<&String> = weight_map.values().collect();
        let mut paths = Vec::with_capacity(files.len());
        for file in files {
            let path = dir.join(file);
            if !path.is_file() {
                let tensor = weight_map
                    .iter()
                    .find(|(_, f)| *f == file)
                    .map_or("", |(n, _)| n.as_str());
                return Err(bad(format!(
                    "shard {} (holding tensor `{tensor}`) does not exist",
                    path.display()
                )));
            }
            paths.push(path);
        }
        Self::from_files(dir, paths, Some((index, &weight_map)))
    }

    /// Maps and parses `paths`; with an index, checks that each tensor it lists is in the shard it names.
    fn from_files(dir: &Path, paths: Vec<PathBuf>, index: Option<(&Path, &BTreeMap<String, String>)>) -> Result<Self> {
        let mut shards: Vec<Shard> = Vec::with_capacity(paths.len());
        let mut entries: BTreeMap<String, Entry> = BTreeMap::new();
        for (i, path) in paths.into_iter().enumerate() {
            let mmap = map_file(&path)?;
            for (name, entry) in parse_header(&path, &mmap, i)? {
                if let Some(prev) = entries.get(&name) {
                    // Names are unique within a file, so the earlier copy is in an earlier, already pushed shard.
                    return Err(EngineError::Checkpoint(format!(
                        "tensor `{name}` is stored twice, in {} and {}",
                        shards[prev.shard].path.display(),
                        path.display()
                    )));
                }
                entries.insert(name, entry);
            }
            shards.push(Shard { path, mmap });
        }
        if let Some((index_path, weight_map)) = index {
            for (name, file) in weight_map {
                let here = entries.get(name).map(|e| &shards[e.shard].path);
                if here.is_none_or(|p| p.file_name().is_none_or(|f| f != file.as_str())) {
                    return Err(EngineError::Checkpoint(format!(
                        "{} lists tensor `{name}` in shard {}, but that shard does not hold it",
                        index_path.display(),
                        dir.join(file).display()
                    )));
                }
            }
        }
        Ok(SafetensorsSource {
            dir: dir.to_path_buf(),
            shards,
            entries,
            taken: HashSet::new(),
            kept: Vec::new(),
            quant: Quantization::read(dir)?,
        })
    }

    /// The checkpoint directory this source was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every tensor name in the checkpoint, taken or not, sorted.
    pub fn names(&self) -> Vec<String> {
        self.entries.keys().cloned().collect()
    }

    /// The stored dtype of `name` as safetensors spells it (`"BF16"`, `"F32"`, ...), if the tensor exists.
    pub fn dtype_of(&self, name: &str) -> Option<String> {
        self.entries.get(name).map(|e| e.dtype.to_string())
    }

    /// Tensors that [`TensorSource::finish`] left untaken because they match a keep prefix (e.g. `mtp.`), sorted.
    /// They can still be taken afterwards.
    pub fn kept(&self) -> Vec<String> {
        self.kept.iter().filter(|n| !self.taken.contains(*n)).cloned().collect()
    }

    /// The checkpoint's quantization, if its configuration declares one.
    pub fn quantization(&self) -> Option<&Quantization> {
        self.quant.as_ref()
    }

    /// Whether `entry` holds a quantized weight to dequantize (rather than a float tensor to widen).
    fn is_quantized(&self, entry: &Entry) -> bool {
        match entry.dtype {
            Dtype::F8_E4M3 => true,
            Dtype::U8 => self
                .quant
                .as_ref()
                .is_some_and(|q| matches!(q.method, Method::Nvfp4 { .. })),
            _ => false,
        }
    }

    fn untaken(&self, name: &str) -> Option<&Entry> {
        self.entries.get(name).filter(|_| !self.taken.contains(name))
    }
}

impl TensorSource for SafetensorsSource {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let Some(entry) = self.entries.get(name) else {
            return Err(EngineError::MissingTensor {
                name: name.to_string(),
                expected: shape.to_vec(),
            });
        };
        if self.taken.contains(name) {
            return Err(EngineError::Checkpoint(format!("tensor `{name}` was taken twice")));
        }
        if self.is_quantized(entry) {
            let data = self.dequantize(name, shape)?;
            self.taken.insert(name.to_string());
            return Ok(data);
        }
        if entry.shape != shape {
            return Err(shape_error(name, &entry.shape, shape));
        }
        let shard = &self.shards[entry.shard];
        let bytes = &shard.mmap[entry.start..entry.end];
        let data = to_f32(bytes, entry.dtype).ok_or_else(|| {
            EngineError::Checkpoint(format!(
                "tensor `{name}` in {} has dtype {}, which rewind cannot load (supported: BF16, F16, F32, F64, and the \
                 quantized weights of an fp8 or ModelOpt checkpoint)",
                shard.path.display(),
                entry.dtype
            ))
        })?;
        self.taken.insert(name.to_string());
        Ok(data)
    }

    fn contains(&self, name: &str) -> bool {
        self.untaken(name).is_some()
    }

    fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        self.untaken(name).map(|e| self.logical_shape(e))
    }

    fn finish(&mut self, keep_prefixes: &[&str], ignore_prefixes: &[&str]) -> Result<()> {
        let mut kept = Vec::new();
        let mut left = Vec::new();
        for name in self.entries.keys().filter(|n| !self.taken.contains(*n)) {
            if keep_prefixes.iter().any(|p| name.starts_with(p)) {
                kept.push(name.clone());
            } else if !ignore_prefixes.iter().any(|p| name.starts_with(p))
                && !self.quant.as_ref().is_some_and(|q| q.sets_aside(name))
            {
                left.push(name.as_str());
            }
        }
        if !left.is_empty() {
            let mut message = format!(
                "{} tensor(s) in {}: {}",
                left.len(),
                self.dir.display(),
                left.iter()
                    .take(LIST_MAX)
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            if left.len() > LIST_MAX {
                message.push_str(&format!(" and {} more", left.len() - LIST_MAX));
            }
            return Err(EngineError::UnexpectedTensors(message));
        }
        self.kept = kept;
        Ok(())
    }
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map_or_else(|| path.display().to_string(), |f| f.to_string_lossy().into_owned())
}
