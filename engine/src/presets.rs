//! Model presets for `rewind init-model`: HF `config.json` contents for each family at test size (`tiny`), CPU demo
//! size (`small`, ~50M parameters) and the real shapes of the published models (Nemotron-H, Qwen3-Next, Qwen3.5).

use serde_json::{json, Value};

use crate::error::{EngineError, Result};
use crate::model::Family;

/// A named preset and what it is for.
pub struct PresetInfo {
    pub name: &'static str,
    pub family: Family,
    pub about: &'static str,
}

/// Every preset, by family.
pub const PRESETS: &[PresetInfo] = &[
    PresetInfo {
        name: "tiny",
        family: Family::NemotronH,
        about: "tests: hidden 64, 6 layers",
    },
    PresetInfo {
        name: "tiny-latent",
        family: Family::NemotronH,
        about: "tests: tiny with Nemotron-3 Super's latent MoE (experts in a 32-wide latent space)",
    },
    PresetInfo {
        name: "small",
        family: Family::NemotronH,
        about: "CPU demo: ~50M parameters",
    },
    PresetInfo {
        name: "nemotron-h-8b",
        family: Family::NemotronH,
        about: "Nemotron-H-8B shapes (52 layers)",
    },
    PresetInfo {
        name: "nemotron-3-nano-30b-a3b",
        family: Family::NemotronH,
        about: "Nemotron-3-Nano-30B-A3B shapes (52 layers, MoE)",
    },
    PresetInfo {
        name: "nemotron-3-super-120b-a12b",
        family: Family::NemotronH,
        about: "Nemotron-3-Super-120B-A12B shapes (88 layers, latent MoE: 512 experts in a 1024-wide latent space)",
    },
    PresetInfo {
        name: "tiny",
        family: Family::Qwen3Next,
        about: "tests",
    },
    PresetInfo {
        name: "small",
        family: Family::Qwen3Next,
        about: "CPU demo",
    },
    PresetInfo {
        name: "qwen3-next-80b-a3b",
        family: Family::Qwen3Next,
        about: "Qwen3-Next-80B-A3B shapes (48 layers, 512 experts)",
    },
    PresetInfo {
        name: "tiny",
        family: Family::Qwen35,
        about: "tests",
    },
    PresetInfo {
        name: "small",
        family: Family::Qwen35,
        about: "CPU demo",
    },
    PresetInfo {
        name: "qwen3.5-4b",
        family: Family::Qwen35,
        about: "Qwen3.5-4B shapes (32 layers)",
    },
    PresetInfo {
        name: "qwen3.5-9b",
        family: Family::Qwen35,
        about: "Qwen3.5-9B shapes (32 layers)",
    },
    PresetInfo {
        name: "tiny",
        family: Family::Qwen35Moe,
        about: "tests",
    },
    PresetInfo {
        name: "small",
        family: Family::Qwen35Moe,
        about: "CPU demo",
    },
    PresetInfo {
        name: "qwen3.5-35b-a3b",
        family: Family::Qwen35Moe,
        about: "Qwen3.5-35B-A3B shapes (40 layers, 256 experts)",
    },
    PresetInfo {
        name: "qwen3.5-122b-a10b",
        family: Family::Qwen35Moe,
        about: "Qwen3.5-122B-A10B shapes (48 layers)",
    },
    PresetInfo {
        name: "qwen3.5-397b-a17b",
        family: Family::Qwen35Moe,
        about: "Qwen3.5-397B-A17B shapes (60 layers, 512 experts): the largest public Qwen3.5 MoE",
    },
];

/// Parses an `--arch` value.
pub fn parse_arch(arch: &str) -> Result<Family> {
    match arch {
        "nemotron_h" => Ok(Family::NemotronH),
        "qwen3_next" => Ok(Family::Qwen3Next),
        "qwen3_5" => Ok(Family::Qwen35),
        "qwen3_5_moe" => Ok(Family::Qwen35Moe),
        other => Err(EngineError::InvalidInput(format!(
            "unknown --arch `{other}`; expected one of nemotron_h, qwen3_next, qwen3_5, qwen3_5_moe"
        ))),
    }
}

