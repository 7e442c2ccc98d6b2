//! A GPU rank between loading and serving: its shard's weights on the device (uploaded block by block from the one
//! loader, [`ShardedModel::load_streaming`]) and what it can hold in the memory budget, before the ranks agree on the
//! pool sizes and [`LoadedRank::allocate`] makes it a serving [`super::rank::GpuRank`].

use std::ops::Range;
use std::sync::Arc;

use rewind_kernels::cuda::{Blas, CudaDevice, CudaSlice};
use tracing::debug_span;

use super::layers::{GpuBlock, GpuMixer};
use super::mtp::MtpScratch;
use super::mtp_layer::{extra_blocks, GpuMtpLayer};
use super::scratch::{attention_workspace, widths, Scratch, StepRows, Widths};
use super::state::{state_bytes, PoolSizes, BLOCK_SIZE};
use super::weights::stored;
use super::{Act, DeviceComm};
use crate::error::{EngineError, Result};
use crate::model::config::ModelConfig;
use crate::shard::ShardedModel;
use crate::state::memory::SlotRows;

const GIB: f64 = (1u64 << 30) as f64;

/// A rank whose weights are on the device, before its pools are sized.
pub(crate) struct LoadedRank<A: Act> {
    pub(super) rank: usize,
    pub(super) tp: usize,
    pub(super) dev: Arc<CudaDevice>,
    pub(super) blas: Blas,
    pub(super) comm: Option<Box<dyn DeviceComm>>,
    pub(super) config: ModelConfig,
    pub(super) vocab: Range<usize>,
    pub(super) embed: CudaSlice<A>,
    pub(super) lm_head: Option<CudaSlice<A>>,
    pub(super) final_norm: CudaSlice<A>,
    pub(super) blocks: Vec<GpuBlock<A>>,
    /// The checkpoint's MTP layer, when the rank drafts with it (`GpuOptions::mtp`).
    pub(super) mtp: Option<GpuMtpLayer<A>>,
    pub(super) weight_bytes: usize,
}

/// What a rank can hold, reported before the pools are allocated (ranks then agree on the smallest).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Capacity {
    /// KV blocks that fit in the budget after weights, scratch and SSM state.
    pub(crate) kv_blocks: usize,
    pub(crate) weight_bytes: usize,
    pub(crate) state_bytes: usize,
    pub(crate) scratch_bytes: usize,
    /// Bytes set aside for stored states (`GpuOptions::prefix_store`).
    pub(crate) store_bytes: usize,
    pub(crate) total_bytes: usize,
    /// Floats of the attention layers' split-KV workspace (part of `scratch_bytes`), handed on to the allocation.
    pub(crate) attention_ws: usize,
}

impl<A: Act> LoadedRank<A> {
    /// Loads rank `rank` of `tp` from the checkpoint in `dir` onto `dev`, with its share of the checkpoint's MTP
    /// layer when `mtp` (a checkpoint without one is a clear error, [`crate::model::mtp::checked_mtp_layout`]).
    pub(crate) fn load(
        dev: Arc<CudaDevice>,
        comm: Option<Box<dyn DeviceComm>>,
        dir: &std::path::Path,
        tp: usize,
        rank: usize,
        mtp: bool,
    ) -> Result<Self> {
        let _span = debug_span!("gpu_load", rank, tp).entered();
        let blas = Blas::new(&dev)?;
        let crate::shard::model::OpenCheckpoint {
            config,
            mut src,
            mtp: layout,
            ..
        } = crate::shard::model::OpenCheckpoint::open(dir, mtp)?;
        let mut blocks = Vec::with_capacity(config.num_blocks());
        // Each block is uploaded and dropped as soon as it is read: host memory holds one block at a time.
        let parts = ShardedModel::load_streaming(config, layout.as_ref(), tp, rank, &mut src, |b| {
            blocks.push(GpuBlock::upload(&dev, &b.norm, &b.mixer, &b.shard)?);
            Ok(())
        })?;
        let hidden = parts.config.hidden_size;
        let mtp = parts
            .mtp
            .as_ref()
            .map(|head| GpuMtpLayer::upload(&dev, head, hidden))
            .transpose()?;
        let embed = stored(&dev, &parts.embed)?;
        let lm_head = parts.lm_head.as_deref().map(|h| stored(&dev, h)).transpose()?;
        let final_norm = super::weights::act_of(&dev, &parts.final_norm)?;
        dev.synchronize()?;
        let (free, total) = dev.memory()?;
        Ok(LoadedRank {
            rank,
            tp,
            dev,
            blas,
            comm,
            vocab: parts.plan.vocab.clone(),
            config: parts.config,
            embed,
            lm_head,
            final_norm,
            blocks,
            mtp,
            weight_bytes: total - free,
        })
    }

