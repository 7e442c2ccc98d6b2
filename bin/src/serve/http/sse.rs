//! Streamed answers as server-sent events, the way OpenAI streams them: one `data: {chunk}` per piece of text, a
//! chunk with the `finish_reason`, a usage chunk when `stream_options.include_usage` asked for one, then
//! `data: [DONE]`. A request that fails after its stream started sends `data: {"error": ...}` before `[DONE]`.
//!
//! The engine's event stream lives inside the response body: when the client disconnects, the server drops the body
//! and with it the request, which the engine then cancels.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use rewind_actors::{Event, Usage};
use rewind_engine::tokenizer::reasoning::{ReasoningSplitter, Split};
use serde_json::{json, Value};
use tracing::Instrument;

use super::errors::ApiError;
use super::generation::{usage_json, Admitted, Logprobs};

/// How often an idle stream (a long prefill, a queued request) sends a comment, so proxies keep it open.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// What every chunk of one stream carries, and which of the two chunk shapes it uses.
#[derive(Clone, Debug)]
pub struct ChunkShape {
    pub id: String,
    pub created: u64,
    pub model: String,
    /// `chat.completion.chunk` with `delta`s, else `text_completion` with `text`.
    pub chat: bool,
    pub include_usage: bool,
}

impl ChunkShape {
    /// A chunk with `choices` (empty for the usage chunk).
    fn chunk(&self, choices: Vec<Value>, usage: Option<&Usage>) -> Value {
        let mut c = json!({
            "id": self.id,
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        // With include_usage every chunk has the field, null until the last one (as OpenAI sends it).
        if self.include_usage {
            c["usage"] = usage.map_or(Value::Null, usage_json);
        }
        c
    }

    /// The chat stream's first chunk: the assistant's role.
    pub fn role(&self) -> Value {
        self.chunk(
            vec![
                json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null,
                        "finish_reason": null}),
            ],
            None,
        )
    }

    /// A chunk of text.
    pub fn text(&self, text: &str) -> Value {
        self.text_with(text, Value::Null)
    }

