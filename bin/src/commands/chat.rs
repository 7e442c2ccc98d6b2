//! `rewind chat`: an interactive multi-turn chat over a gRPC session. Without `--addr` it serves the model in this
//! process on a loopback port and talks to that server, so a local chat and a remote one take the same path. Each
//! user turn is rendered by the server with its model's chat template, and only what the session lacks is sent
//! ([`turns`]): the client needs no copy of the model and cannot disagree with the server about it. Commands:
//! `/reset`, `/fork`, `/stats`, `/quit`. On a terminal lines are edited with rustyline; otherwise lines are read
//! from stdin until its end.

mod turns;

use std::io::{BufRead, IsTerminal};
use std::time::Instant;

use anyhow::{Context, Result};
use rewind_engine::words::count;
use tokio::runtime::Runtime;

use crate::cli::{ChatArgs, ListenArgs, ModelArgs, ServeArgs};
use crate::output::errln;
use crate::serve::grpc::client::{connect, Client};
use crate::serve::grpc::pb;
use crate::serve::run::{self, Running, ServeOptions};
use crate::serve::ServedModel;
use turns::Transcript;

const HELP: &str = "commands: /reset (a new conversation), /fork (continue on a copy of this session), /stats, /quit";

/// Where the chat's lines come from.
enum Lines {
    // Boxed: the editor is large, the piped variant a pointer.
    Editor(Box<rustyline::DefaultEditor>),
    Piped(std::io::StdinLock<'static>),
}

impl Lines {
    fn new() -> Result<Self> {
        if std::io::stdin().is_terminal() {
            let editor = rustyline::DefaultEditor::new().context("starting the line editor")?;
            Ok(Lines::Editor(Box::new(editor)))
        } else {
            Ok(Lines::Piped(std::io::stdin().lock()))
        }
    }

    /// The next line; `None` at the end of input (Ctrl-D, or Ctrl-C on a terminal).
    fn next(&mut self) -> Result<Option<String>> {
        match self {
            Lines::Editor(ed) => match ed.readline("you> ") {
                Ok(line) => {
                    if !line.trim().is_empty() {
                        let _ = ed.add_history_entry(line.as_str());
                    }
                    Ok(Some(line))
                }
                Err(rustyline::error::ReadlineError::Eof | rustyline::error::ReadlineError::Interrupted) => Ok(None),
                Err(e) => Err(e).context("reading a line"),
            },
            Lines::Piped(stdin) => {
                let mut line = String::new();
                if stdin.read_line(&mut line).context("reading stdin")? == 0 {
                    return Ok(None);
                }
                Ok(Some(line.trim_end_matches(['\n', '\r']).to_string()))
            }
        }
    }
}

/// One conversation on one session.
struct Chat {
    client: Client,
    /// The served model's end-of-sequence tokens.
    eos_ids: Vec<u32>,
    sampling: pb::Sampling,
    session: String,
    transcript: Transcript,
}

/// Writes `text` to stdout now. Through `write_stdout`, so a reader that went away (`rewind chat | head`) ends the
/// chat quietly, as it does every other command.
fn print(text: &str) -> Result<()> {
    crate::output::write_stdout(text)
}

impl Chat {
    async fn new_session(&mut self) -> Result<String> {
        let info = self
            .client
            .create_session(pb::CreateSessionRequest {
                defaults: Some(self.sampling.clone()),
                speculate: None,
            })
            .await
            .context("creating a session")?
            .into_inner();
        Ok(info.id)
    }

    /// Runs one user turn, streaming the reply to stdout. A turn that fails or is interrupted leaves the session as
    /// it was (the engine saves only finished turns), so the transcript goes back too and the chat goes on.
    async fn turn(&mut self, text: &str, interactive: bool) -> Result<()> {
        let before = self.transcript.clone();
        let result = if interactive {
            tokio::select! {
                r = self.reply(text) => r,
                _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
            }
        } else {
            self.reply(text).await
        };
        if let Err(e) = result {
            self.transcript = before;
            print("\n")?;
            errln!("[the turn ended early: {e:#}; the session is as it was before it]");
        }
        Ok(())
    }

