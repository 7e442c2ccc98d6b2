//! `rewind plan-memory`: bytes per sequence slot and the number of sequences that fit a budget, for each decode form
//! and speculative window, from a model directory's config or a preset shape (no checkpoint needed).

use std::fmt::Write;

use anyhow::{bail, Context, Result};
use rewind_engine::model::ModelConfig;
use rewind_engine::presets::{parse_arch, preset_config, tokenizer_vocab};
use rewind_engine::state::memory::{format_bytes, parse_bytes, plan_memory, MemoryPlan, PlanOptions, ACT_BYTES};

use crate::cli::{PlanMemoryArgs, ShapeArgs};
use crate::output::{outln, write_stdout};

/// The config of `--model DIR` or of `--preset NAME --arch ARCH` (shared with `rewind plan`).
pub(crate) fn model_config(shape: &ShapeArgs) -> Result<ModelConfig> {
    match (shape.model.as_deref(), shape.preset.as_deref(), shape.arch.as_deref()) {
        (Some(_), Some(_), _) | (Some(_), _, Some(_)) => {
            bail!("give either --model DIR or --preset NAME --arch ARCH, not both")
        }
        (Some(dir), None, None) => Ok(ModelConfig::from_dir(dir)?),
        (None, Some(preset), Some(arch)) => {
            let family = parse_arch(arch)?;
            // The token ids only fill config fields; the plan does not depend on them.
            let json = preset_config(family, preset, None, tokenizer_vocab(preset), 1, 2)?;
            Ok(ModelConfig::from_json(&json)?)
        }
        (None, Some(_), None) => {
            bail!("--preset needs --arch (nemotron_h, qwen3_next, qwen3_5 or qwen3_5_moe)")
        }
        (None, None, Some(_)) => bail!("--arch needs --preset"),
        (None, None, None) => bail!("give --model DIR, or --preset NAME --arch ARCH"),
    }
}

/// The plan as a table for people, ending in a newline.
fn format_table(config: &ModelConfig, plan: &MemoryPlan) -> Result<String> {
    let mut out = String::new();
    let left = plan.budget_bytes.saturating_sub(plan.weights_bytes);
    writeln!(out, "model        {}", config.summary())?;
    writeln!(
        out,
        "weights      {:.2}B parameters, {} (bf16)",
        plan.parameters as f64 / 1e9,
        format_bytes(plan.weights_bytes)
    )?;
    writeln!(
        out,
        "budget       {}, {} left for sequences",
        format_bytes(plan.budget_bytes),
        format_bytes(left)
    )?;
    writeln!(
        out,
        "sequence     {} tokens of context (KV blocks of {}), ring L = {}, kv-only below {} tokens",
        plan.context, plan.kv_block_size, plan.buffer_len, plan.kv_only_threshold
    )?;
    let baseline = if plan.spec_window > 0 {
        format!("spec-baseline at T = {}", plan.spec_window)
    } else {
        "recurrent".to_string()
    };
    writeln!(out)?;
    writeln!(
        out,
        "{:<14} {:>3} {:>16} {:>12} {:>12} {:>12} {:>10}",
        "form", "T", "bytes/sequence", "(ssm)", "(kv)", "max seqs", "vs base"
    )?;
    for f in &plan.forms {
        let ratio = f.vs_baseline.map_or("-".to_string(), |r| format!("{r:.2}x"));
        writeln!(
            out,
            "{:<14} {:>3} {:>16} {:>12} {:>12} {:>12} {:>10}",
            f.name(),
            f.spec_window,
            format_bytes(f.bytes_per_sequence),
            format_bytes(f.ssm_bytes),
            format_bytes(f.kv_bytes),
            f.max_sequences,
            ratio
        )?;
    }
    writeln!(out)?;
    writeln!(out, "vs base: max sequences relative to {baseline}.")?;
    for note in &plan.notes {
        writeln!(out, "note: {note}")?;
    }
    Ok(out)
}

pub fn run(args: PlanMemoryArgs) -> Result<()> {
    let budget = parse_bytes(&args.budget).context("--budget")?;
    // Bounds far above any real deployment, so the byte arithmetic below cannot overflow.
    anyhow::ensure!(
        args.spec_window <= 1024,
        "--spec-window must be at most 1024, got {}",
        args.spec_window
    );
    anyhow::ensure!(
        args.buffer_len <= 1 << 20,
        "--buffer-len must be at most {}, got {}",
        1 << 20,
        args.buffer_len
    );
    anyhow::ensure!(
        args.kv_block_size <= 1 << 16,
        "--kv-block-size must be at most {}, got {}",
        1 << 16,
        args.kv_block_size
    );
    if let Some(c) = args.context {
        anyhow::ensure!(c >= 1, "--context must be at least 1 token, got {c}");
        anyhow::ensure!(c <= 1 << 30, "--context must be at most {} tokens, got {c}", 1u64 << 30);
    }
    let config = model_config(&args.shape)?;
    let limit = config.max_position_embeddings;
    let context = args.context.unwrap_or(limit);
    anyhow::ensure!(
        context <= limit,
        "--context {context} exceeds the model's context limit of {limit} tokens (max_position_embeddings)"
    );
    let opts = PlanOptions {
        spec_window: args.spec_window,
        buffer_len: args.buffer_len,
        context,
        kv_block_size: args.kv_block_size,
        kv_only_threshold: None,
        // The GPU's default activation type (bf16).
        act_bytes: ACT_BYTES,
    };
    let plan = plan_memory(&config, budget, &opts)?;
    if args.json {
        let mut value = serde_json::to_value(&plan)?;
        if let Some(obj) = value.as_object_mut() {
            obj.insert("model".into(), serde_json::Value::String(config.summary()));
        }
        outln!("{}", serde_json::to_string_pretty(&value)?)?;
    } else {
        write_stdout(&format_table(&config, &plan)?)?;
    }
    // As `rewind plan` does: a budget the weights alone exceed is a failure (scripts test the exit), though the plan
    // above still shows by how much.
    if plan.weights_bytes >= plan.budget_bytes {
        bail!(
            "the weights alone ({}) exceed the budget ({}): no sequence fits",
            format_bytes(plan.weights_bytes),
            format_bytes(plan.budget_bytes)
        );
    }
    Ok(())
}
