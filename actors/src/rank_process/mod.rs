//! Ranks in worker processes of their own (`--rank-processes`): a rank that segfaults, aborts or is killed takes
//! its worker down, not the server. The coordinator and the workers are nodes of one `ractor_cluster` cluster on
//! loopback; the coordinator's [`ProcessRankActor`] talks to a worker's actor with [`WorkerMsg`]s and looks to the
//! coordinator exactly like an in-process [`crate::rank_actor::RankActor`]. See `docs/processes.md`.
//!
//! - [`wire`]: the messages and their encoding;
//! - [`remote`]: the coordinator side (starting, supervising and killing workers);
//! - [`worker`]: the worker side (one process, one rank).

pub mod remote;
pub mod wire;
pub mod worker;

pub use remote::{ProcessGeneration, ProcessRankActor, ProcessRankArgs, RankProcesses};
pub use wire::{LoadArgs, RemoteError, Wire, WorkerMsg};
pub use worker::{WorkerArgs, COOKIE_ENV};