    /// The turn itself: sends the new text, streams the reply, records it.
    async fn reply(&mut self, text: &str) -> Result<()> {
        let request = self.transcript.user_turn(text);
        let turn = self
            .client
            .render_chat(request)
            .await
            .context("rendering the turn")?
            .into_inner();
        if !turn.exact {
            errln!("[note: the chat template rewrites earlier turns; this turn is rendered on its own]");
        }
        self.transcript.rendered(&turn);
        let ids = turn.token_ids;
        let t0 = Instant::now();
        let mut stream = self
            .client
            .generate(pb::GenerateRequest {
                session_id: self.session.clone(),
                input: Some(pb::generate_request::Input::TokenIds(pb::TokenIds { ids })),
                sampling: None,
                logprobs: false,
                n: None,
                top_logprobs: None,
            })
            .await
            .context("starting the turn")?
            .into_inner();
        let mut tokens: Vec<u32> = Vec::new();
        let mut last: Option<pb::GenerateChunk> = None;
        while let Some(chunk) = stream.message().await.context("receiving the reply")? {
            print(&chunk.text)?;
            tokens.extend_from_slice(&chunk.token_ids);
            if chunk.finish_reason != pb::FinishReason::Unspecified as i32 {
                last = Some(chunk);
            }
        }
        print("\n")?;
        let last = last.context("the reply stream ended without its last chunk")?;
        let finish = last.finish_reason();
        // The session holds the reply's tokens; the transcript keeps them as the template will write them (special
        // tokens spelled out) and, apart, the end-of-sequence token the reply ended with.
        let eos = match tokens.last() {
            Some(id) if finish == pb::FinishReason::Eos && self.eos_ids.contains(id) => Some(*id),
            _ => None,
        };
        let content_ids = tokens[..tokens.len() - usize::from(eos.is_some())].to_vec();
        let content = self.spelled(content_ids).await?;
        let eos_text = match eos {
            Some(id) => Some(self.spelled(vec![id]).await?),
            None => None,
        };
        self.transcript.assistant_reply(content, eos_text);
        let secs = t0.elapsed().as_secs_f64();
        errln!(
            "[{} tokens | finish: {} | {:.1} tok/s | session {}]",
            tokens.len(),
            finish.as_str_name().trim_start_matches("FINISH_REASON_").to_lowercase(),
            tokens.len() as f64 / secs.max(1e-9),
            self.session
        );
        Ok(())
    }

    /// `ids` as text with their special tokens spelled out, as the chat template writes a reply.
    async fn spelled(&mut self, ids: Vec<u32>) -> Result<String> {
        let r = self
            .client
            .detokenize(pb::DetokenizeRequest {
                token_ids: ids,
                skip_special_tokens: false,
            })
            .await
            .context("reading the reply's text")?;
        Ok(r.into_inner().text)
    }

    async fn reset(&mut self) -> Result<()> {
        let old = std::mem::take(&mut self.session);
        self.client
            .close_session(pb::CloseSessionRequest {
                session_id: old.clone(),
            })
            .await
            .with_context(|| format!("closing session {old}"))?;
        self.session = self.new_session().await?;
        self.transcript.reset();
        print(&format!("reset: closed {old}, new session {}\n", self.session))
    }

    async fn fork(&mut self) -> Result<()> {
        let info = self
            .client
            .fork_session(pb::ForkSessionRequest {
                session_id: self.session.clone(),
            })
            .await
            .context("forking the session")?
            .into_inner();
        print(&format!(
            "forked {} -> {} ({} tokens); continuing on {}\n",
            self.session, info.id, info.tokens, info.id
        ))?;
        self.session = info.id;
        Ok(())
    }

    async fn stats(&mut self) -> Result<()> {
        let s = self
            .client
            .stats(pb::StatsRequest {})
            .await
            .context("reading stats")?
            .into_inner();
        let info = self
            .client
            .get_session(pb::GetSessionRequest {
                session_id: self.session.clone(),
            })
            .await
            .context("reading the session")?
            .into_inner();
        print(&format!(
            "session {}: {}, {}{}\n\
             server: model {}, tp {}, {}, {} running, {} waiting, {} generated tokens ({:.1} tok/s since start), {} \
             finished, {}\n",
            info.id,
            count(info.tokens, "token"),
            count(info.turns, "turn"),
            info.forked_from
                .map_or_else(String::new, |f| format!(", forked from {f}")),
            s.model,
            s.tp,
            count(s.sessions, "session"),
            s.running,
            s.queue_depth,
            s.generated_tokens,
            s.generated_tokens_per_second,
            count(s.requests_finished, "request"),
            count(s.recoveries, "recovery")
        ))
    }

