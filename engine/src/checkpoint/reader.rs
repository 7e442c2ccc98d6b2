//! [`SafetensorsSource`]: a [`TensorSource`] over a Hugging Face safetensors checkpoint (one file or index + shards),
//! memory-mapped, converting each tensor to f32 when it is taken.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::tensor::{Dtype, SafeTensorError};
use safetensors::SafeTensors;

use crate::error::{EngineError, Result};
use crate::model::tensors::{shape_error, TensorSource};

/// File name of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of the index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Elements converted per parallel chunk: large enough to amortise rayon's scheduling, small enough to balance.
const CHUNK: usize = 1 << 16;
/// Tensors below this many elements are converted on the calling thread.
const PARALLEL_MIN: usize = 1 << 18;
/// How many leftover names [`EngineError::UnexpectedTensors`] spells out before summarising.
const LIST_MAX: usize = 10;

/// One memory-mapped safetensors file.
#[derive(Debug)]
struct Shard {
    path: PathBuf,
    mmap: Mmap,
}

/// Where one tensor lives: its shard and the absolute byte range in that shard's mapping.
#[derive(Debug)]
struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// A safetensors checkpoint directory opened for loading.
///
/// Every shard is memory-mapped once; tensors are converted to f32 only when taken, so peak memory is the converted
/// model plus whatever pages the OS keeps cached.
#[derive(Debug)]
pub struct SafetensorsSource {
    dir: PathBuf,
    shards: Vec<Shard>,
    entries: BTreeMap<String, Entry>,
    taken: HashSet<String>,
    kept: Vec<String>,
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
        if entry.shape != shape {
            return Err(shape_error(name, &entry.shape, shape));
        }
        let shard = &self.shards[entry.shard];
        let bytes = &shard.mmap[entry.start..entry.end];
        let data = to_f32(bytes, entry.dtype).ok_or_else(|| {
            EngineError::Checkpoint(format!(
                "tensor `{name}` in {} has dtype {}, which rewind cannot load (supported: BF16, F16, F32, F64)",
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
        self.untaken(name).map(|e| e.shape.clone())
    }

    fn finish(&mut self, keep_prefixes: &[&str], ignore_prefixes: &[&str]) -> Result<()> {
        let mut kept = Vec::new();
        let mut left = Vec::new();
        for name in self.entries.keys().filter(|n| !self.taken.contains(*n)) {
            if keep_prefixes.iter().any(|p| name.starts_with(p)) {
                kept.push(name.clone());
            } else if !ignore_prefixes.iter().any(|p| name.starts_with(p)) {
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

fn map_file(path: &Path) -> Result<Mmap> {
    let file = File::open(path).map_err(|e| EngineError::io(path, e))?;
    let len = file.metadata().map_err(|e| EngineError::io(path, e))?.len();
    if len < 8 {
        return Err(EngineError::Checkpoint(format!(
            "{}: file is {len} bytes, too short to hold a safetensors header",
            path.display()
        )));
    }
    // SAFETY: the mapping is read-only. Like every mmap-based loader (transformers, candle), this assumes nobody
    // truncates or rewrites the checkpoint while it is open; doing so is outside what rewind can defend against.
    unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(path, e))
}

/// Parses a shard's header into entries with absolute byte ranges, turning every malformation into an error that
/// names the file.
fn parse_header(path: &Path, buf: &[u8], shard: usize) -> Result<Vec<(String, Entry)>> {
    let (n, metadata) = SafeTensors::read_metadata(buf).map_err(|e| header_error(path, buf, e))?;
    let base = 8 + n;
    Ok(metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| {
            let entry = Entry {
                shard,
                dtype: info.dtype,
                shape: info.shape.clone(),
                start: base + info.data_offsets.0,
                end: base + info.data_offsets.1,
            };
            (name, entry)
        })
        .collect())
}

fn header_error(path: &Path, buf: &[u8], e: SafeTensorError) -> EngineError {
    let declared = buf
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes);
    let what = match e {
        SafeTensorError::InvalidHeaderLength | SafeTensorError::HeaderTooLarge => format!(
            "header declares {declared} bytes but only {} follow its 8-byte length (truncated, or not a safetensors file)",
            buf.len().saturating_sub(8)
        ),
        SafeTensorError::MetadataIncompleteBuffer => format!(
            "the header's tensors do not cover the {} data bytes exactly (file truncated or corrupt)",
            (buf.len() as u64).saturating_sub(8 + declared)
        ),
        other => format!("malformed safetensors header: {other}"),
    };
    EngineError::Checkpoint(format!("{}: {what}", path.display()))
}

/// Converts little-endian `bytes` of `dtype` to f32; `None` for a dtype rewind does not load.
fn to_f32(bytes: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
    let width = match dtype {
        Dtype::BF16 | Dtype::F16 => 2,
        Dtype::F32 => 4,
        Dtype::F64 => 8,
        _ => return None,
    };
    let n = bytes.len() / width;
    let mut out = vec![0f32; n];
    let convert = |(dst, src): (&mut [f32], &[u8])| match dtype {
        Dtype::BF16 => bf16_to_f32(src, dst),
        Dtype::F16 => f16_to_f32(src, dst),
        Dtype::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        _ => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(8)) {
                *d = f64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]) as f32;
            }
        }
    };
    if n >= PARALLEL_MIN {
        out.par_chunks_mut(CHUNK)
            .zip(bytes.par_chunks(CHUNK * width))
            .for_each(convert);
    } else {
        out.chunks_mut(CHUNK).zip(bytes.chunks(CHUNK * width)).for_each(convert);
    }
    Some(out)
}

