//! The multi-token-prediction (MTP) module that Qwen3-Next, Qwen3.5(-MoE) and Nemotron-3 (Super) checkpoints carry
//! beside the model: the layout of its weights (everything under `mtp.`) and its CPU forward pass ([`MtpHead`]). The
//! drafter that runs it, and the loader of the weights it shares with the model (the embedding, the LM head and the
//! final norm), is [`crate::spec::mtp`].
//!
//! Qwen layout (vLLM `qwen3_next_mtp.py` / `qwen3_5_mtp.py`, `Qwen3NextMultiTokenPredictor`):
//! `mtp.fc.weight` `[hidden, 2·hidden]` (no bias), `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`,
//! `mtp.norm.weight` (`[hidden]`, zero-centred like every Qwen3-Next norm), and `mtp.layers.{i}.` decoder layers built
//! as the model's own layer with `layer_type = "full_attention"` and layer index `i` (gated attention, then the FFN
//! layer `i` would have: MoE for Qwen3-Next and Qwen3.5-MoE, the dense MLP for Qwen3.5). One step is
//!
//! ```text
//! x = fc(concat[pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)])
//! x = x + attn(input_layernorm(x));  x = x + ffn(post_attention_layernorm(x))
//! out = norm(x)        // both the LM head's input and the next step's `hidden`
//! ```
//!
//! where `hidden` is the target model's output *after* its final norm (vLLM's target forward ends with the norm and
//! `compute_logits` applies the LM head directly) for the first step, and the MTP's own `out` for later steps.
//!
//! Nemotron-3 layout (vLLM `nemotron_h_mtp.py`, `NemotronHMultiTokenPredictor`; transformers 5.23 skips `mtp.*`): one
//! MTP step is `mtp_hybrid_override_pattern` (published: `"*E"`; transformers 5.23 writes `mtp_layers_block_type`,
//! default `["full_attention", "moe"]`) read as Nemotron-H decoder layers `mtp.layers.{i}.` (`norm.weight` and
//! `mixer.*`, the MoE latent like the main model's). The first holds the input projection `eh_proj.weight`
//! `[hidden, 2·hidden]` with `enorm.weight` / `hnorm.weight`, the last the output norm `final_layernorm.weight`; the
//! computation is the one above with those names (plain RMSNorm weights, `layer_norm_epsilon`). With
//! `num_nextn_predict_layers` > 1 the first step's layers are the ones read.

use std::collections::BTreeMap;

use rewind_kernels::cpu::gemm::linear;
use rewind_kernels::cpu::norm::rms_norm_vec;
use serde_json::{json, Value};

use super::config::{BlockKind, BlockPlan, Family, ModelConfig};
use super::mixers::attention::{AttentionMixer, KvCache};
use super::mixers::ffn::{Mlp, Moe};
use super::tensors::{ShapeRecorder, TensorSource};
use crate::error::{EngineError, Result};

/// The prefix of every MTP tensor in a checkpoint.
pub const MTP_PREFIX: &str = "mtp.";

/// Where an MTP module's tensors lie (names relative to [`MTP_PREFIX`]) and the residual blocks of its layer: an
/// attention block then an FFN block.
#[derive(Clone, Debug, PartialEq)]
pub struct MtpLayout {
    /// The input projection `[hidden, 2·hidden]` and the norms of its embedding and hidden halves.
    pub fc: String,
    pub norm_embedding: String,
    pub norm_hidden: String,
    /// The attention block then the FFN block, their norm and mixer names relative to [`MTP_PREFIX`].
    pub blocks: Vec<BlockPlan>,
    /// The output norm (the LM head's input, and the next step's `hidden`).
    pub out_norm: String,
}

/// The MTP layout of the model `config_json` describes (see the module docs).
pub fn mtp_layout(config_json: &Value) -> Result<MtpLayout> {
    if ModelConfig::from_json(config_json)?.family == Family::NemotronH {
        return nemotron_layout(config_json);
    }
    let mut blocks = qwen_layer_plan(config_json)?;
    for b in &mut blocks {
        b.norm = format!("layers.0.{}", b.norm);
        b.mixer = format!("layers.0.{}", b.mixer);
    }
    Ok(MtpLayout {
        fc: "fc.weight".into(),
        norm_embedding: "pre_fc_norm_embedding.weight".into(),
        norm_hidden: "pre_fc_norm_hidden.weight".into(),
        blocks,
        out_norm: "norm.weight".into(),
    })
}

