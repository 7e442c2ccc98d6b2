//! The RPCs that let a client chat without a local copy of the model: GetModelInfo (the tokenizer's metadata and
//! the chat template) and RenderChat (a session's next turn, rendered and tokenized by the served model).

use rewind_engine::tokenizer::ChatMessage;
use tonic::Status;

use super::params::utf8;
use super::pb;
use super::status::invalid;
use crate::serve::{ServeState, CHAT_ROLES};

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
    let bytes = req.held.len() + req.messages.iter().map(|m| m.content.len()).sum::<usize>();
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
            Ok(ChatMessage::new(
                m.role.clone(),
                utf8(&format!("messages[{i}].content"), &m.content)?,
            ))
        })
        .collect::<Result<Vec<_>, Status>>()?;
    let turn = state
        .model
        .tokenizer
        .turn_delta(&messages, &held, Some(&held_eos))
        .map_err(|e| invalid("messages", e.to_string()))?;
    Ok(pb::RenderChatResponse {
        rendered: turn.rendered,
        delta: turn.delta,
        token_ids: turn.token_ids,
        exact: turn.exact,
    })
}
