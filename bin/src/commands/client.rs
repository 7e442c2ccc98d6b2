//! `rewind client`: the gRPC API from the command line — generate (streamed, in a session or not), sessions,
//! tokenization, health and statistics of a running server.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use rewind_engine::words::count;
use serde::Serialize;
use tonic::Status;

use crate::output::{errln, outln, write_stdout};
use crate::serve::grpc::client::{connect, Client};
use crate::serve::grpc::json::{finish_reason_name, serving_status_name};
use crate::serve::grpc::pb;

/// Where `rewind client` looks for a server unless told (the conventional gRPC port on this machine).
pub const DEFAULT_ADDR: &str = "http://127.0.0.1:50051";

/// `rewind client` flags.
#[derive(Args, Debug)]
pub struct ClientArgs {
    /// The server's gRPC address.
    #[arg(long, env = "REWIND_ADDR", default_value = DEFAULT_ADDR)]
    pub addr: String,
    /// The server's API key (sent as `authorization: Bearer KEY`).
    #[arg(long, env = "REWIND_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Print the replies as JSON (generate: one object per streamed chunk).
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: ClientCommand,
}

/// What `rewind client` does.
#[derive(Subcommand, Debug)]
pub enum ClientCommand {
    /// Generate from a prompt, streaming the text to stdout (a summary goes to stderr).
    Generate(ClientGenerateArgs),
    /// Create, fork, close or inspect sessions.
    #[command(subcommand)]
    Session(SessionCommand),
    /// The token ids of a text.
    Tokenize {
        text: String,
        /// Add the tokenizer's special tokens (BOS where the model uses one).
        #[arg(long)]
        special: bool,
    },
    /// Whether the server serves, and each rank's state (exits non-zero when it does not serve).
    Health,
    /// The engine's counters: slots, queue, tokens/s, speculation, sessions, recoveries.
    Stats,
}

/// Sampling flags of `rewind client` (unset ones keep the session's or the model's defaults).
#[derive(Args, Debug, Default)]
pub struct ClientSamplingArgs {
    /// Tokens to generate at most.
    #[arg(long, allow_negative_numbers = true)]
    pub max_tokens: Option<i64>,
    /// Sampling temperature (0 is greedy).
    #[arg(long, allow_negative_numbers = true)]
    pub temperature: Option<f32>,
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    #[arg(long, allow_negative_numbers = true)]
    pub top_k: Option<i64>,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop before this string (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
}

impl ClientSamplingArgs {
    fn to_pb(&self) -> pb::Sampling {
        pb::Sampling {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            ignore_eos: self.ignore_eos.then_some(true),
            max_tokens: self.max_tokens,
            stop: self.stop.iter().map(|s| s.clone().into_bytes()).collect(),
            ..Default::default()
        }
    }
}

/// `rewind client generate` flags.
#[derive(Args, Debug)]
pub struct ClientGenerateArgs {
    /// The prompt (a session turn: only the turn's new text).
    pub prompt: String,
    /// Run the prompt as a turn of this session (default: a stateless completion).
    #[arg(long)]
    pub session: Option<String>,
    #[command(flatten)]
    pub sampling: ClientSamplingArgs,
}

/// `rewind client session` subcommands.
#[derive(Subcommand, Debug)]
pub enum SessionCommand {
    /// Start an empty session (the flags become its sampling defaults); prints its id.
    Create {
        #[command(flatten)]
        sampling: ClientSamplingArgs,
        /// Never speculate in this session's turns.
        #[arg(long)]
        no_speculate: bool,
    },
    /// A new session holding a copy of session ID's state.
    Fork { id: String },
    /// Close session ID, freeing its state.
    Close { id: String },
    /// Every live session.
    List,
    /// One session's details.
    Show { id: String },
}

/// Runs `rewind client`.
pub fn run(args: ClientArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let mut c = connect(&args.addr, args.api_key.as_deref()).await?;
        match args.command {
            ClientCommand::Generate(g) => generate(&mut c, g, args.json).await,
            ClientCommand::Session(s) => session(&mut c, s, args.json).await,
            ClientCommand::Tokenize { text, special } => {
                let r = c
                    .tokenize(pb::TokenizeRequest {
                        text: text.into_bytes(),
                        add_special_tokens: special,
                    })
                    .await
                    .map_err(rpc_error)?
                    .into_inner();
                if args.json {
                    return print_json(&r);
                }
                let ids: Vec<String> = r.token_ids.iter().map(u32::to_string).collect();
                outln!("{}", ids.join(" "))
            }
            ClientCommand::Health => health(&mut c, args.json).await,
            ClientCommand::Stats => {
                let s = c.stats(pb::StatsRequest {}).await.map_err(rpc_error)?.into_inner();
                if args.json {
                    return print_json(&s);
                }
                write_stdout(&stats_text(&s))
            }
        }
    })
}

/// A failed call as an error that names its status code (`NotFound: session ... was closed`).
fn rpc_error(s: Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", s.code(), s.message())
}

fn print_json<T: Serialize>(v: &T) -> Result<()> {
    outln!("{}", serde_json::to_string(v)?)
}

