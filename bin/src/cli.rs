//! Command-line arguments.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use rewind_engine::decode::FormChoice;
use rewind_engine::model::Family;
use rewind_engine::presets::{names_for, PRESETS};

mod bench_e2e;
mod bench_kernels;
mod bench_multiturn;
mod bytes;
mod compile_kernels;
mod device;
mod duration;
mod model;
mod plan;
mod selftest;
mod serving;
pub use bench_e2e::{BenchE2eArgs, BenchPlotArgs};
pub use bench_kernels::{BenchCommand, BenchKernelsArgs, KernelFamily};
pub use bench_multiturn::BenchMultiTurnArgs;
pub use bytes::byte_size;
pub use compile_kernels::CompileKernelsArgs;
pub use device::{Device, DeviceArgs};
pub use duration::{seconds, MAX_SECONDS};
pub use model::ModelArgs;
pub use plan::{PlanArgs, ShapeArgs};
pub use selftest::SelftestArgs;
pub use serving::{
    env_for_every_flag, ChatArgs, ListenArgs, ReasoningParserArg, RunArgs, ServeArgs, ToolCallParserArg,
};

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
    #[command(after_help = GENERATE_EXAMPLES)]
    Generate(GenerateArgs),
    /// Write per-position logits for a token sequence: the first N tokens through prefill, the rest through decode.
    #[command(after_help = LOGITS_EXAMPLES)]
    Logits(LogitsArgs),
    /// Perplexity of a text file under a model.
    #[command(after_help = PERPLEXITY_EXAMPLES)]
    Perplexity(PerplexityArgs),
    /// Write a complete HF-format checkpoint with seeded random weights.
    #[command(after_help = INIT_MODEL_EXAMPLES)]
    InitModel(InitModelArgs),
    /// Copy a float checkpoint with its linear layers' weights quantized in a published layout (fp8-block,
    /// modelopt-fp8 or nvfp4), e.g. to measure a model's perplexity quantized.
    Quantize(QuantizeArgs),
    /// Benchmarks: chunked vs token-by-token prefill, decode tokens per second; `bench kernels`: the SSM decode
    /// kernels alone.
    #[command(after_help = BENCH_EXAMPLES)]
    Bench(BenchArgs),
    /// How many sequences fit a memory budget, for each decode form and speculative window.
    #[command(after_help = PLAN_MEMORY_EXAMPLES)]
    PlanMemory(PlanMemoryArgs),
    /// Per-GPU memory, concurrency and projected decode / prefill speed of a model on a GPU profile, per decode form.
    #[command(after_help = plan::PLAN_EXAMPLES)]
    Plan(PlanArgs),
    /// Check every CUDA op against its CPU twin on fresh random inputs, and NCCL across the visible GPUs.
    #[command(after_help = SELFTEST_EXAMPLES)]
    Selftest(SelftestArgs),
    /// Compile every CUDA kernel with NVRTC for Hopper and Blackwell (no GPU needed): errors, missing entry points,
    /// and each entry point's registers and spills.
    #[command(after_help = COMPILE_KERNELS_EXAMPLES)]
    CompileKernels(CompileKernelsArgs),
    /// Serve a model: gRPC sessions and the OpenAI-compatible HTTP API in one process (SIGINT / SIGTERM drain it).
    #[command(after_help = SERVE_EXAMPLES)]
    Serve(ServeArgs),
    /// Chat with a model in the terminal, one gRPC session per conversation (`/reset`, `/fork`, `/stats`, `/quit`).
    #[command(after_help = CHAT_EXAMPLES)]
    Chat(ChatArgs),
    /// Talk to a running server over gRPC: generate, sessions, tokenize, health, stats.
    Client(crate::commands::client::ClientArgs),
    /// One rank of a server's model in a worker process of its own; started by `serve --rank-processes`, not by hand.
    #[command(hide = true)]
    RankWorker(RankWorkerArgs),
}

