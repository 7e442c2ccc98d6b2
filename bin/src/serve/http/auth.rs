//! The gate of the `/v1/*` routes and `/metrics`: the API key (when the server has one), and draining (`/v1/*` only).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::errors::ApiError;
use super::Api;

/// The token of an `Authorization: Bearer <token>` header (the scheme in any case, as RFC 7235 allows); `None`
/// without one or with another scheme.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// 401 without the right key, 503 for `/v1/*` while the server drains; otherwise the route.
pub async fn guard(State(api): State<Arc<Api>>, req: Request, next: Next) -> Response {
    if !api.state.authorized(bearer(req.headers())) {
        let presented = req.headers().contains_key(header::AUTHORIZATION);
        let mut r = ApiError::unauthorized(presented).into_response();
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return r;
    }
    // A draining server still answers scrapes of /metrics: the drain itself is worth watching.
    if api.state.draining() && req.uri().path().starts_with("/v1/") {
        return ApiError::draining().into_response();
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(auth: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(auth).expect("ascii"));
        h
    }

    #[test]
    fn bearer_tokens_are_read() {
        assert_eq!(bearer(&headers("Bearer abc")), Some("abc"));
        assert_eq!(bearer(&headers("bearer  abc ")), Some("abc"));
        assert_eq!(bearer(&headers("Basic abc")), None);
        assert_eq!(bearer(&headers("Bearer")), None);
        assert_eq!(bearer(&HeaderMap::new()), None);
    }
}
