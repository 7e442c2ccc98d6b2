//! Per-slot counters as plain arrays indexed by slot: the data a decode kernel reads to find a sequence's ring
//! entries, conv history and KV length, and the data a commit kernel writes. One set serves every layer of a
//! sequence, since all its layers advance in lockstep.

use super::PoolError;

/// How a sequence is decoded (design.md, "Decode forms"); stored per slot as a `u8` so a batch can mix forms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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

/// Where a slot's logical ring entries live: entry `j` (0 = oldest) is at physical row `(start + j) % capacity`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingIndex {
    pub start: usize,
    /// Valid (committed) entries.
    pub len: usize,
    pub capacity: usize,
}

impl RingIndex {
    /// The physical row of logical entry `j`; entries at `j ≥ len` are where new (speculative) inputs go.
    pub fn physical(&self, j: usize) -> usize {
        (self.start + j) % self.capacity
    }
}

/// The per-slot counters.
#[derive(Clone, Debug)]
pub struct SlotCounters {
    ring_start: Vec<u32>,
    ring_len: Vec<u32>,
    flush: Vec<u8>,
    conv_head: Vec<u32>,
    kv_len: Vec<u32>,
    form: Vec<u8>,
    ring_capacity: usize,
    conv_capacity: usize,
    conv_window: usize,
    max_step: usize,
}

impl SlotCounters {
    /// Counters for `slots` slots with an input ring of `ring_capacity` entries and a conv ring holding a history of
    /// `conv_window` (`K − 1`) entries plus `spec_window` speculative ones.
    pub fn new(slots: usize, ring_capacity: usize, conv_window: usize, spec_window: usize) -> Self {
        SlotCounters {
            ring_start: vec![0; slots],
            ring_len: vec![0; slots],
            flush: vec![0; slots],
            conv_head: vec![0; slots],
            kv_len: vec![0; slots],
            form: vec![DecodeForm::Replay as u8; slots],
            ring_capacity,
            conv_capacity: conv_window + spec_window,
            conv_window,
            // A verify step feeds the last sampled token plus the T drafts.
            max_step: spec_window + 1,
        }
    }

    /// Counters of a fresh sequence: empty ring, conv head 0, KV length 0, no flush pending, `form`.
    pub fn reset(&mut self, slot: usize, form: DecodeForm) {
        self.ring_start[slot] = 0;
        self.ring_len[slot] = 0;
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

    /// Input-ring capacity `L`.
    pub fn ring_capacity(&self) -> usize {
        self.ring_capacity
    }
    /// Conv-ring capacity `K − 1 + T`.
    pub fn conv_capacity(&self) -> usize {
        self.conv_capacity
    }

    /// One slot's input-ring index.
    pub fn ring(&self, slot: usize) -> RingIndex {
        RingIndex {
            start: self.ring_start[slot] as usize,
            len: self.ring_len[slot] as usize,
            capacity: self.ring_capacity,
        }
    }

    /// One slot's conv-ring index: `len` is the `K − 1` history entries, oldest first.
    pub fn conv(&self, slot: usize) -> RingIndex {
        RingIndex {
            start: self.conv_head[slot] as usize,
            len: self.conv_window,
            capacity: self.conv_capacity,
        }
    }

    /// A slot's decode form.
    pub fn form_of(&self, slot: usize) -> DecodeForm {
        // Only `set_form` and `reset` write the array, both from a `DecodeForm`.
        DecodeForm::from_code(self.form[slot]).unwrap_or(DecodeForm::Replay)
    }

    /// Sets a slot's decode form.
    pub fn set_form(&mut self, slot: usize, form: DecodeForm) {
        self.form[slot] = form as u8;
    }

    /// Sets a slot's flush flag.
    pub fn set_flush(&mut self, slot: usize, flush: bool) {
        self.flush[slot] = flush as u8;
    }

    /// Commits `n` new entries written after the cached ones: `h += n`. Rejected drafts are never committed, so a
    /// rollback is the absence of this move.
    pub fn ring_commit(&mut self, slot: usize, n: usize) -> Result<(), PoolError> {
        let len = self.ring_len[slot] as usize;
        if len + n > self.ring_capacity {
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
        self.ring_start[slot] = ((self.ring_start[slot] as usize + n) % self.ring_capacity) as u32;
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
            capacity: self.ring_capacity,
        }
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
        c.set_form(2, DecodeForm::KvOnly);
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
