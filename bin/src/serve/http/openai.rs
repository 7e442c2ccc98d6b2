//! Reading OpenAI request bodies: [`Fields`] (a JSON object read field by field, every wrong type a 400 naming the
//! field) and what `/v1/completions` and `/v1/chat/completions` share: the model check, the sampling fields
//! ([`sampling`]), the streaming options, and the fields this server refuses rather than ignores ([`refuse_unsupported`]).
//!
//! Bodies are read as `serde_json::Value` and not derived structs because serde's errors for a wrong type name a
//! column, not the field, and OpenAI clients send `null` for any field they leave unset.

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use rewind_engine::sample::SamplingParams;
use serde_json::{Map, Value};

use super::errors::{echo, ApiError};
use super::Api;
use crate::serve::ServeState;

/// A request body: a JSON object.
#[derive(Debug)]
pub struct Fields(Map<String, Value>);

/// How a JSON value's type reads in an error message.
pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong_type(name: &str, want: &str, got: &Value) -> ApiError {
    ApiError::invalid(name, format!("{name} must be {want}, got {}", type_name(got)))
}

impl Fields {
    /// Parses a request body, which must be a JSON object.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        if body.is_empty() {
            return Err(ApiError::bad_request("The request body is empty; send a JSON object."));
        }
        match serde_json::from_slice::<Value>(body) {
            Ok(Value::Object(m)) => Ok(Fields(m)),
            Ok(v) => Err(ApiError::bad_request(format!(
                "The request body must be a JSON object, got {}.",
                type_name(&v)
            ))),
            Err(e) => Err(ApiError::bad_request(format!(
                "The request body is not valid JSON: {e}."
            ))),
        }
    }

    /// A field's value; `null` counts as absent.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    /// A number field. A value past f32's range is refused as given (as f32 it would read as infinity, and the
    /// range checks would then name a value the client never sent).
    pub fn f32(&self, name: &str) -> Result<Option<f32>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_f64() {
                Some(x) if x.abs() <= f64::from(f32::MAX) => Ok(Some(x as f32)),
                Some(_) => Err(ApiError::invalid(
                    name,
                    format!("{name} is out of range, got {n} (at most {:e} in magnitude)", f32::MAX),
                )),
                None => Err(ApiError::invalid(name, format!("{name} must be a finite number"))),
            },
            Some(v) => Err(wrong_type(name, "a number", v)),
        }
    }

    /// An integer field (negative ones included).
    pub fn int(&self, name: &str) -> Result<Option<i128>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => n
                .as_i64()
                .map(i128::from)
                .or_else(|| n.as_u64().map(i128::from))
                .map(Some)
                .ok_or_else(|| {
                    // JSON reads an integer past 64 bits as a float: say it is too large, not that it is no integer.
                    let whole = n.as_f64().is_some_and(|x| x.fract() == 0.0 && x.abs() >= 9.2e18);
                    let why = if whole { "is out of range" } else { "must be an integer" };
                    ApiError::invalid(name, format!("{name} {why}, got {n}"))
                }),
            Some(v) => Err(wrong_type(name, "an integer", v)),
        }
    }

    /// A non-negative integer field that fits a `usize`.
    pub fn count(&self, name: &str) -> Result<Option<usize>, ApiError> {
        match self.int(name)? {
            None => Ok(None),
            Some(i) => usize::try_from(i)
                .map(Some)
                .map_err(|_| ApiError::invalid(name, format!("{name} must be a non-negative integer, got {i}"))),
        }
    }

    /// A boolean field.
    pub fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(wrong_type(name, "a boolean", v)),
        }
    }

    /// A string field.
    pub fn str(&self, name: &str) -> Result<Option<&str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(wrong_type(name, "a string", v)),
        }
    }

    /// `stop`: a string or an array of strings, none empty.
    fn stop(&self) -> Result<Vec<String>, ApiError> {
        let list = match self.get("stop") {
            None => return Ok(Vec::new()),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => Ok(s.clone()),
                    v => Err(wrong_type(&format!("stop[{i}]"), "a string", v)),
                })
                .collect::<Result<_, _>>()?,
            Some(v) => return Err(wrong_type("stop", "a string or an array of strings", v)),
        };
        rewind_engine::sample::check_stop_strings(&list, "stop").map_err(|m| ApiError::invalid("stop", m))?;
        Ok(list)
    }

    /// `logit_bias`: an object from token ids (decimal strings, as JSON keys are) below `vocab` to biases in
    /// [-100, 100]. The range is checked here, on the number as sent (past f32 it would read as infinity).
    fn logit_bias(&self, vocab: usize) -> Result<BTreeMap<u32, f32>, ApiError> {
        const NAME: &str = "logit_bias";
        let map = match self.get(NAME) {
            None => return Ok(BTreeMap::new()),
            Some(Value::Object(m)) => m,
            Some(v) => return Err(wrong_type(NAME, "an object from token ids to biases", v)),
        };
        let max = f64::from(rewind_engine::sample::MAX_LOGIT_BIAS);
        map.iter()
            .map(|(key, v)| {
                let id = key
                    .parse::<u32>()
                    .ok()
                    .filter(|&id| (id as usize) < vocab)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            NAME,
                            format!(
                                "logit_bias: key \"{}\" is not a token id of a vocabulary of {vocab} tokens",
                                echo(key)
                            ),
                        )
                    })?;
                let b = match v {
                    Value::Number(n) => n.as_f64().filter(|b| (-max..=max).contains(b)).ok_or_else(|| {
                        ApiError::invalid(NAME, format!("logit_bias[{id}] must be in [-100, 100], got {n}"))
                    })?,
                    v => return Err(wrong_type(&format!("logit_bias[{id}]"), "a number", v)),
                };
                Ok((id, b as f32))
            })
            .collect()
    }

    /// An array of token ids, each below `vocab`.
    pub fn token_ids(&self, name: &str, vocab: usize) -> Result<Option<Vec<u32>>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => token_ids(name, v, vocab).map(Some),
        }
    }
}

