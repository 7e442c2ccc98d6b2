//! The tensor-parallel plan: for TP size `tp` and rank `r`, which slice of every checkpoint tensor the rank holds and
//! what its layers look like (their local specs), following `docs/architecture.md` ("Tensor parallelism").
//!
//! Splits are contiguous and as even as possible: `n` items over `tp` ranks give the first `n % tp` ranks one extra
//! ([`even_split`]). Heads that share a group (Mamba-2 heads of a B/C group, GDN value heads of a key head, attention
//! query heads of a KV head) are split by head, not by group, so any `tp` up to the head count works; each rank then
//! holds the groups its heads read ([`GroupedSplit`]). A group whose heads span ranks is held by each of them (marked
//! shared, not split); when `groups % tp == 0` and `heads % tp == 0` every group lands whole on one rank and nothing
//! is shared. Splitting needs at least one item per rank in every split dimension; a `tp` larger than a layer's head
//! count (or FFN width, or vocabulary) is refused.

use std::ops::Range;

use super::layers;
use crate::error::{EngineError, Result};
use crate::model::config::{BlockKind, ModelConfig};

/// Items `rank` owns when `n` items are split over `tp` ranks: contiguous, the first `n % tp` ranks one extra.
pub fn even_split(n: usize, tp: usize, rank: usize) -> Range<usize> {
    let (base, extra) = (n / tp, n % tp);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

/// One rank's heads of a grouped layer (`heads` heads in `groups` equal groups) and the groups they read.
///
/// The rank's heads cover a run of groups, the first and last possibly in part. Kernels map head `h` to group
/// `h / (heads / groups)`, so the rank presents its heads as *virtual groups* of `heads_per_virtual` heads each, where
/// `heads_per_virtual` is the gcd of the per-group head counts; each virtual group reads one real group. With aligned
/// splits there is one virtual group per real group and nothing is expanded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupedSplit {
    /// Global head range.
    pub heads: Range<usize>,
    /// Global indices of the groups the heads read, ascending.
    pub groups: Vec<usize>,
    /// Per entry of `groups`: whether another rank reads that group too.
    pub shared: Vec<bool>,
    /// Heads per virtual group.
    pub heads_per_virtual: usize,
    /// Per virtual group: its real group, as an index into `groups`.
    pub virtual_groups: Vec<usize>,
}

impl GroupedSplit {
    /// Rank `rank`'s share of `heads` heads (a multiple of `groups`) over `tp` ranks.
    pub fn new(heads: usize, groups: usize, tp: usize, rank: usize) -> Self {
        let hpg = heads / groups;
        let range = even_split(heads, tp, rank);
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for h in range.clone() {
            match runs.last_mut() {
                Some((g, count)) if *g == h / hpg => *count += 1,
                _ => runs.push((h / hpg, 1)),
            }
        }
        let per_virtual = runs.iter().fold(0, |a, &(_, c)| gcd(a, c));
        let groups_read: Vec<usize> = runs.iter().map(|&(g, _)| g).collect();
        let shared = groups_read
            .iter()
            .map(|&g| {
                let span = g * hpg..(g + 1) * hpg;
                (0..tp).any(|r| r != rank && overlaps(&even_split(heads, tp, r), &span))
            })
            .collect();
        let virtual_groups = runs
            .iter()
            .enumerate()
            .flat_map(|(i, &(_, c))| std::iter::repeat_n(i, c / per_virtual.max(1)))
            .collect();
        GroupedSplit {
            heads: range,
            groups: groups_read,
            shared,
            heads_per_virtual: per_virtual,
            virtual_groups,
        }
    }

    /// Whether the virtual groups are the real groups one to one (no expansion needed).
    pub fn is_identity(&self) -> bool {
        self.virtual_groups.len() == self.groups.len()
    }

    /// Whether, over all ranks, some group's heads span more than one rank.
    pub fn any_group_spans_ranks(heads: usize, groups: usize, tp: usize) -> bool {
        (0..tp).any(|r| GroupedSplit::new(heads, groups, tp, r).shared.iter().any(|s| *s))
    }
}

