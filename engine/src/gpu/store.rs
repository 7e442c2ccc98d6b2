//! The GPU rank's store of slot states (the prefix cache's entries, `actors/src/coordinator/prefix/`): a stored
//! state is a device-to-device copy of one slot — every SSM layer's checkpoint, committed ring entries and conv
//! history, every attention layer's KV rows of the slot's positions — in buffers of its own, so caching a finished
//! sequence and starting a request from it never move a byte across PCIe. The layout is the snapshot's
//! (`gpu/snapshot.rs`): rings and conv history in logical order, KV rows contiguous, so a restore into any slot rebuilds
//! them from row 0.
//!
//! The store's memory is set aside when the rank sizes its pools (`GpuOptions::prefix_store`); a state that does not
//! fit is not kept (the caller evicts and retries), so storing never takes memory the pools were planned to have.

use std::collections::HashMap;

use rewind_kernels::cuda::{ops, CudaSlice};

use super::rank::GpuRank;
use super::state::LayerPool;
use super::Act;
use crate::decode::FormChoice;
use crate::error::{EngineError, Result};
use crate::state::DecodeForm;

/// One layer of a stored state.
enum StoredLayer<A: Act> {
    None,
    Ssm {
        state: CudaSlice<f32>,
        /// `[ring_len, ·]` each, oldest first, in the pool's field order.
        ring_a: Option<CudaSlice<A>>,
        ring_f: Option<CudaSlice<f32>>,
        ring_b: Option<CudaSlice<A>>,
        /// `[conv_len, conv_dim]`, oldest first.
        conv: Option<CudaSlice<A>>,
    },
    Kv {
        /// `[position, kv row]`.
        k: Option<CudaSlice<A>>,
        v: Option<CudaSlice<A>>,
    },
}

/// One stored slot state.
struct Stored<A: Act> {
    form_choice: FormChoice,
    form: DecodeForm,
    position: usize,
    ring_len: usize,
    conv_len: usize,
    layers: Vec<StoredLayer<A>>,
    bytes: u64,
}

/// The stored states of one GPU rank, within a byte budget.
pub(crate) struct DeviceStore<A: Act> {
    states: HashMap<u64, Stored<A>>,
    used: u64,
    capacity: u64,
}

impl<A: Act> DeviceStore<A> {
    /// An empty store of at most `capacity` bytes.
    pub(crate) fn new(capacity: u64) -> Self {
        DeviceStore {
            states: HashMap::new(),
            used: 0,
            capacity,
        }
    }
}

/// `[n, 2]` (source, destination) row pairs for `copy_rows`.
fn pairs(it: impl Iterator<Item = (usize, usize)>) -> Vec<i32> {
    it.flat_map(|(s, d)| [s as i32, d as i32]).collect()
}

/// The row width of a pool of `n` slots of `per_slot` rows, and the element range of `slot`'s rows.
fn slot_rows<T: rewind_kernels::cuda::DeviceRepr>(
    pool: &CudaSlice<T>,
    slot: usize,
    n: usize,
    per_slot: usize,
) -> (usize, std::ops::Range<usize>) {
    let width = width_of(pool, n, per_slot);
    (width, slot * per_slot * width..(slot + 1) * per_slot * width)
}

/// The row width of a pool of `n` slots of `per_slot` rows.
fn width_of<T: rewind_kernels::cuda::DeviceRepr>(pool: &CudaSlice<T>, n: usize, per_slot: usize) -> usize {
    pool.len() / (n * per_slot).max(1)
}

impl<A: Act> GpuRank<A> {
    /// The bytes a state of `slot` would take in the store.
    fn stored_bytes(&self, slot: usize, position: usize) -> u64 {
        let (n, rows) = (self.sizes.max_seqs, self.sizes.rows.ring);
        let ring_len = self.counters.ring(slot).len;
        let conv_len = self.counters.conv(slot).len;
        let conv_rows = self.counters.conv_capacity();
        let act = std::mem::size_of::<A>() as u64;
        self.pools
            .iter()
            .map(|p| match p {
                LayerPool::Ssm {
                    conv,
                    ssm,
                    ring_a,
                    ring_f,
                    ring_b,
                } => {
                    let ring = (width_of(ring_a, n, rows) + width_of(ring_b, n, rows)) as u64 * act
                        + width_of(ring_f, n, rows) as u64 * 4;
                    (ssm.len() / n) as u64 * 4
                        + ring_len as u64 * ring
                        + (conv_len * width_of(conv, n, conv_rows)) as u64 * act
                }
                LayerPool::Kv { layout, .. } => 2 * (position * layout.kv_heads * layout.head_dim) as u64 * act,
                LayerPool::None => 0,
            })
            .sum()
    }

