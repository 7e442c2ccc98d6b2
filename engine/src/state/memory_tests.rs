use serde_json::json;

use super::*;
use crate::init::plan_tensors;
use crate::model::Family;
use crate::presets::{preset_config, tokenizer_vocab, PRESETS};
use crate::shard::{RankPlan, ShardKind};
use crate::state::DEFAULT_KV_BLOCK_SIZE;

/// Mamba-2 (2 heads × 4, state 8, 1 group, K 4), attention (2 heads, 1 KV head of 4), MLP 16; hidden 8, vocab 10.
fn tiny_nemotron() -> ModelConfig {
    ModelConfig::from_json(&json!({
        "model_type": "nemotron_h", "hidden_size": 8, "vocab_size": 10, "hybrid_override_pattern": "M*-",
        "mamba_num_heads": 2, "mamba_head_dim": 4, "ssm_state_size": 8, "n_groups": 1, "conv_kernel": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16,
        "max_position_embeddings": 64
    }))
    .expect("tiny nemotron")
}

/// GDN (1 key head × 4, 2 value heads × 3, K 4) then attention (2 heads, 1 KV head of 8, gated); hidden 8, vocab
/// 10, dense MLP 16, tied embeddings.
fn tiny_qwen() -> ModelConfig {
    ModelConfig::from_json(&json!({
        "model_type": "qwen3_5_text", "hidden_size": 8, "vocab_size": 10, "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"], "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 8, "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 4,
        "linear_value_head_dim": 3, "linear_conv_kernel_dim": 4, "intermediate_size": 16,
        "tie_word_embeddings": true, "partial_rotary_factor": 0.25
    }))
    .expect("tiny qwen")
}

/// SSM bytes of one sequence of the whole model `c` on one GPU (a `plan-memory` row's).
fn ssm_bytes(c: &ModelConfig, form: DecodeForm, t: usize, o: &PlanOptions) -> u64 {
    let threshold = o.kv_only_threshold.unwrap_or_else(|| kv_only_threshold(c));
    MemoryShare::whole(c).ssm_bytes(form, t, o, threshold)
}

/// Attention KV bytes of `context` tokens of the whole model `c` in blocks of `block`, activations of `act` bytes.
fn kv_bytes(c: &ModelConfig, context: usize, block: usize, act: u64) -> u64 {
    let o = PlanOptions {
        kv_block_size: block,
        act_bytes: act,
        ..opts(0, context)
    };
    MemoryShare::whole(c).kv_bytes(&o)
}

/// Attention KV bytes per token of the whole model `c`, activations of `act` bytes.
fn kv_bytes_per_token(c: &ModelConfig, act: u64) -> u64 {
    MemoryShare::whole(c).kv_values_per_token * act
}

fn opts(t: usize, context: usize) -> PlanOptions {
    PlanOptions {
        spec_window: t,
        buffer_len: 4,
        context,
        kv_block_size: 16,
        kv_only_threshold: None,
        act_bytes: ACT_BYTES,
    }
}

