//! The servers every front end shares: one engine ([`ServeState`]) behind the gRPC session API (`grpc`) and the
//! OpenAI-compatible HTTP API (`http`). `rewind serve` runs them in one process; `rewind-launch` adds GPU discovery
//! and the TP plan on top.

pub mod conn;
pub mod grpc;
pub mod http;
pub mod limits;
pub mod model;
pub mod run;
pub mod state;

pub use model::ServedModel;

/// The roles of OpenAI's chat API, which both APIs take. Another role would reach the template as is, where it
/// either fails obscurely or renders a turn the model was never trained on.
pub const CHAT_ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool", "function"];
pub use state::ServeState;
