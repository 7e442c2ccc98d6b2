//! The self-test's rows for chains of verifies on the GPU (`rewind_engine::rank::spec_chain_check`): speculative
//! decoding in chains whose drafts, verdicts and commits stay on the device, against the same verifies run one plan
//! at a time, with the n-gram drafter and a drafter table (the oracle); judged greedily, and sampled from the rows'
//! one-pass summaries (the device keys every later step's noise itself).

use std::path::Path;

use rewind_engine::decode::FormChoice;
use rewind_engine::gpu::{gpu_group, GpuDtype, GpuOptions};
use rewind_engine::rank::{spec_chain_check, SpecChainReport};
use serde_json::{json, Value};

/// Drafts per verify, further steps per chain and chains after each prompt.
const WINDOW: usize = 3;
const CHAINED: usize = 5;
const CHAINS: usize = 3;
/// The sampled rows' temperature: low, so that even a random model's windows are accepted in part.
const TEMPERATURE: f32 = 0.05;

/// Runs the check greedily in the replay, kv-only and auto forms (the recurrent form's verify commits by a snapshot
/// copy, which does not chain on the GPU), and sampled in the auto form; one row each.
pub(super) fn rows(
    case: &str,
    dir: &Path,
    prompts: &[Vec<u32>],
    opts: &GpuOptions,
    tp: usize,
    dtype: GpuDtype,
    tolerance: f64,
) -> Vec<(Value, bool)> {
    let opts = GpuOptions {
        max_verify: opts.max_verify.max(WINDOW + 1),
        buffer_len: opts.buffer_len.max(2 * (WINDOW + 1)),
        ..opts.clone()
    };
    [
        (FormChoice::Replay, None),
        (FormChoice::KvOnly, None),
        (FormChoice::Auto, None),
        (FormChoice::Auto, Some(TEMPERATURE)),
    ]
    .into_iter()
    .map(|(form, temperature)| {
        let r = gpu_group(dir, &opts)
            .and_then(|(mut g, _)| {
                spec_chain_check(&mut g, prompts, form, WINDOW, CHAINED, CHAINS, temperature, tolerance)
            })
            .map_err(|e| e.to_string());
        line(case, tp, dtype, form, temperature, &r)
    })
    .collect()
}

fn line(
    case: &str,
    tp: usize,
    dtype: GpuDtype,
    form: FormChoice,
    temperature: Option<f32>,
    r: &Result<SpecChainReport, String>,
) -> (Value, bool) {
    let judged = temperature.map_or("greedy".to_string(), |t| format!("T={t}"));
    match r {
        Ok(r) => {
            println!(
                "{:<20} tp {}  {:<4}  spec chain  {:<9} {:<6} {} × {} verifies of {}: {} steps, {} drafts accepted, {} \
                 differ, worst rel vs single steps {:.2e} (≤ {:.0e})  {}",
                case,
                tp,
                dtype,
                r.form,
                judged,
                r.chains,
                r.chain_steps,
                r.window,
                r.steps,
                r.accepted,
                r.mismatches,
                r.worst_rel,
                r.tolerance,
                if r.pass { "pass" } else { "FAIL" }
            );
            if let Some(m) = &r.first_mismatch {
                println!("{:<20} first difference: {m}", "");
            }
            let mut v = serde_json::to_value(r).unwrap_or(Value::Null);
            v["case"] = json!(case);
            v["check"] = json!("spec_chain");
            v["dtype"] = json!(dtype.to_string());
            if !r.worst_rel.is_finite() {
                v["worst_rel"] = json!(r.worst_rel.to_string());
            }
            (v, r.pass)
        }
        Err(e) => {
            println!(
                "{case:<20} tp {tp}  {dtype:<4}  spec chain {} {judged} FAIL: {e}",
                form.name()
            );
            (
                json!({ "case": case, "tp": tp, "dtype": dtype.to_string(), "form": form.name(), "temperature": temperature, "check": "spec_chain", "pass": false, "error": e }),
                false,
            )
        }
    }
}
