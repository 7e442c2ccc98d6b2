//! Decoder unit tests on tiny random checkpoints: errors for bad input, commits as pointer moves, and the traffic
//! each form reports. Model-level equivalence of the forms is in `tests/tests/decode_forms.rs`.

use super::*;
use crate::init::{init_model, InitOptions};
use crate::model::Family;
use crate::state::PoolError;

fn tiny(family: Family) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().expect("tempdir");
    init_model(&InitOptions {
        family,
        preset: "tiny".into(),
        layers: None,
        seed: 5,
        out: dir.path().to_path_buf(),
        dtype: None,
    })
    .expect("init-model");
    let model = Model::from_dir(dir.path()).expect("load");
    (dir, model)
}

fn config(buffer_len: usize, max_verify: usize) -> DecoderConfig {
    DecoderConfig {
        buffer_len,
        max_verify,
        ..DecoderConfig::new(3, 64)
    }
}

fn invalid(r: Result<impl std::fmt::Debug>, needle: &str) {
    match r {
        Err(e) => assert!(e.to_string().contains(needle), "`{e}` lacks `{needle}`"),
        Ok(v) => panic!("expected an error containing `{needle}`, got {v:?}"),
    }
}

#[test]
fn form_names_and_bad_configs() {
    for c in FormChoice::ALL {
        assert_eq!(c.name().parse::<FormChoice>().expect("parse"), c);
    }
    invalid("fast".parse::<FormChoice>(), "unknown decode form `fast`");
    let (_dir, model) = tiny(Family::NemotronH);
    invalid(Decoder::new(&model, config(1, 1)), "at least 2");
    invalid(Decoder::new(&model, config(5, 3)), "needs L ≥ 2T");
    invalid(Decoder::new(&model, config(4, 0)), "at least 1 token");
    Decoder::new(&model, config(2, 1)).expect("the smallest ring");
}

#[test]
fn bad_slots_tokens_and_commits_are_errors() {
    let (_dir, model) = tiny(Family::NemotronH);
    let vocab = model.config().vocab_size as u32;
    let mut dec = Decoder::new(&model, config(8, 2)).expect("decoder");
    assert!(matches!(
        dec.decode(&[(1, 3)]),
        Err(EngineError::Pool(PoolError::NotAllocated { slot: 1 }))
    ));
    invalid(dec.decode(&[(99, 3)]), "out of range");
    invalid(dec.decode(&[]), "empty decode batch");
    let a = dec.start(FormChoice::Replay).expect("slot");
    let b = dec.start(FormChoice::KvOnly).expect("slot");
    invalid(dec.decode(&[(a, vocab)]), "out of range");
    invalid(dec.decode(&[(a, 1), (a, 2)]), "appears twice");
    invalid(dec.prefill(a, &[], Logits::Last), "no tokens");
    dec.prefill(a, &[1, 2, 3], Logits::Last).expect("prefill");
    invalid(dec.prefill(a, &[4], Logits::Last), "already holds 3 tokens");
    invalid(dec.verify(a, &[]), "1 to 2 tokens");
    invalid(dec.verify(a, &[1, 2, 3]), "1 to 2 tokens");
    invalid(dec.commit(a, 0), "no verify to commit");
    dec.verify(a, &[5, 6]).expect("verify");
    invalid(dec.decode(&[(b, 1), (a, 2)]), "awaiting commit");
    invalid(dec.verify(a, &[5]), "awaiting commit");
    invalid(dec.commit(a, 3), "cannot accept 3 of 2");
    dec.commit(a, 1).expect("commit");
    assert_eq!(dec.position(a).expect("position"), 4);
    dec.decode(&[(b, 1), (a, 2)]).expect("a mixed batch");
    dec.release(b).expect("release");
    assert!(matches!(
        dec.release(b),
        Err(EngineError::Pool(PoolError::DoubleFree { .. }))
    ));
    invalid(dec.decode(&[(b, 1)]), "not allocated");
}