#[test]
fn mamba2_bytes_by_hand() {
    let c = tiny_nemotron();
    // State 2·4·8 fp32 = 256 B. Conv row (8 + 2·8) bf16 = 48 B, K − 1 = 3 rows = 144 B.
    // Ring entry: x 8 bf16 (16) + dt 2 fp32 (8) + B 8 bf16 (16) = 40 B.
    let o = opts(2, 20);
    assert_eq!(ssm_bytes(&c, DecodeForm::Recurrent, 0, &o), 256 + 144);
    assert_eq!(ssm_bytes(&c, DecodeForm::Recurrent, 2, &o), 3 * 400);
    // Replay, L = 4, T = 2: 256 + 4·40 + (3 + 2)·48.
    assert_eq!(ssm_bytes(&c, DecodeForm::Replay, 2, &o), 656);
    assert_eq!(ssm_bytes(&c, DecodeForm::Replay, 0, &o), 256 + 160 + 144);
    // kv-only, threshold = state dim 8. Context 20 ≥ 8: 256 + (8 + 2)·40 + 240. Context 5: (5 + 2)·40 + 240.
    assert_eq!(kv_only_threshold(&c), 8);
    assert_eq!(ssm_bytes(&c, DecodeForm::KvOnly, 2, &o), 896);
    assert_eq!(ssm_bytes(&c, DecodeForm::KvOnly, 2, &opts(2, 5)), 520);
    // A ring L = 16 longer than threshold + T = 10: the switch continues in replay with L entries.
    let long = PlanOptions {
        buffer_len: 16,
        ..opts(2, 20)
    };
    assert_eq!(ssm_bytes(&c, DecodeForm::KvOnly, 2, &long), 256 + 16 * 40 + 240);
    // KV: 1 head × 4, K and V bf16 = 16 B per token; 20 tokens take 2 blocks of 16.
    assert_eq!(kv_bytes_per_token(&c, ACT_BYTES), 16);
    assert_eq!(kv_bytes(&c, 20, 16, ACT_BYTES), 512);
    assert_eq!(kv_bytes(&c, 16, 16, ACT_BYTES), 256);
    assert_eq!(kv_bytes(&c, 0, 16, ACT_BYTES), 0);
    // Weights: embed 80 + head 80 + final norm 8; Mamba block 8 + in_proj 34·8 + conv 24·4 + 24 + 3·2 + 8 + 8·8;
    // attention block 8 + (8 + 4 + 4)·8 + 8·8; MLP block 8 + 2·16·8.
    assert_eq!(parameter_count(&c), 168 + 478 + 200 + 264);
    assert_eq!(weight_bytes(&c), 2220);
}

#[test]
fn gdn_bytes_by_hand() {
    let c = tiny_qwen();
    // State 2·3·4 fp32 = 96 B. Conv row (2·4 + 6) bf16 = 28 B, 3 rows = 84 B.
    // Ring entry: u 6 bf16 (12) + k 4 bf16 (8) + g 2 fp32 (8) = 28 B.
    let o = opts(4, 100);
    assert_eq!(ssm_bytes(&c, DecodeForm::Recurrent, 0, &o), 180);
    assert_eq!(ssm_bytes(&c, DecodeForm::Recurrent, 4, &o), 5 * 180);
    assert_eq!(ssm_bytes(&c, DecodeForm::Replay, 4, &o), 96 + 4 * 28 + 7 * 28);
    // KV: 1 head × 8 → 32 B per token; 100 tokens → 112.
    assert_eq!(kv_bytes(&c, 100, 16, ACT_BYTES), 112 * 32);
    // Weights: embed 80 (tied) + final norm 8; GDN block 8 + (14 + 6 + 4)·8 + 14·4 + 2·2 + 3 + 8·6;
    // attention block 8 + (32 + 8 + 8)·8 + 8·16 + 2·8; MLP blocks 8 + 3·16·8 (two per layer: after GDN, after attention).
    let gdn = 8 + 192 + 56 + 4 + 3 + 48;
    let attn = 8 + 384 + 128 + 16;
    let mlp = 8 + 384;
    assert_eq!(parameter_count(&c), 88 + gdn + attn + 2 * mlp);
}

#[test]
fn f32_activations_widen_conv_rows_ring_vectors_and_kv() {
    let f32_opts = |t, context| PlanOptions {
        act_bytes: 4,
        ..opts(t, context)
    };
    let c = tiny_nemotron();
    // State 256 B either way. Conv row 24 f32 = 96 B, 3 rows = 288 B.
    assert_eq!(ssm_bytes(&c, DecodeForm::Recurrent, 0, &f32_opts(2, 20)), 256 + 288);
    // Ring entry: x 8 f32 (32) + dt 2 fp32 (8, as in bf16) + B 8 f32 (32) = 72 B. Replay, L = 4, T = 2.
    assert_eq!(
        ssm_bytes(&c, DecodeForm::Replay, 2, &f32_opts(2, 20)),
        256 + 4 * 72 + 5 * 96
    );
    // KV: 1 head × 4, K and V f32 = 32 B per token.
    assert_eq!(kv_bytes_per_token(&c, 4), 32);
    assert_eq!(kv_bytes(&c, 20, 16, 4), 2 * kv_bytes(&c, 20, 16, ACT_BYTES));
    let c = tiny_qwen();
    // State 96 B; conv row 14 f32 = 56 B, 3 rows = 168 B; ring entry u 6 f32 (24) + k 4 f32 (16) + g 2 fp32 (8).
    assert_eq!(ssm_bytes(&c, DecodeForm::Recurrent, 0, &f32_opts(4, 100)), 96 + 168);
    assert_eq!(
        ssm_bytes(&c, DecodeForm::Replay, 4, &f32_opts(4, 100)),
        96 + 4 * 48 + 7 * 56
    );
    // The weights do not depend on the activation type.
    let bf16 = plan_memory(&c, 1 << 30, &opts(1, 100)).expect("bf16 plan");
    let f32 = plan_memory(&c, 1 << 30, &f32_opts(1, 100)).expect("f32 plan");
    assert_eq!(bf16.weights_bytes, f32.weights_bytes);
    assert!(f32
        .forms
        .iter()
        .zip(&bf16.forms)
        .all(|(a, b)| a.ssm_bytes > b.ssm_bytes));
    let zero = PlanOptions {
        act_bytes: 0,
        ..opts(1, 100)
    };
    assert!(plan_memory(&c, 1 << 30, &zero).is_err());
}

