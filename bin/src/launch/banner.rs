//! The banner `rewind-launch` prints once the servers listen: what is served, where, on which devices, and the
//! memory plan of `rewind plan-memory` for the devices' budget.

use std::fmt::Write;

use anyhow::Result;
use rewind_engine::model::ModelConfig;
use rewind_engine::state::memory::{format_bytes, plan_memory, MemoryPlan, PlanOptions, ACT_BYTES};
use rewind_engine::state::DEFAULT_KV_BLOCK_SIZE;

use crate::serve::run::Bound;

/// What the memory plan is made for.
pub struct PlanInput<'a> {
    pub config: &'a ModelConfig,
    /// The devices' memory for weights and sequences, and how it was found.
    pub budget: u64,
    pub budget_source: String,
    /// Tokens of context each sequence reserves, the speculative window (0: none) and the replay ring's length.
    pub context: usize,
    pub spec_window: usize,
    pub buffer_len: usize,
    /// Bytes per stored activation value: 2 for bf16 pools, 4 for f32 (the CPU's).
    pub act_bytes: u64,
}

/// The plan `rewind plan-memory` makes for `p` (the same function, the same options).
pub fn memory_plan(p: &PlanInput) -> Result<MemoryPlan> {
    Ok(plan_memory(
        p.config,
        p.budget,
        &PlanOptions {
            spec_window: p.spec_window,
            buffer_len: p.buffer_len,
            context: p.context,
            kv_block_size: DEFAULT_KV_BLOCK_SIZE,
            kv_only_threshold: None,
            act_bytes: p.act_bytes,
        },
    )?)
}

/// Bytes per stored activation of a device's pools: the GPU's `--dtype`, f32 on the CPU.
pub fn act_bytes(gpu_dtype: Option<&str>) -> u64 {
    match gpu_dtype {
        Some("f32") | None => 4,
        Some(_) => ACT_BYTES,
    }
}

/// The CPU's budget: the memory the kernel says is available (`MemAvailable`), where it says.
pub fn cpu_budget() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// What the banner shows.
pub struct Banner<'a> {
    pub model_dir: &'a std::path::Path,
    pub config: &'a ModelConfig,
    pub served_as: String,
    pub tp: usize,
    /// Every rank's device, in words.
    pub devices: Vec<String>,
    pub form: String,
    pub slots: usize,
    pub context: usize,
    pub plan: Option<(MemoryPlan, String)>,
    pub api_key: bool,
}

impl Banner<'_> {
    /// The banner's lines, with the servers' bound addresses.
    pub fn render(&self, bound: Bound) -> Result<String> {
        let mut out = String::new();
        writeln!(out, "rewind-launch {}", env!("CARGO_PKG_VERSION"))?;
        writeln!(
            out,
            "  model     {} (served as `{}`)",
            self.model_dir.display(),
            self.served_as
        )?;
        writeln!(out, "  arch      {}", self.config.summary())?;
        writeln!(out, "  tp        {}", self.tp)?;
        for (rank, d) in self.devices.iter().enumerate() {
            writeln!(out, "  rank {rank:<4} {d}")?;
        }
        writeln!(
            out,
            "  engine    {} sequences x {} tokens, decode form {}",
            self.slots, self.context, self.form
        )?;
        match &self.plan {
            Some((plan, source)) => {
                let left = plan.budget_bytes.saturating_sub(plan.weights_bytes);
                writeln!(
                    out,
                    "  memory    budget {} ({source}): weights {}, {} left for sequences",
                    format_bytes(plan.budget_bytes),
                    format_bytes(plan.weights_bytes),
                    format_bytes(left)
                )?;
                for f in &plan.forms {
                    let t = if f.spec_window > 0 {
                        format!(" T={}", f.spec_window)
                    } else {
                        String::new()
                    };
                    writeln!(
                        out,
                        "            {:<14} {:>12} per sequence, {} sequences fit",
                        format!("{}{t}", f.name()),
                        format_bytes(f.bytes_per_sequence),
                        f.max_sequences
                    )?;
                }
                for note in &plan.notes {
                    writeln!(out, "            note: {note}")?;
                }
            }
            None => writeln!(
                out,
                "  memory    no budget known for this device (see `rewind plan-memory`)"
            )?,
        }
        writeln!(
            out,
            "  grpc      {} (rewind.v1.Rewind: sessions, completion, health)",
            bound.grpc
        )?;
        writeln!(
            out,
            "  http      http://{} (OpenAI-compatible: /v1/models, /v1/completions, /v1/chat/completions)",
            bound.http
        )?;
        writeln!(out, "  api key   {}", if self.api_key { "required" } else { "off" })?;
        writeln!(
            out,
            "  SIGINT / SIGTERM drain: new requests refused, in-flight ones finish, then the servers stop"
        )?;
        Ok(out)
    }
}
