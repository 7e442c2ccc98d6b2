//! `rewind logits --decode ... --buffer-len ... --tp N` end to end: every decode form, on one CPU rank or split over
//! several, gives the one-rank recurrent form's logits on tiny init-model checkpoints of both SSM families, and bad
//! values are clear errors.

use std::path::{Path, PathBuf};

use crate::common;
use common::{rewind, stderr};

/// A tiny checkpoint of `arch` in a directory of its own for the test `tag` (tests run in parallel).
fn tiny_model(arch: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rewind-decode-cli-{arch}-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let o = rewind(&[
        "init-model",
        "--arch",
        arch,
        "--preset",
        "tiny",
        "--out",
        dir.to_str().expect("utf8"),
        "--seed",
        "11",
    ]);
    assert!(o.status.success(), "init-model failed: {}", stderr(&o));
    dir
}

/// The JSON `rewind logits` writes for `tokens`, the first `prefill` through prefill, with `extra` flags.
fn logits_json(model: &Path, tokens: &str, prefill: usize, extra: &[&str]) -> serde_json::Value {
    let out = std::env::temp_dir().join(format!(
        "rewind-decode-cli-{}-{}-{}.json",
        std::process::id(),
        model
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        extra.join("_")
    ));
    let prefill = prefill.to_string();
    let mut args = vec![
        "logits",
        "--model",
        model.to_str().expect("utf8"),
        "--tokens",
        tokens,
        "--prefill",
        &prefill,
        "--out",
        out.to_str().expect("utf8"),
    ];
    args.extend_from_slice(extra);
    let o = rewind(&args);
    assert!(o.status.success(), "logits {extra:?} failed: {}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).expect("read")).expect("json");
    let _ = std::fs::remove_file(&out);
    v
}

/// `rewind logits` rows for `tokens`, the first `prefill` through prefill, with `extra` flags.
fn logits(model: &Path, tokens: &str, prefill: usize, extra: &[&str]) -> Vec<Vec<f64>> {
    logits_json(model, tokens, prefill, extra)["logits"]
        .as_array()
        .expect("logits")
        .iter()
        .map(|r| {
            r.as_array()
                .expect("row")
                .iter()
                .map(|x| x.as_f64().expect("f64"))
                .collect()
        })
        .collect()
}

fn rel(got: &[f64], want: &[f64]) -> f64 {
    let max_ref = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let max_diff = got.iter().zip(want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs()));
    max_diff / max_ref.max(1e-12)
}

#[test]
fn logits_in_every_form_match_recurrent() {
    let tokens = "5,17,42,7,9,33,2,8,61,4,19,23,6,50,11,3,27,14";
    for arch in ["nemotron_h", "qwen3_5"] {
        let model = tiny_model(arch, "forms");
        for prefill in [5, 1] {
            let want = logits(&model, tokens, prefill, &["--decode", "recurrent"]);
            assert_eq!(want.len(), 18);
            for flags in [
                &["--decode", "replay", "--buffer-len", "3"][..],
                &["--decode", "kv-only"],
                &["--decode", "auto", "--buffer-len", "4"],
                &[],
                &["--tp", "2", "--decode", "recurrent"],
                &["--tp", "2", "--decode", "replay", "--buffer-len", "3"],
                &["--tp", "3", "--decode", "kv-only"],
                &["--tp", "4", "--decode", "auto"],
            ] {
                let got = logits(&model, tokens, prefill, flags);
                assert_eq!(got.len(), want.len());
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let e = rel(g, w);
                    assert!(
                        e < 1e-4,
                        "{arch} prefill {prefill} {flags:?}: position {i} off by {e:.2e}"
                    );
                }
            }
        }
        let _ = std::fs::remove_dir_all(&model);
    }
}

