//! `POST /v1/chat/completions`: the messages rendered with the model's chat template, continued as the assistant's
//! reply, streamed or not.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::response::Response;
use rewind_engine::tokenizer::chat::ChatMessage;
use rewind_engine::tokenizer::reasoning::{prompt_opens_reasoning, ReasoningSplitter};
use serde_json::{json, Map, Value};

use super::errors::{echo, ApiError};
use super::generation::{answer, blocking, Answer, Logprobs};
use super::logprobs;
use super::openai::{self, type_name, Endpoint, Fields};
use super::{Api, RequestContext};
use crate::serve::{ServeState, CHAT_ROLES};

/// A message's content: a string, `null` (an assistant turn that only called tools), or an array of parts of which
/// only text ones are understood; their texts are joined by newlines, as vLLM joins them.
fn content(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
    let parts = match v {
        None | Some(Value::Null) => return Ok(String::new()),
        Some(Value::String(s)) => return Ok(s.clone()),
        Some(Value::Array(parts)) => parts,
        Some(other) => {
            return Err(ApiError::invalid(
                format!("{at}.content"),
                format!(
                    "{at}.content must be a string or an array of parts, got {}",
                    type_name(other)
                ),
            ))
        }
    };
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let param = format!("{at}.content[{j}]");
        match (part.get("type").and_then(Value::as_str), part.get("text")) {
            (Some("text"), Some(Value::String(t))) => texts.push(t.as_str()),
            (Some("text"), _) => return Err(ApiError::invalid(&param, format!("{param}.text must be a string"))),
            (Some(other), _) => {
                return Err(ApiError::unsupported(
                    &param,
                    &format!("content of type `{other}` (only `text`)"),
                ))
            }
            (None, _) => {
                return Err(ApiError::invalid(
                    &param,
                    format!("{param} must be an object with a `type`"),
                ))
            }
        }
    }
    Ok(texts.join("\n"))
}

/// `messages`: a non-empty array of `{role, content}` objects.
pub(super) fn parse_messages(f: &Fields) -> Result<Vec<ChatMessage>, ApiError> {
    let list = match f.get("messages") {
        None => return Err(ApiError::invalid("messages", "messages is required")),
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::invalid("messages", "messages must not be empty"))
        }
        Some(Value::Array(a)) => a,
        Some(other) => {
            return Err(ApiError::invalid(
                "messages",
                format!("messages must be an array, got {}", type_name(other)),
            ))
        }
    };
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let at = format!("messages[{i}]");
            if !m.is_object() {
                return Err(ApiError::invalid(
                    &at,
                    format!("{at} must be an object, got {}", type_name(m)),
                ));
            }
            let role = match m.get("role") {
                Some(Value::String(r)) if CHAT_ROLES.contains(&r.as_str()) => r.clone(),
                Some(Value::String(r)) if !r.is_empty() => {
                    return Err(ApiError::invalid(
                        format!("{at}.role"),
                        format!(
                            "{at}.role `{}` is not a chat role: expected one of {}",
                            echo(r),
                            CHAT_ROLES.join(", ")
                        ),
                    ));
                }
                _ => {
                    return Err(ApiError::invalid(
                        format!("{at}.role"),
                        format!("{at}.role must be a non-empty string"),
                    ))
                }
            };
            Ok(ChatMessage::new(role, content(m.get("content"), &at)?))
        })
        .collect()
}

/// A conversation rendered and tokenized.
pub(super) struct Prompt {
    pub ids: Vec<u32>,
    /// The template's generation prompt left a `<think>` block open: the answer starts inside it.
    pub opens_reasoning: bool,
}

/// The rendered conversation's token ids (the template adds its own special tokens, so none are added here; a
/// content's text never becomes one), with `kwargs` (`chat_template_kwargs`) passed to the template.
pub(super) fn tokenize(
    state: &ServeState,
    messages: Vec<ChatMessage>,
    generation_prompt: bool,
    kwargs: &Map<String, Value>,
) -> Result<Prompt, ApiError> {
    let tokenizer = &state.model.tokenizer;
    if tokenizer.chat_template().is_none() {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "The model `{}` has no chat template, so it cannot take chat messages; use /v1/completions with a \
                 prompt instead.",
                state.model_name
            ),
        ));
    }
    // A template's own checks (`raise_exception`: roles out of order, ...) are the request's fault.
    let rendered = tokenizer
        .render_with(&messages, generation_prompt, kwargs)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    state
        .check_text_len("conversation", rendered.len())
        .map_err(|m| ApiError::invalid("messages", m).with_code("context_length_exceeded"))?;
    // Contents are text even where they spell a special token; only the template's markers are special.
    let ids = tokenizer
        .encode_chat_with(&messages, generation_prompt, kwargs, &rendered)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    Ok(Prompt {
        ids,
        opens_reasoning: generation_prompt && prompt_opens_reasoning(&rendered),
    })
}

