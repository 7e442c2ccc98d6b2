//! `rewind generate` and `rewind bench` flags end to end: device flags are checked on every device (with a note when
//! a GPU-only flag does nothing on the CPU), negative numbers are clear errors, the finish reason reads the same on
//! stderr as in JSON, prompts come from stdin or a file, `--system` adds a system message, checkpoint loading reports
//! progress, and the `--help` examples. `bench`'s own flags are in `bench_flags.rs`.

use std::path::Path;
use std::process::{Command, Output};

use crate::cli_flags;
use crate::common;
use cli_flags::{assert_fails, assert_ok, s, stdout, temp_dir, tiny_model};
use common::{rewind, rewind_stdin, stderr};

/// `generate --json` on `model` with `extra` flags (greedy, 6 tokens unless overridden later in `extra`).
fn generate_json(model: &Path, extra: &[&str], input: Option<&str>) -> (serde_json::Value, Output) {
    let mut args = vec!["generate", "--model", s(model), "--temperature", "0", "--json"];
    args.extend_from_slice(extra);
    if !args.contains(&"--max-tokens") {
        args.extend_from_slice(&["--max-tokens", "6"]);
    }
    let o = match input {
        Some(i) => rewind_stdin(&args, i),
        None => rewind(&args),
    };
    assert_ok(&o, &format!("generate {extra:?}"));
    let v = serde_json::from_str(stdout(&o).trim()).expect("one JSON object on stdout");
    (v, o)
}

#[test]
fn device_flags_are_checked_on_every_device() {
    let model = tiny_model("device");
    let m = s(&model);
    let out = temp_dir("device-files").join("logits.json");
    let logits: Vec<&str> = vec![
        "logits",
        "--model",
        m,
        "--tokens",
        "1,2",
        "--prefill",
        "1",
        "--out",
        s(&out),
    ];
    let generate: Vec<&str> = vec!["generate", "--model", m, "--max-tokens", "2"];
    let bench: Vec<&str> = vec![
        "bench",
        "--model",
        m,
        "--prompt-len",
        "4",
        "--decode-tokens",
        "1",
        "--repeats",
        "1",
    ];
    for base in [&generate, &bench, &logits] {
        for (flag, value, needle) in [
            ("--dtype", "f16", "--dtype"),
            (
                "--gpu-memory-fraction",
                "5",
                "--gpu-memory-fraction 5 is outside (0, 1]",
            ),
            (
                "--gpu-memory-fraction",
                "0",
                "--gpu-memory-fraction 0 is outside (0, 1]",
            ),
            (
                "--gpu-memory-fraction",
                "-0.5",
                "--gpu-memory-fraction -0.5 is outside (0, 1]",
            ),
            (
                "--gpu-memory-fraction",
                "NaN",
                "--gpu-memory-fraction NaN is outside (0, 1]",
            ),
            ("--max-seqs", "0", "--max-seqs must be at least 1"),
            ("--prefill-chunk", "0", "--prefill-chunk must be at least 1"),
            ("--max-model-len", "0", "--max-model-len must be at least 1"),
        ] {
            let mut args = base.clone();
            args.extend_from_slice(&["--device", "cpu", flag, value]);
            assert_fails(&rewind(&args), &[needle]);
        }
    }
    // Good values of GPU-only flags on the CPU run, with one note each; the defaults earn none.
    for base in [&generate, &bench] {
        let mut args = base.clone();
        args.extend_from_slice(&[
            "--device",
            "cpu",
            "--gpu-memory-fraction",
            "0.5",
            "--max-seqs",
            "3",
            "--dtype",
            "f32",
            "--no-cuda-graphs",
            "--stage-profile",
        ]);
        let o = rewind(&args);
        assert_ok(&o, "GPU-only flags on the CPU");
        let notes: Vec<String> = stderr(&o)
            .lines()
            .filter(|l| l.starts_with("note:"))
            .map(str::to_string)
            .collect();
        assert_eq!(
            notes,
            [
                "note: --gpu-memory-fraction does not apply to --device cpu",
                "note: --max-seqs does not apply to --device cpu",
                "note: --dtype does not apply to --device cpu",
                "note: --no-cuda-graphs does not apply to --device cpu",
                "note: --stage-profile does not apply to --device cpu",
                // The model is an init-model checkpoint.
                "note: this model has RANDOM weights (made by `rewind init-model`): its output is noise",
            ],
            "{}",
            stderr(&o)
        );
        let o = rewind(base);
        assert_ok(&o, "defaults");
        assert!(!stderr(&o).contains("does not apply"), "{}", stderr(&o));
    }
    // The GPU-only flags have a heading of their own in --help; the device and --tp stay with the other options.
    for cmd in ["generate", "bench", "logits"] {
        let help = stdout(&rewind(&[cmd, "--help"]));
        let heading = help
            .find("\nGPU:\n")
            .unwrap_or_else(|| panic!("{cmd} --help has no GPU heading: {help}"));
        for flag in [
            "--gpu-memory-fraction",
            "--max-seqs",
            "--max-model-len",
            "--prefill-chunk",
            "--dtype",
            "--no-cuda-graphs",
            "--stage-profile",
        ] {
            assert!(
                help.find(flag).is_some_and(|i| i > heading),
                "{cmd}: {flag} not under GPU: {help}"
            );
        }
        for flag in ["--device <DEVICE>", "--tp <TP>"] {
            assert!(
                help.find(flag).is_some_and(|i| i < heading),
                "{cmd}: {flag} under GPU: {help}"
            );
        }
    }
}

