//! Activation buffers of a rank, allocated once for the largest step (`rows` tokens: the prefill chunk or the
//! decode batch, whichever is larger) and reused by every layer.

use rewind_kernels::cuda::ops::{
    gdn_chunked_workspace, mamba2_chunked_workspace, paged_attention_workspace_len, PagedKv, MAX_CHUNK, REPLAY_META,
    SPEC_COMMIT_META,
};
use rewind_kernels::cuda::{CudaDevice, CudaSlice};

use super::chain::ChainScratch;
use super::head::{logits_len, HeadScratch};
use super::layers::{GpuBlock, GpuMixer};
use super::state::{PoolSizes, BLOCK_SIZE};
use super::whole_rows::WholeRows;
use super::Act;
use crate::error::Result;

pub(crate) struct Scratch<A: Act> {
    pub(crate) rows: usize,
    /// Rows that may ask for whole logit rows.
    pub(crate) whole: usize,
    /// The residual stream `[rows, hidden]` (f32), a block's output and a second f32 output (shared expert).
    pub(crate) x: CudaSlice<f32>,
    pub(crate) y: CudaSlice<f32>,
    pub(crate) y2: CudaSlice<f32>,
    /// The normalised block input.
    pub(crate) h: CudaSlice<A>,
    /// `[rows, wide]` activation temporaries.
    pub(crate) proj: CudaSlice<A>,
    pub(crate) a: CudaSlice<A>,
    pub(crate) b: CudaSlice<A>,
    pub(crate) c: CudaSlice<A>,
    pub(crate) d: CudaSlice<A>,
    pub(crate) e: CudaSlice<A>,
    pub(crate) g: CudaSlice<A>,
    /// `[rows, hidden]` f32: the router's input.
    pub(crate) hf: CudaSlice<f32>,
    /// `[rows, hidden]`: the routed experts' combined output.
    pub(crate) routed: CudaSlice<A>,
    /// `[rows, narrow]` f32 temporaries (dt, β, g, router logits, norm sums).
    pub(crate) f0: CudaSlice<f32>,
    pub(crate) f1: CudaSlice<f32>,
    pub(crate) ws: CudaSlice<f32>,
    /// Split-KV partials of the attention layers ([`attention_workspace`]).
    pub(crate) attention_ws: CudaSlice<f32>,
    /// MoE: `[rows · top_k, ·]` expert activations and the routing arrays.
    pub(crate) moe_up: CudaSlice<A>,
    pub(crate) moe_mid: CudaSlice<A>,
    pub(crate) moe_down: CudaSlice<A>,
    pub(crate) ids: CudaSlice<i32>,
    pub(crate) weights: CudaSlice<f32>,
    pub(crate) offsets: CudaSlice<i32>,
    pub(crate) grouped: CudaSlice<i32>,
    pub(crate) pos: CudaSlice<i32>,
    /// Logits: whole rows for `StepRows::whole` rows, or a bounded chunk of the vocabulary for every row
    /// (`gpu/head.rs`); and per-row argmax.
    pub(crate) logits: CudaSlice<f32>,
    pub(crate) argmax: CudaSlice<i32>,
    /// The LM head's summaries (`gpu/head.rs`).
    pub(crate) head: HeadScratch,
    /// Per-step metadata: token ids, each row's slot and position, each sequence's slot.
    pub(crate) tokens: CudaSlice<i32>,
    pub(crate) row_slots: CudaSlice<i32>,
    pub(crate) row_pos: CudaSlice<i32>,
    pub(crate) seq_slots: CudaSlice<i32>,
    /// `[rows, 8]` replay rows (`ReplayRow`): each sequence's (or prompt piece's) slot, ring position, fold and conv
    /// head.
    pub(crate) meta: CudaSlice<i32>,
    /// The block table and lengths, mirrored from the books.
    pub(crate) table: CudaSlice<i32>,
    pub(crate) lens: CudaSlice<i32>,
    /// `[slots, 2]` commits of recurrent verifies (slot, accepted): what the baseline's commit kernel reads.
    pub(crate) commits: CudaSlice<i32>,
    /// Chained decode steps' log and draws (`gpu/chain.rs`).
    pub(crate) chain: ChainScratch,
    /// Sampled rows joined from every rank's vocabulary slice (`gpu/whole_rows.rs`); `None` at TP 1.
    pub(crate) whole_rows: Option<WholeRows>,
}

/// How many token rows a step may hold: `rows` through the blocks (the larger of a prompt chunk and a verify of
/// every slot), of which `whole` may ask for whole logit rows (a prompt chunk, or a decode of every slot).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StepRows {
    pub(crate) rows: usize,
    pub(crate) whole: usize,
    /// What the rows were sized from: the prompt chunk, the slots and the longest verify window.
    pub(crate) prefill_chunk: usize,
    pub(crate) max_seqs: usize,
    pub(crate) max_verify: usize,
}

