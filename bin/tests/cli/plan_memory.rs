//! End-to-end tests of `rewind plan-memory`: the JSON contract on real-shape presets, agreement between `--model`
//! and `--preset`, and clear errors for bad budgets and sources.

use std::process::{Command, Output};

use serde_json::Value;

fn rewind(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rewind"))
        .args(args)
        .output()
        .expect("run rewind")
}

fn plan_json(args: &[&str]) -> Value {
    let mut all = vec!["plan-memory", "--json"];
    all.extend_from_slice(args);
    let o = rewind(&all);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "plan-memory {args:?} failed: {err}");
    serde_json::from_slice(&o.stdout).expect("stdout is one JSON object")
}

fn form<'a>(plan: &'a Value, name: &str, t: u64) -> &'a Value {
    plan["forms"]
        .as_array()
        .expect("forms array")
        .iter()
        .find(|f| f["form"] == name && f["spec_window"] == t)
        .unwrap_or_else(|| panic!("no {name} row at T = {t}: {plan}"))
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not an unsigned integer: {v}"))
}

#[test]
fn json_contract_on_real_shapes() {
    for (arch, preset) in [("nemotron_h", "nemotron-h-8b"), ("qwen3_5", "qwen3.5-4b")] {
        for context in ["1024", "8192"] {
            let p = plan_json(&[
                "--arch",
                arch,
                "--preset",
                preset,
                "--budget",
                "70GiB",
                "--spec-window",
                "4",
                "--context",
                context,
            ]);
            let budget = 70u64 << 30;
            assert_eq!(u(&p["budget_bytes"]), budget);
            let weights = u(&p["weights_bytes"]);
            assert!(weights > 4 << 30 && weights < 20 << 30, "{preset}: weights {weights}");
            for f in p["forms"].as_array().expect("forms") {
                for key in ["form", "spec_window", "bytes_per_sequence", "max_sequences"] {
                    assert!(f.get(key).is_some(), "{preset}: form lacks `{key}`: {f}");
                }
                let per = u(&f["bytes_per_sequence"]);
                assert_eq!(u(&f["max_sequences"]), (budget - weights) / per, "{preset} {f}");
            }
            let base = form(&p, "spec-baseline", 4);
            let replay = form(&p, "replay", 4);
            let recurrent = form(&p, "recurrent", 0);
            // One state per sequence instead of 1 + T: the SSM part shrinks by more than 4x (at most 1 + T); the
            // attention KV, equal in both, dilutes the concurrency gain as the context grows.
            let ssm_ratio = u(&base["ssm_bytes"]) as f64 / u(&replay["ssm_bytes"]) as f64;
            assert!(
                ssm_ratio > 4.0 && ssm_ratio < 5.0,
                "{preset}: SSM bytes ratio {ssm_ratio}"
            );
            let ratio = u(&replay["max_sequences"]) as f64 / u(&base["max_sequences"]) as f64;
            assert!(
                ratio > 1.5 && ratio < ssm_ratio,
                "{preset} context {context}: ratio {ratio}"
            );
            let vs = replay["vs_baseline"].as_f64().expect("vs_baseline");
            assert!((vs - ratio).abs() < 1e-12, "{vs} vs {ratio}");
            assert!(u(&replay["bytes_per_sequence"]) > u(&recurrent["bytes_per_sequence"]));
            // The baseline keeps 1 + T copies of the recurrent state; every form reserves the same attention KV.
            assert_eq!(u(&base["ssm_bytes"]), 5 * u(&recurrent["ssm_bytes"]));
            assert_eq!(base["kv_bytes"], replay["kv_bytes"]);
        }
    }
}

