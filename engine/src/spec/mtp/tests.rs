//! Tests of the MTP drafter on tiny random checkpoints written by `init-model --mtp`.

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rewind_kernels::cpu::gemm::linear;
use rewind_kernels::cpu::sample::argmax;

use super::*;
use crate::checkpoint::SafetensorsSource;
use crate::init::{init_model, InitOptions};
use crate::model::{Family, ModelConfig};
use crate::shard::ShardedModel;
use crate::spec::HiddenRows;

fn checkpoint(family: Family, layers: Option<usize>, mtp: bool) -> tempfile::TempDir {
    // Nemotron-H: the preset with Nemotron-3 Super's latent MoE, whose MTP layer is latent too.
    let preset = if family == Family::NemotronH {
        "tiny-latent"
    } else {
        "tiny"
    };
    let dir = tempfile::tempdir().expect("tempdir");
    init_model(&InitOptions {
        family,
        preset: preset.into(),
        layers,
        seed: 3,
        out: dir.path().to_path_buf(),
        dtype: None,
        mtp,
    })
    .expect("init-model");
    dir
}

/// `n` random hidden rows of width `h` (the scale of a residual stream).
fn rows(n: usize, h: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n * h).map(|_| rng.random_range(-2.0f32..2.0)).collect()
}

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

/// Proposes after `toks` with the hidden rows `hidden` of positions `position ..`.
fn propose(d: &mut MtpDrafter, toks: &[u32], position: usize, hidden: &[f32], max: usize) -> Result<Draft> {
    let h = d.weights().config().hidden_size;
    let rows = HiddenRows {
        position,
        hidden: h,
        rows: hidden.to_vec(),
    };
    d.propose(&DraftInput {
        tokens: toks,
        hidden: Some(&rows),
        max,
    })
}

/// Proposes after `toks` with no rows of its own (everything was observed).
fn proposed(d: &mut MtpDrafter, toks: &[u32], max: usize) -> Result<Draft> {
    d.propose(&DraftInput {
        tokens: toks,
        hidden: None,
        max,
    })
}

#[test]
fn init_model_mtp_round_trips_through_the_loaders() {
    for family in [Family::Qwen35, Family::Qwen3Next, Family::Qwen35Moe] {
        let dir = checkpoint(family, None, true);
        let config = ModelConfig::from_dir(dir.path()).expect("config");
        assert_eq!(config.mtp_layers, 1, "{family:?}");
        // The main model still loads: the mtp.* tensors are kept aside, not unexpected.
        ShardedModel::from_dir(dir.path(), 1, 0).expect("main model");
        let names = SafetensorsSource::open(dir.path()).expect("open").names();
        for n in [
            "mtp.fc.weight",
            "mtp.pre_fc_norm_embedding.weight",
            "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight",
            "mtp.layers.0.input_layernorm.weight",
            "mtp.layers.0.self_attn.q_proj.weight",
            "mtp.layers.0.self_attn.q_norm.weight",
            "mtp.layers.0.post_attention_layernorm.weight",
        ] {
            assert!(names.iter().any(|x| x == n), "{family:?}: {n} missing");
        }
        let moe = names.iter().any(|n| n.starts_with("mtp.layers.0.mlp.experts.0."));
        assert_eq!(moe, family != Family::Qwen35, "{family:?}: MTP FFN kind");
        let w = MtpWeights::load(dir.path()).expect("MTP weights");
        assert_eq!(w.config().vocab_size, config.vocab_size);
    }
    // Without --mtp nothing MTP is written.
    let dir = checkpoint(Family::Qwen35, None, false);
    assert_eq!(ModelConfig::from_dir(dir.path()).expect("config").mtp_layers, 0);
    let names = SafetensorsSource::open(dir.path()).expect("open").names();
    assert!(!names.iter().any(|n| n.starts_with("mtp.")));
}

