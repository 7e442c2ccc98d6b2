//! Writing f32 tensors as a Hugging Face safetensors checkpoint: one `model.safetensors`, or
//! `model-0000k-of-0000N.safetensors` shards plus `model.safetensors.index.json`.
//!
//! Shards are streamed to disk (header, then each tensor converted on its own), so writing never holds a second copy
//! of the model; [`write_streaming`] goes further and asks the caller for each tensor only when it is written.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use safetensors::tensor::{Dtype, Metadata, TensorInfo};

use super::reader::{INDEX_FILE, SINGLE_FILE};
use crate::error::{EngineError, Result};

/// Elements converted per write call.
const CHUNK: usize = 1 << 16;

/// The dtype tensors are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteDtype {
    /// Exact.
    F32,
    /// Rounded to nearest-even bf16, as `tensor.to(torch.bfloat16)` does.
    BF16,
}

impl WriteDtype {
    fn dtype(self) -> Dtype {
        match self {
            WriteDtype::F32 => Dtype::F32,
            WriteDtype::BF16 => Dtype::BF16,
        }
    }
}

/// A named f32 tensor waiting to be written.
#[derive(Debug)]
struct Pending {
    name: String,
    shape: Vec<usize>,
    data: Vec<f32>,
}

/// Accumulates named f32 tensors, then writes them as a safetensors checkpoint (see [`CheckpointWriter::write`]).
///
/// Tensors are written in the order they were added, which also decides how they are split across shards.
#[derive(Debug, Default)]
pub struct CheckpointWriter {
    tensors: Vec<Pending>,
    names: HashSet<String>,
}

impl CheckpointWriter {
    /// An empty writer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds tensor `name` of `shape` with row-major `data`. Fails on a duplicate name or if `data` does not have
    /// exactly as many elements as `shape` implies.
    pub fn add(&mut self, name: &str, shape: Vec<usize>, data: Vec<f32>) -> Result<()> {
        if self.names.contains(name) {
            return Err(EngineError::Checkpoint(format!(
                "tensor `{name}` added twice to the checkpoint writer"
            )));
        }
        let n = element_count(name, &shape)?;
        if n != data.len() as u64 {
            return Err(EngineError::Checkpoint(format!(
                "tensor `{name}`: shape {shape:?} has {n} elements but {} values were given",
                data.len()
            )));
        }
        self.names.insert(name.to_string());
        self.tensors.push(Pending {
            name: name.to_string(),
            shape,
            data,
        });
        Ok(())
    }

    /// Number of tensors added.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether no tensor was added.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Writes every tensor into `dir` (created if needed) as `dtype`.
    ///
    /// With `max_shard_bytes` = `None`, or when all tensor bytes fit in it, the result is one `model.safetensors`;
    /// otherwise shards of at most that many tensor bytes (a larger tensor gets a shard of its own) plus
    /// `model.safetensors.index.json`. Checkpoint files from an earlier write into `dir` that the new layout does not
    /// use are removed, so the directory never holds two conflicting checkpoints.
    pub fn write(&self, dir: &Path, dtype: WriteDtype, max_shard_bytes: Option<u64>) -> Result<()> {
        let specs: Vec<Spec> = self
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone(), dtype.dtype()))
            .collect();
        write_planned(dir, max_shard_bytes, &specs, &mut |i, sink| {
            sink(Payload::Values(&self.tensors[i].data))
        })
    }
}

/// Writes a checkpoint like [`CheckpointWriter::write`] without holding the tensors: shards are planned from the names
/// and shapes in `specs` (written in that order), and `fill(name, buffer)` is called once per tensor, just before it
/// is written, to fill a zeroed buffer of exactly that tensor's element count. An error from `fill` aborts the write.
pub fn write_streaming(
    dir: &Path,
    dtype: WriteDtype,
    max_shard_bytes: Option<u64>,
    specs: &[(String, Vec<usize>)],
    mut fill: impl FnMut(&str, &mut [f32]) -> Result<()>,
) -> Result<()> {
    let mut buffer = Vec::new();
    let stored: Vec<Spec> = specs
        .iter()
        .map(|(n, s)| (n.clone(), s.clone(), dtype.dtype()))
        .collect();
    write_planned(dir, max_shard_bytes, &stored, &mut |i, sink| {
        let (name, shape) = &specs[i];
        buffer.clear();
        buffer.resize(shape.iter().product(), 0.0);
        fill(name, &mut buffer)?;
        sink(Payload::Values(&buffer))
    })
}

