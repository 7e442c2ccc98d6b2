//! Snapshot and restore of one slot on a GPU rank: every SSM layer's checkpoint, committed ring entries and conv
//! history (rings in logical order, so a restore into any slot rebuilds them from row 0, as the CPU decoder does) and
//! the KV rows of the slot's positions in every attention layer, copied to the host in f32 (a bf16 value widens
//! exactly, so a restore writes back the same bits). Ring fields are in the CPU's order: Mamba-2 `x`, `dt`, `B`;
//! GDN `u`, `k`, `g`.

use rewind_kernels::cuda::{CudaDevice, CudaSlice, Elem};

use super::layers::GpuMixer;
use super::rank::GpuRank;
use super::state::LayerPool;
use super::Act;
use crate::error::{EngineError, Result};
use crate::rank::{SlotSnapshot, SsmSnapshot};
use crate::state::kv::NO_BLOCK;

fn wrong(what: &str) -> EngineError {
    EngineError::InvalidInput(format!(
        "restoring a slot snapshot: {what} does not fit this GPU rank's pools"
    ))
}

impl<A: Act> GpuRank<A> {
    /// The physical rows `(first row, rows)` of positions `0..len` of `slot`, block by block.
    pub(super) fn kv_runs(&self, slot: usize, len: usize) -> Result<Vec<(usize, usize)>> {
        let kv = self
            .books
            .kv()
            .ok_or_else(|| EngineError::InvalidInput("the model has no KV blocks".into()))?;
        let bs = kv.block_size();
        let table = kv.table(slot);
        (0..len.div_ceil(bs))
            .map(|i| {
                let b = table[i];
                if b == NO_BLOCK {
                    return Err(EngineError::InvalidInput(format!(
                        "slot {slot} has no KV block for its position {}",
                        i * bs
                    )));
                }
                Ok((b as usize * bs, bs.min(len - i * bs)))
            })
            .collect()
    }

    /// The length of the sequence in `slot`, which must have started and have no verify awaiting its commit (to
    /// `what` it: snapshot, store).
    pub(super) fn idle_len(&self, slot: usize, what: &str) -> Result<usize> {
        if !self.books.started(slot) {
            return Err(EngineError::InvalidInput(format!(
                "slot {slot} holds no sequence to {what}"
            )));
        }
        if self.books.pending(slot)? != 0 {
            return Err(EngineError::InvalidInput(format!(
                "slot {slot} has a verify awaiting its commit"
            )));
        }
        self.books.len(slot)
    }

    pub(super) fn snapshot_slot(&mut self, slot: usize) -> Result<SlotSnapshot> {
        let len = self.idle_len(slot, "snapshot")?;
        let (n, rows) = (self.sizes.max_seqs, self.sizes.rows.ring);
        let (ring, conv_idx) = (self.counters.ring(slot), self.counters.conv(slot));
        let dev = self.inner.dev.clone();
        let (mut ssm, mut kv) = (Vec::new(), Vec::new());
        for (block, pool) in self.inner.blocks.iter().zip(&self.pools) {
            match pool {
                LayerPool::Ssm {
                    conv,
                    ssm: state,
                    ring_a,
                    ring_f,
                    ring_b,
                } => {
                    let sl = state.len() / n;
                    let logical = || (0..ring.len).map(|j| ring.physical(j));
                    let field_a = gather(&dev, ring_a, slot, n, rows, logical())?;
                    let field_f = gather(&dev, ring_f, slot, n, rows, logical())?;
                    let field_b = gather(&dev, ring_b, slot, n, rows, logical())?;
                    let ring_fields = match block.mixer {
                        GpuMixer::Gdn(_) => vec![field_a, field_b, field_f],
                        _ => vec![field_a, field_f, field_b],
                    };
                    let window = (0..conv_idx.len).map(|j| conv_idx.physical(j));
                    ssm.push(SsmSnapshot {
                        state: dev.download(&state.slice(slot * sl..(slot + 1) * sl))?,
                        ring: ring_fields,
                        conv: gather(&dev, conv, slot, n, conv_idx.capacity, window)?,
                    });
                }
                LayerPool::Kv { k, v, layout } => {
                    let row = layout.kv_heads * layout.head_dim;
                    let (mut keys, mut values) = (Vec::with_capacity(len * row), Vec::with_capacity(len * row));
                    for (first, rows) in self.kv_runs(slot, len)? {
                        let r = first * row..(first + rows) * row;
                        keys.extend(dev.download_f32(&k.slice(r.clone()))?);
                        values.extend(dev.download_f32(&v.slice(r))?);
                    }
                    kv.push((keys, values));
                }
                LayerPool::None => {}
            }
        }
        Ok(SlotSnapshot {
            form_choice: self.choice[slot],
            form: self.counters.form_of(slot),
            position: len,
            ring_capacity: ring.capacity,
            ring_len: ring.len,
            ssm,
            kv,
        })
    }

