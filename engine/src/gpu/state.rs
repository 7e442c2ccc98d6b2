//! A rank's sequence state on the device: per layer a conv-state pool (in the activation type) and an SSM-state pool
//! (f32) with one slot per sequence, and paged K/V pools for the attention layers. The host-side books (slots,
//! lengths, KV block tables) are the coordinator's [`crate::rank::Books`], which every rank keeps identically.

use rewind_kernels::cuda::ops::PagedKv;
use rewind_kernels::cuda::{CudaDevice, CudaSlice};

use super::layers::{GpuBlock, GpuMixer};
use super::Act;
use crate::error::Result;

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

/// Bytes of state one sequence slot takes in `blocks` (conv + SSM state), and bytes per KV block over all attention
/// layers.
pub(crate) fn state_bytes<A: Act>(blocks: &[GpuBlock<A>]) -> (usize, usize) {
    let (mut per_seq, mut per_block) = (0, 0);
    let e = std::mem::size_of::<A>();
    for b in blocks {
        match &b.mixer {
            GpuMixer::Mamba2(m) => {
                per_seq +=
                    (m.spec.conv_kernel - 1) * m.conv_dim * 2 + m.dims.heads * m.dims.head_dim * m.dims.state_dim * 4
            }
            GpuMixer::Gdn(m) => per_seq += (m.spec.conv_kernel - 1) * m.conv_dim * e + m.dims.state_len() * 4,
            GpuMixer::Attention(a) => per_block += 2 * BLOCK_SIZE * a.spec.kv_heads * a.spec.head_dim * e,
            GpuMixer::Mlp(_) | GpuMixer::Moe(_) => {}
        }
    }
    (per_seq, per_block)
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
            Ok(match &b.mixer {
                GpuMixer::Mamba2(m) => LayerPool::Ssm {
                    conv: dev.alloc_zeros(sizes.max_seqs * (m.spec.conv_kernel - 1) * m.conv_dim)?,
                    ssm: dev.alloc_zeros(sizes.max_seqs * m.dims.heads * m.dims.head_dim * m.dims.state_dim)?,
                },
                GpuMixer::Gdn(m) => LayerPool::Ssm {
                    conv: dev.alloc_zeros(sizes.max_seqs * (m.spec.conv_kernel - 1) * m.conv_dim)?,
                    ssm: dev.alloc_zeros(sizes.max_seqs * m.dims.state_len())?,
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
