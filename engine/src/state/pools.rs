//! [`StatePools`]: every per-sequence tensor of a model for a fixed number of slots, sized up front.

use super::counters::{DecodeForm, SlotCounters, StepPhase};
use super::kv::{KvBlocks, KvLayerPool, KvSlotMut, NO_BLOCK};
use super::slots::SlotAllocator;
use super::ssm::{GdnSlotMut, Mamba2SlotMut, SsmDims, SsmLayerPool, SsmSlotMut};
use super::{PoolError, DEFAULT_BUFFER_LEN, DEFAULT_KV_BLOCK_SIZE, MAX_SLOTS};
use crate::model::{BlockKind, ModelConfig};

/// How big the pools are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Sequence slots.
    pub slots: usize,
    /// Input-ring capacity `L`. A verify step writes `T + 1` entries, so `L ≥ T + 1`; below `2T` every step flushes.
    pub buffer_len: usize,
    /// Input-ring capacity of a slot in the kv-only form, whose ring is its whole history until it compresses:
    /// `threshold + T`. `None`: `buffer_len`. Every slot's ring rows are sized for the larger of the two.
    pub kv_only_ring: Option<usize>,
    /// Speculative window `T` (draft tokens per step; 0 for standard decode).
    pub spec_window: usize,
    /// Tokens per KV block.
    pub kv_block_size: usize,
    /// The longest KV length one slot can map (its block table has `⌈max_context / block⌉` entries).
    pub max_context: usize,
    /// Blocks in the KV pool; `None`: enough for every slot at `max_context`.
    pub kv_blocks: Option<usize>,
    /// The form a freshly reset slot starts in.
    pub default_form: DecodeForm,
}

impl PoolConfig {
    /// `slots` slots of up to `max_context` tokens, with the default ring length, block size, no speculation, and
    /// enough KV blocks for every slot to reach `max_context`.
    pub fn new(slots: usize, max_context: usize) -> Self {
        PoolConfig {
            slots,
            buffer_len: DEFAULT_BUFFER_LEN,
            kv_only_ring: None,
            spec_window: 0,
            kv_block_size: DEFAULT_KV_BLOCK_SIZE,
            max_context,
            kv_blocks: None,
            default_form: DecodeForm::Replay,
        }
    }
}

/// The per-sequence state one residual block needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayerState {
    /// None (MLP, MoE).
    None,
    /// An SSM layer's checkpoint, input ring and conv ring.
    Ssm(SsmDims),
    /// Paged KV of `kv_heads` heads of `head_dim`.
    Attention { kv_heads: usize, head_dim: usize },
}

impl LayerState {
    /// The state of a block of kind `kind`, with the sizes its spec gives.
    pub fn of(kind: &BlockKind) -> Self {
        match kind {
            BlockKind::Mamba2(s) => LayerState::Ssm(SsmDims::mamba2(s)),
            BlockKind::Gdn(s) => LayerState::Ssm(SsmDims::gdn(s)),
            BlockKind::Attention(s) => LayerState::Attention {
                kv_heads: s.kv_heads,
                head_dim: s.head_dim,
            },
            BlockKind::Mlp(_) | BlockKind::Moe(_) => LayerState::None,
        }
    }
}

/// Which pool a residual block's per-sequence state lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateRef {
    /// The block keeps no per-sequence state (MLP, MoE).
    None,
    /// SSM layer `i` (counting SSM blocks in model order).
    Ssm(usize),
    /// Attention layer `i` (counting attention blocks in model order).
    Attention(usize),
}

/// The state pools of one model (on one rank).
#[derive(Clone, Debug)]
pub struct StatePools {
    config: PoolConfig,
    slots: SlotAllocator,
    counters: SlotCounters,
    ssm: Vec<SsmLayerPool>,
    attention: Vec<KvLayerPool>,
    kv: KvBlocks,
    block_refs: Vec<StateRef>,
}

impl StatePools {
    /// Allocates every pool for `model`'s stateful layers (the whole, unsharded model), zeroed, all slots free.
    pub fn new(model: &ModelConfig, config: PoolConfig) -> Result<Self, PoolError> {
        let layers = model.layers.iter().flatten().map(|b| LayerState::of(&b.kind)).collect();
        Self::with_layers(layers, config)
    }