/// The handler.
pub async fn handle(
    State(api): State<Arc<Api>>,
    Extension(ctx): Extension<RequestContext>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (api, ctx) = (api.as_ref(), &ctx);
    let state = &api.state;
    let (f, streaming) = openai::read(body, api, Endpoint::Chat).await?;
    let messages = parse_messages(&f)?;
    let generation_prompt = f.bool("add_generation_prompt")?.unwrap_or(true);
    let kwargs = openai::template_kwargs(&f)?;
    let mut params = openai::sampling(&f, state)?;
    let ask = logprobs::chat(&f)?;
    // OpenAI renamed max_tokens to max_completion_tokens; the new name wins when a client sends both.
    let requested = match f.count("max_completion_tokens")? {
        Some(m) => Some((m, "max_completion_tokens")),
        None => f.count("max_tokens")?.map(|m| (m, "max_tokens")),
    };
    let prompt = blocking(api, move |s| tokenize(s, messages, generation_prompt, &kwargs)).await?;
    params.max_tokens = Some(openai::resolve_max_tokens(
        state,
        prompt.ids.len(),
        "messages",
        requested,
        params.min_tokens,
    )?);
    let reasoning = state.reasoning.then(|| ReasoningSplitter::new(prompt.opens_reasoning));
    tracing::debug!(
        reasoning = state.reasoning,
        opens_reasoning = prompt.opens_reasoning,
        "chat prompt"
    );

    let lp = (ask != logprobs::Ask::default()).then(|| Logprobs {
        ask,
        render: logprobs::Render::new(api.state.clone(), true),
        echoed: None,
    });
    match answer(api, ctx, (prompt.ids, params), streaming, true, None, reasoning, lp).await? {
        Answer::Streamed(r) => Ok(r),
        Answer::Completed(done) => {
            let message = if state.reasoning {
                let split = ReasoningSplitter::split_all(prompt.opens_reasoning, &done.text);
                let reasoning = (!split.reasoning.is_empty()).then_some(split.reasoning);
                // An answer that is all reasoning (cut short, or only thought) has no content, as vLLM says it.
                let content = (!split.content.is_empty() || reasoning.is_none()).then_some(split.content);
                json!({"role": "assistant", "content": content, "reasoning_content": reasoning})
            } else {
                json!({"role": "assistant", "content": done.text})
            };
            Ok(done.response(
                "chat.completion",
                json!({"index": 0, "message": message, "finish_reason": done.reason.openai()}),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(body: &str) -> Result<Vec<ChatMessage>, ApiError> {
        parse_messages(&Fields::parse(body.as_bytes()).expect("object"))
    }

    #[test]
    fn messages_take_strings_and_text_parts() {
        let m = messages(
            r#"{"messages": [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                             {"role": "assistant", "content": null}]}"#,
        )
        .expect("valid");
        assert_eq!(
            m,
            vec![
                ChatMessage::new("system", "be brief"),
                ChatMessage::new("user", "a\nb"),
                ChatMessage::new("assistant", ""),
            ]
        );
    }

    #[test]
    fn bad_messages_name_the_field() {
        for (body, param, want) in [
            (r#"{}"#, "messages", "messages is required"),
            (r#"{"messages": []}"#, "messages", "must not be empty"),
            (r#"{"messages": "hi"}"#, "messages", "must be an array, got a string"),
            (r#"{"messages": [3]}"#, "messages[0]", "must be an object"),
            (
                r#"{"messages": [{"content": "x"}]}"#,
                "messages[0].role",
                "non-empty string",
            ),
            (
                r#"{"messages": [{"role": "wizard", "content": "x"}]}"#,
                "messages[0].role",
                "`wizard` is not a chat role",
            ),
            (
                r#"{"messages": [{"role": "user", "content": 5}]}"#,
                "messages[0].content",
                "got a number",
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}"#,
                "messages[0].content[0]",
                "`image_url` (only `text`) is not supported",
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "text"}]}]}"#,
                "messages[0].content[0]",
                "text",
            ),
        ] {
            let e = messages(body).expect_err(body);
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
            assert!(e.message.contains(want), "{body}: {}", e.message);
        }
    }
}