#[test]
fn model_dir_and_preset_agree() {
    let dir = std::env::temp_dir().join(format!("rewind-plan-memory-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let family = rewind_engine::presets::parse_arch("qwen3_5_moe").expect("arch");
    let cfg = rewind_engine::presets::preset_config(family, "small", None, 4096, 1, 2).expect("preset");
    std::fs::write(dir.join("config.json"), cfg.to_string()).expect("write config");
    let common = ["--budget", "512MiB", "--spec-window", "2", "--context", "300"];
    let mut a = vec!["--model", dir.to_str().expect("utf8")];
    a.extend_from_slice(&common);
    let mut b = vec!["--arch", "qwen3_5_moe", "--preset", "small"];
    b.extend_from_slice(&common);
    let (pa, pb) = (plan_json(&a), plan_json(&b));
    assert_eq!(pa["forms"], pb["forms"]);
    assert_eq!(u(&pa["context"]), 300);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn context_defaults_to_the_model_limit_and_table_prints() {
    let p = plan_json(&["--arch", "nemotron_h", "--preset", "nemotron-h-8b", "--budget", "80GB"]);
    assert_eq!(u(&p["context"]), 8192);
    assert_eq!(
        p["forms"].as_array().map(Vec::len),
        Some(3),
        "T = 0: recurrent, replay, kv-only"
    );
    let o = rewind(&[
        "plan-memory",
        "--arch",
        "qwen3_5",
        "--preset",
        "qwen3.5-4b",
        "--budget",
        "70GiB",
        "--spec-window",
        "4",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for needle in ["spec-baseline", "replay", "kv-only", "max seqs", "vs base"] {
        assert!(out.contains(needle), "table lacks `{needle}`:\n{out}");
    }
}

#[test]
fn weights_over_budget_fit_nothing() {
    // The plan still shows, but the command fails (exit 1), as `rewind plan` does for weights that do not fit.
    let over = [
        "plan-memory",
        "--arch",
        "nemotron_h",
        "--preset",
        "nemotron-h-8b",
        "--budget",
        "4GiB",
    ];
    let table = rewind(&over);
    assert_eq!(table.status.code(), Some(1));
    assert!(!table.stdout.is_empty(), "the table is still printed");
    let o = rewind(&[&over[..], &["--json"]].concat());
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("exceed the budget"), "{err}");
    let p: Value = serde_json::from_slice(&o.stdout).expect("the plan is still printed");
    assert!(p["forms"]
        .as_array()
        .expect("forms")
        .iter()
        .all(|f| u(&f["max_sequences"]) == 0));
    let notes = p["notes"].to_string();
    assert!(notes.contains("exceed the budget"), "{notes}");
}

#[test]
fn bad_inputs_are_clear_errors() {
    let cases: [(&[&str], &[&str]); 6] = [
        (
            &["--arch", "nemotron_h", "--preset", "tiny", "--budget", "70XB"],
            &["--budget", "XB"],
        ),
        (
            &["--arch", "nemotron_h", "--preset", "tiny", "--budget", "0"],
            &["--budget", "positive"],
        ),
        (&["--budget", "1GiB"], &["--model", "--preset"]),
        (&["--preset", "tiny", "--budget", "1GiB"], &["--arch"]),
        (
            &["--arch", "nemotron_h", "--preset", "huge", "--budget", "1GiB"],
            &["huge", "nemotron-h-8b"],
        ),
        (
            &[
                "--arch",
                "nemotron_h",
                "--preset",
                "tiny",
                "--budget",
                "1GiB",
                "--spec-window",
                "16",
            ],
            &["--buffer-len 16", "--spec-window 16"],
        ),
    ];
    for (args, needles) in cases {
        let mut all = vec!["plan-memory"];
        all.extend_from_slice(args);
        let o = rewind(&all);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(err.contains("error:") && !err.contains("panicked"), "{args:?}: {err}");
        for n in needles {
            assert!(err.contains(n), "{args:?}: stderr lacks `{n}`: {err}");
        }
    }
}

#[test]
fn a_one_layer_model_is_one_layer() {
    let dir = std::env::temp_dir().join(format!("rewind-plan-memory-one-layer-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().expect("utf8");
    let init: Vec<&str> = "init-model --arch nemotron_h --preset tiny --layers 1 --out"
        .split(' ')
        .chain([d])
        .collect();
    let o = rewind(&init);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v = plan_json(&["--model", d, "--budget", "1GiB"]);
    let model = v["model"].as_str().expect("model");
    assert!(model.contains("(1 layer:"), "{model}");
    let _ = std::fs::remove_dir_all(&dir);
}
