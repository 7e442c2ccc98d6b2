use super::*;
use clap::Parser;

fn args(extra: &[&str]) -> BenchE2eArgs {
    let mut argv = vec!["rewind", "bench", "e2e"];
    argv.extend_from_slice(extra);
    let cli = Cli::try_parse_from(argv).expect("flags parse");
    match cli.command {
        Command::Bench(b) => match b.command {
            Some(crate::cli::BenchCommand::E2e(e)) => *e,
            other => panic!("not e2e: {other:?}"),
        },
        other => panic!("not bench: {other:?}"),
    }
}

fn refused(extra: &[&str], needle: &str) {
    let e = check(&args(extra))
        .err()
        .unwrap_or_else(|| panic!("{extra:?} was accepted"));
    assert!(e.to_string().contains(needle), "{extra:?}: `{e}` lacks `{needle}`");
}

#[test]
fn defaults_are_the_issue_sweep() {
    let s = check(&args(&[])).expect("defaults");
    assert!(s.gpu);
    assert_eq!(s.forms, vec!["recurrent", "replay", "spec"]);
}

#[test]
fn bad_flags_are_named() {
    refused(&["--device", "tpu"], "--device `tpu`");
    refused(&["--batch", "0"], "--batch sizes must be positive");
    refused(&["--forms", "turbo"], "unknown form `turbo`");
    refused(&["--forms", "replay,replay"], "names `replay` twice");
    refused(&["--repeats", "0"], "--repeats");
    refused(&["--forms", "spec", "--spec-window", "0"], "--spec-window");
    refused(&["--device", "cpu"], "pass --no-concurrency with --device cpu");
    refused(&["--admit-budget-gib", "-1"], "--admit-budget-gib");
    refused(&["--dtype", "fp8"], "--dtype `fp8`");
    refused(&["--layers", "nemotron-h-8b"], "expected PRESET=N");
    refused(&["--layers", "nemotron-h-8b=0"], "positive integer");
    refused(&["--models", "gpt-5"], "unknown preset `gpt-5`");
    refused(&["--models", "tiny"], "several families");
    refused(&["--concurrency", "0"], "--concurrency must be at least 1");
}

#[test]
fn forms_run_in_a_fixed_order() {
    let s = check(&args(&["--forms", "spec,kv-only,recurrent", "--no-concurrency"])).expect("ok");
    assert_eq!(s.forms, vec!["recurrent", "kv-only", "spec"]);
}

#[test]
fn presets_resolve_by_family_when_names_repeat() {
    let (f, n) = preset("qwen3_5:tiny").expect("qualified");
    assert_eq!((f, n), (rewind_engine::model::Family::Qwen35, "tiny"));
    assert!(preset("nemotron-h-8b").is_ok());
    assert!(preset("llama:tiny").is_err());
}

fn bench_run() -> Value {
    json!({
        "copy_gb_s": 3000.0,
        "device": "GPU",
        "prefill_tok_per_s": 1000.0,
        "decode": [
            {"batch": 1, "decode_tok_per_s": [100.0, 110.0, 90.0], "decode_tok_per_s_median": 100.0,
             "step_ms_median": 10.0, "byte_model_bytes": 2.7e10, "roofline_ms": 9.0, "roofline_fraction": 0.9},
            {"batch": 4, "decode_tok_per_s": [400.0], "decode_tok_per_s_median": 400.0, "step_ms_median": 10.0}
        ],
        "verify": [
            {"batch": 1, "window": 2, "kept_drafts": 0, "step_ms": [11.0], "step_ms_median": 11.0, "tokens_per_s": 90.9},
            {"batch": 1, "window": 2, "kept_drafts": 2, "step_ms": [12.0], "step_ms_median": 12.0, "tokens_per_s": 250.0}
        ]
    })
}

#[test]
fn rows_carry_the_bench_numbers() {
    let r = bench_run();
    let mut steps = rows::decode_rows("recurrent", &r).expect("decode rows");
    assert_eq!(steps.len(), 2);
    assert_eq!(steps[0]["step_ms_repeats"], json!([10.0, 1e3 / 110.0, 1e3 / 90.0]));
    assert_eq!(steps[0]["roofline_fraction"], json!(0.9));
    assert!(steps[1]["roofline_fraction"].is_null(), "the CPU has no roofline");
    let spec = rows::verify_rows(&r).expect("verify rows");
    assert_eq!(spec[1]["tokens_per_step"], json!(3));
    assert_eq!(spec[1]["kept"], json!(2));
    steps.extend(spec);
    rows::speedups(&mut steps);
    assert_eq!(steps[0]["speedup_vs_recurrent"], json!(1.0));
    assert_eq!(steps[3]["speedup_vs_recurrent"], json!(2.5));
    // Batch 4 has a recurrent row too; nothing else at batch 4.
    assert_eq!(steps[1]["speedup_vs_recurrent"], json!(1.0));
}

#[test]
fn a_malformed_bench_run_is_an_error() {
    assert!(rows::decode_rows("replay", &json!({})).is_err());
    assert!(rows::decode_rows("replay", &json!({"decode": [{"batch": 1}]})).is_err());
    assert!(rows::verify_rows(&json!({"decode": []})).is_err());
    assert!(rows::serving(&json!({"concurrency": 2})).is_err());
}

#[test]
fn markdown_lists_every_row() {
    let r = bench_run();
    let mut steps = rows::decode_rows("replay", &r).expect("rows");
    steps.extend(rows::verify_rows(&r).expect("rows"));
    let report = json!({
        "device": "GPU", "copy_gb_s": 3000.0, "dtype": "bf16", "date": "d", "commit": "c", "command": "x",
        "models": [{"name": "m", "summary": "s", "prefill_tok_per_s": {"replay": 1000.0}, "steps": steps,
                    "serving": Value::Null,
                    "concurrency": {"context": 1024, "budget_gib": 8.0, "spec_window": 4,
                                    "snapshot": {"admitted": 10, "planned": 11},
                                    "replay": {"admitted": 45, "planned": 46}, "ratio": 4.5}}]
    });
    let md = rows::markdown(&report);
    assert_eq!(md.matches("\n| replay |").count(), 2, "{md}");
    assert_eq!(md.matches("\n| spec |").count(), 2, "{md}");
    assert!(md.contains("| 2 / 2 |"), "{md}");
    assert!(md.contains("replay admitted 45: 4.50×"), "{md}");
}
