//! `rewind bench` flags end to end: work that cannot fit the context (the prompt, the decoded tokens, the batched
//! measures' `--step-prompt`) is refused up front, speculation without `--concurrency` is an error, long benches
//! report progress on stderr, and the random-weights notice appears for init-model checkpoints only.

use std::process::Command;

use crate::cli_flags;
use crate::common;
use cli_flags::{assert_fails, assert_ok, s, stdout, temp_dir, tiny_model};
use common::{rewind, stderr};

/// `rewind bench --serving-only` of model `m` with `prompt` + `decode` tokens a request and the `extra` flags.
fn serving_bench(m: &str, prompt: &str, decode: &str, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "bench",
        "--model",
        m,
        "--prompt-len",
        prompt,
        "--decode-tokens",
        decode,
        "--serving-only",
    ];
    args.extend_from_slice(extra);
    rewind(&args)
}

#[test]
fn bench_refuses_work_past_the_context_limit() {
    let model = tiny_model("context");
    let m = s(&model);
    for extra in [&[][..], &["--concurrency", "1", "--requests", "1"][..]] {
        let mut args = vec!["bench", "--model", m, "--prompt-len", "4090", "--decode-tokens", "64"];
        args.extend_from_slice(extra);
        assert_fails(
            &rewind(&args),
            &[
                "--prompt-len 4090",
                "--decode-tokens 64",
                "4154",
                "4096",
                "max_position_embeddings",
            ],
        );
    }
    // The serving mode decodes right after each prompt: 4033 + 64 is one token too many, 4032 + 64 fits exactly.
    let serving = |prompt: &str| {
        serving_bench(
            m,
            prompt,
            "64",
            &["--concurrency", "1", "--requests", "1", "--repeats", "1"],
        )
    };
    assert_fails(&serving("4033"), &["--prompt-len 4033", "max_position_embeddings"]);
    let o = serving("4032");
    assert_ok(&o, "bench of exactly the context limit");
    assert!(stdout(&o).contains("4032 + 64 tokens each"), "{}", stdout(&o));
    // Huge values are refused without overflowing.
    assert_fails(
        &rewind(&[
            "bench",
            "--model",
            m,
            "--prompt-len",
            "100",
            "--decode-tokens",
            "18446744073709551615",
        ]),
        &["--decode-tokens", "max_position_embeddings"],
    );
    assert_fails(
        &rewind(&["bench", "--model", m, "--decode-tokens", "0"]),
        &["--decode-tokens must be at least 1"],
    );
    assert_fails(
        &rewind(&["bench", "--model", m, "--concurrency", "0"]),
        &["--concurrency must be at least 1"],
    );
    // The batched measures' prompt: at least one token, and it plus the decoded tokens must fit the context.
    assert_fails(
        &rewind(&["bench", "--model", m, "--step-prompt", "0"]),
        &["--step-prompt must be at least 1"],
    );
    assert_fails(
        &rewind(&["bench", "--model", m, "--spec", "ngram"]),
        &["--spec ngram needs --concurrency"],
    );
    // MTP drafting is timed on GPU ranks, over verify steps of a window.
    assert_fails(
        &rewind(&["bench", "--model", m, "--verify-window", "2", "--mtp-draft"]),
        &["--mtp-draft", "--device cuda"],
    );
    assert_fails(
        &rewind(&["bench", "--model", m, "--mtp-draft"]),
        &["required arguments were not provided"],
    );
    assert_fails(
        &rewind(&["bench", "--model", m, "--step-prompt", "4090", "--decode-tokens", "8"]),
        &["--step-prompt of 4090", "max_position_embeddings"],
    );
    let o = rewind(&[
        "bench",
        "--model",
        m,
        "--prompt-len",
        "8",
        "--decode-tokens",
        "2",
        "--repeats",
        "1",
        "--batch",
        "2",
        "--step-prompt",
        "300",
    ]);
    assert_ok(&o, "bench with a long step prompt");
    assert!(stdout(&o).contains("decode, batch 2"), "{}", stdout(&o));
}

#[test]
fn bench_reports_progress_on_stderr() {
    let model = tiny_model("progress");
    let o = rewind(&[
        "bench",
        "--model",
        s(&model),
        "--prompt-len",
        "40",
        "--decode-tokens",
        "4",
        "--repeats",
        "2",
        "--concurrency",
        "2",
        "--requests",
        "3",
    ]);
    assert_ok(&o, "bench");
    let err = stderr(&o);
    for line in [
        "prefill 40 tokens, warm-up",
        "prefill 40 tokens (chunked), repeat 1/2 ... ",
        "prefill 40 tokens (chunked), repeat 2/2 ... ",
        "prefill 40 tokens (token by token), repeat 2/2 ... ",
        "decode batch 1, 4 tokens each, repeat 1/2 ... ",
        "decode batch 1, 4 tokens each, repeat 2/2 ... ",
        "serving: 3 requests of 40 + 4 tokens, 2 in flight",
        "serving: 3/3 requests done",
    ] {
        let l = err.lines().find(|l| l.contains(line));
        assert!(l.is_some(), "stderr lacks `{line}`: {err}");
        assert!(
            l.is_some_and(|l| l.starts_with('[')),
            "no elapsed time on `{line}`: {err}"
        );
    }
    // Each timed measurement's line ends with its time.
    let timed = err.lines().find(|l| l.contains("(chunked), repeat 1/2")).expect("line");
    assert!(timed.contains(" s (") && timed.ends_with("tok/s)"), "{timed}");
    // stdout keeps only the results table.
    let out = stdout(&o);
    assert!(
        !out.contains("repeat") && !out.contains("requests done"),
        "progress on stdout: {out}"
    );
    assert!(out.contains("| decode, batch 1 |"), "{out}");
}

