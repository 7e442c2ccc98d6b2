//! Parity with the transformers reference implementation: every fixture under `tests/fixtures/` (written by
//! `scripts/reference/make_fixtures.py`) is loaded by rewind as one rank under a recurrent-form decoder and its logits
//! compared position by position, for the prefill path (one pass over the first `prefill_len` tokens, every row), the
//! decode path (one token at a time after it), the full pass (one prefill of every token) and a prompt in two chunks
//! (the second one at a position > 0, in the recurrent, replay and kv-only forms).

use std::path::Path;

use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::model::ModelConfig;
use rewind_engine::rank::Rows;
use rewind_tests::{fixtures, name, reference, single, tokens};
use serde_json::Value;

/// max |Δlogit| / max |logit| allowed at every position.
const TOLERANCE: f64 = 1e-3;

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

/// The worst error of logit rows `got` (`[rows, vocab]`) against `want`, which must have as many rows.
fn worst(got: &[f32], want: &[Vec<f64>], vocab: usize) -> f64 {
    assert_eq!(got.len(), want.len() * vocab, "row count differs");
    got.chunks_exact(vocab)
        .zip(want)
        .map(|(g, w)| rel_error(g, w))
        .fold(0.0, f64::max)
}

/// The fixture's tokens in one sequence of `form`: the prompt as `chunks` (lengths summing to the prefill), every row
/// reported, then one decode per later token. Returns every position's logits `[tokens, vocab]`.
fn run(dir: &Path, form: FormChoice, chunks: &[usize]) -> Vec<f32> {
    let (tokens, prefill) = tokens(dir);
    assert_eq!(chunks.iter().sum::<usize>(), prefill);
    let mut dec = single(dir, DecoderConfig::new(1, tokens.len()));
    let slot = dec.start(form).expect("slot");
    let mut got = Vec::new();
    let mut at = 0;
    for &n in chunks {
        got.extend(dec.prefill(slot, &tokens[at..at + n], Rows::All).expect("prefill"));
        at += n;
        assert_eq!(dec.position(slot).expect("position"), at);
    }
    for &t in &tokens[prefill..] {
        got.extend(dec.decode(&[(slot, t)]).expect("decode"));
    }
    got
}

/// Returns (worst prefill error, worst decode error, worst full-pass error, worst two-chunk error over the forms).
fn check(dir: &Path) -> (f64, f64, f64, f64) {
    let reference = reference(dir);
    let (tokens, prefill) = tokens(dir);
    let want = rows(&reference, "logits");
    assert_eq!(want.len(), tokens.len(), "one reference row per token");
    let vocab = ModelConfig::from_dir(dir).expect("config").vocab_size;

    let got = run(dir, FormChoice::Recurrent, &[prefill]);
    let pre = worst(&got[..prefill * vocab], &want[..prefill], vocab);
    let dec = worst(&got[prefill * vocab..], &want[prefill..], vocab);

    let mut full_dec = single(dir, DecoderConfig::new(1, tokens.len()));
    let slot = full_dec.start(FormChoice::Recurrent).expect("slot");
    let full = full_dec.prefill(slot, &tokens, Rows::All).expect("full pass");
    let full_err = worst(&full, &rows(&reference, "full_logits"), vocab);

    // The prompt in two chunks: positions `..cut`, then `cut..prefill` at position `cut`.
    assert!(
        prefill >= 2,
        "{}: a prompt of {prefill} token cannot be split",
        name(dir)
    );
    let cut = prefill / 2;
    let mut chunked = 0.0f64;
    for form in [FormChoice::Recurrent, FormChoice::Replay, FormChoice::KvOnly] {
        let got = run(dir, form, &[cut, prefill - cut]);
        let e = worst(&got, &want, vocab);
        println!(
            "{:<20} two chunks ({cut} + {}) {form:<9} {e:.2e}",
            name(dir),
            prefill - cut
        );
        chunked = chunked.max(e);
    }
    (pre, dec, full_err, chunked)
}

#[test]
fn logits_match_transformers() {
    let mut failures = Vec::new();
    for dir in fixtures() {
        let name = name(&dir);
        let (pre, dec, full, chunked) = check(&dir);
        println!("{name:<20} prefill {pre:.2e}  decode {dec:.2e}  full-pass {full:.2e}  two chunks {chunked:.2e}");
        if pre > TOLERANCE || dec > TOLERANCE || full > TOLERANCE || chunked > TOLERANCE {
            failures.push(format!(
                "{name}: prefill {pre:.2e}, decode {dec:.2e}, full {full:.2e}, two chunks {chunked:.2e}"
            ));
        }
    }
    assert!(failures.is_empty(), "parity above {TOLERANCE}: {failures:#?}");
}
