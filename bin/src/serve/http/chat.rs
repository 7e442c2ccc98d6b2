//! `POST /v1/chat/completions`: the messages rendered with the model's chat template, continued as the assistant's
//! reply, streamed or not.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::response::Response;
use rewind_engine::grammar::{Constraint, ConstraintSpec};
use rewind_engine::tokenizer::chat::ChatMessage;
use rewind_engine::tokenizer::reasoning::{prompt_opens_reasoning, ReasoningSplitter};
use rewind_engine::tools::grammar::{tool_call_grammar, ReasoningPrefix};
use rewind_engine::tools::{parse_message_tool_calls, parse_tool_choice, parse_tools, ToolCallParser, ToolChoice};
use rewind_engine::tools::{ToolFormat, ToolSpec, ToolsError};
use serde_json::{json, Map, Value};

use super::chat_parse::{self, ChatParser};
use super::errors::{echo, ApiError};
use super::generation::{answer, blocking, Answer, Logprobs};
use super::logprobs;
use super::openai::{self, type_name, Endpoint, Fields};
use super::structured;
use super::{Api, RequestContext};
use crate::serve::state::NoToolFormat;
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

/// A bad `tools` / `tool_choice` / `tool_calls` as a 400 naming the field.
fn tools_error(e: ToolsError) -> ApiError {
    ApiError::invalid(e.field, e.message)
}

/// An optional string field of message `at`.
fn message_str(m: &Value, at: &str, name: &str) -> Result<Option<String>, ApiError> {
    match m.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(ApiError::invalid(
            format!("{at}.{name}"),
            format!("{at}.{name} must be a string, got {}", type_name(other)),
        )),
    }
}

/// `messages`: a non-empty array of `{role, content}` objects; an assistant's may carry `tool_calls` (their arguments
/// JSON text, parsed for the template) and `reasoning_content`, a tool result its `tool_call_id` and `name`.
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
            let mut message = ChatMessage::new(role, content(m.get("content"), &at)?);
            if let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null()) {
                message.tool_calls = Some(parse_message_tool_calls(calls, &at).map_err(tools_error)?);
            }
            message.tool_call_id = message_str(m, &at, "tool_call_id")?;
            message.name = message_str(m, &at, "name")?;
            message.reasoning_content = message_str(m, &at, "reasoning_content")?;
            Ok(message)
        })
        .collect()
}

/// The chat template's variables of a request: its `chat_template_kwargs`, and its `tools` (as the client sent them,
/// once checked) when it has any; and the tools read.
pub(super) fn template_vars(f: &Fields) -> Result<(Map<String, Value>, Vec<ToolSpec>), ApiError> {
    let mut vars = openai::template_kwargs(f)?;
    let Some(v) = f.get("tools") else {
        return Ok((vars, Vec::new()));
    };
    let tools = parse_tools(v).map_err(tools_error)?;
    if !tools.is_empty() {
        vars.insert("tools".into(), v.clone());
    }
    Ok((vars, tools))
}

/// The tool-call reader of a chat request: none unless it has tools and lets the model choose (`auto`). A choice
/// that forces a call needs a grammar, which this server does not apply to a request yet: refused rather than
/// hoped for.
fn tool_parser(
    state: &ServeState,
    tools: Vec<ToolSpec>,
    choice: &ToolChoice,
) -> Result<Option<ToolCallParser>, ApiError> {
    match choice {
        ToolChoice::None => Ok(None),
        ToolChoice::Auto if tools.is_empty() => Ok(None),
        ToolChoice::Auto | ToolChoice::Required | ToolChoice::Named(_) => {
            let format = state.tool_format.map_err(|why| no_tool_format(state, why))?;
            Ok(Some(ToolCallParser::new(format, tools)))
        }
    }
}

