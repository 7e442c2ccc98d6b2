//! Parsing `config.json` of every supported family into a family-independent [`ModelConfig`]: a list of residual
//! blocks, each a norm plus one mixer ([`BlockKind`]), with the tensor-name prefixes the family's checkpoints use.

use std::path::Path;

use serde_json::Value;

use super::json::Fields;
use super::spec::*;
use crate::error::{EngineError, Result};

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
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| EngineError::io(&path, e))?;
        let value = super::json::parse_relaxed(&text).map_err(|e| EngineError::Json {
            path: path.clone(),
            message: e.to_string(),
        })?;
        Self::from_json(&value)
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
        match kind {
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
        }
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
            "{} ({} layers: {}), hidden {}, vocab {}",
            self.model_type,
            self.layers.len(),
            parts.join(", "),
            self.hidden_size,
            self.vocab_size
        )
    }
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

fn nemotron_layer_types(f: &Fields) -> Result<Vec<char>> {
    let list = match f.opt_str_list("layers_block_type")? {
        Some(l) => Some(("layers_block_type", l)),
        None => f.opt_str_list("layer_types")?.map(|l| ("layer_types", l)),
    };
    if let Some((field, list)) = list {
        return list
            .iter()
            .map(|t| match t.as_str() {
                "mamba" | "linear_attention" => Ok('M'),
                "attention" | "full_attention" => Ok('*'),
                "mlp" => Ok('-'),
                "moe" => Ok('E'),
                other => Err(f.error(
                    field,
                    format!("unknown layer type `{other}` (expected mamba, attention, mlp, moe, linear_attention or full_attention)"),
                )),
            })
            .collect();
    }
    if let Some(pattern) = f.opt_str("hybrid_override_pattern")? {
        return pattern
            .chars()
            .map(|c| match c {
                'M' | '*' | '-' | 'E' => Ok(c),
                other => Err(f.error(
                    "hybrid_override_pattern",
                    format!("unknown layer letter `{other}` (expected M, *, - or E)"),
                )),
            })
            .collect();
    }
    Err(f.error(
        "layers_block_type",
        "missing: give `layers_block_type` or `hybrid_override_pattern`",
    ))
}