#[test]
fn negative_numbers_are_clear_errors() {
    let model = tiny_model("negative");
    let m = s(&model);
    for args in [
        vec!["generate", "--model", m, "--max-tokens", "-1"],
        vec!["generate", "--model", m, "--seed", "-1"],
        vec!["generate", "--model", m, "--top-k", "-3"],
        vec!["generate", "--model", m, "--stop-token-id", "-2"],
        vec!["generate", "--model", m, "--tp", "-1"],
        vec!["generate", "--model", m, "--max-seqs", "-4"],
        vec!["generate", "--model", m, "--max-batch-tokens", "-1"],
        vec!["bench", "--model", m, "--decode-tokens", "-1"],
        vec!["bench", "--model", m, "--prompt-len", "-10"],
        vec!["bench", "--model", m, "--repeats", "-1"],
        vec!["bench", "--model", m, "--batch", "1,-2"],
        vec!["bench", "--model", m, "--concurrency", "-1"],
    ] {
        let o = rewind(&args);
        let flag = args[3];
        assert_fails(&o, &[flag, "must be a non-negative integer"]);
        assert!(!stderr(&o).contains("unexpected argument"), "{args:?}: {}", stderr(&o));
    }
    assert_fails(
        &rewind(&["generate", "--model", m, "--max-tokens", "lots"]),
        &["--max-tokens", "must be a non-negative integer, got `lots`"],
    );
    // Negative numbers where the engine checks the value reach that check instead of clap's "unexpected argument".
    assert_fails(
        &rewind(&["generate", "--model", m, "--step-timeout", "-1"]),
        &["--step-timeout must be a positive number"],
    );
}

#[test]
fn finish_reason_reads_the_same_on_stderr_as_in_json() {
    let model = tiny_model("finish");
    let (v, _) = generate_json(&model, &["hello"], None);
    let text = v["text"].as_str().expect("text").to_string();
    // The first character the model writes, as a stop string, ends the request with `stop_string`.
    let stop: String = text.chars().take(1).collect();
    assert!(!stop.is_empty(), "no text generated: {v}");
    let (v, _) = generate_json(&model, &["hello", "--stop", &stop], None);
    assert_eq!(v["stats"]["finish_reason"], "stop_string", "{v}");
    let o = rewind(&[
        "generate",
        "hello",
        "--model",
        s(&model),
        "--temperature",
        "0",
        "--max-tokens",
        "6",
        "--stop",
        &stop,
    ]);
    assert_ok(&o, "generate --stop");
    let err = stderr(&o);
    assert!(err.contains("| finish: stop_string |"), "{err}");
    assert!(!err.contains("StopString"), "{err}");
    // Seeded: an unseeded draw could end on EOS before the length limit.
    let o = rewind(&[
        "generate",
        "hello",
        "--model",
        s(&model),
        "--max-tokens",
        "2",
        "--seed",
        "7",
        "--ignore-eos",
    ]);
    assert_ok(&o, "generate");
    assert!(stderr(&o).contains("| finish: length |"), "{}", stderr(&o));
}

