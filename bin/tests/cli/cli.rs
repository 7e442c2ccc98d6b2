//! End-to-end tests of the `rewind` binary: contracts of `logits` and `generate --json`, determinism, and clear errors
//! (one `error:` line, non-zero exit, never a panic) for every kind of bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn rewind(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rewind"))
        .args(args)
        .output()
        .expect("run rewind")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

/// Asserts a clean failure whose message contains every one of `needles`.
fn assert_fails(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure, got success; stderr: {err}");
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "panic instead of an error: {err}"
    );
    assert!(err.contains("error:"), "no error line: {err}");
    for n in needles {
        assert!(err.contains(n), "stderr lacks `{n}`: {err}");
    }
}

/// A tiny Nemotron-H checkpoint shared by the tests (built once per test process).
fn tiny_model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("rewind-cli-tiny-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let o = rewind(&[
            "init-model",
            "--arch",
            "nemotron_h",
            "--preset",
            "tiny",
            "--out",
            dir.to_str().expect("utf8"),
            "--seed",
            "3",
        ]);
        assert!(o.status.success(), "init-model failed: {}", stderr(&o));
        dir
    })
}

/// A copy of the tiny model that a test may damage.
fn damaged_copy(name: &str) -> PathBuf {
    let src = tiny_model();
    let dir = std::env::temp_dir().join(format!("rewind-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    for entry in std::fs::read_dir(src).expect("read tiny") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), dir.join(entry.file_name())).expect("copy");
    }
    dir
}

#[test]
fn logits_contract() {
    let out = std::env::temp_dir().join(format!("rewind-cli-logits-{}.json", std::process::id()));
    let model = tiny_model().to_str().expect("utf8");
    let o = rewind(&[
        "logits",
        "--model",
        model,
        "--tokens",
        "5,17,42,7,9",
        "--prefill",
        "3",
        "--out",
        out.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).expect("read")).expect("json");
    assert_eq!(v["tokens"], serde_json::json!([5, 17, 42, 7, 9]));
    let rows = v["logits"].as_array().expect("logits");
    assert_eq!(rows.len(), 5);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny_model().join("config.json")).expect("config"))
            .expect("json");
    let vocab = config["vocab_size"].as_u64().expect("vocab") as usize;
    assert!(rows.iter().all(|r| r.as_array().map(Vec::len) == Some(vocab)));
}