    /// Allocates the pools of `layers` (one entry per residual block, in model order; a tensor-parallel rank passes
    /// its shard's sizes), zeroed, all slots free.
    pub fn with_layers(layers: Vec<LayerState>, config: PoolConfig) -> Result<Self, PoolError> {
        let bad = |m: String| Err(PoolError::Config(m));
        if config.slots == 0 || config.slots > MAX_SLOTS {
            return bad(format!(
                "the slot count must be in 1..={MAX_SLOTS}, found {}",
                config.slots
            ));
        }
        // Counters are u32 on the device.
        let limit = u32::MAX as usize;
        let kv_only_ring = config.kv_only_ring.unwrap_or(config.buffer_len);
        for (name, v) in [
            ("buffer length", config.buffer_len),
            ("kv-only ring", kv_only_ring),
            ("spec window", config.spec_window),
            ("max context", config.max_context),
        ] {
            if v >= limit {
                return bad(format!("the {name} ({v}) must be below {limit}"));
            }
        }
        if config.kv_block_size == 0 {
            return bad("the KV block size must be at least 1 token".into());
        }
        if config.buffer_len < config.spec_window + 1 {
            return bad(format!(
                "buffer length {} cannot hold one verify step of {} tokens (spec window {} + 1)",
                config.buffer_len,
                config.spec_window + 1,
                config.spec_window
            ));
        }
        // A kv-only step starts below the threshold, so `threshold + T` holds it; only an empty ring is unusable.
        if kv_only_ring == 0 {
            return bad("the kv-only ring must hold at least 1 entry".into());
        }
        let ring_rows = config.buffer_len.max(kv_only_ring);
        let mut block_refs = Vec::new();
        let mut ssm_dims = Vec::new();
        let mut attn_specs = Vec::new();
        for layer in layers {
            block_refs.push(match layer {
                LayerState::Ssm(d) => {
                    ssm_dims.push(d);
                    StateRef::Ssm(ssm_dims.len() - 1)
                }
                LayerState::Attention { kv_heads, head_dim } => {
                    attn_specs.push((kv_heads, head_dim));
                    StateRef::Attention(attn_specs.len() - 1)
                }
                LayerState::None => StateRef::None,
            });
        }
        // One conv head per slot serves every layer, so every layer's conv ring must have the same length.
        let conv_window = ssm_dims.first().map_or(0, |d| d.conv_window);
        if let Some(d) = ssm_dims.iter().find(|d| d.conv_window != conv_window) {
            return bad(format!(
                "SSM layers with different conv widths ({} and {}) are not supported",
                conv_window + 1,
                d.conv_window + 1
            ));
        }
        let per_slot = config.max_context.div_ceil(config.kv_block_size);
        let kv_blocks = match config.kv_blocks {
            Some(n) => n,
            None => config
                .slots
                .checked_mul(per_slot)
                .ok_or_else(|| PoolError::Config(format!("{} slots × {per_slot} KV blocks overflow", config.slots)))?,
        };
        if kv_blocks >= NO_BLOCK as usize {
            return bad(format!(
                "{kv_blocks} KV blocks: block ids are u32, so fewer than {NO_BLOCK} blocks"
            ));
        }
        // Refuse sizes that cannot be allocated before trying, with the size in the message.
        let (s, l, t) = (config.slots as u128, ring_rows as u128, config.spec_window as u128);
        let ssm_values: u128 = ssm_dims
            .iter()
            .map(|d| {
                let conv_rows = d.conv_window as u128 + t;
                s * (d.state_len() as u128 + l * d.entry_len() as u128 + conv_rows * d.conv_dim as u128)
            })
            .sum();
        let kv_tokens = kv_blocks as u128 * config.kv_block_size as u128;
        let kv_values: u128 = attn_specs.iter().map(|&(h, d)| 2 * kv_tokens * (h * d) as u128).sum();
        let tables = s * per_slot as u128;
        let bytes = (ssm_values + kv_values + tables) * 4;
        if bytes > isize::MAX as u128 {
            return bad(format!("the pools would need {bytes} bytes"));
        }
        let ssm = ssm_dims
            .into_iter()
            .map(|d| SsmLayerPool::new(d, config.slots, ring_rows, config.spec_window))
            .collect::<Result<_, _>>()?;
        let attention = attn_specs
            .into_iter()
            .map(|(h, d)| KvLayerPool::new(h, d, config.kv_block_size, kv_blocks))
            .collect::<Result<_, _>>()?;
        Ok(StatePools {
            slots: SlotAllocator::new(config.slots),
            counters: SlotCounters::new(config.slots, config.buffer_len, conv_window, config.spec_window)
                .with_kv_only_capacity(kv_only_ring),
            kv: KvBlocks::new(config.slots, config.kv_block_size, per_slot, kv_blocks)?,
            ssm,
            attention,
            block_refs,
            config,
        })
    }

