//! `rewind bench e2e` and `rewind bench plot`: the flags of the end-to-end sweep on random real-shape models and of
//! the plots drawn from benchmark JSON.

use std::path::PathBuf;

use clap::Args;

use super::non_negative;

/// Examples shown after `rewind bench e2e --help`.
pub(super) const BENCH_E2E_EXAMPLES: &str = "\
Examples:
  rewind bench e2e --device cuda --json e2e.json --markdown e2e.md
  rewind bench e2e --device cuda --models nemotron-h-8b --batch 1,64,256 --forms recurrent,replay,spec
  rewind bench e2e --device cuda --model-dir /models/my-hybrid --batch 1,8 --no-serving --no-concurrency";

/// Examples shown after `rewind bench plot --help`.
pub(super) const BENCH_PLOT_EXAMPLES: &str = "\
Examples:
  rewind bench plot --input e2e.json --out-dir bench/results/plots
  rewind bench plot --input kernels.json --input peers.json --out-dir plots --font /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

#[derive(Args, Debug)]
pub struct BenchE2eArgs {
    /// Device: `cuda` (GPU 0) or `cuda:N`; `cpu` runs the same sweep on the CPU backend (a smoke test: no byte
    /// roofline, and --no-concurrency is required).
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Model presets to build with random weights (comma-separated): nemotron-h-8b, qwen3.5-4b,
    /// nemotron-3-nano-30b-a3b (and any other `rewind init-model` preset of the nemotron_h / qwen3_5 / qwen3_next
    /// families). Ignored for the presets when --model-dir is given.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "nemotron-h-8b,qwen3.5-4b,nemotron-3-nano-30b-a3b"
    )]
    pub models: Vec<String>,
    /// Layers to keep of a preset (`PRESET=N`, comma-separated), e.g. `nemotron-3-nano-30b-a3b=12` so that a model
    /// fits one GPU; presets not named keep every layer.
    #[arg(long, value_delimiter = ',', default_value = "nemotron-3-nano-30b-a3b=12")]
    pub layers: Vec<String>,
    /// Existing model directories to sweep instead of the presets (repeatable).
    #[arg(long = "model-dir", value_name = "DIR")]
    pub model_dirs: Vec<PathBuf>,
    /// Where the presets' random checkpoints are written (default: a temporary directory removed at the end).
    #[arg(long, value_name = "DIR")]
    pub work_dir: Option<PathBuf>,
    /// Decode batch sizes of the batched-step sweep.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64,128,256")]
    pub batch: Vec<usize>,
    /// Forms: recurrent, replay, kv-only, spec (replay verifying --spec-window drafts, kept 0 … T).
    #[arg(long, value_delimiter = ',', default_value = "recurrent,replay,spec")]
    pub forms: Vec<String>,
    /// Drafts per verify step of the `spec` form.
    #[arg(long, default_value_t = 4, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub spec_window: usize,
    /// Timed decode tokens per sequence of each batched measure.
    #[arg(long, default_value_t = 16, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub decode_tokens: usize,
    /// Prompt tokens each sequence holds before the timed steps.
    #[arg(long, default_value_t = 16, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub step_prompt: usize,
    /// Repeats of each measure (the median is reported; an untimed warm-up run comes first).
    #[arg(long, default_value_t = 3, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub repeats: usize,
    /// Serving through the coordinator: requests kept in flight (`rewind bench --concurrency`).
    #[arg(long, default_value_t = 64, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub concurrency: usize,
    /// Serving: requests in all.
    #[arg(long, default_value_t = 256, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub requests: usize,
    /// Serving: prompt tokens per request.
    #[arg(long, default_value_t = 128, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub serving_prompt: usize,
    /// Serving: tokens generated per request.
    #[arg(long, default_value_t = 64, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub serving_tokens: usize,
    /// Skip the serving measure.
    #[arg(long)]
    pub no_serving: bool,
    /// Measured concurrency: the context (tokens) of every admitted sequence.
    #[arg(long, default_value_t = 1024, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub admit_context: usize,
    /// Measured concurrency: the memory budget for state, KV and everything else beyond the weights, in GiB.
    #[arg(long, default_value_t = 8.0, allow_negative_numbers = true)]
    pub admit_budget_gib: f64,
    /// Skip the measured-concurrency comparison (per-draft snapshots vs replay).
    #[arg(long)]
    pub no_concurrency: bool,
    /// Activation / weight dtype: bf16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Write the results as JSON to this file (schema `rewind-bench-e2e`, docs/benchmarks.md).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write the markdown tables to this file too (they always go to stdout).
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct BenchPlotArgs {
    /// Benchmark JSON files: `rewind bench e2e --json`, `rewind bench kernels --json`, `bench/peers/ssm_decode.py
    /// --json` (repeatable; the kind of each is read from its contents).
    #[arg(long, value_name = "FILE", required = true)]
    pub input: Vec<PathBuf>,
    /// Directory for the PNG plots and the markdown index (`plots.md`); created if absent.
    #[arg(long, value_name = "DIR")]
    pub out_dir: PathBuf,
    /// A TrueType font for the labels (default: the first found of the usual DejaVu / Liberation paths).
    #[arg(long, value_name = "FILE")]
    pub font: Option<PathBuf>,
}
