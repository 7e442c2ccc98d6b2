//! The input ring of one slot of one Mamba-2 layer: storage in physical row order plus a [`RingIndex`], so that
//! appends, flushes, commits and rollbacks never copy or relocate a row.

use super::{entry_bytes, heads_per_group};
use crate::cpu::mamba2::Mamba2Dims;
use crate::cpu::ring::RingIndex;
use crate::cpu::traffic::Traffic;

/// A borrowed view of one slot's ring for one Mamba-2 layer: storage plus counters.
///
/// Storage (row-major, `L` = the index's capacity): `x [L, heads, head_dim]`, `dt [L, heads]`,
/// `b [L, groups, state_dim]`, so a physical row of each array is one token's entry. The engine keeps these in
/// slot-indexed pools and borrows one slot's rows (lengths from [`Mamba2Ring::storage_lens`]) and its [`RingIndex`]
/// per call. Rows outside the committed and pending ranges are stale and never read.
#[derive(Debug)]
pub struct Mamba2Ring<'a> {
    pub(super) dims: Mamba2Dims,
    pub(super) x: &'a mut [f32],
    pub(super) dt: &'a mut [f32],
    pub(super) b: &'a mut [f32],
    pub(super) index: &'a mut RingIndex,
}

/// One logical entry of a Mamba-2 ring, borrowed: `x [heads, head_dim]`, `dt [heads]`, `b [groups, state_dim]`.
#[derive(Clone, Copy, Debug)]
pub struct Mamba2Entry<'a> {
    /// Values.
    pub x: &'a [f32],
    /// Step sizes.
    pub dt: &'a [f32],
    /// Keys.
    pub b: &'a [f32],
}

impl<'a> Mamba2Ring<'a> {
    /// Lengths of the `x`, `dt` and `b` storage of one ring of `capacity` entries.
    pub fn storage_lens(dims: Mamba2Dims, capacity: usize) -> (usize, usize, usize) {
        (
            capacity * dims.heads * dims.head_dim,
            capacity * dims.heads,
            capacity * dims.groups * dims.state_dim,
        )
    }

    /// Views `x`, `dt`, `b` (lengths from [`Mamba2Ring::storage_lens`] at `index.capacity`) and `index` as a ring;
    /// panics on a shape mismatch.
    pub fn new(
        dims: Mamba2Dims,
        x: &'a mut [f32],
        dt: &'a mut [f32],
        b: &'a mut [f32],
        index: &'a mut RingIndex,
    ) -> Self {
        heads_per_group(dims);
        index.check();
        let lens = Self::storage_lens(dims, index.capacity);
        assert_eq!((x.len(), dt.len(), b.len()), lens, "replay_mamba2: ring storage");
        Mamba2Ring { dims, x, dt, b, index }
    }

    /// The layer's sizes.
    pub fn dims(&self) -> Mamba2Dims {
        self.dims
    }

    /// Ring rows (`L`).
    pub fn capacity(&self) -> usize {
        self.index.capacity
    }

    /// The counters.
    pub fn index(&self) -> RingIndex {
        *self.index
    }

    /// Committed entries since the checkpoint (`h`).
    pub fn len(&self) -> usize {
        self.index.len
    }

    /// Whether no committed entry is cached.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Starts a new sequence in this slot ([`RingIndex::reset`]).
    pub fn reset(&mut self) {
        self.index.reset();
    }

    /// Physical row of logical entry `j`.
    pub fn physical(&self, j: usize) -> usize {
        self.index.physical(j)
    }

    /// Logical entry `j`, committed or pending (`j < len + pending`).
    pub fn entry(&self, j: usize) -> Mamba2Entry<'_> {
        assert!(
            j < self.index.len + self.index.pending,
            "replay_mamba2: entry {j} not in {:?}",
            self.index
        );
        let d = self.dims;
        let (hp, gn) = (d.heads * d.head_dim, d.groups * d.state_dim);
        let r = self.physical(j);
        Mamba2Entry {
            x: &self.x[r * hp..(r + 1) * hp],
            dt: &self.dt[r * d.heads..(r + 1) * d.heads],
            b: &self.b[r * gn..(r + 1) * gn],
        }
    }

    /// Appends `t` entries as committed (`x` `[t, heads, head_dim]`, `dt` `[t, heads]`, `b` `[t, groups, state_dim]`),
    /// e.g. a prompt's inputs after a prefill in the KV-only form. Returns the ring write.
    pub fn push(&mut self, x: &[f32], dt: &[f32], b: &[f32]) -> Traffic {
        let t = dt.len() / self.dims.heads;
        self.write(self.index.len, t, x, dt, b);
        self.index.push(t);
        Traffic {
            ring_written: t as u64 * entry_bytes(self.dims),
            ..Traffic::default()
        }
    }

    /// Writes `t` entries at logical `from..from + t` without moving the counters.
    pub(super) fn write(&mut self, from: usize, t: usize, x: &[f32], dt: &[f32], b: &[f32]) {
        let d = self.dims;
        let (hp, gn) = (d.heads * d.head_dim, d.groups * d.state_dim);
        assert!(
            x.len() == t * hp && dt.len() == t * d.heads && b.len() == t * gn,
            "replay_mamba2: entries to append"
        );
        assert!(
            from + t <= self.index.capacity,
            "replay_mamba2: {from} + {t} entries overflow a ring of {}",
            self.index.capacity
        );
        for s in 0..t {
            let r = self.physical(from + s);
            self.x[r * hp..(r + 1) * hp].copy_from_slice(&x[s * hp..(s + 1) * hp]);
            self.dt[r * d.heads..(r + 1) * d.heads].copy_from_slice(&dt[s * d.heads..(s + 1) * d.heads]);
            self.b[r * gn..(r + 1) * gn].copy_from_slice(&b[s * gn..(s + 1) * gn]);
        }
    }
}

/// A ring that owns its storage (tests, single-sequence use); [`Mamba2RingBuf::view`] gives the [`Mamba2Ring`] the
/// ops take. The engine keeps the same layout in slot pools and builds views over slices of them.
#[derive(Clone, Debug)]
pub struct Mamba2RingBuf {
    dims: Mamba2Dims,
    /// `[capacity, heads, head_dim]`.
    pub x: Vec<f32>,
    /// `[capacity, heads]`.
    pub dt: Vec<f32>,
    /// `[capacity, groups, state_dim]`.
    pub b: Vec<f32>,
    /// The counters.
    pub index: RingIndex,
}

impl Mamba2RingBuf {
    /// An empty ring of `capacity` entries (storage zeroed).
    pub fn new(dims: Mamba2Dims, capacity: usize) -> Self {
        let (lx, ldt, lb) = Mamba2Ring::storage_lens(dims, capacity);
        Mamba2RingBuf {
            dims,
            x: vec![0.0; lx],
            dt: vec![0.0; ldt],
            b: vec![0.0; lb],
            index: RingIndex::new(capacity),
        }
    }

    /// The ring as the ops take it.
    pub fn view(&mut self) -> Mamba2Ring<'_> {
        Mamba2Ring::new(self.dims, &mut self.x, &mut self.dt, &mut self.b, &mut self.index)
    }
}
