//! Snapshot and restore of one slot's whole state on this rank — what sessions (keep a conversation's state between
//! turns) and fork (branch a sequence) need. Rings and conv history are copied in logical order, so a restore into
//! any free slot rebuilds them from row 0 without caring where the source slot's rows physically sat.

use super::{Decoder, FormChoice};
use crate::error::{EngineError, Result};
use crate::state::{RingIndex, StateRef};

/// One slot's whole state on one rank, enough to continue the sequence in any slot of any rank with the same shard:
/// the SSM checkpoint, input ring and conv ring per SSM layer, the KV rows per attention layer, and the counters.
/// Rings are stored in logical order (oldest first), so a restore needs no particular physical layout.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SlotSnapshot {
    pub form_choice: FormChoice,
    /// The slot's current form (`recurrent`, `replay` or `kv-only`).
    pub form: crate::state::DecodeForm,
    /// Committed tokens.
    pub position: usize,
    /// The slot's ring capacity (`L`, or `threshold + T` in the kv-only form).
    pub ring_capacity: usize,
    /// Committed ring entries (the same in every SSM layer).
    pub ring_len: usize,
    /// Per SSM layer.
    pub ssm: Vec<SsmSnapshot>,
    /// Per attention layer: keys and values of positions `0..position`, `[position, kv row]` each.
    pub kv: Vec<(Vec<f32>, Vec<f32>)>,
}

impl SlotSnapshot {
    /// The bytes its values take (f32 each).
    pub fn bytes(&self) -> u64 {
        let ssm: usize = self
            .ssm
            .iter()
            .map(|l| l.state.len() + l.conv.len() + l.ring.iter().map(Vec::len).sum::<usize>())
            .sum();
        let kv: usize = self.kv.iter().map(|(k, v)| k.len() + v.len()).sum();
        4 * (ssm + kv) as u64
    }
}

/// One SSM layer of a [`SlotSnapshot`].
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SsmSnapshot {
    /// The checkpoint state.
    pub state: Vec<f32>,
    /// The committed ring entries, oldest first, per ring field (`[entries, field width]` each).
    pub ring: Vec<Vec<f32>>,
    /// The `K − 1` committed conv rows, oldest first.
    pub conv: Vec<f32>,
}

/// Rows `0..n` of a ring in logical order, `width` values each.
fn gather(storage: &[f32], idx: RingIndex, n: usize, width: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n * width);
    for j in 0..n {
        let p = idx.physical(j);
        out.extend_from_slice(&storage[p * width..(p + 1) * width]);
    }
    out
}

/// Writes logical rows `0..n` of `src` into a ring.
fn scatter(storage: &mut [f32], idx: RingIndex, n: usize, width: usize, src: &[f32]) {
    for j in 0..n {
        let p = idx.physical(j);
        storage[p * width..(p + 1) * width].copy_from_slice(&src[j * width..(j + 1) * width]);
    }
}

fn wrong(what: &str) -> EngineError {
    EngineError::InvalidInput(format!(
        "restoring a slot snapshot: {what} does not fit this rank's pools"
    ))
}

impl Decoder {
    /// Copies slot `slot`'s state: every SSM layer's checkpoint, committed ring entries and conv history, every
    /// attention layer's KV rows, and the counters. The slot must have no verify awaiting its commit.
    pub fn snapshot(&mut self, slot: usize) -> Result<SlotSnapshot> {
        self.check_idle(slot)?;
        let position = self.position[slot];
        let ring_index = self.pools.counters().ring(slot);
        let conv_index = self.pools.counters().conv(slot);
        let mut ssm = Vec::new();
        let mut kv = Vec::new();
        for r in self.pools.block_refs().to_vec() {
            match r {
                StateRef::Ssm(layer) => {
                    let v = self.pools.ssm_slot_mut(layer, slot)?;
                    let ring = v
                        .ring
                        .iter()
                        .map(|f| gather(f, ring_index, ring_index.len, f.len() / ring_index.capacity.max(1)))
                        .collect();
                    let cw = v.conv.len() / conv_index.capacity.max(1);
                    ssm.push(SsmSnapshot {
                        state: v.state.to_vec(),
                        ring,
                        conv: gather(v.conv, conv_index, conv_index.len, cw),
                    });
                }
                StateRef::Attention(layer) => {
                    let view = self.pools.kv_slot_mut(layer, slot)?;
                    let (mut k, mut vals) = (Vec::new(), Vec::new());
                    for p in 0..position {
                        k.extend_from_slice(view.key(p));
                        vals.extend_from_slice(view.value(p));
                    }
                    kv.push((k, vals));
                }
                StateRef::None => {}
            }
        }
        Ok(SlotSnapshot {
            form_choice: self.choice[slot],
            form: self.pools.counters().form_of(slot),
            position,
            ring_capacity: ring_index.capacity,
            ring_len: ring_index.len,
            ssm,
            kv,
        })
    }