/// Nemotron-3's published MTP layout (vLLM `nemotron_h_mtp.py`): pattern `*E` as layers `mtp.layers.0.` (attention,
/// with `eh_proj`, `enorm`, `hnorm`) and `mtp.layers.1.` (latent MoE, with `final_layernorm`).
#[test]
fn nemotron_mtp_round_trips_in_the_published_layout() {
    let dir = checkpoint(Family::NemotronH, None, true);
    let config = ModelConfig::from_dir(dir.path()).expect("config");
    assert_eq!(config.mtp_layers, 1);
    ShardedModel::from_dir(dir.path(), 1, 0).expect("main model");
    let names = SafetensorsSource::open(dir.path()).expect("open").names();
    for n in [
        "mtp.layers.0.eh_proj.weight",
        "mtp.layers.0.enorm.weight",
        "mtp.layers.0.hnorm.weight",
        "mtp.layers.0.norm.weight",
        "mtp.layers.0.mixer.q_proj.weight",
        "mtp.layers.0.mixer.o_proj.weight",
        "mtp.layers.1.norm.weight",
        "mtp.layers.1.mixer.gate.weight",
        "mtp.layers.1.mixer.gate.e_score_correction_bias",
        "mtp.layers.1.mixer.fc1_latent_proj.weight",
        "mtp.layers.1.mixer.fc2_latent_proj.weight",
        "mtp.layers.1.mixer.experts.0.up_proj.weight",
        "mtp.layers.1.mixer.shared_experts.down_proj.weight",
        "mtp.layers.1.final_layernorm.weight",
    ] {
        assert!(names.iter().any(|x| x == n), "{n} missing");
    }
    assert!(!names.iter().any(|n| n.starts_with("mtp.layers.2.")));
    let w = MtpWeights::load(dir.path()).expect("MTP weights");
    assert_eq!(w.config().vocab_size, config.vocab_size);
    // transformers 5.23 writes the pattern as `mtp_layers_block_type`; the same layers load from it.
    let cfg_path = dir.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).expect("read")).expect("json");
    cfg.as_object_mut()
        .expect("object")
        .remove("mtp_hybrid_override_pattern");
    cfg["mtp_layers_block_type"] = serde_json::json!(["full_attention", "moe"]);
    std::fs::write(&cfg_path, cfg.to_string()).expect("write");
    MtpWeights::load(dir.path()).expect("MTP weights from mtp_layers_block_type");
    // A pattern other than attention then FFN is refused, naming what is supported.
    cfg["mtp_layers_block_type"] = serde_json::json!(["moe", "full_attention"]);
    std::fs::write(&cfg_path, cfg.to_string()).expect("write");
    let e = MtpWeights::load(dir.path()).err().expect("moe first");
    assert!(
        matches!(e, EngineError::NotSupported(_)) && e.to_string().contains("attention block"),
        "{e}"
    );
    cfg["mtp_layers_block_type"] = serde_json::json!(["mamba", "moe"]);
    std::fs::write(&cfg_path, cfg.to_string()).expect("write");
    let e = MtpWeights::load(dir.path()).err().expect("mamba");
    assert!(e.to_string().contains("mtp_layers_block_type"), "{e}");
}

/// A stack cut to one (linear-attention) layer still gets a full-attention MTP layer.
#[test]
fn mtp_layer_does_not_depend_on_the_main_stack() {
    let dir = checkpoint(Family::Qwen35, Some(1), true);
    let config = ModelConfig::from_dir(dir.path()).expect("config");
    assert_eq!(config.layers[0][0].kind.label(), "gdn");
    let mut d = MtpDrafter::load(dir.path()).expect("drafter");
    let toks = tokens(5, config.vocab_size, 1);
    let draft = propose(&mut d, &toks, 0, &rows(4, config.hidden_size, 2), 3).expect("draft");
    assert_eq!(draft.tokens.len(), 3);
}

