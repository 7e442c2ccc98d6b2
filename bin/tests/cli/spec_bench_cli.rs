//! `rewind bench` takes the speculation flags of `generate`: with `--spec` the serving benchmark runs the same
//! requests plain and speculative side by side in one engine, checks that the speculative tokens are the plain ones,
//! and reports the drafter's counters and the speed-up (JSON and markdown); bad values are the same clear errors.

use crate::common;
use common::{rewind, stderr};

/// Runs the serving benchmark with `spec` and returns its JSON's `serving.speculation` object.
fn speculation(spec: &[&str]) -> serde_json::Value {
    let json = std::env::temp_dir().join(format!(
        "rewind-bench-spec-{}-{}.json",
        std::process::id(),
        spec.join("-").replace([':', '/', '.'], "_")
    ));
    let mut args = vec![
        "bench",
        "--serving-only",
        "--concurrency",
        "1",
        "--requests",
        "2",
        "--prompt-len",
        "8",
        "--decode-tokens",
        "12",
        "--repeats",
        "1",
        "--json",
        json.to_str().expect("utf8"),
    ];
    args.extend_from_slice(spec);
    let o = rewind(&args);
    assert!(o.status.success(), "bench {spec:?} failed: {}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json file")).expect("json");
    let _ = std::fs::remove_file(&json);
    assert!(
        stderr(&o).contains("[spec "),
        "{spec:?}: the counters go to stderr too: {}",
        stderr(&o)
    );
    v["serving"]["speculation"].clone()
}

#[test]
fn bench_runs_plain_and_speculative_side_by_side() {
    for spec in [
        &["--spec", "oracle:0", "--spec-window", "3"][..],
        &["--spec", "ngram", "--spec-policy", "adaptive"],
    ] {
        let s = speculation(spec);
        let r = &s["report"];
        for key in [
            "drafted",
            "accepted",
            "steps",
            "accepted_per_step",
            "acceptance_rate",
            "window",
            "drafter",
            "policy",
        ] {
            assert!(r.get(key).is_some(), "{spec:?}: no `{key}` in {r}");
        }
        let m = &s["requests_matching_reference"];
        assert_eq!(
            m["speculative"], m["of"],
            "{spec:?}: greedy speculation changed tokens: {s}"
        );
        for key in ["plain_tok_per_s_median", "spec_tok_per_s_median", "speedup"] {
            let v = s[key].as_f64().unwrap_or(f64::NAN);
            assert!(v > 0.0 && v.is_finite(), "{spec:?}: `{key}` in {s}");
        }
        if spec[1] == "oracle:0" {
            assert_eq!(r["window"], 3);
            let (drafted, accepted) = (r["drafted"].as_u64(), r["accepted"].as_u64());
            assert!(
                drafted > Some(0) && accepted == drafted,
                "a perfect oracle is always accepted: {r}"
            );
        }
    }
}

#[test]
fn bench_refuses_bad_speculation_flags() {
    let plain = common::default_model_without_mtp();
    let plain = plain.path().to_str().expect("utf-8 path");
    for (args, want) in [
        (
            &["--spec", "ngram", "--spec-window", "0"][..],
            "--spec-window must be at least 1",
        ),
        (&["--spec", "bogus"], "unknown drafter `bogus`"),
        (&["--model", plain, "--spec", "mtp"], "no MTP weights"),
    ] {
        let mut all = vec!["bench", "--serving-only", "--concurrency", "1", "--requests", "1"];
        all.extend_from_slice(args);
        let o = rewind(&all);
        assert!(!o.status.success(), "{args:?} was accepted");
        assert!(
            stderr(&o).contains(want),
            "{args:?}: expected `{want}` in: {}",
            stderr(&o)
        );
    }
}
