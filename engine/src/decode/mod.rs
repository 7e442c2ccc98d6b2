//! The decoder: sequences in slot-indexed state pools, each decoded in its own form — recurrent, replay or kv-only —
//! with speculative verification whose rollback is a pointer move.
//!
//! Every form produces the recurrent form's outputs up to floating-point error:
//! - `recurrent` keeps the live state in the slot's checkpoint and updates it every token (Alg. 1 / 5); speculative
//!   drafts go through the faithful baseline (Alg. 3 / 7), one state snapshot per draft, committed by a copy;
//! - `replay` keeps a checkpoint plus a ring of the inputs since it, reads the state only through the replay kernels
//!   (Alg. 2 / 6 decode, Alg. 4 / 8 verify) and writes it only at a flush, decided per slot as data (`h + 2T > L`, one
//!   window early) and folding committed entries only;
//! - `kv-only` keeps no state at all while the context is below the threshold (KVBuffer §3.4; by default the state's
//!   key dim, [`memory::kv_only_threshold`]): the ring alone is the history, with a capacity of `threshold + T` so
//!   that a verify started just below the threshold still fits. The first step once the committed context has
//!   reached the threshold compresses the ring into a checkpoint, and the slot continues in `replay` with a ring of
//!   `L` (the slot's ring capacity is per-slot data in the counters; the pool rows hold the larger of the two).
//!
//! A commit of `accepted ∈ 0..=T` drafts moves the ring length, the conv head and the KV length; nothing is copied
//! (but the baseline's snapshot). The conv ring keeps `K − 1 + T` pre-conv inputs, so rolling back the conv history
//! is choosing where the `K − 1` window starts.
//!
//! The decoder runs one tensor-parallel rank's shard (an unsharded model is the plan with one rank) with its
//! communicator; each rank holds only its part of every pool. One step ([`Decoder::advance`], behind
//! [`Decoder::prefill`], [`Decoder::decode`], [`Decoder::verify`] and the [`crate::rank::Rank`] interface) runs a
//! batch of sequences, each in its own phase and form: layer by layer, the FFN blocks over every row at once, the SSM
//! and attention blocks per sequence over that sequence's state.

use std::fmt;
use std::str::FromStr;

use rewind_kernels::cpu::traffic::Traffic;
use tracing::debug_span;

use std::sync::Arc;

use crate::error::{EngineError, Result};
use crate::shard::{Communicator, LocalComm, ShardedModel};
use crate::state::{memory, DecodeForm, PoolConfig, StatePools, StateRef, DEFAULT_BUFFER_LEN};

mod advance;
mod snapshot;
mod ssm;
mod step;

pub use snapshot::{SlotSnapshot, SsmSnapshot};

/// Which positions of a sequence's tokens a step reports on (its LM-head rows).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Rows {
    /// None (an intermediate prompt chunk).
    None,
    /// The last position only.
    #[default]
    Last,
    /// Every position (verification, `rewind logits`).
    All,
}

#[cfg(test)]
mod tests;

pub(crate) use step::Phase;

/// The decode form a sequence asks for. `Auto` (the default) starts KV-only while the context is short, then
/// compresses into replay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum FormChoice {
    /// The full state read and written every token.
    Recurrent,
    /// Checkpoint plus input ring.
    Replay,
    /// No state while the context is below the kv-only threshold (≈ the state's key dim); then replay.
    KvOnly,
    /// KV-only while the context is short, then replay: today the same schedule as `KvOnly`.
    #[default]
    Auto,
}

impl FormChoice {
    /// Every choice, in CLI order.
    pub const ALL: [FormChoice; 4] = [
        FormChoice::Recurrent,
        FormChoice::Replay,
        FormChoice::KvOnly,
        FormChoice::Auto,
    ];

    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            FormChoice::Recurrent => "recurrent",
            FormChoice::Replay => "replay",
            FormChoice::KvOnly => "kv-only",
            FormChoice::Auto => "auto",
        }
    }

    /// The form a fresh sequence starts in.
    pub(crate) fn initial(self) -> DecodeForm {
        match self {
            FormChoice::Recurrent => DecodeForm::Recurrent,
            FormChoice::Replay => DecodeForm::Replay,
            FormChoice::KvOnly | FormChoice::Auto => DecodeForm::KvOnly,
        }
    }
}

