//! The e2e document's rows, built from `rewind bench --json` runs, and its markdown tables.

use anyhow::{Context, Result};
use serde_json::{json, Value};

fn num(v: &Value, key: &str) -> Result<f64> {
    v[key]
        .as_f64()
        .with_context(|| format!("a bench row lacks the number `{key}`: {v}"))
}

fn count(v: &Value, key: &str) -> Result<usize> {
    v[key]
        .as_u64()
        .map(|n| n as usize)
        .with_context(|| format!("a bench row lacks the count `{key}`: {v}"))
}

/// The plain decode rows of one bench run in `form`.
pub(super) fn decode_rows(form: &str, run: &Value) -> Result<Vec<Value>> {
    let rows = run["decode"].as_array().context("a bench run without decode rows")?;
    rows.iter()
        .map(|r| {
            let batch = count(r, "batch")?;
            let step_ms = num(r, "step_ms_median")?;
            let repeats: Vec<f64> = r["decode_tok_per_s"]
                .as_array()
                .context("a decode row without its repeats")?
                .iter()
                .filter_map(Value::as_f64)
                .map(|tps| 1e3 * batch as f64 / tps)
                .collect();
            Ok(json!({
                "form": form,
                "batch": batch,
                "window": 0,
                "kept": 0,
                "tokens_per_step": batch,
                "step_ms": step_ms,
                "step_ms_repeats": repeats,
                "tokens_per_s": num(r, "decode_tok_per_s_median")?,
                "bytes": r["byte_model_bytes"].as_f64(),
                "roofline_ms": r["roofline_ms"].as_f64(),
                "roofline_fraction": r["roofline_fraction"].as_f64(),
                "speedup_vs_recurrent": Value::Null,
            }))
        })
        .collect()
}

/// The verify rows of a replay run with `--verify-window T`: the `spec` form, one row per kept count.
pub(super) fn verify_rows(run: &Value) -> Result<Vec<Value>> {
    let rows = run["verify"]
        .as_array()
        .context("a bench run with --verify-window but no verify rows")?;
    rows.iter()
        .map(|r| {
            let (batch, kept) = (count(r, "batch")?, count(r, "kept_drafts")?);
            Ok(json!({
                "form": "spec",
                "batch": batch,
                "window": count(r, "window")?,
                "kept": kept,
                "tokens_per_step": batch * (kept + 1),
                "step_ms": num(r, "step_ms_median")?,
                "step_ms_repeats": r["step_ms"].clone(),
                "tokens_per_s": num(r, "tokens_per_s")?,
                "bytes": r["byte_model_bytes"].as_f64(),
                "roofline_ms": r["roofline_ms"].as_f64(),
                "roofline_fraction": r["roofline_fraction"].as_f64(),
                "speedup_vs_recurrent": Value::Null,
            }))
        })
        .collect()
}

/// Fills `speedup_vs_recurrent`: tokens per second over the recurrent form's at the same batch (where measured).
pub(super) fn speedups(steps: &mut [Value]) {
    let base: Vec<(u64, f64)> = steps
        .iter()
        .filter(|s| s["form"] == "recurrent")
        .filter_map(|s| Some((s["batch"].as_u64()?, s["tokens_per_s"].as_f64()?)))
        .collect();
    for s in steps.iter_mut() {
        let b = s["batch"].as_u64();
        if let (Some(&(_, r)), Some(t)) = (base.iter().find(|(bb, _)| Some(*bb) == b), s["tokens_per_s"].as_f64()) {
            if r > 0.0 {
                s["speedup_vs_recurrent"] = json!(t / r);
            }
        }
    }
}