fn parse_nemotron_h(f: Fields) -> Result<ModelConfig> {
    let hidden = f.positive("hidden_size")?;
    let vocab = f.positive("vocab_size")?;
    let eps = f.positive_f64_or("layer_norm_epsilon", 1e-5)? as f32;
    let types = nemotron_layer_types(&f)?;
    if types.is_empty() {
        return Err(f.error("layers_block_type", "no layers"));
    }
    let needs = |c: char| types.contains(&c);
    let mamba = if needs('M') {
        if let Some(act) = f.opt_str("mamba_hidden_act")? {
            if act != "silu" {
                return Err(f.error("mamba_hidden_act", format!("`{act}` is not supported (only silu)")));
            }
        }
        let heads = f.positive("mamba_num_heads")?;
        let head_dim = f.positive("mamba_head_dim")?;
        let groups = match f.opt_usize("n_groups")? {
            Some(g) => g,
            None => f.positive_or("mamba_n_groups", 8)?,
        };
        if groups == 0 {
            return Err(f.error("n_groups", "must be positive"));
        }
        check_divides(&f, "mamba_num_heads", groups, "n_groups", heads)?;
        let conv_kernel = if f.has("conv_kernel") {
            f.positive("conv_kernel")?
        } else {
            f.positive_or("mamba_d_conv", 4)?
        };
        let chunk_size = if f.has("chunk_size") {
            f.positive("chunk_size")?
        } else {
            f.positive_or("mamba_chunk_size", 128)?
        };
        let conv_bias = if f.has("use_conv_bias") {
            f.bool_or("use_conv_bias", true)?
        } else {
            f.bool_or("mamba_conv_bias", true)?
        };
        let dt_min = if f.has("time_step_min") {
            f.f64_or("time_step_min", 0.001)?
        } else {
            f.f64_or("mamba_dt_min", 0.001)?
        };
        let d_inner = heads * head_dim;
        Some(Mamba2Spec {
            hidden,
            heads,
            head_dim,
            state_dim: f.positive_or("ssm_state_size", 128)?,
            groups,
            conv_kernel,
            chunk_size,
            conv_bias,
            proj_bias: f.bool_or("use_bias", false)?,
            norm_eps: eps,
            norm_group_size: d_inner / groups,
            // The reference clamps dt from below by `time_step_min` (no upper limit) in its chunked scan.
            time_step_limit: (dt_min as f32, f32::INFINITY),
        })
    } else {
        None
    };
    let attention = if needs('*') {
        let heads = f.positive("num_attention_heads")?;
        let kv_heads = f.positive_or("num_key_value_heads", heads)?;
        check_divides(&f, "num_attention_heads", kv_heads, "num_key_value_heads", heads)?;
        let head_dim = match f.opt_usize("head_dim")? {
            Some(d) if d > 0 => d,
            Some(_) => return Err(f.error("head_dim", "must be positive")),
            None => hidden / heads,
        };
        Some(AttentionSpec {
            hidden,
            heads,
            kv_heads,
            head_dim,
            // The reference builds q/k/v/o without bias whatever `attention_bias` says.
            bias: false,
            rope: None,
            qk_norm: None,
            output_gate: false,
            scale: 1.0 / (head_dim as f32).sqrt(),
        })
    } else {
        None
    };
    let mlp_bias = f.bool_or("mlp_bias", false)?;
    if needs('-') || needs('E') {
        if let Some(act) = f.opt_str("mlp_hidden_act")? {
            if act != "relu2" {
                return Err(f.error("mlp_hidden_act", format!("`{act}` is not supported (only relu2)")));
            }
        }
    }
    let mlp = if needs('-') {
        Some(MlpSpec {
            hidden,
            intermediate: f.positive("intermediate_size")?,
            act: Activation::Relu2,
            bias: mlp_bias,
        })
    } else {
        None
    };
    let moe = if needs('E') {
        if f.has("moe_latent_size") {
            return Err(f.error(
                "moe_latent_size",
                "latent MoE projections (Nemotron-3-Super) are not supported yet; only moe_latent_size = null",
            ));
        }
        let experts = if f.has("n_routed_experts") {
            f.positive("n_routed_experts")?
        } else {
            f.positive("num_local_experts")?
        };
        let top_k = f.positive("num_experts_per_tok")?;
        if top_k > experts {
            return Err(f.error(
                "num_experts_per_tok",
                format!("{top_k} exceeds the number of experts ({experts})"),
            ));
        }
        let n_group = f.positive_or("n_group", 1)?;
        let topk_group = f.positive_or("topk_group", 1)?;
        check_divides(&f, "n_routed_experts", n_group, "n_group", experts)?;
        if topk_group > n_group {
            return Err(f.error("topk_group", format!("{topk_group} exceeds n_group ({n_group})")));
        }
        if top_k > topk_group * (experts / n_group) {
            return Err(f.error("num_experts_per_tok", "more experts than the selected groups hold"));
        }
        let shared = if f.positive_or("n_shared_experts", 1)? > 0 {
            Some(SharedExpertSpec {
                intermediate: f.positive("moe_shared_expert_intermediate_size")?,
                sigmoid_gate: false,
            })
        } else {
            None
        };
        Some(MoeSpec {
            hidden,
            num_experts: experts,
            top_k,
            expert_intermediate: f.positive("moe_intermediate_size")?,
            act: Activation::Relu2,
            router: RouterSpec::SigmoidGrouped {
                n_group,
                topk_group,
                norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
                routed_scaling_factor: f.f64_or("routed_scaling_factor", 1.0)? as f32,
            },
            shared,
        })
    } else {
        None
    };
    let layers = types
        .iter()
        .map(|c| {
            // Every layer kind required above was parsed because `needs` saw it.
            let kind = match c {
                'M' => BlockKind::Mamba2(mamba.clone().expect("parsed when present")),
                '*' => BlockKind::Attention(attention.clone().expect("parsed when present")),
                '-' => BlockKind::Mlp(mlp.clone().expect("parsed when present")),
                _ => BlockKind::Moe(moe.clone().expect("parsed when present")),
            };
            vec![BlockPlan {
                norm: "norm.weight".into(),
                mixer: "mixer.".into(),
                kind,
            }]
        })
        .collect();
    let mtp_layers = f.opt_usize("num_nextn_predict_layers")?.unwrap_or(0);
    Ok(ModelConfig {
        family: Family::NemotronH,
        model_type: "nemotron_h".into(),
        vocab_size: vocab,
        hidden_size: hidden,
        max_position_embeddings: f.positive_or("max_position_embeddings", 4096)?,
        norm_eps: eps,
        norm_offset: 0.0,
        tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
        layers,
        eos_token_ids: f.token_ids("eos_token_id")?,
        bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
        prefixes: vec!["backbone.".into(), "model.".into()],
        embed_name: "embeddings.weight".into(),
        final_norm_name: "norm_f.weight".into(),
        layers_name: "layers.".into(),
        keep_prefixes: vec!["mtp.".into()],
        ignore_prefixes: Vec::new(),
        mtp_layers,
    })
}