/// Tiny, small and real-shape models of both families.
fn model_configs() -> Vec<ModelConfig> {
    let mut configs = vec![tiny_nemotron(), tiny_qwen()];
    for (family, preset) in [(Family::NemotronH, "nemotron-h-8b"), (Family::Qwen35, "qwen3.5-4b")] {
        let json = preset_config(family, preset, None, 0, 1, 2).expect("preset");
        configs.push(ModelConfig::from_json(&json).expect("parse"));
    }
    configs
}

#[test]
fn gpu_pool_planning_agrees_with_the_plan() {
    let block = DEFAULT_KV_BLOCK_SIZE;
    for c in model_configs() {
        let layers: Vec<LayerValues> = c
            .layers
            .iter()
            .flatten()
            .map(|b| LayerValues::of_block(&b.kind))
            .collect();
        for act in [ACT_BYTES, 4] {
            let o = PlanOptions {
                act_bytes: act,
                ..opts(0, block)
            };
            // What `gpu::state::state_bytes` reserves per slot and per KV block: without rings the recurrent row of
            // the plan, with them (every form at once) the kv-only row past its threshold, and one block of KV.
            let (per_slot, per_block) = pool_bytes(layers.iter().copied(), block, act, SlotRows::default());
            assert_eq!(
                per_slot,
                ssm_bytes(&c, DecodeForm::Recurrent, 0, &o),
                "{} act {act}",
                c.summary()
            );
            let t = 4;
            let threshold = kv_only_threshold(&c);
            let rows = SlotRows {
                ring: o.buffer_len.max(threshold + t),
                conv_extra: t,
                snapshots: 0,
            };
            let past = PlanOptions {
                context: threshold + 1,
                ..o.clone()
            };
            assert_eq!(
                pool_bytes(layers.iter().copied(), block, act, rows).0,
                ssm_bytes(&c, DecodeForm::KvOnly, t, &past),
                "{} act {act}, every form",
                c.summary()
            );
            // A rank started for speculation adds `T` fp32 state snapshots per slot (the recurrent baseline).
            let states: u64 = layers.iter().map(|v| v.state as u64 * STATE_BYTES).sum();
            assert_eq!(
                pool_bytes(layers.iter().copied(), block, act, SlotRows { snapshots: t, ..rows }).0,
                pool_bytes(layers.iter().copied(), block, act, rows).0 + t as u64 * states,
                "{} act {act}, snapshots",
                c.summary()
            );
            assert_eq!(per_block, kv_bytes(&c, block, block, act), "{} act {act}", c.summary());
        }
        // The allocator's element counts times the element sizes are the plan's bytes, layer by layer.
        for d in ssm_layers(&c) {
            let v = LayerValues::ssm(&d);
            for act in [ACT_BYTES, 4] {
                let o = PlanOptions {
                    buffer_len: 0,
                    act_bytes: act,
                    ..opts(0, 0)
                };
                assert_eq!(
                    v.state as u64 * STATE_BYTES + v.conv as u64 * act,
                    v.sequence_bytes(DecodeForm::Recurrent, 0, &o, 0)
                );
                assert_eq!(
                    v.slot_bytes(act, SlotRows::default()),
                    v.state_bytes() + v.conv_history_bytes(act)
                );
            }
        }
    }
}