/// `v` as an array of token ids below `vocab`; errors name `name` and the index at fault.
pub fn token_ids(name: &str, v: &Value, vocab: usize) -> Result<Vec<u32>, ApiError> {
    let Value::Array(items) = v else {
        return Err(wrong_type(name, "an array of token ids", v));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let id = item.as_u64().ok_or_else(|| {
                ApiError::invalid(
                    name,
                    format!("{name}[{i}] must be a non-negative integer token id, got {item}"),
                )
            })?;
            if id >= vocab as u64 {
                return Err(ApiError::invalid(
                    name,
                    format!("{name}[{i}]: token id {id} is out of range for a vocabulary of {vocab} tokens"),
                ));
            }
            Ok(id as u32)
        })
        .collect()
}

/// What both endpoints read first: the body's fields, checked for the served model and for values this server refuses,
/// and the streaming options.
///
/// Unknown top-level fields are refused under `--strict-fields`; otherwise, as vLLM does, they are ignored with a
/// warning and counted in `/metrics`, so clients that send newer fields keep working.
pub async fn read(
    body: Result<Bytes, BytesRejection>,
    api: &Api,
    endpoint: Endpoint,
) -> Result<(Fields, Streaming), ApiError> {
    let state = &api.state;
    let body = body.map_err(|r| ApiError::unreadable_body(&r))?;
    let f = super::body::parse(api, body).await?;
    let unknown = unknown_fields(&f, endpoint);
    if !unknown.is_empty() {
        let list = field_list(&unknown);
        if state.strict_fields {
            return Err(ApiError::invalid(
                unknown[0],
                format!("unknown field(s) {list} (the server runs with --strict-fields)"),
            )
            .with_code("unknown_parameter"));
        }
        tracing::warn!(fields = %list, "ignoring unknown request fields");
        api.metrics.unknown_fields(api_endpoint(endpoint), unknown.len());
    }
    check_model(&f, state)?;
    refuse_unsupported(&f, endpoint)?;
    let s = match endpoint {
        Endpoint::Completions | Endpoint::Chat => streaming(&f)?,
        Endpoint::Tokenize | Endpoint::Detokenize => Streaming::default(),
    };
    Ok((f, s))
}