/// `rewind rank-worker`: what the coordinator tells a worker process (the cluster's cookie comes in the environment).
#[derive(Args, Debug)]
pub struct RankWorkerArgs {
    /// The model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// Tensor-parallel ranks of the group.
    #[arg(long)]
    pub tp: usize,
    /// The rank this worker hosts.
    #[arg(long)]
    pub rank: usize,
    /// Every rank's decoder sizes, as JSON.
    #[arg(long)]
    pub decoder: String,
    /// Load the checkpoint's MTP layer (`--spec mtp`).
    #[arg(long)]
    pub mtp: bool,
    /// The coordinator's cluster address.
    #[arg(long)]
    pub coordinator: std::net::SocketAddr,
    /// The process group the coordinator finds this worker under.
    #[arg(long)]
    pub group: String,
}

/// Examples shown after `rewind compile-kernels --help`.
const COMPILE_KERNELS_EXAMPLES: &str = "\
Examples:
  rewind compile-kernels                                  # every module for sm_90, sm_100 and sm_103
  rewind compile-kernels --arch sm_90 --only replay --json kernels.json
NVRTC (libnvrtc.so.13) must be loadable: scripts/nvrtc.sh puts it under target/nvrtc/lib (add that to LD_LIBRARY_PATH).";

/// Examples shown after `rewind serve --help`.
const SERVE_EXAMPLES: &str = "\
Examples:
  rewind serve --model ./my-model
  rewind serve --model ./my-model --device cuda --tp 2 --http-port 8080 --api-key secret
  REWIND_MODEL=./my-model REWIND_GRPC_PORT=0 REWIND_HTTP_PORT=0 rewind serve

Every flag can also come from the environment: REWIND_ and the flag's name in capitals with `_` for `-` (REWIND_MODEL,
REWIND_HOST, REWIND_GRPC_PORT, REWIND_HTTP_PORT, REWIND_API_KEY, REWIND_MAX_SEQS, ...); a flag given wins.";

/// Examples shown after `rewind chat --help`.
const CHAT_EXAMPLES: &str = "\
Examples:
  rewind chat --model ./my-model --system \"Be brief.\"
  rewind chat --model ./my-model --addr http://127.0.0.1:50051 --api-key secret
  printf 'hello\\n/fork\\nand then?\\n/stats\\n' | rewind chat --model ./my-model";

/// Examples shown after `rewind logits --help`.
const LOGITS_EXAMPLES: &str = "\
Examples:
  rewind logits --model ./my-model --tokens 5,17,42,7,9 --prefill 3 --out logits.json
  rewind logits --model ./my-model --tokens 5,17,42,7,9 --prefill 3 --out logits.json --decode replay --tp 2";

/// Examples shown after `rewind perplexity --help`.
const PERPLEXITY_EXAMPLES: &str = "\
Examples:
  rewind perplexity --model ./my-model --file book.txt
  rewind perplexity --default-model qwen3_5 --file book.txt
  rewind perplexity --model ./my-model --file book.txt --window 512 --json";

/// Examples shown after `rewind init-model --help`.
const INIT_MODEL_EXAMPLES: &str = "\
Examples:
  rewind init-model --arch nemotron_h --preset tiny --out ./tiny
  rewind init-model --arch qwen3_5 --preset qwen3.5-4b --layers 4 --out ./q4b-cut --force";

/// Examples shown after `rewind plan-memory --help`.
const PLAN_MEMORY_EXAMPLES: &str = "\
Examples:
  rewind plan-memory --arch nemotron_h --preset nemotron-h-8b --budget 70GiB
  rewind plan-memory --model ./my-model --budget 40GiB --context 8192 --spec-window 4 --json";

/// Examples shown after `rewind selftest --help`.
const SELFTEST_EXAMPLES: &str = "\
Examples:
  rewind selftest --device cuda
  rewind selftest --device cuda:1 --only ssd_scan --no-model --json selftest.json";

