//! State pools: every per-sequence tensor the decode forms need, allocated once for a fixed number of sequence
//! slots and indexed by slot, in the layout a GPU kernel reads.
//!
//! Per SSM layer ([`ssm::SsmLayerPool`]): the fp32 checkpoint state, an input ring of capacity `L` (Mamba-2
//! `x, dt, B`; GDN `u, k, g`; a kv-only slot's ring holds `threshold + T` entries, so the rows per slot are the
//! larger of the two) and a conv ring of `K − 1 + T` pre-conv inputs. Per attention layer
//! ([`kv::KvLayerPool`]): paged K/V storage; one block table per slot ([`kv::KvBlocks`]) serves every attention
//! layer, because a sequence has the same length in all of them. The per-slot counters ([`counters::SlotCounters`])
//! are plain arrays — ring start, cached count `h`, ring capacity, flush flag, conv head, KV length, decode form — so that a commit
//! or a rollback is a pointer move written as data, never a copy and never a host object per sequence.
//!
//! CPU storage is f32 throughout; [`memory`] counts the bytes of the GPU layout (fp32 state, bf16 vectors).

pub mod counters;
pub mod kv;
pub mod memory;
pub mod pools;
pub mod slots;
pub mod ssm;

#[cfg(test)]
mod tests;

/// Pool errors live in [`crate::error`], below every module that raises or wraps them.
pub use crate::error::PoolError;
pub use counters::{DecodeForm, SlotCounters, StepDecision, StepPhase};
pub use kv::{KvBlocks, KvLayerPool, KvSlotMut};
pub use pools::{LayerState, PoolConfig, StatePools, StateRef};
/// The kernels' ring counters, which the per-slot counters hand out per slot.
pub use rewind_kernels::cpu::ring::RingIndex;
pub use slots::SlotAllocator;
pub use ssm::{GdnSlotMut, Mamba2SlotMut, SsmDims, SsmLayerPool, SsmSlotMut};

/// The ring capacity `L` used when none is given (ReplaySSM's choice for Qwen3.5; 8–16 for Nemotron).
pub const DEFAULT_BUFFER_LEN: usize = 16;
/// Tokens per paged KV block when none is given.
pub const DEFAULT_KV_BLOCK_SIZE: usize = 16;
/// The most slots a pool may have (the per-slot arrays are allocated without a fallible path).
pub const MAX_SLOTS: usize = 1 << 24;

/// `n` copies of `value`, or a [`PoolError::Config`] naming `what` when the memory cannot be had (instead of
/// aborting the process).
fn filled<T: Clone>(n: usize, value: T, what: &str) -> Result<Vec<T>, PoolError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        PoolError::Config(format!(
            "could not allocate {} for {what}",
            memory::format_bytes((n as u64).saturating_mul(std::mem::size_of::<T>() as u64))
        ))
    })?;
    v.resize(n, value);
    Ok(v)
}

/// `n` f32 zeros (see [`filled`]).
fn zeroed(n: usize, what: &str) -> Result<Vec<f32>, PoolError> {
    filled(n, 0.0, what)
}
