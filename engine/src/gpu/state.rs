//! A rank's sequence state on the device: per layer a conv-state pool (in the activation type) and an SSM-state pool
//! (f32) with one slot per sequence, paged K/V pools for the attention layers, and the host-side books (free slots,
//! free KV blocks, block tables, lengths) that every rank keeps identically because every rank sees the same commands.
//! The pools are sized by the memory model's [`LayerValues`], the same counts `plan-memory` reports.

use rewind_kernels::cuda::ops::PagedKv;
use rewind_kernels::cuda::{CudaDevice, CudaSlice};

use super::layers::{GpuBlock, GpuMixer};
use super::Act;
use crate::error::{EngineError, Result};
use crate::state::kv::{KvBlocks, NO_BLOCK};
use crate::state::memory::{pool_bytes, LayerValues};
use crate::state::{PoolError, SlotAllocator, SsmDims};

/// Tokens per KV block.
pub const BLOCK_SIZE: usize = 16;

/// How many sequences and KV blocks the pools hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolSizes {
    /// Sequence slots (the most sequences alive at once).
    pub max_seqs: usize,
    /// Longest sequence, in tokens (a multiple of [`BLOCK_SIZE`]).
    pub max_len: usize,
    /// KV blocks shared by all sequences (per attention layer).
    pub num_blocks: usize,
}

impl PoolSizes {
    /// Block-table entries per sequence.
    pub fn blocks_per_seq(&self) -> usize {
        self.max_len.div_ceil(BLOCK_SIZE)
    }
}

/// One layer's pools.
pub(crate) enum LayerPool<A: Act> {
    None,
    Ssm {
        conv: CudaSlice<A>,
        ssm: CudaSlice<f32>,
    },
    Kv {
        k: CudaSlice<A>,
        v: CudaSlice<A>,
        layout: PagedKv,
    },
}

/// The memory model's element counts of one block's pools, from the rank-local spec the block was built from.
fn layer_values<A: Act>(mixer: &GpuMixer<A>) -> LayerValues {
    let ssm = |d: SsmDims, conv_dim: usize| {
        // The conv kernels index rows by the block's own width; a model that disagreed would size the pool wrong.
        debug_assert_eq!(
            d.conv_dim, conv_dim,
            "memory model and device block disagree on conv_dim"
        );
        LayerValues::ssm(&d)
    };
    match mixer {
        GpuMixer::Mamba2(m) => ssm(SsmDims::mamba2(&m.spec), m.conv_dim),
        GpuMixer::Gdn(m) => ssm(SsmDims::gdn(&m.spec), m.conv_dim),
        GpuMixer::Attention(a) => LayerValues::attention(&a.spec),
        GpuMixer::Mlp(_) | GpuMixer::Moe(_) => LayerValues::default(),
    }
}

/// Bytes of state one sequence slot takes in `blocks` (conv + SSM state), and bytes per KV block over all attention
/// layers: [`pool_bytes`] at the activation type's size, the sizes [`alloc_pools`] allocates.
pub(crate) fn state_bytes<A: Act>(blocks: &[GpuBlock<A>]) -> (usize, usize) {
    let e = std::mem::size_of::<A>() as u64;
    let (per_seq, per_block) = pool_bytes(blocks.iter().map(|b| layer_values(&b.mixer)), BLOCK_SIZE, e);
    (per_seq as usize, per_block as usize)
}

