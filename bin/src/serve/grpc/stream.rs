//! A request's engine events as a stream of [`pb::GenerateChunk`]s: the tokens one engine step produced for one choice
//! become one chunk (several when speculation accepted drafts), each choice's last chunk carries its finish reason and
//! usage, and a failure becomes the stream's error status. The response stream owns the request's [`EventStream`], so a client that goes
//! away (the stream dropped) cancels the request and frees its slot.

use std::pin::Pin;

use futures::{FutureExt, Stream, StreamExt};
use rewind_actors::{Event, EventStream, TokenLogprob};
use rewind_engine::sched::FinishReason;
use tonic::Status;
use tracing::Instrument;

use super::pb;
use super::status::failure;
use crate::serve::state::CutOff;

/// What Generate and Complete return.
pub type ChunkStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateChunk, Status>> + Send + 'static>>;

/// The chunks of `events`. The first chunk is awaited here, so a request the engine refuses (a bad parameter, a
/// prompt too long, a busy session) fails the call itself with its status rather than a stream that errs at once.
pub async fn respond(events: EventStream, cut: CutOff, span: tracing::Span) -> Result<ChunkStream, Status> {
    let mut chunker = Chunker {
        events,
        cut,
        pending: None,
        last: None,
        done: false,
    };
    let first = chunker.next_chunk().instrument(span.clone()).await;
    let first = match first {
        Some(Ok(c)) => c,
        Some(Err(s)) => return Err(s),
        None => return Err(Status::internal("the request ended without an event")),
    };
    let rest = futures::stream::unfold(chunker, move |mut c| {
        let span = span.clone();
        async move { c.next_chunk().await.map(|chunk| (chunk, c)) }.instrument(span)
    });
    Ok(futures::stream::once(async move { Ok(first) }).chain(rest).boxed())
}

/// Groups a request's events into chunks; see the module docs.
struct Chunker {
    events: EventStream,
    /// Ends the stream with an UNAVAILABLE status when the server stops without waiting.
    cut: CutOff,
    /// An event read ahead that belongs to the next chunk.
    pending: Option<Event>,
    /// The engine step and choice of the latest token: a later token of both is an accepted draft.
    last: Option<(u64, usize)>,
    done: bool,
}

impl Chunker {
    /// The next chunk, the request's error, or `None` after the last chunk.
    async fn next_chunk(&mut self) -> Option<Result<pb::GenerateChunk, Status>> {
        if self.done {
            return None;
        }
        let mut event = match self.pending.take() {
            Some(e) => e,
            None => self.cut.next(&mut self.events).await?,
        };
        let mut chunk = pb::GenerateChunk {
            choice_index: choice_of(&event).unwrap_or(0) as u32,
            ..Default::default()
        };
        loop {
            match event {
                Event::Token {
                    token,
                    text,
                    step,
                    choice,
                    logprob,
                    ..
                } => {
                    if self.last == Some((step.index, choice)) {
                        chunk.accepted_draft_tokens += 1;
                    }
                    self.last = Some((step.index, choice));
                    chunk.token_ids.push(token);
                    chunk.text.push_str(&text);
                    chunk.logprobs.extend(logprob.as_ref().map(token_logprob));
                }
                Event::PromptLogprobs { first_token, entries } => {
                    chunk.prompt_logprobs = entries
                        .iter()
                        .map(|e| match e {
                            Some(e) => token_logprob(e),
                            // Nothing predicts the first token: its entry has no value.
                            None => pb::TokenLogprob {
                                token_id: first_token,
                                logprob: None,
                                top: Vec::new(),
                            },
                        })
                        .collect();
                }
                Event::Finished {
                    reason,
                    usage,
                    timing,
                    seed,
                    spec,
                    choice: _,
                } => {
                    // Other choices may still run.
                    self.done = self.events.ended();
                    chunk.finish_reason = finish_reason(reason) as i32;
                    chunk.usage = Some(pb::Usage {
                        prompt_tokens: usage.prompt_tokens as u64,
                        completion_tokens: usage.completion_tokens as u64,
                        cached_tokens: usage.cached_tokens as u64,
                    });
                    chunk.seed = Some(seed);
                    chunk.spec = spec.map(|s| pb::SpecStats {
                        drafted: s.drafted as u64,
                        accepted: s.accepted as u64,
                        verifies: s.verifies as u64,
                    });
                    chunk.ttft_seconds = timing.ttft_seconds;
                    chunk.total_seconds = timing.total_seconds;
                    return Some(Ok(chunk));
                }
                Event::Failed { error, kind } => {
                    if chunk.token_ids.is_empty() {
                        self.done = true;
                        tracing::debug!(%error, ?kind, "request failed");
                        return Some(Err(failure(kind, error)));
                    }
                    // The tokens before the failure still reach the client; the error follows them.
                    self.pending = Some(Event::Failed { error, kind });
                    return Some(Ok(chunk));
                }
            }
            // Only events already here join this chunk: a chunk never waits for a later step. `next` is
            // cancel-safe (a channel receive), so not waiting loses nothing.
            match self.events.next().now_or_never() {
                Some(Some(e)) => {
                    let later_step =
                        matches!(&e, Event::Token { step, .. } if Some(step.index) != self.last.map(|l| l.0));
                    let other_choice = choice_of(&e).is_some_and(|c| c as u32 != chunk.choice_index);
                    if later_step || other_choice {
                        self.pending = Some(e);
                        return Some(Ok(chunk));
                    }
                    event = e;
                }
                Some(None) | None => return Some(Ok(chunk)),
            }
        }
    }
}

/// The choice an event belongs to (`None` for a failure, which ends every choice). The prompt's log-probabilities,
/// sent once for a request of any `n`, come with choice 0.
fn choice_of(e: &Event) -> Option<usize> {
    match e {
        Event::Token { choice, .. } | Event::Finished { choice, .. } => Some(*choice),
        Event::PromptLogprobs { .. } => Some(0),
        Event::Failed { .. } => None,
    }
}

/// A token's log-probability as the API writes it.
fn token_logprob(e: &TokenLogprob) -> pb::TokenLogprob {
    pb::TokenLogprob {
        token_id: e.token,
        logprob: Some(e.logprob),
        top: e
            .top
            .iter()
            .map(|&(token_id, logprob)| pb::TopLogprob { token_id, logprob })
            .collect(),
    }
}

/// The API's finish reason.
pub fn finish_reason(r: FinishReason) -> pb::FinishReason {
    match r {
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Eos => pb::FinishReason::Eos,
        FinishReason::StopToken => pb::FinishReason::StopToken,
        FinishReason::StopString => pb::FinishReason::StopString,
        FinishReason::ContextLimit => pb::FinishReason::ContextLimit,
    }
}
