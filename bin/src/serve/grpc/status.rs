//! Errors as gRPC statuses: the one mapping from the engine's failure kinds and errors to status codes, so every RPC
//! reports the same condition with the same code.

use rewind_actors::{ActorsError, FailureKind, SessionError};
use rewind_engine::EngineError;
use tonic::{Code, Status};

/// The status code of a failure kind.
pub fn code(kind: FailureKind) -> Code {
    match kind {
        FailureKind::InvalidArgument => Code::InvalidArgument,
        FailureKind::NotFound => Code::NotFound,
        FailureKind::FailedPrecondition => Code::FailedPrecondition,
        FailureKind::ResourceExhausted => Code::ResourceExhausted,
        FailureKind::Unavailable => Code::Unavailable,
        FailureKind::Internal => Code::Internal,
    }
}

/// The most bytes of a status message: it travels as a header (`grpc-message`), and one over the client's header
/// limit turns the answer into RESOURCE_EXHAUSTED. Messages can hold what a client sent.
const MAX_MESSAGE_BYTES: usize = 1024;

/// `message` cut to [`MAX_MESSAGE_BYTES`] (at a character boundary, `…` marking the cut).
fn bounded(message: String) -> String {
    if message.len() <= MAX_MESSAGE_BYTES {
        return message;
    }
    let mut end = MAX_MESSAGE_BYTES - '…'.len_utf8();
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &message[..end])
}

/// A status of `code` whose message is [`bounded`]; every status this API makes goes through it.
pub fn status(code: Code, message: impl Into<String>) -> Status {
    Status::new(code, bounded(message.into()))
}

/// A request's failure as a status.
pub fn failure(kind: FailureKind, message: impl Into<String>) -> Status {
    status(code(kind), message)
}

/// An engine error as a status (a bad parameter is INVALID_ARGUMENT, a failed rank group UNAVAILABLE).
pub fn engine(e: &EngineError) -> Status {
    failure(FailureKind::of(e), e.to_string())
}

/// A runtime error as a status.
pub fn actors(e: &ActorsError) -> Status {
    match e {
        // A stopped engine, or one that did not start, may come back (a restart): retrying later can succeed.
        ActorsError::Stopped | ActorsError::Start(_) => status(Code::Unavailable, e.to_string()),
        ActorsError::Engine(e) => engine(e),
        ActorsError::Session(s) => status(session_code(s), s.to_string()),
    }
}

/// The status code of a refused session operation.
fn session_code(e: &SessionError) -> Code {
    match e {
        SessionError::NotFound { .. } => Code::NotFound,
        SessionError::Busy { .. } => Code::FailedPrecondition,
        SessionError::Limit { .. } | SessionError::Memory { .. } => Code::ResourceExhausted,
    }
}

/// INVALID_ARGUMENT for `field`: the message starts with the field's name.
pub fn invalid(field: &str, why: impl std::fmt::Display) -> Status {
    status(Code::InvalidArgument, format!("{field}: {why}"))
}

/// What a request gets while the server shuts down.
pub fn draining() -> Status {
    Status::unavailable("the server is draining (shutting down): it takes no new requests")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_bounded() {
        let gone = ActorsError::Session(SessionError::NotFound {
            id: "é".repeat(20_000),
            reason: "no session has this id".into(),
        });
        let s = actors(&gone);
        assert_eq!(s.code(), Code::NotFound);
        assert!(
            s.message().len() <= MAX_MESSAGE_BYTES && s.message().ends_with('…'),
            "{}",
            s.message().len()
        );
        assert_eq!(failure(FailureKind::Internal, "short").message(), "short");
    }

    #[test]
    fn failure_kinds_map_to_their_codes() {
        assert_eq!(code(FailureKind::InvalidArgument), Code::InvalidArgument);
        assert_eq!(code(FailureKind::NotFound), Code::NotFound);
        assert_eq!(code(FailureKind::ResourceExhausted), Code::ResourceExhausted);
        assert_eq!(code(FailureKind::Unavailable), Code::Unavailable);
        assert_eq!(code(FailureKind::Internal), Code::Internal);
        assert_eq!(code(FailureKind::FailedPrecondition), Code::FailedPrecondition);
        let gone = ActorsError::Session(SessionError::NotFound {
            id: "sess-1".into(),
            reason: "it was closed".into(),
        });
        assert_eq!(actors(&gone).code(), Code::NotFound);
        assert!(actors(&gone).message().contains("closed"));
        let busy = ActorsError::Session(SessionError::Busy { id: "sess-1".into() });
        assert_eq!(actors(&busy).code(), Code::FailedPrecondition);
        assert_eq!(
            actors(&ActorsError::Session(SessionError::Limit { max: 2 })).code(),
            Code::ResourceExhausted
        );
        let memory = ActorsError::Session(SessionError::Memory {
            id: "sess-1".into(),
            needed: 3 << 20,
            budget: 2 << 20,
            pinned: 0,
        });
        assert_eq!(actors(&memory).code(), Code::ResourceExhausted);
        assert!(actors(&memory).message().contains("--session-memory"));
        let s = engine(&EngineError::InvalidInput("temperature must be >= 0".into()));
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(s.message().contains("temperature"), "{}", s.message());
        assert_eq!(actors(&ActorsError::Stopped).code(), Code::Unavailable);
        assert_eq!(invalid("top_k", "must be >= 0").message(), "top_k: must be >= 0");
    }
}