/// Examples shown after `rewind generate --help`.
const GENERATE_EXAMPLES: &str = "\
Examples:
  rewind generate \"The quick brown fox\" --max-tokens 32
  rewind generate --default-model qwen3_5 \"It is a truth universally acknowledged\" --temperature 0
  rewind generate --model ./my-model --chat --system \"Be brief.\" \"What is an SSM?\"
  echo \"Once upon a time\" | rewind generate - --temperature 0 --json
  rewind generate --model ./my-model --prompt-file prompt.txt --device cuda --tp 2";

/// Examples shown after `rewind bench --help`.
const BENCH_EXAMPLES: &str = "\
Examples:
  rewind bench --model ./my-model --prompt-len 1024 --decode-tokens 64
  rewind bench --model ./my-model --device cuda --batch 1,16,64 --json bench.json
  rewind bench --model ./my-model --concurrency 8 --requests 64 --serving-only
  rewind bench kernels --device cuda --json kernels.json";

/// A whole number of at least 0 (a negative one is a clear error rather than clap's \"unexpected argument\").
fn non_negative<T>(s: &str) -> Result<T, String>
where
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    if s.trim_start().starts_with('-') {
        return Err(format!("must be a non-negative integer, got `{s}`"));
    }
    s.parse::<T>()
        .map_err(|e| format!("must be a non-negative integer, got `{s}` ({e})"))
}

/// Sampling flags shared by the commands that generate.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Maximum number of tokens to generate.
    #[arg(long, default_value_t = 64, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy. Default: the model's generation_config.json, else 1.0.
    #[arg(long, allow_hyphen_values = true)]
    pub temperature: Option<f32>,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches P, in (0, 1].
    #[arg(long, allow_hyphen_values = true)]
    pub top_p: Option<f32>,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, allow_hyphen_values = true, value_parser = non_negative::<usize>)]
    pub top_k: Option<usize>,
    /// Drop tokens whose probability is below P times the most likely token's, in [0, 1].
    #[arg(long, allow_hyphen_values = true)]
    pub min_p: Option<f32>,
    /// Repetition penalty (> 0; 1 = off).
    #[arg(long, allow_hyphen_values = true)]
    pub repetition_penalty: Option<f32>,
    /// Random seed: the same seed gives the same output.
    #[arg(long, allow_negative_numbers = true, value_parser = non_negative::<u64>)]
    pub seed: Option<u64>,
    /// Stop when this string is generated (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Stop when this token id is generated (repeatable).
    #[arg(long = "stop-token-id", allow_negative_numbers = true, value_parser = non_negative::<u32>)]
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// OpenAI presence penalty over the tokens generated so far, in [-2, 2] (0 = off).
    #[arg(long, allow_hyphen_values = true)]
    pub presence_penalty: Option<f32>,
    /// OpenAI frequency penalty over the tokens generated so far, per occurrence, in [-2, 2] (0 = off).
    #[arg(long, allow_hyphen_values = true)]
    pub frequency_penalty: Option<f32>,
    /// Add BIAS (in [-100, 100]) to token ID's logit, as ID=BIAS (repeatable).
    #[arg(long = "logit-bias", value_name = "ID=BIAS", allow_hyphen_values = true, value_parser = logit_bias_entry)]
    pub logit_bias: Vec<(u32, f32)>,
    /// End-of-sequence and stop tokens cannot end the output, nor stop strings, before this many tokens.
    #[arg(long, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub min_tokens: Option<usize>,
    /// Keep the stop string that ended the output in the text.
    #[arg(long)]
    pub include_stop_str_in_output: bool,
}