/// Allocates every layer's pools (SSM pools zeroed: a fresh slot starts from zero state anyway).
pub(crate) fn alloc_pools<A: Act>(
    dev: &CudaDevice,
    blocks: &[GpuBlock<A>],
    sizes: PoolSizes,
) -> Result<Vec<LayerPool<A>>> {
    blocks
        .iter()
        .map(|b| {
            let values = layer_values(&b.mixer);
            Ok(match &b.mixer {
                GpuMixer::Mamba2(_) | GpuMixer::Gdn(_) => LayerPool::Ssm {
                    conv: dev.alloc_zeros(sizes.max_seqs * values.conv)?,
                    ssm: dev.alloc_zeros(sizes.max_seqs * values.state)?,
                },
                GpuMixer::Attention(a) => {
                    let layout = PagedKv {
                        num_blocks: sizes.num_blocks,
                        block_size: BLOCK_SIZE,
                        kv_heads: a.spec.kv_heads,
                        head_dim: a.spec.head_dim,
                        num_slots: sizes.max_seqs,
                        blocks_per_slot: sizes.blocks_per_seq(),
                    };
                    debug_assert_eq!(
                        2 * layout.pool_len(),
                        sizes.num_blocks * BLOCK_SIZE * values.kv_per_token,
                        "memory model and paged layout disagree on KV values"
                    );
                    LayerPool::Kv {
                        k: dev.alloc(layout.pool_len())?,
                        v: dev.alloc(layout.pool_len())?,
                        layout,
                    }
                }
                GpuMixer::Mlp(_) | GpuMixer::Moe(_) => LayerPool::None,
            })
        })
        .collect()
}

/// The host books: the engine's slot allocator and KV block tables (`crate::state`), plus each slot's length.
#[derive(Clone, Debug)]
pub(crate) struct Books {
    pub(crate) sizes: PoolSizes,
    slots: SlotAllocator,
    kv: KvBlocks,
    /// Tokens cached per slot.
    pub(crate) lens: Vec<i32>,
    /// The block tables changed since they were last uploaded.
    pub(crate) table_dirty: bool,
}

impl Books {
    pub(crate) fn new(sizes: PoolSizes) -> Result<Self> {
        Ok(Books {
            sizes,
            slots: SlotAllocator::new(sizes.max_seqs),
            kv: KvBlocks::new(sizes.max_seqs, BLOCK_SIZE, sizes.blocks_per_seq(), sizes.num_blocks)?,
            lens: vec![0; sizes.max_seqs],
            table_dirty: true,
        })
    }

    /// The block tables as the kernels read them: `[max_seqs, blocks_per_seq]` i32, −1 where no block is assigned.
    pub(crate) fn table_i32(&self) -> Vec<i32> {
        self.kv
            .tables()
            .iter()
            .map(|&b| if b == NO_BLOCK { -1 } else { b as i32 })
            .collect()
    }

    /// Takes a free slot for a new sequence.
    pub(crate) fn open(&mut self) -> Result<usize> {
        let slot = self.slots.alloc().map_err(|_| {
            EngineError::InvalidInput(format!(
                "all {} sequence slots are in use (raise --max-seqs)",
                self.sizes.max_seqs
            ))
        })?;
        self.lens[slot] = 0;
        Ok(slot)
    }

    /// Frees a slot and its KV blocks.
    pub(crate) fn close(&mut self, slot: usize) -> Result<()> {
        self.check_live(slot)?;
        if self.kv.held(slot) > 0 {
            self.kv.fit(slot, 0)?;
            self.table_dirty = true;
        }
        self.slots.free(slot)?;
        self.lens[slot] = 0;
        Ok(())
    }

    pub(crate) fn check_live(&self, slot: usize) -> Result<()> {
        if self.slots.is_allocated(slot) {
            Ok(())
        } else {
            Err(EngineError::InvalidInput(format!("sequence {slot} is not open")))
        }
    }

    /// The length slot `slot` would have after `t` more tokens, checked against the capacity.
    pub(crate) fn check_grow(&self, slot: usize, t: usize) -> Result<usize> {
        self.check_live(slot)?;
        let new_len = self.lens[slot] as usize + t;
        if new_len > self.sizes.max_len {
            return Err(EngineError::InvalidInput(format!(
                "sequence {slot} would reach {new_len} tokens, beyond the pools' limit of {} (raise --max-model-len)",
                self.sizes.max_len
            )));
        }
        Ok(new_len)
    }