impl fmt::Display for FormChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for FormChoice {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        FormChoice::ALL.into_iter().find(|c| c.name() == s).ok_or_else(|| {
            EngineError::InvalidInput(format!(
                "unknown decode form `{s}` (expected recurrent, replay, kv-only or auto)"
            ))
        })
    }
}

/// The sizes of a [`Decoder`]'s pools.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DecoderConfig {
    /// Sequence slots.
    pub slots: usize,
    /// Input-ring capacity `L`: at least 2 and at least `2·max_verify`.
    pub buffer_len: usize,
    /// The most tokens one [`Decoder::verify`] may take (`T`); the conv ring holds `K − 1 + T` rows.
    pub max_verify: usize,
    /// The longest context a slot may reach (sizes the KV pool); capped at the model's `max_position_embeddings`.
    pub max_context: usize,
    /// Context length below which a `kv-only` or `auto` sequence keeps no state (its ring then holds up to
    /// `threshold + max_verify` entries); `None`: [`memory::kv_only_threshold`].
    pub kv_only_threshold: Option<usize>,
}

impl DecoderConfig {
    /// `slots` slots of up to `max_context` tokens, the default ring length, plain decode only (`max_verify = 1`).
    pub fn new(slots: usize, max_context: usize) -> Self {
        DecoderConfig {
            slots,
            buffer_len: DEFAULT_BUFFER_LEN,
            max_verify: 1,
            max_context,
            kv_only_threshold: None,
        }
    }
}

/// Sequences of one rank's shard of a model in slot-indexed state pools (each holding only the rank's part of every
/// checkpoint, ring, conv ring and KV row); see the module docs. Every rank of a tensor-parallel group must make the
/// same calls in the same order: the block loop all-reduces through the rank's communicator.
pub struct Decoder {
    model: Arc<ShardedModel>,
    comm: Box<dyn Communicator>,
    pools: StatePools,
    config: DecoderConfig,
    /// The context length at which a kv-only sequence compresses into replay.
    kv_threshold: usize,
    /// `(block index, SSM layer index)` of every SSM block, in model order.
    ssm_blocks: Vec<(usize, usize)>,
    /// Per slot: the form asked for at [`Decoder::start`].
    choice: Vec<FormChoice>,
    /// Per slot: committed tokens (the next token's position).
    position: Vec<usize>,
    /// Per slot: drafts of the verify awaiting its commit (0: none).
    pending: Vec<usize>,
    /// Per slot and SSM layer: the baseline's per-draft state snapshots `[T, state]` (recurrent verify only).
    snapshots: Vec<Vec<Vec<f32>>>,
    traffic: Traffic,
    /// The LM head's bytes in the last rank step (see [`Decoder::last_head_traffic`]).
    pub(crate) head_traffic: Traffic,
    /// Steps run (for health reports).
    steps: u64,
    /// States kept for later restores ([`Decoder::store`]), by the caller's ids.
    stored: std::collections::HashMap<u64, SlotSnapshot>,
}

impl fmt::Debug for Decoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Decoder")
            .field("config", &self.config)
            .field("rank", &self.model.plan().rank)
            .field("tp", &self.model.plan().tp)
            .field("slots_in_use", &self.pools.slots().used_count())
            .field("last_traffic", &self.traffic)
            .finish_non_exhaustive()
    }
}

/// One sequence's part of a [`Decoder::advance`] call.
pub(crate) struct Item<'a> {
    pub slot: usize,
    pub phase: Phase,
    pub tokens: &'a [u32],
}