/// The metrics label of `endpoint`.
fn api_endpoint(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Completions => super::COMPLETIONS,
        Endpoint::Chat => super::CHAT,
        Endpoint::Tokenize => super::TOKENIZE,
        Endpoint::Detokenize => super::DETOKENIZE,
    }
}

/// A 404 unless `model` (when given) is the served model.
fn check_model(f: &Fields, state: &ServeState) -> Result<(), ApiError> {
    match f.str("model")? {
        Some(m) if m != state.model_name => Err(ApiError::model_not_found(m, &state.model_name)),
        _ => Ok(()),
    }
}

/// Which endpoint a body is for: they differ in which fields they have (and the two generating ones in what
/// `logprobs` is).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
    Tokenize,
    Detokenize,
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    }
}

fn is_false(v: &Value) -> bool {
    v == &Value::Bool(false)
}

/// Which values of a field [`refuse_unsupported`] lets through.
type Accepts = fn(&Value) -> bool;

/// A table of refused fields: the name, what a value other than the default asks for, and which values pass.
type Refusals = [(&'static str, &'static str, Accepts)];

/// The fields [`refuse_unsupported`] checks: the name, what a value other than the default asks for, and which values
/// pass.
const UNSUPPORTED: &[(&str, &str, Accepts)] = &[
    ("use_beam_search", "use_beam_search", is_false),
    ("suffix", "suffix", is_empty),
    (
        "functions",
        "functions (the legacy function calling; send tools)",
        is_empty,
    ),
];

/// Fields both endpoints know besides those of [`UNSUPPORTED`]: read, or harmless to ignore (`user`, `metadata`).
const KNOWN: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_tokens",
    "seed",
    "stop",
    "include_stop_str_in_output",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "best_of",
    "stream",
    "stream_options",
    "logprobs",
    "user",
    "metadata",
    "store",
    "service_tier",
    // Structured outputs, read by `super::structured`.
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "structured_outputs",
];

/// Fields only `/v1/completions` knows.
const KNOWN_COMPLETIONS: &[&str] = &["prompt", "echo", "prompt_logprobs"];

/// Fields only `/v1/chat/completions` knows besides those of [`UNSUPPORTED_CHAT`].
const KNOWN_CHAT: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "top_logprobs",
    "parallel_tool_calls",
    "chat_template_kwargs",
];

/// What `/v1/completions` refuses rather than ignores: tools belong to chats.
const UNSUPPORTED_COMPLETIONS: &[(&str, &str, Accepts)] = &[
    (
        "tools",
        "tools on completions (send them to /v1/chat/completions)",
        is_empty,
    ),
    ("tool_choice", "tool_choice on completions", |v| {
        v == "none" || v == "auto"
    }),
];

/// The fields of `/tokenize` (vLLM's: a `prompt`, or chat `messages` with their options).
const KNOWN_TOKENIZE: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "return_token_strs",
    "chat_template_kwargs",
    "tools",
];

/// What `/tokenize` refuses rather than ignores: a chat rendered differently from how `/v1/chat/completions` renders it.
const UNSUPPORTED_TOKENIZE: &[(&str, &str, Accepts)] = &[
    (
        "chat_template",
        "chat_template (the model's own template is used)",
        is_empty,
    ),
    ("continue_final_message", "continue_final_message", is_false),
];

/// The fields of `/detokenize`.
const KNOWN_DETOKENIZE: &[&str] = &["model", "tokens"];

