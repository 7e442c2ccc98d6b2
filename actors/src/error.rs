//! The actor runtime's errors.

/// Why the runtime could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum ActorsError {
    /// The engine did not start (a rank failed to load, a bad option).
    #[error("starting the engine: {0}")]
    Start(String),
    /// The engine has stopped.
    #[error("the engine has stopped")]
    Stopped,
    #[error(transparent)]
    Engine(#[from] rewind_engine::EngineError),
    #[error(transparent)]
    Session(#[from] crate::session::SessionError),
}
