//! The MTP layer against the transformers reference: `tests/fixtures/mtp/<arch>/` (written by
//! `scripts/train/make_mtp_fixtures.py` with the MTP layer `scripts/train/train_mtp.py` trains, built from
//! transformers' own layer classes) holds a tiny checkpoint with `mtp.*` tensors in the layout rewind ships for its
//! default models (Nemotron-H: attention then a dense MLP; Qwen3.5: the gated full-attention decoder layer, zero-centred
//! norms) and what PyTorch computes with them. rewind's MTP weights must give the same rows, logits and greedy drafts,
//! and its drafter, handed the target's rows before the final norm, the same drafts.

use std::path::{Path, PathBuf};

use rewind_engine::spec::mtp::{tiled_argmax, MtpDrafter, MtpWeights};
use rewind_engine::spec::{DraftInput, Drafter, HiddenRows};
use rewind_tests::{reference, rel};
use serde_json::Value;

/// max |Δ| / max |reference| allowed per row: both sides compute in f32 from the same bf16 weights.
const TOLERANCE: f64 = 1e-5;

fn dirs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join("mtp");
    ["nemotron_h", "qwen3_5"].iter().map(|a| root.join(a)).collect()
}

/// `key`'s rows, flattened.
fn rows(r: &Value, key: &str) -> Vec<f32> {
    let rows = r[key]
        .as_array()
        .unwrap_or_else(|| panic!("reference.json lacks `{key}`"));
    rows.iter()
        .flat_map(|row| row.as_array().expect("row").iter())
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

fn values(r: &Value, key: &str) -> Vec<f32> {
    let v = r[key]
        .as_array()
        .unwrap_or_else(|| panic!("reference.json lacks `{key}`"));
    v.iter().map(|x| x.as_f64().expect("number") as f32).collect()
}

fn ids(r: &Value, key: &str) -> Vec<u32> {
    let v = r[key]
        .as_array()
        .unwrap_or_else(|| panic!("reference.json lacks `{key}`"));
    v.iter().map(|x| x.as_u64().expect("token id") as u32).collect()
}

fn assert_rows(what: &str, got: &[f32], want: &[f32], h: usize) {
    assert_eq!(got.len(), want.len(), "{what}: row count");
    for (i, (g, w)) in got.chunks_exact(h).zip(want.chunks_exact(h)).enumerate() {
        let e = rel(g, w);
        assert!(e < TOLERANCE, "{what}: row {i} differs from the reference by {e:.2e}");
    }
}

#[test]
fn mtp_rows_logits_and_drafts_match_the_reference() {
    for dir in dirs() {
        let what = dir.display().to_string();
        let r = reference(&dir);
        let w = MtpWeights::load(&dir).unwrap_or_else(|e| panic!("{what}: {e}"));
        let (h, vocab) = (w.config().hidden_size, w.config().vocab_size);
        let tokens = ids(&r, "tokens");
        let mut cache = w.new_cache();
        // One pass over the committed rows (each with the token after it), from position 0.
        let hidden = w.normalise_target(&rows(&r, "hidden"));
        let out = w.forward(&hidden, &tokens[1..], &mut cache).expect("forward");
        assert_rows(&format!("{what} outputs"), &out, &rows(&r, "outputs"), h);

        let mut x = out[out.len() - h..].to_vec();
        let logits: Vec<f32> = w
            .lm_head()
            .chunks_exact(h)
            .map(|e| e.iter().zip(&x).map(|(a, b)| a * b).sum())
            .collect();
        assert_eq!(logits.len(), vocab);
        assert_rows(
            &format!("{what} last row's logits"),
            &logits,
            &values(&r, "logits_last"),
            vocab,
        );

        // Greedy drafts: each step runs on the previous step's output and draft.
        let drafts = ids(&r, "drafts");
        let steps = rows(&r, "draft_outputs");
        for (k, &d) in drafts.iter().enumerate() {
            assert_eq!(tiled_argmax(&x, w.lm_head(), h), Some(d), "{what}: draft {}", k + 1);
            if k + 1 < drafts.len() {
                x = w.forward(&x, &[d], &mut cache).expect("draft step");
                assert_rows(
                    &format!("{what} draft step {}", k + 2),
                    &x,
                    &steps[k * h..(k + 1) * h],
                    h,
                );
            }
        }
    }
}

#[test]
fn mtp_drafter_proposes_the_reference_drafts() {
    for dir in dirs() {
        let what = dir.display().to_string();
        let r = reference(&dir);
        let weights = MtpWeights::load(&dir).unwrap_or_else(|e| panic!("{what}: {e}"));
        let h = weights.config().hidden_size;
        let tokens = ids(&r, "tokens");
        let drafts = ids(&r, "drafts");
        let mut drafter = MtpDrafter::new(weights);
        // The target's rows of positions 0..n-1 before its final norm, as the ranks return them.
        let hidden = HiddenRows {
            position: 0,
            hidden: h,
            rows: rows(&r, "hidden"),
        };
        let got = drafter
            .propose(&DraftInput {
                tokens: &tokens,
                hidden: Some(&hidden),
                max: drafts.len(),
            })
            .expect("propose");
        assert_eq!(got.tokens, drafts, "{what}");
    }
}
