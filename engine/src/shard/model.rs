//! One tensor-parallel rank of the hybrid model on the CPU: it loads only its slices (see [`super::plan`]) and runs
//! prefill and decode with all-reduces through a [`Communicator`].
//!
//! Per block, every rank normalises the full (replicated) residual stream, runs its slice of the mixer and all-reduces
//! the partial output of the row-parallel projection; the mixers are the single-rank ones, loaded with local specs.
//! Mamba-2 and GDN shards run their own scan closure, which expands B/C (or q/k) from the groups the rank holds to its
//! virtual groups; the Mamba-2 gated norm sums squares per global group, all-reduced when a group spans ranks. The
//! embedding is vocab-parallel (each rank writes its rows, zeros elsewhere, then all-reduce) and so is the LM head
//! (each rank's logits are all-gathered).

use std::borrow::Cow;
use std::ops::Range;

use rewind_kernels::cpu::act::silu;
use rewind_kernels::cpu::gdn::{gdn_chunked, gdn_step, GdnDims};
use rewind_kernels::cpu::gemm;
use rewind_kernels::cpu::mamba2::{mamba2_chunked, mamba2_step, Mamba2Dims};
use rewind_kernels::cpu::norm;

use super::comm::Communicator;
use super::plan::{even_split, GroupedSplit, RankPlan, ShardKind};
use super::source::ShardSource;
use crate::error::{EngineError, Result};
use crate::model::config::{BlockKind, ModelConfig};
use crate::model::hybrid::{BlockState, Logits, Mixer, SequenceState};
use crate::model::mixers::attention::AttentionMixer;
use crate::model::mixers::ffn::{Mlp, Moe};
use crate::model::mixers::gdn::{GdnMixer, GdnState};
use crate::model::mixers::mamba2::{Mamba2Mixer, Mamba2State};
use crate::model::tensors::TensorSource;

/// One block of a rank: its pre-norm weight, its local mixer and how the mixer is split.
pub(crate) struct ShardBlock {
    pub(crate) norm: Vec<f32>,
    pub(crate) mixer: Mixer,
    pub(crate) shard: ShardKind,
}

/// A rank's weights outside its blocks (which [`ShardedModel::load_streaming`] hands out one by one).
pub(crate) struct ShardParts {
    pub(crate) config: ModelConfig,
    pub(crate) plan: RankPlan,
    pub(crate) embed: Vec<f32>,
    pub(crate) final_norm: Vec<f32>,
    pub(crate) lm_head: Option<Vec<f32>>,
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
}

impl ShardedModel {
    /// Loads rank `rank` of `tp` from `src` (a whole-model source, e.g. the memory-mapped checkpoint every rank opens).
    pub fn load(config: ModelConfig, tp: usize, rank: usize, src: &mut dyn TensorSource) -> Result<Self> {
        let mut blocks = Vec::new();
        let parts = Self::load_streaming(config, tp, rank, src, |b| {
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
        })
    }