#[test]
fn drafting_is_deterministic_bounded_and_in_vocab() {
    for family in [Family::Qwen35, Family::Qwen3Next, Family::NemotronH] {
        let dir = checkpoint(family, None, true);
        let w = MtpWeights::load(dir.path()).expect("weights");
        let (h, vocab) = (w.config().hidden_size, w.config().vocab_size);
        let toks = tokens(9, vocab, 4);
        let hidden = rows(8, h, 5);
        let mut drafts = Vec::new();
        for _ in 0..2 {
            let mut d = MtpDrafter::new(Arc::clone(&w));
            assert_eq!((d.name(), d.wants_hidden()), ("mtp", true));
            for max in [1, 4] {
                let draft = propose(&mut d, &toks, 0, &hidden, max).expect("draft");
                assert!(draft.tokens.len() <= max && !draft.tokens.is_empty(), "{draft:?}");
                assert!(draft.tokens.iter().all(|&t| (t as usize) < vocab), "{draft:?}");
                assert!(draft.probs.is_none());
                drafts.push(draft.tokens);
            }
        }
        assert_eq!(drafts[0], drafts[2], "{family:?}");
        assert_eq!(drafts[1], drafts[3], "{family:?}");
        // Greedy: a shorter draft is a prefix of a longer one.
        assert_eq!(drafts[0][..], drafts[1][..1], "{family:?}");
    }
}

#[test]
fn tiled_argmax_equals_argmax_of_whole_logits() {
    let dir = checkpoint(Family::Qwen35, None, true);
    let w = MtpWeights::load(dir.path()).expect("weights");
    let (h, vocab) = (w.config().hidden_size, w.config().vocab_size);
    let toks = tokens(6, vocab, 8);
    let hidden = rows(5, h, 9);
    let mut d = MtpDrafter::new(Arc::clone(&w));
    let draft = propose(&mut d, &toks, 0, &hidden, 2).expect("draft");
    // The same two steps, the straightforward way: whole logit rows through the LM head.
    let mut cache = w.new_cache();
    let out = w
        .forward(&w.normalise_target(&hidden), &toks[1..], &mut cache)
        .expect("forward");
    let last = &out[4 * h..];
    let d1 = argmax(&linear(last, w.lm_head(), None, 1, h, vocab));
    let out2 = w.forward(last, &[d1], &mut cache).expect("step 2");
    let d2 = argmax(&linear(&out2, w.lm_head(), None, 1, h, vocab));
    assert_eq!(draft.tokens, [d1, d2]);

    // Synthetic heads: a vocabulary that is no multiple of the tile, ties across tiles, NaN rows.
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let (hid, n) = (7, 3 * ARGMAX_TILE + 41);
    for trial in 0..20 {
        let x: Vec<f32> = (0..hid).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let mut wt: Vec<f32> = (0..n * hid).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        if trial % 2 == 1 {
            // Copy one row to a lower and a higher id in other tiles: the lowest id must win.
            let best = argmax(&linear(&x, &wt, None, 1, hid, n)) as usize;
            let row = wt[best * hid..(best + 1) * hid].to_vec();
            for at in [best / 2, n - 1] {
                wt[at * hid..(at + 1) * hid].copy_from_slice(&row);
            }
        }
        let logits = linear(&x, &wt, None, 1, hid, n);
        assert_eq!(tiled_argmax(&x, &wt, hid), Some(argmax(&logits)), "trial {trial}");
    }
    let x = vec![1.0; hid];
    let mut wt = vec![0.0; n * hid];
    wt[..hid].fill(f32::NAN);
    wt[(n - 1) * hid] = 1.0;
    assert_eq!(tiled_argmax(&x, &wt, hid), Some(n as u32 - 1));
    assert_eq!(tiled_argmax(&x, &vec![f32::NAN; n * hid], hid), None);
}

/// Asserts that two output rows agree to float rounding (a batched forward and a stepwise one sum differently).
fn assert_close(a: Option<&[f32]>, b: Option<&[f32]>, what: &str) {
    let (a, b) = (a.expect(what), b.expect(what));
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= 1e-4 * (1.0 + x.abs()), "{what}: {x} vs {y}");
    }
}

