//! A rank's sequence state on the device: per SSM layer a conv history ring (`K − 1 + T` rows, in the activation
//! type), a checkpoint pool (f32) and an input ring (`x`/`u` and `B`/`k` in the activation type, `dt`/`g` in f32) with
//! one slot per sequence; paged K/V pools for the attention layers; and, on a rank started with a verify window, per
//! SSM layer the recurrent form's speculative snapshots (`[slots, T, state]` f32, [`alloc_snapshots`]). The
//! host-side books (slots, lengths, KV block tables) are the coordinator's [`crate::rank::Books`], which every rank
//! keeps identically; the per-slot ring and conv counters are the rank's [`crate::state::SlotCounters`]. The pools
//! are sized by the memory model's [`LayerValues`], the same counts `plan-memory` reports (every form at once: its
//! kv-only row past the threshold, plus the snapshots).

use rewind_kernels::cuda::ops::PagedKv;
use rewind_kernels::cuda::{CudaDevice, CudaSlice};

use super::layers::{GpuBlock, GpuMixer};
use super::Act;
use crate::error::Result;
use crate::state::memory::{pool_bytes, LayerValues, SlotRows};
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
    /// Input-ring rows per slot (`max(L, threshold + T)`) and conv rows beyond the history (`T`).
    pub rows: SlotRows,
}

/// The replay form's sizes on a rank: what the slot counters and the decisions of every step use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplaySettings {
    /// Input-ring capacity `L`.
    pub buffer_len: usize,
    /// The most tokens one verify takes (`T`).
    pub max_verify: usize,
    /// The kv-only threshold.
    pub threshold: usize,
    /// Whether sequences may verify drafts in the recurrent form ([`super::GpuOptions::recurrent_verify`]).
    pub recurrent_verify: bool,
}

impl ReplaySettings {
    /// The rows every slot's rings hold: `max(L, threshold + T)` input entries (any slot may start kv-only), `T`
    /// conv rows beyond the history, and — when the rank verifies drafts (`T > 1`: a verify of one token is a decode
    /// step) in the recurrent form — `T` state snapshots for its baseline verify. The snapshots cost `T` states per
    /// slot and layer, so a rank started without speculation or for other forms keeps none and refuses a recurrent
    /// verify.
    pub fn rows(&self) -> SlotRows {
        SlotRows {
            ring: self.buffer_len.max(self.threshold + self.max_verify),
            conv_extra: self.max_verify,
            snapshots: if self.recurrent_verify && self.max_verify > 1 {
                self.max_verify
            } else {
                0
            },
        }
    }
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
        /// `[slots, K − 1 + T, conv_dim]`.
        conv: CudaSlice<A>,
        /// `[slots, state]`.
        ssm: CudaSlice<f32>,
        /// The input ring `[slots, rows, ·]`: Mamba-2 `x`, `dt`, `B`; GDN `u`, `g`, `k`.
        ring_a: CudaSlice<A>,
        ring_f: CudaSlice<f32>,
        ring_b: CudaSlice<A>,
    },
    Kv {
        k: CudaSlice<A>,
        v: CudaSlice<A>,
        layout: PagedKv,
    },
}

/// The memory model's element counts of one block's pools, from the rank-local spec the block was built from, with
/// the ring's B / k cached per virtual group (what the replay kernels read).
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
        GpuMixer::Mamba2(m) => {
            let mut d = SsmDims::mamba2(&m.spec);
            d.ring_fields[2].width = m.dims.groups * m.dims.state_dim;
            ssm(d, m.conv_dim)
        }
        GpuMixer::Gdn(m) => {
            let mut d = SsmDims::gdn(&m.spec);
            d.ring_fields[1].width = m.dims.k_heads * m.dims.k_dim;
            ssm(d, m.conv_dim)
        }
        GpuMixer::Attention(a) => LayerValues::attention(&a.spec),
        GpuMixer::Mlp(_) | GpuMixer::Moe(_) => LayerValues::default(),
    }
}

