//! Tensor-parallel decoders vs the single-rank recurrent decoder on random in-memory checkpoints that the fixtures do
//! not cover: projection, conv and MLP biases (row-parallel biases added once), and the fused expert layouts
//! (`experts.up_proj`, `experts.gate_up_proj`, `experts.down_proj`). Every rank loads its shard from the whole
//! checkpoint (taking every tensor) and runs a replay decoder on its own thread; the ranks' joined vocabulary slices
//! and their merged summaries match the TP = 1 logits.

use std::ops::Range;
use std::sync::Arc;

use serde_json::{json, Value};

use super::{LocalComm, RankPlan, ShardedModel};
use crate::decode::{Decoder, DecoderConfig, FormChoice};
use crate::init::plan_tensors;
use crate::model::mixers::ffn::tests::{random, MapSource};
use crate::model::{Family, ModelConfig};
use crate::presets::preset_config;
use crate::rank::vocab::{join_slices, merge_rows, summarise_row};
use crate::rank::Rows;

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

const TOKENS: [u32; 12] = [5, 17, 3, 42, 8, 29, 11, 60, 2, 33, 14, 7];
/// Prompt tokens; the rest are decoded, verified and committed.
const PROMPT: usize = 6;
/// Drafts of the one verify, and how many of them are accepted.
const DRAFTS: usize = 2;
const ACCEPTED: usize = 1;

/// The decoder sizes every rank runs with: a ring of 4 with verify windows of 2, so that the third decode flushes.
fn decoder_config() -> DecoderConfig {
    DecoderConfig {
        buffer_len: 4,
        max_verify: DRAFTS,
        ..DecoderConfig::new(1, 32)
    }
}

/// One sequence in `form`: a prefill of `PROMPT` tokens (every row), 3 decodes, a verify of `DRAFTS` tokens of which
/// `ACCEPTED` are committed, and one decode. Returns the rank's logit rows `[rows, slice]` in that order (12 rows).
fn run(dec: &mut Decoder, form: FormChoice) -> Vec<f32> {
    let slot = dec.start(form).expect("slot");
    let mut out = dec.prefill(slot, &TOKENS[..PROMPT], Rows::All).expect("prefill");
    for &t in &TOKENS[PROMPT..PROMPT + 3] {
        out.extend(dec.decode(&[(slot, t)]).expect("decode"));
    }
    let drafts = &TOKENS[PROMPT + 3..PROMPT + 3 + DRAFTS];
    out.extend(dec.verify(slot, drafts).expect("verify"));
    dec.commit(slot, ACCEPTED).expect("commit");
    out.extend(dec.decode(&[(slot, TOKENS[PROMPT + 3 + DRAFTS])]).expect("decode"));
    assert_eq!(dec.position(slot).expect("position"), PROMPT + 3 + ACCEPTED + 1);
    out
}

const ROWS: usize = PROMPT + 3 + DRAFTS + 1;

fn rel(got: &[f32], want: &[f32]) -> f32 {
    let max = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    got.iter().zip(want).fold(0.0f32, |m, (g, w)| m.max((g - w).abs())) / max
}

fn check(label: &str, json: &Value, fused: bool, tps: &[usize]) {
    let config = ModelConfig::from_json(json).expect("config");
    let vocab = config.vocab_size;
    // The oracle: the whole model as one rank, in the recurrent form.
    let mut src = checkpoint(&config, fused);
    let single = ShardedModel::load(config.clone(), 1, 0, &mut src).expect("load");
    src.assert_all_taken();
    assert_eq!(
        single.plan().vocab,
        0..vocab,
        "{label}: one rank holds the whole vocabulary"
    );
    let mut dec = Decoder::single(single, decoder_config()).expect("decoder");
    let want = run(&mut dec, FormChoice::Recurrent);
    assert_eq!(want.len(), ROWS * vocab);
    for &tp in tps {
        RankPlan::new(&config, tp, 0, &|_| false).unwrap_or_else(|e| panic!("{label} tp {tp}: {e}"));
        let got: Vec<(Range<usize>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = LocalComm::group(tp)
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    let config = config.clone();
                    s.spawn(move || {
                        let mut src = checkpoint(&config, fused);
                        let m = ShardedModel::load(config, tp, rank, &mut src).expect("sharded load");
                        src.assert_all_taken();
                        assert_eq!((m.plan().tp, m.plan().rank), (tp, rank));
                        let range = m.plan().vocab.clone();
                        let mut dec =
                            Decoder::new(Arc::new(m), Box::new(comm), decoder_config()).expect("rank decoder");
                        let logits = run(&mut dec, FormChoice::Replay);
                        assert_eq!(logits.len(), ROWS * range.len(), "rank {rank}: its slice's rows");
                        (range, logits)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        let ranges: Vec<Range<usize>> = got.iter().map(|(r, _)| r.clone()).collect();
        assert_eq!(
            ranges,
            (0..tp).map(|r| super::even_split(vocab, tp, r)).collect::<Vec<_>>()
        );
        let parts: Vec<&[f32]> = got.iter().map(|(_, l)| l.as_slice()).collect();
        let joined = join_slices(&parts, &ranges, ROWS, vocab).expect("join");
        for (row, (g, w)) in joined.chunks_exact(vocab).zip(want.chunks_exact(vocab)).enumerate() {
            let e = rel(g, w);
            assert!(e < 1e-4, "{label} tp {tp} row {row}: {e:e}");
            // The ranks' summaries of their slices merge into the single-rank row's.
            let summaries: Vec<_> = got
                .iter()
                .map(|(r, l)| summarise_row(&l[row * r.len()..(row + 1) * r.len()], r.start))
                .collect();
            let merged = merge_rows(&summaries).expect("merge");
            let whole = summarise_row(w, 0);
            assert_eq!(merged.argmax, whole.pass.argmax, "{label} tp {tp} row {row}: argmax");
            let (m, w) = (merged.max, whole.pass.max);
            assert!((m - w).abs() <= 1e-4 * w.abs().max(1.0));
            let (lse, want_lse) = (merged.lse, whole.pass.lse);
            assert!(
                (lse - want_lse).abs() <= 1e-4 * want_lse.abs().max(1.0),
                "{label} tp {tp} row {row}: log-sum-exp {lse} vs {want_lse}"
            );
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
