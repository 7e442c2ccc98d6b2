//! `rewind plan`: per-rank memory, concurrency and projected decode / prefill speed of a model on a GPU profile
//! (`rewind_engine::plan`), as tables for people, one JSON object, or Markdown deployment rows.

use std::fmt::Write;

use anyhow::{bail, Context, Result};
use rewind_engine::model::ModelConfig;
use rewind_engine::plan::calibration::{self, Applied};
use rewind_engine::plan::projection::{Batch, StepTerms};
use rewind_engine::plan::{project, FormRow, GpuProfile, Plan, PlanInput};
use rewind_engine::state::memory::ACT_BYTES;
use rewind_engine::state::DecodeForm;

use super::plan_memory::model_config;
use crate::cli::PlanArgs;
use crate::output::{outln, write_stdout};

const GB: f64 = 1e9;

fn profile(args: &PlanArgs) -> Result<GpuProfile> {
    match (&args.gpu, &args.gpu_spec) {
        (Some(name), None) => Ok(GpuProfile::builtin(name)?),
        (None, Some(path)) => Ok(GpuProfile::from_file(path)?),
        _ => bail!("give --gpu h100|h200|b200|b300 or --gpu-spec FILE"),
    }
}

/// The largest fixed batch `rewind plan` projects (far past what any GPU holds; the byte model's products stay in range).
const MAX_PLAN_BATCH: usize = 1 << 24;

fn batches(args: &PlanArgs) -> Result<Vec<Batch>> {
    args.batch
        .iter()
        .map(|b| match b.trim() {
            "max" => Ok(Batch::Max),
            n => n
                .parse::<usize>()
                .ok()
                .filter(|&n| (1..=MAX_PLAN_BATCH).contains(&n))
                .map(Batch::Fixed)
                .with_context(|| {
                    format!("--batch: `{n}` is neither a batch size from 1 to {MAX_PLAN_BATCH} nor `max`")
                }),
        })
        .collect()
}

fn input(args: &PlanArgs, context: usize) -> Result<PlanInput> {
    anyhow::ensure!(
        args.tp >= 1 && args.tp <= 4096,
        "--tp must be between 1 and 4096, got {}",
        args.tp
    );
    anyhow::ensure!(
        args.spec_window <= 64,
        "--spec-window must be at most 64, got {}",
        args.spec_window
    );
    anyhow::ensure!(args.buffer_len <= 1 << 20, "--buffer-len must be at most {}", 1 << 20);
    anyhow::ensure!(
        args.kv_block_size <= 1 << 16,
        "--kv-block-size must be at most {}",
        1 << 16
    );
    Ok(PlanInput {
        tp: args.tp,
        nodes: args.nodes,
        replicas: args.replicas,
        context,
        spec_window: args.spec_window,
        acceptance: args.acceptance,
        buffer_len: args.buffer_len,
        kv_block_size: args.kv_block_size,
        memory_fraction: args.memory_fraction,
        act_bytes: ACT_BYTES,
        forms: args.forms.iter().map(|f| FormRow::parse(f)).collect::<Result<_, _>>()?,
        batches: batches(args)?,
        prefill_chunk: args.prefill_chunk,
    })
}

/// `× measured/model = R, from FILE` for a calibrated row.
fn ratio_note(c: &Option<Applied>) -> String {
    c.as_ref().map_or("no measured run of this form".into(), |a| {
        format!("x measured/model = {:.2}, from bench/results/{}", a.ratio, a.file)
    })
}

fn calibration_table() -> Result<String> {
    let rows = calibration::table().map_err(anyhow::Error::msg)?;
    let mut out = String::new();
    writeln!(
        out,
        "calibration: random Nemotron-H-8B shape, rewind bench --device cuda; ratio = measured / model"
    )?;
    writeln!(
        out,
        "{:<50} {:<5} {:>3} {:<11} {:>6} {:>7} {:>12} {:>12} {:>7} {:>8}",
        "file (bench/results/)", "gpu", "tp", "form", "batch", "context", "measured", "model", "ratio", "applied"
    )?;
    for r in rows {
        let m = &r.measurement;
        let unit = if m.form.is_some() { "ms" } else { "tok/s" };
        writeln!(
            out,
            "{:<50} {:<5} {:>3} {:<11} {:>6} {:>7} {:>9.2} {:<2} {:>9.2} {:<2} {:>7.2} {:>8}",
            m.file,
            m.gpu,
            m.tp,
            m.form.map_or("prefill", DecodeForm::name),
            m.batch,
            m.context,
            m.measured,
            unit,
            r.model,
            unit,
            r.ratio,
            if m.applied { "yes" } else { "-" }
        )?;
    }
    Ok(out)
}

