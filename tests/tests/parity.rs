//! Parity with the transformers reference implementation: every fixture under `tests/fixtures/` (written by
//! `scripts/reference/make_fixtures.py`) is loaded by rewind and its logits compared position by position, for the
//! prefill path (one pass over the first `prefill_len` tokens) and the decode path (one token at a time after it).

use std::path::{Path, PathBuf};

use rewind_engine::model::{Logits, Model};
use serde_json::Value;

/// max |Δlogit| / max |logit| allowed at every position.
const TOLERANCE: f64 = 1e-3;

fn fixtures() -> Vec<PathBuf> {
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

fn rows(v: &Value, key: &str) -> Vec<Vec<f64>> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("reference.json lacks `{key}`"))
        .iter()
        .map(|r| {
            r.as_array()
                .expect("row")
                .iter()
                .map(|x| x.as_f64().expect("number"))
                .collect()
        })
        .collect()
}

fn rel_error(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "vocab size differs");
    let max_ref = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let max_diff = got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (g, w)| m.max((*g as f64 - w).abs()));
    max_diff / max_ref.max(1e-12)
}

/// Returns (worst prefill error, worst decode error, worst full-pass error).
fn check(dir: &Path) -> (f64, f64, f64) {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).expect("read reference"))
            .expect("json");
    let tokens: Vec<u32> = reference["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect();
    let prefill = reference["prefill_len"].as_u64().expect("prefill_len") as usize;
    let want = rows(&reference, "logits");
    let model = Model::from_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let vocab = model.config().vocab_size;

    let mut state = model.new_state();
    let mut got: Vec<Vec<f32>> = model
        .forward(&tokens[..prefill], &mut state, Logits::All)
        .expect("prefill")
        .chunks(vocab)
        .map(<[f32]>::to_vec)
        .collect();
    for &t in &tokens[prefill..] {
        got.push(model.forward(&[t], &mut state, Logits::All).expect("decode"));
    }
    let errors: Vec<f64> = got.iter().zip(&want).map(|(g, w)| rel_error(g, w)).collect();
    let pre = errors[..prefill].iter().cloned().fold(0.0, f64::max);
    let dec = errors[prefill..].iter().cloned().fold(0.0, f64::max);

    let mut full_state = model.new_state();
    let full = model.forward(&tokens, &mut full_state, Logits::All).expect("full pass");
    let full_want = rows(&reference, "full_logits");
    let full_err = full
        .chunks(vocab)
        .zip(&full_want)
        .map(|(g, w)| rel_error(g, w))
        .fold(0.0, f64::max);
    (pre, dec, full_err)
}

#[test]
fn logits_match_transformers() {
    let mut failures = Vec::new();
    for dir in fixtures() {
        let name = dir.file_name().expect("name").to_string_lossy().to_string();
        let (pre, dec, full) = check(&dir);
        println!("{name:<20} prefill {pre:.2e}  decode {dec:.2e}  full-pass {full:.2e}");
        if pre > TOLERANCE || dec > TOLERANCE || full > TOLERANCE {
            failures.push(format!("{name}: prefill {pre:.2e}, decode {dec:.2e}, full {full:.2e}"));
        }
    }
    assert!(failures.is_empty(), "parity above {TOLERANCE}: {failures:#?}");
}
