//! The OpenAI-compatible API as its users meet it: the official `openai` Python SDK (pinned in
//! `scripts/sdk_venv.sh`, which this test runs first) drives a CPU server of the embedded default model through
//! `bin/tests/sdk/test_openai_sdk.py`. A failure there fails this test with the Python runner's report.

use crate::process;

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn the_openai_python_sdk_gets_what_it_expects() {
    let root = repo();
    let venv = Command::new(root.join("scripts/sdk_venv.sh"))
        .output()
        .expect("run scripts/sdk_venv.sh");
    assert!(
        venv.status.success(),
        "scripts/sdk_venv.sh failed (it needs python3 and PyPI):\n{}",
        String::from_utf8_lossy(&venv.stderr)
    );
    let bin = Path::new(env!("CARGO_BIN_EXE_rewind"));
    // The default model's template has no tool or reasoning format of its own: the flags name the ones to read. A
    // second server splits reasoning: a reasoning parser also lets a forced tool call open with a reasoning block,
    // which an untrained model may never close.
    let start = |extra: &[&str]| {
        let mut args = vec!["serve", "--served-model-name", "rewind-default", "--max-seqs", "8"];
        args.extend_from_slice(extra);
        process::Server::start(bin, &args, &[("REWIND_GRPC_PORT", "0"), ("REWIND_HTTP_PORT", "0")])
    };
    let server = start(&["--tool-call-parser", "hermes", "--reasoning-parser", "none"]);
    let reasoning = start(&["--reasoning-parser", "qwen3"]);
    let out = Command::new(root.join("target/sdk-venv/bin/python"))
        .args(["-m", "unittest", "-v", "test_openai_sdk"])
        .current_dir(root.join("bin/tests/sdk"))
        .env("REWIND_BASE_URL", format!("http://{}/v1", server.http))
        .env("REWIND_REASONING_URL", format!("http://{}/v1", reasoning.http))
        .env("REWIND_BIN", bin)
        .env("REWIND_MODEL_NAME", "rewind-default")
        .output()
        .expect("run the SDK tests");
    let report = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the SDK tests failed:\n{report}\n{}\nserver stderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        server.stderr()
    );
    // The runner names every test it ran; none may be skipped silently.
    assert!(!report.contains("skipped"), "{report}");
}