/// A contiguous range along a tensor axis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub range: Range<usize>,
    /// True when exactly one rank holds these elements, once; false when they are shared (several ranks, or the
    /// same rank more than once, hold a copy: B/C or key groups read by heads on several ranks, duplicated KV heads).
    pub split: bool,
}

/// How a rank's tensor is cut from a checkpoint tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cut {
    /// The whole tensor; every rank holds a copy (norm weights, routers, per-head-dim norms).
    Replicated,
    /// The listed pieces along `axis`, concatenated in order (every index of the other axes kept).
    Pieces { axis: usize, pieces: Vec<Piece> },
    /// A bias added after a row-parallel projection's all-reduce: it must be added once, so rank 0 (`owner`) holds the
    /// values and the other ranks hold zeros of the same shape.
    FirstRank { owner: bool },
}

/// One tensor a rank loads.
#[derive(Clone, Debug, PartialEq)]
pub struct LocalTensor {
    /// The name the rank's mixer asks for (the checkpoint's name, or a split-layout name for a fused tensor).
    pub name: String,
    /// The checkpoint tensor it is cut from.
    pub source: String,
    pub source_shape: Vec<usize>,
    pub cut: Cut,
}

impl LocalTensor {
    /// A tensor every rank holds whole.
    pub fn replicated(name: String, shape: &[usize]) -> Self {
        LocalTensor {
            source: name.clone(),
            name,
            source_shape: shape.to_vec(),
            cut: Cut::Replicated,
        }
    }

    /// The rank's shape.
    pub fn local_shape(&self) -> Vec<usize> {
        let mut shape = self.source_shape.clone();
        if let Cut::Pieces { axis, pieces } = &self.cut {
            shape[*axis] = pieces.iter().map(|p| p.range.len()).sum();
        }
        shape
    }

    /// Whether the rank holds the whole tensor as stored (replicated, or pieces that cover the split axis in order):
    /// then [`LocalTensor::apply_owned`] hands the data back without copying it.
    pub fn is_whole(&self) -> bool {
        match &self.cut {
            Cut::Replicated | Cut::FirstRank { owner: true } => true,
            Cut::FirstRank { owner: false } => false,
            Cut::Pieces { axis, pieces } => {
                let mut next = 0;
                for p in pieces {
                    if p.range.start != next {
                        return false;
                    }
                    next = p.range.end;
                }
                next == self.source_shape[*axis]
            }
        }
    }

    /// [`LocalTensor::apply`] on data the caller no longer needs: a whole tensor comes back as it is. Loading at TP 1
    /// (every tensor whole) spent more than half its time copying each tensor into a fresh allocation.
    pub fn apply_owned(&self, data: Vec<f32>) -> Vec<f32> {
        if self.is_whole() {
            data
        } else {
            self.apply(&data)
        }
    }

    /// Cuts the rank's elements out of the whole checkpoint tensor `data` (row-major, `source_shape`).
    pub fn apply(&self, data: &[f32]) -> Vec<f32> {
        match &self.cut {
            Cut::Replicated | Cut::FirstRank { owner: true } => data.to_vec(),
            Cut::FirstRank { owner: false } => vec![0.0; data.len()],
            Cut::Pieces { axis, pieces } => {
                let shape = &self.source_shape;
                let outer: usize = shape[..*axis].iter().product();
                let inner: usize = shape[axis + 1..].iter().product();
                let dim = shape[*axis];
                let mut out = Vec::with_capacity(self.local_shape().iter().product());
                for o in 0..outer {
                    for p in pieces {
                        out.extend_from_slice(
                            &data[(o * dim + p.range.start) * inner..(o * dim + p.range.end) * inner],
                        );
                    }
                }
                out
            }
        }
    }
}

