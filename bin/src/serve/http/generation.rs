//! Running one generation request on the engine for a handler ([`answer`]): it is handed over and the engine's first
//! event awaited before anything is sent (so a request the engine refuses gets its HTTP status rather than a failed
//! stream), then streamed as server-sent events or read to its end for a JSON body. Tokenizing, done before, runs on
//! the blocking pool ([`blocking`]).

use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use rewind_actors::{Event, EventStream, GenerateRequest, TokenLogprob, Usage};
use rewind_engine::sample::SamplingParams;
use rewind_engine::sched::FinishReason;
use serde_json::{json, Value};

use super::chat_parse::ChatParser;
use super::errors::ApiError;
use super::logprobs::{self, Ask, Render};
use super::metrics::HttpMetrics;
use super::openai::Streaming;
use super::sse::{self, ChunkShape};
use super::{Api, RequestContext};
use crate::serve::state::CutOff;
use crate::serve::ServeState;

/// A request the engine took: its events, the first one already read. Dropping it cancels the request (the
/// [`EventStream`] inside does), which is what happens when the client goes away.
pub struct Admitted {
    events: EventStream,
    /// Ends the request with a failure when the server stops without waiting.
    cut: CutOff,
    first: Option<Event>,
    /// Where the time to the first token goes, until it has been recorded.
    ttft: Option<(Arc<HttpMetrics>, &'static str, Instant)>,
}

/// Submits `prompt` with `params` and waits for the engine's first event: a `Failed` one (bad parameters the checks
/// here missed, a full queue, a stopped engine) becomes the error, anything else starts the answer.
async fn submit(
    api: &Api,
    ctx: &RequestContext,
    prompt: Vec<u32>,
    params: SamplingParams,
    n: usize,
    ask: Ask,
) -> Result<Admitted, ApiError> {
    let prompt_tokens = prompt.len();
    let mut request = GenerateRequest::new(prompt, params);
    request.logprobs = ask.generated;
    request.prompt_logprobs = ask.prompt;
    let mut events = api
        .state
        .engine
        .submit(GenerateRequest { n, ..request })
        .map_err(|e| ApiError::server(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
    tracing::Span::current().record("engine_request", events.id());
    tracing::debug!(prompt_tokens, "submitted");
    let first = match events.next().await {
        Some(Event::Failed { error, kind }) => return Err(ApiError::from_failure(kind, error)),
        None => {
            return Err(ApiError::server(
                StatusCode::SERVICE_UNAVAILABLE,
                "the engine ended the request without an answer",
            ))
        }
        Some(e) => e,
    };
    let mut admitted = Admitted {
        events,
        cut: api.state.cut_off_watch(),
        first: None,
        ttft: Some((api.metrics.clone(), ctx.endpoint, ctx.start)),
    };
    admitted.saw(&first);
    admitted.first = Some(first);
    Ok(admitted)
}

impl Admitted {
    /// The next event; `None` after the last one.
    pub async fn next(&mut self) -> Option<Event> {
        if let Some(e) = self.first.take() {
            return Some(e);
        }
        let e = self.cut.next(&mut self.events).await;
        if let Some(e) = &e {
            self.saw(e);
        }
        e
    }

    /// Records the time to the first token when `e` is it.
    fn saw(&mut self, e: &Event) {
        if matches!(e, Event::Token { .. }) {
            if let Some((metrics, endpoint, start)) = self.ttft.take() {
                metrics.first_token(endpoint, start.elapsed());
            }
        }
    }
}

/// Runs `f` (tokenizing, rendering a chat template: work that grows with the prompt) on the blocking pool, so a long
/// prompt does not hold up the other connections' tasks.
pub async fn blocking<T: Send + 'static>(
    api: &Api,
    f: impl FnOnce(&ServeState) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let state = api.state.clone();
    tokio::task::spawn_blocking(move || f(&state))
        .await
        .unwrap_or_else(|e| {
            Err(ApiError::server(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("a worker failed: {e}"),
            ))
        })
}

/// A generation that ran to its end.
pub struct Completed {
    /// The response's id, creation time and model (what a stream's chunks would have carried).
    pub shape: ChunkShape,
    /// Every choice, by index.
    pub choices: Vec<Choice>,
    /// The prompt counted once, the choices' tokens summed (as OpenAI counts `n`).
    pub usage: Usage,
    /// Each choice's `logprobs` (`null` unless asked for), by index.
    pub logprobs: Vec<Value>,
    /// vLLM's `prompt_logprobs` list (every choice's), when the request gave that field.
    pub prompt_logprobs: Option<Value>,
}

/// What a request's log-probabilities are written with: what it asked, the writer (copied for each choice), and an
/// echoed prompt's ids (whose entries open each choice's legacy object of a completion).
pub struct Logprobs {
    pub ask: Ask,
    pub render: Render,
    pub echoed: Option<Vec<u32>>,
}

/// One choice of a completed generation.
#[derive(Clone, Debug, Default)]
pub struct Choice {
    pub text: String,
    /// `None` until the choice finished.
    pub reason: Option<FinishReason>,
}

impl Choice {
    /// OpenAI's `finish_reason` of the choice.
    pub fn finish_reason(&self) -> Option<&'static str> {
        self.reason.map(FinishReason::openai)
    }
}

/// `usage` with a finished choice's own usage added: the prompt counted once, completion tokens summed.
pub fn add_usage(total: &mut Usage, choice: &Usage) {
    total.prompt_tokens = choice.prompt_tokens;
    total.cached_tokens = choice.cached_tokens;
    total.completion_tokens += choice.completion_tokens;
}

/// Reads `admitted` (of `n` choices) to its end; its response will have `shape`'s id, time and model, and each
/// choice the log-probabilities `lp` asks for: the prompt's (sent once for the request) and its own tokens'.
async fn collect(
    mut admitted: Admitted,
    shape: ChunkShape,
    n: usize,
    lp: Option<Logprobs>,
) -> Result<Completed, ApiError> {
    let mut choices = vec![Choice::default(); n];
    let mut usage = Usage::default();
    let mut open = n;
    let mut generated = vec![Vec::new(); n];
    let mut prompt = None;
    let unknown = |c: usize| {
        ApiError::server(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the engine answered for choice {c} of {n}"),
        )
    };
    while let Some(e) = admitted.next().await {
        match e {
            Event::Token {
                text, choice, logprob, ..
            } => {
                choices.get_mut(choice).ok_or_else(|| unknown(choice))?.text += &text;
                generated[choice].extend(logprob);
            }
            Event::PromptLogprobs { entries, .. } => prompt = Some(entries),
            Event::Finished {
                reason,
                usage: u,
                choice,
                ..
            } => {
                choices.get_mut(choice).ok_or_else(|| unknown(choice))?.reason = Some(reason);
                add_usage(&mut usage, &u);
                open -= 1;
                if open > 0 {
                    continue;
                }
                let (logprobs, prompt_logprobs) = match lp {
                    None => (vec![Value::Null; n], None),
                    Some(lp) => {
                        let vllm = prompt
                            .as_deref()
                            .filter(|_| lp.ask.prompt_field)
                            .map(|e| lp.render.vllm_prompt(e));
                        let values = generated
                            .iter()
                            .map(|tokens| choice_logprobs(&lp, prompt.as_deref(), tokens))
                            .collect();
                        (values, vllm)
                    }
                };
                return Ok(Completed {
                    shape,
                    choices,
                    usage,
                    logprobs,
                    prompt_logprobs,
                });
            }
            Event::Failed { error, kind } => return Err(ApiError::from_failure(kind, error)),
        }
    }
    Err(ApiError::server(
        StatusCode::SERVICE_UNAVAILABLE,
        "the engine ended the request without a final event",
    ))
}

/// A choice's `logprobs`: with `echo`, the prompt's entries (`prompt`) and then its tokens' (`generated`) in one
/// legacy object whose offsets run on; else its tokens'; `null` when the request asked for neither.
fn choice_logprobs(lp: &Logprobs, prompt: Option<&[Option<TokenLogprob>]>, generated: &[TokenLogprob]) -> Value {
    let mut render = lp.render.clone();
    let echoed = match (&lp.echoed, prompt) {
        (Some(ids), Some(entries)) if lp.ask.generated.is_some() => Some(render.prompt(ids, entries)),
        _ => None,
    };
    let tokens = lp.ask.generated.map(|_| render.generated(generated));
    match (echoed, tokens) {
        (Some(p), Some(t)) => logprobs::join_legacy(p, &t),
        (_, Some(t)) => t,
        (_, None) => Value::Null,
    }
}

/// How a generation is answered: streamed (the response is ready), or run to its end for the endpoint's body.
pub enum Answer {
    Streamed(Response),
    Completed(Completed),
}

/// Runs `prompt` for an endpoint (`chat` or completions): streamed when `streaming` says so, the stream opening with
/// the chat role and `echo` (the prompt's text, for completions that want it back), its text read by `parser` (chat
/// with a reasoning parser or tools) into `reasoning_content`, `content` and `tool_calls` deltas, with `logprobs`
/// when asked for; else collected.
#[allow(clippy::too_many_arguments)]
pub async fn answer(
    api: &Api,
    ctx: &RequestContext,
    (prompt, params, n): (Vec<u32>, SamplingParams, usize),
    streaming: Streaming,
    chat: bool,
    echo: Option<String>,
    parser: Option<ChatParser>,
    logprobs: Option<Logprobs>,
) -> Result<Answer, ApiError> {
    let ask = logprobs.as_ref().map_or_else(Ask::default, |l| l.ask);
    let admitted = submit(api, ctx, prompt, params, n, ask).await?;
    let shape = ChunkShape {
        id: format!("{}-{}", if chat { "chatcmpl" } else { "cmpl" }, ctx.id),
        created: unix_now(),
        model: api.state.model_name.clone(),
        chat,
        include_usage: streaming.include_usage,
    };
    if !streaming.stream {
        let mut done = collect(admitted, shape, n, logprobs).await?;
        if let Some(prefix) = echo {
            for c in &mut done.choices {
                c.text.insert_str(0, &prefix);
            }
        }
        return Ok(Answer::Completed(done));
    }
    // Each choice opens as a stream of one would (OpenAI sends every choice its role).
    let echo = echo.filter(|t| !t.is_empty());
    let opening = (0..n)
        .flat_map(|i| {
            let role = chat.then(|| shape.role(i));
            role.into_iter().chain(echo.as_ref().map(|t| shape.text(i, t)))
        })
        .collect();
    Ok(Answer::Streamed(sse::respond(
        shape, admitted, opening, parser, logprobs, n,
    )))
}

impl Completed {
    /// The endpoint's response: `object` with its `choices`, each made by `choice` from its index and itself, then
    /// given its `logprobs` and vLLM's `prompt_logprobs` when asked for.
    pub fn response(&self, object: &str, choice: impl Fn(usize, &Choice) -> Value) -> Response {
        let choices: Vec<Value> = self
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut value = choice(i, c);
                value["logprobs"] = self.logprobs.get(i).cloned().unwrap_or(Value::Null);
                if let Some(p) = &self.prompt_logprobs {
                    value["prompt_logprobs"] = p.clone();
                }
                value
            })
            .collect();
        Json(json!({
            "id": self.shape.id,
            "object": object,
            "created": self.shape.created,
            "model": self.shape.model,
            "choices": choices,
            "usage": usage_json(&self.usage),
        }))
        .into_response()
    }
}

/// OpenAI's `usage` object (`cached_tokens`: prompt tokens restored from a session's state rather than prefilled).
pub fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// Seconds since the Unix epoch (OpenAI's `created`).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
