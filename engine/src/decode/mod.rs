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
//! One [`Decoder::decode`] call runs a batch of sequences, each in its own form: layer by layer, the FFN blocks over
//! every row at once, the SSM and attention blocks per sequence over that sequence's state.

use std::fmt;
use std::str::FromStr;

use rewind_kernels::cpu::traffic::Traffic;
use tracing::debug_span;

use crate::error::{EngineError, Result};
use crate::model::hybrid::Mixer;
use crate::model::{Logits, Model};
use crate::state::{memory, DecodeForm, PoolConfig, StatePools, StateRef, DEFAULT_BUFFER_LEN};

mod ssm;
mod step;

#[cfg(test)]
mod tests;

use step::{Phase, Seq};

/// The decode form a sequence asks for. `Auto` (the default) starts KV-only while the context is short, then
/// compresses into replay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
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
    fn initial(self) -> DecodeForm {
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

/// What a user picks on the command line: the form and the input-ring length `L`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeOptions {
    /// The decode form of the sequence.
    pub form: FormChoice,
    /// Input-ring capacity `L` (at least 2).
    pub buffer_len: usize,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions {
            form: FormChoice::Auto,
            buffer_len: DEFAULT_BUFFER_LEN,
        }
    }
}

/// The sizes of a [`Decoder`]'s pools.
#[derive(Clone, Debug, PartialEq, Eq)]
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

/// Sequences of one model in slot-indexed state pools; see the module docs.
pub struct Decoder<'m> {
    model: &'m Model,
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
}

impl fmt::Debug for Decoder<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Decoder")
            .field("config", &self.config)
            .field("slots_in_use", &self.pools.slots().used_count())
            .field("last_traffic", &self.traffic)
            .finish_non_exhaustive()
    }
}

