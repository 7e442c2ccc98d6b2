//! What a request asks for, checked: sampling settings merged over their defaults (the model's, or a session's) and
//! the input as token ids. Every error is INVALID_ARGUMENT and names the field.

use std::sync::Arc;

use rewind_engine::sample::SamplingParams;
use tonic::Status;

use super::pb;
use super::status::{engine, invalid};
use crate::serve::ServeState;

/// `base` with `overrides`' set fields applied, then checked as a whole (ranges, stop ids below the vocabulary,
/// `max_tokens` within the server's limit).
pub fn merge(
    state: &ServeState,
    base: &SamplingParams,
    overrides: Option<&pb::Sampling>,
) -> Result<SamplingParams, Status> {
    let mut p = base.clone();
    if let Some(s) = overrides {
        if let Some(v) = s.temperature {
            p.temperature = v;
        }
        if let Some(v) = s.top_p {
            p.top_p = v;
        }
        if let Some(v) = s.top_k {
            p.top_k = usize::try_from(v).map_err(|_| invalid("top_k", format!("must be >= 0 (0 is off), got {v}")))?;
        }
        if let Some(v) = s.min_p {
            p.min_p = v;
        }
        if let Some(v) = s.repetition_penalty {
            p.repetition_penalty = v;
        }
        if let Some(v) = s.seed {
            p.seed = Some(v);
        }
        if let Some(v) = s.ignore_eos {
            p.ignore_eos = v;
        }
        if let Some(v) = s.max_tokens {
            // Above usize (or below 1) is out of range either way; the limit check below reports it.
            p.max_tokens =
                Some(usize::try_from(v).map_err(|_| invalid("max_tokens", format!("must be at least 1, got {v}")))?);
        }
        if !s.stop.is_empty() {
            p.stop_strings = s
                .stop
                .iter()
                .enumerate()
                .map(|(i, b)| utf8(&format!("stop[{i}]"), b))
                .collect::<Result<_, _>>()?;
        }
        if !s.stop_token_ids.is_empty() {
            p.stop_token_ids = s.stop_token_ids.clone();
        }
        if let Some(v) = s.presence_penalty {
            p.presence_penalty = v;
        }
        if let Some(v) = s.frequency_penalty {
            p.frequency_penalty = v;
        }
        if !s.logit_bias.is_empty() {
            p.logit_bias = s.logit_bias.iter().map(|(&id, &b)| (id, b)).collect();
        }
        if let Some(v) = s.min_tokens {
            p.min_tokens = usize::try_from(v).map_err(|_| invalid("min_tokens", format!("{v} is out of range")))?;
        }
        if let Some(v) = s.include_stop_str_in_output {
            p.include_stop_str_in_output = v;
        }
    }
    if let Some(m) = p.max_tokens {
        if m == 0 {
            return Err(invalid("max_tokens", "must be at least 1, got 0"));
        }
        if m > state.max_tokens_limit {
            return Err(invalid(
                "max_tokens",
                format!("{m} exceeds this server's limit of {}", state.max_tokens_limit),
            ));
        }
    }
    // The engine's own check: its messages start with the field's name ("temperature must be ...").
    p.validate(state.engine.info().vocab).map_err(|e| engine(&e))?;
    Ok(p)
}

/// What a request's (or a new session's) settings are merged over: the model's defaults, with `max_tokens` left unset
/// so that [`default_max_tokens`] can tell the server's default from a value the client chose.
pub fn base(state: &ServeState) -> SamplingParams {
    let mut p = state.sampling_defaults();
    p.max_tokens = None;
    p
}

/// Sets the server's default `max_tokens` where neither the request nor its session chose one, raised to `min_tokens`
/// and capped to what the context leaves after `used` tokens: a long prompt gets what fits, as over HTTP, instead of a refusal for a limit
/// the client never asked for. Nothing fits: left unset, and the engine's refusal names the prompt.
pub fn default_max_tokens(state: &ServeState, p: &mut SamplingParams, used: usize) {
    if p.max_tokens.is_none() {
        let room = state.engine.info().max_context.saturating_sub(used);
        p.max_tokens = (room > 0).then(|| state.default_max_tokens.max(p.min_tokens).min(room));
    }
}

/// `bytes` as UTF-8 text, or INVALID_ARGUMENT naming `field` and where the bad byte is.
pub fn utf8(field: &str, bytes: &[u8]) -> Result<String, Status> {
    String::from_utf8(bytes.to_vec()).map_err(|e| invalid(field, format!("is not valid UTF-8 ({})", e.utf8_error())))
}

/// A request's input as token ids: text is encoded on the blocking pool (with the tokenizer's special tokens when
/// `add_special`), ids are checked against the vocabulary; either is refused when longer than the context holds.
pub async fn input_ids<I: Into<Input>>(
    state: &Arc<ServeState>,
    input: Option<I>,
    add_special: bool,
) -> Result<Vec<u32>, Status> {
    match input.map(Into::into) {
        None => Err(invalid("input", "set `text` or `token_ids`")),
        Some(Input::Text(bytes)) => {
            super::blocking::check_text(state, "text", bytes.len())?;
            super::blocking::run(state, move |s| {
                let text = utf8("text", &bytes)?;
                s.model
                    .tokenizer
                    .encode(&text, add_special)
                    .map_err(|e| invalid("text", format!("cannot be tokenized: {e}")))
            })
            .await
        }
        Some(Input::Ids(ids)) => {
            super::blocking::check_id_count(state, "token_ids", ids.len())?;
            check_ids(state, "token_ids", &ids)?;
            Ok(ids)
        }
    }
}

/// INVALID_ARGUMENT when an id in `ids` is outside the model's vocabulary.
pub fn check_ids(state: &ServeState, field: &str, ids: &[u32]) -> Result<(), Status> {
    let vocab = state.engine.info().vocab;
    match ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        Some((i, t)) => Err(invalid(
            &format!("{field}[{i}]"),
            format!("token id {t} is out of range (vocab size {vocab})"),
        )),
        None => Ok(()),
    }
}

/// The input of a Generate or a Complete request.
pub enum Input {
    Text(Vec<u8>),
    Ids(Vec<u32>),
}

impl From<pb::generate_request::Input> for Input {
    fn from(i: pb::generate_request::Input) -> Self {
        match i {
            pb::generate_request::Input::Text(t) => Input::Text(t),
            pb::generate_request::Input::TokenIds(t) => Input::Ids(t.ids),
        }
    }
}

impl From<pb::complete_request::Input> for Input {
    fn from(i: pb::complete_request::Input) -> Self {
        match i {
            pb::complete_request::Input::Text(t) => Input::Text(t),
            pb::complete_request::Input::TokenIds(t) => Input::Ids(t.ids),
        }
    }
}

/// Sampling settings as the API reports them.
pub fn resolved(p: &SamplingParams) -> pb::ResolvedSampling {
    pb::ResolvedSampling {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k as u64,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        seed: p.seed,
        ignore_eos: p.ignore_eos,
        max_tokens: p.max_tokens.map(|m| m as u64),
        stop: p.stop_strings.clone(),
        stop_token_ids: p.stop_token_ids.clone(),
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        logit_bias: p.logit_bias.iter().map(|(&id, &b)| (id, b)).collect(),
        min_tokens: p.min_tokens as u64,
        include_stop_str_in_output: p.include_stop_str_in_output,
    }
}
