//! Helpers shared by the workspace's integration tests (`tests/tests/`): the fixtures under `tests/fixtures/`
//! (checkpoints with logits from the transformers reference, written by `scripts/reference/make_fixtures.py`), the
//! error measure the tests compare logits with, and the engine set up the way the tests drive it.

use std::path::{Path, PathBuf};

use rewind_engine::decode::{Decoder, DecoderConfig};
use rewind_engine::rank::{cpu_group, CpuOptions, RankGroup};
use rewind_engine::shard::ShardedModel;
use serde_json::Value;

/// Every fixture directory, sorted by name.
pub fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("reading {}: {e}", root.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("reference.json").is_file())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no fixtures under {}", root.display());
    dirs
}

/// A fixture's name (its directory's).
pub fn name(dir: &Path) -> String {
    dir.file_name().expect("name").to_string_lossy().to_string()
}

/// A fixture's `reference.json`.
pub fn reference(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).expect("read reference")).expect("json")
}

/// A fixture's tokens and the length of its prefill.
pub fn tokens(dir: &Path) -> (Vec<u32>, usize) {
    let r = reference(dir);
    let tokens = r["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect();
    (tokens, r["prefill_len"].as_u64().expect("prefill_len") as usize)
}

/// `max |got − want| / max |want|`.
pub fn rel(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "row lengths differ");
    let max_ref = want.iter().fold(0.0f64, |m, x| m.max(x.abs() as f64));
    let max_diff = got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (g, w)| m.max((*g as f64 - *w as f64).abs()));
    max_diff / max_ref.max(1e-12)
}

/// The first index of the largest value.
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// The fixture's model as one rank (TP = 1) under a decoder of `config`.
pub fn single(dir: &Path, config: DecoderConfig) -> Decoder {
    let model = ShardedModel::from_dir(dir, 1, 0).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    Decoder::single(model, config).expect("decoder")
}

/// The fixture's model as `tp` CPU ranks (threads) under decoders of `config`.
pub fn group(dir: &Path, tp: usize, config: DecoderConfig) -> RankGroup {
    cpu_group(dir, &CpuOptions { tp, decoder: config }).unwrap_or_else(|e| panic!("{} at tp {tp}: {e}", dir.display()))
}

/// A small deterministic generator (splitmix64), so random walks are reproducible without extra dependencies.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// The async runtime the serving tests run an engine on (two workers, like the CI machine's cores).
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}
