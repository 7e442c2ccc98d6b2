//! Log-probabilities in OpenAI's shapes: what a body asks for (completions' `logprobs: k`, `echo` and vLLM's
//! `prompt_logprobs: k`; chat's `logprobs: true` with `top_logprobs: k`) and how the engine's entries
//! ([`TokenLogprob`]) are written: the legacy completions object `{tokens, token_logprobs, top_logprobs,
//! text_offset}`, chat's `{content: [{token, logprob, bytes, top_logprobs}]}`, and vLLM's `prompt_logprobs` list.
//! A token's string is the tokenizer's decoding of that id alone (as vLLM writes it), `bytes` its UTF-8 bytes.

use std::sync::Arc;

use rewind_actors::TokenLogprob;
use rewind_engine::rank::MAX_TOP;
use serde_json::{json, Map, Value};

use super::errors::ApiError;
use super::openai::Fields;
use crate::serve::ServeState;

/// What a request asks for: top entries per generated token and per prompt token (`None`: none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ask {
    pub generated: Option<usize>,
    pub prompt: Option<usize>,
    /// vLLM's `prompt_logprobs` field was given (its list is answered beside the legacy object).
    pub prompt_field: bool,
}

/// A count of top entries in `0 ..= 20`, named `name` in errors.
fn top_count(f: &Fields, name: &str) -> Result<Option<usize>, ApiError> {
    match f.int(name)? {
        None => Ok(None),
        Some(k) if (0..=MAX_TOP as i128).contains(&k) => Ok(Some(k as usize)),
        Some(k) => Err(ApiError::invalid(
            name,
            format!("{name} must be between 0 and {MAX_TOP}, got {k}"),
        )),
    }
}

/// `/v1/completions`: `logprobs: k` gives each generated token's entry with `k` alternatives (`0`: the token's
/// alone), and with `echo` the prompt's too; `prompt_logprobs: k` (vLLM) the prompt's with `k` alternatives.
pub fn completions(f: &Fields, echo: bool) -> Result<Ask, ApiError> {
    let generated = top_count(f, "logprobs")?;
    let field = top_count(f, "prompt_logprobs")?;
    Ok(Ask {
        generated,
        prompt: field.or(generated.filter(|_| echo)),
        prompt_field: field.is_some(),
    })
}

/// `/v1/chat/completions`: `logprobs: true`, with `top_logprobs: k` alternatives per token (which needs
/// `logprobs: true`, as OpenAI says; `top_logprobs: 0`, which clients send unasked, asks for nothing).
pub fn chat(f: &Fields) -> Result<Ask, ApiError> {
    let on = f.bool("logprobs")?.unwrap_or(false);
    let top = top_count(f, "top_logprobs")?;
    if top.is_some_and(|k| k > 0) && !on {
        return Err(ApiError::invalid(
            "top_logprobs",
            "top_logprobs requires logprobs to be set to true",
        ));
    }
    Ok(Ask {
        generated: on.then(|| top.unwrap_or(0)),
        prompt: None,
        prompt_field: false,
    })
}

/// Writes entries with their tokens' strings; a completion's running `text_offset` is kept here (so each choice
/// has its own copy).
#[derive(Clone)]
pub struct Render {
    state: Arc<ServeState>,
    chat: bool,
    /// Characters of the token strings written so far (completions' `text_offset`).
    offset: usize,
}

impl Render {
    pub fn new(state: Arc<ServeState>, chat: bool) -> Self {
        Render { state, chat, offset: 0 }
    }

