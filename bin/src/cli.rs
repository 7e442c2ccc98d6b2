//! Command-line arguments.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use rewind_engine::decode::FormChoice;

/// rewind — a serving engine for hybrid SSM language models (Nemotron-H, Qwen3-Next, Qwen3.5).
#[derive(Parser, Debug)]
#[command(
    name = "rewind",
    version,
    about = "rewind — a serving engine for hybrid SSM language models (Nemotron-H, Qwen3-Next, Qwen3.5)",
    long_about = None
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate text from a prompt (streams to stdout; a summary goes to stderr).
    Generate(GenerateArgs),
    /// Write per-position logits for a token sequence: the first N tokens through prefill, the rest through decode.
    Logits(LogitsArgs),
    /// Perplexity of a text file under a model.
    Perplexity(PerplexityArgs),
    /// Write a complete HF-format checkpoint with seeded random weights.
    InitModel(InitModelArgs),
    /// Benchmarks: chunked vs token-by-token prefill, decode tokens per second.
    Bench(BenchArgs),
    /// How many sequences fit a memory budget, for each decode form and speculative window.
    PlanMemory(PlanMemoryArgs),
    /// Check every CUDA op against its CPU twin on fresh random inputs, and NCCL across the visible GPUs.
    Selftest(SelftestArgs),
}

/// Sampling flags shared by the commands that generate.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Maximum number of tokens to generate.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy. Default: the model's generation_config.json, else 1.0.
    #[arg(long, allow_hyphen_values = true)]
    pub temperature: Option<f32>,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches P, in (0, 1].
    #[arg(long, allow_hyphen_values = true)]
    pub top_p: Option<f32>,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, allow_hyphen_values = true)]
    pub top_k: Option<usize>,
    /// Drop tokens whose probability is below P times the most likely token's, in [0, 1].
    #[arg(long, allow_hyphen_values = true)]
    pub min_p: Option<f32>,
    /// Repetition penalty (> 0; 1 = off).
    #[arg(long, allow_hyphen_values = true)]
    pub repetition_penalty: Option<f32>,
    /// Random seed: the same seed gives the same output.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this string is generated (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Stop when this token id is generated (repeatable).
    #[arg(long = "stop-token-id")]
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// The prompt (default: "The quick brown fox").
    pub prompt: Option<String>,
    /// Model directory (config.json, *.safetensors, tokenizer.json). Default: the embedded `small` model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Render the prompt as a user message with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Print one JSON object `{ "text", "tokens", "stats" }` instead of streaming text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub decode: DecodeArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// How the serving engine (coordinator and rank actors) runs (shared by `generate` and `bench`).
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// The most tokens one engine step runs: one per decoding sequence plus prompt chunks.
    #[arg(long, default_value_t = 2048)]
    pub max_batch_tokens: usize,
    /// Seconds every rank gets to answer a step; a rank that takes longer counts as hung and the ranks restart.
    #[arg(long, default_value_t = 60.0)]
    pub step_timeout: f64,
    /// Faults a request may live through (each restarts the ranks and re-prefills it); one more fails it.
    #[arg(long, default_value_t = 3)]
    pub max_retries: usize,
    /// Testing aid: make rank RANK fail the engine's step number STEP (from 1) with KIND = panic | hang | error |
    /// nan, e.g. `0:panic@5` (repeatable). The engine recovers; outputs must not change.
    #[arg(long = "inject-fault", value_name = "RANK:KIND@STEP")]
    pub inject_fault: Vec<String>,
}

/// How SSM layers decode (shared by `generate` and `logits`).
#[derive(Args, Debug, Clone)]
pub struct DecodeArgs {
    /// Decode form: recurrent, replay, kv-only, or auto (kv-only while the context is short, then replay).
    /// Default: auto on the CPU, recurrent on a GPU (the only form the GPU rank has yet).
    #[arg(long = "decode", value_name = "FORM", value_parser = parse_form)]
    pub form: Option<FormChoice>,
    /// Input-ring capacity L of the replay form (at least 2); a kv-only sequence holds up to threshold + T entries
    /// until it compresses into replay.
    #[arg(long, value_name = "L", default_value_t = rewind_engine::state::DEFAULT_BUFFER_LEN, value_parser = parse_buffer_len)]
    pub buffer_len: usize,
}

impl DecodeArgs {
    /// Fails unless the form can run on a GPU (recurrent, the default there).
    pub fn check_gpu(&self) -> anyhow::Result<()> {
        match self.form {
            None | Some(FormChoice::Recurrent) => Ok(()),
            Some(f) => anyhow::bail!(
                "--decode {f}: the GPU runner decodes with the recurrent form only so far; the replay, kv-only and auto \
                 forms run on the CPU (--device cpu)"
            ),
        }
    }
}

/// Where a model runs (shared by `generate`, `logits` and `bench`).
#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Device: `cpu`, `cuda` (GPU 0) or `cuda:N` (with --tp, GPUs N .. N + tp − 1).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Tensor-parallel ranks: one GPU each (NCCL all-reduces between them), or on the CPU one thread each (in-process
    /// all-reduces).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Fraction of each GPU's memory rewind may take for weights, activations and state pools, in (0, 1].
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_fraction: f64,
    /// Most sequences alive at once on a GPU (state slots; also the largest decode batch).
    #[arg(long, default_value_t = 64)]
    pub max_seqs: usize,
    /// Longest sequence on a GPU, in tokens (default: the model's limit, at most 32768).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Tokens per prefill chunk on a GPU.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Storage type of GPU activations and state: bf16, or f32 (GEMM inputs still rounded to bf16; for accuracy
    /// checks).
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
}

