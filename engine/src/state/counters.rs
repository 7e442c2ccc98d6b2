//! Per-slot counters as plain arrays indexed by slot: the data a decode kernel reads to find a sequence's ring
//! entries, conv history and KV length, and the data a commit kernel writes. One set serves every layer of a
//! sequence, since all its layers advance in lockstep.

use rewind_kernels::cpu::ring::RingIndex;
use serde::Serialize;

use super::PoolError;

/// How a sequence is decoded (see docs/decode-forms.md); stored per slot as a `u8` so a batch can mix forms.
/// Serialized by its [`DecodeForm::name`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
#[repr(u8)]
pub enum DecodeForm {
    /// Read and write the full state every step (the baseline).
    Recurrent = 0,
    /// Checkpoint state plus input ring; the state is written only at flush.
    Replay = 1,
    /// No state while the context is short: the output comes from the ring alone.
    KvOnly = 2,
}

impl DecodeForm {
    /// Every form, in code order.
    pub const ALL: [DecodeForm; 3] = [DecodeForm::Recurrent, DecodeForm::Replay, DecodeForm::KvOnly];

    /// The form stored as `code`, if any.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|f| *f as u8 == code)
    }

    /// The CLI / table name.
    pub fn name(self) -> &'static str {
        match self {
            DecodeForm::Recurrent => "recurrent",
            DecodeForm::Replay => "replay",
            DecodeForm::KvOnly => "kv-only",
        }
    }
}

/// The per-slot counters.
///
/// Each slot has its own logical input-ring capacity (`ring_cap`, a plain array next to start and length, so a
/// kernel indexes entry `j` at `(start + j) % ring_cap[slot]`): `L` for replay and recurrent slots, `threshold + T`
/// for a kv-only slot, whose ring is its whole history. The physical rows per slot hold the largest of them.
#[derive(Clone, Debug)]
pub struct SlotCounters {
    ring_start: Vec<u32>,
    ring_len: Vec<u32>,
    ring_cap: Vec<u32>,
    flush: Vec<u8>,
    conv_head: Vec<u32>,
    kv_len: Vec<u32>,
    form: Vec<u8>,
    ring_capacity: usize,
    kv_only_capacity: usize,
    conv_capacity: usize,
    conv_window: usize,
    max_step: usize,
}

impl SlotCounters {
    /// Counters for `slots` slots with an input ring of `ring_capacity` entries and a conv ring holding a history of
    /// `conv_window` (`K − 1`) entries plus `spec_window` speculative ones. Kv-only slots use the same ring capacity;
    /// see [`SlotCounters::with_kv_only_capacity`].
    pub fn new(slots: usize, ring_capacity: usize, conv_window: usize, spec_window: usize) -> Self {
        SlotCounters {
            ring_start: vec![0; slots],
            ring_len: vec![0; slots],
            ring_cap: vec![ring_capacity as u32; slots],
            flush: vec![0; slots],
            conv_head: vec![0; slots],
            kv_len: vec![0; slots],
            form: vec![DecodeForm::Replay as u8; slots],
            ring_capacity,
            kv_only_capacity: ring_capacity,
            conv_capacity: conv_window + spec_window,
            conv_window,
            // A verify step feeds the last sampled token plus the T drafts.
            max_step: spec_window + 1,
        }
    }

    /// The same counters, with kv-only slots given a ring of `capacity` entries (`threshold + T`) instead of `L`.
    /// Every slot is reset to its form's capacity.
    pub fn with_kv_only_capacity(mut self, capacity: usize) -> Self {
        self.kv_only_capacity = capacity;
        for slot in 0..self.ring_cap.len() {
            self.ring_cap[slot] = self.capacity_for(self.form_of(slot)) as u32;
        }
        self
    }

    /// The ring capacity a slot in `form` uses: `threshold + T` for kv-only, `L` otherwise.
    pub fn capacity_for(&self, form: DecodeForm) -> usize {
        match form {
            DecodeForm::KvOnly => self.kv_only_capacity,
            DecodeForm::Recurrent | DecodeForm::Replay => self.ring_capacity,
        }
    }