#[test]
fn commit_moves_pointers_only() {
    for family in [Family::NemotronH, Family::Qwen35] {
        let (_dir, model) = tiny(family);
        let mut dec = Decoder::new(&model, config(8, 3)).expect("decoder");
        let slot = dec.start(FormChoice::Replay).expect("slot");
        dec.prefill(slot, &[3, 1, 4, 1, 5], Logits::Last).expect("prefill");
        dec.decode(&[(slot, 9)]).expect("decode");
        let c = dec.pools().counters();
        let before = (c.ring_len()[slot], c.conv_head()[slot], c.kv_len()[slot]);
        assert_eq!(before.0, 1, "{family:?}: one committed entry after one decode");
        dec.verify(slot, &[2, 6, 5]).expect("verify");
        let c = dec.pools().counters();
        assert_eq!(
            (c.ring_len()[slot], c.conv_head()[slot]),
            (before.0, before.1),
            "{family:?}: a verify commits nothing"
        );
        let layer = dec.pools().ssm_layer(0).expect("ssm layer");
        let storage: Vec<Vec<f32>> = (0..3).map(|f| layer.ring_field(f).to_vec()).collect();
        let (states, convs) = (layer.states().to_vec(), layer.conv_rings().to_vec());
        dec.commit(slot, 2).expect("commit");
        let layer = dec.pools().ssm_layer(0).expect("ssm layer");
        for (f, s) in storage.iter().enumerate() {
            assert_eq!(layer.ring_field(f), &s[..], "{family:?}: ring field {f} moved");
        }
        assert!(layer.states() == &states[..] && layer.conv_rings() == &convs[..]);
        let c = dec.pools().counters();
        let cap = c.conv_capacity() as u32;
        assert_eq!(
            (c.ring_len()[slot], c.conv_head()[slot], c.kv_len()[slot]),
            (before.0 + 2, (before.1 + 2) % cap, before.2 + 2),
            "{family:?}"
        );
        assert_eq!(
            dec.last_traffic().total(),
            0,
            "{family:?}: a replay commit moves no bytes"
        );
    }
}

#[test]
fn traffic_follows_the_form() {
    let (_dir, model) = tiny(Family::NemotronH);
    let threshold = 4;
    let cfg = DecoderConfig {
        kv_only_threshold: Some(threshold),
        ..config(4, 1)
    };
    let mut dec = Decoder::new(&model, cfg).expect("decoder");
    assert_eq!(dec.kv_only_threshold(), threshold);
    let rec = dec.start(FormChoice::Recurrent).expect("slot");
    let rep = dec.start(FormChoice::Replay).expect("slot");
    let kv = dec.start(FormChoice::KvOnly).expect("slot");
    for s in [rec, rep, kv] {
        dec.prefill(s, &[7, 8], Logits::Last).expect("prefill");
    }
    let mut flushed = 0;
    for step in 0..6 {
        dec.decode(&[(rec, 1)]).expect("recurrent");
        let r = dec.last_traffic();
        assert!(r.state_read > 0 && r.state_written == r.state_read && r.ring_read == 0);
        let h = dec.pools().counters().ring_len()[rep] as usize;
        dec.decode(&[(rep, 1)]).expect("replay");
        let p = dec.last_traffic();
        assert_eq!(p.state_read, r.state_read, "replay reads the checkpoint once per layer");
        assert!(p.ring_written > 0 && (h == 0 || p.ring_read > 0));
        if p.state_written > 0 {
            flushed += 1;
            assert_eq!(
                dec.pools().counters().ring_len()[rep],
                0,
                "a decode flush empties the ring"
            );
        }
        // Context before this step: the 2 prompt tokens plus `step`.
        let context = 2 + step;
        let c = dec.pools().counters();
        if context <= threshold {
            assert_eq!(c.ring_len()[kv] as usize, context, "the ring is the whole history");
        }
        dec.decode(&[(kv, 1)]).expect("kv-only");
        let k = dec.last_traffic();
        let c = dec.pools().counters();
        if context < threshold {
            assert_eq!(dec.form(kv).expect("form"), DecodeForm::KvOnly, "step {step}");
            assert_eq!(
                c.ring_cap()[kv] as usize,
                threshold + 1,
                "a kv-only ring of threshold + T"
            );
            assert_eq!(
                (k.state_read, k.state_written),
                (0, 0),
                "step {step}: kv-only keeps no state"
            );
        } else {
            assert_eq!(dec.form(kv).expect("form"), DecodeForm::Replay, "step {step}");
            assert_eq!(c.ring_cap()[kv], 4, "replay continues with a ring of L");
            assert!(k.state_read > 0, "step {step}: compressed at the threshold");
        }
    }
    assert!(flushed > 0, "L = 4 must flush within six steps");
    assert_eq!(dec.form_choice(kv).expect("choice"), FormChoice::KvOnly);
}
