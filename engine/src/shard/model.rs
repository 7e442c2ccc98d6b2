//! One tensor-parallel rank of the hybrid model on the CPU: its weights (only its slices, see [`super::plan`]) and
//! the pieces of the forward pass that are not a mixer — the vocab-parallel embedding (each rank writes its rows,
//! zeros elsewhere, then all-reduce), block norms, and the rank's slice of the LM head. An unsharded model is the
//! plan with one rank. The block loop that runs it, with every decode form, is [`crate::decode::Decoder`].
//!
//! The mixers are the single-rank ones, loaded with local specs. Mamba-2 and GDN shards read B/C (or q/k) of the
//! groups the rank holds, expanded to its virtual groups ([`expand`]); the Mamba-2 gated norm sums squares per global
//! group, all-reduced when a group spans ranks.

use std::borrow::Cow;

use rewind_kernels::cpu::gemm;
use rewind_kernels::cpu::norm;

use super::comm::Communicator;
use super::plan::{GroupedSplit, RankPlan, ShardKind};
use super::source::ShardSource;
use crate::error::{EngineError, Result};
use crate::model::config::{BlockKind, ModelConfig};
use crate::model::mixers::attention::AttentionMixer;
use crate::model::mixers::ffn::{Mlp, Moe};
use crate::model::mixers::gdn::GdnMixer;
use crate::model::mixers::mamba2::Mamba2Mixer;
use crate::model::mixers::Mixer;
use crate::model::mtp::{MtpHead, MtpLayout};
use crate::model::tensors::TensorSource;
use crate::state::{LayerState, SsmDims};

/// One block of a rank: its pre-norm weight, its local mixer and how the mixer is split.
pub struct ShardBlock {
    pub(crate) norm: Vec<f32>,
    pub(crate) mixer: Mixer,
    pub(crate) shard: ShardKind,
}

impl ShardBlock {
    /// The rank's part of the block's mixer (built from its local spec).
    pub fn mixer(&self) -> &Mixer {
        &self.mixer
    }

    /// How the block is split across ranks.
    pub fn shard(&self) -> &ShardKind {
        &self.shard
    }
}

/// A rank's weights outside its blocks (which [`ShardedModel::load_streaming`] hands out one by one).
pub(crate) struct ShardParts {
    pub(crate) config: ModelConfig,
    pub(crate) plan: RankPlan,
    pub(crate) embed: Vec<f32>,
    pub(crate) final_norm: Vec<f32>,
    pub(crate) lm_head: Option<Vec<f32>>,
    pub(crate) mtp: Option<MtpHead>,
}

/// A checkpoint directory opened for loading: its config (and the JSON it was parsed from), its tensors, and its MTP
/// layout when the caller runs the MTP layer — the one place a loader finds out whether `--spec mtp` can run.
pub struct OpenCheckpoint {
    pub config: ModelConfig,
    pub json: serde_json::Value,
    pub src: crate::checkpoint::SafetensorsSource,
    pub mtp: Option<MtpLayout>,
}

impl OpenCheckpoint {
    /// Opens the checkpoint in `dir`; with `mtp`, a checkpoint without MTP weights is a clear error
    /// ([`crate::model::mtp::checked_mtp_layout`]).
    pub fn open(dir: &std::path::Path, mtp: bool) -> Result<Self> {
        let (config, json) = ModelConfig::from_dir_json(dir)?;
        let src = crate::checkpoint::SafetensorsSource::open(dir)?;
        let mtp = match mtp {
            true => {
                let has = src.names().iter().any(|n| n.starts_with(crate::model::mtp::MTP_PREFIX));
                Some(crate::model::mtp::checked_mtp_layout(&config, &json, has, dir)?)
            }
            false => None,
        };
        Ok(OpenCheckpoint { config, json, src, mtp })
    }
}

/// One rank's share of a model.
pub struct ShardedModel {
    config: ModelConfig,
    plan: RankPlan,
    /// The rank's vocabulary rows, `[vocab slice, hidden]`.
    embed: Vec<f32>,
    blocks: Vec<ShardBlock>,
    final_norm: Vec<f32>,
    lm_head: Option<Vec<f32>>,
    /// The rank's share of the checkpoint's MTP layer, when it was loaded to run on the rank.
    mtp: Option<MtpHead>,
}

