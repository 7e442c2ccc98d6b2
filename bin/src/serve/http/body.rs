//! Request bodies within the server's [`RequestLimits`](crate::serve::limits::RequestLimits): [`read_body`] takes
//! the whole body before a handler runs — refused with a 413 when larger than `--max-request-bytes` (by its
//! `Content-Length` before a byte of it is read), with a 408 when it takes longer than `--body-timeout` — and
//! [`parse`] reads a large one as JSON on the blocking pool, a few at a time: parsing expands a body several times
//! over, and on an async worker a large one stalls every other request that worker carries.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

use super::errors::ApiError;
use super::openai::Fields;
use super::Api;
use crate::serve::limits::bytes;

/// Bodies up to this many bytes are parsed where they arrive: less than a millisecond of work.
const PARSE_INLINE_BYTES: usize = 64 << 10;

/// The 413 of a body over `most` bytes (`size` when its length is known).
fn too_large(size: Option<usize>, most: usize) -> ApiError {
    let has = size.map_or_else(|| "more".to_string(), |n| format!("{n} bytes,"));
    ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        code: Some("request_too_large"),
        ..ApiError::bad_request(format!(
            "The request body has {has} more than this server's limit of {} (--max-request-bytes).",
            bytes(most)
        ))
    }
}

/// The middleware of every route that takes a body: the body read whole within the limits (see the module docs),
/// then handed on.
pub async fn read_body(State(api): State<Arc<Api>>, req: Request, next: Next) -> Response {
    let limits = &api.state.limits;
    let most = limits.max_request_bytes;
    let (parts, body) = req.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if let Some(n) = declared.filter(|&n| n > most) {
        api.metrics.body_refused("too_large");
        tracing::warn!(bytes = n, limit = most, "request body refused: too large");
        return too_large(Some(n), most).into_response();
    }
    let read = async {
        let mut stream = body.into_data_stream();
        let mut buf = Vec::with_capacity(declared.unwrap_or(0));
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| ApiError::bad_request(format!("The request body could not be read: {e}")))?;
            if buf.len() + chunk.len() > most {
                api.metrics.body_refused("too_large");
                tracing::warn!(limit = most, "request body refused: too large");
                return Err(too_large(None, most));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(buf))
    };
    let body = match tokio::time::timeout(limits.body_timeout, read).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return e.into_response(),
        Err(_) => {
            api.metrics.body_refused("timeout");
            tracing::warn!(seconds = limits.body_timeout.as_secs_f64(), "request body timed out");
            return ApiError {
                status: StatusCode::REQUEST_TIMEOUT,
                code: Some("request_timeout"),
                ..ApiError::bad_request(format!(
                    "The request body did not arrive in full within {} s (--body-timeout).",
                    limits.body_timeout.as_secs_f64()
                ))
            }
            .into_response();
        }
    };
    next.run(Request::from_parts(parts, Body::from(body))).await
}

/// `body` parsed as the request's JSON object; a large one on the blocking pool, at most as many at once as the
/// pool's permits allow (the rest wait their turn without holding a worker).
pub async fn parse(api: &Api, body: Bytes) -> Result<Fields, ApiError> {
    if body.len() <= PARSE_INLINE_BYTES {
        return Fields::parse(&body);
    }
    let _permit = api
        .parses
        .acquire()
        .await
        .map_err(|_| ApiError::server(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down"))?;
    let _parsing = api.metrics.parsing();
    tokio::task::spawn_blocking(move || Fields::parse(&body))
        .await
        .unwrap_or_else(|e| {
            Err(ApiError::server(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("a worker failed: {e}"),
            ))
        })
}
