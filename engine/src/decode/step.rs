//! One step of the decoder through every block — the CPU's only block loop: the vocab-parallel embedding, then per
//! block the norm, the rank's part of the mixer and the all-reduce of its partial output. FFN blocks run over every
//! row of the batch at once; SSM and attention blocks per sequence, each over its slot's state in the pools and in
//! its own phase (prefill chunk, decode or verify) and form.

use rewind_kernels::cpu::{replay_gdn, replay_mamba2};

use super::ssm;
use super::Decoder;
use crate::error::{EngineError, Result};
use crate::model::mixers::attention::AttentionMixer;
use crate::model::mixers::Mixer;
use crate::shard::ShardBlock;
use crate::state::{DecodeForm, StatePools, StateRef};

/// What a step does with a sequence's tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// A prompt chunk: chunked scans, committed.
    Prefill,
    /// One token, committed.
    Decode,
    /// Drafts, pending until a commit.
    Verify,
}

/// One sequence of a step, planned before any layer runs.
pub(crate) struct Seq<'a> {
    pub slot: usize,
    pub tokens: &'a [u32],
    /// Committed tokens before this step (the position of `tokens[0]`).
    pub pos: usize,
    pub phase: Phase,
    pub form: DecodeForm,
    /// Fold the committed ring entries into the checkpoint in this step.
    pub flush: bool,
}

impl Decoder {
    /// Runs `seqs` through every block and returns the final residual rows `[Σ t, hidden]`, in batch order. SSM and
    /// attention state moves as each sequence's phase says; the slot counters are the caller's to update.
    pub(super) fn run(&mut self, seqs: &[Seq]) -> Result<Vec<f32>> {
        let model = self.model.clone();
        let hidden = model.config().hidden_size;
        let rows: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let mut x = model.embed(&tokens, &*self.comm)?;
        let tp = model.plan().tp;
        for (b, block) in model.blocks().iter().enumerate() {
            let h = model.block_input(block, &x);
            let mut y = match (block.mixer(), self.pools.block_refs()[b]) {
                (Mixer::Mlp(m), _) => m.forward(&h, rows),
                (Mixer::Moe(m), _) => m.forward(&h, rows),
                (_, state) => {
                    let mut y = Vec::with_capacity(rows * hidden);
                    let mut at = 0;
                    for s in seqs {
                        let t = s.tokens.len();
                        let xs = &h[at * hidden..(at + t) * hidden];
                        at += t;
                        y.extend(self.mixer_step(block, state, s, xs)?);
                    }
                    y
                }
            };
            if tp > 1 {
                self.comm.all_reduce_sum(&mut y)?;
            }
            for (xi, yi) in x.iter_mut().zip(&y) {
                *xi += yi;
            }
        }
        Ok(x)
    }

    /// One stateful block for one sequence.
    fn mixer_step(&mut self, block: &ShardBlock, state: StateRef, s: &Seq, x: &[f32]) -> Result<Vec<f32>> {
        let t = s.tokens.len();
        let step = ssm::Step {
            phase: s.phase,
            form: s.form,
            flush: s.flush,
        };
        match (block.mixer(), state) {
            (Mixer::Mamba2(m), StateRef::Ssm(layer)) => {
                let view = self.pools.mamba2_slot_mut(layer, s.slot)?;
                let snaps = snapshot_buf(&mut self.snapshots[s.slot], layer);
                ssm::mamba2(
                    m,
                    block.shard(),
                    view,
                    x,
                    t,
                    step,
                    snaps,
                    &mut self.traffic,
                    &*self.comm,
                )
            }
            (Mixer::Gdn(m), StateRef::Ssm(layer)) => {
                let view = self.pools.gdn_slot_mut(layer, s.slot)?;
                let snaps = snapshot_buf(&mut self.snapshots[s.slot], layer);
                ssm::gdn(m, block.shard(), view, x, t, step, snaps, &mut self.traffic)
            }
            (Mixer::Attention(m), StateRef::Attention(layer)) => attention(&mut self.pools, m, layer, s, x),
            _ => Err(EngineError::InvalidInput(
                "the state pools do not match the model's blocks".into(),
            )),
        }
    }

