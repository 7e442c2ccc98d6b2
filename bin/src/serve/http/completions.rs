//! `POST /v1/completions`: one prompt (a string, or token ids) continued, streamed or not; `echo` prepends the
//! prompt's text.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::response::Response;
use serde_json::{json, Value};

use super::errors::ApiError;
use super::generation::{answer, blocking, Answer, Logprobs};
use super::logprobs;
use super::openai::{self, Endpoint, Fields};
use super::structured;
use super::{Api, RequestContext};
use crate::serve::ServeState;

/// A prompt as the request gave it: text (tokenized here, with the tokenizer's special tokens) or token ids.
#[derive(Clone, Debug, PartialEq)]
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

fn batched(n: usize) -> ApiError {
    ApiError::invalid(
        "prompt",
        format!("a batch of {n} prompts is not supported: send one prompt per request"),
    )
    .with_code("unsupported_parameter")
}

/// The request's one prompt: a string, an array of token ids, or an array holding one of either (how some clients
/// send a single prompt). A batch of several prompts is refused.
fn parse_prompt(f: &Fields, vocab: usize) -> Result<Prompt, ApiError> {
    let Some(v) = f.get("prompt") else {
        return Err(ApiError::invalid("prompt", "prompt is required"));
    };
    let empty = || ApiError::invalid("prompt", "prompt must not be empty");
    match v {
        Value::String(s) if s.is_empty() => Err(empty()),
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(a) if a.is_empty() => Err(empty()),
        Value::Array(a) => match &a[0] {
            Value::Number(_) => Ok(Prompt::Ids(openai::token_ids("prompt", v, vocab)?)),
            Value::String(_) | Value::Array(_) if a.len() > 1 => Err(batched(a.len())),
            Value::String(s) if s.is_empty() => Err(empty()),
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            Value::Array(ids) if ids.is_empty() => Err(empty()),
            Value::Array(_) => Ok(Prompt::Ids(openai::token_ids("prompt[0]", &a[0], vocab)?)),
            other => Err(ApiError::invalid(
                "prompt",
                format!(
                    "prompt must be a string, an array of token ids or an array of one of those; its first element \
                     is {}",
                    openai::type_name(other)
                ),
            )),
        },
        other => Err(ApiError::invalid(
            "prompt",
            format!(
                "prompt must be a string or an array of token ids, got {}",
                openai::type_name(other)
            ),
        )),
    }
}

/// The prompt's token ids, and its text when `echo` wants it.
fn tokenize(state: &ServeState, prompt: Prompt, echo: bool) -> Result<(Vec<u32>, Option<String>), ApiError> {
    let tokenizer = &state.model.tokenizer;
    let failed = |e: rewind_engine::EngineError| ApiError::invalid("prompt", format!("prompt: {e}"));
    match prompt {
        Prompt::Text(s) => {
            state
                .check_text_len("prompt", s.len())
                .map_err(|m| ApiError::invalid("prompt", m).with_code("context_length_exceeded"))?;
            let ids = tokenizer.encode(&s, true).map_err(failed)?;
            Ok((ids, echo.then_some(s)))
        }
        Prompt::Ids(ids) => {
            let text = echo
                .then(|| tokenizer.decode(&ids, false))
                .transpose()
                .map_err(failed)?;
            Ok((ids, text))
        }
    }
}

/// The handler.
pub async fn handle(
    State(api): State<Arc<Api>>,
    Extension(ctx): Extension<RequestContext>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (api, ctx) = (api.as_ref(), &ctx);
    let state = &api.state;
    let (f, streaming) = openai::read(body, api, Endpoint::Completions).await?;
    let echo = f.bool("echo")?.unwrap_or(false);
    let ask = logprobs::completions(&f, echo)?;
    let prompt = parse_prompt(&f, state.engine.info().vocab)?;
    let mut params = openai::sampling(&f, state)?;
    let n = openai::choices(&f, state.engine.info().slots)?;
    params.constraint = structured::constraint(api, &f).await?;
    let requested = f.count("max_tokens")?.map(|m| (m, "max_tokens"));
    let (ids, echoed) = blocking(api, move |s| tokenize(s, prompt, echo)).await?;
    // `max_tokens: 0` scores the prompt (its log-probabilities, with `echo` its text) and generates nothing.
    let scoring = requested.is_some_and(|(m, _)| m == 0) && ask.prompt.is_some();
    let resolved = openai::resolve_max_tokens(
        state,
        ids.len(),
        "prompt",
        requested.filter(|_| !scoring),
        params.min_tokens,
    )?;
    if scoring && params.min_tokens > 0 {
        return Err(ApiError::invalid(
            "min_tokens",
            format!("min_tokens must be at most max_tokens (0), got {}", params.min_tokens),
        ));
    }
    params.max_tokens = Some(if scoring { 0 } else { resolved });
    let lp = (ask != logprobs::Ask::default()).then(|| Logprobs {
        ask,
        render: logprobs::Render::new(api.state.clone(), false),
        echoed: echo.then(|| ids.clone()),
    });

    match answer(api, ctx, (ids, params, n), streaming, false, echoed, None, lp).await? {
        Answer::Streamed(r) => Ok(r),
        Answer::Completed(done) => Ok(done.response(
            "text_completion",
            |i, c| json!({"index": i, "text": c.text, "finish_reason": c.finish_reason()}),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(body: &str) -> Result<Prompt, ApiError> {
        parse_prompt(&Fields::parse(body.as_bytes()).expect("object"), 100)
    }

    #[test]
    fn prompts_are_text_or_ids() {
        assert_eq!(prompt(r#"{"prompt": "hi"}"#), Ok(Prompt::Text("hi".into())));
        assert_eq!(prompt(r#"{"prompt": ["hi"]}"#), Ok(Prompt::Text("hi".into())));
        assert_eq!(prompt(r#"{"prompt": [1, 2]}"#), Ok(Prompt::Ids(vec![1, 2])));
        assert_eq!(prompt(r#"{"prompt": [[3]]}"#), Ok(Prompt::Ids(vec![3])));
    }

    #[test]
    fn bad_prompts_name_the_field() {
        for (body, want) in [
            (r#"{}"#, "prompt is required"),
            (r#"{"prompt": ""}"#, "must not be empty"),
            (r#"{"prompt": []}"#, "must not be empty"),
            (r#"{"prompt": [[]]}"#, "must not be empty"),
            (r#"{"prompt": ["a", "b"]}"#, "a batch of 2 prompts is not supported"),
            (r#"{"prompt": [[1], [2]]}"#, "a batch of 2 prompts"),
            (r#"{"prompt": [1, 100]}"#, "token id 100 is out of range"),
            (r#"{"prompt": [1, "a"]}"#, "prompt[1] must be a non-negative integer"),
            (r#"{"prompt": 7}"#, "got a number"),
            (r#"{"prompt": [{}]}"#, "first element is an object"),
        ] {
            let e = prompt(body).expect_err(body);
            assert!(e.message.contains(want), "{body}: {}", e.message);
            assert!(e.param.as_deref().is_some_and(|p| p.starts_with("prompt")), "{body}");
            assert_eq!(e.status.as_u16(), 400);
        }
    }
}
