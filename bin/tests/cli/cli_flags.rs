//! Helpers of the CLI flag tests (`generate_bench_flags.rs`, `bench_flags.rs`): clean failures, temporary directories
//! and a tiny checkpoint with a known context.

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::common::{rewind, scratch_dir, stderr};

/// What the run wrote to stdout.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

/// Asserts a clean failure: a non-zero exit, no panic, exactly one `error:` line, and every one of `needles` in it.
pub fn assert_fails(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure, got success; stderr: {err}");
    assert!(!err.contains("panicked"), "panic instead of an error: {err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "want one error line: {err}");
    for n in needles {
        assert!(errors[0].contains(n), "the error line lacks `{n}`: {err}");
    }
}

/// Asserts success, showing stderr otherwise.
pub fn assert_ok(o: &Output, what: &str) {
    assert!(o.status.success(), "{what} failed: {}", stderr(o));
}

/// A fresh temporary directory for the test `tag` (tests run in parallel).
pub fn temp_dir(tag: &str) -> PathBuf {
    scratch_dir(&format!("gbf-{tag}"))
}

/// A tiny Nemotron-H checkpoint (max_position_embeddings 4096) in a directory of its own for the test `tag`.
pub fn tiny_model(tag: &str) -> PathBuf {
    let dir = temp_dir(tag).join("tiny");
    let o = rewind(&[
        "init-model",
        "--arch",
        "nemotron_h",
        "--preset",
        "tiny",
        "--out",
        dir.to_str().expect("utf8"),
        "--seed",
        "5",
    ]);
    assert_ok(&o, "init-model");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).expect("config")).expect("json");
    assert_eq!(
        config["max_position_embeddings"], 4096,
        "the tests assume a 4096-token context"
    );
    dir
}

/// A path as the `&str` an argument list takes.
pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf8")
}