impl StepRows {
    /// For prompt chunks of `prefill_chunk` tokens, `max_seqs` slots and verifies of up to `max_verify` tokens.
    pub(crate) fn new(prefill_chunk: usize, max_seqs: usize, max_verify: usize) -> Self {
        StepRows {
            rows: prefill_chunk.max(max_seqs * max_verify.max(1)),
            whole: prefill_chunk.max(max_seqs),
            prefill_chunk,
            max_seqs,
            max_verify: max_verify.max(1),
        }
    }
}

/// Widths the temporaries need over every block.
#[derive(Default, Debug, Clone, Copy)]
pub(crate) struct Widths {
    pub(crate) wide: usize,
    pub(crate) narrow: usize,
    pub(crate) moe_rows_per_token: usize,
    pub(crate) moe_width: usize,
    pub(crate) experts: usize,
    pub(crate) workspace: usize,
}

pub(crate) fn widths<'b, A: Act + 'b>(
    blocks: impl IntoIterator<Item = &'b GpuBlock<A>>,
    hidden: usize,
    rows: usize,
) -> Widths {
    let mut w = Widths {
        wide: hidden,
        narrow: 1,
        ..Default::default()
    };
    for b in blocks {
        match &b.mixer {
            GpuMixer::Mamba2(m) => {
                w.wide = w.wide.max(m.in_proj.out_dim).max(m.conv_dim);
                w.narrow = w.narrow.max(m.dims.heads);
                if let super::layers::GatedNorm::Split { groups, .. } = m.norm {
                    w.narrow = w.narrow.max(groups);
                }
                let chunk = m.spec.chunk_size.min(MAX_CHUNK);
                w.workspace = w.workspace.max(mamba2_chunked_workspace(m.dims, rows, chunk));
            }
            GpuMixer::Gdn(m) => {
                w.wide = w.wide.max(m.proj_dim).max(m.conv_dim);
                w.wide = w.wide.max(m.dims.k_heads * m.dims.k_dim);
                w.narrow = w.narrow.max(m.dims.v_heads);
                let chunk = m.spec.chunk_size.min(MAX_CHUNK);
                w.workspace = w.workspace.max(gdn_chunked_workspace(m.dims, rows, chunk));
            }
            GpuMixer::Attention(a) => {
                w.wide = w.wide.max(a.q_proj.out_dim).max(a.spec.heads * a.spec.head_dim);
            }
            GpuMixer::Mlp(m) => w.wide = w.wide.max(m.up.out_dim),
            GpuMixer::Moe(m) => {
                let s = &m.spec;
                let d = s.expert_dim();
                let up_rows = m.up.len() / (s.num_experts * d);
                w.narrow = w.narrow.max(s.num_experts);
                w.moe_rows_per_token = w.moe_rows_per_token.max(s.top_k);
                w.moe_width = w.moe_width.max(up_rows).max(hidden).max(d);
                // A latent MoE keeps its latent input and the experts' latent sum in `a` and `b`.
                w.wide = w.wide.max(d);
                w.experts = w.experts.max(s.num_experts);
                if let Some(sh) = &m.shared {
                    w.wide = w.wide.max(sh.up.out_dim);
                }
            }
        }
    }
    w
}

/// Floats of split-KV partials the attention layers need at the largest of the steps the rank runs (decode and
/// verify batches of every size, prompt chunks of every length): the rank owns them, so that no step allocates and
/// a captured step (`gpu/graphs.rs`) always reads the same buffer.
pub(crate) fn attention_workspace<'b, A: Act + 'b>(
    dev: &CudaDevice,
    blocks: impl IntoIterator<Item = &'b GpuBlock<A>>,
    step: StepRows,
    sizes: PoolSizes,
) -> Result<usize> {
    let mut shapes: Vec<(usize, usize, usize)> = blocks
        .into_iter()
        .filter_map(|b| match &b.mixer {
            GpuMixer::Attention(a) => Some((a.spec.heads, a.spec.kv_heads, a.spec.head_dim)),
            _ => None,
        })
        .collect();
    shapes.sort_unstable();
    shapes.dedup();
    let mut need = 0;
    for (heads, kv_heads, head_dim) in shapes {
        let layout = PagedKv {
            num_blocks: 1,
            block_size: BLOCK_SIZE,
            kv_heads,
            head_dim,
            num_slots: sizes.max_seqs,
            blocks_per_slot: sizes.blocks_per_seq(),
        };
        let batched = (1..=step.max_verify).flat_map(|t| (1..=step.max_seqs).map(move |b| (t, b)));
        let prompts = (1..=step.prefill_chunk).map(|t| (t, 1));
        for (t, batch) in batched.chain(prompts) {
            need = need.max(paged_attention_workspace_len::<A>(dev, layout, heads, t, batch)?);
        }
    }
    Ok(need)
}