    /// The sizes the pools were built with.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }
    /// The slot allocator (read-only: allocate through [`StatePools::alloc`] so the slot is reset).
    pub fn slots(&self) -> &SlotAllocator {
        &self.slots
    }
    /// The per-slot counters.
    pub fn counters(&self) -> &SlotCounters {
        &self.counters
    }
    /// The KV block tables and free list.
    pub fn kv_blocks(&self) -> &KvBlocks {
        &self.kv
    }
    /// Where each residual block's state lives, in model order (`layers` flattened).
    pub fn block_refs(&self) -> &[StateRef] {
        &self.block_refs
    }
    /// Number of SSM layers.
    pub fn num_ssm_layers(&self) -> usize {
        self.ssm.len()
    }
    /// Number of attention layers.
    pub fn num_attention_layers(&self) -> usize {
        self.attention.len()
    }
    /// SSM layer `i`'s pools (whole-pool arrays for batched kernels).
    pub fn ssm_layer(&self, i: usize) -> Option<&SsmLayerPool> {
        self.ssm.get(i)
    }
    /// f32 values the pools hold in all.
    pub fn storage_values(&self) -> usize {
        self.ssm.iter().map(SsmLayerPool::len_values).sum::<usize>()
            + self.attention.iter().map(KvLayerPool::len_values).sum::<usize>()
    }

    /// Takes a free slot and resets it for a new sequence.
    pub fn alloc(&mut self) -> Result<usize, PoolError> {
        let slot = self.slots.alloc()?;
        self.clear(slot);
        Ok(slot)
    }

    /// Takes the free slot `slot` (a rank following the coordinator's books, which hand the slots out).
    pub fn alloc_at(&mut self, slot: usize) -> Result<(), PoolError> {
        self.slots.claim(slot)?;
        self.clear(slot);
        Ok(())
    }

    /// Returns a slot's KV blocks, clears its counters and frees the slot.
    pub fn free(&mut self, slot: usize) -> Result<(), PoolError> {
        self.slots.check_allocated(slot).map_err(|e| match e {
            PoolError::NotAllocated { slot } => PoolError::DoubleFree { slot },
            other => other,
        })?;
        self.kv.fit(slot, 0)?;
        // A free slot reads as empty to a kernel launched over every slot.
        self.counters.reset(slot, self.config.default_form);
        self.slots.free(slot)
    }

    /// Resets an allocated slot for a new sequence: zero checkpoints and conv rings, empty rings, no KV, the
    /// default form.
    pub fn reset(&mut self, slot: usize) -> Result<(), PoolError> {
        self.slots.check_allocated(slot)?;
        self.clear(slot);
        Ok(())
    }

    fn clear(&mut self, slot: usize) {
        for layer in &mut self.ssm {
            layer.reset_slot(slot);
        }
        // A free slot holds no blocks, so shrinking to 0 cannot fail.
        let _ = self.kv.fit(slot, 0);
        self.counters.reset(slot, self.config.default_form);
    }

