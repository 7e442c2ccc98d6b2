//! rewind's actor runtime: requests go to a [`coordinator::Coordinator`] actor that batches them continuously and
//! drives one [`rank_actor::RankActor`] per device (each the async face of a rank's own OS thread); tokens stream
//! back per request through an [`EngineHandle`]. A rank that panics, hangs, errors or produces non-finite values
//! costs no request: the coordinator restarts the ranks and re-prefills every sequence (see
//! `coordinator/recovery.rs` and `docs/architecture.md`).

pub mod coordinator;
mod error;
mod handle;
mod memory;
pub mod metrics;
pub mod rank_actor;
pub mod rank_process;
mod request;
mod session;

pub use coordinator::{
    EngineConfig, EngineHealth, EngineInfo, EngineSpec, PrefixCacheConfig, DEFAULT_PREFIX_CACHE_MEMORY,
    DEFAULT_PREFIX_MIN_TOKENS, DEFAULT_SESSION_MEMORY,
};
pub use error::ActorsError;
pub use handle::{EngineHandle, EventStream};
pub use metrics::{Metrics, MetricsSnapshot, Recovery};
pub use request::{choice_seed, Event, FailureKind, GenerateRequest, RequestTiming, StepStats, TokenLogprob, Usage};
pub use session::{SessionError, SessionInfo, SessionOptions, SessionOwner};