impl<A: Act> Scratch<A> {
    /// Bytes [`Scratch::new`] allocates (besides the attention workspace, [`attention_workspace`] floats).
    /// `tp`: the ranks of the group (the chain gathers their summaries; sampled rows are joined from their slices of
    /// the model's `vocab` ids).
    pub(crate) fn bytes(
        w: &Widths,
        step: StepRows,
        hidden: usize,
        vocab_local: usize,
        sizes: PoolSizes,
        tp: usize,
        vocab: usize,
    ) -> usize {
        let rows = step.rows;
        let moe = rows * w.moe_rows_per_token;
        let e = std::mem::size_of::<A>();
        4 * 4 * rows * hidden
            + e * rows * hidden
            + e * 7 * rows * w.wide
            + e * rows * hidden
            + 4 * 2 * rows * w.narrow
            + 4 * w.workspace
            + e * 3 * moe * w.moe_width
            + 4 * (4 * moe + w.experts + 1)
            + 4 * logits_len(step, vocab_local)
            + 4 * (6 + REPLAY_META) * rows
            + HeadScratch::bytes(rows, vocab_local)
            + 4 * (sizes.max_seqs * sizes.blocks_per_seq() + sizes.max_seqs)
            + 4 * SPEC_COMMIT_META * sizes.max_seqs
            + ChainScratch::bytes(sizes.max_seqs, tp)
            + WholeRows::bytes(vocab, tp, sizes.max_seqs)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        dev: &CudaDevice,
        w: &Widths,
        step: StepRows,
        hidden: usize,
        vocab_local: usize,
        sizes: PoolSizes,
        attention_ws: usize,
        (tp, rank, vocab): (usize, usize, usize),
    ) -> Result<Self> {
        let rows = step.rows;
        let moe = rows * w.moe_rows_per_token;
        Ok(Scratch {
            rows,
            whole: step.whole,
            x: dev.alloc_zeros(rows * hidden)?,
            y: dev.alloc_zeros(rows * hidden)?,
            y2: dev.alloc_zeros(rows * hidden)?,
            h: dev.alloc_zeros(rows * hidden)?,
            proj: dev.alloc_zeros(rows * w.wide)?,
            a: dev.alloc_zeros(rows * w.wide)?,
            b: dev.alloc_zeros(rows * w.wide)?,
            c: dev.alloc_zeros(rows * w.wide)?,
            d: dev.alloc_zeros(rows * w.wide)?,
            e: dev.alloc_zeros(rows * w.wide)?,
            g: dev.alloc_zeros(rows * w.wide)?,
            hf: dev.alloc_zeros(rows * hidden)?,
            routed: dev.alloc_zeros(rows * hidden)?,
            f0: dev.alloc_zeros(rows * w.narrow)?,
            f1: dev.alloc_zeros(rows * w.narrow)?,
            ws: dev.alloc_zeros(w.workspace.max(1))?,
            attention_ws: dev.alloc_zeros(attention_ws.max(1))?,
            moe_up: dev.alloc_zeros(moe * w.moe_width)?,
            moe_mid: dev.alloc_zeros(moe * w.moe_width)?,
            moe_down: dev.alloc_zeros(moe * w.moe_width)?,
            ids: dev.alloc_zeros(moe)?,
            weights: dev.alloc_zeros(moe)?,
            offsets: dev.alloc_zeros(w.experts + 1)?,
            grouped: dev.alloc_zeros(moe)?,
            pos: dev.alloc_zeros(moe)?,
            logits: dev.alloc_zeros(logits_len(step, vocab_local))?,
            argmax: dev.alloc_zeros(rows)?,
            head: HeadScratch::new(dev, rows, vocab_local)?,
            tokens: dev.alloc_zeros(rows)?,
            row_slots: dev.alloc_zeros(rows)?,
            row_pos: dev.alloc_zeros(rows)?,
            seq_slots: dev.alloc_zeros(rows)?,
            meta: dev.alloc_zeros(rows * REPLAY_META)?,
            table: dev.alloc_zeros(sizes.max_seqs * sizes.blocks_per_seq())?,
            lens: dev.alloc_zeros(sizes.max_seqs)?,
            commits: dev.alloc_zeros(SPEC_COMMIT_META * sizes.max_seqs)?,
            chain: ChainScratch::new(dev, sizes.max_seqs, tp)?,
            whole_rows: WholeRows::new(dev, vocab, tp, rank, sizes.max_seqs)?,
        })
    }
}