    /// Counters of a fresh sequence: empty ring of `form`'s capacity, conv head 0, KV length 0, no flush pending,
    /// `form`.
    pub fn reset(&mut self, slot: usize, form: DecodeForm) {
        self.ring_start[slot] = 0;
        self.ring_len[slot] = 0;
        self.ring_cap[slot] = self.capacity_for(form) as u32;
        self.flush[slot] = 0;
        self.conv_head[slot] = 0;
        self.kv_len[slot] = 0;
        self.form[slot] = form as u8;
    }

    /// Input-ring start (physical row of the oldest cached entry), per slot.
    pub fn ring_start(&self) -> &[u32] {
        &self.ring_start
    }
    /// Cached entry count `h`, per slot.
    pub fn ring_len(&self) -> &[u32] {
        &self.ring_len
    }
    /// Logical input-ring capacity, per slot.
    pub fn ring_cap(&self) -> &[u32] {
        &self.ring_cap
    }
    /// Flush flag (0 or 1), per slot.
    pub fn flush(&self) -> &[u8] {
        &self.flush
    }
    /// Conv-ring head (physical row of the oldest of the `K − 1` history entries), per slot.
    pub fn conv_head(&self) -> &[u32] {
        &self.conv_head
    }
    /// KV length (tokens cached in every attention layer), per slot.
    pub fn kv_len(&self) -> &[u32] {
        &self.kv_len
    }
    /// Decode form code ([`DecodeForm`] as `u8`), per slot.
    pub fn form(&self) -> &[u8] {
        &self.form
    }

    /// Input-ring capacity `L` of replay and recurrent slots.
    pub fn ring_capacity(&self) -> usize {
        self.ring_capacity
    }
    /// Input-ring capacity of kv-only slots (`threshold + T`; `L` unless set).
    pub fn kv_only_capacity(&self) -> usize {
        self.kv_only_capacity
    }
    /// The physical ring rows each slot needs: the largest capacity any form uses.
    pub fn ring_rows(&self) -> usize {
        self.ring_capacity.max(self.kv_only_capacity)
    }
    /// Conv-ring capacity `K − 1 + T`.
    pub fn conv_capacity(&self) -> usize {
        self.conv_capacity
    }

    /// One slot's input-ring index.
    pub fn ring(&self, slot: usize) -> RingIndex {
        // Drafts are committed on the host (`ring_commit`), so a kernel never receives any.
        RingIndex {
            start: self.ring_start[slot] as usize,
            len: self.ring_len[slot] as usize,
            pending: 0,
            capacity: self.ring_cap[slot] as usize,
        }
    }

    /// One slot's conv-ring index: `len` is the `K − 1` history entries, oldest first.
    pub fn conv(&self, slot: usize) -> RingIndex {
        RingIndex {
            start: self.conv_head[slot] as usize,
            len: self.conv_window,
            pending: 0,
            capacity: self.conv_capacity,
        }
    }

    /// A slot's decode form.
    pub fn form_of(&self, slot: usize) -> DecodeForm {
        // Only `set_form` and `reset` write the array, both from a `DecodeForm`.
        DecodeForm::from_code(self.form[slot]).unwrap_or(DecodeForm::Replay)
    }

    /// Sets a slot's decode form, and its ring capacity to the form's. A capacity change re-indexes the ring, so it
    /// is allowed only while the ring is empty (a kv-only slot switches to replay right after its compress); the
    /// start goes back to row 0.
    pub fn set_form(&mut self, slot: usize, form: DecodeForm) -> Result<(), PoolError> {
        let cap = self.capacity_for(form);
        if cap != self.ring_cap[slot] as usize {
            let len = self.ring_len[slot] as usize;
            if len > 0 {
                return Err(PoolError::Ring {
                    slot,
                    op: "resize to a ring of",
                    n: cap,
                    len,
                    capacity: self.ring_cap[slot] as usize,
                });
            }
            self.ring_cap[slot] = cap as u32;
            self.ring_start[slot] = 0;
        }
        self.form[slot] = form as u8;
        Ok(())
    }

    /// Sets a slot's flush flag.
    pub fn set_flush(&mut self, slot: usize, flush: bool) {
        self.flush[slot] = flush as u8;
    }

    /// Commits `n` new entries written after the cached ones: `h += n`. Rejected drafts are never committed, so a
    /// rollback is the absence of this move.
    pub fn ring_commit(&mut self, slot: usize, n: usize) -> Result<(), PoolError> {
        let len = self.ring_len[slot] as usize;
        if len + n > self.ring_cap[slot] as usize {
            return Err(self.ring_error(slot, "commit", n));
        }
        self.ring_len[slot] = (len + n) as u32;
        Ok(())
    }