/// How many ids of a preset's tokenizer are trained BPE tokens. `tiny` and `small` models use exactly this vocabulary;
/// the real shapes have their published (larger) vocabulary, and `init-model` fills the ids past the trained ones with
/// placeholder tokens so that every id the model can produce decodes to text.
pub fn tokenizer_vocab(preset: &str) -> usize {
    match preset {
        "tiny" | "tiny-latent" => 512,
        _ => 4096,
    }
}

/// Nemotron-H-8B's layer pattern: 24 Mamba-2, 4 attention, 24 MLP.
const NEMOTRON_H_8B_PATTERN: &str = "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-M-M-M-M-";
/// Nemotron-3-Nano-30B-A3B's layer pattern: 23 Mamba-2, 6 attention, 23 MoE.
const NEMOTRON_3_NANO_PATTERN: &str = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEMEME";
/// Nemotron-3-Super-120B-A12B's layer pattern: 40 Mamba-2, 8 attention, 40 latent MoE. Its shapes (hidden 4096,
/// 512 experts top-22 of width 2688 in a 1024-wide latent space, shared expert 5376, routed scaling 5.0, 128 Mamba
/// heads of 64, 32 / 2 attention heads of 128, vocab 131072) are those of the published config.json
/// (https://huggingface.co/nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16/blob/main/config.json), as Megatron-Bridge's
/// `Nemotron3SuperProvider` (src/megatron/bridge/models/nemotronh/nemotron_h_provider.py) also writes them.
const NEMOTRON_3_SUPER_PATTERN: &str =
    "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME";

/// The names of `family`'s presets, in [`PRESETS`]' order.
pub fn names_for(family: Family) -> Vec<&'static str> {
    PRESETS.iter().filter(|p| p.family == family).map(|p| p.name).collect()
}