/// A tensor already in its stored form: its dtype (any safetensors dtype, e.g. `F8_E4M3` or packed `U8`), its shape
/// as stored, and its little-endian bytes. What [`write_stored`] writes.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// Writes tensors already in their stored form (a quantized checkpoint: FP8 or packed FP4 weights beside their f32
/// scales), laid out in shards exactly as [`CheckpointWriter::write`] lays out float tensors.
pub fn write_stored(dir: &Path, max_shard_bytes: Option<u64>, tensors: &[StoredTensor]) -> Result<()> {
    let specs: Vec<Spec> = tensors
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone(), t.dtype))
        .collect();
    write_planned(dir, max_shard_bytes, &specs, &mut |i, sink| {
        sink(Payload::Bytes(&tensors[i].bytes))
    })
}

/// A tensor to write: name, stored shape, stored dtype.
type Spec = (String, Vec<usize>, Dtype);

/// One tensor's data as handed to the writer: f32 values converted to its (float) dtype, or its stored bytes.
enum Payload<'a> {
    Values(&'a [f32]),
    Bytes(&'a [u8]),
}

/// Receives one tensor's data and writes it.
type Sink<'a> = dyn FnMut(Payload<'_>) -> Result<()> + 'a;
/// Hands tensor `i`'s data to the sink.
type Provide<'a> = dyn FnMut(usize, &mut Sink<'_>) -> Result<()> + 'a;

fn element_count(name: &str, shape: &[usize]) -> Result<u64> {
    shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .filter(|&n| usize::try_from(n).is_ok())
        .ok_or_else(|| EngineError::Checkpoint(format!("tensor `{name}`: shape {shape:?} is too large")))
}

/// Shard file name `model-0000k-of-0000N.safetensors`, k counted from 1, as transformers names them.
fn shard_name(k: usize, n: usize) -> String {
    format!("model-{k:05}-of-{n:05}.safetensors")
}

/// Whether `name` is a file some checkpoint write could have produced (and so may be replaced or removed).
fn is_checkpoint_file(name: &str) -> bool {
    if name == SINGLE_FILE || name == INDEX_FILE {
        return true;
    }
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    name.strip_prefix("model-")
        .and_then(|r| r.strip_suffix(".safetensors"))
        .and_then(|r| r.split_once("-of-"))
        .is_some_and(|(k, n)| digits(k) && digits(n))
}

/// The stored size of one element of `dtype`, in bits (packed 4-bit types count 4).
fn element_bits(dtype: Dtype) -> u64 {
    dtype.bitsize() as u64
}

fn write_planned(dir: &Path, max_shard_bytes: Option<u64>, specs: &[Spec], provide: &mut Provide<'_>) -> Result<()> {
    let mut seen = HashSet::with_capacity(specs.len());
    let mut sizes = Vec::with_capacity(specs.len());
    for (name, shape, dtype) in specs {
        if name.is_empty() || name == "__metadata__" {
            return Err(EngineError::Checkpoint(format!("`{name}` is not a valid tensor name")));
        }
        if !seen.insert(name.as_str()) {
            return Err(EngineError::Checkpoint(format!("tensor `{name}` is listed twice")));
        }
        let bytes = element_count(name, shape)?
            .checked_mul(element_bits(*dtype))
            .ok_or_else(|| EngineError::Checkpoint(format!("tensor `{name}` is too large")))?
            .div_ceil(8);
        sizes.push(bytes);
    }
    let total: u64 = sizes.iter().sum();

    // Greedy in order, as transformers' `save_pretrained` does: start a new shard when the next tensor would overflow.
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut filled = 0u64;
    for (i, &bytes) in sizes.iter().enumerate() {
        let limit = max_shard_bytes.filter(|&m| total > m);
        if let (Some(limit), Some(current)) = (limit, shards.last()) {
            if !current.is_empty() && filled + bytes > limit {
                shards.push(Vec::new());
                filled = 0;
            }
        }
        filled += bytes;
        if let Some(current) = shards.last_mut() {
            current.push(i);
        }
    }

    std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
    let names: Vec<String> = if shards.len() == 1 {
        vec![SINGLE_FILE.to_string()]
    } else {
        (1..=shards.len()).map(|k| shard_name(k, shards.len())).collect()
    };
    let mut weight_map = BTreeMap::new();
    for (file, members) in names.iter().zip(&shards) {
        write_shard(&dir.join(file), specs, members, &sizes, provide)?;
        for &i in members {
            weight_map.insert(specs[i].0.clone(), file.clone());
        }
    }
    let mut written: HashSet<&str> = names.iter().map(String::as_str).collect();
    if shards.len() > 1 {
        let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        let text = serde_json::to_string_pretty(&index)
            .map_err(|e| EngineError::Checkpoint(format!("cannot encode {INDEX_FILE}: {e}")))?;
        let path = dir.join(INDEX_FILE);
        write_atomic(&path, |w| Ok(w.write_all(text.as_bytes())?))?;
        written.insert(INDEX_FILE);
    }
    remove_stale(dir, &written)
}

