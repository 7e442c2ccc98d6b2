//! A rank's sequence state on the device: per layer a conv-state pool (in the activation type) and an SSM-state pool
//! (f32) with one slot per sequence, and paged K/V pools for the attention layers. The host-side books (slots,
//! lengths, KV block tables) are the coordinator's [`crate::rank::Books`], which every rank keeps identically.
//! The pools are sized by the memory model's [`LayerValues`], the same counts `plan-memory` reports.

use rewind_kernels::cuda::ops::PagedKv;
use rewind_kernels::cuda::{CudaDevice, CudaSlice};

use super::layers::{GpuBlock, GpuMixer};
use super::Act;
use crate::error::Result;
use crate::state::memory::{pool_bytes, LayerValues};
use crate::state::SsmDims;

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
