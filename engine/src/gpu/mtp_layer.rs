//! The checkpoint's MTP layer on a GPU rank (issue 41; the CPU's is [`MtpHead`]): its input projection and norms,
//! and its attention and FFN blocks as the same device blocks as the target's ([`GpuBlock`]), so the one block loop
//! (`forward::blocks`) runs them. Under tensor parallelism the blocks hold the rank's share (the loader split them
//! like the target's, `RankPlan::with_mtp`) and the projection and norms are whole on every rank.
//!
//! Its KV is one more attention layer of the rank's paged pool, read through the target's block tables: the entry
//! of KV index `i` lies where the target's position `i` does ([`crate::rank::mtp`] keeps `i ≤` the position, so the
//! target already holds the block). Only the draft rows, run past the step's last position, may fall beyond the
//! target's blocks: each slot has [`extra_blocks`] blocks of its own past the shared ones for them.

use rewind_kernels::cuda::ops::PagedKv;
use rewind_kernels::cuda::{CudaDevice, CudaSlice};

use super::layers::{attention, mlp, moe, GpuBlock, GpuMixer};
use super::state::{PoolSizes, BLOCK_SIZE};
use super::weights::{act_of, DeviceLinear};
use super::Act;
use crate::error::Result;
use crate::model::mtp::{MtpFfn, MtpHead};

/// The MTP layer's weights on the device.
pub(crate) struct GpuMtpLayer<A: Act> {
    /// `[hidden, 2·hidden]`: the normed embedding's half of the input first, then the normed hidden row's.
    pub(crate) fc: DeviceLinear<A>,
    pub(crate) norm_embedding: CudaSlice<A>,
    pub(crate) norm_hidden: CudaSlice<A>,
    /// The attention block, then the MLP or MoE block.
    pub(crate) blocks: Vec<GpuBlock<A>>,
    /// The output norm: the LM head's input, and the next draft step's hidden row.
    pub(crate) norm: CudaSlice<A>,
}

impl<A: Act> GpuMtpLayer<A> {
    /// Uploads the rank's share of the MTP layer the loader read (`hidden`: the model's width).
    pub(crate) fn upload(dev: &CudaDevice, head: &MtpHead, hidden: usize) -> Result<Self> {
        let p = head.parts();
        let ffn = match p.ffn {
            MtpFfn::Mlp(m) => GpuMixer::Mlp(Box::new(mlp(dev, m)?)),
            MtpFfn::Moe(m) => GpuMixer::Moe(Box::new(moe(dev, m)?)),
        };
        Ok(GpuMtpLayer {
            fc: DeviceLinear::new(dev, p.fc, None, hidden, 2 * hidden)?,
            norm_embedding: act_of(dev, p.pre_fc_norm_embedding)?,
            norm_hidden: act_of(dev, p.pre_fc_norm_hidden)?,
            blocks: vec![
                GpuBlock {
                    norm: act_of(dev, p.attn_norm)?,
                    mixer: GpuMixer::Attention(Box::new(attention(dev, p.attn)?)),
                },
                GpuBlock {
                    norm: act_of(dev, p.ffn_norm)?,
                    mixer: ffn,
                },
            ],
            norm: act_of(dev, p.norm)?,
        })
    }

    /// The paged layout of the layer's K and V pools for pools of `sizes` on a rank verifying `max_verify` tokens:
    /// the target's blocks, then [`extra_blocks`] of each slot's own; every slot's table row is wider by as many.
    pub(crate) fn kv_layout(&self, sizes: PoolSizes, max_verify: usize) -> PagedKv {
        let extra = extra_blocks(max_verify);
        let (kv_heads, head_dim) = match &self.blocks[0].mixer {
            GpuMixer::Attention(a) => (a.spec.kv_heads, a.spec.head_dim),
            // `upload` builds the attention block first.
            _ => (0, 0),
        };
        PagedKv {
            num_blocks: sizes.num_blocks + sizes.max_seqs * extra,
            block_size: BLOCK_SIZE,
            kv_heads,
            head_dim,
            num_slots: sizes.max_seqs,
            blocks_per_slot: sizes.blocks_per_seq() + extra,
        }
    }
}

/// Blocks of its own each slot's MTP KV has past the target's, for the draft rows of one window: a window proposes
/// at most `max_verify − 1` drafts (the next verify's tokens after its first), which run `max_verify − 2` rows past
/// the step's last position, the first of them in the block after the target's last at worst.
pub(crate) fn extra_blocks(max_verify: usize) -> usize {
    max_verify.saturating_sub(2).div_ceil(BLOCK_SIZE).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slot's draft rows stay inside its table row: the last draft row of a window of `T − 1` drafts, run from a
    /// step that ends on the last position the target's blocks hold, lands in one of the slot's own blocks.
    #[test]
    fn the_own_blocks_hold_a_windows_draft_rows() {
        for max_verify in 1..=64 {
            let extra = extra_blocks(max_verify);
            for held in 1..4 {
                // The step's rows end at KV index `held · B − 1`; draft step d (1-based) runs at `held · B − 1 + d`.
                let drafts = max_verify.saturating_sub(1);
                let last = (held * BLOCK_SIZE - 1 + drafts.saturating_sub(1)) / BLOCK_SIZE;
                assert!(last < held + extra, "T {max_verify}: block {last} of {held} + {extra}");
            }
        }
        assert_eq!(extra_blocks(4), 1);
        assert_eq!(extra_blocks(18), 1);
        assert_eq!(extra_blocks(19), 2);
    }
}