    /// A chunk of text with its tokens' `logprobs`.
    fn text_with(&self, text: &str, logprobs: Value) -> Value {
        let choice = if self.chat {
            json!({"index": 0, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": null})
        } else {
            json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": null})
        };
        self.chunk(vec![choice], None)
    }

    /// A chat chunk of an answer split by a reasoning parser: `reasoning_content` and / or `content`, whichever has
    /// text.
    pub fn split(&self, split: &Split) -> Value {
        self.split_with(split, Value::Null)
    }

    fn split_with(&self, split: &Split, logprobs: Value) -> Value {
        let mut delta = serde_json::Map::new();
        if !split.reasoning.is_empty() {
            delta.insert("reasoning_content".into(), Value::String(split.reasoning.clone()));
        }
        if !split.content.is_empty() {
            delta.insert("content".into(), Value::String(split.content.clone()));
        }
        self.chunk(
            vec![json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": null})],
            None,
        )
    }

    /// The chunk that ends the choice.
    fn finish(&self, reason: &str) -> Value {
        let choice = if self.chat {
            json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": reason})
        } else {
            json!({"index": 0, "text": "", "logprobs": null, "finish_reason": reason})
        };
        self.chunk(vec![choice], None)
    }
}

/// What the body stream holds between events.
struct Streaming {
    shape: ChunkShape,
    /// `None` once the request ended (so dropping the body cancels nothing).
    admitted: Option<Admitted>,
    queue: VecDeque<SseEvent>,
    /// Splits a chat answer's text into reasoning and content deltas, when the server has a reasoning parser.
    reasoning: Option<ReasoningSplitter>,
    /// Writes the tokens' log-probabilities, when the request asked for them.
    logprobs: Option<Logprobs>,
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

impl Streaming {
    /// Queues what `event` sends; ends the stream on the request's last event.
    fn on(&mut self, event: Option<Event>) {
        match event {
            Some(Event::Token { text, logprob, .. }) => {
                // A token's log-probability goes with the chunk of its text; a token whose text is held back still
                // sends a chunk for it (its text empty), so every token's entry arrives in order.
                let lp = match (&mut self.logprobs, logprob) {
                    (Some(l), Some(e)) => Some(l.render.generated(std::slice::from_ref(&e))),
                    _ => None,
                };
                // Empty pieces (a character split across tokens, text held back for a possible stop string) send
                // nothing; the text comes with a later token.
                if let Some(splitter) = &mut self.reasoning {
                    // A piece that may be the start of `</think>` is held back until the next one decides it.
                    let split = splitter.push(&text);
                    if !split.is_empty() || lp.is_some() {
                        let chunk = self.shape.split_with(&split, lp.unwrap_or(Value::Null));
                        self.queue.push_back(data(&chunk));
                    }
                } else if !text.is_empty() || lp.is_some() {
                    let chunk = self.shape.text_with(&text, lp.unwrap_or(Value::Null));
                    self.queue.push_back(data(&chunk));
                }
            }
            Some(Event::PromptLogprobs { entries, .. }) => {
                // An echoed prompt's entries (completions with `echo` and `logprobs`) and vLLM's `prompt_logprobs`
                // come in one chunk with no text, after the echoed text.
                if let Some(l) = &mut self.logprobs {
                    let legacy = match &l.echoed {
                        Some(ids) if l.ask.generated.is_some() => l.render.prompt(ids, &entries),
                        _ => Value::Null,
                    };
                    let vllm = l.ask.prompt_field.then(|| l.render.vllm_prompt(&entries));
                    if !legacy.is_null() || vllm.is_some() {
                        let mut chunk = self.shape.text_with("", legacy);
                        if let Some(v) = vllm {
                            chunk["choices"][0]["prompt_logprobs"] = v;
                        }
                        self.queue.push_back(data(&chunk));
                    }
                }
            }
            Some(Event::Finished { reason, usage, .. }) => {
                if let Some(split) = self.reasoning.as_mut().map(ReasoningSplitter::finish) {
                    if !split.is_empty() {
                        self.queue.push_back(data(&self.shape.split(&split)));
                    }
                }
                self.queue.push_back(data(&self.shape.finish(reason.openai())));
                if self.shape.include_usage {
                    self.queue.push_back(data(&self.shape.chunk(Vec::new(), Some(&usage))));
                }
                self.end();
            }
            Some(Event::Failed { error, kind }) => {
                tracing::warn!(%error, ?kind, "request failed mid-stream");
                self.queue.push_back(data(&ApiError::from_failure(kind, error).body()));
                self.end();
            }
            None => self.end(),
        }
    }

    fn end(&mut self) {
        self.admitted = None;
        self.queue.push_back(SseEvent::default().data("[DONE]"));
    }
}

/// The streamed response for `admitted`, starting with `opening` chunks (the chat role, an echoed prompt), its text
/// split by `reasoning` when given.
pub fn respond(
    shape: ChunkShape,
    admitted: Admitted,
    opening: Vec<Value>,
    reasoning: Option<ReasoningSplitter>,
    logprobs: Option<Logprobs>,
) -> Response {
    let span = tracing::Span::current();
    let state = Streaming {
        queue: opening.iter().map(data).collect(),
        shape,
        admitted: Some(admitted),
        reasoning,
        logprobs,
    };
    let body = futures::stream::unfold(state, move |mut st| {
        async move {
            loop {
                if let Some(e) = st.queue.pop_front() {
                    return Some((Ok::<_, Infallible>(e), st));
                }
                let admitted = st.admitted.as_mut()?;
                let event = admitted.next().await;
                st.on(event);
            }
        }
        .instrument(span.clone())
    });
    Sse::new(body)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(chat: bool, include_usage: bool) -> ChunkShape {
        ChunkShape {
            id: "x-1".into(),
            created: 5,
            model: "m".into(),
            chat,
            include_usage,
        }
    }

    #[test]
    fn chat_chunks_carry_deltas() {
        let s = shape(true, false);
        let r = s.role();
        assert_eq!(r["object"], "chat.completion.chunk");
        assert_eq!(r["choices"][0]["delta"]["role"], "assistant");
        assert!(r.get("usage").is_none(), "no usage field unless asked for");
        assert_eq!(s.text("hi")["choices"][0]["delta"]["content"], "hi");
        let f = s.finish("stop");
        assert_eq!(f["choices"][0]["finish_reason"], "stop");
        assert_eq!(f["choices"][0]["delta"], json!({}));
        let both = Split {
            reasoning: "r".into(),
            content: "c".into(),
        };
        assert_eq!(
            s.split(&both)["choices"][0]["delta"],
            json!({"reasoning_content": "r", "content": "c"})
        );
        let only = Split {
            reasoning: "r".into(),
            content: String::new(),
        };
        assert_eq!(s.split(&only)["choices"][0]["delta"], json!({"reasoning_content": "r"}));
    }

    #[test]
    fn completion_chunks_carry_text_and_null_usage_until_the_end() {
        let s = shape(false, true);
        let t = s.text("a");
        assert_eq!(t["object"], "text_completion");
        assert_eq!(t["choices"][0]["text"], "a");
        assert!(t["usage"].is_null());
        let u = s.chunk(
            Vec::new(),
            Some(&Usage {
                prompt_tokens: 3,
                completion_tokens: 4,
                ..Usage::default()
            }),
        );
        assert_eq!(u["choices"], json!([]));
        assert_eq!(u["usage"]["total_tokens"], 7);
    }
}
