//! Parsing `config.json` of every supported family into a family-independent [`ModelConfig`]: a list of residual
//! blocks, each a norm plus one mixer ([`BlockKind`]), with the tensor-name prefixes the family's checkpoints use.
//!
//! This file holds the shared types and [`ModelConfig::from_json`], which picks the family; each family's parser is
//! its own file: `nemotron_h.rs` (Mamba-2 hybrids) and `qwen.rs` (Gated DeltaNet hybrids: Qwen3-Next, Qwen3.5).

mod nemotron_h;
mod qwen;

use std::path::Path;

use serde_json::Value;

use super::json::Fields;
use super::spec::*;
use crate::error::{EngineError, Result};
use nemotron_h::parse_nemotron_h;
use qwen::parse_qwen;

/// The supported model families.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `nemotron_h`: Mamba-2 + attention + relu² MLP or MoE (Nemotron-H, Nemotron-Nano-v2, Nemotron-3).
    NemotronH,
    /// `qwen3_next`: Gated DeltaNet + gated attention + MoE with a gated shared expert.
    Qwen3Next,
    /// `qwen3_5_text` (or the text part of `qwen3_5`): Gated DeltaNet + gated attention + dense SwiGLU MLP.
    Qwen35,
    /// `qwen3_5_moe_text` (or the text part of `qwen3_5_moe`): like Qwen3.5 with MoE FFNs.
    Qwen35Moe,
}

/// What `rewind` accepts, for error messages.
pub const SUPPORTED_MODELS: &str = "model_type nemotron_h (NemotronHForCausalLM), qwen3_next (Qwen3NextForCausalLM), \
qwen3_5 / qwen3_5_text (Qwen3_5ForConditionalGeneration, Qwen3_5ForCausalLM), qwen3_5_moe / qwen3_5_moe_text \
(Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeForCausalLM)";

impl Family {
    /// The family's canonical name (`--arch` value of `init-model`).
    pub fn name(self) -> &'static str {
        match self {
            Family::NemotronH => "nemotron_h",
            Family::Qwen3Next => "qwen3_next",
            Family::Qwen35 => "qwen3_5",
            Family::Qwen35Moe => "qwen3_5_moe",
        }
    }
}

/// The layer kind of one residual block.
#[derive(Clone, Debug, PartialEq)]
pub enum BlockKind {
    Mamba2(Mamba2Spec),
    Gdn(GdnSpec),
    Attention(AttentionSpec),
    Mlp(MlpSpec),
    Moe(MoeSpec),
}

impl BlockKind {
    /// A short name for logs and tables.
    pub fn label(&self) -> &'static str {
        match self {
            BlockKind::Mamba2(_) => "mamba2",
            BlockKind::Gdn(_) => "gdn",
            BlockKind::Attention(_) => "attention",
            BlockKind::Mlp(_) => "mlp",
            BlockKind::Moe(_) => "moe",
        }
    }
}

/// One residual block `x += mixer(norm(x))`, with tensor names relative to its decoder layer's prefix.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockPlan {
    /// The pre-norm weight, e.g. `norm.weight` or `input_layernorm.weight`.
    pub norm: String,
    /// The mixer's prefix, e.g. `mixer.`, `linear_attn.`, `self_attn.`, `mlp.`.
    pub mixer: String,
    pub kind: BlockKind,
}

/// A parsed, validated model config.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    /// `model_type` as written in the config.
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The longest context the model accepts (`max_position_embeddings`).
    pub max_position_embeddings: usize,
    /// Epsilon of the block and final RMSNorms.
    pub norm_eps: f32,
    /// 0 for plain RMSNorm weights, 1 for zero-centred `(1 + w)` weights.
    pub norm_offset: f32,
    pub tie_word_embeddings: bool,
    /// Decoder layers, each one or two residual blocks.
    pub layers: Vec<Vec<BlockPlan>>,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// Prefixes under which the text model's tensors may be stored, most likely first (published layout first).
    pub prefixes: Vec<String>,
    /// Embedding and final-norm names relative to the prefix.
    pub embed_name: String,
    pub final_norm_name: String,
    /// Name of each decoder layer's prefix relative to the model prefix: `layers.{i}.`.
    pub layers_name: String,
    /// Tensor prefixes kept for later use (MTP heads) and prefixes ignored (vision tower).
    pub keep_prefixes: Vec<String>,
    pub ignore_prefixes: Vec<String>,
    /// Number of MTP layers the checkpoint carries (kept for the MTP drafter).
    pub mtp_layers: usize,
}