#[test]
fn prompts_from_stdin_or_a_file_and_a_system_message() {
    let model = tiny_model("prompt");
    let dir = temp_dir("prompt-files");
    let prompt = "The tide comes in";
    let (want, _) = generate_json(&model, &[prompt], None);
    // `-` reads stdin; one trailing newline (as `echo` writes) is dropped.
    for input in [prompt.to_string(), format!("{prompt}\n"), format!("{prompt}\r\n")] {
        let (got, _) = generate_json(&model, &["-"], Some(&input));
        assert_eq!(got["tokens"], want["tokens"], "stdin {input:?}");
        assert_eq!(
            got["stats"]["prompt_tokens"], want["stats"]["prompt_tokens"],
            "stdin {input:?}"
        );
    }
    let file = dir.join("prompt.txt");
    std::fs::write(&file, format!("{prompt}\n")).expect("write prompt");
    let (got, _) = generate_json(&model, &["--prompt-file", s(&file)], None);
    assert_eq!(got["tokens"], want["tokens"]);
    assert_eq!(got["stats"]["prompt_tokens"], want["stats"]["prompt_tokens"]);
    // `--prompt-file -` reads stdin too, as the synopsis offers.
    let (got, _) = generate_json(&model, &["--prompt-file", "-"], Some(&format!("{prompt}\n")));
    assert_eq!(got["tokens"], want["tokens"]);
    assert_eq!(got["stats"]["prompt_tokens"], want["stats"]["prompt_tokens"]);
    // A different prompt is really read (not the default one).
    let (other, _) = generate_json(&model, &["-"], Some("Something else entirely, and longer than that"));
    assert_ne!(other["stats"]["prompt_tokens"], want["stats"]["prompt_tokens"]);

    let m = s(&model);
    let missing = dir.join("missing.txt");
    assert_fails(
        &rewind(&["generate", "--model", m, "--prompt-file", s(&missing)]),
        &["missing.txt"],
    );
    assert_fails(
        &rewind(&["generate", "hi", "--model", m, "--prompt-file", s(&file)]),
        &["--prompt-file"],
    );
    assert_fails(&rewind_stdin(&["generate", "--model", m, "-"], ""), &["stdin", "empty"]);

    // --system adds a system message to the chat template's rendering.
    assert_fails(
        &rewind(&["generate", "hi", "--model", m, "--system", "Be brief."]),
        &["--system", "--chat"],
    );
    let (plain, _) = generate_json(&model, &[prompt, "--chat"], None);
    let (with_system, _) = generate_json(&model, &[prompt, "--chat", "--system", "Be brief."], None);
    let n = |v: &serde_json::Value| v["stats"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    assert!(n(&with_system) > n(&plain) + 3, "{with_system} vs {plain}");
    // From stdin with --chat and --system as well.
    let (piped, _) = generate_json(
        &model,
        &["-", "--chat", "--system", "Be brief."],
        Some(&format!("{prompt}\n")),
    );
    assert_eq!(piped["tokens"], with_system["tokens"]);
}

#[test]
fn help_shows_examples() {
    for (cmd, example) in [
        ("generate", "rewind generate - "),
        ("generate", "--prompt-file"),
        ("bench", "rewind bench --model"),
        ("bench", "--concurrency"),
    ] {
        let o = rewind(&[cmd, "--help"]);
        assert_ok(&o, "--help");
        let help = stdout(&o);
        let examples = help
            .find("Examples:")
            .unwrap_or_else(|| panic!("{cmd} --help has no examples: {help}"));
        assert!(
            help[examples..].contains(example),
            "{cmd} --help examples lack `{example}`: {help}"
        );
    }
}

#[test]
fn every_subcommand_help_has_examples() {
    for cmd in [
        "generate",
        "logits",
        "perplexity",
        "init-model",
        "bench",
        "plan-memory",
        "selftest",
    ] {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_rewind"))
            .args([cmd, "--help"])
            .output()
            .expect("run rewind");
        let help = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{cmd} --help failed");
        assert!(
            help.contains("Examples:") && help.contains(&format!("rewind {cmd} ")),
            "{cmd} --help has no example: {help}"
        );
    }
}

#[test]
fn loading_and_writing_a_checkpoint_report_progress() {
    let dir = std::env::temp_dir().join(format!("rewind-progress-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_rewind"))
            .args(args)
            .env("RUST_LOG", "rewind::progress=info")
            .output()
            .expect("run rewind")
    };
    let d = dir.to_str().expect("utf8");
    let o = run(&["init-model", "--arch", "nemotron_h", "--preset", "tiny", "--out", d]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && err.contains("writing") && err.contains("done in"),
        "{err}"
    );
    let o = run(&["generate", "hi", "--model", d, "--max-tokens", "2"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && err.contains("loading rank 0 of 1") && err.contains("done in"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Values that used to panic or spawn threads without end (fuzzing): a TP size no model can split is refused before
/// any rank starts, and a timeout too long to add to a clock is refused by name.
#[test]
fn huge_tp_and_timeouts_are_clear_errors() {
    let model = tiny_model("huge-values");
    for tp in ["18446744073709551615", "1000000"] {
        let o = rewind(&["generate", "--model", s(&model), "--max-tokens", "2", "--tp", tp, "hi"]);
        assert_fails(&o, &[&format!("--tp {tp} cannot split this model"), "exceeds"]);
    }
    let o = rewind(&[
        "generate",
        "--model",
        s(&model),
        "--max-tokens",
        "2",
        "--step-timeout",
        "1e300",
        "hi",
    ]);
    assert_fails(
        &o,
        &["--step-timeout must be at most 31536000 seconds (a year), got 1e300"],
    );
}

/// The OpenAI sampling fields are flags of `generate` too: a logit bias forces or bans a token, `--min-tokens`
/// keeps a forced end-of-sequence token from ending the output, and bad values are clear errors naming the field.
#[test]
fn generate_takes_logit_bias_penalties_and_min_tokens() {
    let model = tiny_model("logit-bias");
    let tokens = |v: &serde_json::Value| -> Vec<u64> {
        v["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .filter_map(|t| t.as_u64())
            .collect()
    };
    let (forced, _) = generate_json(&model, &["--ignore-eos", "--logit-bias", "5=100", "hello"], None);
    assert_eq!(tokens(&forced), vec![5; 6], "{forced}");
    let (plain, _) = generate_json(&model, &["--ignore-eos", "hello"], None);
    let first = tokens(&plain)[0];
    let ban = format!("{first}=-100");
    let (banned, _) = generate_json(&model, &["--ignore-eos", "--logit-bias", &ban, "hello"], None);
    assert!(!tokens(&banned).contains(&first), "{banned}");
    let (penalised, _) = generate_json(
        &model,
        &[
            "--ignore-eos",
            "--presence-penalty",
            "2",
            "--frequency-penalty",
            "2",
            "hello",
        ],
        None,
    );
    assert_eq!(tokens(&penalised).len(), 6, "{penalised}");
    // The end-of-sequence token (2 in the tiny preset) forced: it ends the output at once, or after 3 tokens.
    let (at_once, _) = generate_json(&model, &["--logit-bias", "2=100", "hello"], None);
    assert_eq!(tokens(&at_once), vec![2], "{at_once}");
    let (held, _) = generate_json(&model, &["--logit-bias", "2=100", "--min-tokens", "3", "hello"], None);
    let held = tokens(&held);
    assert_eq!((held.len(), held[3]), (4, 2), "{held:?}");
    assert!(!held[..3].contains(&2), "{held:?}");
    for (flag, value, want) in [
        ("--logit-bias", "5=300", "logit_bias[5]"),
        ("--logit-bias", "5", "ID=BIAS"),
        ("--presence-penalty", "3", "presence_penalty"),
        ("--frequency-penalty", "-2.5", "frequency_penalty"),
    ] {
        let o = rewind(&["generate", "--model", s(&model), flag, value, "hello"]);
        assert_fails(&o, &[want]);
    }
}