/// The `config.json` of `preset` for `family`, cut to `layers` decoder layers if given. `vocab` is the tokenizer's
/// vocabulary size, used by the small presets; `eos`/`bos` are the tokenizer's special ids.
pub fn preset_config(
    family: Family,
    preset: &str,
    layers: Option<usize>,
    vocab: usize,
    bos: u32,
    eos: u32,
) -> Result<Value> {
    let unknown = || {
        EngineError::InvalidInput(format!(
            "unknown --preset `{preset}` for {}; available: {}",
            family.name(),
            names_for(family).join(", ")
        ))
    };
    let mut cfg = match family {
        Family::NemotronH => {
            let (pattern, shape) = match preset {
                "tiny" => (
                    "M*-M-E",
                    json!({"hidden_size": 64, "mamba_num_heads": 4, "mamba_head_dim": 16,
                    "ssm_state_size": 16, "n_groups": 2, "chunk_size": 8, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48,
                    "routed_scaling_factor": 1.5, "vocab_size": vocab}),
                ),
                "tiny-latent" => (
                    "M*EM-E",
                    json!({"hidden_size": 64, "mamba_num_heads": 4, "mamba_head_dim": 16,
                    "ssm_state_size": 16, "n_groups": 2, "chunk_size": 8, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "n_routed_experts": 8,
                    "num_experts_per_tok": 3, "moe_intermediate_size": 32, "moe_latent_size": 32,
                    "moe_shared_expert_intermediate_size": 48, "n_group": 2, "topk_group": 1,
                    "routed_scaling_factor": 5.0, "vocab_size": vocab}),
                ),
                "small" => (
                    "M-M-M*-M-M-M-M*-M-M-M*-M-",
                    json!({"hidden_size": 512, "mamba_num_heads": 16,
                    "mamba_head_dim": 64, "ssm_state_size": 64, "n_groups": 2, "chunk_size": 64,
                    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 2048,
                    "vocab_size": vocab}),
                ),
                "nemotron-h-8b" => (
                    NEMOTRON_H_8B_PATTERN,
                    json!({"hidden_size": 4096, "mamba_num_heads": 128,
                    "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "chunk_size": 128,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504,
                    "vocab_size": 131072, "max_position_embeddings": 8192}),
                ),
                "nemotron-3-nano-30b-a3b" => (
                    NEMOTRON_3_NANO_PATTERN,
                    json!({"hidden_size": 2688,
                    "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
                    "chunk_size": 128, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
                    "intermediate_size": 1856, "n_routed_experts": 128, "num_experts_per_tok": 6,
                    "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
                    "routed_scaling_factor": 2.5, "vocab_size": 131072, "max_position_embeddings": 262144}),
                ),
                "nemotron-3-super-120b-a12b" => (
                    NEMOTRON_3_SUPER_PATTERN,
                    json!({"hidden_size": 4096,
                    "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
                    "chunk_size": 128, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
                    "intermediate_size": 2688, "n_routed_experts": 512, "num_experts_per_tok": 22,
                    "moe_intermediate_size": 2688, "moe_latent_size": 1024,
                    "moe_shared_expert_intermediate_size": 5376, "routed_scaling_factor": 5.0,
                    "vocab_size": 131072, "max_position_embeddings": 262144}),
                ),
                _ => return Err(unknown()),
            };
            let pattern: String = pattern
                .chars()
                .take(check_layers(family, preset, layers, pattern.len())?)
                .collect();
            let mut base = json!({
                "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
                "hybrid_override_pattern": pattern, "num_hidden_layers": pattern.len(),
                "conv_kernel": 4, "use_conv_bias": true, "mamba_hidden_act": "silu", "use_bias": false,
                "mlp_hidden_act": "relu2", "mlp_bias": false, "attention_bias": false,
                "layer_norm_epsilon": 1e-5, "time_step_min": 0.001, "time_step_max": 0.1,
                "n_group": 1, "topk_group": 1, "norm_topk_prob": true, "n_shared_experts": 1,
                "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                "moe_shared_expert_intermediate_size": 256, "routed_scaling_factor": 1.0,
                "tie_word_embeddings": false, "max_position_embeddings": 4096, "residual_in_fp32": false,
                "rescale_prenorm_residual": true, "use_cache": true, "num_logits_to_keep": 1,
            });
            merge(&mut base, shape);
            base
        }
        Family::Qwen3Next | Family::Qwen35 | Family::Qwen35Moe => {
            let shape = match (family, preset) {
                (_, "tiny") => json!({"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                    "linear_key_head_dim": 16, "linear_value_head_dim": 24, "intermediate_size": 128, "num_experts": 8,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                    "full_attention_interval": 2, "vocab_size": vocab}),
                (_, "small") => json!({"hidden_size": 512, "num_hidden_layers": 16, "num_attention_heads": 8,
                    "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                    "linear_key_head_dim": 64, "linear_value_head_dim": 64, "intermediate_size": 1792, "num_experts": 16,
                    "num_experts_per_tok": 4, "moe_intermediate_size": 384, "shared_expert_intermediate_size": 512,
                    "vocab_size": vocab}),
                (Family::Qwen35, "qwen3.5-4b") => json!({"hidden_size": 2560, "num_hidden_layers": 32,
                    "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 9216,
                    "tie_word_embeddings": true, "vocab_size": 248320}),
                (Family::Qwen35, "qwen3.5-9b") => json!({"hidden_size": 4096, "num_hidden_layers": 32,
                    "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 12288, "vocab_size": 248320}),
                (Family::Qwen35Moe, "qwen3.5-35b-a3b") => json!({"hidden_size": 2048, "num_hidden_layers": 40,
                    "num_attention_heads": 16, "num_key_value_heads": 2, "num_experts": 256, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "vocab_size": 248320}),
                (Family::Qwen35Moe, "qwen3.5-122b-a10b") => json!({"hidden_size": 3072, "num_hidden_layers": 48,
                    "num_attention_heads": 32, "num_key_value_heads": 2, "linear_num_value_heads": 64, "num_experts": 256,
                    "num_experts_per_tok": 8, "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
                    "vocab_size": 248320}),
                // https://huggingface.co/Qwen/Qwen3.5-397B-A17B/blob/main/config.json (text_config): 60 layers of
                // 3 Gated DeltaNet + 1 gated attention, 16 key / 64 value linear heads of 128, 32 / 2 attention heads
                // of 256, 512 experts top-10 of width 1024 plus one shared expert of 1024, 262144 tokens of context.
                (Family::Qwen35Moe, "qwen3.5-397b-a17b") => json!({"hidden_size": 4096, "num_hidden_layers": 60,
                    "num_attention_heads": 32, "num_key_value_heads": 2, "linear_num_value_heads": 64, "num_experts": 512,
                    "num_experts_per_tok": 10, "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
                    "vocab_size": 248320, "max_position_embeddings": 262144}),
                (Family::Qwen3Next, "qwen3-next-80b-a3b") => json!({"hidden_size": 2048, "num_hidden_layers": 48,
                    "num_attention_heads": 16, "num_key_value_heads": 2, "intermediate_size": 5120, "num_experts": 512,
                    "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                    "vocab_size": 151936}),
                _ => return Err(unknown()),
            };
            let mut base = json!({
                "hidden_act": "silu", "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                "rms_norm_eps": 1e-6, "attention_bias": false, "max_position_embeddings": 32768,
                "tie_word_embeddings": false, "full_attention_interval": 4, "use_cache": true,
            });
            merge(&mut base, shape);
            let depth = base["num_hidden_layers"].as_u64().unwrap_or(1) as usize;
            let n = check_layers(family, preset, layers, depth)?;
            let interval = base["full_attention_interval"].as_u64().unwrap_or(4) as usize;
            let types: Vec<&str> = (0..n)
                .map(|i| {
                    if !(i + 1).is_multiple_of(interval) {
                        "linear_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect();
            base["num_hidden_layers"] = json!(n);
            base["layer_types"] = json!(types);
            let obj = base.as_object_mut().expect("preset configs are objects");
            match family {
                Family::Qwen3Next => {
                    obj.insert("architectures".into(), json!(["Qwen3NextForCausalLM"]));
                    obj.insert("model_type".into(), json!("qwen3_next"));
                    obj.insert("rope_theta".into(), json!(10_000_000.0));
                    obj.insert("partial_rotary_factor".into(), json!(0.25));
                    obj.insert("norm_topk_prob".into(), json!(true));
                    obj.insert("decoder_sparse_step".into(), json!(1));
                    obj.insert("mlp_only_layers".into(), json!([]));
                }
                Family::Qwen35 | Family::Qwen35Moe => {
                    let moe = family == Family::Qwen35Moe;
                    obj.insert(
                        "architectures".into(),
                        json!([if moe {
                            "Qwen3_5MoeForCausalLM"
                        } else {
                            "Qwen3_5ForCausalLM"
                        }]),
                    );
                    obj.insert(
                        "model_type".into(),
                        json!(if moe { "qwen3_5_moe_text" } else { "qwen3_5_text" }),
                    );
                    obj.insert(
                        "rope_parameters".into(),
                        json!({"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": [11, 11, 10], "mrope_interleaved": true}),
                    );
                    if !moe {
                        for k in [
                            "num_experts",
                            "num_experts_per_tok",
                            "moe_intermediate_size",
                            "shared_expert_intermediate_size",
                        ] {
                            obj.remove(k);
                        }
                    } else {
                        obj.remove("intermediate_size");
                    }
                }
                Family::NemotronH => unreachable!("handled above"),
            }
            obj.remove("full_attention_interval");
            base
        }
    };
    let obj = cfg.as_object_mut().expect("preset configs are objects");
    obj.insert("bos_token_id".into(), json!(bos));
    obj.insert("eos_token_id".into(), json!(eos));
    obj.insert("pad_token_id".into(), json!(eos));
    obj.insert("torch_dtype".into(), json!("float32"));
    obj.insert("transformers_version".into(), json!("5.17.0"));
    Ok(cfg)
}

/// The number of layers to build: `layers` if it is between 1 and the preset's `depth` (`--layers` only cuts depth),
/// the whole preset if `None`.
fn check_layers(family: Family, preset: &str, layers: Option<usize>, depth: usize) -> Result<usize> {
    match layers {
        None => Ok(depth),
        Some(n) if (1..=depth).contains(&n) => Ok(n),
        Some(n) => Err(EngineError::InvalidInput(format!(
            "--layers {n} is out of range: preset `{preset}` of {} has {depth} layers, and --layers can only cut \
             depth (1..={depth})",
            family.name()
        ))),
    }
}

fn merge(base: &mut Value, over: Value) {
    if let (Some(b), Value::Object(o)) = (base.as_object_mut(), over) {
        for (k, v) in o {
            b.insert(k, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::BlockKind;
    use crate::model::ModelConfig;

    #[test]
    fn every_preset_parses() {
        for p in PRESETS {
            let cfg = preset_config(p.family, p.name, Some(3), 512, 1, 2).expect("preset");
            let parsed = ModelConfig::from_json(&cfg).unwrap_or_else(|e| panic!("{} {}: {e}", p.family.name(), p.name));
            assert_eq!(parsed.family, p.family);
            assert_eq!(parsed.layers.len(), 3);
        }
    }

    #[test]
    fn layers_cut_depth_but_never_grow_it() {
        for p in PRESETS {
            let full = preset_config(p.family, p.name, None, 512, 1, 2).expect("preset");
            let depth = full["num_hidden_layers"].as_u64().expect("num_hidden_layers") as usize;
            let exact = preset_config(p.family, p.name, Some(depth), 512, 1, 2).expect("the whole depth");
            assert_eq!(exact, full, "{} {}", p.family.name(), p.name);
            let one = preset_config(p.family, p.name, Some(1), 512, 1, 2).expect("one layer");
            assert_eq!(one["num_hidden_layers"], 1);
            for n in [0, depth + 1, 999, usize::MAX] {
                let e = preset_config(p.family, p.name, Some(n), 512, 1, 2)
                    .unwrap_err()
                    .to_string();
                assert!(
                    e.contains("--layers")
                        && e.contains(&format!("{n}"))
                        && e.contains(&format!("has {depth} layers"))
                        && e.contains(p.name),
                    "{e}"
                );
            }
        }
        // Nemotron-H keeps the first N layers of the pattern.
        let cfg = preset_config(Family::NemotronH, "nemotron-h-8b", Some(4), 0, 1, 2).expect("cut");
        assert_eq!(cfg["hybrid_override_pattern"], "M-M-");
    }

    /// The whole preset, parsed, and its layer count with its blocks counted per label (in `labels` order).
    fn shape(family: Family, preset: &str, labels: [&str; 3]) -> (ModelConfig, [usize; 4]) {
        let c = ModelConfig::from_json(&preset_config(family, preset, None, 0, 1, 2).expect("preset")).expect("parse");
        let count = |l: &str| c.layers.iter().flatten().filter(|b| b.kind.label() == l).count();
        let counts = [c.layers.len(), count(labels[0]), count(labels[1]), count(labels[2])];
        (c, counts)
    }

    #[test]
    fn real_shapes_match_targets() {
        let nemotron = ["mamba2", "attention", "moe"];
        let (_, counts) = shape(Family::NemotronH, "nemotron-h-8b", ["mamba2", "attention", "mlp"]);
        assert_eq!(counts, [52, 24, 4, 24]);
        let (_, counts) = shape(Family::NemotronH, "nemotron-3-nano-30b-a3b", nemotron);
        assert_eq!(counts, [52, 23, 6, 23]);
        let (c, counts) = shape(Family::NemotronH, "nemotron-3-super-120b-a12b", nemotron);
        assert_eq!(counts, [88, 40, 8, 40]);
        let moe = c
            .layers
            .iter()
            .find_map(|b| match &b[0].kind {
                BlockKind::Moe(m) => Some(m.clone()),
                _ => None,
            })
            .expect("a MoE layer");
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.expert_intermediate, moe.expert_dim()),
            (512, 22, 2688, 1024)
        );
        assert_eq!(moe.shared.as_ref().map(|s| s.intermediate), Some(5376));
        // The published totals: 120B (Super, latent projections included) and 397B (Qwen3.5's largest MoE).
        let params = crate::state::memory::parameter_count(&c) as f64;
        assert!((118e9..124e9).contains(&params), "{params}");
        let (c, counts) = shape(Family::Qwen35Moe, "qwen3.5-397b-a17b", ["gdn", "attention", "moe"]);
        assert_eq!(counts, [60, 45, 15, 60]);
        let params = crate::state::memory::parameter_count(&c) as f64;
        assert!((390e9..400e9).contains(&params), "{params}");
    }

    #[test]
    fn unknown_preset_lists_available() {
        let e = preset_config(Family::Qwen35, "huge", None, 512, 1, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("qwen3.5-4b") && e.contains("huge"), "{e}");
    }
}