impl Decoder {
    /// Pools for `config.slots` sequences of `model` (one rank's shard; `comm` is that rank's communicator), all
    /// slots free.
    pub fn new(model: Arc<ShardedModel>, comm: Box<dyn Communicator>, config: DecoderConfig) -> Result<Self> {
        model.check_comm(&*comm)?;
        let bad = |m: String| Err(EngineError::InvalidInput(m));
        if config.buffer_len < 2 {
            return bad(format!(
                "the buffer length (input-ring capacity L) must be at least 2, found {}",
                config.buffer_len
            ));
        }
        if config.max_verify == 0 {
            return bad("the verify window must be at least 1 token".into());
        }
        if config.max_verify > config.buffer_len / 2 {
            return bad(format!(
                "a ring of {} entries cannot verify windows of {} tokens (needs L ≥ 2T)",
                config.buffer_len, config.max_verify
            ));
        }
        let max_context = config.max_context.min(model.config().max_position_embeddings).max(1);
        let kv_threshold = config
            .kv_only_threshold
            .unwrap_or_else(|| memory::kv_only_threshold(model.config()));
        // A kv-only step starts below the threshold and appends at most a window.
        let kv_only_ring = kv_threshold.checked_add(config.max_verify).ok_or_else(|| {
            EngineError::InvalidInput(format!("a kv-only threshold of {kv_threshold} tokens is too large"))
        })?;
        let pool = PoolConfig {
            buffer_len: config.buffer_len,
            kv_only_ring: Some(kv_only_ring),
            spec_window: config.max_verify,
            default_form: DecodeForm::Replay,
            ..PoolConfig::new(config.slots, max_context)
        };
        let pools = StatePools::with_layers(model.layer_states(), pool)?;
        let ssm_blocks = pools
            .block_refs()
            .iter()
            .enumerate()
            .filter_map(|(b, r)| match r {
                StateRef::Ssm(i) => Some((b, *i)),
                _ => None,
            })
            .collect();
        let n = config.slots;
        Ok(Decoder {
            model,
            comm,
            pools,
            kv_threshold,
            ssm_blocks,
            choice: vec![FormChoice::Auto; n],
            position: vec![0; n],
            pending: vec![0; n],
            snapshots: vec![Vec::new(); n],
            stored: std::collections::HashMap::new(),
            traffic: Traffic::default(),
            head_traffic: Traffic::default(),
            steps: 0,
            config: DecoderConfig { max_context, ..config },
        })
    }

    /// A decoder of an unsharded model (the plan with one rank), with a one-rank communicator.
    pub fn single(model: ShardedModel, config: DecoderConfig) -> Result<Self> {
        let comm = LocalComm::group(1)
            .pop()
            .ok_or_else(|| EngineError::Communicator("a one-rank group has no handle".into()))?;
        Self::new(Arc::new(model), Box::new(comm), config)
    }

    /// The rank's shard of the model.
    pub fn model(&self) -> &ShardedModel {
        &self.model
    }

    /// The sizes the decoder was built with (`max_context` as capped).
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// The context length below which a kv-only or auto sequence keeps no state.
    pub fn kv_only_threshold(&self) -> usize {
        self.kv_threshold
    }

    /// This rank's communicator (the CPU rank merges a chained step's picks through it, `rank/cpu.rs`).
    pub(crate) fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    /// The state pools (counters, rings, checkpoints), read-only.
    pub fn pools(&self) -> &StatePools {
        &self.pools
    }

    /// The bytes the decode kernels of the last operation moved, summed over layers and sequences (GPU layout, see
    /// [`Traffic`]): a decode step, a verify, or a commit (nothing for replay and kv-only, the snapshot copies of
    /// the recurrent baseline). Prefill counts only the KV-only ring writes; the chunked scans are not decode-path
    /// ops.
    pub fn last_traffic(&self) -> Traffic {
        self.traffic
    }