#[test]
fn teacher_forced_verify_steps_match_recurrent_decoding() {
    let tokens = "5,17,42,7,9,33,2,8,61,4,19,23,6,50,11,3,27,14,5,8,13,21,34,55,1,2,3";
    for arch in ["nemotron_h", "qwen3_5"] {
        let model = tiny_model(arch, "verify");
        let want = logits(&model, tokens, 4, &["--decode", "recurrent"]);
        for flags in [
            &[
                "--decode",
                "replay",
                "--buffer-len",
                "12",
                "--verify-window",
                "4",
                "--verify-reject",
                "0.25",
            ][..],
            &[
                "--decode",
                "kv-only",
                "--verify-window",
                "3",
                "--verify-reject",
                "0.5",
                "--seed",
                "3",
            ],
            &["--decode", "auto", "--verify-window", "4", "--tp", "2"],
        ] {
            let got = logits(&model, tokens, 4, flags);
            assert_eq!(got.len(), want.len(), "{arch} {flags:?}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let e = rel(g, w);
                assert!(e < 1e-4, "{arch} {flags:?}: position {i} off by {e:.2e}");
            }
        }
        // The in-process comparison reports the same agreement, and the drafts it kept.
        let c = logits_json(
            &model,
            tokens,
            4,
            &[
                "--decode",
                "replay",
                "--verify-window",
                "4",
                "--verify-reject",
                "0.25",
                "--reference-form",
                "recurrent",
            ],
        );
        assert_eq!(c["positions"], 27);
        assert_eq!(c["argmax_agree"], 27);
        assert!(c["max_rel_diff"].as_f64().expect("rel") < 1e-4, "{c}");
        assert!(c["verify_steps"].as_u64().expect("steps") > 0 && c["drafts_kept"].as_u64().expect("kept") > 0);
        let _ = std::fs::remove_dir_all(&model);
    }
}

#[test]
fn bad_decode_flags_are_clear_errors() {
    for (flags, needle) in [
        (&["--decode", "fast"][..], "unknown decode form `fast`"),
        (&["--buffer-len", "1"], "at least 2"),
        (&["--buffer-len", "many"], "not a whole number"),
        (&["--tp", "0"], "--tp must be at least 1"),
    ] {
        let mut args = vec![
            "logits",
            "--model",
            "/nonexistent",
            "--tokens",
            "1,2",
            "--prefill",
            "1",
            "--out",
            "/dev/null",
        ];
        args.extend_from_slice(flags);
        let o = rewind(&args);
        let err = stderr(&o);
        assert!(!o.status.success(), "{flags:?} accepted");
        assert!(err.contains("error:") && !err.contains("panicked"), "{flags:?}: {err}");
        assert!(err.contains(needle), "{flags:?}: `{err}` lacks `{needle}`");
        let o = rewind(&[&["generate", "hi"][..], flags].concat());
        assert!(!o.status.success() && stderr(&o).contains(needle), "generate {flags:?}");
    }
}

#[test]
fn a_split_the_model_cannot_take_is_a_clear_error() {
    let model = tiny_model("nemotron_h", "split");
    let o = rewind(&[
        "generate",
        "hi",
        "--model",
        model.to_str().expect("utf8"),
        "--tp",
        "64",
        "--max-tokens",
        "2",
    ]);
    let err = stderr(&o);
    assert!(!o.status.success(), "--tp 64 accepted");
    assert!(
        err.contains("tensor parallelism 64 exceeds") && !err.contains("panicked"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&model);
}

/// A token id out of the vocabulary is named by its position in `--tokens` (the steps see one token at a time, and
/// used to report index 0 of "slot 0"; fuzzing finding).
#[test]
fn an_out_of_vocabulary_token_is_named_by_its_position() {
    let model = tiny_model("nemotron_h", "oov");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_rewind"))
        .args([
            "logits",
            "--model",
            model.to_str().expect("utf8"),
            "--tokens",
            "5,999999",
            "--prefill",
            "1",
        ])
        .args([
            "--out",
            std::env::temp_dir().join("rewind-oov.json").to_str().expect("utf8"),
        ])
        .output()
        .expect("run rewind logits");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("--tokens: token id 999999 at position 1 is out of range"),
        "{err}"
    );
}