    /// Like [`ShardedModel::load`], but hands each block to `on_block` as soon as it is loaded instead of keeping it
    /// (the returned parts hold no blocks): a backend that copies blocks elsewhere (the GPU runner) never holds more
    /// than one block in host memory.
    pub(crate) fn load_streaming(
        config: ModelConfig,
        tp: usize,
        rank: usize,
        src: &mut dyn TensorSource,
        mut on_block: impl FnMut(ShardBlock) -> Result<()>,
    ) -> Result<ShardParts> {
        let plan = {
            let view: &dyn TensorSource = src;
            RankPlan::new(&config, tp, rank, &|n| view.contains(n))?
        };
        let hidden = config.hidden_size;
        let mut ss = ShardSource::new(src, plan.tensors());
        let embed = ss.take(&plan.embed.name, &plan.embed.local_shape())?;
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
        }
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
        })
    }

    /// Loads rank `rank` of `tp` from `dir/config.json` and the safetensors checkpoint beside it.
    pub fn from_dir(dir: &std::path::Path, tp: usize, rank: usize) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let mut src = crate::checkpoint::SafetensorsSource::open(dir)?;
        Self::load(config, tp, rank, &mut src)
    }

    /// The whole model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// What this rank holds.
    pub fn plan(&self) -> &RankPlan {
        &self.plan
    }

    /// A fresh state for a new sequence: this rank's slice of every layer's state.
    pub fn new_state(&self) -> SequenceState {
        let blocks = self
            .blocks
            .iter()
            .map(|b| match &b.mixer {
                Mixer::Mamba2(m) => BlockState::Mamba2(m.new_state()),
                Mixer::Gdn(m) => BlockState::Gdn(m.new_state()),
                Mixer::Attention(m) => BlockState::Kv(m.new_cache()),
                Mixer::Mlp(_) | Mixer::Moe(_) => BlockState::Stateless,
            })
            .collect();
        SequenceState { blocks, position: 0 }
    }

    /// Like [`crate::model::Model::forward`], on this rank: every rank of `comm` must make the same call with the same
    /// tokens. Returns the full logits (gathered from every rank's vocabulary slice) on every rank.
    pub fn forward(
        &self,
        tokens: &[u32],
        state: &mut SequenceState,
        which: Logits,
        comm: &dyn Communicator,
    ) -> Result<Vec<f32>> {
        let (vocab, first) = (self.config.vocab_size, state.position);
        let local = self.forward_local(tokens, state, which, comm)?;
        let rows = local.len() / self.plan.vocab.len();
        let logits = gather_vocab(&local, rows, vocab, comm)?;
        if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
            return Err(EngineError::NonFinite {
                position: first + tokens.len() - rows + i / vocab,
            });
        }
        Ok(logits)
    }

    /// Like [`ShardedModel::forward`], but returns only this rank's logits, `[rows, plan().vocab.len()]` for vocabulary
    /// ids `plan().vocab`; summarise them across ranks with [`summarise`]. Not checked for non-finite values (ranks
    /// would disagree on the error; the summary carries NaN/inf to every rank instead).
    pub fn forward_local(
        &self,
        tokens: &[u32],
        state: &mut SequenceState,
        which: Logits,
        comm: &dyn Communicator,
    ) -> Result<Vec<f32>> {
        let (t, hidden, vocab) = (tokens.len(), self.config.hidden_size, self.config.vocab_size);
        if comm.size() != self.plan.tp || comm.rank() != self.plan.rank {
            return Err(EngineError::Communicator(format!(
                "rank {} of {} loaded, but the communicator is rank {} of {}",
                self.plan.rank,
                self.plan.tp,
                comm.rank(),
                comm.size()
            )));
        }
        if t == 0 {
            return Err(EngineError::InvalidInput("no tokens to process".into()));
        }
        if let Some(&bad) = tokens.iter().find(|&&tok| tok as usize >= vocab) {
            return Err(EngineError::InvalidInput(format!(
                "token id {bad} is out of range (vocab size {vocab})"
            )));
        }
        if state.position + t > self.config.max_position_embeddings {
            return Err(EngineError::InvalidInput(format!(
                "context of {} tokens exceeds the model's limit of {} (max_position_embeddings)",
                state.position + t,
                self.config.max_position_embeddings
            )));
        }
        let mut x = vec![0.0f32; t * hidden];
        let vr = &self.plan.vocab;
        for (row, &tok) in x.chunks_exact_mut(hidden).zip(tokens) {
            let tok = tok as usize;
            if vr.contains(&tok) {
                let at = (tok - vr.start) * hidden;
                row.copy_from_slice(&self.embed[at..at + hidden]);
            }
        }
        comm.all_reduce_sum(&mut x)?;
        let pos = state.position;
        let (eps, offset) = (self.config.norm_eps, self.config.norm_offset);
        for (block, bstate) in self.blocks.iter().zip(state.blocks.iter_mut()) {
            let h = norm::rms_norm_vec(&x, &block.norm, eps, offset);
            let mut y = match (&block.mixer, bstate) {
                (Mixer::Mamba2(m), BlockState::Mamba2(s)) => mamba2(m, &block.shard, &h, t, s, comm)?,
                (Mixer::Gdn(m), BlockState::Gdn(s)) => gdn(m, &block.shard, &h, t, s)?,
                (Mixer::Attention(m), BlockState::Kv(c)) => m.forward(&h, t, pos, c),
                (Mixer::Mlp(m), BlockState::Stateless) => m.forward(&h, t),
                (Mixer::Moe(m), BlockState::Stateless) => m.forward(&h, t),
                _ => {
                    return Err(EngineError::InvalidInput(
                        "sequence state does not belong to this model".into(),
                    ))
                }
            };
            comm.all_reduce_sum(&mut y)?;
            for (xi, yi) in x.iter_mut().zip(&y) {
                *xi += yi;
            }
        }
        state.position += t;
        let rows = match which {
            Logits::All => t,
            Logits::Last => 1,
        };
        let normed = norm::rms_norm_vec(&x[(t - rows) * hidden..], &self.final_norm, eps, offset);
        let head = self.lm_head.as_deref().unwrap_or(&self.embed);
        Ok(gemm::linear(&normed, head, None, rows, hidden, vr.len()))
    }
}