/// Writes one shard: the 8-byte header length, the JSON header padded to 8 bytes, then each tensor in turn.
fn write_shard(path: &Path, specs: &[Spec], members: &[usize], sizes: &[u64], provide: &mut Provide<'_>) -> Result<()> {
    let bad = |what: String| EngineError::Checkpoint(format!("{}: {what}", path.display()));
    let mut infos = Vec::with_capacity(members.len());
    let mut offset = 0usize;
    for &i in members {
        let end =
            offset + usize::try_from(sizes[i]).map_err(|_| bad(format!("tensor `{}` is too large", specs[i].0)))?;
        let info = TensorInfo {
            dtype: specs[i].2,
            shape: specs[i].1.clone(),
            data_offsets: (offset, end),
        };
        infos.push((specs[i].0.clone(), info));
        offset = end;
    }
    // transformers refuses safetensors files whose metadata lacks `format` = `pt`.
    let format = HashMap::from([("format".to_string(), "pt".to_string())]);
    let metadata = Metadata::new(Some(format), infos).map_err(|e| bad(format!("invalid header: {e}")))?;
    let mut header = serde_json::to_vec(&metadata).map_err(|e| bad(format!("cannot encode header: {e}")))?;
    header.resize(header.len().next_multiple_of(8), b' ');

    write_atomic(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        let mut bytes = Vec::with_capacity(CHUNK * 4);
        for &i in members {
            let (name, _, dtype) = &specs[i];
            let mut sink = |payload: Payload<'_>| -> Result<()> {
                let data = match payload {
                    Payload::Bytes(b) => {
                        if b.len() as u64 != sizes[i] {
                            return Err(bad(format!(
                                "tensor `{name}` has {} bytes, expected {}",
                                b.len(),
                                sizes[i]
                            )));
                        }
                        return w.write_all(b).map_err(|e| EngineError::io(path, e));
                    }
                    Payload::Values(data) => data,
                };
                let width = match dtype {
                    Dtype::F32 => 4,
                    Dtype::BF16 => 2,
                    other => return Err(bad(format!("tensor `{name}`: f32 values cannot be stored as {other}"))),
                };
                let expected = sizes[i] / width;
                if data.len() as u64 != expected {
                    return Err(bad(format!(
                        "tensor `{name}` has {} values, expected {expected}",
                        data.len()
                    )));
                }
                for chunk in data.chunks(CHUNK) {
                    bytes.clear();
                    if *dtype == Dtype::F32 {
                        chunk.iter().for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
                    } else {
                        chunk
                            .iter()
                            .for_each(|&x| bytes.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes()));
                    }
                    w.write_all(&bytes).map_err(|e| EngineError::io(path, e))?;
                }
                Ok(())
            };
            provide(i, &mut sink).map_err(WriteFailure::Engine)?;
        }
        Ok(())
    })
}

/// Why writing a file stopped: an I/O error (reported with the path) or an error from the data source.
enum WriteFailure {
    Io(std::io::Error),
    Engine(EngineError),
}

impl From<std::io::Error> for WriteFailure {
    fn from(e: std::io::Error) -> Self {
        WriteFailure::Io(e)
    }
}