    /// Drops the `n` oldest entries after they were summarised into the checkpoint: the start moves, `h` shrinks.
    pub fn ring_flush(&mut self, slot: usize, n: usize) -> Result<(), PoolError> {
        let len = self.ring_len[slot] as usize;
        if n > len {
            return Err(self.ring_error(slot, "flush", n));
        }
        self.ring_start[slot] = ((self.ring_start[slot] as usize + n) % self.ring_cap[slot] as usize) as u32;
        self.ring_len[slot] = (len - n) as u32;
        Ok(())
    }

    /// Moves the conv history forward by `n` accepted tokens (at most `T + 1`, what one step can have written).
    pub fn conv_advance(&mut self, slot: usize, n: usize) -> Result<(), PoolError> {
        if n > self.max_step {
            return Err(PoolError::ConvAdvance {
                slot,
                n,
                max: self.max_step,
            });
        }
        if self.conv_capacity > 0 {
            self.conv_head[slot] = ((self.conv_head[slot] as usize + n) % self.conv_capacity) as u32;
        }
        Ok(())
    }

    /// Sets the KV length; the caller keeps the block table in step ([`super::StatePools`] does).
    pub(crate) fn set_kv_len(&mut self, slot: usize, len: usize) {
        self.kv_len[slot] = len as u32;
    }

    fn ring_error(&self, slot: usize, op: &'static str, n: usize) -> PoolError {
        PoolError::Ring {
            slot,
            op,
            n,
            len: self.ring_len[slot] as usize,
            capacity: self.ring_cap[slot] as usize,
        }
    }
}

/// The phase of a sequence's step, for [`SlotCounters::decide`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepPhase {
    /// A prompt chunk starting at `position`.
    Prefill { position: usize },
    /// One committed token.
    Decode,
    /// Drafts awaiting a commit.
    Verify,
}

/// How one sequence's step runs, decided from its counters alone, so that every engine (the CPU decoder, a GPU rank)
/// applies the same rules: [`SlotCounters::decide`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepDecision {
    /// Fold every committed ring entry into the checkpoint before the step (from a zero state when the slot is
    /// kv-only: its compress) and empty the ring; the slot continues in replay.
    pub fold_first: bool,
    /// A kv-only prompt at least as long as the threshold: the slot starts in replay (its ring is empty).
    pub start_replay: bool,
    /// The form the step runs in.
    pub form: DecodeForm,
    /// The step's flush flag.
    pub flush: bool,
}

impl SlotCounters {
    /// Decides how a step of `t` tokens runs for `slot`, with the kv-only `threshold`, the verify window `window`
    /// (`T`, at least 1) and the replay ring capacity `L` of these counters. Changes nothing: the caller folds,
    /// switches the form ([`SlotCounters::set_form`]) and sets the flag.
    ///
    /// - A prompt chunk at position 0 of a kv-only sequence at least `threshold` long starts it in replay; a later
    ///   chunk first folds the ring (compressing a kv-only ring), so the chunked scan starts from the whole history.
    /// - A decode or verify of a kv-only sequence whose committed context has reached the threshold compresses
    ///   first. The flush is one window early: the step flushes unless the ring keeps room for the next window after
    ///   it, `h + t + T ≤ L` ([`needs_flush`] with every step a full window); using the largest window rather than this
    ///   step's keeps a window's worth of free rows even after a run of shorter steps.
    pub fn decide(&self, slot: usize, phase: StepPhase, t: usize, threshold: usize, window: usize) -> StepDecision {
        let form = self.form_of(slot);
        let h = self.ring_len[slot] as usize;
        match phase {
            StepPhase::Prefill { position } => {
                let start_replay = position == 0 && form == DecodeForm::KvOnly && t >= threshold;
                let fold_first = position > 0 && (form == DecodeForm::KvOnly || h > 0);
                StepDecision {
                    fold_first,
                    start_replay,
                    form: if start_replay || (fold_first && form == DecodeForm::KvOnly) {
                        DecodeForm::Replay
                    } else {
                        form
                    },
                    flush: false,
                }
            }
            StepPhase::Decode | StepPhase::Verify => {
                let fold_first = form == DecodeForm::KvOnly && h >= threshold;
                let (form, h) = if fold_first { (DecodeForm::Replay, 0) } else { (form, h) };
                let window = window.max(t);
                StepDecision {
                    fold_first,
                    start_replay: false,
                    form,
                    flush: form == DecodeForm::Replay && h + t + window > self.ring_capacity,
                }
            }
        }
    }
}