/// Bytes of state one sequence slot takes in `blocks` (conv, SSM state and its snapshots, input rings), and bytes per
/// KV block over all attention layers: [`pool_bytes`] at the activation type's size, the sizes [`alloc_pools`] and
/// [`alloc_snapshots`] allocate.
pub(crate) fn state_bytes<'b, A: Act + 'b>(
    blocks: impl IntoIterator<Item = &'b GpuBlock<A>>,
    rows: SlotRows,
) -> (usize, usize) {
    let e = std::mem::size_of::<A>() as u64;
    let (per_seq, per_block) = pool_bytes(blocks.into_iter().map(|b| layer_values(&b.mixer)), BLOCK_SIZE, e, rows);
    (per_seq as usize, per_block as usize)
}

/// Allocates every SSM layer's snapshot pool for the recurrent form's baseline verify (`gpu/steps.rs`):
/// `[slots, snapshots, state]` f32, indexed by slot like the state pool, so that the commit, a later step, finds the
/// snapshots of the verify it commits. `None` for the other layers, and for every layer of a rank that keeps no
/// snapshots ([`SlotRows::snapshots`] = 0).
pub(crate) fn alloc_snapshots<A: Act>(
    dev: &CudaDevice,
    blocks: &[GpuBlock<A>],
    sizes: PoolSizes,
) -> Result<Vec<Option<CudaSlice<f32>>>> {
    blocks
        .iter()
        .map(|b| {
            let state = layer_values(&b.mixer).state;
            let len = sizes.max_seqs * sizes.rows.snapshots * state;
            Ok(match &b.mixer {
                GpuMixer::Mamba2(_) | GpuMixer::Gdn(_) if len > 0 => Some(dev.alloc_zeros(len)?),
                _ => None,
            })
        })
        .collect()
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
            let (n, r) = (sizes.max_seqs, sizes.rows.ring);
            Ok(match &b.mixer {
                GpuMixer::Mamba2(m) => LayerPool::Ssm {
                    conv: dev.alloc_zeros(n * (values.conv + sizes.rows.conv_extra * values.conv_row))?,
                    ssm: dev.alloc_zeros(n * values.state)?,
                    ring_a: dev.alloc_zeros((n * r * m.dims.heads * m.dims.head_dim).max(1))?,
                    ring_f: dev.alloc_zeros((n * r * m.dims.heads).max(1))?,
                    ring_b: dev.alloc_zeros((n * r * m.dims.groups * m.dims.state_dim).max(1))?,
                },
                GpuMixer::Gdn(m) => LayerPool::Ssm {
                    conv: dev.alloc_zeros(n * (values.conv + sizes.rows.conv_extra * values.conv_row))?,
                    ssm: dev.alloc_zeros(n * values.state)?,
                    ring_a: dev.alloc_zeros((n * r * m.dims.v_heads * m.dims.v_dim).max(1))?,
                    ring_f: dev.alloc_zeros((n * r * m.dims.v_heads).max(1))?,
                    ring_b: dev.alloc_zeros((n * r * m.dims.k_heads * m.dims.k_dim).max(1))?,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The recurrent baseline's snapshots cost `T` states per slot: only a rank that verifies drafts in the recurrent
    /// form keeps them.
    #[test]
    fn snapshots_only_with_a_window_of_drafts_in_the_recurrent_form() {
        let settings = |max_verify, recurrent_verify| ReplaySettings {
            buffer_len: 16,
            max_verify,
            threshold: 12,
            recurrent_verify,
        };
        assert_eq!(settings(1, true).rows().snapshots, 0);
        assert_eq!(settings(5, false).rows().snapshots, 0);
        let rows = settings(5, true).rows();
        assert_eq!((rows.snapshots, rows.conv_extra, rows.ring), (5, 5, 17));
    }
}
