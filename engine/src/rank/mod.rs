//! The backend-neutral rank interface and the coordinator logic over it.
//!
//! A [`Rank`] is one tensor-parallel shard of a model on one device, with its state pools: the CPU rank is
//! [`crate::decode::Decoder`] (the sharded model, its pools and an in-process communicator), the GPU rank lives in
//! `crate::gpu`. The coordinator drives every rank with the same typed [`StepPlan`] and merges their answers:
//!
//! - [`plan`]: the messages — [`StepPlan`], [`StepOut`], [`SlotSnapshot`], [`RankHealth`], [`RankInfo`];
//! - `executor`: the host loops of chained programs over a backend's single steps;
//! - [`books`]: the coordinator's copy of every slot's length, pending verify and KV blocks, and the validation that
//!   rejects a bad plan before any rank computes;
//! - [`vocab`]: merging the ranks' vocabulary slices (summaries and logits);
//! - [`thread`]: a rank's own OS thread, fed typed [`RankMsg`]s (and where faults are injected, [`fault`]);
//! - [`launch`]: [`Launcher`], which starts a generation of ranks (fresh communicators, an [`Abort`] signal);
//! - [`lockstep`]: the coordinator's half of a step (validate and build the plan, merge the answers);
//! - [`group`]: [`RankGroup`], the synchronous driver of one generation;
//! - [`sequence`]: one sequence of a group as the generation loop's backend.
//!
//! See `docs/architecture.md` for how this fits the actor runtime.

pub mod books;
mod cpu;
mod executor;
pub mod fault;
pub mod group;
pub mod launch;
pub mod lockstep;
pub mod mtp;
mod mtp_cpu;
pub mod plan;
pub mod sequence;
pub mod spec_chain;
pub mod spec_chain_check;
pub mod thread;
pub mod vocab;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_logprobs;
#[cfg(test)]
mod tests_mtp;
#[cfg(test)]
mod tests_spec_chain;

pub use books::Books;
pub use cpu::{cpu_group, CpuLauncher, CpuOptions, Meet};
pub use fault::{FaultKind, FaultSpec, Faults};
pub use group::{await_ranks, RankGroup};
pub use launch::{Abort, Launch, Launcher, RankLoader};
pub use lockstep::{finish, prepare, StepResult};
pub use mtp::{MtpBook, MtpProposal, MtpRequest};
pub use plan::{
    Batch, ChainSample, ChainedDecode, ChainedVerify, Commit, DecodeChain, GraphStats, LogprobRows, Program,
    RankHealth, RankInfo, RowSummary, Rows, SampleRow, SeqKind, SeqSpan, SeqStep, SlotSnapshot, SpecSample,
    SsmSnapshot, StageTime, StageTimes, StepOut, StepPlan, VerifyChain, MAX_CHAINED, MTP_DRAFT_STAGE,
};
pub use rewind_kernels::cpu::lm_head::{summarise_logits_with, LogprobRequest, LogprobSummary, RowPass, TopK, MAX_TOP};
pub use sequence::GroupSequence;
pub use spec_chain::{ChainDrafter, ChainLog};
pub use spec_chain_check::{spec_chain_check, SpecChainReport};
pub use thread::{RankMsg, RankThread, Reply};
pub use vocab::MergedStep;

use crate::error::Result;

/// One tensor-parallel shard of a model on one device, with its state pools. Loading is the implementation's
/// constructor (a rank is built on the thread that will own it: a GPU rank's context, stream and NCCL communicator
/// cannot move). Every rank of a group receives the same calls in the same order; a rank must answer a plan the
/// coordinator's [`Books`] accepted, and may refuse anything else with an error (changing nothing).
pub trait Rank {
    /// What the rank holds and can do; fixed after loading.
    fn info(&self) -> RankInfo;

    /// Runs one step: the plan's commits, then its sequences as one batch. Returns the rank's summaries (and logit
    /// slices when asked) of the reported rows, in plan order.
    fn step(&mut self, plan: &StepPlan) -> Result<StepOut>;

    /// Ends the sequence in `slot` and returns every pool entry it held.
    fn release(&mut self, slot: usize) -> Result<()>;

    /// Copies `slot`'s whole state on this rank (no verify may be pending).
    fn snapshot(&mut self, slot: usize) -> Result<SlotSnapshot>;

    /// Starts a sequence in the free slot `slot` from a snapshot of this rank's shard.
    fn restore(&mut self, slot: usize, snapshot: &SlotSnapshot) -> Result<()>;

    /// Copies `slot`'s whole state into the rank's own store under `id` (device memory on a GPU; no verify may be
    /// pending), for later [`Rank::restore_stored`] calls: the prefix cache's entries, which so never leave the
    /// device. Returns the bytes kept, or `None` when the store has no room for them (nothing kept: not an error).
    fn store(&mut self, slot: usize, id: u64) -> Result<Option<u64>>;

    /// Starts a sequence in the free slot `slot` from the state stored under `id`, which stays stored.
    fn restore_stored(&mut self, slot: usize, id: u64) -> Result<()>;

    /// Frees the states stored under `ids`; an id not stored is ignored (a state the caller dropped twice, or one a
    /// restarted rank never had).
    fn drop_stored(&mut self, ids: &[u64]) -> Result<()>;

    /// Reports the rank's state; an error means the rank cannot serve.
    fn health(&mut self) -> Result<RankHealth>;

    /// Waits for the rank's queued device work (for timing); a no-op on the CPU.
    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }
}