impl SlotCounters {
    /// Moves `slot`'s counters after a step of `t` tokens ran in `form` with flush flag `flush`, its ring holding `h`
    /// committed entries before the step: the rules every engine applies after its device work (the CPU decoder's
    /// `decode/advance.rs`, a GPU rank's `gpu/steps.rs`), written once.
    ///
    /// - A prompt chunk of a kv-only sequence keeps its `t` entries; other forms' chunks went into the checkpoint.
    /// - A decode commits its entry in replay and kv-only (a replay flush folded every committed entry, its own
    ///   included: `h + 1` leave the ring), and moves every form's conv history by one.
    /// - A verify's flush folded the committed history (`h` entries); its drafts wait for [`SlotCounters::commit`].
    pub fn after_step(
        &mut self,
        slot: usize,
        phase: StepPhase,
        form: DecodeForm,
        flush: bool,
        h: usize,
        t: usize,
    ) -> Result<(), PoolError> {
        match (phase, form) {
            (StepPhase::Prefill { .. }, DecodeForm::KvOnly) => self.ring_commit(slot, t),
            (StepPhase::Prefill { .. }, _) => Ok(()),
            (StepPhase::Decode, DecodeForm::Recurrent) => self.conv_advance(slot, 1),
            (StepPhase::Decode, DecodeForm::KvOnly) => {
                self.ring_commit(slot, 1)?;
                self.conv_advance(slot, 1)
            }
            (StepPhase::Decode, DecodeForm::Replay) => {
                self.ring_commit(slot, 1)?;
                if flush {
                    self.ring_flush(slot, h + 1)?;
                }
                self.conv_advance(slot, 1)
            }
            (StepPhase::Verify, _) if flush => self.ring_flush(slot, h),
            (StepPhase::Verify, _) => Ok(()),
        }
    }

    /// Accepts the first `accepted` drafts of `slot`'s verify: a replay or kv-only ring keeps them (a pointer move; a
    /// rollback is the absence of this move) and the conv history moves by `accepted`. A recurrent slot's state is
    /// the caller's to replace (its baseline snapshot `accepted − 1`).
    pub fn commit(&mut self, slot: usize, accepted: usize) -> Result<(), PoolError> {
        if self.form_of(slot) != DecodeForm::Recurrent {
            self.ring_commit(slot, accepted)?;
        }
        self.conv_advance(slot, accepted)
    }
}