impl ShardedModel {
    /// Loads rank `rank` of `tp` from `src` (a whole-model source, e.g. the memory-mapped checkpoint every rank opens).
    pub fn load(config: ModelConfig, tp: usize, rank: usize, src: &mut dyn TensorSource) -> Result<Self> {
        Self::load_with_mtp(config, None, tp, rank, src)
    }

    /// [`ShardedModel::load`], also loading the rank's share of the MTP layer `mtp` describes
    /// ([`crate::model::mtp::mtp_layout`]) when given.
    pub fn load_with_mtp(
        config: ModelConfig,
        mtp: Option<&MtpLayout>,
        tp: usize,
        rank: usize,
        src: &mut dyn TensorSource,
    ) -> Result<Self> {
        let mut blocks = Vec::new();
        let parts = Self::load_streaming(config, mtp, tp, rank, src, |b| {
            blocks.push(b);
            Ok(())
        })?;
        Ok(ShardedModel {
            config: parts.config,
            plan: parts.plan,
            embed: parts.embed,
            blocks,
            final_norm: parts.final_norm,
            lm_head: parts.lm_head,
            mtp: parts.mtp,
        })
    }

    /// Like [`ShardedModel::load`], but hands each block to `on_block` as soon as it is loaded instead of keeping it
    /// (the returned parts hold no blocks): a backend that copies blocks elsewhere (the GPU runner) never holds more
    /// than one block in host memory.
    pub(crate) fn load_streaming(
        config: ModelConfig,
        mtp: Option<&MtpLayout>,
        tp: usize,
        rank: usize,
        src: &mut dyn TensorSource,
        mut on_block: impl FnMut(ShardBlock) -> Result<()>,
    ) -> Result<ShardParts> {
        let plan = {
            let view: &dyn TensorSource = src;
            let plan = RankPlan::new(&config, tp, rank, &|n| view.contains(n))?;
            match mtp {
                Some(layout) => plan.with_mtp(&config, layout, &|n| view.contains(n))?,
                None => plan,
            }
        };
        let hidden = config.hidden_size;
        let mut ss = ShardSource::new(src, plan.tensors());
        let embed = ss.take(&plan.embed.name, &plan.embed.local_shape())?;
        let mut progress = crate::progress::Progress::new(
            format!("loading rank {rank} of {tp} ({} blocks)", plan.blocks.len()),
            plan.blocks.len() as u64,
        );
        for b in &plan.blocks {
            let norm = ss.take(&b.norm.name, &[hidden])?;
            let p = b.prefix.as_str();
            let mixer = match &b.kind {
                BlockKind::Mamba2(s) => Mixer::Mamba2(Mamba2Mixer::load_shard(s, &mut ss, p)?),
                BlockKind::Gdn(s) => Mixer::Gdn(GdnMixer::load_shard(s, &mut ss, p)?),
                BlockKind::Attention(s) => Mixer::Attention(AttentionMixer::load(s, &mut ss, p)?),
                BlockKind::Mlp(s) => Mixer::Mlp(Mlp::load(s, &mut ss, p)?),
                BlockKind::Moe(s) => Mixer::Moe(Moe::load(s, &mut ss, p)?),
            };
            on_block(ShardBlock {
                norm,
                mixer,
                shard: b.shard.clone(),
            })?;
            progress.advance(1);
        }
        let mtp = match &plan.mtp {
            Some(m) => Some(MtpHead::load(&config, &m.local_layout(), &mut ss)?),
            None => None,
        };
        let final_norm = ss.take(&plan.final_norm.name, &[hidden])?;
        let lm_head = match &plan.lm_head {
            Some(t) => Some(ss.take(&t.name, &t.local_shape())?),
            None => None,
        };
        let keep: Vec<&str> = config.keep_prefixes.iter().map(String::as_str).collect();
        let ignore: Vec<&str> = config.ignore_prefixes.iter().map(String::as_str).collect();
        ss.finish(&keep, &ignore)?;
        Ok(ShardParts {
            config,
            plan,
            embed,
            final_norm,
            lm_head,
            mtp,
        })
    }

