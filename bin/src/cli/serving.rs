//! The flags of the serving commands: `rewind serve`, `rewind chat` and `rewind-launch` (which adds `--gpus`).

use clap::{Args, ValueEnum};

use super::{non_negative, DecodeArgs, DeviceArgs, EngineArgs, ModelArgs, SpecArgs};

/// `--reasoning-parser` (vLLM's flag and names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ReasoningParserArg {
    Auto,
    Qwen3,
    None,
}

/// `--tool-call-parser` (vLLM's flag; the names of its parsers for the same formats).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ToolCallParserArg {
    /// The format the model's chat template writes tool calls in (none when it writes none).
    Auto,
    /// `<tool_call>` JSON (Qwen3).
    Hermes,
    /// `<tool_call><function=...><parameter=...>` (Nemotron-3, Qwen3.5, Qwen3-Coder).
    #[value(name = "qwen3_xml")]
    Qwen3Xml,
    /// `<TOOLCALL>[...]` (Nemotron-Nano-v2).
    #[value(name = "nemotron_json")]
    NemotronJson,
    /// Tools are rendered into the prompt but calls are never parsed out of the answer.
    None,
}

impl ToolCallParserArg {
    /// The format asked for: `Some(None)` for `none`, `None` for `auto` (the template decides).
    pub fn format(self) -> Option<Option<rewind_engine::tools::ToolFormat>> {
        use rewind_engine::tools::ToolFormat;
        match self {
            ToolCallParserArg::Auto => None,
            ToolCallParserArg::Hermes => Some(Some(ToolFormat::Hermes)),
            ToolCallParserArg::Qwen3Xml => Some(Some(ToolFormat::Qwen3Xml)),
            ToolCallParserArg::NemotronJson => Some(Some(ToolFormat::NemotronJson)),
            ToolCallParserArg::None => Some(None),
        }
    }
}

/// Where and how the servers listen (shared by `rewind serve` and `rewind-launch`).
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Serving")]
pub struct ListenArgs {
    /// Address both servers bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port of the gRPC session API (0: any free port; the bound port is printed).
    #[arg(long, default_value_t = 50051)]
    pub grpc_port: u16,
    /// Port of the OpenAI-compatible HTTP API (0: any free port; the bound port is printed).
    #[arg(long, default_value_t = 8000)]
    pub http_port: u16,
    /// Require `Authorization: Bearer KEY` (HTTP) / `authorization: Bearer KEY` metadata (gRPC) on every request.
    /// Repeat it to accept several keys: a gRPC session belongs to the key that created it, and other keys cannot
    /// see or use it.
    #[arg(long, value_name = "KEY")]
    pub api_key: Vec<String>,
    /// The model id both APIs report and accept (default: the model directory's name).
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Seconds a gRPC session may stay idle before it is closed and its state freed (0: never).
    #[arg(long, value_name = "SECS", default_value_t = 1800.0, allow_negative_numbers = true)]
    pub session_idle_timeout: f64,
    /// Host memory the gRPC sessions' saved states may hold together (bytes, or with a unit: 512MiB, 8GiB); a fork
    /// shares its parent's state until one of them runs a turn. Past it the least recently used idle sessions are
    /// evicted; a turn whose state cannot fit even then fails with RESOURCE_EXHAUSTED.
    #[arg(long, value_name = "BYTES", default_value = "8GiB", value_parser = super::byte_size)]
    pub session_memory: u64,
    /// Seconds SIGINT / SIGTERM waits for in-flight requests before the servers stop anyway.
    #[arg(long, value_name = "SECS", default_value_t = 30.0, allow_negative_numbers = true)]
    pub drain_timeout: f64,
    /// Tokens a request that sets no `max_tokens` may generate, on both APIs; capped to the room its context leaves
    /// after the prompt (and a gRPC session's earlier turns).
    #[arg(long, value_name = "N", default_value_t = crate::serve::state::DEFAULT_MAX_TOKENS as u64,
          value_parser = clap::value_parser!(u64).range(1..=1 << 24))]
    pub default_max_tokens: u64,
    /// Refuse HTTP requests with top-level fields the API does not know (a 400 naming them) instead of ignoring them
    /// with a warning (counted in /metrics as rewind_http_unknown_fields_total).
    #[arg(long)]
    pub strict_fields: bool,
    /// How chat answers are split into `reasoning_content` and `content`: `qwen3` (a `<think>...</think>` block,
    /// also when the template's generation prompt opens it), `none` (all of it is content), or `auto`: `qwen3` when
    /// the model's chat template mentions `<think>`.
    #[arg(long, value_name = "PARSER", value_enum, default_value_t = ReasoningParserArg::Auto)]
    pub reasoning_parser: ReasoningParserArg,
    /// How tool calls are read out of chat answers when a request sends `tools`: `hermes`, `qwen3_xml`,
    /// `nemotron_json`, `none` (tools are shown to the model, calls stay text), or `auto`: the format the model's chat
    /// template writes (a request with tools to a model whose template has none is refused).
    #[arg(long, value_name = "PARSER", value_enum, default_value_t = ToolCallParserArg::Auto)]
    pub tool_call_parser: ToolCallParserArg,
    /// The most connections each server (HTTP, gRPC) keeps open at once; one past it is closed at once (HTTP answers
    /// it 503 first), counted in /metrics as rewind_connections_refused_total.
    #[arg(long, value_name = "N", default_value_t = crate::serve::limits::DEFAULT_MAX_CONNECTIONS as u64,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_connections: u64,
    /// Seconds a client has to send a request's headers once it starts sending them (HTTP), or the HTTP/2 preface
    /// after connecting (gRPC); past it the connection is closed.
    #[arg(long, value_name = "SECS", default_value_t = crate::serve::limits::DEFAULT_HEADER_TIMEOUT_SECS,
          allow_negative_numbers = true)]
    pub header_timeout: f64,
    /// Seconds an HTTP request's body may take to arrive in full; past it the request gets a 408.
    #[arg(long, value_name = "SECS", default_value_t = crate::serve::limits::DEFAULT_BODY_TIMEOUT_SECS,
          allow_negative_numbers = true)]
    pub body_timeout: f64,
    /// Seconds an HTTP connection may sit idle between requests before it is closed (keep above a load balancer's
    /// own idle timeout).
    #[arg(long, value_name = "SECS", default_value_t = crate::serve::limits::DEFAULT_KEEP_ALIVE_TIMEOUT_SECS,
          allow_negative_numbers = true)]
    pub keep_alive_timeout: f64,
    /// The largest request in bytes: an HTTP body (a 413 past it, checked before the body is read) or a gRPC message.
    #[arg(long, value_name = "BYTES", default_value_t = crate::serve::limits::DEFAULT_MAX_REQUEST_BYTES as u64,
          value_parser = clap::value_parser!(u64).range(1024..=1 << 30))]
    pub max_request_bytes: u64,
}