    /// Checks that every `(slot, t)` of `growth` (distinct slots) can grow by `t` tokens together — lengths and KV
    /// blocks — with the errors [`Books::grow`] would give; changes nothing.
    pub(crate) fn check_growth(&self, growth: &[(usize, usize)], with_kv: bool) -> Result<()> {
        let mut blocks = 0;
        for &(slot, t) in growth {
            let new_len = self.check_grow(slot, t)?;
            if with_kv {
                blocks += self.kv.blocks_for(new_len).saturating_sub(self.kv.held(slot));
            }
        }
        if blocks > self.kv.free_count() {
            return Err(self.kv_full());
        }
        Ok(())
    }

    fn kv_full(&self) -> EngineError {
        EngineError::InvalidInput(format!(
            "the KV cache is full ({} blocks of {BLOCK_SIZE} tokens in use); release sequences or give the pools more \
             memory",
            self.kv.used_count()
        ))
    }

    /// Grows slot `slot` by `t` tokens, assigning KV blocks as needed (only when the model has attention layers,
    /// `with_kv`). On failure nothing changes.
    pub(crate) fn grow(&mut self, slot: usize, t: usize, with_kv: bool) -> Result<()> {
        let new_len = self.check_grow(slot, t)?;
        if with_kv {
            let before = self.kv.held(slot);
            if let Err(e) = self.kv.fit(slot, new_len) {
                return Err(match e {
                    PoolError::KvBlocksFull { .. } => self.kv_full(),
                    other => other.into(),
                });
            }
            self.table_dirty |= self.kv.held(slot) != before;
        }
        self.lens[slot] = new_len as i32;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn books_assign_and_free_blocks() {
        let sizes = PoolSizes {
            max_seqs: 2,
            max_len: 64,
            num_blocks: 5,
        };
        let mut b = Books::new(sizes).unwrap();
        let s0 = b.open().unwrap();
        let s1 = b.open().unwrap();
        assert!(b.open().is_err());
        b.grow(s0, 17, true).unwrap();
        assert_eq!(b.lens[s0], 17);
        assert_eq!(b.table_i32()[..4].iter().filter(|e| **e >= 0).count(), 2);
        b.grow(s1, 48, true).unwrap();
        // 2 + 3 blocks used: one more token on s0 fits its second block, a third block does not exist.
        b.grow(s0, 15, true).unwrap();
        let err = b.grow(s0, 1, true).unwrap_err().to_string();
        assert!(err.contains("KV cache is full"), "{err}");
        assert_eq!(b.lens[s0], 32, "a failed grow changes nothing");
        assert!(b.grow(s1, 17, true).unwrap_err().to_string().contains("limit of 64"));
        b.close(s1).unwrap();
        assert!(b.close(s1).is_err());
        b.grow(s0, 1, true).unwrap();
        assert_eq!(b.lens[s0], 33);
    }

    #[test]
    fn a_batch_is_checked_as_a_whole_before_anything_grows() {
        let sizes = PoolSizes {
            max_seqs: 3,
            max_len: 64,
            num_blocks: 4,
        };
        let mut b = Books::new(sizes).unwrap();
        let (s0, s1, s2) = (b.open().unwrap(), b.open().unwrap(), b.open().unwrap());
        b.grow(s0, 16, true).unwrap();
        b.grow(s1, 16, true).unwrap();
        b.grow(s2, 16, true).unwrap();
        // Each needs one more block for its 17th token; only one is free.
        let err = b.check_growth(&[(s0, 1), (s1, 1)], true).unwrap_err().to_string();
        assert!(err.contains("KV cache is full"), "{err}");
        b.check_growth(&[(s0, 1)], true).unwrap();
        b.check_growth(&[(s0, 1), (s1, 1)], false).unwrap();
        assert!(b
            .check_growth(&[(s0, 49)], true)
            .unwrap_err()
            .to_string()
            .contains("limit of 64"));
        assert_eq!(b.lens[..3], [16, 16, 16], "checks change nothing");
    }
}