/// The element counts `gpu::layers` derives for a rank's blocks from its tensor-parallel split (the conv width from
/// the heads and the B/C or key groups the rank holds), against the memory model's counts from the rank-local spec.
#[test]
fn layer_values_match_the_device_layout_of_every_rank() {
    for c in model_configs() {
        let mut ranks = 0;
        for tp in [1, 2, 4] {
            for rank in 0..tp {
                let plan = match RankPlan::new(&c, tp, rank, &|_| false) {
                    Ok(plan) => plan,
                    // A split the model's head counts or vocabulary do not allow.
                    Err(_) if tp > 1 => continue,
                    Err(e) => panic!("{}: {e}", c.summary()),
                };
                ranks += 1;
                for b in &plan.blocks {
                    let device = match (&b.kind, &b.shard) {
                        (BlockKind::Mamba2(s), ShardKind::Mamba2 { split, .. }) => LayerValues {
                            state: s.heads * s.head_dim * s.state_dim,
                            conv: (s.conv_kernel - 1) * (s.heads * s.head_dim + 2 * split.groups.len() * s.state_dim),
                            kv_per_token: 0,
                            ..LayerValues::default()
                        },
                        (BlockKind::Gdn(s), ShardKind::Gdn(split)) => LayerValues {
                            state: s.v_heads * s.v_head_dim * s.k_head_dim,
                            conv: (s.conv_kernel - 1)
                                * (2 * split.groups.len() * s.k_head_dim + s.v_heads * s.v_head_dim),
                            kv_per_token: 0,
                            ..LayerValues::default()
                        },
                        (BlockKind::Attention(a), _) => LayerValues {
                            kv_per_token: 2 * a.kv_heads * a.head_dim,
                            ..LayerValues::default()
                        },
                        _ => LayerValues::default(),
                    };
                    let v = LayerValues::of_block(&b.kind);
                    assert_eq!(
                        (v.state, v.conv, v.kv_per_token),
                        (device.state, device.conv, device.kv_per_token),
                        "{} tp {tp} rank {rank} {}",
                        c.summary(),
                        b.prefix
                    );
                }
            }
        }
        assert!(ranks >= 3, "{}: no tensor-parallel split was checked", c.summary());
    }
}

#[test]
fn plan_counts_sequences_and_ratios() {
    let c = tiny_nemotron();
    // Replay at T = 2, context 20: 656 + 512 = 1168 B per sequence; leave room for 10 and a bit.
    let budget = 2220 + 10 * 1168 + 1000;
    let p = plan_memory(&c, budget, &opts(2, 20)).expect("plan");
    let row = |f: DecodeForm, t: usize| {
        p.forms
            .iter()
            .find(|r| r.form == f && r.spec_window == t)
            .unwrap_or_else(|| panic!("row {f:?} {t}"))
    };
    let names: Vec<_> = p.forms.iter().map(|r| (r.name(), r.spec_window)).collect();
    assert_eq!(
        names,
        [
            ("recurrent", 0),
            ("spec-baseline", 2),
            ("replay", 0),
            ("replay", 2),
            ("kv-only", 0),
            ("kv-only", 2)
        ]
    );
    let replay = row(DecodeForm::Replay, 2);
    assert_eq!((replay.bytes_per_sequence, replay.max_sequences), (1168, 10));
    let base = row(DecodeForm::Recurrent, 2);
    assert_eq!(base.bytes_per_sequence, 1200 + 512);
    assert_eq!(base.max_sequences, (10 * 1168 + 1000) / 1712);
    assert_eq!(base.vs_baseline, Some(1.0));
    let want = 10.0 / base.max_sequences as f64;
    assert!((replay.vs_baseline.expect("ratio") - want).abs() < 1e-12);
    assert_eq!(p.weights_bytes, 2220);
    assert!(p.notes.iter().any(|n| n.contains("kv-only")), "{:?}", p.notes);
}

#[test]
fn weights_over_budget_fit_nothing() {
    let c = tiny_nemotron();
    let p = plan_memory(&c, 2000, &opts(0, 20)).expect("plan");
    assert!(p.forms.iter().all(|f| f.max_sequences == 0 && f.vs_baseline.is_none()));
    assert!(p.notes[0].contains("exceed the budget"), "{:?}", p.notes);
    assert_eq!(p.forms.len(), 3, "no speculative rows at T = 0");
    assert_eq!(max_sequences(100, 100, 7), 0);
    assert_eq!(max_sequences(100, 30, 7), 10);
    assert_eq!(max_sequences(100, 30, 0), 0);
}