/// A parsed `--device`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// The GPU ordinals of the ranks.
    Cuda(Vec<usize>),
}

impl DeviceArgs {
    /// Parses `--device` and `--tp`.
    pub fn device(&self) -> anyhow::Result<Device> {
        if self.tp == 0 {
            anyhow::bail!("--tp must be at least 1");
        }
        let first = match self.device.as_str() {
            "cpu" => return Ok(Device::Cpu),
            "cuda" => 0,
            d => match d.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => n,
                _ => anyhow::bail!("unknown device `{d}`: expected `cpu`, `cuda` or `cuda:N`"),
            },
        };
        Ok(Device::Cuda((first..first + self.tp).collect()))
    }
}

fn parse_form(s: &str) -> Result<FormChoice, String> {
    s.parse().map_err(|e: rewind_engine::EngineError| e.to_string())
}

fn parse_buffer_len(s: &str) -> Result<usize, String> {
    let l: usize = s.parse().map_err(|e| format!("`{s}` is not a whole number: {e}"))?;
    if l < 2 {
        return Err(format!("the input ring must hold at least 2 entries, found {l}"));
    }
    Ok(l)
}

#[derive(Args, Debug)]
pub struct LogitsArgs {
    /// Model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// Comma-separated token ids, e.g. 5,17,42.
    #[arg(long, value_delimiter = ',', required = true)]
    pub tokens: Vec<u32>,
    /// How many leading tokens go through the prefill path in one pass (the rest are decoded one at a time).
    #[arg(long)]
    pub prefill: usize,
    /// Output JSON file: { "tokens": [...], "logits": [[f32; vocab] per position] }.
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub decode: DecodeArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
}

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    /// Model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// Text file to score.
    #[arg(long)]
    pub file: PathBuf,
    /// Longest window scored in one pass (default: the model's context limit).
    #[arg(long)]
    pub window: Option<usize>,
    /// Print a JSON object instead of a line.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct InitModelArgs {
    /// Model family: nemotron_h, qwen3_next, qwen3_5 or qwen3_5_moe.
    #[arg(long)]
    pub arch: String,
    /// Preset: tiny, small, or a real shape (nemotron-h-8b, nemotron-3-nano-30b-a3b, qwen3.5-4b, qwen3.5-9b,
    /// qwen3.5-35b-a3b, qwen3.5-122b-a10b, qwen3-next-80b-a3b).
    #[arg(long)]
    pub preset: String,
    /// Output directory.
    #[arg(long)]
    pub out: PathBuf,
    /// Keep only the first N decoder layers.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Weight seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Storage dtype: f32 or bf16 (default: f32 for tiny/small, bf16 for real shapes).
    #[arg(long)]
    pub dtype: Option<String>,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model directory (default: the embedded `small` model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Prompt length for the prefill comparison.
    #[arg(long, default_value_t = 1024)]
    pub prompt_len: usize,
    /// Tokens decoded for the decode rate.
    #[arg(long, default_value_t = 64)]
    pub decode_tokens: usize,
    /// Repeats of each measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Decode batch sizes (default 1 on the CPU, 1,64 on GPUs): each runs that many sequences through the batched step.
    #[arg(long, value_delimiter = ',')]
    pub batch: Option<Vec<usize>>,
    /// Serving mode: keep N requests in flight through the engine (coordinator and rank actors) and report output
    /// tokens/s, time to first token and inter-token latency (p50 / p99), after the batched-step numbers.
    #[arg(long, value_name = "N")]
    pub concurrency: Option<usize>,
    /// Serving mode: requests in all (each a --prompt-len prompt generating --decode-tokens tokens).
    #[arg(long, value_name = "M", requires = "concurrency")]
    pub requests: Option<usize>,
    /// Serving mode only: skip the batched-step numbers.
    #[arg(long, requires = "concurrency")]
    pub serving_only: bool,
    #[command(flatten)]
    pub decode: DecodeArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

#[derive(Args, Debug)]
pub struct PlanMemoryArgs {
    /// Model directory (only config.json is read).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Plan a preset shape instead of a model directory (with --arch), e.g. nemotron-h-8b, qwen3.5-4b.
    #[arg(long)]
    pub preset: Option<String>,
    /// Model family of --preset: nemotron_h, qwen3_next, qwen3_5 or qwen3_5_moe.
    #[arg(long)]
    pub arch: Option<String>,
    /// Memory budget for weights plus sequences: 70GiB, 70GB, 512MiB, or plain bytes.
    #[arg(long)]
    pub budget: String,
    /// Tokens of context each sequence reserves in its attention layers (default: max_position_embeddings).
    #[arg(long)]
    pub context: Option<usize>,
    /// Speculative window T (draft tokens per step); 0 plans standard decoding only.
    #[arg(long, default_value_t = 0)]
    pub spec_window: usize,
    /// Input-ring capacity L of the replay form.
    #[arg(long, default_value_t = rewind_engine::state::DEFAULT_BUFFER_LEN)]
    pub buffer_len: usize,
    /// Tokens per paged KV block.
    #[arg(long, default_value_t = rewind_engine::state::DEFAULT_KV_BLOCK_SIZE)]
    pub kv_block_size: usize,
    /// Print one JSON object `{ "forms": [ { "form", "spec_window", "bytes_per_sequence", "max_sequences", ... } ],
    /// ... }` instead of a table.
    #[arg(long)]
    pub json: bool,
}

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
    /// Fixture models for the model-level check (teacher-forced GPU logits against the CPU; with 2 GPUs also --tp 2).
    #[arg(long, default_value = "tests/fixtures")]
    pub fixtures: PathBuf,
    /// Skip the model-level check.
    #[arg(long)]
    pub no_model: bool,
}