/// `--logit-bias ID=BIAS`: the pair (its ranges are checked with the other sampling parameters).
fn logit_bias_entry(s: &str) -> Result<(u32, f32), String> {
    let (id, bias) = s
        .split_once('=')
        .ok_or_else(|| format!("expected ID=BIAS (e.g. 42=-100), got `{s}`"))?;
    let id = non_negative::<u32>(id.trim())?;
    let bias = bias
        .trim()
        .parse::<f32>()
        .map_err(|e| format!("the bias of `{s}` is not a number ({e})"))?;
    Ok((id, bias))
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// The prompt, or `-` to read it from stdin (default: "The quick brown fox"). One trailing newline of a prompt
    /// read from stdin or a file is dropped.
    pub prompt: Option<String>,
    /// Read the prompt from this file (`-`: stdin).
    #[arg(long, value_name = "FILE", conflicts_with = "prompt")]
    pub prompt_file: Option<PathBuf>,
    /// A system message before the prompt (with --chat).
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Render the prompt as a user message with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Print one JSON object `{ "text", "tokens", "stats" }` instead of streaming text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub run: RunArgs,
}

/// Speculative decoding (shared by `generate` and `bench`).
#[derive(Args, Debug, Clone)]
pub struct SpecArgs {
    /// Drafter: none, ngram (prompt lookup), mtp (the checkpoint's MTP layer), draft:DIR (a smaller checkpoint with
    /// the same tokenizer), or oracle:P (benchmarking only: the target's own greedy continuation, each token
    /// corrupted with probability P).
    #[arg(
        long,
        value_name = "DRAFTER",
        default_value = "none",
        help_heading = "Speculative decoding"
    )]
    pub spec: String,
    /// Drafts per step T (a verify runs 1 + T tokens; needs --buffer-len ≥ 2·(1 + T)).
    #[arg(long, value_name = "T", default_value_t = 4, allow_negative_numbers = true,
          value_parser = non_negative::<usize>, help_heading = "Speculative decoding")]
    pub spec_window: usize,
    /// Window policy: fixed (always up to T drafts) or adaptive (per step, the window 0..=T with the most expected
    /// tokens per second for the measured acceptance and this machine's step times: --spec-profile, then the
    /// server's own steps; an analytic prior until anything is measured).
    #[arg(
        long,
        value_name = "POLICY",
        default_value = "fixed",
        help_heading = "Speculative decoding"
    )]
    pub spec_policy: String,
    /// With --spec-policy adaptive: the step times measured on this machine that the window starts from, as
    /// `rewind bench --verify-window T --write-step-profile PATH` writes them.
    #[arg(long, value_name = "PATH", help_heading = "Speculative decoding")]
    pub spec_profile: Option<PathBuf>,
    /// Shortest and longest n-gram the ngram drafter matches.
    #[arg(long, value_name = "N", default_value_t = rewind_engine::spec::config::NGRAM_MIN,
          allow_negative_numbers = true, value_parser = non_negative::<usize>, help_heading = "Speculative decoding")]
    pub ngram_min: usize,
    #[arg(long, value_name = "N", default_value_t = rewind_engine::spec::config::NGRAM_MAX,
          allow_negative_numbers = true, value_parser = non_negative::<usize>, help_heading = "Speculative decoding")]
    pub ngram_max: usize,
}

