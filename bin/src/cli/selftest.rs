//! `rewind selftest`'s flags.

use std::path::PathBuf;

use clap::Args;

/// `rewind selftest`: every CUDA op against its CPU twin, the NCCL checks and the model-level check.
#[derive(Args, Debug)]
pub struct SelftestArgs {
    /// Device to check: `cuda` (GPU 0) or `cuda:N`. The CPU ops are the reference, so `cpu` is refused.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Write the full report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Seed of the random inputs (default: from the clock; it is printed, so a run can be repeated).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Run only the ops whose name contains this string.
    #[arg(long)]
    pub only: Option<String>,
    /// Skip the NCCL all-reduce check (it runs when at least 2 GPUs are visible).
    #[arg(long)]
    pub no_nccl: bool,
    /// Fixture models for the model-level check (teacher-forced GPU logits against the CPU; with 2 GPUs also --tp 2),
    /// e.g. `tests/fixtures` in a checkout. Default: one `tiny` model per architecture, generated from --seed into a
    /// temporary directory (so selftest runs from any directory).
    #[arg(long, value_name = "DIR")]
    pub fixtures: Option<PathBuf>,
    /// The trained default models whose bf16 rows gate (`DIR/nemotron_h`, `DIR/qwen3_5`, e.g. `models/default` in a
    /// checkout). Default: the ones this binary embeds.
    #[arg(long, value_name = "DIR")]
    pub trained_models: Option<PathBuf>,
    /// Skip the model-level check.
    #[arg(long)]
    pub no_model: bool,
    /// Tensor-parallel sizes of the model-level check, e.g. `4` or `1,2` (default: 1, then 2 and 4 where that many
    /// GPUs are visible). A size above the visible GPU count is an error.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub model_tp: Option<Vec<usize>>,
}