/// What every rank learns about one position's full logits from the ranks' vocabulary slices, without gathering
/// them (design.md: ranks exchange summaries, not logits).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VocabSummary {
    /// The greedy token: the lowest id among the largest logits.
    pub argmax: u32,
    pub max_logit: f32,
    /// `log Σ exp(logit)` over the whole vocabulary.
    pub log_sum_exp: f32,
}

/// Combines every rank's `[rows, its vocab slice]` logits (from [`ShardedModel::forward_local`]; `vocab` is the slice's
/// id range) into per-row summaries, the same on every rank. One all-gather of three values per row and rank.
pub fn summarise(local: &[f32], vocab: &Range<usize>, comm: &dyn Communicator) -> Result<Vec<VocabSummary>> {
    let width = vocab.len();
    if width == 0 || !local.len().is_multiple_of(width) {
        return Err(EngineError::InvalidInput(format!(
            "summarise: {} logits are not rows of the vocabulary slice ({width})",
            local.len()
        )));
    }
    let rows = local.len() / width;
    let mut send = Vec::with_capacity(3 * rows);
    for row in local.chunks_exact(width) {
        let (arg, max) = row.iter().enumerate().fold(
            (0, f32::NEG_INFINITY),
            |(a, m), (i, &v)| if v > m { (i, v) } else { (a, m) },
        );
        let sum: f32 = row.iter().map(|v| (v - max).exp()).sum();
        // Ids travel as f32: exact below 2^24, far above any vocabulary.
        send.extend([(vocab.start + arg) as f32, max, sum]);
    }
    let mut recv = vec![0.0f32; send.len() * comm.size()];
    comm.all_gather(&send, &mut recv)?;
    let per_rank: Vec<&[f32]> = recv.chunks_exact(3 * rows).collect();
    Ok((0..rows)
        .map(|r| {
            let parts = per_rank.iter().map(|p| &p[3 * r..3 * r + 3]);
            // Ranks hold ascending id ranges, so the first rank reaching the maximum has the lowest id.
            let (arg, max) = parts.clone().fold(
                (0.0, f32::NEG_INFINITY),
                |(a, m), p| if p[1] > m { (p[0], p[1]) } else { (a, m) },
            );
            let sum: f32 = parts.map(|p| p[2] * (p[1] - max).exp()).sum();
            VocabSummary {
                argmax: arg as u32,
                max_logit: max,
                log_sum_exp: max + sum.ln(),
            }
        })
        .collect())
}

/// All-gathers every rank's `[rows, its vocab slice]` logits into `[rows, vocab]`; slices are padded to the largest
/// (rank 0's) so every rank sends the same count.
fn gather_vocab(local: &[f32], rows: usize, vocab: usize, comm: &dyn Communicator) -> Result<Vec<f32>> {
    let tp = comm.size();
    let width = even_split(vocab, tp, 0).len();
    let mine = even_split(vocab, tp, comm.rank()).len();
    let mut send = vec![0.0f32; rows * width];
    for (dst, src) in send.chunks_exact_mut(width).zip(local.chunks_exact(mine.max(1))) {
        dst[..mine].copy_from_slice(src);
    }
    let mut recv = vec![0.0f32; tp * rows * width];
    comm.all_gather(&send, &mut recv)?;
    let mut logits = vec![0.0f32; rows * vocab];
    for (r, part) in recv.chunks_exact(rows * width).enumerate() {
        let range = even_split(vocab, tp, r);
        for (row, src) in part.chunks_exact(width).enumerate() {
            logits[row * vocab + range.start..row * vocab + range.end].copy_from_slice(&src[..range.len()]);
        }
    }
    Ok(logits)
}

