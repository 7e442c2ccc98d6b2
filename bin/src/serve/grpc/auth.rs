//! The API key check: an interceptor in front of every RPC (health and stats included) when the server has a key.

use std::sync::Arc;

use tonic::service::Interceptor;
use tonic::{Request, Status};

use crate::serve::ServeState;

/// Lets a call in when the server has no API key, or when its `authorization` metadata is `Bearer <the key>`.
#[derive(Clone)]
pub struct Auth {
    state: Arc<ServeState>,
}

impl Auth {
    /// The check for `state`'s key.
    pub fn new(state: Arc<ServeState>) -> Self {
        Auth { state }
    }
}

/// The token of an `authorization` header value in the bearer scheme (the scheme's name in any case, RFC 7235).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

impl Interceptor for Auth {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        if self.state.api_key.is_none() {
            return Ok(request);
        }
        let Some(value) = request.metadata().get("authorization") else {
            return Err(Status::unauthenticated(
                "missing `authorization: Bearer <API key>` metadata (this server requires an API key)",
            ));
        };
        let token = value.to_str().ok().and_then(bearer);
        if self.state.authorized(token) {
            Ok(request)
        } else {
            Err(Status::unauthenticated(
                "invalid API key (the `authorization` metadata must be `Bearer <API key>`)",
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::bearer;

    #[test]
    fn bearer_tokens_are_read_in_any_scheme_case() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer  abc "), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer"), None);
    }
}
