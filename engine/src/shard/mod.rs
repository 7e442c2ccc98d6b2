//! Tensor parallelism: the per-rank plan ([`plan`]), the collectives ([`comm`]), a slicing tensor source
//! ([`source`]) and a rank's weights ([`model`]); see `docs/architecture.md` ("Tensor parallelism"). Every model is
//! a sharded model: an unsharded one is the plan with one rank.
//!
//! A rank's mixers are the single-rank mixers built from local specs (fewer heads, a slice of the FFN width) and loaded
//! through [`source::ShardSource`], which cuts each tensor out of the whole checkpoint by the plan; all-reduces after
//! row-parallel projections make every rank's residual stream equal to the single-rank model's, up to the order of
//! floating-point sums.

pub mod comm;
mod layers;
pub mod model;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod plan;
pub mod source;
pub mod tcp_comm;

#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod tests;

pub use comm::{Communicator, LocalComm};
pub use model::{ShardBlock, ShardedModel};
pub use plan::{even_split, BlockShard, Cut, GroupedSplit, LocalTensor, MtpShard, Piece, RankPlan, ShardKind};
pub use source::ShardSource;
pub use tcp_comm::{TcpAbort, TcpComm, TcpRendezvous};
