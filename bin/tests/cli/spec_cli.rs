//! `rewind generate --spec ...` end to end on the embedded default model: greedy speculative output equals greedy
//! output for every drafter that needs no extra checkpoint, the stats are reported (stderr and `--json`), bad
//! values are clear errors before anything loads, and `rewind bench --verify-window` times verify steps at every
//! kept count.

use std::path::PathBuf;

use crate::common;
use common::{rewind, stderr};

fn generate_json(extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "generate",
        "one two three one two three one two",
        "--temperature",
        "0",
        "--max-tokens",
        "24",
        "--ignore-eos",
        "--json",
    ];
    args.extend_from_slice(extra);
    let o = rewind(&args);
    assert!(o.status.success(), "generate {extra:?} failed: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).expect("json")
}

#[test]
fn greedy_speculation_gives_the_plain_tokens_and_reports_its_counters() {
    let plain = generate_json(&[]);
    assert!(plain["stats"].get("spec").is_none(), "no counters without --spec");
    for spec in [
        &["--spec", "ngram"][..],
        &["--spec", "oracle:0"],
        &["--spec", "oracle:0.25", "--spec-window", "7"],
    ] {
        let out = generate_json(spec);
        assert_eq!(out["tokens"], plain["tokens"], "{spec:?}");
        let s = &out["stats"]["spec"];
        let (drafted, accepted) = (
            s["drafted"].as_u64().expect("drafted"),
            s["accepted"].as_u64().expect("accepted"),
        );
        assert!(accepted <= drafted, "{spec:?}: {s}");
        for key in [
            "steps",
            "accepted_per_step",
            "acceptance_rate",
            "window",
            "drafter",
            "policy",
        ] {
            assert!(s.get(key).is_some(), "{spec:?}: no `{key}` in {s}");
        }
        if spec[1] == "oracle:0" {
            assert!(
                drafted > 0 && accepted == drafted,
                "a perfect oracle is always accepted: {s}"
            );
        }
    }
    // The adaptive policy changes the window, never the tokens.
    let adaptive = generate_json(&["--spec", "oracle:0.25", "--spec-policy", "adaptive"]);
    assert_eq!(adaptive["tokens"], plain["tokens"]);
    // Without --json the counters go to stderr.
    let o = rewind(&[
        "generate",
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--spec",
        "oracle:0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("[spec oracle:0 T=4 fixed: drafted"),
        "{}",
        stderr(&o)
    );
}

fn refused(args: &[&str], want: &str) {
    let mut all = vec!["generate", "--max-tokens", "4"];
    all.extend_from_slice(args);
    let o = rewind(&all);
    assert!(!o.status.success(), "{args:?} was accepted");
    assert!(
        stderr(&o).contains(want),
        "{args:?}: expected `{want}` in: {}",
        stderr(&o)
    );
}

#[test]
fn bad_speculation_flags_are_clear_errors() {
    refused(
        &["--spec", "ngram", "--spec-window", "0"],
        "--spec-window must be at least 1",
    );
    refused(
        &["--spec", "ngram", "--spec-window", "8"],
        "needs an input ring of at least 18 entries",
    );
    refused(&["--spec", "bogus"], "unknown drafter `bogus`");
    refused(&["--spec", "oracle:1.5"], "oracle:P needs P in [0, 1]");
    refused(&["--spec", "draft"], "draft:DIR");
    refused(
        &["--spec", "ngram", "--spec-policy", "greedy"],
        "unknown speculation policy `greedy`",
    );
    refused(
        &["--spec", "ngram", "--ngram-min", "3", "--ngram-max", "2"],
        "n-gram range",
    );
    // A checkpoint without MTP weights (the default model's, with its MTP layer switched off).
    let plain = common::default_model_without_mtp();
    let plain = plain.path().to_str().expect("utf-8 path");
    refused(&["--model", plain, "--spec", "mtp"], "no MTP weights");
    // A draft model with another vocabulary.
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_5");
    refused(
        &["--spec", &format!("draft:{}", fixture.display())],
        "must share the target's tokenizer",
    );
    refused(
        &["--spec", "draft:/nonexistent/draft-model"],
        "/nonexistent/draft-model",
    );
}

#[test]
fn bench_times_verify_steps_at_every_kept_count() {
    let json = std::env::temp_dir().join(format!("rewind-bench-verify-{}.json", std::process::id()));
    let o = rewind(&[
        "bench",
        "--prompt-len",
        "4",
        "--decode-tokens",
        "8",
        "--repeats",
        "1",
        "--batch",
        "2",
        "--verify-window",
        "2",
        "--json",
        json.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "bench --verify-window failed: {}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json file")).expect("json");
    let _ = std::fs::remove_file(&json);
    let rows = v["verify"].as_array().expect("verify rows");
    let kept: Vec<u64> = rows.iter().map(|r| r["kept_drafts"].as_u64().expect("kept")).collect();
    assert_eq!(kept, [0, 1, 2]);
    for r in rows {
        assert_eq!((r["batch"].as_u64(), r["window"].as_u64()), (Some(2), Some(2)));
        let ms = r["step_ms_median"].as_f64().expect("ms");
        assert!(ms > 0.0 && ms.is_finite(), "{r}");
        // Tokens per second count the kept drafts and the token after them, two sequences each.
        let k = r["kept_drafts"].as_f64().expect("k");
        let tps = r["tokens_per_s"].as_f64().expect("tok/s");
        assert!((tps - 2.0 * (k + 1.0) / ms * 1e3).abs() < 1e-6 * tps, "{r}");
        // No roofline on the CPU: there is no copy bandwidth to measure against.
        assert!(r.get("roofline_fraction").is_none(), "{r}");
    }
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("| verify T = 2, 2 kept, batch 2 |"), "{text}");
    let bad = rewind(&["bench", "--verify-window", "0"]);
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("--verify-window must be at least 1"),
        "{}",
        stderr(&bad)
    );
}

