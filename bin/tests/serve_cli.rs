//! `rewind generate` through the serving engine, end to end: greedy tokens at `--tp 1|2|3` equal, every
//! `--inject-fault` kind recovered with the same tokens (and reported on stderr), bad engine flags clear errors.

use std::path::{Path, PathBuf};

mod common;
use common::{rewind, stderr};

fn tiny_model(arch: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rewind-serve-cli-{arch}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let o = rewind(&[
        "init-model",
        "--arch",
        arch,
        "--preset",
        "tiny",
        "--out",
        dir.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "init-model failed: {}", stderr(&o));
    dir
}

/// Greedy tokens of `generate --json` with `extra` flags, and its stderr.
fn tokens(model: &Path, extra: &[&str]) -> (Vec<u64>, String) {
    let mut args = vec![
        "generate",
        "the quick brown fox",
        "--model",
        model.to_str().expect("utf8"),
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    ];
    args.extend_from_slice(extra);
    let o = rewind(&args);
    assert!(o.status.success(), "generate {extra:?} failed: {}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let t = v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("id"))
        .collect();
    (t, stderr(&o))
}

#[test]
fn generate_is_the_same_at_every_tp_and_through_every_fault() {
    for arch in ["nemotron_h", "qwen3_5"] {
        let model = tiny_model(arch);
        let (want, _) = tokens(&model, &[]);
        assert_eq!(want.len(), 12);
        for tp in ["2", "3"] {
            assert_eq!(tokens(&model, &["--tp", tp]).0, want, "{arch} at --tp {tp}");
        }
        for kind in ["panic", "hang", "error", "nan"] {
            let spec = format!("1:{kind}@5");
            let (got, err) = tokens(&model, &["--tp", "2", "--inject-fault", &spec, "--step-timeout", "3"]);
            assert_eq!(got, want, "{arch} with {spec}");
            assert!(err.contains("[recovered from a fault"), "{arch} {spec}: {err}");
        }
        let _ = std::fs::remove_dir_all(&model);
    }
}

#[test]
fn bad_engine_flags_are_clear_errors() {
    for (flags, want) in [
        (&["--inject-fault", "0:boom@3"][..], "RANK:KIND@STEP"),
        (&["--inject-fault", "2:panic@3"][..], "rank 2 does not exist"),
        (&["--max-batch-tokens", "0"][..], "--max-batch-tokens"),
        (&["--step-timeout", "0"][..], "--step-timeout"),
    ] {
        let mut args = vec!["generate", "hi", "--max-tokens", "2"];
        args.extend_from_slice(flags);
        let o = rewind(&args);
        assert!(!o.status.success(), "{flags:?} accepted");
        let err = stderr(&o);
        assert!(err.contains(want) && !err.contains("panicked"), "{flags:?}: {err}");
    }
}
