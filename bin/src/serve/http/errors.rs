//! [`ApiError`]: every error the HTTP API returns, in OpenAI's shape
//! (`{"error": {"message", "type", "param", "code"}}`) with its status code, so OpenAI client libraries raise the
//! right exception (`BadRequestError`, `AuthenticationError`, `NotFoundError`, `RateLimitError`, ...).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use rewind_actors::FailureKind;
use serde_json::{json, Value};

/// An HTTP error response.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `rate_limit_error`, `server_error`.
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// A machine-readable code (`model_not_found`, `context_length_exceeded`, `invalid_api_key`, ...).
    pub code: Option<&'static str>,
}

/// The most characters of a client's value an error message repeats: enough to recognise it, while a client cannot
/// make an error as large as its request.
pub const ECHO_CHARS: usize = 64;

/// A client's value as an error message repeats it: at most [`ECHO_CHARS`] characters, `…` marking a cut.
pub fn echo(value: &str) -> String {
    match value.char_indices().nth(ECHO_CHARS) {
        Some((at, _)) => format!("{}…", &value[..at]),
        None => value.to_string(),
    }
}

impl ApiError {
    /// A 400 about the field `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
        }
    }

    /// A 400 about the request as a whole (malformed JSON, a body that is not an object).
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            param: None,
            ..Self::invalid("", message)
        }
    }

    /// A 400 for a field whose value asks for something this server does not do (`n: 2`, `logprobs`, ...).
    pub fn unsupported(param: &str, what: &str) -> Self {
        Self::invalid(param, format!("{what} is not supported")).with_code("unsupported_parameter")
    }

    /// The 404 for a `model` this server does not serve.
    pub fn model_not_found(requested: &str, served: &str) -> Self {
        let requested = echo(requested);
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{requested}` does not exist; this server serves `{served}`."),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// The 401 for a missing or wrong API key.
    pub fn unauthorized(presented: bool) -> Self {
        let message = if presented {
            "Incorrect API key provided."
        } else {
            "Missing API key: send it as `Authorization: Bearer <key>`."
        };
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// The 503 of a server that is shutting down.
    pub fn draining() -> Self {
        Self::server(
            StatusCode::SERVICE_UNAVAILABLE,
            "The server is shutting down and takes no new requests.",
        )
    }

    /// A 5xx.
    pub fn server(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// A 404 for a path this server does not have.
    pub fn no_route(path: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            code: Some("not_found"),
            param: None,
            ..Self::invalid("", format!("There is no route {path}."))
        }
    }

    /// The same error with `code` set.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// A body that could not be read (too large: 413; the connection broke: 400).
    pub fn unreadable_body(rejection: &axum::extract::rejection::BytesRejection) -> Self {
        ApiError {
            status: rejection.status(),
            ..Self::bad_request(format!("The request body could not be read: {}", rejection.body_text()))
        }
    }

    /// What the engine's `Failed { error, kind }` event becomes.
    pub fn from_failure(kind: FailureKind, error: String) -> Self {
        // No wildcard: a new failure kind must be given its status here.
        let (status, kind_name) = match kind {
            FailureKind::InvalidArgument => (StatusCode::BAD_REQUEST, "invalid_request_error"),
            FailureKind::NotFound => (StatusCode::NOT_FOUND, "invalid_request_error"),
            FailureKind::FailedPrecondition => (StatusCode::CONFLICT, "invalid_request_error"),
            FailureKind::ResourceExhausted => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
            FailureKind::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "server_error"),
            FailureKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
        };
        let param = (kind == FailureKind::InvalidArgument)
            .then(|| engine_param(&error))
            .flatten();
        ApiError {
            status,
            message: error,
            kind: kind_name,
            param,
            code: None,
        }
    }

    /// The error object (`{"error": {...}}`), also what a stream sends when a request fails after its first event.
    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

/// The request field an engine `InvalidInput` message is about: `SamplingParams::validate` and the coordinator start
/// their messages with the field's name (`top_p must be ...`, `stop_token_ids: ...`, `stop_strings[0] ...`,
/// `prompt token id ...`, `max_tokens 12 and the prompt's ...`); named as the HTTP API names them.
fn engine_param(message: &str) -> Option<String> {
    let first = message.split([' ', ':', '[']).next().unwrap_or_default();
    let name = match first {
        "stop_strings" => "stop",
        "temperature" | "top_p" | "top_k" | "min_p" | "repetition_penalty" | "max_tokens" | "stop_token_ids"
        | "prompt" | "seed" | "presence_penalty" | "frequency_penalty" | "logit_bias" | "min_tokens" => first,
        _ => return None,
    };
    Some(name.to_string())
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echoed_values_are_cut() {
        assert_eq!(echo("wizard"), "wizard");
        let long = "é".repeat(1000);
        let cut = echo(&long);
        assert_eq!(cut.chars().count(), ECHO_CHARS + 1, "{cut}");
        assert!(cut.ends_with('…'));
        let e = ApiError::model_not_found(&"m".repeat(20_000), "served");
        assert!(e.message.len() < 200, "{}", e.message);
    }

    #[test]
    fn failure_kinds_map_to_their_statuses() {
        for (kind, status) in [
            (FailureKind::InvalidArgument, 400),
            (FailureKind::NotFound, 404),
            (FailureKind::FailedPrecondition, 409),
            (FailureKind::ResourceExhausted, 429),
            (FailureKind::Unavailable, 503),
            (FailureKind::Internal, 500),
        ] {
            assert_eq!(
                ApiError::from_failure(kind, "x".into()).status.as_u16(),
                status,
                "{kind:?}"
            );
        }
    }

    #[test]
    fn engine_messages_name_their_field() {
        let e = ApiError::from_failure(FailureKind::InvalidArgument, "top_p must be in (0, 1], got 2".into());
        assert_eq!(e.param.as_deref(), Some("top_p"));
        let e = ApiError::from_failure(FailureKind::InvalidArgument, "stop_strings[1] must not be empty".into());
        assert_eq!(e.param.as_deref(), Some("stop"));
        let e = ApiError::from_failure(FailureKind::InvalidArgument, "the prompt is empty".into());
        assert_eq!(e.param, None);
        let e = ApiError::from_failure(FailureKind::Internal, "temperature went wrong".into());
        assert_eq!(e.param, None, "only invalid arguments name a field");
    }

    #[test]
    fn the_body_has_openais_shape() {
        let b = ApiError::invalid("temperature", "bad").body();
        assert_eq!(b["error"]["message"], "bad");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["param"], "temperature");
        assert!(b["error"]["code"].is_null());
        let b = ApiError::model_not_found("x", "y").body();
        assert_eq!(b["error"]["code"], "model_not_found");
    }
}
