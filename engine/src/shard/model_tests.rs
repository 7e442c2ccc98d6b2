//! Sharded forward vs single-rank forward on random in-memory checkpoints that the fixtures do not cover: projection,
//! conv and MLP biases (row-parallel biases added once), and the fused expert layouts (`experts.up_proj`,
//! `experts.gate_up_proj`, `experts.down_proj`); and vocabulary summaries against the single-rank logits.

use serde_json::{json, Value};

use super::{summarise, LocalComm, RankPlan, ShardedModel, VocabSummary};
use crate::init::plan_tensors;
use crate::model::mixers::ffn::tests::{random, MapSource};
use crate::model::{Family, Logits, Model, ModelConfig};
use crate::presets::preset_config;

/// One expert's projection: (expert, gate-before-up order, shape, data).
type ExpertPart = (usize, usize, Vec<usize>, Vec<f32>);

/// A checkpoint of `config` with seeded random weights; with `fused`, per-expert tensors are stacked into the fused
/// layout transformers keeps in memory.
fn checkpoint(config: &ModelConfig, fused: bool) -> MapSource {
    let mut src = MapSource::default();
    let tensors = plan_tensors(config).expect("tensor list");
    let data = |i: usize, name: &str, len: usize| -> Vec<f32> {
        let r = random(len, 1000 + i as u64, 0.25);
        if name.ends_with("norm.weight") || name.ends_with("layernorm.weight") {
            r.iter().map(|v| 1.0 + v).collect()
        } else {
            r
        }
    };
    let mut stacked: std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)> = Default::default();
    for (i, (name, shape)) in tensors.iter().enumerate() {
        let values = data(i, name, shape.iter().product());
        let expert = name.split_once(".experts.").and_then(|(prefix, rest)| {
            let (x, proj) = rest.split_once('.')?;
            Some((prefix, x.parse::<usize>().ok()?, proj))
        });
        match expert {
            Some((prefix, _, proj)) if fused => {
                // Collected per fused tensor and sorted by expert index below (map order is lexicographic).
                let fused_name = match proj {
                    "down_proj.weight" => "down_proj",
                    _ => "up",
                };
                let key = format!("{prefix}.experts.{fused_name}|{name}");
                stacked.insert(key, (shape.clone(), values));
            }
            _ => src.insert(name, shape, values),
        }
    }
    if fused {
        // Group by fused tensor, in numeric expert order; gate rows before up rows for SwiGLU.
        let mut groups: std::collections::BTreeMap<String, Vec<ExpertPart>> = Default::default();
        for (key, (shape, values)) in stacked {
            let (fused_name, name) = key.split_once('|').expect("key");
            let rest = name.split_once(".experts.").expect("expert").1;
            let (x, proj) = rest.split_once('.').expect("proj");
            let order = usize::from(proj.starts_with("up_proj"));
            let x: usize = x.parse().expect("index");
            groups
                .entry(fused_name.to_string())
                .or_default()
                .push((x, order, shape, values));
        }
        assert!(!groups.is_empty(), "no experts to fuse");
        for (fused_name, mut parts) in groups {
            parts.sort_by_key(|p| (p.0, p.1));
            let experts = parts.iter().map(|p| p.0).max().expect("experts") + 1;
            let per = parts.len() / experts;
            let (rows, cols) = (parts[0].2[0] * per, parts[0].2[1]);
            let name = match (fused_name.ends_with(".up"), per) {
                (true, 2) => fused_name.replace(".up", ".gate_up_proj"),
                (true, _) => fused_name.replace(".up", ".up_proj"),
                (false, _) => fused_name,
            };
            let data: Vec<f32> = parts.into_iter().flat_map(|p| p.3).collect();
            src.insert(&name, &[experts, rows, cols], data);
        }
    }
    src
}

const TOKENS: [u32; 9] = [5, 17, 3, 42, 8, 29, 11, 60, 2];

/// Logits per position: a prefill of 6 tokens, then 3 decode steps.
fn run(forward: &mut dyn FnMut(&[u32], Logits) -> Vec<f32>, vocab: usize) -> Vec<Vec<f32>> {
    let tokens = TOKENS;
    let mut rows: Vec<Vec<f32>> = forward(&tokens[..6], Logits::All)
        .chunks(vocab)
        .map(<[f32]>::to_vec)
        .collect();
    for &t in &tokens[6..] {
        rows.push(forward(&[t], Logits::Last));
    }
    rows
}