async fn generate(c: &mut Client, g: ClientGenerateArgs, json: bool) -> Result<()> {
    let sampling = Some(g.sampling.to_pb());
    let text = g.prompt.into_bytes();
    let response = match g.session {
        Some(session_id) => {
            c.generate(pb::GenerateRequest {
                session_id,
                input: Some(pb::generate_request::Input::Text(text)),
                sampling,
                logprobs: false,
                n: None,
                top_logprobs: None,
            })
            .await
        }
        None => {
            c.complete(pb::CompleteRequest {
                input: Some(pb::complete_request::Input::Text(text)),
                sampling,
                speculate: None,
                logprobs: false,
                n: None,
                top_logprobs: None,
                prompt_logprobs: None,
            })
            .await
        }
    };
    let mut stream = response.map_err(rpc_error)?.into_inner();
    let mut last = None;
    while let Some(chunk) = stream.message().await.map_err(rpc_error)? {
        if json {
            print_json(&chunk)?;
        } else {
            write_stdout(&chunk.text)?;
        }
        last = Some(chunk);
    }
    let last = last.context("the server ended the stream without a chunk")?;
    if !json {
        write_stdout("\n")?;
        let u = last.usage.unwrap_or_default();
        errln!(
            "[{} prompt tokens ({} cached), {} generated | finish: {} | seed {}]",
            u.prompt_tokens,
            u.cached_tokens,
            u.completion_tokens,
            finish_reason_name(last.finish_reason),
            last.seed.map_or_else(|| "-".to_string(), |s| s.to_string())
        );
    }
    Ok(())
}

async fn session(c: &mut Client, cmd: SessionCommand, json: bool) -> Result<()> {
    // Its help promises the id alone, for `ID=$(rewind client session create)`.
    let id_only = matches!(cmd, SessionCommand::Create { .. }) && !json;
    let one = match cmd {
        SessionCommand::Create { sampling, no_speculate } => {
            c.create_session(pb::CreateSessionRequest {
                defaults: Some(sampling.to_pb()),
                speculate: Some(!no_speculate),
            })
            .await
        }
        SessionCommand::Fork { id } => c.fork_session(pb::ForkSessionRequest { session_id: id }).await,
        SessionCommand::Show { id } => c.get_session(pb::GetSessionRequest { session_id: id }).await,
        SessionCommand::Close { id } => {
            c.close_session(pb::CloseSessionRequest { session_id: id.clone() })
                .await
                .map_err(rpc_error)?;
            return if json {
                outln!("{}", serde_json::json!({ "closed": id }))
            } else {
                outln!("closed {id}")
            };
        }
        SessionCommand::List => {
            let r = c
                .list_sessions(pb::ListSessionsRequest {})
                .await
                .map_err(rpc_error)?
                .into_inner();
            if json {
                return print_json(&r);
            }
            let mut out = format!(
                "{:<40} {:>8} {:>6} {:>5} {:>10}  forked from\n",
                "id", "tokens", "turns", "busy", "idle s"
            );
            for s in &r.sessions {
                out.push_str(&format!(
                    "{:<40} {:>8} {:>6} {:>5} {:>10.1}  {}\n",
                    s.id,
                    s.tokens,
                    s.turns,
                    s.busy,
                    s.idle_seconds,
                    s.forked_from.as_deref().unwrap_or("-")
                ));
            }
            return write_stdout(&out);
        }
    };
    let s = one.map_err(rpc_error)?.into_inner();
    if json {
        print_json(&s)
    } else if id_only {
        outln!("{}", s.id)
    } else {
        outln!(
            "{}  ({}, {}{}{})",
            s.id,
            count(s.tokens, "token"),
            count(s.turns, "turn"),
            if s.busy { ", busy" } else { "" },
            s.forked_from
                .as_deref()
                .map(|f| format!(", forked from {f}"))
                .unwrap_or_default()
        )
    }
}

async fn health(c: &mut Client, json: bool) -> Result<()> {
    let h = c.health(pb::HealthRequest {}).await.map_err(rpc_error)?.into_inner();
    if json {
        print_json(&h)?;
    } else {
        let mut out = format!(
            "{} (model {}, rank generation {}){}\n",
            serving_status_name(h.status),
            h.model,
            h.generation,
            if h.message.is_empty() {
                String::new()
            } else {
                format!(": {}", h.message)
            }
        );
        for r in &h.ranks {
            out.push_str(&format!(
                "  rank {}: {}, {} slots in use, {} steps\n",
                r.rank, r.device, r.slots_in_use, r.steps
            ));
        }
        write_stdout(&out)?;
    }
    anyhow::ensure!(
        h.status == pb::ServingStatus::Serving as i32,
        "the server is not serving ({})",
        serving_status_name(h.status)
    );
    Ok(())
}

fn stats_text(s: &pb::StatsResponse) -> String {
    format!(
        "model            {}\n\
         status           {}\n\
         slots            {} in use of {} (tp {})\n\
         queue            {} waiting, {} running\n\
         tokens           {} prefilled, {} generated ({:.1}/s since start, {:.0} s ago)\n\
         requests         {} finished, {} failed, {} cancelled\n\
         speculation      {} accepted of {} drafted ({:.1}%)\n\
         sessions         {}\n\
         recoveries       {}\n",
        s.model,
        serving_status_name(s.status),
        s.slots_in_use,
        s.slots_total,
        s.tp,
        s.queue_depth,
        s.running,
        s.prefill_tokens,
        s.generated_tokens,
        s.generated_tokens_per_second,
        s.uptime_seconds,
        s.requests_finished,
        s.requests_failed,
        s.requests_cancelled,
        s.spec_accepted,
        s.spec_drafted,
        100.0 * s.acceptance_rate,
        s.sessions,
        s.recoveries,
    )
}