    /// The string of token `id` alone (undecodable ids read as empty, as the byte-level pieces of a split character
    /// read as U+FFFD).
    fn piece(&self, id: u32) -> String {
        self.state.model.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// The `logprobs` value of a piece of the answer holding `entries` (generated tokens).
    pub fn generated(&mut self, entries: &[TokenLogprob]) -> Value {
        if self.chat {
            return json!({"content": entries.iter().map(|e| self.chat_entry(e)).collect::<Vec<_>>()});
        }
        let rows: Vec<(u32, Option<&TokenLogprob>)> = entries.iter().map(|e| (e.token, Some(e))).collect();
        self.legacy(&rows)
    }

    /// The legacy completions object of an echoed prompt (`ids`, with `entries` from the engine: the first is
    /// `null`).
    pub fn prompt(&mut self, ids: &[u32], entries: &[Option<TokenLogprob>]) -> Value {
        let rows: Vec<(u32, Option<&TokenLogprob>)> = ids
            .iter()
            .enumerate()
            .map(|(i, &id)| (id, entries.get(i).and_then(Option::as_ref)))
            .collect();
        self.legacy(&rows)
    }

    fn legacy(&mut self, rows: &[(u32, Option<&TokenLogprob>)]) -> Value {
        let mut tokens = Vec::with_capacity(rows.len());
        let mut token_logprobs = Vec::with_capacity(rows.len());
        let mut top_logprobs = Vec::with_capacity(rows.len());
        let mut text_offset = Vec::with_capacity(rows.len());
        for &(id, e) in rows {
            let s = self.piece(id);
            text_offset.push(self.offset);
            self.offset += s.chars().count();
            tokens.push(Value::String(s));
            token_logprobs.push(e.map_or(Value::Null, |e| json!(e.logprob)));
            top_logprobs.push(e.map_or(Value::Null, |e| {
                // A dict by token string, best first (OpenAI's shape; two ids of one string keep the better).
                let mut m = Map::new();
                for &(t, v) in &e.top {
                    m.entry(self.piece(t)).or_insert(json!(v));
                }
                Value::Object(m)
            }));
        }
        json!({
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        })
    }

    fn chat_token(&self, id: u32, logprob: f32) -> Value {
        let s = self.piece(id);
        json!({"token": s, "logprob": logprob, "bytes": s.as_bytes()})
    }

    fn chat_entry(&self, e: &TokenLogprob) -> Value {
        let mut v = self.chat_token(e.token, e.logprob);
        v["top_logprobs"] = e.top.iter().map(|&(t, l)| self.chat_token(t, l)).collect();
        v
    }

    /// vLLM's `prompt_logprobs`: per prompt token `null` (the first) or a map from token id to
    /// `{logprob, rank, decoded_token}` holding the prompt's token and the top entries (`rank`: 1 for the best,
    /// `null` for a token outside the top entries).
    pub fn vllm_prompt(&self, entries: &[Option<TokenLogprob>]) -> Value {
        entries
            .iter()
            .map(|e| {
                e.as_ref().map_or(Value::Null, |e| {
                    let mut m = Map::new();
                    let rank = e.top.iter().position(|&(t, _)| t == e.token).map(|r| r + 1);
                    m.insert(
                        e.token.to_string(),
                        json!({"logprob": e.logprob, "rank": rank, "decoded_token": self.piece(e.token)}),
                    );
                    for (r, &(t, l)) in e.top.iter().enumerate() {
                        m.entry(t.to_string())
                            .or_insert_with(|| json!({"logprob": l, "rank": r + 1, "decoded_token": self.piece(t)}));
                    }
                    Value::Object(m)
                })
            })
            .collect()
    }
}

/// Joins two legacy completions objects (an echoed prompt's, then the generated tokens').
pub fn join_legacy(mut a: Value, b: &Value) -> Value {
    for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(x), Some(y)) = (a[k].as_array_mut(), b[k].as_array()) {
            x.extend(y.iter().cloned());
        }
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(s: &str) -> Fields {
        Fields::parse(s.as_bytes()).expect("an object")
    }

    #[test]
    fn completions_ask_for_generated_and_echoed_prompt_entries() {
        let a = completions(&fields(r#"{"logprobs": 5}"#), false).expect("valid");
        assert_eq!((a.generated, a.prompt), (Some(5), None));
        let a = completions(&fields(r#"{"logprobs": 0}"#), true).expect("valid");
        assert_eq!((a.generated, a.prompt), (Some(0), Some(0)));
        let a = completions(&fields(r#"{"prompt_logprobs": 2}"#), false).expect("valid");
        assert_eq!((a.generated, a.prompt, a.prompt_field), (None, Some(2), true));
        assert_eq!(completions(&fields(r#"{"logprobs": null}"#), true), Ok(Ask::default()));
        for body in [
            r#"{"logprobs": 21}"#,
            r#"{"logprobs": -1}"#,
            r#"{"prompt_logprobs": 99}"#,
        ] {
            let e = completions(&fields(body), false).expect_err(body);
            assert_eq!(e.status.as_u16(), 400);
            assert!(e.message.contains("between 0 and 20"), "{}", e.message);
        }
        let e = completions(&fields(r#"{"logprobs": true}"#), false).expect_err("a boolean");
        assert_eq!(e.param.as_deref(), Some("logprobs"));
    }

    #[test]
    fn chat_top_logprobs_need_logprobs_and_stay_in_range() {
        let a = chat(&fields(r#"{"logprobs": true, "top_logprobs": 3}"#)).expect("valid");
        assert_eq!(a.generated, Some(3));
        assert_eq!(
            chat(&fields(r#"{"logprobs": true}"#)).expect("valid").generated,
            Some(0)
        );
        assert_eq!(chat(&fields(r#"{"logprobs": false}"#)).expect("valid").generated, None);
        assert_eq!(chat(&fields(r#"{"top_logprobs": 0}"#)).expect("valid").generated, None);
        for (body, want) in [
            (r#"{"top_logprobs": 2}"#, "requires logprobs"),
            (r#"{"logprobs": false, "top_logprobs": 2}"#, "requires logprobs"),
            (r#"{"logprobs": true, "top_logprobs": 21}"#, "between 0 and 20"),
            (r#"{"logprobs": true, "top_logprobs": -2}"#, "between 0 and 20"),
        ] {
            let e = chat(&fields(body)).expect_err(body);
            assert_eq!(e.param.as_deref(), Some("top_logprobs"), "{body}");
            assert!(e.message.contains(want), "{body}: {}", e.message);
        }
    }
}