#[test]
fn bench_writes_the_step_profile_that_adaptive_speculation_reads() {
    let dir = std::env::temp_dir().join(format!("rewind-step-profile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let path = dir.join("profile.json");
    let path_s = path.to_str().expect("utf8");
    let o = rewind(&[
        "bench",
        "--prompt-len",
        "4",
        "--decode-tokens",
        "8",
        "--repeats",
        "1",
        "--batch",
        "1,2",
        "--verify-window",
        "2",
        "--write-step-profile",
        path_s,
    ]);
    assert!(o.status.success(), "bench --write-step-profile failed: {}", stderr(&o));
    let p: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("profile")).expect("json");
    assert_eq!(p["step_profile_version"], 1);
    let mut points: Vec<(u64, u64)> = p["points"]
        .as_array()
        .expect("points")
        .iter()
        .map(|q| {
            let ms = q["step_ms"].as_f64().expect("step_ms");
            assert!(ms > 0.0 && ms.is_finite(), "{q}");
            (
                q["batch"].as_u64().expect("batch"),
                q["window"].as_u64().expect("window"),
            )
        })
        .collect();
    points.sort_unstable();
    assert_eq!(
        points,
        [(1, 0), (1, 2), (2, 0), (2, 2)],
        "a decode and a verify point per batch"
    );

    // The profile drives the adaptive window; the tokens stay the plain ones.
    let plain = generate_json(&[]);
    let adaptive = generate_json(&[
        "--spec",
        "oracle:0.25",
        "--spec-policy",
        "adaptive",
        "--spec-profile",
        path_s,
    ]);
    assert_eq!(adaptive["tokens"], plain["tokens"]);

    // Bad files and flags are clear errors naming the file and the field.
    let adaptive_with = |profile: &str| {
        vec![
            "--spec".to_string(),
            "ngram".into(),
            "--spec-policy".into(),
            "adaptive".into(),
            "--spec-profile".into(),
            profile.into(),
        ]
    };
    let refused_owned = |args: Vec<String>, want: &str| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        refused(&args, want)
    };
    refused_owned(adaptive_with("/nonexistent/profile.json"), "/nonexistent/profile.json");
    let bad = dir.join("bad.json");
    std::fs::write(
        &bad,
        r#"{"step_profile_version": 1, "points": [{"batch": 1, "window": 0, "step_ms": 0}]}"#,
    )
    .expect("write");
    refused_owned(adaptive_with(bad.to_str().expect("utf8")), "field `points[0].step_ms`");
    std::fs::write(&bad, "{").expect("write");
    refused_owned(adaptive_with(bad.to_str().expect("utf8")), "bad.json: malformed JSON");
    refused(
        &["--spec", "ngram", "--spec-profile", path_s],
        "--spec-profile only applies to --spec-policy adaptive",
    );
    refused(&["--spec-profile", path_s], "--spec-profile needs speculation");
    let o = rewind(&["bench", "--write-step-profile", path_s]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--verify-window"), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}
