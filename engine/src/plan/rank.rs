//! What one tensor-parallel rank holds, read from the engine's own shard plan ([`RankPlan`]): the bytes of every
//! tensor it loads, which of them are routed experts, its SSM layers' pool dims as the GPU allocates them, and its
//! attention KV width. Going through `RankPlan::new` means the plan refuses exactly the tensor-parallel sizes the
//! engine refuses, with the engine's message.

use crate::model::spec::AttentionSpec;
use crate::model::{BlockKind, ModelConfig};
use crate::shard::{RankPlan, ShardKind};
use crate::state::memory::{LayerValues, MemoryShare, WEIGHT_BYTES};
use crate::state::SsmDims;

use super::PlanError;

/// One MoE block of a rank.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeLayer {
    /// Routed experts `E`.
    pub experts: usize,
    /// Experts per token `k`.
    pub top_k: usize,
    /// Bytes of the rank's slice of one routed expert (bf16).
    pub expert_bytes: u64,
}

impl MoeLayer {
    /// Expected distinct experts that `tokens` tokens activate, each choosing `k` of `E` uniformly:
    /// `E·(1 − (1 − k/E)^tokens)`. Routers are not uniform, so real batches touch somewhat fewer.
    pub fn active_experts(&self, tokens: f64) -> f64 {
        let e = self.experts as f64;
        if e == 0.0 {
            return 0.0;
        }
        e * (1.0 - (1.0 - (self.top_k as f64 / e).min(1.0)).powf(tokens))
    }
}

/// One tensor-parallel rank's share of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct RankModel {
    pub rank: usize,
    /// Every tensor the rank loads, bf16.
    pub weight_bytes: u64,
    /// The rank's embedding slice (read one row per token, not whole).
    pub embed_bytes: u64,
    /// The LM-head bytes a step reads: the rank's vocabulary slice (the embedding slice when tied).
    pub lm_head_bytes: u64,
    /// Whether the LM head is the embedding (tied): then the embedding slice is read whole every step.
    pub tied_head: bool,
    /// All routed experts' bytes (read only for the experts a batch activates).
    pub routed_expert_bytes: u64,
    /// The MoE blocks.
    pub moe: Vec<MoeLayer>,
    /// The SSM blocks' pool dims as the GPU allocates them (ring `B` / `k` per virtual group, `gpu/state.rs`).
    pub ssm: Vec<SsmDims>,
    /// The attention blocks' local specs (heads and KV heads of this rank).
    pub attention: Vec<AttentionSpec>,
    /// K and V values per token over all attention blocks (duplicated KV heads included).
    pub kv_values_per_token: u64,
    /// Residual blocks: one all-reduce of the block output each (`gpu/forward.rs`).
    pub blocks: usize,
    /// Values per row all-reduced for Mamba-2 gated norms whose groups span ranks (`gpu/ssm_layers.rs`).
    pub norm_reduce_values: usize,
    /// Mamba-2 blocks whose gated-norm sums are all-reduced (one more collective each).
    pub norm_reduce_layers: usize,
}