/// How a block's mixer is split, beyond its local spec.
#[derive(Clone, Debug, PartialEq)]
pub enum ShardKind {
    /// Heads split; `norm_group_size` and `all_reduce_norm` describe the global gated norm: when a norm group spans
    /// ranks (the same answer on every rank), its sum of squares is all-reduced.
    Mamba2 {
        split: GroupedSplit,
        norm_group_size: usize,
        norm_groups: usize,
        all_reduce_norm: bool,
    },
    /// Value heads split, key heads follow.
    Gdn(GroupedSplit),
    /// Query heads split; KV heads are materialised per virtual group (duplicated where heads of one KV head span
    /// ranks or split unevenly).
    Attention(GroupedSplit),
    /// The intermediate range of a dense MLP.
    Mlp(Range<usize>),
    /// The intermediate range of every expert and of the shared expert.
    Moe {
        experts: Range<usize>,
        shared: Option<Range<usize>>,
    },
}

/// One residual block of a rank.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockShard {
    /// The block's pre-norm weight (replicated), full name.
    pub norm: LocalTensor,
    /// The mixer's tensor prefix, e.g. `backbone.layers.3.mixer.`.
    pub prefix: String,
    /// The rank's layer, as the mixer's loader sees it.
    pub kind: BlockKind,
    pub shard: ShardKind,
    /// Every tensor of the mixer.
    pub tensors: Vec<LocalTensor>,
}

/// Everything rank `rank` of `tp` loads.
#[derive(Clone, Debug, PartialEq)]
pub struct RankPlan {
    pub tp: usize,
    pub rank: usize,
    /// The rank's vocabulary slice (embedding rows and LM-head rows).
    pub vocab: Range<usize>,
    pub embed: LocalTensor,
    pub final_norm: LocalTensor,
    /// `None` with tied embeddings: the LM head is the rank's embedding slice.
    pub lm_head: Option<LocalTensor>,
    pub blocks: Vec<BlockShard>,
    /// The checkpoint's MTP layer, when the rank runs it ([`RankPlan::with_mtp`]).
    pub mtp: Option<MtpShard>,
}

/// A rank's share of the MTP layer ([`crate::model::mtp`]): the input projection and the norms replicated (the
/// residual stream is whole on every rank), the attention and FFN blocks split exactly as the target's are.
#[derive(Clone, Debug, PartialEq)]
pub struct MtpShard {
    pub fc: LocalTensor,
    pub norm_embedding: LocalTensor,
    pub norm_hidden: LocalTensor,
    /// The attention block then the FFN block (full tensor names in [`BlockShard::prefix`] and `norm`).
    pub blocks: Vec<BlockShard>,
    pub out_norm: LocalTensor,
}

impl MtpShard {
    /// The layout the rank's [`MtpHead`](crate::model::mtp::MtpHead) loads: the local block kinds, names relative to
    /// [`MTP_PREFIX`](crate::model::mtp::MTP_PREFIX).
    pub fn local_layout(&self) -> crate::model::mtp::MtpLayout {
        let rel = |name: &str| {
            name.strip_prefix(crate::model::mtp::MTP_PREFIX)
                .unwrap_or(name)
                .to_string()
        };
        crate::model::mtp::MtpLayout {
            fc: rel(&self.fc.name),
            norm_embedding: rel(&self.norm_embedding.name),
            norm_hidden: rel(&self.norm_hidden.name),
            blocks: self
                .blocks
                .iter()
                .map(|b| crate::model::config::BlockPlan {
                    norm: rel(&b.norm.name),
                    mixer: rel(&b.prefix),
                    kind: b.kind.clone(),
                })
                .collect(),
            out_norm: rel(&self.out_norm.name),
        }
    }

    fn tensors(&self) -> impl Iterator<Item = &LocalTensor> {
        [&self.fc, &self.norm_embedding, &self.norm_hidden, &self.out_norm]
            .into_iter()
            .chain(
                self.blocks
                    .iter()
                    .flat_map(|b| std::iter::once(&b.norm).chain(&b.tensors)),
            )
    }
}