/// bf16 is the top half of an f32, so widening is exact and a shift (which the compiler vectorises).
fn bf16_to_f32(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f32::from_bits(u32::from(u16::from_le_bytes([s[0], s[1]])) << 16);
    }
}

/// f16 goes through `half`'s slice conversion (F16C / NEON when available) via an aligned bounce buffer, since the
/// mapped bytes carry no alignment guarantee.
fn f16_to_f32(src: &[u8], dst: &mut [f32]) {
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    let mut bits = [0u16; 1024];
    for (d, s) in dst.chunks_mut(bits.len()).zip(src.chunks(bits.len() * 2)) {
        let bits = &mut bits[..d.len()];
        for (b, s) in bits.iter_mut().zip(s.chunks_exact(2)) {
            *b = u16::from_le_bytes([s[0], s[1]]);
        }
        let halves: &[half::f16] = bits.reinterpret_cast();
        halves.convert_to_f32_slice(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{CheckpointWriter, WriteDtype};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use safetensors::tensor::TensorView;

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect()
    }

    /// Writes raw tensors with the safetensors crate itself, for dtypes and layouts our writer never produces.
    fn write_raw(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(&str, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (*n, TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    /// A small f32 checkpoint: `a` [2, 3], `b` [4], `mtp.x` [2], `vision.y` [3].
    fn small(dir: &Path) -> Vec<Vec<f32>> {
        let mut w = CheckpointWriter::new();
        let data = vec![random(6, 1), random(4, 2), random(2, 3), random(3, 4)];
        for ((name, shape), d) in [
            ("a", vec![2, 3]),
            ("b", vec![4]),
            ("mtp.x", vec![2]),
            ("vision.y", vec![3]),
        ]
        .into_iter()
        .zip(&data)
        {
            w.add(name, shape, d.clone()).unwrap();
        }
        w.write(dir, WriteDtype::F32, None).unwrap();
        data
    }

    fn message(r: Result<impl std::fmt::Debug>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn names_dtypes_contains_and_take_once() {
        let dir = tempfile::tempdir().unwrap();
        let data = small(dir.path());
        let mut src = SafetensorsSource::open(dir.path()).unwrap();
        assert_eq!(src.names(), ["a", "b", "mtp.x", "vision.y"]);
        assert_eq!(src.dtype_of("a").as_deref(), Some("F32"));
        assert_eq!(src.dtype_of("nope"), None);
        assert!(src.contains("a"));
        assert_eq!(src.shape_of("a"), Some(vec![2, 3]));
        assert_eq!(src.take("a", &[2, 3]).unwrap(), data[0]);
        assert!(!src.contains("a"));
        assert_eq!(src.shape_of("a"), None);
        let twice = message(src.take("a", &[2, 3]));
        assert!(twice.contains("`a`") && twice.contains("twice"), "{twice}");
    }

    #[test]
    fn missing_and_wrong_shape() {
        let dir = tempfile::tempdir().unwrap();
        small(dir.path());
        let mut src = SafetensorsSource::open(dir.path()).unwrap();
        let missing = src.take("model.layers.0.w", &[5]).unwrap_err();
        assert!(matches!(missing, EngineError::MissingTensor { .. }));
        assert!(missing.to_string().contains("model.layers.0.w"), "{missing}");
        let shape = src.take("a", &[3, 2]).unwrap_err();
        assert!(matches!(shape, EngineError::TensorShape { .. }));
        let text = shape.to_string();
        assert!(
            text.contains("`a`") && text.contains("[2, 3]") && text.contains("[3, 2]"),
            "{text}"
        );
        // A failed take leaves the tensor available.
        assert!(src.contains("a"));
    }

    #[test]
    fn finish_reports_unexpected_keeps_and_ignores() {
        let dir = tempfile::tempdir().unwrap();
        let data = small(dir.path());
        let mut src = SafetensorsSource::open(dir.path()).unwrap();
        src.take("a", &[2, 3]).unwrap();
        let err = src.finish(&["mtp."], &["vision."]).unwrap_err();
        assert!(matches!(err, EngineError::UnexpectedTensors(_)));
        let text = err.to_string();
        assert!(
            text.contains("`b`") && !text.contains("mtp.x") && !text.contains("vision.y"),
            "{text}"
        );
        src.take("b", &[4]).unwrap();
        src.finish(&["mtp."], &["vision."]).unwrap();
        assert_eq!(src.kept(), ["mtp.x"]);
        assert_eq!(src.take("mtp.x", &[2]).unwrap(), data[2]);
        assert!(src.kept().is_empty());
    }

    #[test]
    fn unexpected_list_is_capped() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = CheckpointWriter::new();
        for i in 0..15 {
            w.add(&format!("extra.{i:02}"), vec![1], random(1, i)).unwrap();
        }
        w.write(dir.path(), WriteDtype::F32, None).unwrap();
        let mut src = SafetensorsSource::open(dir.path()).unwrap();
        let text = src.finish(&[], &[]).unwrap_err().to_string();
        assert!(text.contains("15 tensor(s)") && text.contains("`extra.09`"), "{text}");
        assert!(!text.contains("extra.10") && text.contains("and 5 more"), "{text}");
    }

    #[test]
    fn f16_f64_and_large_bf16_sources() {
        let dir = tempfile::tempdir().unwrap();
        let h = random(1000, 5);
        let d = random(7, 6);
        // Above PARALLEL_MIN and not a multiple of CHUNK, to cover the parallel path and the ragged last chunk.
        let n = PARALLEL_MIN + 12_345;
        let b = random(n, 7);
        let f16_bytes: Vec<u8> = h.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect();
        let f64_bytes: Vec<u8> = d.iter().flat_map(|&x| f64::from(x).to_le_bytes()).collect();
        let bf16_bytes: Vec<u8> = b.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect();
        write_raw(
            &dir.path().join("weights.safetensors"),
            &[
                ("h", Dtype::F16, vec![10, 100], f16_bytes),
                ("d", Dtype::F64, vec![7], f64_bytes),
                ("b", Dtype::BF16, vec![n], bf16_bytes),
            ],
        );
        // A lone *.safetensors file with another name is accepted.
        let mut src = SafetensorsSource::open(dir.path()).unwrap();
        assert_eq!(src.dtype_of("h").as_deref(), Some("F16"));
        let got = src.take("h", &[10, 100]).unwrap();
        for (g, x) in got.iter().zip(&h) {
            assert_eq!(*g, half::f16::from_f32(*x).to_f32());
        }
        assert_eq!(src.take("d", &[7]).unwrap(), d);
        let got = src.take("b", &[n]).unwrap();
        assert_eq!(got.len(), n);
        for (g, x) in got.iter().zip(&b) {
            assert_eq!(*g, half::bf16::from_f32(*x).to_f32());
        }
    }

    #[test]
    fn unsupported_dtype_names_tensor_and_dtype() {
        let dir = tempfile::tempdir().unwrap();
        write_raw(
            &dir.path().join(SINGLE_FILE),
            &[("q.weight", Dtype::I8, vec![2, 2], vec![1, 255, 3, 4])],
        );
        let mut src = SafetensorsSource::open(dir.path()).unwrap();
        let text = message(src.take("q.weight", &[2, 2]));
        assert!(text.contains("`q.weight`") && text.contains("I8"), "{text}");
    }

    #[test]
    fn truncated_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        small(dir.path());
        let path = dir.path().join(SINGLE_FILE);
        let len = std::fs::metadata(&path).unwrap().len();
        // Cut inside the data, inside the header, and before the header length.
        for keep in [len - 3, 40, 5] {
            let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            file.set_len(keep).unwrap();
            drop(file);
            let text = message(SafetensorsSource::open(dir.path()));
            assert!(text.contains(SINGLE_FILE), "{keep}: {text}");
        }
    }

    #[test]
    fn garbage_header_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SINGLE_FILE);
        let mut bytes = 16u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{not json at all");
        std::fs::write(&path, &bytes).unwrap();
        let text = message(SafetensorsSource::open(dir.path()));
        assert!(text.contains(SINGLE_FILE) && text.contains("header"), "{text}");
        // Offsets pointing past the data.
        let header = br#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        bytes.extend_from_slice(&[0u8; 8]);
        std::fs::write(&path, &bytes).unwrap();
        let text = message(SafetensorsSource::open(dir.path()));
        assert!(text.contains(SINGLE_FILE), "{text}");
    }

    #[test]
    fn index_errors_name_tensor_and_shard() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = CheckpointWriter::new();
        w.add("a", vec![8], random(8, 1)).unwrap();
        w.add("b", vec![8], random(8, 2)).unwrap();
        w.write(dir.path(), WriteDtype::F32, Some(40)).unwrap();
        let index = dir.path().join(INDEX_FILE);
        let text = std::fs::read_to_string(&index).unwrap();
        assert!(SafetensorsSource::open(dir.path()).is_ok());

        let moved = text.replace(
            "\"b\": \"model-00002-of-00002.safetensors\"",
            "\"b\": \"model-00001-of-00002.safetensors\"",
        );
        assert_ne!(moved, text);
        std::fs::write(&index, &moved).unwrap();
        let err = message(SafetensorsSource::open(dir.path()));
        assert!(
            err.contains("`b`") && err.contains("model-00001-of-00002.safetensors"),
            "{err}"
        );

        let gone = text.replace("model-00002-of-00002", "model-00003-of-00003");
        std::fs::write(&index, &gone).unwrap();
        let err = message(SafetensorsSource::open(dir.path()));
        assert!(
            err.contains("`b`") && err.contains("model-00003-of-00003.safetensors"),
            "{err}"
        );

        std::fs::write(&index, text.replace("model-00002-of-00002", "../elsewhere")).unwrap();
        let err = message(SafetensorsSource::open(dir.path()));
        assert!(err.contains("`b`") && err.contains("../elsewhere"), "{err}");

        std::fs::write(&index, "{\"weight_map\": ").unwrap();
        let err = message(SafetensorsSource::open(dir.path()));
        assert!(err.contains(INDEX_FILE), "{err}");
    }

    #[test]
    fn tensor_in_two_shards_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let bytes: Vec<u8> = random(2, 1).iter().flat_map(|x| x.to_le_bytes()).collect();
        write_raw(
            &dir.path().join("s1.safetensors"),
            &[("w", Dtype::F32, vec![2], bytes.clone())],
        );
        write_raw(&dir.path().join("s2.safetensors"), &[("w", Dtype::F32, vec![2], bytes)]);
        let index = r#"{"weight_map": {"w": "s1.safetensors", "v": "s2.safetensors"}}"#;
        std::fs::write(dir.path().join(INDEX_FILE), index).unwrap();
        let err = message(SafetensorsSource::open(dir.path()));
        assert!(
            err.contains("`w`") && err.contains("s1.safetensors") && err.contains("s2.safetensors"),
            "{err}"
        );
    }

    #[test]
    fn directory_without_or_with_ambiguous_weights() {
        let dir = tempfile::tempdir().unwrap();
        let err = message(SafetensorsSource::open(dir.path()));
        assert!(
            err.contains(&dir.path().display().to_string()) && err.contains("no model weights"),
            "{err}"
        );
        let bytes: Vec<u8> = random(2, 1).iter().flat_map(|x| x.to_le_bytes()).collect();
        write_raw(
            &dir.path().join("x.safetensors"),
            &[("w", Dtype::F32, vec![2], bytes.clone())],
        );
        write_raw(&dir.path().join("y.safetensors"), &[("w", Dtype::F32, vec![2], bytes)]);
        let err = message(SafetensorsSource::open(dir.path()));
        assert!(err.contains("x.safetensors") && err.contains("y.safetensors"), "{err}");
        let err = message(SafetensorsSource::open(&dir.path().join("absent")));
        assert!(err.contains("absent"), "{err}");
    }
}
