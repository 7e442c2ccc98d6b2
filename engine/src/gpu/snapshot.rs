//! Snapshot and restore of one slot on a GPU rank: the conv and SSM state rows of every SSM layer and the KV rows of
//! the slot's positions in every attention layer, copied to the host in f32 (a bf16 value widens exactly, so a
//! restore writes back the same bits). The GPU decodes in the recurrent form, so there is no ring to copy.

use super::rank::GpuRank;
use super::state::LayerPool;
use super::Act;
use crate::decode::FormChoice;
use crate::error::{EngineError, Result};
use crate::rank::{SlotSnapshot, SsmSnapshot};
use crate::state::kv::NO_BLOCK;
use crate::state::DecodeForm;

fn wrong(what: &str) -> EngineError {
    EngineError::InvalidInput(format!(
        "restoring a slot snapshot: {what} does not fit this GPU rank's pools"
    ))
}

impl<A: Act> GpuRank<A> {
    /// The physical rows `(first row, rows)` of positions `0..len` of `slot`, block by block.
    fn kv_runs(&self, slot: usize, len: usize) -> Result<Vec<(usize, usize)>> {
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

    pub(super) fn snapshot_slot(&mut self, slot: usize) -> Result<SlotSnapshot> {
        if !self.books.started(slot) {
            return Err(EngineError::InvalidInput(format!(
                "slot {slot} holds no sequence to snapshot"
            )));
        }
        let len = self.books.len(slot)?;
        let n = self.sizes.max_seqs;
        let dev = self.inner.dev.clone();
        let (mut ssm, mut kv) = (Vec::new(), Vec::new());
        for pool in &self.pools {
            match pool {
                LayerPool::Ssm { conv, ssm: state } => {
                    let (cl, sl) = (conv.len() / n, state.len() / n);
                    ssm.push(SsmSnapshot {
                        state: dev.download(&state.slice(slot * sl..(slot + 1) * sl))?,
                        ring: Vec::new(),
                        conv: dev.download_f32(&conv.slice(slot * cl..(slot + 1) * cl))?,
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
            form_choice: FormChoice::Recurrent,
            form: DecodeForm::Recurrent,
            position: len,
            ring_capacity: 0,
            ring_len: 0,
            ssm,
            kv,
        })
    }

    pub(super) fn restore_slot(&mut self, slot: usize, snap: &SlotSnapshot) -> Result<()> {
        if snap.form != DecodeForm::Recurrent || snap.ring_len != 0 {
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
        let filled = self
            .books
            .restored(slot, snap.position)
            .and_then(|()| self.fill(slot, snap));
        if let Err(e) = filled {
            // A half-restored slot must not stay open.
            self.books.close(slot)?;
            return Err(e);
        }
        self.table_dirty = true;
        Ok(())
    }

    fn fill(&mut self, slot: usize, snap: &SlotSnapshot) -> Result<()> {
        let n = self.sizes.max_seqs;
        let runs = if self.books.kv().is_some() {
            self.kv_runs(slot, snap.position)?
        } else {
            Vec::new()
        };
        let dev = self.inner.dev.clone();
        let stream = dev.stream().clone();
        let put = |what: &str, e: &dyn std::fmt::Display| EngineError::Gpu(format!("restoring {what}: {e}"));
        let (mut ssm, mut kv) = (snap.ssm.iter(), snap.kv.iter());
        for pool in &mut self.pools {
            match pool {
                LayerPool::Ssm { conv, ssm: state } => {
                    let s = ssm.next().ok_or_else(|| wrong("the SSM layer list"))?;
                    let (cl, sl) = (conv.len() / n, state.len() / n);
                    if s.state.len() != sl || s.conv.len() != cl {
                        return Err(wrong("an SSM layer's state"));
                    }
                    stream
                        .memcpy_htod(&s.state, &mut state.slice_mut(slot * sl..(slot + 1) * sl))
                        .map_err(|e| put("an SSM state", &e))?;
                    let c: Vec<A> = s.conv.iter().map(|&x| A::from_f32(x)).collect();
                    stream
                        .memcpy_htod(&c, &mut conv.slice_mut(slot * cl..(slot + 1) * cl))
                        .map_err(|e| put("a conv state", &e))?;
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
