//! The RPCs that let a client chat without a local copy of the model: GetModelInfo (the tokenizer's metadata and
//! the chat template) and RenderChat (a session's next turn, rendered and tokenized by the served model, with the
//! request's tools and the conversation's tool calls and results).

use rewind_engine::tokenizer::ChatMessage;
use rewind_engine::tools::{parse_message_tool_calls, parse_tools, ToolsError};
use tonic::Status;

use super::params::utf8;
use super::pb;
use super::status::invalid;
use crate::serve::{ServeState, CHAT_ROLES};

/// A field holding JSON text, parsed.
fn json_field(name: &str, text: &str) -> Result<serde_json::Value, Status> {
    serde_json::from_str(text).map_err(|e| invalid(name, format!("{name} is not valid JSON: {e}")))
}

/// A bad tool or tool call, naming the field (as the HTTP API names it).
fn tools_invalid(e: ToolsError) -> Status {
    invalid(&e.field, e.message)
}

fn special(text: &str, id: Option<u32>) -> Option<pb::SpecialToken> {
    id.map(|id| pb::SpecialToken {
        text: text.to_string(),
        id,
    })
}

/// GetModelInfo: what a client needs to render and read a conversation as the server does.
pub fn model_info(state: &ServeState) -> pb::ModelInfo {
    let tok = &state.model.tokenizer;
    let s = tok.special_tokens();
    let named = |t: &Option<(String, Option<u32>)>| t.as_ref().and_then(|(text, id)| special(text, *id));
    let mut special_tokens: Vec<pb::SpecialToken> = tok
        .special_token_strings()
        .iter()
        .filter_map(|t| special(t, tok.token_to_id(t)))
        .collect();
    special_tokens.sort_by_key(|t| t.id);
    pb::ModelInfo {
        model: state.model_name.clone(),
        architecture: state.model.config.model_type.clone(),
        vocab_size: state.engine.info().vocab as u64,
        max_context: state.engine.info().max_context as u64,
        eos_token_ids: state.model.eos_token_ids.clone(),
        bos_token: named(&s.bos),
        eos_token: named(&s.eos),
        special_tokens,
        chat_template: tok.chat_template().map(|t| t.source().to_string()).unwrap_or_default(),
    }
}

/// RenderChat: the tokens a session holding `held` lacks for the conversation's next reply.
pub fn render_chat(state: &ServeState, req: &pb::RenderChatRequest) -> Result<pb::RenderChatResponse, Status> {
    let held = utf8("held", &req.held)?;
    let held_eos = utf8("held_eos", &req.held_eos)?;
    let bytes = req.held.len()
        + req.tools_json.len()
        + req
            .messages
            .iter()
            .map(|m| m.content.len() + m.tool_calls_json.len())
            .sum::<usize>();
    state
        .check_text_len("conversation", bytes)
        .map_err(|e| invalid("messages", e))?;
    let messages = req
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            if !CHAT_ROLES.contains(&m.role.as_str()) {
                return Err(invalid(
                    &format!("messages[{i}].role"),
                    format!("{:?} is not a chat role (one of {})", m.role, CHAT_ROLES.join(", ")),
                ));
            }
            let mut message = ChatMessage::new(m.role.clone(), utf8(&format!("messages[{i}].content"), &m.content)?);
            if !m.tool_calls_json.is_empty() {
                let at = format!("messages[{i}]");
                let calls = json_field(&format!("{at}.tool_calls_json"), &m.tool_calls_json)?;
                message.tool_calls = Some(parse_message_tool_calls(&calls, &at).map_err(tools_invalid)?);
            }
            if !m.tool_call_id.is_empty() {
                message.tool_call_id = Some(m.tool_call_id.clone());
            }
            Ok(message)
        })
        .collect::<Result<Vec<_>, Status>>()?;
    let mut vars = serde_json::Map::new();
    if !req.tools_json.is_empty() {
        let tools = json_field("tools_json", &req.tools_json)?;
        if !parse_tools(&tools).map_err(tools_invalid)?.is_empty() {
            vars.insert("tools".into(), tools);
        }
    }
    let turn = state
        .model
        .tokenizer
        .turn_delta_with(&messages, &held, Some(&held_eos), &vars)
        .map_err(|e| invalid("messages", e.to_string()))?;
    Ok(pb::RenderChatResponse {
        rendered: turn.rendered,
        delta: turn.delta,
        token_ids: turn.token_ids,
        exact: turn.exact,
    })
}