impl RankModel {
    /// Rank `rank` of `tp` for `config`, planned for the published checkpoint layout.
    pub fn new(config: &ModelConfig, tp: usize, rank: usize) -> Result<Self, PlanError> {
        let plan = RankPlan::new(config, tp, rank, &|_| false).map_err(|source| PlanError::Sharding { tp, source })?;
        let bytes = |t: &crate::shard::LocalTensor| t.local_shape().iter().product::<usize>() as u64 * WEIGHT_BYTES;
        let weight_bytes = plan.tensors().map(bytes).sum();
        let embed_bytes = bytes(&plan.embed);
        let lm_head_bytes = plan.lm_head.as_ref().map_or(embed_bytes, bytes);
        let mut m = RankModel {
            rank,
            weight_bytes,
            embed_bytes,
            lm_head_bytes,
            tied_head: plan.lm_head.is_none(),
            routed_expert_bytes: 0,
            moe: Vec::new(),
            ssm: Vec::new(),
            attention: Vec::new(),
            kv_values_per_token: 0,
            blocks: plan.blocks.len(),
            norm_reduce_values: 0,
            norm_reduce_layers: 0,
        };
        for b in &plan.blocks {
            match (&b.kind, &b.shard) {
                (
                    BlockKind::Mamba2(s),
                    ShardKind::Mamba2 {
                        split,
                        norm_groups,
                        all_reduce_norm,
                        ..
                    },
                ) => {
                    let mut d = SsmDims::mamba2(s);
                    d.ring_fields[2].width = split.virtual_groups.len() * s.state_dim;
                    m.ssm.push(d);
                    if *all_reduce_norm {
                        m.norm_reduce_values += norm_groups;
                        m.norm_reduce_layers += 1;
                    }
                }
                (BlockKind::Gdn(s), ShardKind::Gdn(split)) => {
                    let mut d = SsmDims::gdn(s);
                    d.ring_fields[1].width = split.virtual_groups.len() * s.k_head_dim;
                    m.ssm.push(d);
                }
                (BlockKind::Attention(a), _) => {
                    m.kv_values_per_token += LayerValues::attention(a).kv_per_token as u64;
                    m.attention.push(a.clone());
                }
                (BlockKind::Moe(s), _) => {
                    // Routed experts are the tensors under `{mixer}experts.` (the shared expert lives under
                    // `shared_expert(s).`), whatever the layout or a latent width.
                    let prefix = format!("{}experts.", b.prefix);
                    let routed: u64 = b
                        .tensors
                        .iter()
                        .filter(|t| t.name.starts_with(&prefix))
                        .map(bytes)
                        .sum();
                    m.routed_expert_bytes += routed;
                    m.moe.push(MoeLayer {
                        experts: s.num_experts,
                        top_k: s.top_k,
                        expert_bytes: routed / s.num_experts.max(1) as u64,
                    });
                }
                _ => {}
            }
        }
        Ok(m)
    }

    /// Every rank of `tp`: the engine's sharding checks run for each.
    pub fn all(config: &ModelConfig, tp: usize) -> Result<Vec<Self>, PlanError> {
        if tp == 0 {
            return Err(PlanError::Invalid("--tp must be at least 1".into()));
        }
        (0..tp).map(|r| RankModel::new(config, tp, r)).collect()
    }

    /// What the memory planner prices on this rank: its weights, SSM pools and attention KV width.
    pub fn memory_share(&self) -> MemoryShare {
        MemoryShare {
            weight_bytes: self.weight_bytes,
            ssm: self.ssm.clone(),
            kv_values_per_token: self.kv_values_per_token,
        }
    }

    /// Weights a step reads whatever the batch: everything but the embedding table and the routed experts, plus
    /// the LM head when it is the tied embedding.
    pub fn dense_read_bytes(&self) -> u64 {
        let tied_head = if self.tied_head { self.lm_head_bytes } else { 0 };
        self.weight_bytes - self.embed_bytes - self.routed_expert_bytes + tied_head
    }

    /// Routed-expert bytes read by a step of `tokens` tokens (expected distinct experts per MoE block).
    pub fn active_expert_bytes(&self, tokens: f64) -> f64 {
        self.moe
            .iter()
            .fold(0.0, |a, l| a + l.active_experts(tokens) * l.expert_bytes as f64)
    }

    /// Matmul parameters one token uses on this rank: the dense weights (LM head included, embedding excluded) and
    /// `k` routed experts per MoE block.
    pub fn params_per_token(&self) -> f64 {
        let experts: f64 = self
            .moe
            .iter()
            .map(|l| l.top_k.min(l.experts) as f64 * l.expert_bytes as f64)
            .sum();
        (self.dense_read_bytes() as f64 + experts) / WEIGHT_BYTES as f64
    }
}