/// Copies, per row of `groups` groups of `width`, the group each virtual group reads.
fn expand<'a>(src: &'a [f32], width: usize, split: &GroupedSplit) -> Cow<'a, [f32]> {
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

fn wrong_shard(kind: &str) -> EngineError {
    EngineError::InvalidInput(format!("tensor-parallel plan does not describe a {kind} layer"))
}

/// A Mamba-2 shard: the mixer's projection and conv, the scan over virtual groups, then the gated norm over the
/// global norm groups (sums of squares all-reduced when a group spans ranks) and the partial `out_proj`.
fn mamba2(
    m: &Mamba2Mixer,
    shard: &ShardKind,
    x: &[f32],
    t: usize,
    state: &mut Mamba2State,
    comm: &dyn Communicator,
) -> Result<Vec<f32>> {
    let ShardKind::Mamba2 {
        split,
        norm_group_size,
        norm_groups,
        all_reduce_norm,
    } = shard
    else {
        return Err(wrong_shard("Mamba-2"));
    };
    let s = m.spec();
    let dims = Mamba2Dims {
        heads: s.heads,
        head_dim: s.head_dim,
        state_dim: s.state_dim,
        groups: split.virtual_groups.len(),
    };
    let Mamba2State { conv, ssm } = state;
    let (y, z) = m.scan_outputs(x, t, t > 1, conv, |inp, y| {
        let b = expand(&inp.b, s.state_dim, split);
        let c = expand(&inp.c, s.state_dim, split);
        if inp.t == 1 {
            mamba2_step(dims, ssm, &inp.x, &inp.dt, m.a(), &b, &c, m.d_skip(), y);
        } else {
            mamba2_chunked(
                dims,
                inp.t,
                s.chunk_size,
                ssm,
                &inp.x,
                &inp.dt,
                m.a(),
                &b,
                &c,
                m.d_skip(),
                y,
            );
        }
    });
    let di = s.heads * s.head_dim;
    let first = split.heads.start * s.head_dim;
    let gated: Vec<f32> = y.iter().zip(&z).map(|(y, z)| y * silu(*z)).collect();
    let mut sums = vec![0.0f32; t * norm_groups];
    for (row, sum) in gated.chunks_exact(di).zip(sums.chunks_exact_mut(*norm_groups)) {
        for (c, v) in row.iter().enumerate() {
            sum[(first + c) / norm_group_size] += v * v;
        }
    }
    if *all_reduce_norm {
        comm.all_reduce_sum(&mut sums)?;
    }
    let w = m.norm_weight();
    let mut normed = Vec::with_capacity(gated.len());
    for (row, sum) in gated.chunks_exact(di).zip(sums.chunks_exact(*norm_groups)) {
        for (c, v) in row.iter().enumerate() {
            let ms = sum[(first + c) / norm_group_size] / *norm_group_size as f32;
            normed.push(v * (1.0 / (ms + s.norm_eps).sqrt()) * w[c]);
        }
    }
    Ok(m.project_out(&normed, t))
}

/// A Gated DeltaNet shard: the mixer with a delta-rule scan over virtual key groups.
fn gdn(m: &GdnMixer, shard: &ShardKind, x: &[f32], t: usize, state: &mut GdnState) -> Result<Vec<f32>> {
    let ShardKind::Gdn(split) = shard else {
        return Err(wrong_shard("Gated DeltaNet"));
    };
    let s = m.spec();
    let dims = GdnDims {
        k_heads: split.virtual_groups.len(),
        v_heads: s.v_heads,
        k_dim: s.k_head_dim,
        v_dim: s.v_head_dim,
    };
    let GdnState { conv, ssm } = state;
    Ok(m.forward_with(x, t, conv, |inp, out| {
        let q = expand(&inp.q, s.k_head_dim, split);
        let k = expand(&inp.k, s.k_head_dim, split);
        if inp.t == 1 {
            gdn_step(dims, ssm, &q, &k, &inp.v, &inp.g, &inp.beta, out);
        } else {
            gdn_chunked(dims, inp.t, s.chunk_size, ssm, &q, &k, &inp.v, &inp.g, &inp.beta, out);
        }
    }))
}