    /// Loads rank `rank` of `tp` from `dir/config.json` and the safetensors checkpoint beside it.
    pub fn from_dir(dir: &std::path::Path, tp: usize, rank: usize) -> Result<Self> {
        Self::from_dir_with(dir, tp, rank, false)
    }

    /// [`ShardedModel::from_dir`], with the rank's share of the checkpoint's MTP layer when `mtp` (a checkpoint
    /// without one is then a clear error, [`crate::model::mtp::checked_mtp_layout`]).
    pub fn from_dir_with(dir: &std::path::Path, tp: usize, rank: usize, mtp: bool) -> Result<Self> {
        let mut c = OpenCheckpoint::open(dir, mtp)?;
        Self::load_with_mtp(c.config, c.mtp.as_ref(), tp, rank, &mut c.src)
    }

    /// The rank's share of the MTP layer, when it was loaded.
    pub fn mtp(&self) -> Option<&MtpHead> {
        self.mtp.as_ref()
    }

    /// The whole model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// What this rank holds.
    pub fn plan(&self) -> &RankPlan {
        &self.plan
    }

    /// The rank's blocks, in model order.
    pub fn blocks(&self) -> &[ShardBlock] {
        &self.blocks
    }

    /// The per-sequence state each block needs on this rank: its shard's sizes, with the B (Mamba-2) or key (GDN)
    /// ring fields widened to the virtual groups the rank's kernels read (see [`GroupedSplit`]).
    pub fn layer_states(&self) -> Vec<LayerState> {
        self.blocks
            .iter()
            .map(|b| match (&b.mixer, &b.shard) {
                (Mixer::Mamba2(m), ShardKind::Mamba2 { split, .. }) => {
                    let s = m.spec();
                    let mut d = SsmDims::mamba2(s);
                    d.ring_fields[2].width = split.virtual_groups.len() * s.state_dim;
                    LayerState::Ssm(d)
                }
                (Mixer::Gdn(m), ShardKind::Gdn(split)) => {
                    let s = m.spec();
                    let mut d = SsmDims::gdn(s);
                    d.ring_fields[1].width = split.virtual_groups.len() * s.k_head_dim;
                    LayerState::Ssm(d)
                }
                (Mixer::Attention(m), _) => LayerState::Attention {
                    kv_heads: m.spec().kv_heads,
                    head_dim: m.spec().head_dim,
                },
                _ => LayerState::None,
            })
            .collect()
    }

    /// Checks that `tokens` can be appended to a sequence at `position`: ids in the vocabulary, context within the
    /// model's limit.
    pub fn check_tokens(&self, tokens: &[u32], position: usize) -> Result<()> {
        let vocab = self.config.vocab_size;
        if let Some((i, &t)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            return Err(EngineError::InvalidInput(format!(
                "token id {t} at index {i} is out of range (vocab size {vocab})"
            )));
        }
        let end = position + tokens.len();
        if end > self.config.max_position_embeddings {
            return Err(EngineError::InvalidInput(format!(
                "context of {end} tokens exceeds the model's limit of {} (max_position_embeddings)",
                self.config.max_position_embeddings
            )));
        }
        Ok(())
    }

    /// Checks that `comm` is this rank's communicator.
    pub fn check_comm(&self, comm: &dyn Communicator) -> Result<()> {
        if comm.size() != self.plan.tp || comm.rank() != self.plan.rank {
            return Err(EngineError::Communicator(format!(
                "rank {} of {} loaded, but the communicator is rank {} of {}",
                self.plan.rank,
                self.plan.tp,
                comm.rank(),
                comm.size()
            )));
        }
        Ok(())
    }