#[test]
fn bench_notes_random_weights_only_for_init_model_checkpoints() {
    let cache = temp_dir("default-cache");
    let o = Command::new(env!("CARGO_BIN_EXE_rewind"))
        .args(["bench", "--prompt-len", "4", "--decode-tokens", "1", "--repeats", "1"])
        .env("REWIND_CACHE", &cache)
        .output()
        .expect("run rewind");
    // The default model's cache (20 MB) is not left behind in the temporary directory.
    let _ = std::fs::remove_dir_all(&cache);
    assert_ok(&o, "bench of the default model");
    assert!(!stderr(&o).contains("RANDOM weights"), "{}", stderr(&o));
    let model = tiny_model("default");
    let o = rewind(&[
        "bench",
        "--model",
        s(&model),
        "--prompt-len",
        "4",
        "--decode-tokens",
        "1",
        "--repeats",
        "1",
    ]);
    assert_ok(&o, "bench of an init-model checkpoint");
    assert!(
        stderr(&o).contains("note: this model has RANDOM weights (made by `rewind init-model`)"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn serving_lengths_vary_with_the_random_range_ratio() {
    let model = tiny_model("range");
    let m = s(&model);
    let json = temp_dir("range-json").join("bench.json");
    let json = json.to_str().expect("utf-8 path");
    // Serving only, 12 requests 3 in flight, with the given prompt / output lengths and ratio.
    let serving = |prompt: &str, decode: &str, ratio: &str| {
        let extra = [
            "--concurrency",
            "3",
            "--requests",
            "12",
            "--random-range-ratio",
            ratio,
            "--json",
            json,
        ];
        serving_bench(m, prompt, decode, &extra)
    };
    let o = serving("16", "8", "0.5");
    assert_ok(&o, "serving with mixed lengths");
    assert!(stdout(&o).contains("16 + 8 tokens each (± 0.5 each)"), "{}", stdout(&o));
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(json).expect("json")).expect("parse");
    let serving_report = &report["serving"];
    assert_eq!(serving_report["random_range_ratio"], 0.5);
    // Every request generated its own drawn length, within 8 ± 4, and not all the same.
    let lens: Vec<usize> = serving_report["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_array().expect("a request's tokens").len())
        .collect();
    assert_eq!(lens.len(), 12);
    assert!(lens.iter().all(|l| (4..=12).contains(l)), "{lens:?}");
    assert!(lens.iter().any(|&l| l != lens[0]), "{lens:?}");
    assert_eq!(serving_report["output_tokens"], lens.iter().sum::<usize>());
    for bad in ["1", "-0.1", "NaN"] {
        assert_fails(
            &serving("16", "8", bad),
            &["--random-range-ratio must be at least 0 and below 1"],
        );
    }
    // The longest request must fit the context: 4032 + 64 fits exactly, but not once lengths may grow by half.
    assert_fails(
        &serving("4032", "64", "0.5"),
        &["--random-range-ratio 0.5", "6048 + 96", "max_position_embeddings"],
    );
}

/// A quick `rewind bench` of model `m` (16-token prompt, 4 decoded tokens, once) with the `extra` flags.
fn small_bench(m: &str, extra: &[&str]) -> std::process::Output {
    let mut args: Vec<&str> = "bench --prompt-len 16 --decode-tokens 4 --repeats 1 --model"
        .split(' ')
        .collect();
    args.push(m);
    args.extend_from_slice(extra);
    rewind(&args)
}

#[test]
fn bench_json_to_a_path_that_cannot_be_written_fails_before_measuring() {
    let model = tiny_model("bad-json");
    let m = s(&model);
    let missing = temp_dir("bad-json-parent").join("no-such-dir").join("bench.json");
    let dir = temp_dir("bad-json-dir");
    for path in [missing.to_str().expect("utf-8"), dir.to_str().expect("utf-8")] {
        let o = small_bench(m, &["--json", path]);
        assert_fails(&o, &["--json", path]);
        assert!(stdout(&o).is_empty(), "it measured before failing:\n{}", stdout(&o));
    }
}

#[test]
fn bench_names_the_cpu_in_its_table_and_json() {
    let model = tiny_model("cpu-name");
    let m = s(&model);
    let json = temp_dir("cpu-name-json").join("bench.json");
    let o = small_bench(m, &["--json", s(&json)]);
    assert_ok(&o, "bench --json");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("parse");
    let cpu = report["cpu"].as_str().expect("a cpu field");
    assert!(!cpu.is_empty());
    assert!(stdout(&o).contains(&format!("| cpu | {cpu} |")), "{}", stdout(&o));
}