#[test]
fn plan_rejects_bad_options() {
    let c = tiny_nemotron();
    let mut o = opts(4, 20);
    let e = plan_memory(&c, 1 << 30, &o).unwrap_err().to_string();
    assert!(e.contains("--buffer-len 4") && e.contains("--spec-window 4"), "{e}");
    o.buffer_len = 16;
    o.kv_block_size = 0;
    assert!(plan_memory(&c, 1 << 30, &o)
        .unwrap_err()
        .to_string()
        .contains("block size"));
}

#[test]
fn parameter_count_matches_the_checkpoint_layout() {
    // Every tiny and small preset: the closed form equals the element count of the tensors a checkpoint holds.
    for p in PRESETS
        .iter()
        .filter(|p| matches!(p.name, "tiny" | "tiny-latent" | "small"))
    {
        let json = preset_config(p.family, p.name, None, tokenizer_vocab(p.name), 1, 2).expect("preset");
        let c = ModelConfig::from_json(&json).expect("parse");
        let counted: u64 = plan_tensors(&c)
            .expect("plan tensors")
            .values()
            .map(|s| s.iter().product::<usize>() as u64)
            .sum();
        assert_eq!(parameter_count(&c), counted, "{} {}", p.family.name(), p.name);
    }
}

#[test]
fn real_shapes_state_sizes() {
    // targets.md: a Nemotron-H-8B Mamba-2 layer holds 128·64·128 fp32 = 4 MiB of state; 24 such layers.
    let c = ModelConfig::from_json(&preset_config(Family::NemotronH, "nemotron-h-8b", None, 0, 1, 2).expect("8b"))
        .expect("parse");
    let o = opts(0, 0);
    let conv = 24 * 3 * (8192 + 2 * 8 * 128) * 2;
    assert_eq!(ssm_bytes(&c, DecodeForm::Recurrent, 0, &o), 24 * (4 << 20) + conv);
    let params = parameter_count(&c) as f64 / 1e9;
    assert!((7.5..8.5).contains(&params), "{params}B parameters");
    // Qwen3.5-4B: 24 GDN layers of 32 × 128 × 128 fp32 = 2 MiB each.
    let c = ModelConfig::from_json(&preset_config(Family::Qwen35, "qwen3.5-4b", None, 0, 1, 2).expect("4b"))
        .expect("parse");
    let conv = 24 * 3 * (2 * 16 * 128 + 32 * 128) * 2;
    assert_eq!(ssm_bytes(&c, DecodeForm::Recurrent, 0, &o), 24 * (2 << 20) + conv);
}

#[test]
fn budgets_parse() {
    assert_eq!(parse_bytes("70GiB").expect("GiB"), 70 << 30);
    assert_eq!(parse_bytes("70GB").expect("GB"), 70_000_000_000);
    assert_eq!(parse_bytes("512MiB").expect("MiB"), 512 << 20);
    assert_eq!(parse_bytes("123456").expect("bytes"), 123_456);
    assert_eq!(parse_bytes(" 1.5 gib ").expect("fraction"), 3 << 29);
    assert_eq!(parse_bytes("2TiB").expect("TiB"), 2 << 40);
    assert_eq!(parse_bytes("10B").expect("B"), 10);
    for (bad, why) in [
        ("", "expected a number"),
        ("GiB", "expected a number"),
        ("70XB", "unknown unit `XB`"),
        ("-5GiB", "must be positive"),
        ("-0", "must be positive"),
        ("0", "positive"),
        ("0.1B", "positive"),
        ("1.2.3GB", "malformed"),
        ("99999999999999999999999GiB", "too large"),
        ("7e9", "unknown unit"),
    ] {
        let e = parse_bytes(bad).unwrap_err().to_string();
        assert!(e.contains(why) && e.contains(&format!("`{bad}`")), "{bad}: {e}");
    }
}

#[test]
fn bytes_format() {
    assert_eq!(format_bytes(512), "512 B");
    assert_eq!(format_bytes(3 << 19), "1.50 MiB");
    assert_eq!(format_bytes(70 << 30), "70.00 GiB");
}
