//! The counters of one slot's input ring, shared by the replay kernels of every SSM family and by the engine's
//! per-slot counters, so that a kernel and the pools that feed it can never disagree on where an entry lives.

/// Where a slot's logical ring entries live: logical entry `j` is at physical row `(start + j) % capacity`.
///
/// Entries `0 .. len` are committed (part of the sequence's history since the checkpoint); entries
/// `len .. len + pending` are drafts the last verify appended, waiting for [`RingIndex::commit`]. Every move is a
/// counter change: appends write past `len + pending`, commits grow `len`, folds into the checkpoint move `start`,
/// and a rollback is a commit of fewer drafts. No entry is ever copied or relocated.
///
/// The capacity lives here rather than with the storage because it is per slot: a kv-only slot's ring is longer
/// than a replay slot's in the same pool, and a kernel must index both with the capacity the slot was filled with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingIndex {
    /// Physical row of logical entry 0 (`< capacity`).
    pub start: usize,
    /// Committed entries since the checkpoint (`h`).
    pub len: usize,
    /// Drafts appended after the committed entries, awaiting [`RingIndex::commit`]. The engine commits on the host
    /// and hands kernels an index with none.
    pub pending: usize,
    /// Rows of the ring (`L`, or `threshold + T` for a kv-only slot).
    pub capacity: usize,
}

impl RingIndex {
    /// An empty ring of `capacity` rows.
    pub fn new(capacity: usize) -> Self {
        RingIndex {
            start: 0,
            len: 0,
            pending: 0,
            capacity,
        }
    }

    /// Physical row of logical entry `j`; entries at `j ≥ len` are where new inputs go.
    pub fn physical(&self, j: usize) -> usize {
        assert!(j < self.capacity, "ring: entry {j} past capacity {}", self.capacity);
        (self.start + j) % self.capacity
    }

    /// Whether no committed entry is cached (the checkpoint is the whole state).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rows neither committed nor pending.
    pub fn free(&self) -> usize {
        self.capacity - self.len - self.pending
    }

    /// Empties the ring for a new sequence in a reused slot. The capacity stays, and so do the stale rows: every row
    /// is written before it is read.
    pub fn reset(&mut self) {
        *self = RingIndex::new(self.capacity);
    }

    /// Marks `t` entries written after the committed ones as pending drafts. Only one verify may be in flight, since
    /// its drafts sit exactly where the next one's would go.
    pub fn stage(&mut self, t: usize) {
        assert_eq!(self.pending, 0, "ring: commit the last verify first");
        assert!(
            self.len + t <= self.capacity,
            "ring: {} + {t} entries exceed capacity {}",
            self.len,
            self.capacity
        );
        self.pending = t;
    }

    /// Commits the first `accepted` pending drafts (`len += accepted`) and drops the rest, which later appends
    /// overwrite.
    pub fn commit(&mut self, accepted: usize) {
        assert!(
            accepted <= self.pending,
            "ring: {accepted} accepted of {} drafts",
            self.pending
        );
        self.len += accepted;
        self.pending = 0;
    }

    /// Appends `t` entries as committed, without a verify (a prompt's inputs, a decode's own token).
    pub fn push(&mut self, t: usize) {
        self.stage(t);
        self.commit(t);
    }

    /// Drops the `n` oldest committed entries after they were folded into the checkpoint: `start` moves past them and
    /// `len` shrinks. Pending drafts keep their rows and become logical entries `len − n ..`.
    pub fn fold(&mut self, n: usize) {
        assert!(n <= self.len, "ring: folding {n} of {} committed entries", self.len);
        self.start = (self.start + n) % self.capacity;
        self.len -= n;
    }

    /// Panics unless the counters describe a ring of `capacity > 0` rows.
    pub fn check(&self) {
        assert!(self.capacity > 0, "ring: zero capacity");
        assert!(self.start < self.capacity, "ring: {self:?}: start past the capacity");
        assert!(
            self.len + self.pending <= self.capacity,
            "ring: {self:?} overflows its capacity"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn physical_rows_wrap() {
        let r = RingIndex {
            start: 5,
            len: 6,
            pending: 0,
            capacity: 8,
        };
        assert_eq!(
            (r.physical(0), r.physical(2), r.physical(5), r.physical(7)),
            (5, 7, 2, 4)
        );
        assert_eq!(r.free(), 2);
    }

    #[test]
    #[should_panic(expected = "past capacity")]
    fn physical_refuses_entries_past_the_capacity() {
        RingIndex::new(4).physical(4);
    }

    #[test]
    fn stage_commit_fold_move_counters_only() {
        let mut r = RingIndex::new(8);
        r.push(3);
        assert_eq!((r.start, r.len, r.pending), (0, 3, 0));
        r.stage(4);
        let drafts: Vec<usize> = (3..7).map(|j| r.physical(j)).collect();
        // A fold between a verify and its commit leaves the drafts where they are.
        r.fold(3);
        assert_eq!((r.start, r.len, r.pending), (3, 0, 4));
        assert_eq!((0..4).map(|j| r.physical(j)).collect::<Vec<_>>(), drafts);
        r.commit(2);
        assert_eq!((r.start, r.len, r.pending), (3, 2, 0));
        r.fold(2);
        r.push(6);
        assert_eq!((r.start, r.len, r.physical(5)), (5, 6, 2));
        r.reset();
        assert_eq!(r, RingIndex::new(8), "a reset keeps the capacity");
    }

    #[test]
    #[should_panic(expected = "commit the last verify first")]
    fn one_verify_at_a_time() {
        let mut r = RingIndex::new(8);
        r.stage(2);
        r.stage(1);
    }

    #[test]
    #[should_panic(expected = "exceed capacity")]
    fn stage_refuses_an_overflow() {
        let mut r = RingIndex::new(4);
        r.push(2);
        r.stage(3);
    }

    #[test]
    #[should_panic(expected = "3 accepted of 2")]
    fn commit_refuses_more_than_was_staged() {
        let mut r = RingIndex::new(4);
        r.stage(2);
        r.commit(3);
    }

    #[test]
    #[should_panic(expected = "folding 2 of 1")]
    fn fold_refuses_pending_drafts() {
        let mut r = RingIndex::new(4);
        r.push(1);
        r.stage(2);
        r.fold(2);
    }

    #[test]
    fn check_accepts_valid_counters_only() {
        RingIndex::new(1).check();
        for bad in [
            RingIndex::new(0),
            RingIndex {
                start: 4,
                ..RingIndex::new(4)
            },
            RingIndex {
                len: 3,
                pending: 2,
                ..RingIndex::new(4)
            },
        ] {
            assert!(std::panic::catch_unwind(|| bad.check()).is_err(), "{bad:?}");
        }
    }
}