/// The MTP layout of a checkpoint whose MTP layer a rank will run: `config` (parsed from `config_json`) must say it
/// has MTP layers and `has_tensors` that its safetensors hold `mtp.*` tensors; otherwise a clear error naming the
/// checkpoint in `dir` and what is missing.
pub fn checked_mtp_layout(
    config: &ModelConfig,
    config_json: &Value,
    has_tensors: bool,
    dir: &std::path::Path,
) -> Result<MtpLayout> {
    if config.mtp_layers == 0 {
        let field = match config.family {
            Family::NemotronH => "num_nextn_predict_layers",
            _ => "mtp_num_hidden_layers",
        };
        return Err(no_mtp(dir, &format!("its config.json sets no {field}")));
    }
    if !has_tensors {
        return Err(no_mtp(
            dir,
            &format!(
                "its config.json says {} MTP layer(s), but its safetensors hold none",
                config.mtp_layers
            ),
        ));
    }
    mtp_layout(config_json)
}

fn no_mtp(dir: &std::path::Path, why: &str) -> EngineError {
    EngineError::InvalidInput(format!(
        "the checkpoint in {} has no MTP weights (mtp.* tensors; {why}); --spec mtp needs them \
         (init-model --mtp writes random ones)",
        dir.display()
    ))
}

/// The residual blocks of a Qwen MTP decoder layer for the model `config_json` describes: the family's
/// full-attention block and the FFN block of layer 0.
///
/// The family's own config parser builds them, from the config cut to one `full_attention` layer, so the attention
/// spec (heads, partial RoPE, gate, q/k norm) and the FFN choice (`mlp_only_layers`, `decoder_sparse_step`) are
/// exactly the main model's even when its layer stack (e.g. cut by `--layers`) holds no full-attention layer.
fn qwen_layer_plan(config_json: &Value) -> Result<Vec<BlockPlan>> {
    let mut one = config_json.clone();
    let cut = |v: &mut Value| {
        if let Some(obj) = v.as_object_mut() {
            obj.insert("num_hidden_layers".into(), json!(1));
            obj.insert("layer_types".into(), json!(["full_attention"]));
        }
    };
    // The multimodal wrappers (qwen3_5, qwen3_5_moe) keep the text model's fields in `text_config`.
    if let Some(text) = one.get_mut("text_config") {
        cut(text);
    }
    cut(&mut one);
    let config = ModelConfig::from_json(&one)?;
    let layer = config.layers.into_iter().next().unwrap_or_default();
    attention_then_ffn(layer, &config.model_type)
}

/// Nemotron-3's MTP layers: the main config's layer kinds in the order of the MTP pattern, parsed by the family's own
/// parser (so the attention and (latent) MoE specs are the main model's), each its own `layers.{i}.` layer.
fn nemotron_layout(config_json: &Value) -> Result<MtpLayout> {
    let f = super::json::Fields::new(config_json, "")?;
    let pattern: String = match (
        f.opt_str_list("mtp_layers_block_type")?,
        f.opt_str("mtp_hybrid_override_pattern")?,
    ) {
        (Some(list), _) => list
            .iter()
            .map(|t| match t.as_str() {
                "attention" | "full_attention" => Ok('*'),
                "moe" => Ok('E'),
                "mlp" => Ok('-'),
                other => Err(f.error(
                    "mtp_layers_block_type",
                    format!("`{other}` is not an MTP layer rewind runs"),
                )),
            })
            .collect::<Result<_>>()?,
        (None, Some(p)) => p.to_string(),
        // transformers 5.23's default.
        (None, None) => "*E".into(),
    };
    let mut cut = config_json.clone();
    if let Some(obj) = cut.as_object_mut() {
        obj.remove("layers_block_type");
        obj.remove("layer_types");
        // The MTP step's own depth (the main stack's count would contradict its pattern).
        obj.insert("num_hidden_layers".into(), json!(pattern.chars().count()));
        obj.insert("hybrid_override_pattern".into(), json!(pattern));
    }
    let config = ModelConfig::from_json(&cut)?;
    let mut blocks: Vec<BlockPlan> = config.layers.into_iter().flatten().collect();
    for (i, b) in blocks.iter_mut().enumerate() {
        b.norm = format!("layers.{i}.{}", b.norm);
        b.mixer = format!("layers.{i}.{}", b.mixer);
    }
    let last = blocks.len().saturating_sub(1);
    Ok(MtpLayout {
        fc: "layers.0.eh_proj.weight".into(),
        norm_embedding: "layers.0.enorm.weight".into(),
        norm_hidden: "layers.0.hnorm.weight".into(),
        blocks: attention_then_ffn(blocks, &config.model_type)?,
        out_norm: format!("layers.{last}.final_layernorm.weight"),
    })
}