/// How the serving engine (coordinator and rank actors) runs (shared by `generate` and `bench`).
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// The most tokens one engine step runs: one per decoding sequence plus prompt chunks.
    #[arg(long, default_value_t = 2048, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub max_batch_tokens: usize,
    /// Seconds every rank gets to answer a step; a rank that takes longer counts as hung and the ranks restart.
    #[arg(long, default_value_t = 60.0, allow_negative_numbers = true)]
    pub step_timeout: f64,
    /// Faults a request may live through (each restarts the ranks and re-prefills it); one more fails it.
    #[arg(long, default_value_t = 3, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub max_retries: usize,
    /// Testing aid: make rank RANK fail the engine's step number STEP (from 1) with KIND = panic | hang | error |
    /// nan, e.g. `0:panic@5` (repeatable). The engine recovers; outputs must not change.
    #[arg(long = "inject-fault", value_name = "RANK:KIND@STEP")]
    pub inject_fault: Vec<String>,
    /// Decode steps one engine step may chain on the ranks with no host round trip between them (1 to 16; 1: none;
    /// like vLLM's --num-scheduler-steps). A step chains only while every running sequence decodes (no prompt chunk,
    /// verify or waiting request it could admit), never for session turns or repetition penalties; a stop is noticed
    /// at the end of the chain and the tokens after it are dropped. With --spec ngram or oracle:P, speculating requests (greedy, or sampled at a plain temperature) chain
    /// their verifies the same way, while every running sequence verifies a window of the same size and no request
    /// waits: the ranks judge, commit and draft between the steps (not in the recurrent form).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub decode_steps: usize,
    /// Turn automatic prefix caching off (vLLM's flag). It is on by default: a finished sequence's state is kept by
    /// the ranks (in device memory on GPUs, host memory on the CPU), and a request whose prompt starts with a cached
    /// sequence's tokens starts from that state and prefills only the rest (docs/serving.md#prefix-caching).
    #[arg(long, help_heading = "Prefix caching", conflicts_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// Turn automatic prefix caching on (vLLM's flag): it is on by default on every device, so this only says so.
    #[arg(long, help_heading = "Prefix caching")]
    pub enable_prefix_caching: bool,
    /// Memory the prefix cache's states may hold together, in GiB: set aside on each GPU (taken from the KV cache's
    /// share of --gpu-memory-fraction), host memory on the CPU; past it the least recently used go.
    #[arg(long, value_name = "GIB", default_value_t = rewind_actors::DEFAULT_PREFIX_CACHE_MEMORY as f64 / GIB,
          allow_negative_numbers = true, help_heading = "Prefix caching")]
    pub prefix_cache_gib: f64,
    /// The fewest tokens a cached prefix holds: a finished sequence shorter than this is not copied, and a request
    /// restores no shorter prefix (a short one costs more to copy back than to prefill).
    #[arg(long, value_name = "N", default_value_t = rewind_actors::DEFAULT_PREFIX_MIN_TOKENS,
          allow_negative_numbers = true, value_parser = non_negative::<usize>, help_heading = "Prefix caching")]
    pub prefix_cache_min_tokens: usize,
}

/// Bytes in a GiB, as the prefix cache's flag counts them.
pub const GIB: f64 = (1u64 << 30) as f64;

/// How SSM layers decode (shared by `generate` and `logits`).
#[derive(Args, Debug, Clone)]
pub struct DecodeArgs {
    /// Decode form: recurrent, replay, kv-only, or auto (kv-only while the context is short, then replay); every
    /// form runs on the CPU and on GPUs [default: auto].
    #[arg(long = "decode", value_name = "FORM", value_parser = parse_form)]
    pub form: Option<FormChoice>,
    /// Input-ring capacity L of the replay form (at least 2); a kv-only sequence holds up to threshold + T entries
    /// until it compresses into replay.
    #[arg(long, value_name = "L", default_value_t = rewind_engine::state::DEFAULT_BUFFER_LEN, value_parser = parse_buffer_len)]
    pub buffer_len: usize,
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
    #[command(flatten)]
    pub model: ModelArgs,
    /// Comma-separated token ids, e.g. 5,17,42.
    #[arg(long, value_delimiter = ',', required = true)]
    pub tokens: Vec<u32>,
    /// How many leading tokens go through the prefill path in one pass (the rest are decoded one at a time).
    #[arg(long)]
    pub prefill: usize,
    /// Output JSON file: { "tokens": [...], "logits": [[f32; vocab] per position] }; with --reference-form, the
    /// per-position differences instead (see `rewind logits --help`).
    #[arg(long)]
    pub out: PathBuf,
    /// After the prefill, feed the rest through speculative verify steps of 1 + T tokens, teacher-forced (the
    /// drafts are the next tokens), each keeping its tokens up to the first rejected draft.
    #[arg(long, value_name = "T")]
    pub verify_window: Option<usize>,
    /// With --verify-window: the probability that each draft is rejected (drawn with --seed).
    #[arg(long, value_name = "P", default_value_t = 0.0)]
    pub verify_reject: f64,
    /// Seed of the --verify-reject draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also run the tokens in this form without speculation (prefill, then one decode per token) and write the
    /// per-position differences to --out: the largest absolute and relative (to the row's largest |logit|)
    /// difference, where it is, and how many positions agree on the argmax.
    #[arg(long, value_name = "FORM", value_parser = parse_form)]
    pub reference_form: Option<FormChoice>,
    #[command(flatten)]
    pub decode: DecodeArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
}

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text file to score.
    #[arg(long)]
    pub file: PathBuf,
    /// Longest window scored in one pass, from 2 to the model's context limit (the default).
    #[arg(long, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub window: Option<usize>,
    /// Print a JSON object instead of a line.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// `--preset`'s help: every preset of the engine's table, by family, so that none can be left out of it.
