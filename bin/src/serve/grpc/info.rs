//! The RPCs about the model and the engine rather than a generation: Tokenize, Detokenize, Health and Stats.

use std::time::Duration;

use rewind_actors::EngineHealth;
use tonic::Status;

use super::params::{check_ids, utf8};
use super::pb;
use super::status::invalid;
use crate::serve::ServeState;

/// How long Health and Stats wait for the coordinator, which answers between steps (and not while it restarts ranks
/// after a fault): longer means the engine counts as unavailable.
const HEALTH_WAIT: Duration = Duration::from_secs(10);

/// Tokenize: UTF-8 text to ids.
pub fn tokenize(state: &ServeState, req: &pb::TokenizeRequest) -> Result<pb::TokenizeResponse, Status> {
    let text = utf8("text", &req.text)?;
    let token_ids = state
        .model
        .tokenizer
        .encode(&text, req.add_special_tokens)
        .map_err(|e| invalid("text", format!("cannot be tokenized: {e}")))?;
    Ok(pb::TokenizeResponse { token_ids })
}

/// Detokenize: ids (each within the vocabulary) to text.
pub fn detokenize(state: &ServeState, req: &pb::DetokenizeRequest) -> Result<pb::DetokenizeResponse, Status> {
    check_ids(state, "token_ids", &req.token_ids)?;
    let text = state
        .model
        .tokenizer
        .decode(&req.token_ids, req.skip_special_tokens)
        .map_err(|e| Status::internal(format!("detokenizing: {e}")))?;
    Ok(pb::DetokenizeResponse { text })
}

/// The engine's health, or why it is unavailable.
async fn engine_health(state: &ServeState) -> Result<EngineHealth, String> {
    match tokio::time::timeout(HEALTH_WAIT, state.engine.health()).await {
        Ok(Ok(h)) => Ok(h),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "the engine did not answer within {} s (restarting its ranks after a fault?)",
            HEALTH_WAIT.as_secs()
        )),
    }
}

fn ranks(h: &EngineHealth) -> Vec<pb::RankStatus> {
    h.ranks
        .iter()
        .map(|r| pb::RankStatus {
            rank: r.rank as u64,
            device: r.device.clone(),
            slots_in_use: r.slots_in_use as u64,
            steps: r.steps,
        })
        .collect()
}

fn serving_status(state: &ServeState, health: &Result<EngineHealth, String>) -> pb::ServingStatus {
    match health {
        Err(_) => pb::ServingStatus::Unavailable,
        Ok(_) if state.draining() => pb::ServingStatus::Draining,
        Ok(_) => pb::ServingStatus::Serving,
    }
}

/// Health: every rank's state; an engine that does not answer is UNAVAILABLE in the response, not an error, so a
/// probe always learns why.
pub async fn health(state: &ServeState) -> pb::HealthResponse {
    let h = engine_health(state).await;
    let status = serving_status(state, &h);
    match h {
        Ok(h) => pb::HealthResponse {
            status: status as i32,
            message: String::new(),
            ranks: ranks(&h),
            generation: h.generation,
            model: state.model_name.clone(),
        },
        Err(why) => pb::HealthResponse {
            status: status as i32,
            message: why,
            ranks: Vec::new(),
            generation: 0,
            model: state.model_name.clone(),
        },
    }
}

/// Stats: the engine's counters and gauges.
pub async fn stats(state: &ServeState) -> pb::StatsResponse {
    let m = state.engine.metrics().snapshot();
    let info = state.engine.info();
    let h = engine_health(state).await;
    let status = serving_status(state, &h);
    // The coordinator's own counts when it answers; the gauges of its latest step otherwise.
    let (free_slots, waiting, running, ranks) = match &h {
        Ok(h) => (h.free_slots as u64, h.waiting as u64, h.running as u64, self::ranks(h)),
        Err(_) => (m.free_slots, m.queue_depth, m.running, Vec::new()),
    };
    let uptime = state.started.elapsed().as_secs_f64();
    pb::StatsResponse {
        model: state.model_name.clone(),
        tp: info.tp as u64,
        slots_total: info.slots as u64,
        slots_in_use: (info.slots as u64).saturating_sub(free_slots),
        queue_depth: waiting,
        running,
        prefill_tokens: m.prefill_tokens,
        generated_tokens: m.generated_tokens,
        requests_finished: m.requests_finished,
        requests_failed: m.requests_failed,
        requests_cancelled: m.requests_cancelled,
        uptime_seconds: uptime,
        generated_tokens_per_second: if uptime > 0.0 {
            m.generated_tokens as f64 / uptime
        } else {
            0.0
        },
        spec_drafted: m.spec_drafted,
        spec_accepted: m.spec_accepted,
        acceptance_rate: if m.spec_drafted > 0 {
            m.spec_accepted as f64 / m.spec_drafted as f64
        } else {
            0.0
        },
        sessions: m.sessions,
        sessions_evicted: m.sessions_evicted,
        session_state_bytes: m.session_state_bytes,
        recoveries: m.recoveries,
        status: status as i32,
        ranks,
        max_context: info.max_context as u64,
    }
}