impl RankPlan {
    /// The plan of rank `rank` of `tp` for `config`. `has` says which tensors the checkpoint holds; it picks between
    /// layouts exactly as the loaders do (fused vs per-expert MoE weights, the embedding prefix, a stored LM head);
    /// `|_| false` plans for the layout published checkpoints use.
    pub fn new(config: &ModelConfig, tp: usize, rank: usize, has: &dyn Fn(&str) -> bool) -> Result<Self> {
        if tp == 0 || rank >= tp {
            return Err(EngineError::InvalidInput(format!(
                "tensor parallelism: rank {rank} of {tp} ranks"
            )));
        }
        let (hidden, vocab) = (config.hidden_size, config.vocab_size);
        layers::need(vocab, tp, "the vocabulary")?;
        let vocab_range = even_split(vocab, tp, rank);
        let vocab_cut = || Cut::Pieces {
            axis: 0,
            pieces: vec![Piece {
                range: vocab_range.clone(),
                split: true,
            }],
        };
        let prefix = config
            .prefixes
            .iter()
            .find(|p| has(&format!("{p}{}", config.embed_name)))
            .unwrap_or(&config.prefixes[0])
            .clone();
        let embed_name = format!("{prefix}{}", config.embed_name);
        let embed = LocalTensor {
            name: embed_name.clone(),
            source: embed_name,
            source_shape: vec![vocab, hidden],
            cut: vocab_cut(),
        };
        let mut blocks = Vec::new();
        for (i, layer) in config.layers.iter().enumerate() {
            let layer_prefix = format!("{prefix}{}{i}.", config.layers_name);
            for plan in layer {
                let mp = format!("{layer_prefix}{}", plan.mixer);
                let (kind, shard, tensors) = layers::plan_block(&plan.kind, &mp, tp, rank, has)?;
                blocks.push(BlockShard {
                    norm: LocalTensor::replicated(format!("{layer_prefix}{}", plan.norm), &[hidden]),
                    prefix: mp,
                    kind,
                    shard,
                    tensors,
                });
            }
        }
        let final_norm = LocalTensor::replicated(format!("{prefix}{}", config.final_norm_name), &[hidden]);
        let lm_head = (has("lm_head.weight") || !config.tie_word_embeddings).then(|| LocalTensor {
            name: "lm_head.weight".into(),
            source: "lm_head.weight".into(),
            source_shape: vec![vocab, hidden],
            cut: vocab_cut(),
        });
        Ok(RankPlan {
            tp,
            rank,
            vocab: vocab_range,
            embed,
            final_norm,
            lm_head,
            blocks,
            mtp: None,
        })
    }

    /// This plan with the checkpoint's MTP layer (`layout`, [`crate::model::mtp::mtp_layout`]) split by the same
    /// rules as the target's blocks: the rank loads and runs it beside the model.
    pub fn with_mtp(
        mut self,
        config: &ModelConfig,
        layout: &crate::model::mtp::MtpLayout,
        has: &dyn Fn(&str) -> bool,
    ) -> Result<Self> {
        let hidden = config.hidden_size;
        let full = |name: &str| format!("{}{name}", crate::model::mtp::MTP_PREFIX);
        let mut blocks = Vec::new();
        for b in &layout.blocks {
            let mp = full(&b.mixer);
            let (kind, shard, tensors) = layers::plan_block(&b.kind, &mp, self.tp, self.rank, has)?;
            blocks.push(BlockShard {
                norm: LocalTensor::replicated(full(&b.norm), &[hidden]),
                prefix: mp,
                kind,
                shard,
                tensors,
            });
        }
        self.mtp = Some(MtpShard {
            fc: LocalTensor::replicated(full(&layout.fc), &[hidden, 2 * hidden]),
            norm_embedding: LocalTensor::replicated(full(&layout.norm_embedding), &[hidden]),
            norm_hidden: LocalTensor::replicated(full(&layout.norm_hidden), &[hidden]),
            blocks,
            out_norm: LocalTensor::replicated(full(&layout.out_norm), &[hidden]),
        });
        Ok(self)
    }

    /// Every tensor the rank loads.
    pub fn tensors(&self) -> impl Iterator<Item = &LocalTensor> {
        [&self.embed, &self.final_norm]
            .into_iter()
            .chain(self.lm_head.as_ref())
            .chain(
                self.blocks
                    .iter()
                    .flat_map(|b| std::iter::once(&b.norm).chain(&b.tensors)),
            )
            .chain(self.mtp.iter().flat_map(MtpShard::tensors))
    }
}
