//! The OpenAI-compatible HTTP API over the shared engine ([`ServeState`]):
//!
//! - `POST /v1/completions`, `POST /v1/chat/completions` (streamed as server-sent events with `stream: true`),
//! - `GET /v1/models`, `GET /v1/models/{id}`,
//! - `POST /tokenize`, `POST /detokenize` (vLLM's),
//! - `GET /health` (open even with an API key: load balancers probe it), `GET /metrics` (Prometheus).
//!
//! Every `/v1/*` route, `/tokenize`, `/detokenize` and `/metrics` need `Authorization: Bearer K` when the server has a key; while the server
//! drains they answer 503. Errors have OpenAI's shape ([`errors::ApiError`]). [`router`] is all a server binds.

mod auth;
mod body;
mod chat;
mod chat_parse;
mod completions;
pub mod errors;
mod generation;
mod logprobs;
pub mod metrics;
pub mod openai;
mod ops;
mod sse;
mod structured;
mod tokenize;

use std::hash::{BuildHasher, RandomState};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use futures::StreamExt;
use tracing::Instrument;

pub use self::auth::AllowedHosts;
use self::metrics::HttpMetrics;
use super::ServeState;

/// What the handlers share: the engine's state and the HTTP metrics.
pub struct Api {
    pub state: Arc<ServeState>,
    pub metrics: Arc<HttpMetrics>,
    /// The `Host` names a server without an API key answers to (see [`auth`]).
    pub hosts: AllowedHosts,
    /// Large bodies parsed at once on the blocking pool (see [`body::parse`]).
    pub parses: tokio::sync::Semaphore,
}

/// Who a request is, set by the outermost middleware for the handlers: its id (also in `x-request-id` and the
/// response's `id`), the endpoint it matched (the metrics' label) and when it arrived.
#[derive(Clone, Debug)]
pub struct RequestContext {
    pub id: String,
    pub endpoint: &'static str,
    pub start: Instant,
}

const COMPLETIONS: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";
const MODELS: &str = "/v1/models";
const MODEL: &str = "/v1/models/{*id}";
const TOKENIZE: &str = "/tokenize";
const DETOKENIZE: &str = "/detokenize";
const HEALTH: &str = "/health";
const METRICS: &str = "/metrics";

/// The router label of a matched path (always one of the routes; `other` cannot happen but keeps labels bounded).
fn endpoint_label(path: Option<&MatchedPath>) -> &'static str {
    match path.map(MatchedPath::as_str) {
        Some(COMPLETIONS) => COMPLETIONS,
        Some(CHAT) => CHAT,
        Some(MODELS) => MODELS,
        Some(MODEL) => MODEL,
        Some(TOKENIZE) => TOKENIZE,
        Some(DETOKENIZE) => DETOKENIZE,
        Some(HEALTH) => HEALTH,
        Some(METRICS) => METRICS,
        _ => "other",
    }
}

/// The HTTP API over `state`'s engine, listening on `bound` from `--host host`: without an API key it answers only
/// requests whose `Host` names it (see [`AllowedHosts`]).
pub fn router(state: Arc<ServeState>, bound: SocketAddr, host: &str) -> Router {
    let body_limit = state.limits.max_request_bytes;
    // One parse per core: more would only add memory, not speed.
    let parses = std::thread::available_parallelism().map_or(1, usize::from);
    let api = Arc::new(Api {
        state,
        metrics: Arc::new(HttpMetrics::default()),
        hosts: AllowedHosts::new(bound, host),
        parses: tokio::sync::Semaphore::new(parses),
    });
    let guarded = Router::new()
        .route(COMPLETIONS, post(completions::handle))
        .route(CHAT, post(chat::handle))
        .route(MODELS, get(ops::models))
        .route(MODEL, get(ops::model))
        .route(TOKENIZE, post(tokenize::tokenize))
        .route(DETOKENIZE, post(tokenize::detokenize))
        .route(METRICS, get(ops::metrics))
        // Bodies are read after the key check: a client without the key cannot make the server buffer 16 MiB.
        .route_layer(middleware::from_fn_with_state(api.clone(), body::read_body))
        .route_layer(middleware::from_fn_with_state(api.clone(), auth::guard));
    Router::new()
        .route(HEALTH, get(ops::health))
        .merge(guarded)
        .route_layer(middleware::from_fn_with_state(api.clone(), observe))
        .fallback(ops::no_route)
        .method_not_allowed_fallback(ops::wrong_method)
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(api)
}

/// A request id: random (per process and call) and unique (a counter), in hex.
fn request_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    // RandomState is seeded from the OS once per thread and varied per instance: unpredictable enough for an id.
    let r = RandomState::new().hash_one(n);
    format!("{r:016x}{n:x}")
}

/// The outermost middleware of every route: the request's id and tracing span, and its metrics (counted by status
/// when its response starts; a stream's latency runs until its body ends).
async fn observe(State(api): State<Arc<Api>>, mut req: Request, next: Next) -> Response {
    let endpoint = endpoint_label(req.extensions().get::<MatchedPath>());
    let ctx = RequestContext {
        id: request_id(),
        endpoint,
        start: Instant::now(),
    };
    let span = tracing::info_span!(
        "http_request",
        endpoint,
        request_id = %ctx.id,
        method = %req.method(),
        engine_request = tracing::field::Empty,
    );
    let id = HeaderValue::from_str(&ctx.id).ok();
    req.extensions_mut().insert(ctx);
    let mut observation = api.metrics.start(endpoint);
    let mut response = next.run(req).instrument(span).await;
    observation.status(response.status().as_u16());
    if let Some(id) = id {
        response.headers_mut().insert("x-request-id", id);
    }
    let streaming = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if !streaming {
        return response;
    }
    // The observation ends with the body: when the stream finishes or the client goes away.
    let (parts, body) = response.into_parts();
    let body = body.into_data_stream().map(move |chunk| {
        let _ = &observation;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_differ() {
        let (a, b) = (request_id(), request_id());
        assert_ne!(a, b);
        assert!(a.len() >= 17 && a.chars().all(|c| c.is_ascii_hexdigit()), "{a}");
    }
}