    /// The embedding rows of `tokens`, `[t, hidden]`, on every rank: each rank writes the rows of its vocabulary
    /// slice (zeros elsewhere) and the ranks all-reduce. Ids must have passed [`ShardedModel::check_tokens`].
    pub fn embed(&self, tokens: &[u32], comm: &dyn Communicator) -> Result<Vec<f32>> {
        let hidden = self.config.hidden_size;
        let mut x = vec![0.0f32; tokens.len() * hidden];
        let vr = &self.plan.vocab;
        for (row, &tok) in x.chunks_exact_mut(hidden).zip(tokens) {
            let tok = tok as usize;
            if vr.contains(&tok) {
                let at = (tok - vr.start) * hidden;
                row.copy_from_slice(&self.embed[at..at + hidden]);
            }
        }
        if self.plan.tp > 1 {
            comm.all_reduce_sum(&mut x)?;
        }
        Ok(x)
    }

    /// A block's mixer input: the residual stream `x` (`[t, hidden]`) under the block's RMSNorm.
    pub fn block_input(&self, block: &ShardBlock, x: &[f32]) -> Vec<f32> {
        norm::rms_norm_vec(x, &block.norm, self.config.norm_eps, self.config.norm_offset)
    }

    /// Final norm and this rank's slice of the LM head over residual rows `x` (`[rows, hidden]`): `[rows,
    /// plan().vocab.len()]` logits for vocabulary ids `plan().vocab`. Not checked for non-finite values (ranks would
    /// disagree on the error; the summaries carry NaN to the coordinator instead).
    pub fn head(&self, x: &[f32]) -> Vec<f32> {
        let hidden = self.config.hidden_size;
        let rows = x.len() / hidden.max(1);
        let normed = norm::rms_norm_vec(x, &self.final_norm, self.config.norm_eps, self.config.norm_offset);
        let head = self.lm_head.as_deref().unwrap_or(&self.embed);
        gemm::linear(&normed, head, None, rows, hidden, self.plan.vocab.len())
    }

    /// Residual rows `x` (`[rows, hidden]`) under the final norm: the LM head's input, and an MTP layer's hidden input.
    pub fn final_norm_rows(&self, x: &[f32]) -> Vec<f32> {
        norm::rms_norm_vec(x, &self.final_norm, self.config.norm_eps, self.config.norm_offset)
    }

    /// This rank's slice of the LM head, `[plan().vocab.len(), hidden]` (the embedding's rows when tied).
    pub fn lm_head_slice(&self) -> &[f32] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }

    /// One-pass summaries of residual rows `x` `[rows, hidden]` over this rank's vocabulary slice (the final norm,
    /// then the head a vocabulary tile at a time; see `rewind_kernels::cpu::lm_head`): no logits are written. Row `r`
    /// also gets its speculative summary when `spec[r]` asks, its log-probability part when `logprob[r]` does.
    pub fn head_pass(
        &self,
        x: &[f32],
        spec: &[Option<rewind_kernels::cpu::lm_head::SpecRequest>],
        logprob: &[Option<rewind_kernels::cpu::lm_head::LogprobRequest>],
    ) -> Vec<rewind_kernels::cpu::lm_head::RowPass> {
        let hidden = self.config.hidden_size;
        let normed = norm::rms_norm_vec(x, &self.final_norm, self.config.norm_eps, self.config.norm_offset);
        let head = self.lm_head.as_deref().unwrap_or(&self.embed);
        rewind_kernels::cpu::lm_head::head_pass_with(&normed, head, hidden, self.plan.vocab.start as u32, spec, logprob)
    }
}

/// Copies, per row of `groups` groups of `width`, the group each virtual group reads.
pub(crate) fn expand<'a>(src: &'a [f32], width: usize, split: &GroupedSplit) -> Cow<'a, [f32]> {
    if split.is_identity() {
        return Cow::Borrowed(src);
    }
    let row_len = split.groups.len() * width;
    let mut out = Vec::with_capacity(src.len() / row_len * split.virtual_groups.len() * width);
    for row in src.chunks_exact(row_len) {
        for &g in &split.virtual_groups {
            out.extend_from_slice(&row[g * width..(g + 1) * width]);
        }
    }
    Cow::Owned(out)
}
