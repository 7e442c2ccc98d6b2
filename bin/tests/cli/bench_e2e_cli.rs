//! `rewind bench e2e` end to end on the CPU backend (tiny random models of two families): every form's rows, the spec
//! rows at every kept count, serving through the coordinator, the JSON schema `rewind bench plot` reads, and the
//! markdown; and on a machine without CUDA, the GPU sweep is one clear error.

use crate::common;
use common::{rewind, stderr};
use serde_json::Value;

#[test]
fn the_cpu_sweep_writes_every_row() {
    let dir = std::env::temp_dir().join(format!("rewind-e2e-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (json, md) = (dir.join("e2e.json"), dir.join("e2e.md"));
    let work = dir.join("models");
    let o = rewind(&[
        "bench",
        "e2e",
        "--device",
        "cpu",
        "--models",
        "nemotron_h:tiny,qwen3_5:tiny",
        "--batch",
        "1,2",
        "--forms",
        "recurrent,replay,kv-only,spec",
        "--spec-window",
        "2",
        "--decode-tokens",
        "3",
        "--repeats",
        "1",
        "--no-concurrency",
        "--concurrency",
        "2",
        "--requests",
        "3",
        "--serving-prompt",
        "6",
        "--serving-tokens",
        "3",
        "--work-dir",
        work.to_str().expect("utf-8"),
        "--json",
        json.to_str().expect("utf-8"),
        "--markdown",
        md.to_str().expect("utf-8"),
    ]);
    assert!(o.status.success(), "stderr: {}", stderr(&o));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json written")).expect("json");
    assert_eq!(v["kind"], "rewind-bench-e2e");
    let models = v["models"].as_array().expect("models");
    assert_eq!(models.len(), 2);
    assert!(models[0]["summary"]
        .as_str()
        .expect("summary")
        .starts_with("nemotron_h"));
    assert!(models[1]["summary"].as_str().expect("summary").starts_with("qwen3_5"));
    for m in models {
        let steps = m["steps"].as_array().expect("steps");
        for form in ["recurrent", "replay", "kv-only"] {
            let rows: Vec<&Value> = steps.iter().filter(|s| s["form"] == form).collect();
            assert_eq!(rows.len(), 2, "{form}: one row per batch");
        }
        let spec: Vec<&Value> = steps.iter().filter(|s| s["form"] == "spec").collect();
        assert_eq!(spec.len(), 6, "spec: 2 batches × kept 0, 1, 2");
        for s in steps {
            assert!(s["step_ms"].as_f64().expect("step_ms") > 0.0);
            let (batch, kept) = (s["batch"].as_u64().expect("batch"), s["kept"].as_u64().expect("kept"));
            assert_eq!(s["tokens_per_step"].as_u64(), Some(batch * (kept + 1)));
            assert!(
                s["speedup_vs_recurrent"].as_f64().is_some(),
                "every batch has a recurrent row: {s}"
            );
            assert!(s["roofline_fraction"].is_null(), "the CPU has no byte roofline");
        }
        let serving = &m["serving"];
        assert_eq!(serving["requests"], 3);
        assert!(serving["output_tok_per_s"].as_f64().expect("tok/s") > 0.0);
        assert!(m["concurrency"].is_null());
    }
    let text = std::fs::read_to_string(&md).expect("markdown written");
    assert!(
        text.contains("## nemotron_h:tiny") && text.contains("## qwen3_5:tiny"),
        "{text}"
    );
    assert!(text.contains("| spec | 2 | 2 / 2 |"), "{text}");
    assert!(text.contains("Serving through the coordinator"), "{text}");
    // The models were written where --work-dir said, one directory each.
    assert!(work.join("nemotron_h-tiny/config.json").exists());
    assert!(work.join("qwen3_5-tiny/config.json").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn flag_errors_come_before_any_work() {
    let o = rewind(&["bench", "e2e", "--device", "cpu"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("pass --no-concurrency with --device cpu"),
        "{}",
        stderr(&o)
    );
    let o = rewind(&["bench", "e2e", "--forms", "warp"]);
    assert!(stderr(&o).contains("unknown form `warp`"), "{}", stderr(&o));
}

/// Without a driver (CI) the GPU sweep is one clear error, before any checkpoint is written.
#[test]
fn without_a_driver_the_gpu_sweep_is_a_clear_error() {
    if rewind_engine::gpu::device::device_count().is_ok() {
        eprintln!("a CUDA driver is present: the no-driver path is not exercised here");
        return;
    }
    let o = rewind(&[
        "bench",
        "e2e",
        "--models",
        "nemotron_h:tiny",
        "--no-serving",
        "--no-concurrency",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    assert!(stderr(&o).contains("CUDA"), "{}", stderr(&o));
}