/// ReplaySSM's flush rule, one window early: flush before a step that appends up to `window` entries when
/// `h + 2·window > L`, which leaves at least `window` free entries on every later step.
pub fn needs_flush(h: usize, window: usize, capacity: usize) -> bool {
    h + 2 * window > capacity
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_moves_wrap_and_check() {
        let mut c = SlotCounters::new(2, 8, 3, 4);
        c.ring_commit(1, 5).expect("commit");
        c.ring_flush(1, 5).expect("flush");
        c.ring_commit(1, 6).expect("commit");
        let r = c.ring(1);
        assert_eq!(
            (r.start, r.len, r.physical(0), r.physical(2), r.physical(5)),
            (5, 6, 5, 7, 2)
        );
        assert!(matches!(c.ring_commit(1, 3), Err(PoolError::Ring { op: "commit", .. })));
        assert!(matches!(c.ring_flush(1, 7), Err(PoolError::Ring { op: "flush", .. })));
        assert_eq!(
            c.ring(0),
            RingIndex {
                start: 0,
                len: 0,
                pending: 0,
                capacity: 8
            },
            "other slots untouched"
        );
        assert_eq!((c.ring_start(), c.ring_len()), (&[0, 5][..], &[0, 6][..]));
    }

    #[test]
    fn conv_head_moves_by_accepted() {
        let mut c = SlotCounters::new(1, 16, 3, 4);
        assert_eq!(c.conv_capacity(), 7);
        c.conv_advance(0, 5).expect("T + 1 tokens");
        c.conv_advance(0, 4).expect("advance");
        assert_eq!(
            c.conv(0),
            RingIndex {
                start: 2,
                len: 3,
                pending: 0,
                capacity: 7
            }
        );
        assert!(matches!(
            c.conv_advance(0, 6),
            Err(PoolError::ConvAdvance { max: 5, .. })
        ));
        let mut c = SlotCounters::new(1, 16, 0, 0);
        c.conv_advance(0, 1).expect("a kernel of width 1 keeps no history");
        assert_eq!(c.conv_head()[0], 0);
    }

    #[test]
    fn reset_form_and_flush_flag() {
        let mut c = SlotCounters::new(3, 8, 3, 2);
        c.set_form(2, DecodeForm::KvOnly).expect("form");
        c.set_flush(2, true);
        c.ring_commit(2, 4).expect("commit");
        c.set_kv_len(2, 40);
        assert_eq!((c.form_of(2), c.flush()[2], c.kv_len()[2]), (DecodeForm::KvOnly, 1, 40));
        c.reset(2, DecodeForm::Recurrent);
        assert_eq!(
            (c.form_of(2), c.flush()[2], c.kv_len()[2], c.ring_len()[2]),
            (DecodeForm::Recurrent, 0, 0, 0)
        );
        for f in DecodeForm::ALL {
            assert_eq!(DecodeForm::from_code(f as u8), Some(f));
        }
        assert_eq!(DecodeForm::from_code(9), None);
    }

    #[test]
    fn kv_only_slots_have_their_own_capacity() {
        let mut c = SlotCounters::new(3, 8, 3, 2).with_kv_only_capacity(42);
        assert_eq!((c.ring_rows(), c.kv_only_capacity(), c.ring_capacity()), (42, 42, 8));
        c.reset(1, DecodeForm::KvOnly);
        c.ring_commit(1, 40)
            .expect("a kv-only ring holds threshold + T entries");
        assert_eq!(c.ring(1).capacity, 42);
        assert_eq!(c.ring(0).capacity, 8, "other slots keep L");
        assert!(matches!(c.ring_commit(1, 3), Err(PoolError::Ring { capacity: 42, .. })));
        assert!(
            c.set_form(1, DecodeForm::Replay).is_err(),
            "the capacity cannot change under cached entries"
        );
        c.ring_flush(1, 40).expect("compress");
        c.set_form(1, DecodeForm::Replay).expect("switch on an empty ring");
        assert_eq!((c.ring(1).start, c.ring(1).capacity, c.ring_cap()[1]), (0, 8, 8));
        c.ring_commit(1, 8).expect("replay ring of L");
        assert!(c.ring_commit(1, 1).is_err());
        c.set_form(1, DecodeForm::Recurrent)
            .expect("same capacity: no resize needed");
        assert_eq!(c.ring(1).len, 8);
    }

    #[test]
    fn decide_applies_the_shared_rules() {
        // L = 8, conv K − 1 = 3, T = 2; kv-only rings of threshold 5 + T = 7.
        let (threshold, window) = (5, 2);
        let mut c = SlotCounters::new(2, 8, 3, window).with_kv_only_capacity(threshold + window);
        c.reset(0, DecodeForm::KvOnly);
        let prefill = |position| StepPhase::Prefill { position };
        // A kv-only prompt shorter than the threshold stays kv-only; one at least as long starts in replay.
        let d = c.decide(0, prefill(0), 4, threshold, window);
        assert_eq!(
            (d.form, d.start_replay, d.fold_first),
            (DecodeForm::KvOnly, false, false)
        );
        let d = c.decide(0, prefill(0), 5, threshold, window);
        assert_eq!(
            (d.form, d.start_replay, d.fold_first),
            (DecodeForm::Replay, true, false)
        );
        // A later chunk of a kv-only prompt compresses first.
        c.ring_commit(0, 4).expect("prompt entries");
        let d = c.decide(0, prefill(4), 3, threshold, window);
        assert_eq!((d.form, d.fold_first, d.flush), (DecodeForm::Replay, true, false));
        // Decode below the threshold stays kv-only and never flushes; at the threshold it compresses into replay.
        let d = c.decide(0, StepPhase::Decode, 1, threshold, window);
        assert_eq!((d.form, d.fold_first, d.flush), (DecodeForm::KvOnly, false, false));
        c.ring_commit(0, 1).expect("decode entry");
        let d = c.decide(0, StepPhase::Verify, 2, threshold, window);
        assert_eq!((d.form, d.fold_first, d.flush), (DecodeForm::Replay, true, false));
        // Replay flushes one window early: h + t + T > L.
        c.reset(1, DecodeForm::Replay);
        c.ring_commit(1, 5).expect("entries");
        assert!(
            !c.decide(1, StepPhase::Decode, 1, threshold, window).flush,
            "5 + 1 + 2 = 8 fits"
        );
        c.ring_commit(1, 1).expect("entry");
        assert!(
            c.decide(1, StepPhase::Decode, 1, threshold, window).flush,
            "6 + 1 + 2 > 8"
        );
        assert!(c.decide(1, StepPhase::Verify, 2, threshold, window).flush);
        // A recurrent slot never flushes or folds.
        c.reset(1, DecodeForm::Recurrent);
        let d = c.decide(1, StepPhase::Decode, 1, threshold, window);
        assert_eq!((d.form, d.fold_first, d.flush), (DecodeForm::Recurrent, false, false));
    }

    #[test]
    fn after_step_and_commit_move_the_counters_by_the_shared_rules() {
        // L = 8, conv K − 1 = 3, T = 2.
        let mut c = SlotCounters::new(3, 8, 3, 2);
        c.reset(0, DecodeForm::KvOnly);
        c.after_step(0, StepPhase::Prefill { position: 0 }, DecodeForm::KvOnly, false, 0, 4)
            .expect("kv-only prompt");
        assert_eq!(
            (c.ring(0).len, c.conv(0).start),
            (4, 0),
            "a kv-only prompt keeps its entries"
        );
        c.reset(1, DecodeForm::Replay);
        c.after_step(1, StepPhase::Prefill { position: 0 }, DecodeForm::Replay, false, 0, 4)
            .expect("replay prompt");
        assert_eq!(c.ring(1).len, 0, "a replay prompt goes into the checkpoint");
        c.ring_commit(1, 5).expect("entries");
        c.after_step(1, StepPhase::Decode, DecodeForm::Replay, false, 5, 1)
            .expect("decode");
        assert_eq!((c.ring(1).start, c.ring(1).len, c.conv(1).start), (0, 6, 1));
        c.after_step(1, StepPhase::Decode, DecodeForm::Replay, true, 6, 1)
            .expect("flushing decode");
        assert_eq!(
            (c.ring(1).start, c.ring(1).len, c.conv(1).start),
            (7, 0, 2),
            "h + 1 folded"
        );
        c.ring_commit(1, 3).expect("entries");
        c.after_step(1, StepPhase::Verify, DecodeForm::Replay, true, 3, 2)
            .expect("flushing verify");
        assert_eq!(
            (c.ring(1).len, c.conv(1).start),
            (0, 2),
            "the committed history folded, the drafts pending"
        );
        c.commit(1, 2).expect("commit");
        assert_eq!((c.ring(1).len, c.conv(1).start), (2, 4));
        c.reset(2, DecodeForm::Recurrent);
        c.after_step(2, StepPhase::Decode, DecodeForm::Recurrent, false, 0, 1)
            .expect("recurrent decode");
        c.commit(2, 2).expect("recurrent commit");
        assert_eq!((c.ring(2).len, c.conv(2).start), (0, 3), "a recurrent ring stays empty");
        assert!(c
            .after_step(0, StepPhase::Decode, DecodeForm::KvOnly, false, 4, 1)
            .is_ok());
        assert!(c.commit(0, 9).is_err(), "beyond the ring");
    }

    #[test]
    fn flush_rule_keeps_a_window_free() {
        // L = 16, T = 4: flush at h = 9 (9 + 8 > 16), not at h = 8.
        assert!(!needs_flush(8, 4, 16));
        assert!(needs_flush(9, 4, 16));
        // Simulate worst-case acceptance: after every step the ring still has room for the next window.
        let (l, t) = (16, 4);
        let mut h = 0;
        for _ in 0..50 {
            if needs_flush(h, t, l) {
                h = 0;
            }
            assert!(h + t <= l, "window truncated at h = {h}");
            h += t;
        }
    }
}
