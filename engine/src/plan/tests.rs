//! Tests of the plan: its byte terms against the allocators' own sizes, bad inputs, and the calibration.

use super::calibration::{self, MEASUREMENTS};
use super::projection::{project, tokens_per_verify, Batch, PlanInput};
use super::{FormRow, GpuProfile, PlanError, RankModel};
use crate::model::ModelConfig;
use crate::presets::{preset_config, tokenizer_vocab, PRESETS};
use crate::shard::RankPlan;
use crate::state::memory::{
    kv_only_threshold, pool_bytes, weight_bytes, LayerValues, MemoryShare, PlanOptions, SlotRows, ACT_BYTES,
};
use crate::state::DecodeForm;

fn preset(family: crate::model::Family, name: &str) -> ModelConfig {
    let json = preset_config(family, name, None, tokenizer_vocab(name), 1, 2).expect("preset");
    ModelConfig::from_json(&json).expect("parse")
}

fn every_preset() -> Vec<(String, ModelConfig)> {
    PRESETS
        .iter()
        .map(|p| (format!("{:?}/{}", p.family, p.name), preset(p.family, p.name)))
        .collect()
}

fn input(tp: usize, context: usize) -> PlanInput {
    PlanInput {
        tp,
        nodes: 1,
        replicas: 1,
        context,
        spec_window: 4,
        acceptance: 0.7,
        buffer_len: 16,
        kv_block_size: 16,
        memory_fraction: 0.9,
        act_bytes: ACT_BYTES,
        forms: FormRow::ALL.to_vec(),
        batches: vec![Batch::Fixed(1), Batch::Fixed(64), Batch::Fixed(256), Batch::Max],
        prefill_chunk: 512,
    }
}

/// A profile large enough that every preset fits at TP 1.
fn big_gpu() -> GpuProfile {
    GpuProfile {
        memory_gb: 100_000.0,
        ..GpuProfile::builtin("b300").expect("b300")
    }
}

#[test]
fn byte_terms_equal_the_allocators_sizes_for_every_preset_and_tp() {
    for (name, c) in every_preset() {
        // TP 1: the whole model's weights are `weight_bytes`, its state the memory model's, per form.
        let one = RankModel::new(&c, 1, 0).expect("tp 1");
        assert_eq!(one.weight_bytes, weight_bytes(&c), "{name}: weights at TP 1");
        let threshold = kv_only_threshold(&c);
        for tp in [1, 2, 4, 8] {
            let ranks = match RankModel::all(&c, tp) {
                Ok(r) => r,
                Err(PlanError::Sharding { .. }) if tp > 1 => continue,
                Err(e) => panic!("{name} tp {tp}: {e}"),
            };
            let context = 100.min(c.max_position_embeddings);
            let plan = project(&c, &big_gpu(), &input(tp, context)).expect("plan");
            for (r, m) in ranks.iter().zip(&plan.ranks) {
                // The rank's weights are the tensors its shard plan loads.
                let rp = RankPlan::new(&c, tp, r.rank, &|_| false).expect("rank plan");
                let elements: usize = rp.tensors().map(|t| t.local_shape().iter().product::<usize>()).sum();
                assert_eq!(m.weight_bytes, elements as u64 * 2, "{name} tp {tp} rank {}", r.rank);
                // What the GPU pools allocate per slot (every form at once: the kv-only row past its threshold) and
                // per KV block, through the same `pool_bytes` the GPU allocator calls.
                let t = 4;
                let rows = SlotRows {
                    ring: 16usize.max(threshold + t),
                    conv_extra: t,
                    snapshots: 0,
                };
                let layers = r
                    .ssm
                    .iter()
                    .map(LayerValues::ssm)
                    .chain(r.attention.iter().map(LayerValues::attention));
                let (per_slot, per_block) = pool_bytes(layers, 16, ACT_BYTES, rows);
                let past_threshold = PlanOptions {
                    spec_window: t,
                    buffer_len: 16,
                    context: threshold + 1,
                    kv_block_size: 16,
                    kv_only_threshold: Some(threshold),
                    act_bytes: ACT_BYTES,
                };
                let ssm_at_t: u64 = r
                    .ssm
                    .iter()
                    .map(|d| LayerValues::ssm(d).sequence_bytes(DecodeForm::KvOnly, t, &past_threshold, threshold))
                    .sum();
                assert_eq!(per_slot, ssm_at_t, "{name} tp {tp} rank {}: pool slot", r.rank);
                assert_eq!(
                    per_block,
                    16 * r.kv_values_per_token * ACT_BYTES,
                    "{name} tp {tp} rank {}: KV block",
                    r.rank
                );
            }
            if tp == 1 {
                // At TP 1 the per-form bytes are `plan-memory`'s.
                let opts = PlanOptions {
                    spec_window: 4,
                    buffer_len: 16,
                    context,
                    kv_block_size: 16,
                    kv_only_threshold: None,
                    act_bytes: ACT_BYTES,
                };
                let whole = MemoryShare::whole(&c);
                for (i, f) in plan.forms.iter().enumerate() {
                    assert_eq!(
                        plan.ranks[0].ssm_bytes_per_seq[i],
                        whole.ssm_bytes(f.form.form(), f.form.spec_window(4), &opts, threshold),
                        "{name} {:?}",
                        f.form
                    );
                }
                assert_eq!(plan.ranks[0].kv_bytes_per_seq, whole.kv_bytes(&opts), "{name} kv");
            }
        }
    }
}