    /// The KV pool rows of `slot`'s positions `0 .. position`, each paired with its row in a stored state, on the
    /// device for `copy_rows`: `(pool, stored)` pairs to store, `(stored, pool)` pairs to restore.
    fn kv_pairs(&self, slot: usize, position: usize, restore: bool) -> Result<Option<CudaSlice<i32>>> {
        if self.books.kv().is_none() {
            return Ok(None);
        }
        let runs = self.kv_runs(slot, position)?;
        let mut at = 0;
        let list = runs.iter().flat_map(|&(first, count)| {
            let start = at;
            at += count;
            (0..count).map(move |i| match restore {
                false => (first + i, start + i),
                true => (start + i, first + i),
            })
        });
        Ok(Some(self.inner.dev.upload(&pairs(list))?))
    }

    /// [`crate::rank::Rank::store`] on a GPU rank.
    pub(super) fn store_slot(&mut self, slot: usize, id: u64) -> Result<Option<u64>> {
        let position = self.idle_len(slot, "store")?;
        let bytes = self.stored_bytes(slot, position);
        // A state stored again under its id replaces the old one.
        let replaced = self.store.states.get(&id).map_or(0, |s| s.bytes);
        if self.store.used - replaced + bytes > self.store.capacity {
            return Ok(None);
        }
        let (n, rows) = (self.sizes.max_seqs, self.sizes.rows.ring);
        let conv_rows = self.counters.conv_capacity();
        let (ring, conv_idx) = (self.counters.ring(slot), self.counters.conv(slot));
        let dev = self.inner.dev.clone();
        let ring_pairs = dev.upload(&pairs((0..ring.len).map(|j| (ring.physical(j), j))))?;
        let conv_pairs = dev.upload(&pairs((0..conv_idx.len).map(|j| (conv_idx.physical(j), j))))?;
        let kv_pairs = self.kv_pairs(slot, position, false)?;
        let mut layers = Vec::with_capacity(self.pools.len());
        for pool in &self.pools {
            layers.push(match pool {
                LayerPool::Ssm {
                    conv,
                    ssm,
                    ring_a,
                    ring_f,
                    ring_b,
                } => {
                    let sl = ssm.len() / n;
                    let mut state = dev.alloc::<f32>(sl)?;
                    dev.stream()
                        .memcpy_dtod(&ssm.slice(slot * sl..(slot + 1) * sl), &mut state)
                        .map_err(|e| EngineError::Gpu(format!("storing an SSM state: {e}")))?;
                    StoredLayer::Ssm {
                        state,
                        ring_a: gather_rows(&dev, ring_a, slot, n, rows, ring.len, &ring_pairs)?,
                        ring_f: gather_rows(&dev, ring_f, slot, n, rows, ring.len, &ring_pairs)?,
                        ring_b: gather_rows(&dev, ring_b, slot, n, rows, ring.len, &ring_pairs)?,
                        conv: gather_rows(&dev, conv, slot, n, conv_rows, conv_idx.len, &conv_pairs)?,
                    }
                }
                LayerPool::Kv { k, v, layout } => {
                    let row = layout.kv_heads * layout.head_dim;
                    let p = kv_pairs
                        .as_ref()
                        .ok_or_else(|| EngineError::InvalidInput("the model has no KV blocks".into()))?;
                    StoredLayer::Kv {
                        k: gather_kv(&dev, k, row, position, p)?,
                        v: gather_kv(&dev, v, row, position, p)?,
                    }
                }
                LayerPool::None => StoredLayer::None,
            });
        }
        // The pair buffers must outlive the copies that read them.
        dev.synchronize()?;
        let stored = Stored {
            form_choice: self.choice[slot],
            form: self.counters.form_of(slot),
            position,
            ring_len: ring.len,
            conv_len: conv_idx.len,
            layers,
            bytes,
        };
        self.store.used = self.store.used - replaced + bytes;
        self.store.states.insert(id, stored);
        Ok(Some(bytes))
    }

    /// [`crate::rank::Rank::restore_stored`] on a GPU rank.
    pub(super) fn restore_stored_slot(&mut self, slot: usize, id: u64) -> Result<()> {
        let (form_choice, form, position, ring_len, conv_len) = {
            let s = self
                .store
                .states
                .get(&id)
                .ok_or_else(|| EngineError::InvalidInput(format!("no state is stored under id {id}")))?;
            (s.form_choice, s.form, s.position, s.ring_len, s.conv_len)
        };
        if ring_len > self.counters.capacity_for(form) {
            return Err(EngineError::InvalidInput(format!(
                "a stored {} state of {ring_len} ring entries does not fit this rank's pools",
                form.name()
            )));
        }
        self.books.open_at(slot, form_choice)?;
        self.counters.reset(slot, form);
        self.choice[slot] = form_choice;
        let filled = self
            .books
            .restored(slot, position)
            .and_then(|()| self.fill_stored(slot, id, position, conv_len))
            .and_then(|()| Ok(self.counters.ring_commit(slot, ring_len)?));
        if let Err(e) = filled {
            // A half-restored slot must not stay open.
            self.books.close(slot)?;
            return Err(e);
        }
        self.table_dirty = true;
        Ok(())
    }

