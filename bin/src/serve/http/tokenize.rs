//! `POST /tokenize` and `POST /detokenize`, as vLLM has them: a prompt (or chat messages, rendered exactly as
//! `/v1/chat/completions` renders them) to the token ids the model would see, and token ids back to text. Nothing is
//! generated; the same key, body limits and error shapes as the generating endpoints apply.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::chat::{parse_messages, template_vars, tokenize as tokenize_chat};
use super::errors::ApiError;
use super::generation::blocking;
use super::openai::{self, Endpoint};
use super::Api;

/// `POST /tokenize`: `{"prompt": str}` (with `add_special_tokens`, default true) or `{"messages": [...]}` (with
/// `add_generation_prompt`, default true, `chat_template_kwargs` and `tools`) to `{"count", "max_model_len",
/// "tokens"}`, plus `token_strs` when `return_token_strs` asks for them.
pub async fn tokenize(State(api): State<Arc<Api>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let (f, _) = openai::read(body, &api, Endpoint::Tokenize).await?;
    let token_strs = f.bool("return_token_strs")?.unwrap_or(false);
    let ids = match (f.get("prompt"), f.get("messages")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "messages",
                "give either prompt or messages, not both",
            ))
        }
        (None, None) => return Err(ApiError::invalid("prompt", "prompt or messages is required")),
        (Some(_), None) => {
            let chat_only = ["add_generation_prompt", "chat_template_kwargs", "tools"];
            if let Some(name) = chat_only.into_iter().find(|n| f.get(n).is_some()) {
                return Err(ApiError::invalid(name, format!("{name} only applies to messages")));
            }
            let prompt = f.str("prompt")?.unwrap_or_default().to_string();
            let special = f.bool("add_special_tokens")?.unwrap_or(true);
            blocking(&api, move |s| {
                s.check_text_len("prompt", prompt.len())
                    .map_err(|m| ApiError::invalid("prompt", m).with_code("context_length_exceeded"))?;
                s.model
                    .tokenizer
                    .encode(&prompt, special)
                    .map_err(|e| ApiError::invalid("prompt", e.to_string()))
            })
            .await?
        }
        (None, Some(_)) => {
            // The template writes the chat's special tokens; adding the tokenizer's own (a BOS) on top is what
            // vLLM's default `false` avoids, and what this server does not do for chats.
            if f.bool("add_special_tokens")? == Some(true) {
                return Err(ApiError::unsupported(
                    "add_special_tokens",
                    "add_special_tokens with messages (the chat template adds the special tokens)",
                ));
            }
            let messages = parse_messages(&f)?;
            let generation_prompt = f.bool("add_generation_prompt")?.unwrap_or(true);
            let (kwargs, _) = template_vars(&f)?;
            blocking(&api, move |s| tokenize_chat(s, messages, generation_prompt, &kwargs))
                .await?
                .ids
        }
    };
    let state = &api.state;
    let mut body = json!({
        "count": ids.len(),
        "max_model_len": state.engine.info().max_context,
        "tokens": ids,
    });
    if token_strs {
        let tokenizer = &state.model.tokenizer;
        let strs: Vec<Value> = ids
            .iter()
            .map(|&id| tokenizer.id_to_token(id).map_or(Value::Null, Value::String))
            .collect();
        body["token_strs"] = Value::Array(strs);
    }
    Ok(Json(body).into_response())
}

/// `POST /detokenize`: `{"tokens": [ids]}` to `{"prompt": text}` (special tokens kept, as vLLM decodes them).
pub async fn detokenize(
    State(api): State<Arc<Api>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (f, _) = openai::read(body, &api, Endpoint::Detokenize).await?;
    let vocab = api.state.engine.info().vocab;
    let ids = f
        .token_ids("tokens", vocab)?
        .ok_or_else(|| ApiError::invalid("tokens", "tokens is required"))?;
    let prompt = blocking(&api, move |s| {
        s.model
            .tokenizer
            .decode(&ids, false)
            .map_err(|e| ApiError::invalid("tokens", e.to_string()))
    })
    .await?;
    Ok(Json(json!({ "prompt": prompt })).into_response())
}
