//! The routes that generate nothing: `/v1/models` (and `/v1/models/{id}`), `/health`, `/metrics`; and the 404 of every other path and the 405
//! of a wrong method.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::errors::ApiError;
use super::generation::unix_now;
use super::Api;

/// The model object of the served model (an entry of `/v1/models`, and `/v1/models/{id}`).
fn model_object(api: &Api) -> Value {
    let s = &api.state;
    let created = unix_now().saturating_sub(s.started.elapsed().as_secs());
    json!({
        "id": s.model_name,
        "object": "model",
        "created": created,
        "owned_by": "rewind",
        "root": s.model_name,
        "parent": null,
        "max_model_len": s.engine.info().max_context,
    })
}

/// `GET /v1/models`: the one served model.
pub async fn models(State(api): State<Arc<Api>>) -> Response {
    Json(json!({"object": "list", "data": [model_object(&api)]})).into_response()
}

/// `GET /v1/models/{id}` (the SDKs' `models.retrieve`): the served model's object, or a 404 for any other id. The id
/// is the rest of the path, since model names may hold slashes (`org/name`).
pub async fn model(State(api): State<Arc<Api>>, Path(id): Path<String>) -> Response {
    if id != api.state.model_name {
        return ApiError::model_not_found(&id, &api.state.model_name).into_response();
    }
    Json(model_object(&api)).into_response()
}

/// `GET /health`: 200 with every rank's health and the scheduler's counts; 503 while draining or when the engine
/// cannot answer (its ranks failed beyond recovery, or it stopped).
pub async fn health(State(api): State<Arc<Api>>) -> Response {
    let s = &api.state;
    if s.draining() {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "draining"}))).into_response();
    }
    match s.engine.health().await {
        Ok(h) => {
            let mut body = json!({
                "status": "ok",
                "model": s.model_name,
                "uptime_seconds": s.started.elapsed().as_secs_f64(),
                "engine": h,
            });
            if let Some(r) = s.engine.worker_restarts() {
                body["worker_restarts"] = json!(r);
            }
            Json(body).into_response()
        }
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "error", "error": e.to_string()})),
        )
            .into_response(),
    }
}

/// `GET /metrics`: the engine's metrics, the HTTP API's and both servers' connections, in Prometheus' text format.
pub async fn metrics(State(api): State<Arc<Api>>) -> Response {
    let mut text = api.state.engine.metrics().prometheus();
    text.push_str(&api.metrics.prometheus());
    text.push_str(&api.state.connections.prometheus());
    if let Some(restarts) = api.state.engine.worker_restarts() {
        text.push_str(
            "# HELP rewind_rank_worker_restarts Restarts of each rank's worker process (--rank-processes).\n\
             # TYPE rewind_rank_worker_restarts counter\n",
        );
        for (rank, n) in restarts.iter().enumerate() {
            text.push_str(&format!("rewind_rank_worker_restarts{{rank=\"{rank}\"}} {n}\n"));
        }
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        text,
    )
        .into_response()
}

/// Any other path: an OpenAI-shaped 404.
pub async fn no_route(uri: Uri) -> ApiError {
    ApiError::no_route(uri.path())
}

/// A route called with a method it does not take: an OpenAI-shaped 405.
pub async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        code: Some("method_not_allowed"),
        ..ApiError::bad_request(format!("{} does not take {method}.", uri.path()))
    }
}