impl ModelConfig {
    /// Reads and parses `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Ok(Self::from_dir_json(dir)?.0)
    }

    /// Reads and parses `dir/config.json`, returning the JSON as well (the MTP layout is read from it).
    pub fn from_dir_json(dir: &Path) -> Result<(Self, Value)> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| EngineError::io(&path, e))?;
        let value = super::json::parse_relaxed(&text).map_err(|e| EngineError::Json {
            path: path.clone(),
            message: e.to_string(),
        })?;
        Ok((Self::from_json(&value)?, value))
    }

    /// Parses a config already read as JSON.
    pub fn from_json(value: &Value) -> Result<Self> {
        let top = Fields::new(value, "")?;
        let model_type = top.opt_str("model_type")?.map(str::to_string);
        let arch = top.opt_str_list("architectures")?.and_then(|a| a.into_iter().next());
        let kind = match (model_type.as_deref(), arch.as_deref()) {
            (Some("nemotron_h"), _) | (None, Some("NemotronHForCausalLM")) => ("nemotron_h", Family::NemotronH),
            (Some("qwen3_next"), _) | (None, Some("Qwen3NextForCausalLM")) => ("qwen3_next", Family::Qwen3Next),
            (Some("qwen3_5_text"), _) | (None, Some("Qwen3_5ForCausalLM")) => ("qwen3_5_text", Family::Qwen35),
            (Some("qwen3_5"), _) | (None, Some("Qwen3_5ForConditionalGeneration")) => ("qwen3_5", Family::Qwen35),
            (Some("qwen3_5_moe_text"), _) | (None, Some("Qwen3_5MoeForCausalLM")) => {
                ("qwen3_5_moe_text", Family::Qwen35Moe)
            }
            (Some("qwen3_5_moe"), _) | (None, Some("Qwen3_5MoeForConditionalGeneration")) => {
                ("qwen3_5_moe", Family::Qwen35Moe)
            }
            (Some(other), _) => {
                return Err(EngineError::Unsupported(format!(
                    "model_type `{other}` is not supported; supported: {SUPPORTED_MODELS}"
                )))
            }
            (None, Some(other)) => {
                return Err(EngineError::Unsupported(format!(
                    "architecture `{other}` is not supported; supported: {SUPPORTED_MODELS}"
                )))
            }
            (None, None) => {
                return Err(EngineError::config(
                    "model_type",
                    format!("missing (and no `architectures` either); supported: {SUPPORTED_MODELS}"),
                ))
            }
        };
        let cfg = match kind {
            ("nemotron_h", _) => parse_nemotron_h(top),
            (mt @ ("qwen3_5" | "qwen3_5_moe"), family) => {
                let text = top
                    .object("text_config")?
                    .ok_or_else(|| top.error("text_config", "missing"))?;
                let text = Fields::new(text, "text_config.")?;
                let mut cfg = parse_qwen(text, family, mt)?;
                // The multimodal checkpoint stores the text model under `model.language_model.`.
                cfg.prefixes = vec!["model.language_model.".into(), "model.".into()];
                cfg.ignore_prefixes = vec!["model.visual.".into(), "visual.".into()];
                if let Some(tie) = top.raw("tie_word_embeddings") {
                    cfg.tie_word_embeddings = tie
                        .as_bool()
                        .ok_or_else(|| top.error("tie_word_embeddings", "expected true or false"))?;
                }
                if cfg.eos_token_ids.is_empty() {
                    cfg.eos_token_ids = top.token_ids("eos_token_id")?;
                }
                Ok(cfg)
            }
            (mt, family) => parse_qwen(top, family, mt),
        }?;
        check_special_ids(&cfg)?;
        Ok(cfg)
    }

    /// Total number of residual blocks.
    pub fn num_blocks(&self) -> usize {
        self.layers.iter().map(Vec::len).sum()
    }

    /// A one-line description of the layer stack, e.g. `M*-M*- ...` style counts.
    pub fn summary(&self) -> String {
        let mut counts: Vec<(&'static str, usize)> = Vec::new();
        for block in self.layers.iter().flatten() {
            let label = block.kind.label();
            match counts.iter_mut().find(|(l, _)| *l == label) {
                Some((_, n)) => *n += 1,
                None => counts.push((label, 1)),
            }
        }
        let parts: Vec<String> = counts.iter().map(|(l, n)| format!("{n} {l}")).collect();
        format!(
            "{} ({}: {}), hidden {}, vocab {}",
            self.model_type,
            crate::words::count(self.layers.len() as u64, "layer"),
            parts.join(", "),
            self.hidden_size,
            self.vocab_size
        )
    }
}

/// End-of-sequence and beginning-of-sequence ids must be tokens of the vocabulary: an id past it would never be
/// sampled (so generation would run to max_tokens) or would be fed to the embedding out of range.
fn check_special_ids(cfg: &ModelConfig) -> Result<()> {
    let vocab = cfg.vocab_size;
    let named = cfg
        .eos_token_ids
        .iter()
        .map(|&id| ("eos_token_id", id))
        .chain(cfg.bos_token_id.map(|id| ("bos_token_id", id)));
    for (field, id) in named {
        if id as usize >= vocab {
            return Err(EngineError::config(
                field,
                format!("token id {id} is outside the vocabulary of {vocab} (vocab_size)"),
            ));
        }
    }
    Ok(())
}

fn check_divides(f: &Fields, field: &str, divisor: usize, divisor_name: &str, value: usize) -> Result<()> {
    if !value.is_multiple_of(divisor) {
        return Err(f.error(
            field,
            format!("{value} is not a multiple of {divisor_name} ({divisor})"),
        ));
    }
    Ok(())
}