fn step_row(out: &mut String, s: &StepTerms) -> Result<()> {
    let batch = if s.is_max {
        format!("{} (max)", s.batch)
    } else {
        s.batch.to_string()
    };
    let experts = if s.active_experts > 0.0 {
        format!("{:.2} ({:.0})", s.expert_bytes / GB, s.active_experts)
    } else {
        "-".into()
    };
    let (cal_ms, cal_tps) = s.calibrated.as_ref().map_or(("-".into(), "-".into()), |a| {
        (
            a.step_ms.map_or("-".into(), |m| format!("{m:.2}")),
            format!("{:.0}", a.tokens_per_s),
        )
    });
    writeln!(
        out,
        "{:<12} {:>11} {:>8.2} {:>12} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>9.0} | {:>8} {:>9} {}{}",
        s.form.name(),
        batch,
        s.dense_weight_bytes / GB,
        experts,
        s.ssm_bytes / GB,
        s.kv_bytes / GB,
        s.hbm_ms,
        s.compute_ms,
        s.all_reduce_ms,
        s.step_ms,
        s.tokens_per_s,
        cal_ms,
        cal_tps,
        ratio_note(&s.calibrated),
        s.flag.as_ref().map_or(String::new(), |f| format!("  FLAGGED: {f}"))
    )?;
    Ok(())
}

fn format_plan(config: &ModelConfig, plan: &Plan) -> Result<String> {
    let mut out = String::new();
    let g = &plan.gpu;
    writeln!(out, "model        {}", config.summary())?;
    writeln!(
        out,
        "gpu          {}: {}; {} GB, HBM {} TB/s, {} TFLOP/s dense bf16, NVLink {} GB/s per direction, all-reduce \
         latency {} us (assumed)",
        g.name, g.description, g.memory_gb, g.hbm_tb_s, g.bf16_dense_tflops, g.nvlink_gb_s, g.collective_latency_us
    )?;
    writeln!(
        out,
        "layout       TP {} on {} node(s), {} replica(s); context {} tokens; T = {} at acceptance {} per draft; ring L = {}",
        plan.input.tp,
        plan.input.nodes,
        plan.input.replicas,
        plan.input.context,
        plan.input.spec_window,
        plan.input.acceptance,
        plan.input.buffer_len
    )?;
    let (wmin, wmax) = plan.ranks.iter().fold((u64::MAX, 0), |(a, b), r| {
        (a.min(r.weight_bytes), b.max(r.weight_bytes))
    });
    writeln!(
        out,
        "per GPU      {:.2} GB usable ({} of {} GB; the rest is reserve); weights {:.2} GB (ranks from {:.2} to {:.2})",
        plan.budget_bytes / GB,
        plan.input.memory_fraction,
        g.memory_gb,
        wmax as f64 / GB,
        wmin as f64 / GB,
        wmax as f64 / GB
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "{:<12} {:>3} {:>14} {:>14} {:>10}",
        "form", "T", "ssm GB/seq", "kv GB/seq", "max seqs"
    )?;
    for f in &plan.forms {
        writeln!(
            out,
            "{:<12} {:>3} {:>14.4} {:>14.4} {:>10}",
            f.form.name(),
            f.spec_window,
            f.ssm_bytes_per_seq as f64 / GB,
            f.kv_bytes_per_seq as f64 / GB,
            f.max_sequences
        )?;
    }
    writeln!(out)?;
    writeln!(
        out,
        "decode, slowest rank; bytes in GB per step          model (roofline)                               | calibrated"
    )?;
    writeln!(
        out,
        "{:<12} {:>11} {:>8} {:>12} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} | {:>8} {:>9}",
        "form",
        "batch",
        "weights",
        "experts (n)",
        "state",
        "kv",
        "hbm ms",
        "flop ms",
        "comm ms",
        "step ms",
        "tok/s",
        "step ms",
        "tok/s"
    )?;
    for s in &plan.decode {
        step_row(&mut out, s)?;
    }
    let p = &plan.prefill;
    writeln!(out)?;
    writeln!(
        out,
        "prefill      model {:.0} tok/s per replica ({:.1} GFLOP per token, all-reduce {:.4} ms per token); calibrated {} \
         tok/s, {}",
        p.tokens_per_s,
        p.flops_per_token / 1e9,
        p.all_reduce_ms_per_token,
        p.calibrated.as_ref().map_or("-".into(), |a| format!("{:.0}", a.tokens_per_s)),
        ratio_note(&p.calibrated)
    )?;
    if plan.input.replicas > 1 {
        writeln!(
            out,
            "tok/s are per replica; x {} replicas for the whole deployment (JSON: aggregate_tokens_per_s)",
            plan.input.replicas
        )?;
    }
    for note in &plan.notes {
        writeln!(out, "note: {note}")?;
    }
    Ok(out)
}