/// The body's top-level fields that `endpoint` does not know.
pub fn unknown_fields(f: &Fields, endpoint: Endpoint) -> Vec<&str> {
    let (shared, own, unsupported): (&[&str], &[&str], &Refusals) = match endpoint {
        Endpoint::Completions => (KNOWN, KNOWN_COMPLETIONS, UNSUPPORTED),
        Endpoint::Chat => (KNOWN, KNOWN_CHAT, UNSUPPORTED),
        Endpoint::Tokenize => (&[], KNOWN_TOKENIZE, UNSUPPORTED_TOKENIZE),
        Endpoint::Detokenize => (&[], KNOWN_DETOKENIZE, &[]),
    };
    let chat: &Refusals = match endpoint {
        Endpoint::Chat => UNSUPPORTED_CHAT,
        Endpoint::Completions => UNSUPPORTED_COMPLETIONS,
        Endpoint::Tokenize | Endpoint::Detokenize => &[],
    };
    let known = |name: &str| {
        shared.contains(&name) || own.contains(&name) || unsupported.iter().chain(chat).any(|(n, _, _)| *n == name)
    };
    f.0.keys().map(String::as_str).filter(|n| !known(n)).collect()
}

/// How many unknown field names a message or log line lists (they come from the client).
const SHOWN_FIELDS: usize = 8;

/// `names` for a message: at most [`SHOWN_FIELDS`] of them, each cut as [`echo`] cuts.
pub fn field_list(names: &[&str]) -> String {
    let mut shown: Vec<String> = names
        .iter()
        .take(SHOWN_FIELDS)
        .map(|n| format!("`{}`", echo(n)))
        .collect();
    if names.len() > SHOWN_FIELDS {
        shown.push(format!("and {} more", names.len() - SHOWN_FIELDS));
    }
    shown.join(", ")
}

/// Chat-only fields of vLLM's API that change the prompt or the answer; the chat template is the model's own
/// (`tokenizer_config.json`), so a request's template is refused rather than ignored.
const UNSUPPORTED_CHAT: &[(&str, &str, Accepts)] = &[
    (
        "chat_template",
        "chat_template (the model's own template is used)",
        is_empty,
    ),
    ("echo", "echo on chat completions", is_false),
    ("continue_final_message", "continue_final_message", is_false),
    ("add_generation_prompt", "add_generation_prompt other than true", |v| {
        v == &Value::Bool(true)
    }),
];

/// Refuses, with a 400 naming the field, every field whose value asks for something this server does not do; their
/// defaults (`n: 1`, `logprobs: null`, `presence_penalty: 0`, ...) are accepted, since clients send them unasked.
fn refuse_unsupported(f: &Fields, endpoint: Endpoint) -> Result<(), ApiError> {
    // `null` is absent and always fine (Fields::get).
    let (common, own): (&Refusals, &Refusals) = match endpoint {
        Endpoint::Chat => (UNSUPPORTED, UNSUPPORTED_CHAT),
        Endpoint::Completions => (UNSUPPORTED, UNSUPPORTED_COMPLETIONS),
        Endpoint::Tokenize => (UNSUPPORTED_TOKENIZE, &[]),
        Endpoint::Detokenize => (&[], &[]),
    };
    for (name, what, accepts) in common.iter().chain(own) {
        if let Some(v) = f.get(name) {
            if !accepts(v) {
                return Err(ApiError::unsupported(name, what));
            }
        }
    }
    Ok(())
}

/// The template variables the server sets itself: a request's `chat_template_kwargs` may not replace them.
const RESERVED_TEMPLATE_VARS: &[&str] = &[
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// `chat_template_kwargs`: an object of extra variables for the chat template (e.g. `{"enable_thinking": false}`);
/// empty when absent. A non-object, or a key the server sets itself, is a 400 naming it.
pub fn template_kwargs(f: &Fields) -> Result<Map<String, Value>, ApiError> {
    const NAME: &str = "chat_template_kwargs";
    let kwargs = match f.get(NAME) {
        None => return Ok(Map::new()),
        Some(Value::Object(m)) => m,
        Some(v) => return Err(wrong_type(NAME, "an object", v)),
    };
    if let Some(k) = kwargs.keys().find(|k| RESERVED_TEMPLATE_VARS.contains(&k.as_str())) {
        return Err(ApiError::invalid(
            format!("{NAME}.{k}"),
            format!(
                "{NAME}.{} cannot be set: the server passes `{}` to the template itself",
                echo(k),
                echo(k)
            ),
        ));
    }
    Ok(kwargs.clone())
}

/// Whether to stream, and whether a stream ends with a usage chunk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Streaming {
    pub stream: bool,
    pub include_usage: bool,
}