fn qwen_rope(f: &Fields, head_dim: usize) -> Result<RopeSpec> {
    let params = f.object("rope_parameters")?.or(f.object("rope_scaling")?);
    let (theta, factor) = match params {
        Some(p) => {
            let scope = if f.has("rope_parameters") {
                "rope_parameters."
            } else {
                "rope_scaling."
            };
            let p = Fields::new(p, scope)?;
            if let Some(t) = p.opt_str("rope_type")?.or(p.opt_str("type")?) {
                if t != "default" {
                    return Err(p.error(
                        "rope_type",
                        format!("`{t}` is not supported (only default, with text-only mrope)"),
                    ));
                }
            }
            let theta = match p.opt_f64("rope_theta")? {
                Some(t) => t,
                None => f.f64_or("rope_theta", 10000.0)?,
            };
            let factor = match p.opt_f64("partial_rotary_factor")? {
                Some(x) => x,
                None => f.f64_or("partial_rotary_factor", 0.25)?,
            };
            (theta, factor)
        }
        None => (
            f.f64_or("rope_theta", 10000.0)?,
            f.f64_or("partial_rotary_factor", 0.25)?,
        ),
    };
    if theta <= 0.0 {
        return Err(f.error("rope_theta", format!("must be positive, found {theta}")));
    }
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(f.error("partial_rotary_factor", format!("must be in (0, 1], found {factor}")));
    }
    let rotary_dim = (head_dim as f64 * factor) as usize;
    if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
        return Err(f.error(
            "partial_rotary_factor",
            format!("gives {rotary_dim} rotary channels of {head_dim}; must be even and positive"),
        ));
    }
    Ok(RopeSpec {
        theta: theta as f32,
        rotary_dim,
    })
}