/// Deployment rows: per context, max sequences and calibrated tokens/s at the largest batch that fits, per form.
fn markdown(name: &str, plans: &[Plan]) -> Result<String> {
    let mut out = String::new();
    let forms: Vec<FormRow> = plans
        .first()
        .map_or(Vec::new(), |p| p.forms.iter().map(|f| f.form).collect());
    write!(out, "| model | GPUs | layout | context |")?;
    for f in &forms {
        write!(out, " {} seqs / tok/s |", f.name())?;
    }
    writeln!(out)?;
    writeln!(out, "|{}", "---|".repeat(4 + forms.len()))?;
    for p in plans {
        let i = &p.input;
        let gpus = i.tp * i.replicas;
        write!(
            out,
            "| {name} | {gpus} × {} | TP {} × {} | {}K |",
            p.gpu.name.to_uppercase(),
            i.tp,
            i.replicas,
            i.context / 1024
        )?;
        for f in &p.forms {
            let step = p.decode.iter().find(|s| s.form == f.form && s.is_max);
            let cell = match step.and_then(|s| s.calibrated.as_ref().map(|a| (s, a))) {
                Some((s, a)) => format!(
                    "{} / {:.0} ({:.0} model)",
                    f.max_sequences * i.replicas as u64,
                    a.tokens_per_s * i.replicas as f64,
                    s.aggregate_tokens_per_s
                ),
                None => format!("{} / -", f.max_sequences * i.replicas as u64),
            };
            write!(out, " {cell} |")?;
        }
        writeln!(out)?;
    }
    Ok(out)
}

pub fn run(args: PlanArgs) -> Result<()> {
    if args.calibration {
        return write_stdout(&calibration_table()?);
    }
    let config = model_config(&args.shape)?;
    let gpu = profile(&args)?;
    anyhow::ensure!(!args.context.is_empty(), "--context needs at least one length");
    let plans = args
        .context
        .iter()
        .map(|&c| Ok(project(&config, &gpu, &input(&args, c)?)?))
        .collect::<Result<Vec<_>>>()?;
    if args.json {
        let value = serde_json::json!({
            "model": config.summary(),
            "plans": plans,
            "calibration": calibration::table().map_err(anyhow::Error::msg)?,
        });
        outln!("{}", serde_json::to_string_pretty(&value)?)?;
    } else if args.markdown {
        let name = args
            .shape
            .preset
            .clone()
            .or_else(|| args.shape.model.as_ref().map(|m| m.display().to_string()))
            .unwrap_or_default();
        write_stdout(&markdown(&name, &plans)?)?;
    } else {
        for (i, p) in plans.iter().enumerate() {
            if i > 0 {
                write_stdout("\n")?;
            }
            write_stdout(&format_plan(&config, p)?)?;
        }
    }
    Ok(())
}