impl<'m> Decoder<'m> {
    /// Pools for `config.slots` sequences of `model`, all slots free.
    pub fn new(model: &'m Model, config: DecoderConfig) -> Result<Self> {
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
        let pools = StatePools::new(model.config(), pool)?;
        if pools.block_refs().len() != model.blocks().len() {
            return Err(EngineError::InvalidInput(
                "the state pools do not match the model's blocks".into(),
            ));
        }
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
            pools,
            kv_threshold,
            ssm_blocks,
            choice: vec![FormChoice::Auto; n],
            position: vec![0; n],
            pending: vec![0; n],
            snapshots: vec![Vec::new(); n],
            traffic: Traffic::default(),
            config: DecoderConfig { max_context, ..config },
        })
    }

    /// The model.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// The sizes the decoder was built with (`max_context` as capped).
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// The context length below which a kv-only or auto sequence keeps no state.
    pub fn kv_only_threshold(&self) -> usize {
        self.kv_threshold
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

    /// Takes a free slot for a new sequence decoded in `form`.
    pub fn start(&mut self, form: FormChoice) -> Result<usize> {
        let slot = self.pools.alloc()?;
        self.pools.set_form(slot, form.initial())?;
        self.choice[slot] = form;
        self.position[slot] = 0;
        self.pending[slot] = 0;
        Ok(slot)
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

    /// Runs a prompt through a fresh sequence in one pass (the chunked scans, the reference's prefill numerics).
    /// Afterwards a recurrent or replay sequence holds the prompt's state as its checkpoint with an empty ring; a
    /// KV-only sequence holds the prompt's ring entries if the prompt is shorter than the kv-only threshold, else it
    /// continues in replay. Returns
    /// logits as `which` asks: `[t, vocab]` or `[vocab]`.
    pub fn prefill(&mut self, slot: usize, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        self.check_idle(slot)?;
        if self.position[slot] != 0 {
            return Err(EngineError::InvalidInput(format!(
                "prefill starts a sequence, but slot {slot} already holds {} tokens",
                self.position[slot]
            )));
        }
        if tokens.is_empty() {
            return Err(EngineError::InvalidInput("no tokens to prefill".into()));
        }
        self.model.check_tokens(tokens, 0)?;
        let t = tokens.len();
        let _span = debug_span!("prefill", slot, tokens = t).entered();
        self.traffic = Traffic::default();
        let mut form = self.pools.counters().form_of(slot);
        if form == DecodeForm::KvOnly && t >= self.kv_threshold {
            form = DecodeForm::Replay;
            self.pools.set_form(slot, form)?;
        }
        self.pools.set_flush(slot, false)?;
        self.pools.kv_grow(slot, t)?;
        let seq = Seq {
            slot,
            tokens,
            pos: 0,
            form,
            flush: false,
        };
        let x = self.run(&[seq], Phase::Prefill)?;
        if form == DecodeForm::KvOnly {
            self.pools.ring_commit(slot, t)?;
        }
        self.position[slot] = t;
        let hidden = self.model.config().hidden_size;
        match which {
            Logits::All => self.model.head_logits(&x, 0),
            Logits::Last => self.model.head_logits(&x[(t - 1) * hidden..], t - 1),
        }
    }

    /// One decode step of a batch: every `(slot, token)` appends `token` to its sequence, in the slot's own form.
    /// Returns logits `[n, vocab]` in batch order. Slots must be distinct and have no verify awaiting its commit.
    pub fn decode(&mut self, batch: &[(usize, u32)]) -> Result<Vec<f32>> {
        if batch.is_empty() {
            return Err(EngineError::InvalidInput("an empty decode batch".into()));
        }
        for (i, &(slot, tok)) in batch.iter().enumerate() {
            self.check_idle(slot)?;
            if batch[..i].iter().any(|&(s, _)| s == slot) {
                return Err(EngineError::InvalidInput(format!(
                    "slot {slot} appears twice in one decode batch"
                )));
            }
            self.model.check_tokens(&[tok], self.position[slot])?;
        }
        let _span = debug_span!("decode_step", batch = batch.len()).entered();
        self.traffic = Traffic::default();
        let tokens: Vec<[u32; 1]> = batch.iter().map(|&(_, t)| [t]).collect();
        let mut seqs = Vec::with_capacity(batch.len());
        for (&(slot, _), tok) in batch.iter().zip(&tokens) {
            let (form, flush) = self.plan_step(slot, 1)?;
            seqs.push(Seq {
                slot,
                tokens: tok,
                pos: self.position[slot],
                form,
                flush,
            });
        }
        self.grow_kv(&seqs)?;
        let x = self.run(&seqs, Phase::Decode)?;
        for s in &seqs {
            let h = self.pools.counters().ring(s.slot).len;
            match s.form {
                DecodeForm::Recurrent => {}
                DecodeForm::KvOnly => self.pools.ring_commit(s.slot, 1)?,
                DecodeForm::Replay => {
                    self.pools.ring_commit(s.slot, 1)?;
                    if s.flush {
                        // The step folded every committed entry, its own included.
                        self.pools.ring_flush(s.slot, h + 1)?;
                    }
                }
            }
            self.pools.conv_advance(s.slot, 1)?;
            self.position[s.slot] += 1;
        }
        self.model.head_logits(&x, 0).map_err(|e| match e {
            EngineError::NonFinite { position } => EngineError::NonFinite {
                position: seqs.get(position).map_or(position, |s| s.pos),
            },
            other => other,
        })
    }

    /// Speculative verification of `tokens` (`T` of them, `1 ≤ T ≤ max_verify`) appended to a sequence: returns
    /// logits `[T, vocab]`, row `s` being the prediction after `tokens[..=s]`. Nothing is committed until
    /// [`Decoder::commit`]: replay and kv-only sequences read their checkpoint and ring (Alg. 4 / 8, drafts written
    /// past the committed entries); recurrent ones run the baseline with one state snapshot per draft.
    pub fn verify(&mut self, slot: usize, tokens: &[u32]) -> Result<Vec<f32>> {
        self.check_idle(slot)?;
        let t = tokens.len();
        if t == 0 || t > self.config.max_verify {
            return Err(EngineError::InvalidInput(format!(
                "a verify takes 1 to {} tokens, found {t}",
                self.config.max_verify
            )));
        }
        let pos = self.position[slot];
        self.model.check_tokens(tokens, pos)?;
        let _span = debug_span!("verify", slot, drafts = t).entered();
        self.traffic = Traffic::default();
        let (form, flush) = self.plan_step(slot, t)?;
        let seq = Seq {
            slot,
            tokens,
            pos,
            form,
            flush,
        };
        self.grow_kv(std::slice::from_ref(&seq))?;
        let h = self.pools.counters().ring(slot).len;
        let x = self.run(std::slice::from_ref(&seq), Phase::Verify)?;
        if flush {
            // The verify folded the committed history into the checkpoint; the drafts stay pending.
            self.pools.ring_flush(slot, h)?;
        }
        self.pending[slot] = t;
        self.model.head_logits(&x, pos)
    }

    /// Accepts the first `accepted` (0..=T) tokens of the slot's last verify: ring length, conv head and KV length
    /// advance by `accepted` (pointer moves); a recurrent sequence takes snapshot `accepted − 1` as its state.
    pub fn commit(&mut self, slot: usize, accepted: usize) -> Result<()> {
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
        let _span = debug_span!("commit", slot, accepted, drafts = t).entered();
        self.traffic = Traffic::default();
        match self.pools.counters().form_of(slot) {
            DecodeForm::Recurrent => self.commit_baseline(slot, accepted)?,
            DecodeForm::Replay | DecodeForm::KvOnly => self.pools.ring_commit(slot, accepted)?,
        }
        self.pools.conv_advance(slot, accepted)?;
        let pos = self.position[slot] + accepted;
        self.pools.kv_truncate(slot, pos)?;
        self.position[slot] = pos;
        self.pending[slot] = 0;
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

    /// Decides, before a step appending `t` tokens to `slot`, its form (compressing a KV-only sequence whose context
    /// has reached the threshold) and its flush flag, which is written to the slot's counters.
    ///
    /// A kv-only step starts with `h < threshold` committed entries and appends `t ≤ T`, so it fits the slot's ring
    /// of `threshold + T`; a verify may cross the threshold, and the step after its commit compresses.
    ///
    /// The flush is one window early: the step flushes unless the ring keeps room for the next window after it,
    /// `h + t + T ≤ L` with `T` the verify window (`max_verify`). With every step a full window (`t = T`) this is
    /// ReplaySSM's `h + 2T > L`; for plain decode (`t = T = 1`) it is `h + 2 > L`. Using the largest window rather
    /// than this step's keeps a window's worth of free rows even after a run of shorter steps.
    fn plan_step(&mut self, slot: usize, t: usize) -> Result<(DecodeForm, bool)> {
        let mut form = self.pools.counters().form_of(slot);
        let h = self.pools.counters().ring(slot).len;
        if form == DecodeForm::KvOnly && h >= self.kv_threshold {
            self.compress(slot)?;
            form = DecodeForm::Replay;
        }
        let h = self.pools.counters().ring(slot).len;
        let window = self.config.max_verify.max(t);
        let flush = form == DecodeForm::Replay && h + t + window > self.config.buffer_len;
        self.pools.set_flush(slot, flush)?;
        Ok((form, flush))
    }

    /// Grows every sequence's KV length by its tokens; on failure the ones already grown are rolled back.
    fn grow_kv(&mut self, seqs: &[Seq]) -> Result<()> {
        for (i, s) in seqs.iter().enumerate() {
            if let Err(e) = self.pools.kv_grow(s.slot, s.pos + s.tokens.len()) {
                for done in &seqs[..i] {
                    self.pools.kv_truncate(done.slot, done.pos)?;
                }
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// The SSM blocks' mixers with their SSM layer indices.
    fn ssm_mixers(&self) -> impl Iterator<Item = (usize, &'m Mixer)> + '_ {
        let blocks = self.model.blocks();
        self.ssm_blocks.iter().map(move |&(b, i)| (i, blocks[b].mixer()))
    }
}
