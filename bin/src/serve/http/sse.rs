//! Streamed answers as server-sent events, the way OpenAI streams them: one `data: {chunk}` per piece of text, a
//! chunk with the `finish_reason`, a usage chunk when `stream_options.include_usage` asked for one, then
//! `data: [DONE]`. A request that fails after its stream started sends `data: {"error": ...}` before `[DONE]`. With
//! `n` choices their chunks interleave, each naming its choice's `index`; each choice ends with its own
//! `finish_reason` chunk, and the usage chunk (the prompt once, every choice's tokens) and `[DONE]` follow the last.
//!
//! The engine's event stream lives inside the response body: when the client disconnects, the server drops the body
//! and with it the request, which the engine then cancels.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use rewind_actors::{Event, Usage};
use rewind_engine::tokenizer::reasoning::Split;
use serde_json::{json, Value};
use tracing::Instrument;

use super::chat_parse::{ChatDelta, ChatParser, NumberedCall};
use super::errors::ApiError;
use super::generation::{add_usage, usage_json, Admitted, Logprobs};
use super::logprobs::Render;

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

    /// A chat choice's first chunk: the assistant's role.
    pub fn role(&self, index: usize) -> Value {
        self.chunk(
            vec![
                json!({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null,
                        "finish_reason": null}),
            ],
            None,
        )
    }

    /// A chunk of choice `index`'s text.
    pub fn text(&self, index: usize, text: &str) -> Value {
        self.text_with(index, text, Value::Null)
    }

    /// A chunk of choice `index`'s text with its tokens' `logprobs`.
    fn text_with(&self, index: usize, text: &str, logprobs: Value) -> Value {
        let choice = if self.chat {
            json!({"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": null})
        } else {
            json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": null})
        };
        self.chunk(vec![choice], None)
    }

    /// A chat chunk of an answer split by a reasoning parser: `reasoning_content` and / or `content`, whichever has
    /// text.
    pub fn split(&self, index: usize, split: &Split, logprobs: Value) -> Value {
        let mut delta = serde_json::Map::new();
        if !split.reasoning.is_empty() {
            delta.insert("reasoning_content".into(), Value::String(split.reasoning.clone()));
        }
        if !split.content.is_empty() {
            delta.insert("content".into(), Value::String(split.content.clone()));
        }
        self.chunk(
            vec![json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": null})],
            None,
        )
    }

    /// The chunks of a call the model made in choice `choice`, as vLLM streams them: one opening it (index, id,
    /// type, name), one with its arguments.
    pub fn tool_call(&self, choice: usize, call: &NumberedCall) -> [Value; 2] {
        let delta = |call_delta: Value| {
            self.chunk(
                vec![
                    json!({"index": choice, "delta": {"tool_calls": [call_delta]}, "logprobs": null,
                            "finish_reason": null}),
                ],
                None,
            )
        };
        [
            delta(json!({"index": call.index, "id": call.id, "type": "function",
                         "function": {"name": call.call.name}})),
            delta(json!({"index": call.index, "function": {"arguments": call.call.arguments}})),
        ]
    }

    /// The chunk that ends choice `index`.
    fn finish(&self, index: usize, reason: &str) -> Value {
        let choice = if self.chat {
            json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": reason})
        } else {
            json!({"index": index, "text": "", "logprobs": null, "finish_reason": reason})
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
    /// Per choice, splits its chat text into reasoning, content and tool-call deltas, when the server splits
    /// reasoning or the request has tools.
    parsers: Option<Vec<ChatParser>>,
    /// Choices not yet finished, and the usage of those that did.
    open: usize,
    usage: Usage,
    /// Writes the tokens' log-probabilities, when the request asked for them; `renders` holds each choice's writer
    /// (a completion's `text_offset` runs on per choice).
    logprobs: Option<Logprobs>,
    renders: Vec<Render>,
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

impl Streaming {
    /// Queues what `event` sends; ends the stream on the request's last event.
    fn on(&mut self, event: Option<Event>) {
        match event {
            Some(Event::Token {
                text, choice, logprob, ..
            }) => {
                // A token's log-probability goes with the chunk of its text; a token whose text is held back still
                // sends a chunk for it (its text empty), so every token's entry arrives in order.
                let lp = match (self.renders.get_mut(choice), logprob) {
                    (Some(r), Some(e)) => Some(r.generated(std::slice::from_ref(&e))),
                    _ => None,
                };
                // Empty pieces (a character split across tokens, text held back for a possible stop string) send
                // nothing; the text comes with a later token.
                if let Some(parser) = self.parsers.as_mut().and_then(|p| p.get_mut(choice)) {
                    // A piece that may be the start of `</think>` or of a call is held back until the next one
                    // decides it.
                    let delta = parser.push(&text);
                    self.send(choice, delta, lp);
                } else if !text.is_empty() || lp.is_some() {
                    let chunk = self.shape.text_with(choice, &text, lp.unwrap_or(Value::Null));
                    self.queue.push_back(data(&chunk));
                }
            }
            Some(Event::PromptLogprobs { entries, .. }) => {
                // An echoed prompt's entries (completions with `echo` and `logprobs`) and vLLM's `prompt_logprobs`
                // come in one chunk with no text, after the echoed text: the engine sends them once, and every
                // choice gets its chunk (an echoed prompt opens each choice's legacy object).
                if let Some(l) = &self.logprobs {
                    let vllm = l.ask.prompt_field.then(|| l.render.vllm_prompt(&entries));
                    for (i, render) in self.renders.iter_mut().enumerate() {
                        let legacy = match &l.echoed {
                            Some(ids) if l.ask.generated.is_some() => render.prompt(ids, &entries),
                            _ => Value::Null,
                        };
                        if legacy.is_null() && vllm.is_none() {
                            continue;
                        }
                        let mut chunk = self.shape.text_with(i, "", legacy);
                        if let Some(v) = &vllm {
                            chunk["choices"][0]["prompt_logprobs"] = v.clone();
                        }
                        self.queue.push_back(data(&chunk));
                    }
                }
            }
            Some(Event::Finished {
                reason, usage, choice, ..
            }) => {
                let mut reason = reason.openai();
                if let Some(parser) = self.parsers.as_mut().and_then(|p| p.get_mut(choice)) {
                    let delta = parser.finish();
                    if parser.called() {
                        reason = "tool_calls";
                    }
                    self.send(choice, delta, None);
                }
                self.queue.push_back(data(&self.shape.finish(choice, reason)));
                add_usage(&mut self.usage, &usage);
                self.open = self.open.saturating_sub(1);
                if self.open > 0 {
                    return;
                }
                if self.shape.include_usage {
                    self.queue
                        .push_back(data(&self.shape.chunk(Vec::new(), Some(&self.usage))));
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

    /// Queues a parsed piece of choice `choice`: its text parts (with its token's `logprobs`, sent even when the
    /// text is held back), then its calls.
    fn send(&mut self, choice: usize, delta: ChatDelta, logprobs: Option<Value>) {
        let split = delta.text();
        if !split.is_empty() || logprobs.is_some() {
            let chunk = self.shape.split(choice, &split, logprobs.unwrap_or(Value::Null));
            self.queue.push_back(data(&chunk));
        }
        for call in &delta.calls {
            for chunk in self.shape.tool_call(choice, call) {
                self.queue.push_back(data(&chunk));
            }
        }
    }

    fn end(&mut self) {
        self.admitted = None;
        self.queue.push_back(SseEvent::default().data("[DONE]"));
    }
}

/// The streamed response for `admitted` (of `n` choices), starting with `opening` chunks (the chat role, an echoed
/// prompt), each choice's text read by a copy of `parser` when given.
pub fn respond(
    shape: ChunkShape,
    admitted: Admitted,
    opening: Vec<Value>,
    parser: Option<ChatParser>,
    logprobs: Option<Logprobs>,
    n: usize,
) -> Response {
    let span = tracing::Span::current();
    let state = Streaming {
        queue: opening.iter().map(data).collect(),
        shape,
        admitted: Some(admitted),
        parsers: parser.map(|p| vec![p; n]),
        open: n,
        usage: Usage::default(),
        renders: logprobs.as_ref().map_or_else(Vec::new, |l| vec![l.render.clone(); n]),
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
        let r = s.role(0);
        assert_eq!(r["object"], "chat.completion.chunk");
        assert_eq!(r["choices"][0]["delta"]["role"], "assistant");
        assert!(r.get("usage").is_none(), "no usage field unless asked for");
        assert_eq!(s.text(0, "hi")["choices"][0]["delta"]["content"], "hi");
        assert_eq!(s.text(2, "hi")["choices"][0]["index"], 2);
        let f = s.finish(1, "stop");
        assert_eq!(f["choices"][0]["index"], 1);
        assert_eq!(f["choices"][0]["finish_reason"], "stop");
        assert_eq!(f["choices"][0]["delta"], json!({}));
        let both = Split {
            reasoning: "r".into(),
            content: "c".into(),
        };
        assert_eq!(
            s.split(0, &both, Value::Null)["choices"][0]["delta"],
            json!({"reasoning_content": "r", "content": "c"})
        );
        let only = Split {
            reasoning: "r".into(),
            content: String::new(),
        };
        assert_eq!(
            s.split(0, &only, Value::Null)["choices"][0]["delta"],
            json!({"reasoning_content": "r"})
        );
    }

    #[test]
    fn completion_chunks_carry_text_and_null_usage_until_the_end() {
        let s = shape(false, true);
        let t = s.text(0, "a");
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