    /// Folds every committed ring entry of `slot` into its checkpoint in every SSM layer and empties the ring: from
    /// a zero state when the slot is kv-only (its checkpoint is unused; the slot moves to replay), from the
    /// checkpoint otherwise.
    pub(super) fn fold(&mut self, slot: usize) -> Result<()> {
        let h = self.pools.counters().ring(slot).len;
        let from_zero = self.pools.counters().form_of(slot) == DecodeForm::KvOnly;
        let model = self.model.clone();
        for &(b, layer) in &self.ssm_blocks {
            let block = &model.blocks()[b];
            self.traffic += match block.mixer() {
                Mixer::Mamba2(m) => {
                    let dims = ssm::mamba2_dims(m, block.shard())?;
                    let v = self.pools.mamba2_slot_mut(layer, slot)?;
                    let mut index = v.ring;
                    let mut ring = replay_mamba2::Mamba2Ring::new(dims, v.x, v.dt, v.b, &mut index);
                    if from_zero {
                        replay_mamba2::compress(v.state, &mut ring, m.a())
                    } else {
                        replay_mamba2::flush(v.state, &mut ring, h, m.a())
                    }
                }
                Mixer::Gdn(m) => {
                    let dims = ssm::gdn_dims(m, block.shard())?;
                    let v = self.pools.gdn_slot_mut(layer, slot)?;
                    let mut index = v.ring;
                    let mut ring = replay_gdn::GdnRing::new(dims, v.u, v.k, v.g, &mut index);
                    if from_zero {
                        replay_gdn::compress(v.state, &mut ring)
                    } else {
                        replay_gdn::flush(v.state, &mut ring, h)
                    }
                }
                _ => continue,
            };
        }
        self.pools.ring_flush(slot, h)?;
        if from_zero {
            self.pools.set_form(slot, DecodeForm::Replay)?;
        }
        Ok(())
    }

    /// The baseline's commit in every SSM layer: the state becomes snapshot `accepted − 1`.
    pub(super) fn commit_baseline(&mut self, slot: usize, accepted: usize) -> Result<()> {
        let model = self.model.clone();
        for &(b, layer) in &self.ssm_blocks {
            let block = &model.blocks()[b];
            let snaps = snapshot_buf(&mut self.snapshots[slot], layer);
            self.traffic += match block.mixer() {
                Mixer::Mamba2(m) => {
                    let dims = ssm::mamba2_dims(m, block.shard())?;
                    let v = self.pools.mamba2_slot_mut(layer, slot)?;
                    replay_mamba2::commit_baseline(dims, v.state, snaps, accepted)
                }
                Mixer::Gdn(m) => {
                    let dims = ssm::gdn_dims(m, block.shard())?;
                    let v = self.pools.gdn_slot_mut(layer, slot)?;
                    replay_gdn::commit_baseline(dims, v.state, snaps, accepted)
                }
                _ => continue,
            };
        }
        Ok(())
    }
}

/// A slot's snapshot buffer of SSM layer `layer`, created on first use.
fn snapshot_buf(per_layer: &mut Vec<Vec<f32>>, layer: usize) -> &mut Vec<f32> {
    if per_layer.len() <= layer {
        per_layer.resize(layer + 1, Vec::new());
    }
    &mut per_layer[layer]
}

/// An attention block for one sequence over its paged KV: the cached positions are gathered for the attention
/// kernel, and the step's new keys and values written back to the slot's blocks (whose length the caller grew).
fn attention(pools: &mut StatePools, m: &AttentionMixer, layer: usize, s: &Seq, x: &[f32]) -> Result<Vec<f32>> {
    let t = s.tokens.len();
    let mut cache = m.new_cache();
    {
        let view = pools.kv_slot_mut(layer, s.slot)?;
        if s.pos > 0 {
            let mut k = Vec::with_capacity(s.pos * view.row);
            let mut v = Vec::with_capacity(s.pos * view.row);
            for p in 0..s.pos {
                k.extend_from_slice(view.key(p));
                v.extend_from_slice(view.value(p));
            }
            cache.append(&k, &v);
        }
    }
    let y = m.forward(x, t, s.pos, &mut cache);
    let mut view = pools.kv_slot_mut(layer, s.slot)?;
    let row = view.row;
    let (keys, values) = (cache.keys(), cache.values());
    for p in s.pos..s.pos + t {
        view.write(p, &keys[p * row..(p + 1) * row], &values[p * row..(p + 1) * row]);
    }
    Ok(y)
}