fn preset_help() -> String {
    let mut families: Vec<Family> = Vec::new();
    for p in PRESETS {
        if !families.contains(&p.family) {
            families.push(p.family);
        }
    }
    let lists: Vec<String> = families
        .iter()
        .map(|&f| format!("{}: {}", f.name(), names_for(f).join(", ")))
        .collect();
    format!("Preset, by --arch ({})", lists.join("; "))
}

#[derive(Args, Debug)]
#[command(mut_arg("preset", |a| a.help(preset_help())))]
pub struct InitModelArgs {
    /// Model family: nemotron_h, qwen3_next, qwen3_5 or qwen3_5_moe.
    #[arg(long)]
    pub arch: String,
    /// Preset: tiny, small, or a real model's shape (the help lists every one, from the engine's preset table).
    #[arg(long)]
    pub preset: String,
    /// Output directory: must not exist or be empty, unless --force.
    #[arg(long)]
    pub out: PathBuf,
    /// Keep only the first N decoder layers (1 up to the preset's depth; --layers cannot add layers).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Weight seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Storage dtype: f32 or bf16 (default: f32 for tiny/small, bf16 for real shapes).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Write into --out even when it is not empty: the checkpoint there (config, generation config, tokenizer files,
    /// chat template, weight shards and index) is replaced; other files are left alone. Without --force a non-empty
    /// --out is refused.
    #[arg(long)]
    pub force: bool,
    /// Also write one random MTP layer (`mtp.*` tensors in the family's published layout) for `--spec mtp`; for
    /// nemotron_h an attention then a MoE layer (`mtp_hybrid_override_pattern: "*E"`, as Nemotron-3 Super).
    #[arg(long)]
    pub mtp: bool,
    /// Quantize the linear layers' weights in a published layout: fp8-block (fine-grained FP8, 128×128 blocks, as
    /// the Qwen3-Next / Qwen3.5 FP8 checkpoints), modelopt-fp8 (per-tensor FP8, as NVIDIA's ModelOpt exports) or
    /// nvfp4 (ModelOpt NVFP4: E2M1 weights, an E4M3 scale per 16 elements). Embeddings, the LM head, norms,
    /// convolutions and MoE routers stay in --dtype.
    #[arg(long, value_name = "LAYOUT")]
    pub quant: Option<String>,
}