    /// The bytes the LM head moved in the last step through the [`crate::rank::Rank`] interface (GPU layout): the
    /// one-pass summaries write a few bytes per row, whole logits `4·vocab` per row.
    pub fn last_head_traffic(&self) -> Traffic {
        self.head_traffic
    }

    /// Takes a free slot for a new sequence decoded in `form`.
    pub fn start(&mut self, form: FormChoice) -> Result<usize> {
        let slot = self.pools.alloc()?;
        self.begin(slot, form)?;
        Ok(slot)
    }

    /// Takes the free slot `slot` for a new sequence decoded in `form` (a rank following the coordinator's books).
    pub fn start_at(&mut self, slot: usize, form: FormChoice) -> Result<()> {
        self.pools.alloc_at(slot)?;
        self.begin(slot, form)
    }

    fn begin(&mut self, slot: usize, form: FormChoice) -> Result<()> {
        self.pools.set_form(slot, form.initial())?;
        self.choice[slot] = form;
        self.position[slot] = 0;
        self.pending[slot] = 0;
        Ok(())
    }

    /// Ends a sequence and frees its slot.
    pub fn release(&mut self, slot: usize) -> Result<()> {
        self.pools.free(slot)?;
        self.pending[slot] = 0;
        self.position[slot] = 0;
        self.snapshots[slot] = Vec::new();
        Ok(())
    }

    /// A slot's current form (`kv-only` turns into `replay` at the first step once the context has reached the
    /// kv-only threshold).
    pub fn form(&self, slot: usize) -> Result<DecodeForm> {
        self.check_slot(slot)?;
        Ok(self.pools.counters().form_of(slot))
    }

    /// The form a slot's sequence asked for at [`Decoder::start`].
    pub fn form_choice(&self, slot: usize) -> Result<FormChoice> {
        self.check_slot(slot)?;
        Ok(self.choice[slot])
    }

    /// A slot's committed token count.
    pub fn position(&self, slot: usize) -> Result<usize> {
        self.check_slot(slot)?;
        Ok(self.position[slot])
    }

    /// Steps run since the decoder was built.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Drafts of the slot's verify awaiting a commit (0: none).
    pub fn pending(&self, slot: usize) -> Result<usize> {
        self.check_slot(slot)?;
        Ok(self.pending[slot])
    }

    /// Runs a prompt chunk through a sequence in one pass (the chunked scans, the reference's prefill numerics).
    /// The first chunk (at position 0) of a recurrent or replay sequence leaves the prompt's state as its checkpoint
    /// with an empty ring; a KV-only sequence keeps the prompt as ring entries while it is shorter than the kv-only
    /// threshold, else it continues in replay. A later chunk first folds the ring into the checkpoint (compressing
    /// a kv-only sequence into replay). Returns this rank's logits as `which` asks: `[t, slice]`, `[slice]` or
    /// nothing; non-finite logits are an error.
    pub fn prefill(&mut self, slot: usize, tokens: &[u32], which: Rows) -> Result<Vec<f32>> {
        let _span = debug_span!("prefill", slot, tokens = tokens.len()).entered();
        let pos = self.position.get(slot).copied().unwrap_or(0);
        let x = self.advance(&[Item {
            slot,
            phase: Phase::Prefill,
            tokens,
        }])?;
        let t = tokens.len();
        let hidden = self.model.config().hidden_size;
        let skip = match which {
            Rows::All => 0,
            Rows::Last => t - 1,
            Rows::None => t,
        };
        self.checked_head(&x[skip * hidden..], &(pos + skip..pos + t).collect::<Vec<_>>())
    }

