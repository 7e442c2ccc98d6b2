//! End-to-end tests of `rewind plan`: the JSON shape with every term, calibration beside every projection, and clear
//! errors for bad GPU profiles, impossible tensor-parallel sizes and contexts that do not fit.

use std::process::{Command, Output};

use serde_json::Value;

fn rewind(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rewind"))
        .args(args)
        .output()
        .expect("run rewind")
}

fn ok(args: &[&str]) -> String {
    let o = rewind(args);
    assert!(
        o.status.success(),
        "rewind {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).expect("utf-8")
}

fn fails(args: &[&str]) -> String {
    let o = rewind(args);
    assert!(!o.status.success(), "rewind {args:?} should fail");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Writes a GPU profile to a fresh temporary file and returns its path.
fn profile_file(name: &str, json: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("rewind-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    std::fs::write(&path, json).expect("write profile");
    path
}

const N8B: [&str; 5] = ["plan", "--arch", "nemotron_h", "--preset", "nemotron-h-8b"];

fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut v: Vec<&str> = N8B.to_vec();
    v.extend_from_slice(extra);
    v
}

#[test]
fn json_has_every_term_per_context_and_form() {
    let out = ok(&with(&[
        "--gpu",
        "h200",
        "--tp",
        "2",
        "--context",
        "1024,8192",
        "--json",
    ]));
    let v: Value = serde_json::from_str(&out).expect("one JSON object");
    let plans = v["plans"].as_array().expect("plans");
    assert_eq!(plans.len(), 2);
    for (p, context) in plans.iter().zip([1024, 8192]) {
        assert_eq!(p["input"]["context"], context);
        assert_eq!(p["input"]["tp"], 2);
        assert_eq!(p["gpu"]["name"], "h200");
        assert_eq!(p["ranks"].as_array().expect("ranks").len(), 2);
        for r in p["ranks"].as_array().expect("ranks") {
            assert!(r["weight_bytes"].as_u64().expect("weights") > 7_000_000_000);
            assert_eq!(r["ssm_bytes_per_seq"].as_array().expect("per form").len(), 4);
        }
        let forms: Vec<&str> = p["forms"]
            .as_array()
            .expect("forms")
            .iter()
            .map(|f| f["form"].as_str().expect("name"))
            .collect();
        assert_eq!(forms, ["recurrent", "replay", "kv-only", "replay-spec"]);
        let decode = p["decode"].as_array().expect("decode");
        assert_eq!(decode.len(), 16, "4 forms x batches 1, 64, 256, max");
        for s in decode {
            for key in [
                "batch",
                "rows",
                "dense_weight_bytes",
                "expert_bytes",
                "ssm_bytes",
                "kv_bytes",
                "total_bytes",
                "hbm_ms",
                "flops",
                "compute_ms",
                "all_reduces",
                "all_reduce_ms",
                "step_ms",
                "tokens_per_s",
                "aggregate_tokens_per_s",
            ] {
                assert!(s[key].is_number(), "decode row lacks `{key}`: {s}");
            }
            assert!(
                s["all_reduce_ms"].as_f64().expect("comm") > 0.0,
                "TP 2 all-reduces: {s}"
            );
            let c = &s["calibrated"];
            assert!(c["ratio"].as_f64().expect("ratio") > 1.0, "{s}");
            assert!(c["file"].as_str().expect("file").starts_with("gpu-"), "{s}");
        }
        assert!(p["prefill"]["tokens_per_s"].as_f64().expect("prefill") > 0.0);
    }
    assert!(v["calibration"].as_array().expect("calibration").len() >= 10);
}

#[test]
fn tables_print_the_ratio_beside_each_projection() {
    let out = ok(&with(&["--gpu", "h100", "--context", "4096"]));
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("recurrent ")).collect();
    assert!(rows.len() >= 5, "{out}");
    for l in rows.iter().skip(1) {
        assert!(
            l.contains("x measured/model = ") && l.contains("from bench/results/"),
            "{l}"
        );
    }
    let md = ok(&with(&[
        "--gpu",
        "b300",
        "--tp",
        "2",
        "--replicas",
        "4",
        "--context",
        "4096,8192",
        "--markdown",
    ]));
    assert!(md.starts_with("| model | GPUs | layout | context |"), "{md}");
    assert!(md.contains("| 8 × B300 | TP 2 × 4 | 8K |"), "{md}");
    let cal = ok(&["plan", "--calibration"]);
    assert!(cal.contains("gpu-replay-forms-nemotron-h-8b-2026-11-24.json"), "{cal}");
}

#[test]
fn bad_profiles_are_clear_errors() {
    let e = fails(&with(&["--gpu", "a100"]));
    assert!(e.contains("unknown --gpu `a100`") && e.contains("b300"), "{e}");
    let missing = profile_file(
        "missing.json",
        r#"{"name": "x", "memory_gb": 80, "hbm_tb_s": 3, "bf16_dense_tflops": 900}"#,
    );
    let e = fails(&with(&["--gpu-spec", missing.to_str().expect("path")]));
    assert!(e.contains("nvlink_gb_s") && e.contains("missing.json"), "{e}");
    let negative = profile_file(
        "negative.json",
        r#"{"name": "x", "memory_gb": 80, "hbm_tb_s": -3, "bf16_dense_tflops": 900, "nvlink_gb_s": 450}"#,
    );
    let e = fails(&with(&["--gpu-spec", negative.to_str().expect("path")]));
    assert!(e.contains("hbm_tb_s") && e.contains("positive"), "{e}");
    let good = profile_file(
        "good.json",
        r#"{"name": "mine", "memory_gb": 96, "hbm_tb_s": 4, "bf16_dense_tflops": 900, "nvlink_gb_s": 450}"#,
    );
    let out = ok(&with(&[
        "--gpu-spec",
        good.to_str().expect("path"),
        "--context",
        "2048",
    ]));
    assert!(out.contains("gpu          mine"), "{out}");
    let e = fails(&with(&[
        "--gpu-spec",
        missing.with_file_name("absent.json").to_str().expect("path"),
    ]));
    assert!(e.contains("absent.json"), "{e}");
    let e = fails(&with(&[]));
    assert!(e.contains("--gpu"), "{e}");
}

#[test]
fn impossible_layouts_and_contexts_are_clear_errors() {
    let e = fails(&with(&["--gpu", "h100", "--tp", "1024"]));
    assert!(e.contains("--tp 1024") && e.contains("exceeds"), "{e}");
    let e = fails(&with(&["--gpu", "h100", "--context", "999999999"]));
    assert!(e.contains("max_position_embeddings"), "{e}");
    // 16.2 GB of weights leave no room on an 18.1 GB GPU (0.9 of it usable) for a sequence of the model's whole context.
    let small = profile_file(
        "small.json",
        r#"{"name": "small", "memory_gb": 18.1, "hbm_tb_s": 3, "bf16_dense_tflops": 900, "nvlink_gb_s": 450}"#,
    );
    let e = fails(&with(&[
        "--gpu-spec",
        small.to_str().expect("path"),
        "--context",
        "8192",
    ]));
    assert!(e.contains("a context of 8192 tokens does not fit"), "{e}");
    let e = fails(&with(&["--gpu", "h100", "--tp", "3", "--nodes", "2"]));
    assert!(e.contains("--nodes"), "{e}");
    let e = fails(&with(&["--gpu", "h100", "--forms", "fast"]));
    assert!(e.contains("unknown decode form `fast`"), "{e}");
    let e = fails(&with(&["--gpu", "h100", "--acceptance", "1.5"]));
    assert!(e.contains("--acceptance"), "{e}");
}

/// A batch too large for the byte model's arithmetic is refused by name instead of overflowing (fuzzing).
#[test]
fn a_huge_batch_is_refused() {
    let e = fails(&with(&["--gpu", "h100", "--batch", "18446744073709551615"]));
    assert!(
        e.contains("--batch: `18446744073709551615` is neither a batch size from 1 to 16777216"),
        "{e}"
    );
}