    /// Keeps a copy of `slot`'s state under `id` for a later [`Decoder::restore_stored`] (a cached prefix); returns
    /// its bytes. The CPU rank's store is host memory the caller budgets, so it always has room.
    pub fn store(&mut self, slot: usize, id: u64) -> Result<u64> {
        let snap = self.snapshot(slot)?;
        let bytes = snap.bytes();
        self.stored.insert(id, snap);
        Ok(bytes)
    }

    /// Starts a sequence in the free slot `slot` from the state kept under `id` (which stays kept).
    pub fn restore_stored(&mut self, slot: usize, id: u64) -> Result<()> {
        let snap = self
            .stored
            .remove(&id)
            .ok_or_else(|| EngineError::InvalidInput(format!("no state is stored under id {id}")))?;
        let restored = self.restore(slot, &snap);
        self.stored.insert(id, snap);
        restored
    }

    /// Forgets the states kept under `ids` (an id not kept is ignored: the caller may drop a state twice, or one a
    /// restarted rank never had).
    pub fn drop_stored(&mut self, ids: &[u64]) {
        for id in ids {
            self.stored.remove(id);
        }
    }

    /// States kept by [`Decoder::store`].
    pub fn stored_count(&self) -> usize {
        self.stored.len()
    }

    /// Starts a sequence in the free slot `slot` from `snap` (taken on a rank with the same shard and pool sizes);
    /// it continues exactly as the snapshotted sequence would have.
    pub fn restore(&mut self, slot: usize, snap: &SlotSnapshot) -> Result<()> {
        let want_cap = self.pools.counters().capacity_for(snap.form);
        if snap.ring_capacity != want_cap || snap.ring_len > want_cap {
            return Err(wrong(&format!(
                "a ring of {} entries ({} used; this rank's {} form holds {want_cap})",
                snap.ring_capacity,
                snap.ring_len,
                snap.form.name()
            )));
        }
        if snap.ssm.len() != self.pools.num_ssm_layers() || snap.kv.len() != self.pools.num_attention_layers() {
            return Err(wrong(&format!(
                "{} SSM and {} attention layers",
                snap.ssm.len(),
                snap.kv.len()
            )));
        }
        if snap.position > self.config.max_context {
            return Err(wrong(&format!("a context of {} tokens", snap.position)));
        }
        self.start_at(slot, snap.form_choice)?;
        if let Err(e) = self.fill(slot, snap) {
            // A half-restored slot must not stay allocated.
            self.release(slot)?;
            return Err(e);
        }
        Ok(())
    }

    fn fill(&mut self, slot: usize, snap: &SlotSnapshot) -> Result<()> {
        self.pools.set_form(slot, snap.form)?;
        self.pools.kv_grow(slot, snap.position)?;
        let ring_index = self.pools.counters().ring(slot);
        let conv_index = self.pools.counters().conv(slot);
        let n = snap.ring_len;
        let (mut ssm, mut kv) = (snap.ssm.iter(), snap.kv.iter());
        for r in self.pools.block_refs().to_vec() {
            match r {
                StateRef::Ssm(layer) => {
                    let s = ssm.next().ok_or_else(|| wrong("the SSM layer list"))?;
                    let v = self.pools.ssm_slot_mut(layer, slot)?;
                    if s.state.len() != v.state.len() {
                        return Err(wrong("a checkpoint"));
                    }
                    v.state.copy_from_slice(&s.state);
                    for (field, src) in v.ring.into_iter().zip(&s.ring) {
                        // The view holds the slot's `capacity` rows.
                        let width = field.len() / ring_index.capacity.max(1);
                        if src.len() != n * width {
                            return Err(wrong("a ring field"));
                        }
                        scatter(field, ring_index, n, width, src);
                    }
                    let cw = v.conv.len() / conv_index.capacity.max(1);
                    if s.conv.len() != conv_index.len * cw {
                        return Err(wrong("a conv history"));
                    }
                    scatter(v.conv, conv_index, conv_index.len, cw, &s.conv);
                }
                StateRef::Attention(layer) => {
                    let (k, vals) = kv.next().ok_or_else(|| wrong("the attention layer list"))?;
                    let mut view = self.pools.kv_slot_mut(layer, slot)?;
                    let row = view.row;
                    if k.len() != snap.position * row || vals.len() != k.len() {
                        return Err(wrong("a KV cache"));
                    }
                    for p in 0..snap.position {
                        view.write(p, &k[p * row..(p + 1) * row], &vals[p * row..(p + 1) * row]);
                    }
                }
                StateRef::None => {}
            }
        }
        self.pools.ring_commit(slot, n)?;
        self.position[slot] = snap.position;
        Ok(())
    }
}