    fn fill_stored(&mut self, slot: usize, id: u64, position: usize, conv_len: usize) -> Result<()> {
        let (n, rows) = (self.sizes.max_seqs, self.sizes.rows.ring);
        let conv_rows = self.counters.conv_capacity();
        if self.counters.conv(slot).len != conv_len {
            return Err(EngineError::InvalidInput(format!(
                "a stored conv history of {conv_len} rows does not fit this rank's {}",
                self.counters.conv(slot).len
            )));
        }
        let dev = self.inner.dev.clone();
        let kv_pairs = self.kv_pairs(slot, position, true)?;
        let stored = self
            .store
            .states
            .get(&id)
            .ok_or_else(|| EngineError::InvalidInput(format!("no state is stored under id {id}")))?;
        for (pool, layer) in self.pools.iter_mut().zip(&stored.layers) {
            match (pool, layer) {
                (
                    LayerPool::Ssm {
                        conv,
                        ssm,
                        ring_a,
                        ring_f,
                        ring_b,
                    },
                    StoredLayer::Ssm {
                        state,
                        ring_a: sa,
                        ring_f: sf,
                        ring_b: sb,
                        conv: sc,
                    },
                ) => {
                    let sl = ssm.len() / n;
                    if state.len() != sl {
                        return Err(EngineError::InvalidInput(
                            "a stored SSM state does not fit this rank's pools".into(),
                        ));
                    }
                    let copy = |e| EngineError::Gpu(format!("restoring a stored state: {e}"));
                    dev.stream()
                        .memcpy_dtod(state, &mut ssm.slice_mut(slot * sl..(slot + 1) * sl))
                        .map_err(copy)?;
                    put_rows(&dev, sa.as_ref(), ring_a, slot, n, rows)?;
                    put_rows(&dev, sf.as_ref(), ring_f, slot, n, rows)?;
                    put_rows(&dev, sb.as_ref(), ring_b, slot, n, rows)?;
                    put_rows(&dev, sc.as_ref(), conv, slot, n, conv_rows)?;
                }
                (LayerPool::Kv { k, v, layout }, StoredLayer::Kv { k: sk, v: sv }) => {
                    let row = layout.kv_heads * layout.head_dim;
                    if let (Some(sk), Some(sv), Some(p)) = (sk, sv, kv_pairs.as_ref()) {
                        ops::copy_rows(&dev, sk, p, row, k)?;
                        ops::copy_rows(&dev, sv, p, row, v)?;
                    }
                }
                (LayerPool::None, StoredLayer::None) => {}
                _ => {
                    return Err(EngineError::InvalidInput(
                        "a stored state's layers do not match this rank's".into(),
                    ))
                }
            }
        }
        // The pair buffer must outlive the copies that read it.
        dev.synchronize()?;
        Ok(())
    }

    /// [`crate::rank::Rank::drop_stored`] on a GPU rank.
    pub(super) fn drop_stored_states(&mut self, ids: &[u64]) {
        for id in ids {
            if let Some(s) = self.store.states.remove(id) {
                self.store.used -= s.bytes;
            }
        }
    }
}

/// Logical rows `0 .. count` of `slot`'s part of a pool (`pairs` maps each one's physical row to it), copied into a
/// buffer of their own; `None` for no rows.
fn gather_rows<T: rewind_kernels::cuda::Elem>(
    dev: &rewind_kernels::cuda::CudaDevice,
    pool: &CudaSlice<T>,
    slot: usize,
    n: usize,
    per_slot: usize,
    count: usize,
    pairs: &CudaSlice<i32>,
) -> Result<Option<CudaSlice<T>>> {
    if count == 0 {
        return Ok(None);
    }
    let (width, range) = slot_rows(pool, slot, n, per_slot);
    let mut out = dev.alloc::<T>(count * width)?;
    ops::copy_rows(dev, &pool.slice(range), pairs, width, &mut out)?;
    Ok(Some(out))
}

/// Writes stored rows to rows `0 ..` of `slot`'s part of a pool.
fn put_rows<T: rewind_kernels::cuda::Elem>(
    dev: &rewind_kernels::cuda::CudaDevice,
    rows: Option<&CudaSlice<T>>,
    pool: &mut CudaSlice<T>,
    slot: usize,
    n: usize,
    per_slot: usize,
) -> Result<()> {
    let Some(rows) = rows else { return Ok(()) };
    let (_, range) = slot_rows(pool, slot, n, per_slot);
    let at = range.start;
    dev.stream()
        .memcpy_dtod(rows, &mut pool.slice_mut(at..at + rows.len()))
        .map_err(|e| EngineError::Gpu(format!("restoring a stored ring: {e}")))
}

/// KV rows `0 .. position` of a slot (`pairs` maps each one's pool row to it) in a buffer of their own.
fn gather_kv<T: rewind_kernels::cuda::Elem>(
    dev: &rewind_kernels::cuda::CudaDevice,
    pool: &CudaSlice<T>,
    row: usize,
    position: usize,
    pairs: &CudaSlice<i32>,
) -> Result<Option<CudaSlice<T>>> {
    if position == 0 {
        return Ok(None);
    }
    let mut out = dev.alloc::<T>(position * row)?;
    ops::copy_rows(dev, pool, pairs, row, &mut out)?;
    Ok(Some(out))
}