    pub(super) fn restore_slot(&mut self, slot: usize, snap: &SlotSnapshot) -> Result<()> {
        if snap.ring_len > self.counters.capacity_for(snap.form) {
            return Err(wrong(&format!(
                "a {} slot with {} ring entries",
                snap.form.name(),
                snap.ring_len
            )));
        }
        let ssm_pools = self.pools.iter().filter(|p| matches!(p, LayerPool::Ssm { .. })).count();
        let kv_pools = self.pools.iter().filter(|p| matches!(p, LayerPool::Kv { .. })).count();
        if snap.ssm.len() != ssm_pools || snap.kv.len() != kv_pools {
            return Err(wrong(&format!(
                "{} SSM and {} attention layers",
                snap.ssm.len(),
                snap.kv.len()
            )));
        }
        self.books.open_at(slot, snap.form_choice)?;
        self.counters.reset(slot, snap.form);
        self.choice[slot] = snap.form_choice;
        let filled = self
            .books
            .restored(slot, snap.position)
            .and_then(|()| self.fill(slot, snap))
            .and_then(|()| Ok(self.counters.ring_commit(slot, snap.ring_len)?));
        if let Err(e) = filled {
            // A half-restored slot must not stay open.
            self.books.close(slot)?;
            return Err(e);
        }
        self.table_dirty = true;
        Ok(())
    }

    fn fill(&mut self, slot: usize, snap: &SlotSnapshot) -> Result<()> {
        let (n, rows) = (self.sizes.max_seqs, self.sizes.rows.ring);
        let conv_rows = self.counters.conv_capacity();
        let runs = if self.books.kv().is_some() {
            self.kv_runs(slot, snap.position)?
        } else {
            Vec::new()
        };
        let dev = self.inner.dev.clone();
        let stream = dev.stream().clone();
        let put = |what: &str, e: &dyn std::fmt::Display| EngineError::Gpu(format!("restoring {what}: {e}"));
        let (mut ssm, mut kv) = (snap.ssm.iter(), snap.kv.iter());
        for (block, pool) in self.inner.blocks.iter().zip(&mut self.pools) {
            match pool {
                LayerPool::Ssm {
                    conv,
                    ssm: state,
                    ring_a,
                    ring_f,
                    ring_b,
                } => {
                    let s = ssm.next().ok_or_else(|| wrong("the SSM layer list"))?;
                    let sl = state.len() / n;
                    if s.state.len() != sl || s.ring.len() != 3 {
                        return Err(wrong("an SSM layer's state"));
                    }
                    stream
                        .memcpy_htod(&s.state, &mut state.slice_mut(slot * sl..(slot + 1) * sl))
                        .map_err(|e| put("an SSM state", &e))?;
                    // Logical rows go to physical rows 0 .. (the counters restart at start 0, conv head 0).
                    let (fa, ff, fb) = match block.mixer {
                        GpuMixer::Gdn(_) => (&s.ring[0], &s.ring[2], &s.ring[1]),
                        _ => (&s.ring[0], &s.ring[1], &s.ring[2]),
                    };
                    scatter(&dev, ring_a, slot, n, rows, snap.ring_len, fa)?;
                    scatter(&dev, ring_f, slot, n, rows, snap.ring_len, ff)?;
                    scatter(&dev, ring_b, slot, n, rows, snap.ring_len, fb)?;
                    scatter(&dev, conv, slot, n, conv_rows, self.counters.conv(slot).len, &s.conv)?;
                }
                LayerPool::Kv { k, v, layout } => {
                    let (keys, values) = kv.next().ok_or_else(|| wrong("the attention layer list"))?;
                    let row = layout.kv_heads * layout.head_dim;
                    if keys.len() != snap.position * row || values.len() != keys.len() {
                        return Err(wrong("a KV cache"));
                    }
                    let mut at = 0;
                    for &(first, rows) in &runs {
                        let r = first * row..(first + rows) * row;
                        let src = at * row..(at + rows) * row;
                        let kk: Vec<A> = keys[src.clone()].iter().map(|&x| A::from_f32(x)).collect();
                        let vv: Vec<A> = values[src].iter().map(|&x| A::from_f32(x)).collect();
                        stream
                            .memcpy_htod(&kk, &mut k.slice_mut(r.clone()))
                            .map_err(|e| put("keys", &e))?;
                        stream
                            .memcpy_htod(&vv, &mut v.slice_mut(r))
                            .map_err(|e| put("values", &e))?;
                        at += rows;
                    }
                }
                LayerPool::None => {}
            }
        }
        dev.synchronize()?;
        Ok(())
    }
}

/// Rows `physical` (in that order) of `slot`'s part of a pool of `n` slots × `rows` rows, widened to f32.
fn gather<T: Elem>(
    dev: &CudaDevice,
    pool: &CudaSlice<T>,
    slot: usize,
    n: usize,
    rows: usize,
    physical: impl Iterator<Item = usize>,
) -> Result<Vec<f32>> {
    let width = pool.len() / (n * rows).max(1);
    let all = dev.download_f32(&pool.slice(slot * rows * width..(slot + 1) * rows * width))?;
    Ok(physical
        .flat_map(|p| all[p * width..(p + 1) * width].to_vec())
        .collect())
}

/// Writes `count` rows of `src` (f32, in the pool's width) to rows `0 .. count` of `slot`'s part of a pool.
fn scatter<T: Elem>(
    dev: &CudaDevice,
    pool: &mut CudaSlice<T>,
    slot: usize,
    n: usize,
    rows: usize,
    count: usize,
    src: &[f32],
) -> Result<()> {
    let width = pool.len() / (n * rows).max(1);
    if src.len() != count * width {
        return Err(wrong(&format!("{} values for {count} rows of {width}", src.len())));
    }
    if count == 0 {
        return Ok(());
    }
    let vals: Vec<T> = src.iter().map(|&x| T::from_f32(x)).collect();
    let at = slot * rows * width;
    dev.stream()
        .memcpy_htod(&vals, &mut pool.slice_mut(at..at + count * width))
        .map_err(|e| EngineError::Gpu(format!("restoring a ring: {e}")))
}
