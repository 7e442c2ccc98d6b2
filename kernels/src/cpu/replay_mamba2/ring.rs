//! The input ring of one slot of one Mamba-2 layer: storage in physical row order plus a cursor, so that appends,
//! flushes, commits and rollbacks never copy or relocate a row.

use super::{entry_bytes, heads_per_group};
use crate::cpu::mamba2::Mamba2Dims;
use crate::cpu::traffic::Traffic;

/// Where a slot's logical ring entries live: logical entry `j` is at physical row `(start + j) % capacity`. Nothing is
/// ever copied: appends write past `len`, flushes move `start`, commits and rollbacks move `len`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingCursor {
    /// Physical row of logical entry 0 (`< capacity`).
    pub start: usize,
    /// Committed entries since the checkpoint (`h`); speculative drafts sit at logical `len..len + T` until committed.
    pub len: usize,
}

impl RingCursor {
    /// Physical row of logical entry `j` in a ring of `capacity` rows.
    pub fn phys(&self, j: usize, capacity: usize) -> usize {
        (self.start + j) % capacity
    }

    /// Empties the ring for a new sequence in a reused slot (the stale rows stay: every row is written before it is
    /// read).
    pub fn reset(&mut self) {
        *self = RingCursor::default();
    }

    /// Commits `accepted` of the `t` drafts last written by [`verify_replay`](super::verify_replay)
    /// (`len += accepted`, a pointer move; the rejected drafts are overwritten by later appends). Also valid after a
    /// [`flush`](super::flush) between verify and commit.
    pub fn commit(&mut self, t: usize, accepted: usize, capacity: usize) {
        assert!(accepted <= t, "replay_mamba2: accepted {accepted} of {t} drafts");
        assert!(
            self.len + accepted <= capacity,
            "replay_mamba2: commit past the ring capacity"
        );
        self.len += accepted;
    }

    pub(super) fn advance(&mut self, n: usize, capacity: usize) {
        assert!(
            n <= self.len,
            "replay_mamba2: folding {n} of {} committed entries",
            self.len
        );
        self.start = (self.start + n) % capacity;
        self.len -= n;
    }
}

fn check_ring(d: Mamba2Dims, capacity: usize, x: usize, dt: usize, b: usize, cursor: RingCursor) {
    heads_per_group(d);
    assert!(capacity > 0, "replay_mamba2: empty ring");
    assert_eq!(x, capacity * d.heads * d.head_dim, "replay_mamba2: ring x");
    assert_eq!(dt, capacity * d.heads, "replay_mamba2: ring dt");
    assert_eq!(b, capacity * d.groups * d.state_dim, "replay_mamba2: ring B");
    assert!(
        cursor.start < capacity && cursor.len <= capacity,
        "replay_mamba2: cursor {cursor:?} for {capacity} rows"
    );
}

/// A read-only view of one slot's ring for one layer: `x` `[capacity, heads, head_dim]`, `dt` `[capacity, heads]`,
/// `b` `[capacity, groups, state_dim]` (rows in physical order) and the cursor.
#[derive(Clone, Copy, Debug)]
pub struct Mamba2RingRef<'a> {
    pub(super) dims: Mamba2Dims,
    pub(super) capacity: usize,
    pub(super) x: &'a [f32],
    pub(super) dt: &'a [f32],
    pub(super) b: &'a [f32],
    pub(super) cursor: RingCursor,
}

impl<'a> Mamba2RingRef<'a> {
    /// Wraps storage laid out as described on the type; panics on a shape mismatch.
    pub fn new(
        dims: Mamba2Dims,
        capacity: usize,
        x: &'a [f32],
        dt: &'a [f32],
        b: &'a [f32],
        cursor: RingCursor,
    ) -> Self {
        check_ring(dims, capacity, x.len(), dt.len(), b.len(), cursor);
        Mamba2RingRef {
            dims,
            capacity,
            x,
            dt,
            b,
            cursor,
        }
    }

    /// The layer's sizes.
    pub fn dims(&self) -> Mamba2Dims {
        self.dims
    }

    /// Ring rows (`L`).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Start and committed count.
    pub fn cursor(&self) -> RingCursor {
        self.cursor
    }

    /// Logical entry `j` (which may be a pending draft past `len`): `(x [heads, head_dim], dt [heads], B [groups,
    /// state_dim])`.
    pub fn entry(&self, j: usize) -> (&'a [f32], &'a [f32], &'a [f32]) {
        let d = self.dims;
        let (hp, gn) = (d.heads * d.head_dim, d.groups * d.state_dim);
        let r = self.cursor.phys(j, self.capacity);
        (
            &self.x[r * hp..(r + 1) * hp],
            &self.dt[r * d.heads..(r + 1) * d.heads],
            &self.b[r * gn..(r + 1) * gn],
        )
    }
}