/// The constraint that makes the model call a tool, for `tool_choice` `"required"` or a named function: a grammar
/// (`engine/src/tools/grammar.rs`) of one call (several with `parallel_tool_calls`) of the allowed tools in the model's
/// format, each call's arguments held to its function's JSON schema, so the calls always parse and validate. Compiled
/// on the blocking pool like any structured-output constraint; `None` for `auto` and `none`.
async fn forced_tool_call(
    api: &Api,
    parser: Option<&ToolCallParser>,
    choice: &ToolChoice,
    parallel: bool,
    opens_reasoning: bool,
) -> Result<Option<Constraint>, ApiError> {
    let (ToolChoice::Required | ToolChoice::Named(_), Some(parser)) = (choice, parser) else {
        return Ok(None);
    };
    let state = &api.state;
    let reasoning = match (state.reasoning, opens_reasoning) {
        (false, _) => ReasoningPrefix::None,
        (true, true) => ReasoningPrefix::Open,
        (true, false) => ReasoningPrefix::Optional,
    };
    let special = state.model.tokenizer.special_token_strings().to_vec();
    let lark = tool_call_grammar(parser.tools(), choice, parallel, parser.format(), &special, reasoning)
        .map_err(|e| ApiError::invalid("tool_choice", format!("tool_choice: {e}")))?;
    let compiled = blocking(api, move |s| {
        s.compile_constraint(ConstraintSpec::Lark(lark))
            .map_err(|m| ApiError::invalid("tools", format!("the tools' call grammar does not compile: {m}")))
    })
    .await?;
    Ok(Some(compiled))
}

/// Why a request with tools cannot have its calls read.
fn no_tool_format(state: &ServeState, why: NoToolFormat) -> ApiError {
    let formats: Vec<&str> = ToolFormat::ALL.iter().map(|f| f.name()).collect();
    let message = match why {
        NoToolFormat::NotInTemplate => format!(
            "The model `{}` has no tool-call format: its chat template writes none of the formats this server reads \
             ({}). Start the server with --tool-call-parser to name the model's format, or send tool_choice \"none\" \
             (the tools are shown to the model, its answer is not parsed).",
            state.model_name,
            formats.join(", ")
        ),
        NoToolFormat::Disabled => "The server runs with --tool-call-parser none, so tool calls cannot be read; send \
                                   tool_choice \"none\" or no tools."
            .to_string(),
    };
    ApiError::invalid("tools", message)
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
    let (kwargs, tools) = template_vars(&f)?;
    let choice = parse_tool_choice(f.get("tool_choice"), &tools).map_err(tools_error)?;
    // Every call block is read, however many; the flag limits a grammar that forces calls to one call.
    let parallel = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let tool_calls = tool_parser(state, tools, &choice)?;
    let mut params = openai::sampling(&f, state)?;
    let n = openai::choices(&f, state.engine.info().slots)?;
    let ask = logprobs::chat(&f)?;
    params.constraint = structured::constraint(api, &f).await?;
    let forced = matches!(choice, ToolChoice::Required | ToolChoice::Named(_));
    if forced && params.constraint.is_some() {
        return Err(ApiError::invalid(
            "tool_choice",
            "tool_choice \"required\" or a named function constrains the answer to a tool call, so it cannot be \
             combined with response_format or guided decoding",
        ));
    }
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
    if forced {
        params.constraint =
            forced_tool_call(api, tool_calls.as_ref(), &choice, parallel, prompt.opens_reasoning).await?;
    }
    let reasoning = state.reasoning.then(|| ReasoningSplitter::new(prompt.opens_reasoning));
    tracing::debug!(
        reasoning = state.reasoning,
        opens_reasoning = prompt.opens_reasoning,
        tool_format = tool_calls.as_ref().map(|t| t.format().name()),
        "chat prompt"
    );
    let parser = ChatParser::new(reasoning, tool_calls);

    let lp = (ask != logprobs::Ask::default()).then(|| Logprobs {
        ask,
        render: logprobs::Render::new(api.state.clone(), true),
        echoed: None,
    });
    match answer(
        api,
        ctx,
        (prompt.ids, params, n),
        streaming,
        true,
        None,
        parser.clone(),
        lp,
    )
    .await?
    {
        Answer::Streamed(r) => Ok(r),
        Answer::Completed(done) => Ok(done.response("chat.completion", |i, c| {
            let (message, called) = match parser.clone() {
                Some(p) => {
                    let read = p.parse_all(&c.text);
                    (chat_parse::message(&read, state.reasoning), !read.calls.is_empty())
                }
                None => (json!({"role": "assistant", "content": c.text}), false),
            };
            let reason = if called { Some("tool_calls") } else { c.finish_reason() };
            json!({"index": i, "message": message, "finish_reason": reason})
        })),
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
