//! The session RPCs: create, fork, close, inspect, and Generate — one turn, whose input holds only the new tokens
//! (the engine continues the session's state rather than prefilling the earlier turns again). Each names its caller's
//! owner (the API key's, see `auth.rs`): another key's sessions answer exactly as ids never used.

use std::sync::Arc;

use rewind_actors::{GenerateRequest, SessionInfo, SessionOptions, SessionOwner};
use tonic::Status;

use super::params::{base, default_max_tokens, input_ids, merge, resolved};
use super::status::{actors, draining, invalid};
use super::stream::{respond, ChunkStream};
use super::{logprob_options, pb};
use crate::serve::ServeState;

/// A session as the API reports it.
fn info(s: SessionInfo) -> pb::SessionInfo {
    pb::SessionInfo {
        id: s.id,
        tokens: s.tokens as u64,
        turns: s.turns,
        busy: s.busy,
        idle_seconds: s.idle_seconds,
        defaults: Some(resolved(&s.defaults)),
        speculate: s.speculate,
        forked_from: s.forked_from,
    }
}

/// INVALID_ARGUMENT for an empty id (rather than NOT_FOUND for a session named "") or one longer than any session's.
fn require_id(id: &str) -> Result<(), Status> {
    if id.is_empty() {
        return Err(invalid("session_id", "is required"));
    }
    // Not echoed: an id of any size would otherwise come back in the error, and a status message over the peer's
    // header limit turns the answer into RESOURCE_EXHAUSTED.
    if id.len() > MAX_SESSION_ID_BYTES {
        return Err(invalid(
            "session_id",
            format!(
                "is {} bytes long; session ids are at most {MAX_SESSION_ID_BYTES} bytes",
                id.len()
            ),
        ));
    }
    Ok(())
}

/// The longest session id a request may name (the server's own are far shorter).
const MAX_SESSION_ID_BYTES: usize = 128;

/// CreateSession: the model's defaults with the request's overrides become the session's.
pub async fn create(
    state: &Arc<ServeState>,
    owner: SessionOwner,
    r: &pb::CreateSessionRequest,
) -> Result<pb::SessionInfo, Status> {
    if state.draining() {
        return Err(draining());
    }
    // A session's max_tokens stays unset unless chosen: each turn then gets the server's default, capped to the room
    // its context leaves.
    let mut defaults = merge(state, &base(state), r.defaults.as_ref())?;
    super::structured::constrain(state, r.defaults.as_ref(), &mut defaults).await?;
    let options = SessionOptions {
        defaults,
        speculate: r.speculate.unwrap_or(true),
    };
    let s = state
        .engine
        .create_session(owner, options)
        .await
        .map_err(|e| actors(&e))?;
    tracing::info!(session = %s.id, "session created");
    Ok(info(s))
}

/// ForkSession: a new session sharing `id`'s state (copied only when one of them runs a turn).
pub async fn fork(state: &ServeState, owner: SessionOwner, id: &str) -> Result<pb::SessionInfo, Status> {
    if state.draining() {
        return Err(draining());
    }
    require_id(id)?;
    let s = state.engine.fork_session(owner, id).await.map_err(|e| actors(&e))?;
    tracing::info!(session = %s.id, from = id, "session forked");
    Ok(info(s))
}

/// CloseSession. Allowed while draining: it frees memory.
pub async fn close(state: &ServeState, owner: SessionOwner, id: &str) -> Result<(), Status> {
    require_id(id)?;
    state.engine.close_session(owner, id).await.map_err(|e| actors(&e))
}

/// GetSession.
pub async fn get(state: &ServeState, owner: SessionOwner, id: &str) -> Result<pb::SessionInfo, Status> {
    require_id(id)?;
    state.engine.session(owner, id).await.map(info).map_err(|e| actors(&e))
}

/// ListSessions: the caller's sessions.
pub async fn list(state: &ServeState, owner: SessionOwner) -> Result<Vec<pb::SessionInfo>, Status> {
    let all = state.engine.list_sessions(owner).await.map_err(|e| actors(&e))?;
    Ok(all.into_iter().map(info).collect())
}

/// Generate: one turn of session `r.session_id`, sampled with the session's defaults and the request's overrides.
pub async fn generate(
    state: &Arc<ServeState>,
    owner: SessionOwner,
    r: pb::GenerateRequest,
    span: tracing::Span,
) -> Result<ChunkStream, Status> {
    if state.draining() {
        return Err(draining());
    }
    let logprobs = logprob_options(r.logprobs, r.top_logprobs)?;
    require_id(&r.session_id)?;
    // The session's defaults, and whether the turn starts its sequence (only then does text get BOS); a session that
    // is gone is NOT_FOUND here already.
    let s = state
        .engine
        .session(owner, &r.session_id)
        .await
        .map_err(|e| actors(&e))?;
    let mut params = merge(state, &s.defaults, r.sampling.as_ref())?;
    super::structured::constrain(state, r.sampling.as_ref(), &mut params).await?;
    let prompt = input_ids(state, r.input, s.tokens == 0).await?;
    default_max_tokens(state, &mut params, s.tokens + prompt.len());
    let mut request = GenerateRequest::new(prompt, params);
    request.session = Some(r.session_id);
    request.owner = owner;
    request.speculate = s.speculate;
    request.n = r.n.map_or(1, |n| n as usize);
    request.logprobs = logprobs;
    let events = state.engine.submit(request).map_err(|e| actors(&e))?;
    respond(events, state.cut_off_watch(), span).await
}