    /// The target's blocks, then the MTP layer's.
    fn all_blocks(&self) -> impl Iterator<Item = &GpuBlock<A>> {
        self.blocks.iter().chain(self.mtp.iter().flat_map(|m| m.blocks.iter()))
    }

    /// Whether the rank keeps a paged KV cache: for the target's attention layers, or the MTP layer's (which reads
    /// the target's block tables, so a model without attention layers holds them for it).
    pub(super) fn has_attention(&self) -> bool {
        self.all_blocks().any(|b| matches!(b.mixer, GpuMixer::Attention(_)))
    }

    /// The scratch's widths for steps of `rows` token rows: every block's, the MTP layer's too (its input projection
    /// reads `[rows, 2·hidden]` from the scratch's wide temporaries).
    pub(super) fn widths(&self, rows: usize) -> Widths {
        let hidden = self.config.hidden_size;
        let mut w = widths(self.all_blocks(), hidden, rows);
        if self.mtp.is_some() {
            w.wide = w.wide.max(2 * hidden);
        }
        w
    }

    /// The KV blocks that fit in `fraction` of the device's memory with `max_seqs` sequences of up to `max_len`
    /// tokens, steps of `rows` tokens and `store` bytes of stored states; a clear error with the numbers when not
    /// even one full-length sequence fits.
    pub(crate) fn capacity(
        &self,
        fraction: f64,
        store: usize,
        max_seqs: usize,
        max_len: usize,
        rows: StepRows,
        slot_rows: SlotRows,
    ) -> Result<Capacity> {
        let (free, total) = self.dev.memory()?;
        let used = total - free;
        let hidden = self.config.hidden_size;
        let probe = PoolSizes {
            max_seqs,
            max_len,
            num_blocks: 0,
            rows: slot_rows,
        };
        let w = self.widths(rows.rows);
        let mut attention_ws = attention_workspace(&self.dev, &self.blocks, rows, probe)?;
        // The MTP layer's own bytes: its scratch, and each slot's blocks past the target's (`gpu/mtp_layer.rs`).
        let mut mtp_bytes = 0;
        if let Some(m) = &self.mtp {
            let extra = extra_blocks(rows.max_verify);
            // Its attention runs catch-up rows of up to a window and a repaired row per sequence, and reads tables
            // wider by its own blocks.
            let mtp_rows = StepRows::new(rows.prefill_chunk, max_seqs, rows.max_verify + 1);
            let wider = PoolSizes {
                max_len: probe.max_len + extra * BLOCK_SIZE,
                ..probe
            };
            attention_ws = attention_ws.max(attention_workspace(&self.dev, &m.blocks, mtp_rows, wider)?);
            let (_, mtp_block) = state_bytes(&m.blocks, slot_rows);
            mtp_bytes = max_seqs * extra * mtp_block + MtpScratch::<A>::bytes(probe, rows, hidden, self.tp);
        }
        let scratch = Scratch::<A>::bytes(
            &w,
            rows,
            hidden,
            self.vocab.len(),
            probe,
            self.tp,
            self.config.vocab_size,
        ) + 4 * attention_ws
            + mtp_bytes;
        // Per KV block: every attention layer's, the MTP layer's included.
        let (per_seq, per_block) = state_bytes(self.all_blocks(), slot_rows);
        let ssm = per_seq * max_seqs;
        let budget = (fraction * total as f64) as usize;
        let fixed = used + scratch + ssm + store;
        let one_seq_blocks = if self.has_attention() {
            probe.blocks_per_seq()
        } else {
            0
        };
        let kv_min = one_seq_blocks * per_block;
        if fixed + kv_min > budget {
            return Err(EngineError::Gpu(format!(
                "the model does not fit on GPU {}: weights and runtime {:.2} GiB + activations {:.2} GiB + SSM state for \
                 {max_seqs} sequences {:.2} GiB + prefix cache {:.2} GiB + KV cache for one {max_len}-token sequence \
                 {:.2} GiB = {:.2} GiB exceed --gpu-memory-fraction {fraction} × {:.2} GiB = {:.2} GiB (lower \
                 --max-seqs, --max-model-len or --prefix-cache-gib, raise the fraction, or use more GPUs with --tp)",
                self.dev.ordinal(),
                used as f64 / GIB,
                scratch as f64 / GIB,
                ssm as f64 / GIB,
                store as f64 / GIB,
                kv_min as f64 / GIB,
                (fixed + kv_min) as f64 / GIB,
                total as f64 / GIB,
                budget as f64 / GIB
            )));
        }
        let kv_blocks = match per_block {
            0 => 0,
            b => ((budget - fixed) / b).min(max_seqs * probe.blocks_per_seq()),
        };
        Ok(Capacity {
            kv_blocks,
            weight_bytes: self.weight_bytes,
            state_bytes: ssm + kv_blocks * per_block,
            scratch_bytes: scratch,
            store_bytes: store,
            total_bytes: total,
            attention_ws,
        })
    }
}
