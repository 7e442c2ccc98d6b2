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
use serde_json::{json, Value};
use tracing::Instrument;

use super::errors::ApiError;
use super::generation::{usage_json, Admitted};

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
        let choice = if self.chat {
            json!({"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": null})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": null})
        };
        self.chunk(vec![choice], None)
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
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

impl Streaming {
    /// Queues what `event` sends; ends the stream on the request's last event.
    fn on(&mut self, event: Option<Event>) {
        match event {
            Some(Event::Token { text, .. }) => {
                // Empty pieces (a character split across tokens, text held back for a possible stop string) send
                // nothing; the text comes with a later token.
                if !text.is_empty() {
                    self.queue.push_back(data(&self.shape.text(&text)));
                }
            }
            Some(Event::Finished { reason, usage, .. }) => {
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

/// The streamed response for `admitted`, starting with `opening` chunks (the chat role, an echoed prompt).
pub fn respond(shape: ChunkShape, admitted: Admitted, opening: Vec<Value>) -> Response {
    let span = tracing::Span::current();
    let state = Streaming {
        queue: opening.iter().map(data).collect(),
        shape,
        admitted: Some(admitted),
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