    /// One decode step of a batch: every `(slot, token)` appends `token` to its sequence, in the slot's own form.
    /// Returns this rank's logits `[n, slice]` in batch order. Slots must be distinct and have no verify awaiting
    /// its commit.
    pub fn decode(&mut self, batch: &[(usize, u32)]) -> Result<Vec<f32>> {
        let _span = debug_span!("decode_step", batch = batch.len()).entered();
        let tokens: Vec<[u32; 1]> = batch.iter().map(|&(_, t)| [t]).collect();
        let items: Vec<Item> = batch
            .iter()
            .zip(&tokens)
            .map(|(&(slot, _), tok)| Item {
                slot,
                phase: Phase::Decode,
                tokens: tok,
            })
            .collect();
        let x = self.advance(&items)?;
        let positions: Vec<usize> = batch.iter().map(|&(s, _)| self.position[s] - 1).collect();
        self.checked_head(&x, &positions)
    }

    /// Speculative verification of `tokens` (`T` of them, `1 ≤ T ≤ max_verify`) appended to a sequence: returns
    /// this rank's logits `[T, slice]`, row `s` being the prediction after `tokens[..=s]`. Nothing is committed until
    /// [`Decoder::commit`]: replay and kv-only sequences read their checkpoint and ring (Alg. 4 / 8, drafts written
    /// past the committed entries); recurrent ones run the baseline with one state snapshot per draft.
    pub fn verify(&mut self, slot: usize, tokens: &[u32]) -> Result<Vec<f32>> {
        let _span = debug_span!("verify", slot, drafts = tokens.len()).entered();
        let pos = self.position.get(slot).copied().unwrap_or(0);
        let x = self.advance(&[Item {
            slot,
            phase: Phase::Verify,
            tokens,
        }])?;
        self.checked_head(&x, &(pos..pos + tokens.len()).collect::<Vec<_>>())
    }

    /// This rank's logits of residual rows `x`; a non-finite logit is an error naming its position.
    fn checked_head(&self, x: &[f32], positions: &[usize]) -> Result<Vec<f32>> {
        let logits = self.model.head(x);
        let width = self.model.plan().vocab.len().max(1);
        match logits.iter().position(|v| !v.is_finite()) {
            Some(i) => Err(EngineError::NonFinite {
                position: positions.get(i / width).copied().unwrap_or(i / width),
            }),
            None => Ok(logits),
        }
    }

    /// Accepts the first `accepted` (0..=T) tokens of the slot's last verify: ring length, conv head and KV length
    /// advance by `accepted` (pointer moves); a recurrent sequence takes snapshot `accepted − 1` as its state.
    pub fn commit(&mut self, slot: usize, accepted: usize) -> Result<()> {
        self.check_commit(slot, accepted)?;
        let t = self.pending[slot];
        let _span = debug_span!("commit", slot, accepted, drafts = t).entered();
        self.traffic = Traffic::default();
        if self.pools.counters().form_of(slot) == DecodeForm::Recurrent {
            self.commit_baseline(slot, accepted)?;
        }
        self.pools.commit(slot, accepted)?;
        let pos = self.position[slot] + accepted;
        self.pools.kv_truncate(slot, pos)?;
        self.position[slot] = pos;
        self.pending[slot] = 0;
        Ok(())
    }

    /// Checks a commit of `accepted` tokens of the slot's pending verify, changing nothing.
    pub fn check_commit(&self, slot: usize, accepted: usize) -> Result<()> {
        self.check_slot(slot)?;
        let t = self.pending[slot];
        if t == 0 {
            return Err(EngineError::InvalidInput(format!(
                "slot {slot} has no verify to commit"
            )));
        }
        if accepted > t {
            return Err(EngineError::InvalidInput(format!(
                "cannot accept {accepted} of {t} verified tokens"
            )));
        }
        Ok(())
    }

    fn check_slot(&self, slot: usize) -> Result<()> {
        self.pools.slots().check_allocated(slot)?;
        Ok(())
    }

    /// An allocated slot with no verify awaiting its commit.
    fn check_idle(&self, slot: usize) -> Result<()> {
        self.check_slot(slot)?;
        if self.pending[slot] != 0 {
            return Err(EngineError::InvalidInput(format!(
                "slot {slot} has {} verified tokens awaiting commit",
                self.pending[slot]
            )));
        }
        Ok(())
    }
}