/// The serving summary of a `--serving-only` run.
pub(super) fn serving(s: &Value) -> Result<Value> {
    Ok(json!({
        "concurrency": count(s, "concurrency")?,
        "requests": count(s, "requests")?,
        "prompt_tokens": s["prompt_tokens"].clone(),
        "output_tokens_per_request": s["output_tokens_per_request"].clone(),
        "output_tok_per_s": num(s, "output_tok_per_s")?,
        "ttft_ms_p50": num(&s["ttft_ms"], "p50")?,
        "ttft_ms_p99": num(&s["ttft_ms"], "p99")?,
        "itl_ms_p50": num(&s["itl_ms"], "p50")?,
        "itl_ms_p99": num(&s["itl_ms"], "p99")?,
        "steps": s["engine"]["steps"].clone(),
        "preemptions": s["engine"]["preemptions"].clone(),
    }))
}

fn cell(v: &Value, digits: usize) -> String {
    v.as_f64().map_or_else(|| "—".into(), |x| format!("{x:.digits$}"))
}

/// The markdown tables of a whole e2e document.
pub(super) fn markdown(report: &Value) -> String {
    let mut md = format!(
        "# rewind bench e2e\n\n- device: {}, copy {} GB/s, {}\n- date: {}, commit: {}\n- command: `{}`\n",
        report["device"].as_str().unwrap_or("?"),
        cell(&report["copy_gb_s"], 0),
        report["dtype"].as_str().unwrap_or("?"),
        report["date"].as_str().unwrap_or("?"),
        report["commit"].as_str().unwrap_or("?"),
        report["command"].as_str().unwrap_or("?"),
    );
    for m in report["models"].as_array().into_iter().flatten() {
        md += &format!(
            "\n## {}\n\n{}\n\nPrefill tok/s by run: {}\n\n",
            m["name"].as_str().unwrap_or("?"),
            m["summary"].as_str().unwrap_or(""),
            m["prefill_tok_per_s"]
                .as_object()
                .map(|o| o
                    .iter()
                    .map(|(k, v)| format!("{k} {}", cell(v, 0)))
                    .collect::<Vec<_>>()
                    .join(", "))
                .unwrap_or_default()
        );
        md += "| form | batch | kept / T | step ms | tokens/s | byte roofline ms | fraction of roofline | vs recurrent |\n";
        md += "|---|---|---|---|---|---|---|---|\n";
        for s in m["steps"].as_array().into_iter().flatten() {
            let kept = if s["form"] == "spec" {
                format!("{} / {}", s["kept"], s["window"])
            } else {
                "—".into()
            };
            md += &format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
                s["form"].as_str().unwrap_or("?"),
                s["batch"],
                kept,
                cell(&s["step_ms"], 3),
                cell(&s["tokens_per_s"], 0),
                cell(&s["roofline_ms"], 3),
                cell(&s["roofline_fraction"], 2),
                cell(&s["speedup_vs_recurrent"], 2),
            );
        }
        let sv = &m["serving"];
        if !sv.is_null() {
            md += &format!(
                "\nServing through the coordinator: {} requests, {} in flight: {} output tok/s, TTFT p50 {} ms / p99 {} \
                 ms, ITL p50 {} ms / p99 {} ms\n",
                sv["requests"],
                sv["concurrency"],
                cell(&sv["output_tok_per_s"], 0),
                cell(&sv["ttft_ms_p50"], 1),
                cell(&sv["ttft_ms_p99"], 1),
                cell(&sv["itl_ms_p50"], 2),
                cell(&sv["itl_ms_p99"], 2),
            );
        }
        let c = &m["concurrency"];
        if !c.is_null() {
            md += &format!(
                "\nMeasured concurrency at {} tokens of context in {} GiB beyond the weights: per-draft snapshots (T = {}) \
                 admitted {}, replay admitted {}: {}× (planned {} vs {})\n",
                c["context"],
                cell(&c["budget_gib"], 1),
                c["spec_window"],
                c["snapshot"]["admitted"],
                c["replay"]["admitted"],
                cell(&c["ratio"], 2),
                c["snapshot"]["planned"],
                c["replay"]["planned"],
            );
        }
    }
    md
}