/// `layer` when it is an attention block then an MLP or MoE block (the only MTP layer shape published), else
/// [`EngineError::NotSupported`].
fn attention_then_ffn(layer: Vec<BlockPlan>, model_type: &str) -> Result<Vec<BlockPlan>> {
    match layer.as_slice() {
        [BlockPlan {
            kind: BlockKind::Attention(_),
            ..
        }, BlockPlan {
            kind: BlockKind::Mlp(_) | BlockKind::Moe(_),
            ..
        }] => Ok(layer),
        _ => Err(EngineError::NotSupported(format!(
            "MTP layers of {model_type} checkpoints other than an attention block then an FFN block"
        ))),
    }
}

/// The FFN block of an MTP layer.
/// Both boxed: the layers differ widely in size (an MoE with a latent MoE's projections, a dense MLP).
pub(crate) enum MtpFfn {
    Mlp(Box<Mlp>),
    Moe(Box<Moe>),
}

/// The tensors under `mtp.`: the input projection, its two norms, the attention and FFN blocks and the output norm.
pub struct MtpHead {
    hidden: usize,
    eps: f32,
    offset: f32,
    /// `[hidden, 2·hidden]`: the embedding half of the input first, then the hidden half.
    fc: Vec<f32>,
    pre_fc_norm_embedding: Vec<f32>,
    pre_fc_norm_hidden: Vec<f32>,
    attn_norm: Vec<f32>,
    attn: AttentionMixer,
    ffn_norm: Vec<f32>,
    ffn: MtpFfn,
    norm: Vec<f32>,
}

impl MtpHead {
    /// Loads `mtp.*` through `src` as `layout` ([`mtp_layout`]) places it. Further MTP steps' layers are not read:
    /// published checkpoints have one.
    pub fn load(config: &ModelConfig, layout: &MtpLayout, src: &mut dyn TensorSource) -> Result<Self> {
        let h = config.hidden_size;
        let layer = &layout.blocks;
        let (attn_plan, ffn_plan) = match layer.as_slice() {
            [a, f] => (a, f),
            _ => {
                return Err(EngineError::NotSupported(format!(
                    "an MTP layer of {} blocks (an attention block then an FFN block was expected)",
                    layer.len()
                )))
            }
        };
        let lp = MTP_PREFIX;
        let fc = src.take(&format!("{lp}{}", layout.fc), &[h, 2 * h])?;
        let pre_fc_norm_embedding = src.take(&format!("{lp}{}", layout.norm_embedding), &[h])?;
        let pre_fc_norm_hidden = src.take(&format!("{lp}{}", layout.norm_hidden), &[h])?;
        let attn_norm = src.take(&format!("{lp}{}", attn_plan.norm), &[h])?;
        let attn = match &attn_plan.kind {
            BlockKind::Attention(s) => AttentionMixer::load(s, src, &format!("{lp}{}", attn_plan.mixer))?,
            other => {
                return Err(EngineError::NotSupported(format!(
                    "an MTP layer whose first block is {} (attention expected)",
                    other.label()
                )))
            }
        };
        let ffn_norm = src.take(&format!("{lp}{}", ffn_plan.norm), &[h])?;
        let fp = format!("{lp}{}", ffn_plan.mixer);
        let ffn = match &ffn_plan.kind {
            BlockKind::Mlp(s) => MtpFfn::Mlp(Box::new(Mlp::load(s, src, &fp)?)),
            BlockKind::Moe(s) => MtpFfn::Moe(Box::new(Moe::load(s, src, &fp)?)),
            other => {
                return Err(EngineError::NotSupported(format!(
                    "an MTP layer whose second block is {} (an MLP or MoE expected)",
                    other.label()
                )))
            }
        };
        let norm = src.take(&format!("{lp}{}", layout.out_norm), &[h])?;
        Ok(MtpHead {
            hidden: h,
            eps: config.norm_eps,
            offset: config.norm_offset,
            fc,
            pre_fc_norm_embedding,
            pre_fc_norm_hidden,
            attn_norm,
            attn,
            ffn_norm,
            ffn,
            norm,
        })
    }