/// `stream` and `stream_options.include_usage`.
fn streaming(f: &Fields) -> Result<Streaming, ApiError> {
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(_) if !stream => {
            return Err(ApiError::invalid(
                "stream_options",
                "stream_options is only allowed when stream is true",
            ))
        }
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(wrong_type("stream_options.include_usage", "a boolean", v)),
        },
        Some(v) => return Err(wrong_type("stream_options", "an object", v)),
    };
    Ok(Streaming { stream, include_usage })
}

/// The sampling parameters a body asks for, from the server's defaults; `max_tokens` is left to
/// [`resolve_max_tokens`], which needs the prompt's length. Ranges are checked by `SamplingParams::validate`, whose
/// messages name the field.
pub fn sampling(f: &Fields, state: &ServeState) -> Result<SamplingParams, ApiError> {
    let mut p = state.sampling_defaults();
    p.max_tokens = None;
    if let Some(t) = f.f32("temperature")? {
        p.temperature = t;
    }
    if let Some(v) = f.f32("top_p")? {
        p.top_p = v;
    }
    if let Some(k) = f.int("top_k")? {
        // vLLM's convention: -1 (or 0) turns the filter off.
        p.top_k = match k {
            -1 => 0,
            k => usize::try_from(k)
                .map_err(|_| ApiError::invalid("top_k", format!("top_k must be -1 (off) or >= 0, got {k}")))?,
        };
    }
    if let Some(v) = f.f32("min_p")? {
        p.min_p = v;
    }
    if let Some(v) = f.f32("repetition_penalty")? {
        p.repetition_penalty = v;
    }
    if let Some(s) = f.int("seed")? {
        // OpenAI seeds are signed 64-bit; any integer names one reproducible stream.
        p.seed = Some(
            u64::try_from(s)
                .or_else(|_| i64::try_from(s).map(|s| s as u64))
                .map_err(|_| ApiError::invalid("seed", format!("seed must fit in 64 bits, got {s}")))?,
        );
    }
    if let Some(v) = f.f32("presence_penalty")? {
        p.presence_penalty = v;
    }
    if let Some(v) = f.f32("frequency_penalty")? {
        p.frequency_penalty = v;
    }
    if let Some(n) = f.count("min_tokens")? {
        p.min_tokens = n;
    }
    p.stop_strings = f.stop()?;
    if let Some(b) = f.bool("include_stop_str_in_output")? {
        p.include_stop_str_in_output = b;
    }
    let vocab = state.engine.info().vocab;
    p.logit_bias = f.logit_bias(vocab)?;
    p.stop_token_ids = f.token_ids("stop_token_ids", vocab)?.unwrap_or_default();
    p.ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    p.validate(vocab).map_err(|e| {
        let message = match e {
            rewind_engine::EngineError::InvalidInput(m) => m,
            e => e.to_string(),
        };
        ApiError::from_failure(rewind_actors::FailureKind::InvalidArgument, message)
    })?;
    Ok(p)
}

/// `n`, the choices to generate: 1 to `max` (the engine's sequence slots, `--max-seqs`), default 1. `best_of` (the
/// server would rank more candidates than it returns) is accepted only when it asks for nothing more: absent, 1 or
/// `n`.
pub fn choices(f: &Fields, max: usize) -> Result<usize, ApiError> {
    let n = f.count("n")?.unwrap_or(1);
    if n == 0 || n > max {
        return Err(ApiError::invalid(
            "n",
            format!("n must be between 1 and {max} (the sequences this server runs at once, --max-seqs), got {n}"),
        ));
    }
    match f.count("best_of")? {
        None => Ok(n),
        Some(b) if b == 1 || b == n => Ok(n),
        Some(b) => Err(ApiError::unsupported(
            "best_of",
            &format!("best_of {b} (ranking more candidates than the n = {n} returned)"),
        )),
    }
}