fn parse_qwen(f: Fields, family: Family, model_type: &str) -> Result<ModelConfig> {
    let hidden = f.positive("hidden_size")?;
    let vocab = f.positive("vocab_size")?;
    let eps = f.positive_f64_or("rms_norm_eps", 1e-6)? as f32;
    if let Some(act) = f.opt_str("hidden_act")? {
        if act != "silu" {
            return Err(f.error("hidden_act", format!("`{act}` is not supported (only silu)")));
        }
    }
    let num_layers = f.positive("num_hidden_layers")?;
    let types: Vec<String> = match f.opt_str_list("layer_types")? {
        Some(list) => {
            if list.len() != num_layers {
                return Err(f.error(
                    "layer_types",
                    format!("has {} entries but num_hidden_layers is {num_layers}", list.len()),
                ));
            }
            list
        }
        None => {
            let interval = f.positive_or("full_attention_interval", 4)?;
            (0..num_layers)
                .map(|i| {
                    if !(i + 1).is_multiple_of(interval) {
                        "linear_attention".into()
                    } else {
                        "full_attention".into()
                    }
                })
                .collect()
        }
    };
    let k_heads = f.positive("linear_num_key_heads")?;
    let v_heads = f.positive("linear_num_value_heads")?;
    check_divides(&f, "linear_num_value_heads", k_heads, "linear_num_key_heads", v_heads)?;
    let gdn = GdnSpec {
        hidden,
        k_heads,
        v_heads,
        k_head_dim: f.positive("linear_key_head_dim")?,
        v_head_dim: f.positive("linear_value_head_dim")?,
        conv_kernel: f.positive_or("linear_conv_kernel_dim", 4)?,
        chunk_size: 64,
        norm_eps: eps,
        layout: if family == Family::Qwen3Next {
            GdnLayout::FusedInterleaved
        } else {
            GdnLayout::Split
        },
    };
    let heads = f.positive("num_attention_heads")?;
    let kv_heads = f.positive_or("num_key_value_heads", heads)?;
    check_divides(&f, "num_attention_heads", kv_heads, "num_key_value_heads", heads)?;
    let head_dim = f.positive_or("head_dim", hidden / heads)?;
    let attention = AttentionSpec {
        hidden,
        heads,
        kv_heads,
        head_dim,
        bias: f.bool_or("attention_bias", false)?,
        rope: Some(qwen_rope(&f, head_dim)?),
        qk_norm: Some(QkNormSpec { eps, offset: 1.0 }),
        output_gate: true,
        scale: 1.0 / (head_dim as f32).sqrt(),
    };
    let moe = if family == Family::Qwen35 {
        None
    } else {
        let experts = f.positive("num_experts")?;
        let top_k = f.positive("num_experts_per_tok")?;
        if top_k > experts {
            return Err(f.error(
                "num_experts_per_tok",
                format!("{top_k} exceeds num_experts ({experts})"),
            ));
        }
        let norm_topk_prob = if family == Family::Qwen3Next {
            f.bool_or("norm_topk_prob", true)?
        } else {
            true
        };
        Some(MoeSpec {
            hidden,
            num_experts: experts,
            top_k,
            expert_intermediate: f.positive("moe_intermediate_size")?,
            act: Activation::SwiGlu,
            router: RouterSpec::Softmax { norm_topk_prob },
            shared: Some(SharedExpertSpec {
                intermediate: f.positive("shared_expert_intermediate_size")?,
                sigmoid_gate: true,
            }),
        })
    };
    let mlp_only: Vec<usize> = f.opt_usize_list("mlp_only_layers")?.unwrap_or_default();
    let sparse_step = f.positive_or("decoder_sparse_step", 1)?;
    let mut layers = Vec::with_capacity(num_layers);
    for (i, t) in types.iter().enumerate() {
        let mixer = match t.as_str() {
            "linear_attention" => BlockPlan {
                norm: "input_layernorm.weight".into(),
                mixer: "linear_attn.".into(),
                kind: BlockKind::Gdn(gdn.clone()),
            },
            "full_attention" | "attention" => BlockPlan {
                norm: "input_layernorm.weight".into(),
                mixer: "self_attn.".into(),
                kind: BlockKind::Attention(attention.clone()),
            },
            other => {
                return Err(f.error(
                    "layer_types",
                    format!("unknown layer type `{other}` (expected linear_attention or full_attention)"),
                ))
            }
        };
        let ffn_kind = match &moe {
            Some(m)
                if family == Family::Qwen35Moe || (!mlp_only.contains(&i) && (i + 1).is_multiple_of(sparse_step)) =>
            {
                BlockKind::Moe(m.clone())
            }
            _ => BlockKind::Mlp(MlpSpec {
                hidden,
                intermediate: f.positive("intermediate_size")?,
                act: Activation::SwiGlu,
                bias: false,
            }),
        };
        layers.push(vec![
            mixer,
            BlockPlan {
                norm: "post_attention_layernorm.weight".into(),
                mixer: "mlp.".into(),
                kind: ffn_kind,
            },
        ]);
    }
    let mtp_layers = f
        .opt_usize("mtp_num_hidden_layers")?
        .or(f.opt_usize("num_nextn_predict_layers")?)
        .unwrap_or(0);
    Ok(ModelConfig {
        family,
        model_type: model_type.to_string(),
        vocab_size: vocab,
        hidden_size: hidden,
        max_position_embeddings: f.positive_or("max_position_embeddings", 32768)?,
        norm_eps: eps,
        norm_offset: 1.0,
        tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
        layers,
        eos_token_ids: f.token_ids("eos_token_id")?,
        bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
        prefixes: vec!["model.".into()],
        embed_name: "embed_tokens.weight".into(),
        final_norm_name: "norm.weight".into(),
        layers_name: "layers.".into(),
        keep_prefixes: vec!["mtp.".into()],
        ignore_prefixes: Vec::new(),
        mtp_layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn nemotron() -> Value {
        json!({
            "model_type": "nemotron_h", "hidden_size": 64, "vocab_size": 100, "hybrid_override_pattern": "M*-E",
            "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 48, "n_group": 2, "topk_group": 1, "eos_token_id": [2, 3]
        })
    }

    #[test]
    fn nemotron_pattern_and_list_agree() {
        let a = ModelConfig::from_json(&nemotron()).expect("pattern config");
        let mut v = nemotron();
        v.as_object_mut().expect("object").remove("hybrid_override_pattern");
        v["layers_block_type"] = json!(["mamba", "attention", "mlp", "moe"]);
        let b = ModelConfig::from_json(&v).expect("list config");
        assert_eq!(a.layers, b.layers);
        assert_eq!(a.eos_token_ids, vec![2, 3]);
        let labels: Vec<_> = a.layers.iter().map(|l| l[0].kind.label()).collect();
        assert_eq!(labels, ["mamba2", "attention", "mlp", "moe"]);
    }

    #[test]
    fn errors_name_fields() {
        let mut v = nemotron();
        v["n_groups"] = json!(3);
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("mamba_num_heads") && e.contains("n_groups"), "{e}");
        let mut v = nemotron();
        v["hybrid_override_pattern"] = json!("MX");
        assert!(ModelConfig::from_json(&v)
            .unwrap_err()
            .to_string()
            .contains("hybrid_override_pattern"));
        let e = ModelConfig::from_json(&json!({"model_type": "llama"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("llama") && e.contains("qwen3_next"), "{e}");
        let mut v = nemotron();
        v.as_object_mut().expect("object").remove("hidden_size");
        assert!(ModelConfig::from_json(&v)
            .unwrap_err()
            .to_string()
            .contains("hidden_size"));
    }

    #[test]
    fn qwen_layer_types_and_rope() {
        let v = json!({
            "model_type": "qwen3_next", "hidden_size": 64, "vocab_size": 100, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8, "intermediate_size": 96,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
            "full_attention_interval": 2, "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mlp_only_layers": [1]
        });
        let c = ModelConfig::from_json(&v).expect("qwen3_next");
        let kinds: Vec<_> = c
            .layers
            .iter()
            .map(|l| (l[0].kind.label(), l[1].kind.label()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("gdn", "moe"),
                ("attention", "mlp"),
                ("gdn", "moe"),
                ("attention", "moe")
            ]
        );
        match &c.layers[1][0].kind {
            BlockKind::Attention(a) => assert_eq!(a.rope.as_ref().map(|r| r.rotary_dim), Some(8)),
            other => panic!("expected attention, got {other:?}"),
        }
        let full = json!({"model_type": "qwen3_5", "tie_word_embeddings": true, "text_config": {
            "hidden_size": 64, "vocab_size": 100, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
            "intermediate_size": 96, "layer_types": ["linear_attention", "full_attention"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 2], "mrope_interleaved": true}
        }});
        let c = ModelConfig::from_json(&full).expect("qwen3_5");
        assert!(c.tie_word_embeddings);
        assert_eq!(c.prefixes[0], "model.language_model.");
        let mut bad = full.clone();
        bad["text_config"]["rope_parameters"]["rope_type"] = json!("yarn");
        assert!(ModelConfig::from_json(&bad)
            .unwrap_err()
            .to_string()
            .contains("rope_type"));
    }
}