    /// Runs one line of input (a command, or a user turn); false to end the chat.
    async fn run_line(&mut self, line: &str, interactive: bool) -> Result<bool> {
        match line.trim() {
            "" => {}
            "/quit" | "/exit" => return Ok(false),
            "/reset" => self.reset().await?,
            "/fork" => self.fork().await?,
            "/stats" => self.stats().await?,
            "/help" => print(&format!("{HELP}\n"))?,
            cmd if cmd.starts_with('/') && !cmd.contains(' ') => {
                print(&format!("unknown command {cmd}; {HELP}\n"))?;
            }
            text => self.turn(text, interactive).await?,
        }
        Ok(true)
    }
}

/// The in-process server of `--model`: the chat's flags as `rewind serve`'s, on loopback ports chosen by the system.
fn local_server_args(args: &ChatArgs, model: &ServedModel) -> ServeArgs {
    ServeArgs {
        model: ModelArgs::dir(model.dir.clone()),
        listen: ListenArgs {
            host: "127.0.0.1".into(),
            grpc_port: 0,
            http_port: 0,
            api_key: args.api_key.iter().cloned().collect(),
            served_model_name: None,
            session_idle_timeout: 0.0,
            session_memory: rewind_actors::DEFAULT_SESSION_MEMORY as u64,
            drain_timeout: 5.0,
            default_max_tokens: crate::serve::state::DEFAULT_MAX_TOKENS as u64,
            strict_fields: false,
            reasoning_parser: crate::cli::ReasoningParserArg::Auto,
            tool_call_parser: crate::cli::ToolCallParserArg::Auto,
            max_connections: crate::serve::limits::DEFAULT_MAX_CONNECTIONS as u64,
            header_timeout: crate::serve::limits::DEFAULT_HEADER_TIMEOUT_SECS,
            body_timeout: crate::serve::limits::DEFAULT_BODY_TIMEOUT_SECS,
            keep_alive_timeout: crate::serve::limits::DEFAULT_KEEP_ALIVE_TIMEOUT_SECS,
            max_request_bytes: crate::serve::limits::DEFAULT_MAX_REQUEST_BYTES as u64,
        },
        run: args.run.clone(),
        rank_processes: false,
    }
}

/// Starts the in-process server; returns it with the address the chat connects to.
fn start_local(rt: &Runtime, args: &ChatArgs, model: &ServedModel) -> Result<(Running, String)> {
    let prepared = super::serve::prepare(&local_server_args(args, model), &model.dir)?;
    rt.block_on(async {
        let listeners = run::Listeners::bind(&prepared.options).await?;
        let (state, _options, _device): (_, ServeOptions, _) =
            super::serve::start(prepared).await.context("starting the engine")?;
        let running = run::start(state, listeners, |_| {}).await?;
        let addr = format!("http://{}", running.bound.grpc);
        Ok((running, addr))
    })
}

/// `rewind chat`.
pub fn run(args: ChatArgs) -> Result<()> {
    let rt = run::runtime()?;
    let (local, addr) = match &args.addr {
        Some(addr) => {
            if let Some(dir) = &args.model.path {
                errln!(
                    "[note: --addr is given: the chat uses the model the server serves, its template and tokenizer; \
                     --model {} is not read]",
                    dir.display()
                );
            }
            (None, addr.clone())
        }
        None => {
            let model = ServedModel::load(&super::serve::model_dir(&args.model)?)?;
            let (running, addr) = start_local(&rt, &args, &model)?;
            (Some(running), addr)
        }
    };
    let result = rt
        .block_on(async {
            let mut client = connect(&addr, args.api_key.as_deref()).await?;
            let info = client
                .get_model_info(pb::GetModelInfoRequest {})
                .await
                .context("reading the served model's tokenizer and chat template")?
                .into_inner();
            if info.chat_template.is_empty() {
                anyhow::bail!(
                    "the served model {} has no chat template (tokenizer_config.json's chat_template): it cannot \
                     chat; use `rewind generate` or the completions API",
                    info.model
                );
            }
            Ok((client, info))
        })
        .and_then(|(client, info)| {
            let mut chat = Chat {
                client,
                eos_ids: info.eos_token_ids,
                sampling: pb::Sampling {
                    temperature: args.temperature,
                    top_p: args.top_p,
                    top_k: args.top_k,
                    seed: args.seed,
                    max_tokens: args.max_tokens,
                    ..pb::Sampling::default()
                },
                session: String::new(),
                transcript: Transcript::new(args.system.clone()),
            };
            chat.session = rt.block_on(chat.new_session())?;
            errln!(
                "rewind chat: {} on {addr}, session {} ({HELP})",
                info.model,
                chat.session
            );
            let mut lines = Lines::new()?;
            // Ctrl-C interrupts a reply only on a terminal (elsewhere SIGINT keeps its default action: it ends the
            // chat).
            let interactive = matches!(lines, Lines::Editor(_));
            // Lines are read on this thread (the editor blocks); each turn's RPCs run on the runtime.
            while let Some(line) = lines.next()? {
                if !rt.block_on(chat.run_line(&line, interactive))? {
                    break;
                }
            }
            let session = chat.session.clone();
            let _ = rt.block_on(
                chat.client
                    .close_session(pb::CloseSessionRequest { session_id: session }),
            );
            Ok(())
        });
    if let Some(running) = local {
        rt.block_on(running.stop());
    }
    result
}