/// How a model runs: decode form, speculation, device and engine (shared by `generate`, `serve`, `chat` and
/// `rewind-launch`).
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    #[command(flatten)]
    pub decode: DecodeArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

#[derive(Args, Debug, Clone)]
#[command(mut_args(env_for_every_flag))]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub listen: ListenArgs,
    #[command(flatten)]
    pub run: RunArgs,
    /// Run each rank in a worker process of its own (CPU ranks): a rank that crashes or is killed takes its worker
    /// down, not the server, and the coordinator starts a fresh one (docs/processes.md).
    #[arg(long, help_heading = "Serving")]
    pub rank_processes: bool,
}

/// What `--model` means to `rewind chat`.
const CHAT_MODEL_HELP: &str = "Model directory, served in this process on a loopback port for the chat (default: the \
embedded trained model that --default-model names); not read with --addr, where the server's model is used";

#[derive(Args, Debug)]
#[command(mut_arg("model", |a| a.help(CHAT_MODEL_HELP)))]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A running server's gRPC address, e.g. http://127.0.0.1:50051: the chat uses the model it serves, whose chat
    /// template and tokenizer render the turns on the server (no local copy of the model is needed).
    #[arg(long, value_name = "URL")]
    pub addr: Option<String>,
    /// The server's API key (sent as `authorization: Bearer KEY`; with --model the in-process server requires it).
    #[arg(long, value_name = "KEY", env = "REWIND_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// A system message at the start of every conversation.
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// Tokens each reply may have at most (default: the server's).
    #[arg(long, allow_negative_numbers = true, value_parser = non_negative::<i64>)]
    pub max_tokens: Option<i64>,
    /// Sampling temperature of the replies (default: the model's generation_config.json).
    #[arg(long, allow_hyphen_values = true)]
    pub temperature: Option<f32>,
    /// Nucleus sampling of the replies: keep the smallest set of tokens whose probability reaches P, in (0, 1].
    #[arg(long, allow_hyphen_values = true)]
    pub top_p: Option<f32>,
    /// Keep only the K most likely tokens of each reply step (0 = off).
    #[arg(long, allow_negative_numbers = true, value_parser = non_negative::<i64>)]
    pub top_k: Option<i64>,
    /// Random seed of the replies.
    #[arg(long, allow_negative_numbers = true, value_parser = non_negative::<u64>)]
    pub seed: Option<u64>,
    /// How the in-process server of --model runs it.
    #[command(flatten)]
    pub run: RunArgs,
}

/// Gives every long flag of a command without a variable of its own the variable `REWIND_<FLAG>` (`--grpc-port`:
/// `REWIND_GRPC_PORT`), so a container can configure the server through its environment alone.
pub fn env_for_every_flag(arg: clap::Arg) -> clap::Arg {
    let Some(long) = arg.get_long() else {
        return arg;
    };
    if arg.get_env().is_some() || arg.is_positional() {
        return arg;
    }
    let name = format!("REWIND_{}", long.to_uppercase().replace('-', "_"));
    // A secret's value must not show in --help.
    let arg = if long == "api-key" {
        arg.hide_env_values(true)
    } else {
        arg
    };
    // clap keeps variable names as `&'static str` without its `string` feature; these few names are made once per
    // process, so leaking them costs a few hundred bytes.
    arg.env(&*Box::leak(name.into_boxed_str()))
}