    /// The weights, for a backend that copies them to its device (`gpu/mtp_layer.rs`), which runs the same forward.
    pub(crate) fn parts(&self) -> MtpParts<'_> {
        MtpParts {
            fc: &self.fc,
            pre_fc_norm_embedding: &self.pre_fc_norm_embedding,
            pre_fc_norm_hidden: &self.pre_fc_norm_hidden,
            attn_norm: &self.attn_norm,
            attn: &self.attn,
            ffn_norm: &self.ffn_norm,
            ffn: &self.ffn,
            norm: &self.norm,
        }
    }

    fn rms(&self, x: &[f32], w: &[f32]) -> Vec<f32> {
        rms_norm_vec(x, w, self.eps, self.offset)
    }

    /// An empty KV cache for the layer's attention.
    pub fn new_cache(&self) -> KvCache {
        self.attn.new_cache()
    }

    /// The decoder layer and output norm over `t` rows of embeddings `emb` and hidden inputs `hidden`, appending
    /// their keys and values to `cache` (RoPE positions `cache.len()..`). `reduce` sums a row-parallel block's
    /// partial output over the tensor-parallel ranks (nothing to do on one rank), as the target's blocks do.
    pub fn forward(
        &self,
        emb: &[f32],
        hidden: &[f32],
        t: usize,
        cache: &mut KvCache,
        reduce: &mut dyn FnMut(&mut [f32]) -> Result<()>,
    ) -> Result<Vec<f32>> {
        let h = self.hidden;
        let e = self.rms(emb, &self.pre_fc_norm_embedding);
        let g = self.rms(hidden, &self.pre_fc_norm_hidden);
        // vLLM concatenates [embedding, hidden] (`torch.cat([inputs_embeds, hidden_states], dim=-1)`).
        let mut cat = Vec::with_capacity(t * 2 * h);
        for (er, gr) in e.chunks_exact(h).zip(g.chunks_exact(h)) {
            cat.extend_from_slice(er);
            cat.extend_from_slice(gr);
        }
        let mut x = linear(&cat, &self.fc, None, t, 2 * h, h);
        let mut a = self.attn.forward(&self.rms(&x, &self.attn_norm), t, cache.len(), cache);
        reduce(&mut a)?;
        x.iter_mut().zip(&a).for_each(|(x, a)| *x += a);
        let normed = self.rms(&x, &self.ffn_norm);
        let mut f = match &self.ffn {
            MtpFfn::Mlp(m) => m.forward(&normed, t),
            MtpFfn::Moe(m) => m.forward(&normed, t),
        };
        reduce(&mut f)?;
        x.iter_mut().zip(&f).for_each(|(x, f)| *x += f);
        Ok(self.rms(&x, &self.norm))
    }
}

/// An [`MtpHead`]'s weights, borrowed ([`MtpHead::parts`]): `fc` `[hidden, 2·hidden]` (embedding half first), the
/// norms `[hidden]`, the attention and FFN blocks (this rank's share under tensor parallelism).
pub(crate) struct MtpParts<'a> {
    pub(crate) fc: &'a [f32],
    pub(crate) pre_fc_norm_embedding: &'a [f32],
    pub(crate) pre_fc_norm_hidden: &'a [f32],
    pub(crate) attn_norm: &'a [f32],
    pub(crate) attn: &'a AttentionMixer,
    pub(crate) ffn_norm: &'a [f32],
    pub(crate) ffn: &'a MtpFfn,
    pub(crate) norm: &'a [f32],
}

/// Every `mtp.*` tensor (name → shape) that [`MtpHead::load`] reads for the model `config_json` describes, in the
/// published per-expert layout: what `init-model --mtp` writes.
pub fn plan_mtp_tensors(config_json: &Value, config: &ModelConfig) -> Result<BTreeMap<String, Vec<usize>>> {
    let layout = mtp_layout(config_json)?;
    let mut rec = ShapeRecorder::default();
    MtpHead::load(config, &layout, &mut rec)?;
    Ok(rec.tensors)
}
