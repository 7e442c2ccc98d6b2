//! `rewind generate --spec ...` end to end on the embedded default model: greedy speculative output equals greedy
//! output for every drafter that needs no extra checkpoint, the stats are reported (stderr and `--json`), and bad
//! values are clear errors before anything loads.

use std::path::PathBuf;

mod common;
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
    // The default model has no MTP weights.
    refused(&["--spec", "mtp"], "no MTP weights");
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
