//! Synthetic benchmark results for the tests, in the schemas `rewind bench plot` reads.

use serde_json::{json, Value};

use super::inputs::E2E_KIND;

/// A small e2e result: recurrent, replay, kv-only (no roofline) and spec T=4 kept 0 … 4 at four batches.
pub fn e2e_json() -> Value {
    let step = |form: &str, batch: u64, window: u64, kept: u64, ms: f64, roof: Option<f64>| {
        json!({"form": form, "batch": batch, "window": window, "kept": kept, "tokens_per_step": 1 + kept,
               "step_ms": ms, "step_ms_repeats": [ms], "tokens_per_s": batch as f64 * (1 + kept) as f64 / ms * 1e3,
               "bytes": roof.map(|r| r * 3e6), "roofline_ms": roof,
               "roofline_fraction": roof.map(|r| r / ms), "speedup_vs_recurrent": null})
    };
    let mut steps = Vec::new();
    for (b, s) in [(1u64, 1.0), (8, 1.5), (64, 4.0), (256, 12.0)] {
        steps.push(step("recurrent", b, 0, 0, 2.0 * s, Some(1.6 * s)));
        steps.push(step("replay", b, 0, 0, 1.6 * s, Some(1.4 * s)));
        steps.push(step("kv-only", b, 0, 0, 1.2 * s, None));
        for kept in 0..=4 {
            steps.push(step("spec", b, 4, kept, 3.0 * s + 0.1 * kept as f64, Some(2.4 * s)));
        }
    }
    json!({"kind": E2E_KIND, "command": "rewind bench e2e --json e2e.json", "date": "2026-11-26T10:00:00Z",
           "date_unix": 1_795_000_000u64, "commit": "abc1234", "device": "NVIDIA H100 80GB HBM3",
           "copy_gb_s": 3000.0, "dtype": "bf16",
           "models": [{"name": "nemotron-h-8b", "summary": "52 layers", "steps": steps,
                       "serving": {"concurrency": 64, "requests": 256, "output_tok_per_s": 9000.0,
                                   "ttft_ms_p50": 40.0, "ttft_ms_p99": 90.0, "itl_ms_p50": 7.0, "itl_ms_p99": 9.0},
                       "concurrency": null}]})
}

/// A kernels row in `row_json`'s schema.
pub fn kernel_row(imp: &str, family: &str, kernel: &str, ring: Option<u64>, t: u64, batch: u64) -> Value {
    let ms = 0.01 * batch as f64 * t as f64;
    let gbs = 2000.0 * (batch as f64).ln_1p() / (1.0 + (batch as f64).ln_1p());
    json!({"impl": imp, "family": family, "kernel": kernel, "label": null, "batch": batch, "ring_len": ring,
           "window": t, "accepted": null, "ms": ms, "ms_min": ms, "ms_max": ms, "bytes": gbs * ms * 1e6,
           "gb_s": gbs, "frac_copy": gbs / 3000.0, "vs_recurrent": null, "commit": null})
}

/// A small `rewind bench kernels --json`: both families, recurrent / replay / verify / baseline.
pub fn kernels_json() -> Value {
    let mut rows = Vec::new();
    for family in ["mamba2", "gdn"] {
        for batch in [1, 8, 64, 512] {
            rows.push(kernel_row("rewind", family, "recurrent_step", None, 1, batch));
            rows.push(kernel_row("rewind", family, "replay", Some(8), 1, batch));
            rows.push(kernel_row("rewind", family, "replay", Some(16), 1, batch));
            rows.push(kernel_row("rewind", family, "verify", Some(16), 4, batch));
            rows.push(kernel_row("rewind", family, "baseline_verify", None, 4, batch));
        }
    }
    rows[0]["label"] = json!("recurrent (step kernel)");
    json!({"command": "rewind bench kernels --json k.json", "date": "2026-11-26T10:00:00Z", "commit": "abc1234",
           "device": "NVIDIA H100 80GB HBM3", "arch": "sm_90", "copy_gb_s": 3000.0, "rows": rows})
}

/// A small `bench/peers/ssm_decode.py --json`.
pub fn peers_json() -> Value {
    let rows: Vec<Value> = [1, 8, 64, 512]
        .into_iter()
        .flat_map(|b| {
            [
                kernel_row(
                    "mamba_ssm selective_state_update",
                    "mamba2",
                    "recurrent_step",
                    None,
                    1,
                    b,
                ),
                kernel_row(
                    "fla fused_recurrent_gated_delta_rule (T = 1)",
                    "gdn",
                    "recurrent_step",
                    None,
                    1,
                    b,
                ),
            ]
        })
        .collect();
    json!({"device": "NVIDIA H100 80GB HBM3", "torch": "2.9.0", "copy_gb_s": 2990.0, "dtypes": "bf16",
           "rows": rows, "errors": []})
}
