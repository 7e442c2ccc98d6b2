//! The `nemotron_h` family (Nemotron-H, Nemotron-Nano-v2, Nemotron-3): one mixer per decoder layer, chosen by
//! `layers_block_type` / `layer_types` or the older `hybrid_override_pattern` letters.

use super::{check_divides, BlockKind, BlockPlan, Family, ModelConfig};
use crate::error::Result;
use crate::model::json::Fields;
use crate::model::spec::*;

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

pub(super) fn parse_nemotron_h(f: Fields) -> Result<ModelConfig> {
    let hidden = f.positive("hidden_size")?;
    let vocab = f.positive("vocab_size")?;
    let eps = f.positive_f64_or("layer_norm_epsilon", 1e-5)? as f32;
    let types = nemotron_layer_types(&f)?;
    if types.is_empty() {
        return Err(f.error("layers_block_type", "no layers"));
    }
    // Transformers checks the same; a mismatch means the config was cut or edited by hand and half updated.
    if let Some(n) = f.opt_usize("num_hidden_layers")? {
        if n != types.len() {
            return Err(f.error(
                "num_hidden_layers",
                format!("is {n} but the layer pattern lists {} layers", types.len()),
            ));
        }
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
        // Nemotron-3 Super: the routed experts run in a `moe_latent_size`-wide space (transformers >= 5.23).
        let latent = match f.opt_usize("moe_latent_size")? {
            None => None,
            Some(0) => return Err(f.error("moe_latent_size", "must be positive (or null for no latent space)")),
            Some(size) => Some(LatentSpec { size, bias: mlp_bias }),
        };
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
            latent,
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

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
    fn latent_moe_size_is_read_and_null_means_none() {
        let moe_of = |v: &Value| match &ModelConfig::from_json(v).expect("config").layers[3][0].kind {
            BlockKind::Moe(m) => m.clone(),
            other => panic!("layer 3 is {}", other.label()),
        };
        let mut v = nemotron();
        v["moe_latent_size"] = json!(24);
        v["mlp_bias"] = json!(true);
        let m = moe_of(&v);
        assert_eq!(m.latent, Some(LatentSpec { size: 24, bias: true }));
        assert_eq!(m.expert_dim(), 24);
        v["moe_latent_size"] = Value::Null;
        assert_eq!(moe_of(&v).latent, None);
        assert_eq!(moe_of(&v).expert_dim(), 64);
        v["moe_latent_size"] = json!(0);
        let e = ModelConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains("moe_latent_size"), "{e}");
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
    fn hostile_values_are_refused_before_loading() {
        let refused = |field: &str, value: Value, words: &[&str]| {
            let mut v = nemotron();
            v[field] = value;
            let e = ModelConfig::from_json(&v).expect_err(field).to_string();
            for w in words {
                assert!(e.contains(w), "{field}: {e}");
            }
        };
        // Counts past any real model (they made the loader loop over 10^11 experts or heads).
        refused(
            "n_routed_experts",
            json!(100_000_000_000u64),
            &["n_routed_experts", "larger than any model"],
        );
        refused(
            "mamba_num_heads",
            json!(10_000_000_000u64),
            &["mamba_num_heads", "larger"],
        );
        refused(
            "n_routed_experts",
            json!(16_000_000),
            &["n_routed_experts", "at most 16384"],
        );
        refused("hidden_size", json!(1u64 << 40), &["hidden_size"]);
        // Special tokens outside the vocabulary, and a layer count the pattern contradicts.
        refused(
            "eos_token_id",
            json!([2, 100]),
            &["eos_token_id", "100", "vocabulary of 100"],
        );
        refused("bos_token_id", json!(250), &["bos_token_id", "250"]);
        refused("num_hidden_layers", json!(17), &["num_hidden_layers", "17", "4 layers"]);
        let mut v = nemotron();
        v["num_hidden_layers"] = json!(4);
        v["eos_token_id"] = json!(99);
        ModelConfig::from_json(&v).expect("a consistent config");
    }
}