    /// One slot's storage in SSM layer `layer`, with its current ring and conv indices.
    pub fn ssm_slot_mut(&mut self, layer: usize, slot: usize) -> Result<SsmSlotMut<'_>, PoolError> {
        self.slots.check_allocated(slot)?;
        let (ring, conv) = (self.counters.ring(slot), self.counters.conv(slot));
        let n = self.ssm.len();
        let pool = self.ssm.get_mut(layer).ok_or_else(|| PoolError::Layer {
            layer,
            message: format!("out of range (the model has {n} SSM layers)"),
        })?;
        Ok(pool.slot_mut(slot, ring, conv))
    }

    /// One slot of Mamba-2 layer `layer`.
    pub fn mamba2_slot_mut(&mut self, layer: usize, slot: usize) -> Result<Mamba2SlotMut<'_>, PoolError> {
        self.ssm_slot_mut(layer, slot)?.into_mamba2().ok_or(PoolError::Layer {
            layer,
            message: "is a Gated DeltaNet layer, not Mamba-2".into(),
        })
    }

    /// One slot of GDN layer `layer`.
    pub fn gdn_slot_mut(&mut self, layer: usize, slot: usize) -> Result<GdnSlotMut<'_>, PoolError> {
        self.ssm_slot_mut(layer, slot)?.into_gdn().ok_or(PoolError::Layer {
            layer,
            message: "is a Mamba-2 layer, not Gated DeltaNet".into(),
        })
    }

    /// One slot of attention layer `layer`: the layer's paged storage, the slot's block table and KV length.
    pub fn kv_slot_mut(&mut self, layer: usize, slot: usize) -> Result<KvSlotMut<'_>, PoolError> {
        self.slots.check_allocated(slot)?;
        let len = self.counters.kv_len()[slot] as usize;
        let n = self.attention.len();
        let pool = self.attention.get_mut(layer).ok_or_else(|| PoolError::Layer {
            layer,
            message: format!("out of range (the model has {n} attention layers)"),
        })?;
        Ok(pool.slot_mut(self.kv.table(slot), len))
    }

    /// Commits `n` ring entries (see [`SlotCounters::ring_commit`]).
    pub fn ring_commit(&mut self, slot: usize, n: usize) -> Result<(), PoolError> {
        self.slots.check_allocated(slot)?;
        self.counters.ring_commit(slot, n)
    }

    /// Drops the `n` oldest ring entries after a flush (see [`SlotCounters::ring_flush`]).
    pub fn ring_flush(&mut self, slot: usize, n: usize) -> Result<(), PoolError> {
        self.slots.check_allocated(slot)?;
        self.counters.ring_flush(slot, n)
    }

    /// Moves the conv head by `n` accepted tokens.
    pub fn conv_advance(&mut self, slot: usize, n: usize) -> Result<(), PoolError> {
        self.slots.check_allocated(slot)?;
        self.counters.conv_advance(slot, n)
    }

    /// Moves a slot's counters after a step ran (see [`SlotCounters::after_step`]).
    pub fn after_step(
        &mut self,
        slot: usize,
        phase: StepPhase,
        form: DecodeForm,
        flush: bool,
        h: usize,
        t: usize,
    ) -> Result<(), PoolError> {
        self.slots.check_allocated(slot)?;
        self.counters.after_step(slot, phase, form, flush, h, t)
    }

    /// Accepts `accepted` drafts of a slot's verify in its counters (see [`SlotCounters::commit`]).
    pub fn commit(&mut self, slot: usize, accepted: usize) -> Result<(), PoolError> {
        self.slots.check_allocated(slot)?;
        self.counters.commit(slot, accepted)
    }

    /// Sets a slot's flush flag.
    pub fn set_flush(&mut self, slot: usize, flush: bool) -> Result<(), PoolError> {
        self.slots.check_allocated(slot)?;
        self.counters.set_flush(slot, flush);
        Ok(())
    }

    /// Sets a slot's decode form and with it the slot's ring capacity (see [`SlotCounters::set_form`]: a change of
    /// capacity needs an empty ring).
    pub fn set_form(&mut self, slot: usize, form: DecodeForm) -> Result<(), PoolError> {
        self.slots.check_allocated(slot)?;
        self.counters.set_form(slot, form)
    }

    /// Lengthens a slot's KV cache to `new_len` tokens (allocating blocks) before the step writes them. On error
    /// nothing changes.
    pub fn kv_grow(&mut self, slot: usize, new_len: usize) -> Result<(), PoolError> {
        self.slots.check_allocated(slot)?;
        let len = self.counters.kv_len()[slot] as usize;
        if new_len < len {
            return Err(PoolError::KvLength {
                slot,
                op: "grow",
                len,
                new_len,
            });
        }
        self.kv.fit(slot, new_len)?;
        self.counters.set_kv_len(slot, new_len);
        Ok(())
    }

    /// Rolls a slot's KV cache back to `new_len` tokens: the length moves and entirely unused blocks are returned.
    pub fn kv_truncate(&mut self, slot: usize, new_len: usize) -> Result<(), PoolError> {
        self.slots.check_allocated(slot)?;
        let len = self.counters.kv_len()[slot] as usize;
        if new_len > len {
            return Err(PoolError::KvLength {
                slot,
                op: "truncate",
                len,
                new_len,
            });
        }
        self.kv.fit(slot, new_len)?;
        self.counters.set_kv_len(slot, new_len);
        Ok(())
    }
}
