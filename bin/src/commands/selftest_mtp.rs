//! The self-test's rows for MTP drafting on the GPU ranks (`rewind_engine::gpu::mtp_forced`): a model with an MTP
//! layer run on GPU ranks and on CPU ranks with the same plans (prompt chunks, verifies of the previous proposals
//! committed in full and cut short with a forced token, decodes), every proposal compared. In f32 the proposals must
//! be equal; in bf16 their agreement is reported (random weights: rounding moves near-tied drafts). The plans run
//! twice, so that with CUDA graphs on the MTP layer's captured graphs replay (and must have).

use std::path::Path;

use rewind_engine::checkpoint::SafetensorsSource;
use rewind_engine::decode::FormChoice;
use rewind_engine::gpu::{mtp_forced, GpuDtype, GpuOptions, MtpReport};
use rewind_engine::model::config::ModelConfig;
use rewind_engine::model::mtp::MTP_PREFIX;
use serde_json::{json, Value};

/// Drafts per proposal, and plans run after the prompts.
const WINDOW: usize = 3;
const STEPS: usize = 12;

/// Whether the checkpoint in `dir` has an MTP layer to check: its config says so and its safetensors hold `mtp.*`
/// tensors (transformers' fixtures keep the config field without the weights).
pub(super) fn has_mtp(dir: &Path) -> bool {
    let says = ModelConfig::from_dir(dir).is_ok_and(|c| c.mtp_layers > 0);
    says && SafetensorsSource::open(dir).is_ok_and(|s| s.names().iter().any(|n| n.starts_with(MTP_PREFIX)))
}

/// The rows: the check in the replay form, the GPU ranks started from `opts` with a window of [`WINDOW`] drafts,
/// with CUDA graphs as `opts` says (the MTP graphs must replay when on), and once more launched eagerly.
pub(super) fn rows(
    case: &str,
    dir: &Path,
    prompts: &[Vec<u32>],
    opts: &GpuOptions,
    tp: usize,
    dtype: GpuDtype,
) -> Vec<(Value, bool)> {
    let graphed = GpuOptions {
        max_verify: WINDOW + 1,
        buffer_len: opts.buffer_len.max(2 * (WINDOW + 1)),
        mtp: true,
        ..opts.clone()
    };
    let eager = GpuOptions {
        cuda_graphs: false,
        ..graphed.clone()
    };
    let mut out = vec![];
    for o in if graphed.cuda_graphs {
        vec![graphed, eager]
    } else {
        vec![eager]
    } {
        let r = mtp_forced(dir, prompts, STEPS, &o, FormChoice::Replay).map_err(|e| e.to_string());
        out.push(line(case, tp, dtype, o.cuda_graphs, &r));
    }
    out
}

fn line(case: &str, tp: usize, dtype: GpuDtype, graphs: bool, r: &Result<MtpReport, String>) -> (Value, bool) {
    let gating = dtype == GpuDtype::F32;
    let launches = if graphs { "graphs" } else { "eager" };
    match r {
        Ok(r) => {
            // Whatever the dtype, graphs that never replayed fail the row.
            let replayed = r.graphs.is_none_or(|g| !g.enabled || g.mtp_replayed > 0);
            let verdict = match (r.pass, gating) {
                (true, true) => "pass",
                (false, true) => "FAIL",
                (true, false) => "equal (report)",
                (false, false) => "differ (report, not gating)",
            };
            println!(
                "{:<20} tp {}  {:<4}  mtp {:<6} {:<9} {} drafts, {} steps: {} / {} proposals equal, {} / {} drafts equal, \
                 {} cut short  {}",
                case,
                tp,
                dtype,
                launches,
                r.form,
                r.window,
                r.steps,
                r.proposals_equal,
                r.proposals,
                r.drafts_equal,
                r.drafts,
                r.cuts,
                verdict
            );
            if let Some(g) = r.graphs.filter(|g| g.enabled) {
                println!(
                    "{:<20} {} passes, MTP CUDA graphs: {} captured, {} replays{}",
                    "",
                    r.passes,
                    g.mtp_captured,
                    g.mtp_replayed,
                    if g.mtp_replayed == 0 {
                        " (none replayed: FAIL)"
                    } else {
                        ""
                    }
                );
            }
            if let Some(m) = &r.first_mismatch {
                println!("{:<20} first difference: {m}", "");
            }
            let mut v = serde_json::to_value(r).unwrap_or(Value::Null);
            v["case"] = json!(case);
            v["check"] = json!("mtp");
            v["tp"] = json!(tp);
            v["gating"] = json!(gating);
            v["launches"] = json!(launches);
            (v, (r.pass || !gating) && replayed)
        }
        Err(e) => {
            println!("{case:<20} tp {tp}  {dtype:<4}  mtp {launches:<6} FAIL: {e}");
            (
                json!({ "case": case, "tp": tp, "dtype": dtype.to_string(), "check": "mtp", "launches": launches,
                        "pass": false, "error": e }),
                false,
            )
        }
    }
}