#[test]
fn profiles_are_checked_and_errors_name_the_field() {
    for name in ["h100", "H200", "b200", "b300"] {
        GpuProfile::builtin(name).expect("built-in").validate().expect("valid");
    }
    let e = GpuProfile::builtin("a100").expect_err("unknown").to_string();
    assert!(e.contains("a100") && e.contains("b300"), "{e}");
    let missing = r#"{"name": "x", "memory_gb": 80, "hbm_tb_s": 3, "bf16_dense_tflops": 900}"#;
    let e = GpuProfile::from_json(missing).expect_err("missing").to_string();
    assert!(e.contains("nvlink_gb_s"), "{e}");
    let negative = r#"{"name": "x", "memory_gb": 80, "hbm_tb_s": -3, "bf16_dense_tflops": 900, "nvlink_gb_s": 450}"#;
    let e = GpuProfile::from_json(negative).expect_err("negative").to_string();
    assert!(e.contains("hbm_tb_s") && e.contains("positive"), "{e}");
    let typo =
        r#"{"name": "x", "memory_gb": 80, "hbm_tbs": 3, "hbm_tb_s": 3, "bf16_dense_tflops": 900, "nvlink_gb_s": 450}"#;
    let e = GpuProfile::from_json(typo).expect_err("unknown field").to_string();
    assert!(e.contains("hbm_tbs"), "{e}");
    let latency = r#"{"name": "x", "memory_gb": 80, "hbm_tb_s": 3, "bf16_dense_tflops": 900, "nvlink_gb_s": 450,
        "collective_latency_us": -1}"#;
    let e = GpuProfile::from_json(latency).expect_err("latency").to_string();
    assert!(e.contains("collective_latency_us"), "{e}");
}

#[test]
fn impossible_tp_and_contexts_are_errors() {
    let c = preset(crate::model::Family::NemotronH, "tiny");
    let e = project(&c, &big_gpu(), &input(1024, 100)).expect_err("tp too large");
    assert!(matches!(e, PlanError::Sharding { tp: 1024, .. }), "{e}");
    // The engine's own message names what the split exceeds.
    assert!(
        e.to_string().contains("--tp 1024") && e.to_string().contains("exceeds"),
        "{e}"
    );
    let e = project(&c, &big_gpu(), &input(1, c.max_position_embeddings + 1)).expect_err("context");
    assert!(e.to_string().contains("max_position_embeddings"), "{e}");
    // 8B on an H100 at a context whose KV alone exceeds the memory left.
    let big = preset(crate::model::Family::NemotronH, "nemotron-h-8b");
    let h100 = GpuProfile::builtin("h100").expect("h100");
    let mut tight = h100.clone();
    tight.memory_gb = 17.0;
    let e = project(&big, &tight, &input(1, 4096)).expect_err("weights do not fit");
    assert!(
        matches!(e, PlanError::DoesNotFit(_)) && e.to_string().contains("weights"),
        "{e}"
    );
    let mut tiny_gpu = h100;
    tiny_gpu.memory_gb = 18.1;
    let e = project(&big, &tiny_gpu, &input(1, big.max_position_embeddings)).expect_err("context does not fit");
    assert!(e.to_string().contains("does not fit"), "{e}");
    let e = project(
        &big,
        &big_gpu(),
        &PlanInput {
            nodes: 3,
            ..input(2, 100)
        },
    )
    .expect_err("nodes");
    assert!(e.to_string().contains("--nodes"), "{e}");
}