/// The tokens to generate for a prompt of `prompt_len` tokens (named `prompt_param` in errors): the request's
/// `max_tokens` (`requested`, with the field it came from) if it fits the context and the server's limit, else the
/// server's default cut to what the context leaves, raised to `min_tokens` where the context has room. A
/// `min_tokens` above the result is refused, naming it.
pub fn resolve_max_tokens(
    state: &ServeState,
    prompt_len: usize,
    prompt_param: &str,
    requested: Option<(usize, &str)>,
    min_tokens: usize,
) -> Result<usize, ApiError> {
    let mut m = max_tokens_for(state, prompt_len, prompt_param, requested)?;
    if requested.is_none() {
        let room = state.engine.info().max_context - prompt_len;
        m = m.max(min_tokens.min(room));
    }
    if min_tokens > m {
        return Err(ApiError::invalid(
            "min_tokens",
            format!("min_tokens must be at most max_tokens ({m}), got {min_tokens}"),
        ));
    }
    Ok(m)
}

fn max_tokens_for(
    state: &ServeState,
    prompt_len: usize,
    prompt_param: &str,
    requested: Option<(usize, &str)>,
) -> Result<usize, ApiError> {
    let context = state.engine.info().max_context;
    if prompt_len == 0 {
        return Err(ApiError::invalid(prompt_param, format!("{prompt_param} is empty")));
    }
    if prompt_len >= context {
        return Err(ApiError::invalid(
            prompt_param,
            format!(
                "This model's maximum context length is {context} tokens, and the {prompt_param} has {prompt_len} \
                 tokens, which leaves no room to generate."
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = context - prompt_len;
    let Some((m, name)) = requested else {
        return Ok(state.default_max_tokens.min(room));
    };
    if m == 0 {
        return Err(ApiError::invalid(name, format!("{name} must be at least 1, got 0")));
    }
    if m > state.max_tokens_limit {
        return Err(ApiError::invalid(
            name,
            format!("{name} must be at most {}, got {m}", state.max_tokens_limit),
        ));
    }
    if m > room {
        return Err(ApiError::invalid(
            name,
            format!(
                "This model's maximum context length is {context} tokens; the {prompt_param} has {prompt_len} tokens \
                 and {name} asks for {m} more (at most {room} fit)."
            ),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(s: &str) -> Fields {
        Fields::parse(s.as_bytes()).expect("an object")
    }

    #[test]
    fn bodies_must_be_json_objects() {
        assert!(Fields::parse(b"").is_err());
        assert!(Fields::parse(b"{").expect_err("bad").message.contains("not valid JSON"));
        assert!(Fields::parse(b"[1]").expect_err("array").message.contains("an array"));
        assert!(Fields::parse(b"{\"temperature\": NaN}").is_err(), "NaN is not JSON");
    }

    #[test]
    fn wrong_types_name_the_field() {
        let f = fields(r#"{"temperature": "hot", "max_tokens": -3, "stream": 1, "seed": 1.5, "model": 7}"#);
        let e = f.f32("temperature").expect_err("string");
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert!(
            e.message.contains("temperature must be a number, got a string"),
            "{}",
            e.message
        );
        let e = f.count("max_tokens").expect_err("negative");
        assert!(e.message.contains("max_tokens must be a non-negative integer, got -3"));
        assert_eq!(f.bool("stream").expect_err("number").param.as_deref(), Some("stream"));
        assert!(f
            .int("seed")
            .expect_err("float")
            .message
            .contains("seed must be an integer"));
        // Past 64 bits or past f32: too large, named as sent (not "no integer", not "inf").
        let big = fields(r#"{"max_tokens": 1e20, "temperature": 1e40, "n": 100000000000000000000000}"#);
        let e = big.int("max_tokens").expect_err("1e20");
        assert!(
            e.message.contains("max_tokens is out of range, got 1e"),
            "{}",
            e.message
        );
        let e = big.f32("temperature").expect_err("1e40");
        assert!(
            e.message.contains("temperature is out of range, got 1e"),
            "{}",
            e.message
        );
        assert!(big.int("n").expect_err("1e23").message.contains("out of range"));
        assert_eq!(f.str("model").expect_err("number").param.as_deref(), Some("model"));
    }

    #[test]
    fn null_is_absent() {
        let f = fields(r#"{"temperature": null, "stop": null, "n": null}"#);
        assert_eq!(f.f32("temperature").expect("ok"), None);
        assert_eq!(f.stop().expect("ok"), Vec::<String>::new());
        assert!(refuse_unsupported(&f, Endpoint::Chat).is_ok());
    }

    #[test]
    fn stop_is_a_string_or_strings() {
        assert_eq!(fields(r#"{"stop": "x"}"#).stop().expect("ok"), vec!["x"]);
        assert_eq!(fields(r#"{"stop": ["a", "b"]}"#).stop().expect("ok"), vec!["a", "b"]);
        let e = fields(r#"{"stop": ["a", 3]}"#).stop().expect_err("number");
        assert_eq!(e.param.as_deref(), Some("stop[1]"));
        assert!(fields(r#"{"stop": [""]}"#).stop().is_err());
        assert!(fields(r#"{"stop": 5}"#).stop().is_err());
    }

    #[test]
    fn token_ids_are_checked_against_the_vocabulary() {
        assert_eq!(
            token_ids("prompt", &serde_json::json!([1, 2]), 10).expect("ok"),
            vec![1, 2]
        );
        let e = token_ids("prompt", &serde_json::json!([1, 10]), 10).expect_err("out of range");
        assert!(
            e.message.contains("prompt[1]: token id 10 is out of range"),
            "{}",
            e.message
        );
        assert!(token_ids("prompt", &serde_json::json!([-1]), 10).is_err());
        assert!(token_ids("prompt", &serde_json::json!("x"), 10).is_err());
    }

    #[test]
    fn unsupported_values_are_refused_and_defaults_pass() {
        let ok = fields(r#"{"n": 1, "top_logprobs": 0, "logprobs": false, "tools": []}"#);
        assert!(refuse_unsupported(&ok, Endpoint::Chat).is_ok());
        // Sampling fields this server applies are no longer refused, whatever their value.
        let sampling =
            fields(r#"{"presence_penalty": 1, "frequency_penalty": 0.5, "logit_bias": {"3": 5}, "min_tokens": 2}"#);
        assert!(refuse_unsupported(&sampling, Endpoint::Chat).is_ok());
        for (body, param) in [
            (r#"{"chat_template": "{{ messages }}"}"#, "chat_template"),
            (r#"{"echo": true}"#, "echo"),
            (r#"{"add_generation_prompt": false}"#, "add_generation_prompt"),
        ] {
            let e = refuse_unsupported(&fields(body), Endpoint::Chat).expect_err(body);
            assert_eq!(e.param.as_deref(), Some(param));
            assert!(e.message.contains("not supported"));
        }
        // The chat-only fields keep their defaults' meaning, and completions' echo is done, not refused.
        let defaults = fields(r#"{"echo": false, "add_generation_prompt": true, "chat_template": null}"#);
        assert!(refuse_unsupported(&defaults, Endpoint::Chat).is_ok());
        assert!(refuse_unsupported(&fields(r#"{"echo": true}"#), Endpoint::Completions).is_ok());
        // Log-probabilities are computed (`logprobs.rs` checks their values).
        for body in [
            r#"{"logprobs": 0, "prompt_logprobs": 1}"#,
            r#"{"logprobs": true, "top_logprobs": 2}"#,
        ] {
            assert!(
                refuse_unsupported(&fields(body), Endpoint::Completions).is_ok(),
                "{body}"
            );
            assert!(refuse_unsupported(&fields(body), Endpoint::Chat).is_ok(), "{body}");
        }
    }

    #[test]
    fn n_is_bounded_by_the_sequences_and_best_of_asks_for_no_more() {
        assert_eq!(choices(&fields("{}"), 4), Ok(1));
        assert_eq!(choices(&fields(r#"{"n": 4, "best_of": 4}"#), 4), Ok(4));
        assert_eq!(choices(&fields(r#"{"n": 3, "best_of": 1}"#), 4), Ok(3));
        assert_eq!(choices(&fields(r#"{"n": null}"#), 4), Ok(1));
        for (body, param, want) in [
            (r#"{"n": 0}"#, "n", "between 1 and 4"),
            (r#"{"n": 5}"#, "n", "got 5"),
            (r#"{"n": -1}"#, "n", "non-negative"),
            (r#"{"n": 2, "best_of": 3}"#, "best_of", "best_of 3"),
        ] {
            let e = choices(&fields(body), 4).expect_err(body);
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
            assert!(e.message.contains(want), "{body}: {}", e.message);
            assert_eq!(e.status.as_u16(), 400);
        }
    }

    #[test]
    fn unknown_fields_are_told_from_known_and_refused_ones() {
        let f = fields(r#"{"model": "m", "prompt": "x", "frobnicate": true, "n": 1, "messages": [], "zz": 0}"#);
        assert_eq!(
            unknown_fields(&f, Endpoint::Completions),
            vec!["frobnicate", "messages", "zz"]
        );
        let mut chat_unknown = unknown_fields(&f, Endpoint::Chat);
        chat_unknown.sort_unstable();
        assert_eq!(chat_unknown, vec!["frobnicate", "prompt", "zz"]);
        let chat = fields(r#"{"messages": [], "chat_template": null, "max_completion_tokens": 3}"#);
        assert!(unknown_fields(&chat, Endpoint::Chat).is_empty());
        let long = "x".repeat(100);
        let many: Vec<&str> = std::iter::repeat_n(long.as_str(), 10).collect();
        let list = field_list(&many);
        assert!(list.ends_with("and 2 more"), "{list}");
        assert!(list.len() < 8 * 70 + 20, "{list}");
    }

    #[test]
    fn template_kwargs_are_an_object_without_reserved_names() {
        assert!(template_kwargs(&fields("{}")).expect("absent").is_empty());
        let k = template_kwargs(&fields(r#"{"chat_template_kwargs": {"enable_thinking": false}}"#)).expect("object");
        assert_eq!(k.get("enable_thinking"), Some(&Value::Bool(false)));
        let e = template_kwargs(&fields(r#"{"chat_template_kwargs": "x"}"#)).expect_err("string");
        assert_eq!(e.param.as_deref(), Some("chat_template_kwargs"));
        assert!(e.message.contains("must be an object, got a string"), "{}", e.message);
        let e = template_kwargs(&fields(r#"{"chat_template_kwargs": {"messages": []}}"#)).expect_err("reserved");
        assert_eq!(e.param.as_deref(), Some("chat_template_kwargs.messages"));
        let f = fields(r#"{"prompt": "x", "add_special_tokens": true, "stream": true, "tokens": [1]}"#);
        assert_eq!(unknown_fields(&f, Endpoint::Tokenize), vec!["stream", "tokens"]);
        assert_eq!(
            unknown_fields(&f, Endpoint::Detokenize),
            vec!["prompt", "add_special_tokens", "stream"]
        );
    }

    #[test]
    fn stream_options_need_a_stream() {
        let s = streaming(&fields(
            r#"{"stream": true, "stream_options": {"include_usage": true}}"#,
        ))
        .expect("ok");
        assert!(s.stream && s.include_usage);
        let e = streaming(&fields(r#"{"stream_options": {"include_usage": true}}"#)).expect_err("no stream");
        assert_eq!(e.param.as_deref(), Some("stream_options"));
        assert!(streaming(&fields(r#"{"stream": true, "stream_options": {"include_usage": 1}}"#)).is_err());
    }
}