fn rel(got: &[f32], want: &[f32]) -> f32 {
    let max = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    got.iter().zip(want).fold(0.0f32, |m, (g, w)| m.max((g - w).abs())) / max
}

fn check(label: &str, json: &Value, fused: bool, tps: &[usize]) {
    let config = ModelConfig::from_json(json).expect("config");
    let vocab = config.vocab_size;
    let model = Model::load(config.clone(), &mut checkpoint(&config, fused)).expect("load");
    let mut state = model.new_state();
    let want = run(&mut |t, w| model.forward(t, &mut state, w).expect("forward"), vocab);
    for &tp in tps {
        RankPlan::new(&config, tp, 0, &|_| false).unwrap_or_else(|e| panic!("{label} tp {tp}: {e}"));
        let got: Vec<(Vec<Vec<f32>>, Vec<VocabSummary>)> = std::thread::scope(|s| {
            let handles: Vec<_> = LocalComm::group(tp)
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    let config = config.clone();
                    s.spawn(move || {
                        let mut src = checkpoint(&config, fused);
                        let m = ShardedModel::load(config, tp, rank, &mut src).expect("sharded load");
                        src.assert_all_taken();
                        let mut st = m.new_state();
                        let logits = run(&mut |t, w| m.forward(t, &mut st, w, &comm).expect("forward"), vocab);
                        let mut st = m.new_state();
                        let local = m.forward_local(&TOKENS, &mut st, Logits::All, &comm).expect("local");
                        (logits, summarise(&local, &m.plan().vocab, &comm).expect("summarise"))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        for (pos, (g, w)) in got[0].0.iter().zip(&want).enumerate() {
            let e = rel(g, w);
            assert!(e < 1e-4, "{label} tp {tp} position {pos}: {e:e}");
        }
        // Summaries of the vocabulary slices agree with the single-rank logits of every position.
        let mut state = model.new_state();
        let full = model.forward(&TOKENS, &mut state, Logits::All).expect("forward");
        for (rank, (_, summaries)) in got.iter().enumerate() {
            assert_eq!(summaries, &got[0].1, "{label} tp {tp}: rank {rank} summary differs");
        }
        for (row, s) in full.chunks_exact(vocab).zip(&got[0].1) {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
            let arg = row.iter().position(|v| *v == max).expect("max");
            let lse = max as f64 + row.iter().map(|v| ((v - max) as f64).exp()).sum::<f64>().ln();
            assert_eq!(s.argmax as usize, arg, "{label} tp {tp}: argmax");
            assert!(
                (s.log_sum_exp as f64 - lse).abs() < 1e-4 * lse.abs().max(1.0),
                "{label} tp {tp}: {s:?} vs {lse}"
            );
            assert!((s.max_logit - max).abs() <= 1e-4 * max.abs().max(1.0));
        }
    }
}

#[test]
fn biases_and_fused_experts_match_single_rank() {
    let nemotron = json!({
        "model_type": "nemotron_h", "hidden_size": 32, "vocab_size": 70, "hybrid_override_pattern": "M*-E",
        "mamba_num_heads": 12, "mamba_head_dim": 4, "ssm_state_size": 8, "n_groups": 3, "conv_kernel": 4,
        "use_bias": true, "use_conv_bias": true, "mlp_bias": true, "chunk_size": 4,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 40,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 20,
        "moe_shared_expert_intermediate_size": 24, "n_group": 2, "topk_group": 1, "eos_token_id": [2]
    });
    for fused in [false, true] {
        check("nemotron-h with biases", &nemotron, fused, &[2, 3, 4, 5]);
    }
    let qwen = preset_config(Family::Qwen3Next, "tiny", None, 70, 1, 2).expect("preset");
    let max_tp = (1..=8)
        .filter(|&tp| {
            let config = ModelConfig::from_json(&qwen).expect("config");
            RankPlan::new(&config, tp, 0, &|_| false).is_ok()
        })
        .max()
        .expect("tp 1");
    let tps: Vec<usize> = (2..=max_tp.min(5)).collect();
    assert!(tps.len() >= 2, "qwen3-next tiny splits only up to {max_tp}");
    check("qwen3-next tiny, fused gate_up", &qwen, true, &tps);
}
