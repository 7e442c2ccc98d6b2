//! Loading tests: take-once bookkeeping, `finish`'s leftovers, every loadable dtype, and errors that name the tensor
//! and file for truncated or garbage files, inconsistent indexes and ambiguous directories.

use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::tensor::{Dtype, TensorView};

use super::convert::PARALLEL_MIN;
use super::{SafetensorsSource, INDEX_FILE, SINGLE_FILE};
use crate::checkpoint::{CheckpointWriter, WriteDtype};
use crate::error::{EngineError, Result};
use crate::model::tensors::TensorSource;

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