/// A mutable view of one slot's ring for one layer (layout as in [`Mamba2RingRef`]); the cursor is borrowed so the
/// engine can keep cursors in their own per-slot array.
#[derive(Debug)]
pub struct Mamba2RingMut<'a> {
    pub(super) dims: Mamba2Dims,
    pub(super) capacity: usize,
    pub(super) x: &'a mut [f32],
    pub(super) dt: &'a mut [f32],
    pub(super) b: &'a mut [f32],
    pub(super) cursor: &'a mut RingCursor,
}

impl<'a> Mamba2RingMut<'a> {
    /// Wraps storage laid out as described on [`Mamba2RingRef`]; panics on a shape mismatch.
    pub fn new(
        dims: Mamba2Dims,
        capacity: usize,
        x: &'a mut [f32],
        dt: &'a mut [f32],
        b: &'a mut [f32],
        cursor: &'a mut RingCursor,
    ) -> Self {
        check_ring(dims, capacity, x.len(), dt.len(), b.len(), *cursor);
        Mamba2RingMut {
            dims,
            capacity,
            x,
            dt,
            b,
            cursor,
        }
    }

    /// A read-only view of the same ring.
    pub fn as_ref(&self) -> Mamba2RingRef<'_> {
        Mamba2RingRef {
            dims: self.dims,
            capacity: self.capacity,
            x: self.x,
            dt: self.dt,
            b: self.b,
            cursor: *self.cursor,
        }
    }

    /// The cursor (start, committed count).
    pub fn cursor(&self) -> RingCursor {
        *self.cursor
    }

    /// Empties the ring for a new sequence ([`RingCursor::reset`]).
    pub fn reset(&mut self) {
        self.cursor.reset();
    }

    /// [`RingCursor::commit`] on this ring.
    pub fn commit(&mut self, t: usize, accepted: usize) {
        self.cursor.commit(t, accepted, self.capacity);
    }

    /// Appends `t` entries as committed (`x` `[t, heads, head_dim]`, `dt` `[t, heads]`, `b` `[t, groups, state_dim]`),
    /// e.g. a prompt's inputs after a prefill in the KV-only form. Returns the ring write.
    pub fn push(&mut self, x: &[f32], dt: &[f32], b: &[f32]) -> Traffic {
        let t = dt.len() / self.dims.heads;
        let len = self.cursor.len;
        self.write(len, t, x, dt, b);
        self.cursor.len += t;
        Traffic {
            ring_written: t as u64 * entry_bytes(self.dims),
            ..Traffic::default()
        }
    }

    /// Writes `t` entries at logical `from..from + t` without moving the cursor.
    pub(super) fn write(&mut self, from: usize, t: usize, x: &[f32], dt: &[f32], b: &[f32]) {
        let d = self.dims;
        let (hp, gn) = (d.heads * d.head_dim, d.groups * d.state_dim);
        assert!(
            x.len() == t * hp && dt.len() == t * d.heads && b.len() == t * gn,
            "replay_mamba2: entries to append"
        );
        assert!(
            from + t <= self.capacity,
            "replay_mamba2: {from} + {t} entries overflow a ring of {}",
            self.capacity
        );
        for s in 0..t {
            let r = self.cursor.phys(from + s, self.capacity);
            self.x[r * hp..(r + 1) * hp].copy_from_slice(&x[s * hp..(s + 1) * hp]);
            self.dt[r * d.heads..(r + 1) * d.heads].copy_from_slice(&dt[s * d.heads..(s + 1) * d.heads]);
            self.b[r * gn..(r + 1) * gn].copy_from_slice(&b[s * gn..(s + 1) * gn]);
        }
    }
}

/// Ring storage owned in one place (tests, single-sequence use); the engine keeps the same layout in slot pools and
/// builds views over slices of them.
#[derive(Clone, Debug)]
pub struct Mamba2Ring {
    /// The layer's sizes.
    pub dims: Mamba2Dims,
    /// Rows (`L`).
    pub capacity: usize,
    /// `[capacity, heads, head_dim]`.
    pub x: Vec<f32>,
    /// `[capacity, heads]`.
    pub dt: Vec<f32>,
    /// `[capacity, groups, state_dim]`.
    pub b: Vec<f32>,
    /// Start and committed count.
    pub cursor: RingCursor,
}

impl Mamba2Ring {
    /// An empty ring of `capacity` zeroed rows.
    pub fn new(dims: Mamba2Dims, capacity: usize) -> Self {
        Mamba2Ring {
            dims,
            capacity,
            x: vec![0.0; capacity * dims.heads * dims.head_dim],
            dt: vec![0.0; capacity * dims.heads],
            b: vec![0.0; capacity * dims.groups * dims.state_dim],
            cursor: RingCursor::default(),
        }
    }

    /// A read-only view.
    pub fn view(&self) -> Mamba2RingRef<'_> {
        Mamba2RingRef::new(self.dims, self.capacity, &self.x, &self.dt, &self.b, self.cursor)
    }

    /// A mutable view.
    pub fn view_mut(&mut self) -> Mamba2RingMut<'_> {
        Mamba2RingMut::new(
            self.dims,
            self.capacity,
            &mut self.x,
            &mut self.dt,
            &mut self.b,
            &mut self.cursor,
        )
    }
}