#[test]
fn draft_steps_are_discarded_and_kv_continues() {
    let dir = checkpoint(Family::Qwen3Next, None, true);
    let w = MtpWeights::load(dir.path()).expect("weights");
    let (h, vocab) = (w.config().hidden_size, w.config().vocab_size);
    let toks = tokens(12, vocab, 21);
    let hidden = rows(11, h, 22);
    // The same proposal twice: the first one's draft steps must not leak into the second.
    // Drafts of a random model hardly move with stale KV entries, so the last row's output is compared too.
    let mut d = MtpDrafter::new(Arc::clone(&w));
    let a = propose(&mut d, &toks[..7], 0, &hidden[..6 * h], 4).expect("first");
    let out_a = d.last_output().map(<[f32]>::to_vec);
    assert_eq!(d.kv_len(), 6 + 3);
    let b = propose(&mut d, &toks[..7], 0, &hidden[..6 * h], 4).expect("again");
    assert_eq!(a, b);
    assert_eq!(d.last_output(), out_a.as_deref(), "the same proposal again");
    // Committing more rows in pieces (after draft steps) equals taking them all at once.
    let c = propose(&mut d, &toks, 6, &hidden[6 * h..], 3).expect("continued");
    assert_eq!(d.kv_len(), 11 + 2);
    let mut fresh = MtpDrafter::new(Arc::clone(&w));
    let all = propose(&mut fresh, &toks, 0, &hidden, 3).expect("at once");
    assert_eq!(c, all);
    assert_close(d.last_output(), fresh.last_output(), "in pieces vs at once");
    // No new rows: the last committed row is reused, and the drafts are the same.
    let again = propose(&mut d, &toks, 11, &[], 3).expect("no new rows");
    assert_eq!(again, all);
    assert_eq!(d.kv_len(), 11 + 2);
    // Rolled back: rows from an earlier position replace the later entries.
    let back = propose(&mut d, &toks[..7], 3, &hidden[3 * h..6 * h], 4).expect("rolled back");
    assert_eq!(back, a);
    assert_close(d.last_output(), out_a.as_deref(), "rolled back");
    // A drafter created mid-sequence starts its KV at the first row it gets.
    let mut late = MtpDrafter::new(Arc::clone(&w));
    let l = propose(&mut late, &toks, 8, &hidden[8 * h..], 2).expect("late start");
    assert_eq!(l.tokens.len(), 2);
    assert_eq!(late.kv_len(), 3 + 1);
}

/// Rows observed chunk by chunk (a chunked prompt, then a step's committed rows) build the same KV as rows handed
/// over all at once, and a proposal then needs no rows of its own.
#[test]
fn observed_rows_build_the_kv_from_the_prompt_start() {
    let dir = checkpoint(Family::Qwen35, None, true);
    let w = MtpWeights::load(dir.path()).expect("weights");
    let (h, vocab) = (w.config().hidden_size, w.config().vocab_size);
    let toks = tokens(14, vocab, 41);
    let hidden = rows(13, h, 42);
    let observe = |d: &mut MtpDrafter, known: usize, from: usize, to: usize| {
        let rows = HiddenRows {
            position: from,
            hidden: h,
            rows: hidden[from * h..to * h].to_vec(),
        };
        d.observe(&toks[..known], &rows)
    };
    let mut fresh = MtpDrafter::new(Arc::clone(&w));
    let all = propose(&mut fresh, &toks[..11], 0, &hidden[..10 * h], 3).expect("at once");
    let mut d = MtpDrafter::new(Arc::clone(&w));
    // Three prompt chunks of a 10-token prompt (the last row's next token is the first generated one).
    observe(&mut d, 10, 0, 4).expect("chunk 1");
    observe(&mut d, 10, 4, 8).expect("chunk 2");
    observe(&mut d, 11, 8, 10).expect("chunk 3");
    assert_eq!(
        (d.kv_start(), d.kv_len()),
        (0, 10),
        "every prompt position is in the KV"
    );
    let got = proposed(&mut d, &toks[..11], 3).expect("proposal after observing");
    assert_eq!(got, all);
    assert_close(d.last_output(), fresh.last_output(), "observed vs at once");
    // A verify's committed rows, observed after its tokens are known, drop the draft steps first.
    observe(&mut d, 14, 10, 13).expect("committed rows");
    assert_eq!(d.kv_len(), 13);
    let later = proposed(&mut d, &toks, 2).expect("later proposal");
    let mut fresh = MtpDrafter::new(Arc::clone(&w));
    assert_eq!(later, propose(&mut fresh, &toks, 0, &hidden, 2).expect("at once"));
    // A row whose next token is not known yet is refused.
    let e = observe(&mut d, 12, 10, 12).unwrap_err().to_string();
    assert!(e.contains("need the token after each"), "{e}");
}