#[test]
fn generate_json_is_deterministic_with_a_seed() {
    let model = tiny_model().to_str().expect("utf8");
    let run = || {
        let o = rewind(&[
            "generate",
            "hello world",
            "--model",
            model,
            "--max-tokens",
            "8",
            "--seed",
            "11",
            "--temperature",
            "0.9",
            "--json",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).expect("json")
    };
    let (a, b) = (run(), run());
    assert_eq!(a["tokens"], b["tokens"]);
    assert_eq!(a["text"], b["text"]);
    assert!(a["stats"]["prompt_tokens"].as_u64().expect("prompt") > 0);
    assert!(!a["tokens"].as_array().expect("tokens").is_empty());
}

#[test]
fn generate_chat_streams_text() {
    let model = tiny_model().to_str().expect("utf8");
    let o = rewind(&[
        "generate",
        "hi",
        "--model",
        model,
        "--chat",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("decode"), "no summary: {}", stderr(&o));
}

#[test]
fn missing_model_directory() {
    assert_fails(
        &rewind(&[
            "logits",
            "--model",
            "/nonexistent/rewind-model",
            "--tokens",
            "1",
            "--prefill",
            "1",
            "--out",
            "/tmp/x.json",
        ]),
        &["/nonexistent/rewind-model"],
    );
}

#[test]
fn malformed_config() {
    let dir = damaged_copy("badjson");
    std::fs::write(dir.join("config.json"), "{ not json").expect("write");
    assert_fails(
        &rewind(&[
            "logits",
            "--model",
            dir.to_str().expect("utf8"),
            "--tokens",
            "1",
            "--prefill",
            "1",
            "--out",
            "/tmp/x.json",
        ]),
        &["config.json", "JSON"],
    );
}

#[test]
fn truncated_safetensors() {
    let dir = damaged_copy("truncated");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).expect("write");
    assert_fails(
        &rewind(&[
            "logits",
            "--model",
            dir.to_str().expect("utf8"),
            "--tokens",
            "1",
            "--prefill",
            "1",
            "--out",
            "/tmp/x.json",
        ]),
        &["model.safetensors"],
    );
}

#[test]
fn shape_mismatch_names_the_tensor() {
    let dir = damaged_copy("shape");
    let path = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    v["intermediate_size"] = serde_json::json!(96);
    std::fs::write(&path, v.to_string()).expect("write");
    assert_fails(
        &rewind(&[
            "logits",
            "--model",
            dir.to_str().expect("utf8"),
            "--tokens",
            "1",
            "--prefill",
            "1",
            "--out",
            "/tmp/x.json",
        ]),
        &["up_proj.weight", "96"],
    );
}

#[test]
fn token_id_out_of_range() {
    let model = tiny_model().to_str().expect("utf8");
    assert_fails(
        &rewind(&[
            "logits",
            "--model",
            model,
            "--tokens",
            "1,999999",
            "--prefill",
            "1",
            "--out",
            "/tmp/x.json",
        ]),
        &["999999", "vocab"],
    );
}

#[test]
fn prompt_over_the_context_limit() {
    let dir = damaged_copy("context");
    let path = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    v["max_position_embeddings"] = serde_json::json!(4);
    std::fs::write(&path, v.to_string()).expect("write");
    let long = "one two three four five six seven eight nine ten";
    assert_fails(
        &rewind(&[
            "generate",
            long,
            "--model",
            dir.to_str().expect("utf8"),
            "--max-tokens",
            "2",
        ]),
        &["max_position_embeddings"],
    );
}

#[test]
fn invalid_sampling_values() {
    let model = tiny_model().to_str().expect("utf8");
    for (flag, value, needle) in [
        ("--temperature", "-1", "temperature"),
        ("--temperature", "NaN", "temperature"),
        ("--top-p", "0", "top_p"),
        ("--top-p", "1.5", "top_p"),
        ("--min-p", "2", "min_p"),
        ("--repetition-penalty", "0", "repetition_penalty"),
    ] {
        let o = rewind(&["generate", "hi", "--model", model, "--max-tokens", "2", flag, value]);
        assert_fails(&o, &[needle]);
    }
}

#[test]
fn unknown_arch_and_preset() {
    let out = std::env::temp_dir().join("rewind-cli-never-written");
    assert_fails(
        &rewind(&[
            "init-model",
            "--arch",
            "llama",
            "--preset",
            "tiny",
            "--out",
            out.to_str().expect("utf8"),
        ]),
        &["llama", "nemotron_h"],
    );
    assert_fails(
        &rewind(&[
            "init-model",
            "--arch",
            "qwen3_5",
            "--preset",
            "huge",
            "--out",
            out.to_str().expect("utf8"),
        ]),
        &["huge", "qwen3.5-4b"],
    );
}

#[test]
fn selftest_refuses_the_cpu_device() {
    assert_fails(&rewind(&["selftest", "--device", "cpu"]), &["nothing to compare"]);
    assert_fails(&rewind(&["selftest", "--device", "tpu"]), &["unknown device"]);
}

/// Without a driver (CI) `selftest --device cuda` is a clear error and a non-zero exit, never a panic.
#[cfg(feature = "cuda")]
#[test]
fn selftest_without_a_driver_is_a_clear_error() {
    if rewind_engine::gpu::device::device_count().is_ok() {
        eprintln!("a CUDA driver is present: the no-driver path is not exercised here");
        return;
    }
    let dir = std::env::temp_dir().join(format!("rewind-cli-selftest-{}", std::process::id()));
    let json = dir.join("report.json");
    let o = rewind(&["selftest", "--device", "cuda", "--json", json.to_str().expect("utf8")]);
    assert_fails(&o, &["CUDA unavailable", "libcuda"]);
    assert!(!json.exists(), "no report without a device");
}

#[test]
fn perplexity_of_a_text() {
    let text = std::env::temp_dir().join(format!("rewind-cli-ppl-{}.txt", std::process::id()));
    std::fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog. It was the best of times.",
    )
    .expect("write");
    let model = tiny_model().to_str().expect("utf8");
    let o = rewind(&[
        "perplexity",
        "--model",
        model,
        "--file",
        text.to_str().expect("utf8"),
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let ppl = v["perplexity"].as_f64().expect("perplexity");
    // A random model over a 512-token vocabulary: finite, above 1, and not wildly above the vocabulary size.
    assert!(ppl.is_finite() && ppl > 1.0 && ppl < 5000.0, "perplexity {ppl}");
    assert!(v["tokens_scored"].as_u64().expect("count") > 5);
    // Scoring in short windows covers the same tokens.
    let o = rewind(&[
        "perplexity",
        "--model",
        model,
        "--file",
        text.to_str().expect("utf8"),
        "--window",
        "4",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let w: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(w["tokens_scored"], v["tokens_scored"]);
}

#[test]
fn non_finite_logits_are_reported() {
    let dir = damaged_copy("nan");
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).expect("read");
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).expect("header");
    let start = header["backbone.norm_f.weight"]["data_offsets"][0]
        .as_u64()
        .expect("offset") as usize;
    let at = 8 + header_len + start;
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&path, bytes).expect("write");
    let o = rewind(&[
        "generate",
        "hello",
        "--model",
        dir.to_str().expect("utf8"),
        "--max-tokens",
        "2",
    ]);
    assert_fails(&o, &["non-finite"]);
}

#[test]
fn absurd_sizes_are_clear_errors() {
    let model = tiny_model().to_str().expect("utf8");
    let out = std::env::temp_dir().join("rewind-cli-never-written-2");
    let out = out.to_str().expect("utf8");
    assert_fails(
        &rewind(&[
            "init-model",
            "--arch",
            "qwen3_5",
            "--preset",
            "tiny",
            "--out",
            out,
            "--layers",
            "18446744073709551615",
        ]),
        &["--layers"],
    );
    assert_fails(
        &rewind(&[
            "bench",
            "--model",
            model,
            "--prompt-len",
            "18446744073709551615",
            "--repeats",
            "1",
        ]),
        &["--prompt-len", "context"],
    );
    assert_fails(
        &rewind(&[
            "bench",
            "--model",
            model,
            "--decode-tokens",
            "18446744073709551615",
            "--repeats",
            "1",
        ]),
        &["--decode-tokens"],
    );
    for (flag, value) in [
        ("--spec-window", "18446744073709551615"),
        ("--buffer-len", "18446744073709551615"),
        ("--context", "18446744073709551615"),
    ] {
        assert_fails(
            &rewind(&[
                "plan-memory",
                "--arch",
                "nemotron_h",
                "--preset",
                "tiny",
                "--budget",
                "1GiB",
                flag,
                value,
            ]),
            &[flag],
        );
    }
    let o = rewind(&[
        "generate",
        "hi",
        "--model",
        model,
        "--max-tokens",
        "3",
        "--temperature",
        "1e-45",
        "--min-p",
        "0.5",
        "--json",
    ]);
    assert!(o.status.success(), "tiny temperature: {}", stderr(&o));
}

#[test]
fn gpu_flags_are_checked_before_anything_loads() {
    let model = tiny_model().to_str().expect("utf8");
    let o = rewind(&["generate", "--model", model, "--device", "gpu"]);
    assert_fails(&o, &["unknown device `gpu`", "cuda:N"]);
    // The CPU splits a model over rank threads just as GPUs do: greedy output is the one-rank output.
    let greedy = |tp: &str| {
        let o = rewind(&[
            "generate",
            "--model",
            model,
            "--device",
            "cpu",
            "--tp",
            tp,
            "--temperature",
            "0",
            "--max-tokens",
            "8",
            "--json",
        ]);
        assert!(o.status.success(), "--tp {tp}: {}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
        v["tokens"].clone()
    };
    assert_eq!(greedy("2"), greedy("1"));
    let o = rewind(&["generate", "--model", model, "--device", "cuda", "--tp", "0"]);
    assert_fails(&o, &["--tp must be at least 1"]);
    let o = rewind(&["generate", "--model", model, "--device", "cuda", "--decode", "bogus"]);
    assert_fails(&o, &["unknown decode form `bogus`"]);
    let o = rewind(&["bench", "--model", model, "--batch", "0"]);
    assert_fails(&o, &["--batch sizes must be positive"]);
}

/// Without a driver (CI), asking for a GPU is one clear error from every command that takes `--device`.
#[test]
fn gpu_without_a_driver_is_a_clear_error() {
    if rewind_engine::gpu::device::device_count().is_ok() {
        eprintln!("a CUDA driver is present: the no-driver path is not exercised here");
        return;
    }
    let model = tiny_model().to_str().expect("utf8");
    for args in [
        vec!["generate", "--model", model, "--device", "cuda", "--max-tokens", "2"],
        vec![
            "logits",
            "--model",
            model,
            "--device",
            "cuda",
            "--tokens",
            "1,2",
            "--prefill",
            "1",
            "--out",
            "/dev/null",
        ],
        vec!["bench", "--model", model, "--device", "cuda:1", "--tp", "2"],
    ] {
        let o = rewind(&args);
        assert_fails(&o, &["CUDA unavailable"]);
    }
}

#[test]
fn gpu_pool_sizes_are_checked_against_the_model() {
    let model = tiny_model().to_str().expect("utf8");
    let o = rewind(&[
        "generate",
        "--model",
        model,
        "--device",
        "cuda",
        "--max-model-len",
        "100000000",
    ]);
    assert_fails(&o, &["--max-model-len 100000000", "max_position_embeddings"]);
    let o = rewind(&[
        "generate",
        "--model",
        model,
        "--device",
        "cuda",
        "--gpu-memory-fraction",
        "1.5",
    ]);
    assert_fails(&o, &["--gpu-memory-fraction 1.5", "(0, 1]"]);
    let o = rewind(&["generate", "--model", model, "--device", "cuda", "--dtype", "fp8"]);
    assert_fails(&o, &["unknown GPU dtype `fp8`"]);
}

#[test]
fn init_model_help_lists_every_preset() {
    let o = rewind(&["init-model", "--help"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let help = String::from_utf8_lossy(&o.stdout);
    for p in rewind_engine::presets::PRESETS {
        assert!(
            help.contains(p.name) && help.contains(p.family.name()),
            "init-model --help lacks {} ({}):\n{help}",
            p.name,
            p.family.name()
        );
    }
}

#[test]
fn a_refused_connection_is_said_once() {
    // A port just freed: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let addr = format!("http://127.0.0.1:{port}");
    let o = rewind(&["client", "--addr", &addr, "health"]);
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains(&addr) && !err.contains("panicked"), "{err}");
    let line = err.lines().find(|l| l.starts_with("error:")).expect("an error line");
    let causes: Vec<&str> = line.split(": ").collect();
    for pair in causes.windows(2) {
        assert_ne!(pair[0], pair[1], "a cause said twice: {line}");
    }
}
