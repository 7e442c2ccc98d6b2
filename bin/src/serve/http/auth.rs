//! The gate of the `/v1/*` routes and `/metrics`: the API key (when the server has one), and draining (`/v1/*` only).
//!
//! A server without a key also refuses what a web page could send it from a browser on the same machine: a POST body
//! that is not `application/json` (a page can post `text/plain` without asking CORS first), and a `Host` that does not
//! name the server (a page whose own name was made to resolve to the loopback address: DNS rebinding).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
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

/// The `Host` names a server without an API key answers to: `localhost`, its bound address, the `--host` it was given,
/// and for a loopback address the other loopback literals. A server bound to every interface (`0.0.0.0`, `::`)
/// cannot know the names it is reached by, so it takes any.
#[derive(Clone, Debug)]
pub struct AllowedHosts {
    names: Vec<String>,
    any: bool,
}

impl AllowedHosts {
    /// The names of a server bound to `bound` from `--host host`.
    pub fn new(bound: SocketAddr, host: &str) -> Self {
        let ip = bound.ip();
        let literal = |ip: std::net::IpAddr| match ip {
            std::net::IpAddr::V4(v4) => v4.to_string(),
            std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        };
        let host = host.trim().to_ascii_lowercase();
        let mut names = vec!["localhost".to_string(), literal(ip)];
        // `--host ::1` names an IPv6 literal, which a Host header brackets.
        names.push(match host.parse::<std::net::IpAddr>() {
            Ok(given) => literal(given),
            Err(_) => host,
        });
        if ip.is_loopback() {
            names.extend(["127.0.0.1".to_string(), "[::1]".to_string()]);
        }
        AllowedHosts {
            names,
            any: ip.is_unspecified(),
        }
    }

    /// Whether a request for `authority` (`name` or `name:port`) is for this server.
    fn allows(&self, authority: &str) -> bool {
        if self.any {
            return true;
        }
        let authority = authority.trim();
        let name = match authority.strip_prefix('[') {
            Some(rest) => rest.find(']').map_or(authority, |end| &authority[..end + 2]),
            None => authority.rsplit_once(':').map_or(authority, |(name, _)| name),
        };
        let name = name.to_ascii_lowercase();
        self.names.contains(&name)
    }
}

/// The request's `Host` (HTTP/1), or its URI's authority (HTTP/2 has no `Host` header).
fn authority(req: &Request) -> Option<String> {
    match req.headers().get(header::HOST) {
        Some(h) => h.to_str().ok().map(str::to_string),
        None => req.uri().authority().map(|a| a.as_str().to_string()),
    }
}

/// Whether a `Content-Type` value is JSON (`application/json`, parameters such as a charset allowed).
fn is_json(value: &HeaderValue) -> bool {
    value
        .to_str()
        .ok()
        .and_then(|v| v.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"))
}

/// What a keyless server refuses (see the module docs), as the error to answer with.
fn browser_check(api: &Api, req: &Request) -> Option<ApiError> {
    match authority(req) {
        None => {
            return Some(ApiError::bad_request(
                "The request has no Host header; a server without an API key needs one naming it.",
            ))
        }
        Some(a) if !api.hosts.allows(&a) => {
            return Some(ApiError {
                status: StatusCode::MISDIRECTED_REQUEST,
                code: Some("misdirected_request"),
                ..ApiError::bad_request(format!(
                    "The Host `{}` does not name this server; a server without an API key answers only to its own \
                     address or localhost.",
                    super::errors::echo(&a)
                ))
            })
        }
        Some(_) => {}
    }
    if req.method() == Method::POST && !req.headers().get(header::CONTENT_TYPE).is_some_and(is_json) {
        return Some(ApiError {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            code: Some("unsupported_media_type"),
            ..ApiError::bad_request("The request body must be sent as Content-Type: application/json.")
        });
    }
    None
}

/// 401 without the right key; without a key, the checks of [`browser_check`]; 503 for `/v1/*` while the server
/// drains; otherwise the route.
pub async fn guard(State(api): State<Arc<Api>>, req: Request, next: Next) -> Response {
    // The HTTP API has no sessions: any accepted key will do.
    if api.state.authorized(bearer(req.headers())).is_none() {
        let presented = req.headers().contains_key(header::AUTHORIZATION);
        let mut r = ApiError::unauthorized(presented).into_response();
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return r;
    }
    if !api.state.api_keys.required() {
        if let Some(e) = browser_check(&api, &req) {
            return e.into_response();
        }
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
    fn hosts_name_the_server() {
        let loopback = AllowedHosts::new("127.0.0.1:8000".parse().expect("addr"), "127.0.0.1");
        for ok in [
            "127.0.0.1:8000",
            "localhost:8000",
            "LOCALHOST",
            "[::1]:8000",
            "127.0.0.1",
        ] {
            assert!(loopback.allows(ok), "{ok}");
        }
        for bad in [
            "evil.example:8000",
            "127.0.0.2:8000",
            "",
            "localhost.evil.example",
            "[::2]:8000",
        ] {
            assert!(!loopback.allows(bad), "{bad}");
        }
        let named = AllowedHosts::new("10.0.0.5:80".parse().expect("addr"), "box.lan");
        assert!(named.allows("box.lan") && named.allows("10.0.0.5:80") && !named.allows("127.0.0.1"));
        let v6 = AllowedHosts::new("[::1]:80".parse().expect("addr"), "::1");
        assert!(v6.allows("[::1]:80") && v6.allows("localhost"));
        let every = AllowedHosts::new("0.0.0.0:80".parse().expect("addr"), "0.0.0.0");
        assert!(every.allows("anything.example"));
    }

    #[test]
    fn json_content_types() {
        for ok in [
            "application/json",
            "Application/JSON; charset=utf-8",
            " application/json ",
        ] {
            assert!(is_json(&HeaderValue::from_static(ok)), "{ok}");
        }
        for bad in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "",
        ] {
            assert!(!is_json(&HeaderValue::from_static(bad)), "{bad}");
        }
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
