//! The API key check: an interceptor in front of every RPC (health and stats included) when the server has keys,
//! which also tells the session RPCs whose sessions a call may see.

use std::sync::Arc;

use rewind_actors::SessionOwner;
use tonic::service::Interceptor;
use tonic::{Request, Status};

use crate::serve::ServeState;

/// Lets a call in when the server has no API key, or when its `authorization` metadata is `Bearer <a key>`; the
/// call then carries the [`SessionOwner`] the key stands for (read with [`owner`]).
#[derive(Clone)]
pub struct Auth {
    state: Arc<ServeState>,
}

impl Auth {
    /// The check for `state`'s keys.
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
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let presented = request.metadata().get("authorization");
        if presented.is_none() && self.state.api_keys.required() {
            return Err(Status::unauthenticated(
                "missing `authorization: Bearer <API key>` metadata (this server requires an API key)",
            ));
        }
        let token = presented.and_then(|v| v.to_str().ok()).and_then(bearer);
        let Some(owner) = self.state.authorized(token) else {
            return Err(Status::unauthenticated(
                "invalid API key (the `authorization` metadata must be `Bearer <API key>`)",
            ));
        };
        request.extensions_mut().insert(owner);
        Ok(request)
    }
}

/// The session owner [`Auth`] found for `request`. Every call passes through it, so a call without one is a server
/// bug, refused rather than served as anyone's.
pub fn owner<T>(request: &Request<T>) -> Result<SessionOwner, Status> {
    request
        .extensions()
        .get::<SessionOwner>()
        .copied()
        .ok_or_else(|| Status::internal("the API key check did not run on this call"))
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