#[test]
fn checkpoints_without_mtp_weights_are_refused_clearly() {
    let dir = checkpoint(Family::Qwen35, None, false);
    let e = MtpWeights::load(dir.path()).err().expect("no MTP weights");
    let text = e.to_string();
    assert!(matches!(e, EngineError::InvalidInput(_)), "{text}");
    assert!(
        text.contains("no MTP weights")
            && text.contains("init-model --mtp")
            && text.contains(&dir.path().display().to_string()),
        "{text}"
    );
    // A config that claims MTP layers while the safetensors hold none.
    let cfg_path = dir.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).expect("read")).expect("json");
    cfg["mtp_num_hidden_layers"] = serde_json::json!(1);
    std::fs::write(&cfg_path, cfg.to_string()).expect("write");
    let text = MtpDrafter::load(dir.path()).err().expect("no tensors").to_string();
    assert!(text.contains("mtp.*") && text.contains("hold none"), "{text}");
    // Nemotron-H without MTP: named by its own config field.
    let dir = crate::init::tiny_checkpoint(Family::NemotronH, 1);
    let e = MtpWeights::load(dir.path()).err().expect("nemotron without MTP");
    assert!(
        matches!(e, EngineError::InvalidInput(_)) && e.to_string().contains("num_nextn_predict_layers"),
        "{e}"
    );
}

#[test]
fn bad_inputs_are_errors() {
    let dir = checkpoint(Family::Qwen35, None, true);
    let mut d = MtpDrafter::load(dir.path()).expect("drafter");
    let (h, vocab) = (d.weights().config().hidden_size, d.weights().config().vocab_size);
    let toks = tokens(6, vocab, 31);
    // Nothing observed and no rows.
    let e = proposed(&mut d, &toks, 2).unwrap_err().to_string();
    assert!(e.contains("hidden states"), "{e}");
    // Rows that do not end just before the last token.
    let e = propose(&mut d, &toks, 0, &rows(3, h, 1), 2).unwrap_err().to_string();
    assert!(e.contains("do not end just before"), "{e}");
    // Rows of the wrong width.
    let bad = HiddenRows {
        position: 0,
        hidden: h + 1,
        rows: vec![0.0; 5 * (h + 1)],
    };
    let e = d
        .propose(&DraftInput {
            tokens: &toks,
            hidden: Some(&bad),
            max: 2,
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("hidden size"), "{e}");
    // No rows and nothing kept from before.
    let e = propose(&mut d, &toks, 5, &[], 2).unwrap_err().to_string();
    assert!(e.contains("no hidden row"), "{e}");
    // A token past the vocabulary.
    let mut wrong = toks.clone();
    wrong[3] = vocab as u32;
    let e = propose(&mut d, &wrong, 0, &rows(5, h, 1), 2).unwrap_err().to_string();
    assert!(e.contains("out of range"), "{e}");
}