/// Writes `path` through a temporary sibling renamed into place on success, so an interrupted write never leaves a
/// plausible-looking partial checkpoint file.
fn write_atomic<F>(path: &Path, body: F) -> Result<()>
where
    F: FnOnce(&mut BufWriter<File>) -> std::result::Result<(), WriteFailure>,
{
    let mut tmp_name = path.file_name().map(|f| f.to_os_string()).unwrap_or_default();
    tmp_name.push(".partial");
    let tmp = path.with_file_name(tmp_name);
    let result = (|| {
        let file = File::create(&tmp).map_err(|e| EngineError::io(&tmp, e))?;
        let mut w = BufWriter::with_capacity(8 << 20, file);
        match body(&mut w) {
            Ok(()) => {}
            Err(WriteFailure::Io(e)) => return Err(EngineError::io(&tmp, e)),
            Err(WriteFailure::Engine(e)) => return Err(e),
        }
        let file = w.into_inner().map_err(|e| EngineError::io(&tmp, e.into_error()))?;
        file.sync_all().map_err(|e| EngineError::io(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| EngineError::io(path, e))
    })();
    if result.is_err() {
        // Best effort: the original error is what matters to the user.
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Removes checkpoint files in `dir` that the write just finished did not produce.
fn remove_stale(dir: &Path, written: &HashSet<&str>) -> Result<()> {
    let listing = std::fs::read_dir(dir).map_err(|e| EngineError::io(dir, e))?;
    for entry in listing {
        let path = entry.map_err(|e| EngineError::io(dir, e))?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if is_checkpoint_file(name) && !written.contains(name) && path.is_file() {
            std::fs::remove_file(&path).map_err(|e| EngineError::io(&path, e))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::SafetensorsSource;
    use crate::model::tensors::TensorSource;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use safetensors::SafeTensors;

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect()
    }

    fn specs() -> Vec<(String, Vec<usize>)> {
        [
            ("embed", vec![16, 8]),
            ("layers.0.w", vec![8, 8]),
            ("layers.0.b", vec![8]),
            ("norm", vec![8]),
            ("scalar", vec![]),
        ]
        .into_iter()
        .map(|(n, s)| (n.to_string(), s))
        .collect()
    }

    fn filled(specs: &[(String, Vec<usize>)]) -> (CheckpointWriter, Vec<Vec<f32>>) {
        let mut w = CheckpointWriter::new();
        let mut all = Vec::new();
        for (i, (name, shape)) in specs.iter().enumerate() {
            let data = random(shape.iter().product(), i as u64 + 1);
            w.add(name, shape.clone(), data.clone()).unwrap();
            all.push(data);
        }
        (w, all)
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn read_back(dir: &Path, specs: &[(String, Vec<usize>)]) -> Vec<Vec<f32>> {
        let mut src = SafetensorsSource::open(dir).unwrap();
        let out = specs.iter().map(|(n, s)| src.take(n, s).unwrap()).collect();
        src.finish(&[], &[]).unwrap();
        out
    }

    #[test]
    fn f32_round_trip_is_exact_with_pt_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let specs = specs();
        let (w, data) = filled(&specs);
        assert_eq!(w.len(), specs.len());
        w.write(dir.path(), WriteDtype::F32, None).unwrap();
        assert_eq!(files(dir.path()), [SINGLE_FILE]);
        assert_eq!(read_back(dir.path(), &specs), data);
        let bytes = std::fs::read(dir.path().join(SINGLE_FILE)).unwrap();
        let (n, metadata) = SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(n % 8, 0);
        assert_eq!(
            metadata
                .metadata()
                .as_ref()
                .and_then(|m| m.get("format"))
                .map(String::as_str),
            Some("pt")
        );
    }

    #[test]
    fn bf16_round_trip_within_rounding() {
        let dir = tempfile::tempdir().unwrap();
        let specs = specs();
        let (w, data) = filled(&specs);
        w.write(dir.path(), WriteDtype::BF16, None).unwrap();
        let src = SafetensorsSource::open(dir.path()).unwrap();
        assert_eq!(src.dtype_of("embed").as_deref(), Some("BF16"));
        for (got, want) in read_back(dir.path(), &specs).iter().zip(&data) {
            for (g, x) in got.iter().zip(want) {
                assert!((g - x).abs() <= x.abs() * 2f32.powi(-8), "{g} vs {x}");
                assert_eq!(*g, half::bf16::from_f32(*x).to_f32());
            }
        }
    }

    #[test]
    fn sharded_round_trip_through_index() {
        let dir = tempfile::tempdir().unwrap();
        let specs = specs();
        let (w, data) = filled(&specs);
        // embed (512 bytes) alone exceeds the limit and gets its own shard; the rest packs greedily.
        w.write(dir.path(), WriteDtype::F32, Some(330)).unwrap();
        let names = files(dir.path());
        assert_eq!(
            names,
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                INDEX_FILE
            ]
        );
        let index: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join(INDEX_FILE)).unwrap()).unwrap();
        let total: usize = specs.iter().map(|(_, s)| s.iter().product::<usize>() * 4).sum();
        assert_eq!(index["metadata"]["total_size"], total);
        assert_eq!(index["weight_map"]["embed"], "model-00001-of-00002.safetensors");
        assert_eq!(index["weight_map"]["scalar"], "model-00002-of-00002.safetensors");
        assert_eq!(index["weight_map"].as_object().unwrap().len(), specs.len());
        assert_eq!(read_back(dir.path(), &specs), data);

        // Rewriting unsharded removes the stale shards and index, leaving one unambiguous checkpoint.
        w.write(dir.path(), WriteDtype::BF16, Some(1 << 20)).unwrap();
        assert_eq!(files(dir.path()), [SINGLE_FILE]);
        assert_eq!(
            SafetensorsSource::open(dir.path()).unwrap().dtype_of("norm").as_deref(),
            Some("BF16")
        );
    }

    #[test]
    fn streaming_matches_buffered_and_fills_in_order() {
        let specs = specs();
        let (w, data) = filled(&specs);
        let buffered = tempfile::tempdir().unwrap();
        let streamed = tempfile::tempdir().unwrap();
        w.write(buffered.path(), WriteDtype::BF16, Some(200)).unwrap();
        let mut asked = Vec::new();
        write_streaming(streamed.path(), WriteDtype::BF16, Some(200), &specs, |name, buf| {
            let i = specs.iter().position(|(n, _)| n == name).unwrap();
            assert_eq!(buf.len(), data[i].len());
            buf.copy_from_slice(&data[i]);
            asked.push(name.to_string());
            Ok(())
        })
        .unwrap();
        assert_eq!(asked, specs.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>());
        let names = files(buffered.path());
        assert!(names.len() > 2, "{names:?}");
        assert_eq!(names, files(streamed.path()));
        for name in names {
            let a = std::fs::read(buffered.path().join(&name)).unwrap();
            let b = std::fs::read(streamed.path().join(&name)).unwrap();
            assert!(a == b, "{name} differs");
        }
    }

    #[test]
    fn fill_error_aborts_without_leaving_files() {
        let dir = tempfile::tempdir().unwrap();
        let specs = specs();
        let err = write_streaming(dir.path(), WriteDtype::F32, None, &specs, |name, buf| {
            if name == "norm" {
                return Err(EngineError::InvalidInput(format!("no data for {name}")));
            }
            buf.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32 * 0.5 - 1.0);
            Ok(())
        })
        .unwrap_err();
        assert!(err.to_string().contains("no data for norm"), "{err}");
        assert!(files(dir.path()).is_empty());
    }

    #[test]
    fn bad_additions_are_errors_naming_the_tensor() {
        let mut w = CheckpointWriter::new();
        w.add("a", vec![2, 2], random(4, 1)).unwrap();
        let dup = w.add("a", vec![4], random(4, 2)).unwrap_err().to_string();
        assert!(dup.contains("`a`") && dup.contains("twice"), "{dup}");
        let len = w.add("b", vec![2, 3], random(5, 3)).unwrap_err().to_string();
        assert!(len.contains("`b`") && len.contains('6') && len.contains('5'), "{len}");
        assert_eq!(w.len(), 1);
        let dir = tempfile::tempdir().unwrap();
        let twice = vec![("x".to_string(), vec![1]), ("x".to_string(), vec![1])];
        let err = write_streaming(dir.path(), WriteDtype::F32, None, &twice, |_, _| Ok(())).unwrap_err();
        assert!(err.to_string().contains("`x`"), "{err}");
    }

    #[test]
    fn checkpoint_file_names() {
        assert_eq!(shard_name(3, 12), "model-00003-of-00012.safetensors");
        assert!(is_checkpoint_file("model-00003-of-00012.safetensors"));
        assert!(is_checkpoint_file(SINGLE_FILE) && is_checkpoint_file(INDEX_FILE));
        assert!(!is_checkpoint_file("model-3-of-12.safetensors"));
        assert!(!is_checkpoint_file("adapter_model.safetensors"));
        assert!(!is_checkpoint_file("config.json"));
    }
}