#[test]
fn batches_above_the_fit_are_flagged_and_max_is_the_fit() {
    let c = preset(crate::model::Family::NemotronH, "nemotron-h-8b");
    let h100 = GpuProfile::builtin("h100").expect("h100");
    let plan = project(&c, &h100, &input(1, 8192)).expect("plan");
    for f in &plan.forms {
        let rows: Vec<_> = plan.decode.iter().filter(|s| s.form == f.form).collect();
        let max = rows.iter().find(|s| s.is_max).expect("max row");
        assert_eq!(max.batch, f.max_sequences);
        assert!(max.flag.is_none());
        for s in rows.iter().filter(|s| !s.is_max) {
            assert_eq!(s.flag.is_some(), s.batch > f.max_sequences, "{:?} {}", f.form, s.batch);
        }
    }
}

#[test]
fn step_terms_add_up() {
    let c = preset(crate::model::Family::NemotronH, "nemotron-h-8b");
    let h100 = GpuProfile::builtin("h100").expect("h100");
    let plan = project(&c, &h100, &input(2, 1024)).expect("plan");
    for s in &plan.decode {
        let total = s.dense_weight_bytes + s.expert_bytes + s.ssm_bytes + s.kv_bytes;
        assert!((total - s.total_bytes).abs() <= 1e-6 * total);
        assert!((s.step_ms - (s.hbm_ms.max(s.compute_ms) + s.all_reduce_ms)).abs() < 1e-9);
        assert!(s.all_reduce_ms > 0.0 && s.all_reduces == 1 + c.num_blocks());
    }
    // Replay moves fewer state bytes than recurrent at any batch.
    let at = |f: FormRow| {
        plan.decode
            .iter()
            .find(|s| s.form == f && s.batch == 64)
            .expect("row")
            .ssm_bytes
    };
    assert!(at(FormRow::REPLAY) < at(FormRow::RECURRENT));
    assert!((tokens_per_verify(4, 0.5) - 1.9375).abs() < 1e-12);
    assert_eq!(tokens_per_verify(0, 0.7), 1.0);
}

#[test]
fn active_experts_follow_the_expected_distinct_count() {
    let c = preset(crate::model::Family::Qwen35Moe, "qwen3.5-35b-a3b");
    let r = RankModel::new(&c, 1, 0).expect("rank");
    let l = r.moe.first().expect("moe layer");
    let (e, k) = (l.experts as f64, l.top_k as f64);
    assert!((l.active_experts(1.0) - k).abs() < 1e-9);
    let b = 64.0;
    assert!((l.active_experts(b) - e * (1.0 - (1.0 - k / e).powf(b))).abs() < 1e-9);
    assert!(l.active_experts(1e6) <= e);
    assert_eq!(
        l.expert_bytes * l.experts as u64 * r.moe.len() as u64,
        r.routed_expert_bytes
    );
}

#[test]
fn calibration_ratios_are_computed_for_every_measurement() {
    let table = calibration::table().expect("calibration");
    assert_eq!(table.len(), MEASUREMENTS.len());
    for row in table {
        assert!(row.ratio.is_finite() && row.ratio > 0.0, "{row:?}");
        // The engine is slower than its roofline, never faster by more than noise.
        assert!(row.ratio > 0.9, "{row:?}");
    }
    let a = calibration::apply(FormRow::RECURRENT, DecodeForm::Recurrent, 200, 10.0, 200.0).expect("applied");
    assert!(a.basis.contains("batch 256"), "{}", a.basis);
    let s = calibration::apply(FormRow::REPLAY_SPEC, DecodeForm::Replay, 1, 10.0, 2.0).expect("spec");
    assert!(
        s.basis.contains("replay") && s.basis.contains("not measured"),
        "{}",
        s.basis
    );
}