#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// The float checkpoint (a directory; it is read, never changed).
    #[arg(long)]
    pub model: PathBuf,
    /// Output directory: must not exist or be empty. Every file of --model is copied there, then its weights are
    /// quantized in place.
    #[arg(long)]
    pub out: PathBuf,
    /// fp8-block, modelopt-fp8 or nvfp4 (as `init-model --quant`).
    #[arg(long, value_name = "LAYOUT")]
    pub quant: String,
}

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    /// `kernels`: time the SSM decode kernels alone instead of a model (the flags below then do not apply).
    #[command(subcommand)]
    pub command: Option<BenchCommand>,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length for the prefill comparison.
    #[arg(long, default_value_t = 1024, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub prompt_len: usize,
    /// Tokens decoded for the decode rate (at least 1; the prompt plus these must fit the model's context).
    #[arg(long, default_value_t = 64, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub decode_tokens: usize,
    /// Repeats of each measurement (the median is reported).
    #[arg(long, default_value_t = 3, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub repeats: usize,
    /// Prompt tokens each sequence of the batched decode and verify measures holds before its timed steps (prefilled
    /// once per measure), e.g. 8192 to time decoding at an 8K context.
    #[arg(long, default_value_t = 16, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub step_prompt: usize,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Decode batch sizes (default 1 on the CPU, 1,64 on GPUs): each runs that many sequences through the batched step.
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub batch: Option<Vec<usize>>,
    /// Serving mode: keep N requests in flight through the engine (coordinator and rank actors) and report output
    /// tokens/s, time to first token and inter-token latency (p50 / p99), after the batched-step numbers.
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub concurrency: Option<usize>,
    /// Serving mode: requests in all (each a --prompt-len prompt generating --decode-tokens tokens).
    #[arg(long, value_name = "M", requires = "concurrency", allow_negative_numbers = true,
          value_parser = non_negative::<usize>)]
    pub requests: Option<usize>,
    /// Serving mode only: skip the batched-step numbers.
    #[arg(long, requires = "concurrency")]
    pub serving_only: bool,
    /// Serving mode: draw each request's prompt and output lengths uniformly from ±R around --prompt-len and
    /// --decode-tokens (R in [0, 1), as vLLM's benchmark `--random-range-ratio`), the same for every run, so requests
    /// end at different steps as real traffic does.
    #[arg(
        long,
        value_name = "R",
        default_value_t = 0.0,
        requires = "concurrency",
        allow_negative_numbers = true
    )]
    pub random_range_ratio: f64,
    /// Serving mode: every request's sampling temperature (0: greedy). Request i samples with seed 0x5eed + i in
    /// every pass, so passes draw alike; speculative outputs are then not compared with plain ones (speculation
    /// keeps the distribution, not the draws).
    #[arg(
        long,
        value_name = "T",
        default_value_t = 0.0,
        requires = "concurrency",
        allow_negative_numbers = true
    )]
    pub temperature: f32,
    /// Also time speculative verify steps of T drafts at each batch size, keeping exactly 0, 1, …, T drafts per step
    /// (commit and rollback included), beside the plain decode step.
    #[arg(long, value_name = "T", allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub verify_window: Option<usize>,
    /// Write the decode and verify step times (with --verify-window) as a step profile to this file, for
    /// `--spec-policy adaptive --spec-profile PATH`: per batch size, the decode step and the verify step of T drafts
    /// (the mean over its kept counts).
    #[arg(long, value_name = "PATH", requires = "verify_window")]
    pub write_step_profile: Option<PathBuf>,
    /// GPUs: also time drafting a window of --verify-window T drafts with the checkpoint's MTP layer on the ranks
    /// (the catch-up over the rows a verify keeps, then T draft steps; CUDA events around the MTP work), at each batch
    /// size, as a fraction of the verify step. Loads the MTP layer (the checkpoint must have one).
    #[arg(long, requires = "verify_window")]
    pub mtp_draft: bool,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Args, Debug)]
pub struct PlanMemoryArgs {
    #[command(flatten)]
    pub shape: ShapeArgs,
    /// Memory budget for weights plus sequences: 70GiB, 70GB, 512MiB, or plain bytes.
    #[arg(long, allow_hyphen_values = true)]
    pub budget: String,
    /// Tokens of context each sequence reserves in its attention layers, from 1 to max_position_embeddings (the
    /// default).
    #[arg(long, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
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
