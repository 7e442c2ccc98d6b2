//! Decoder unit tests on tiny random checkpoints: errors for bad input, commits as pointer moves, the traffic each
//! form reports, prompt chunks at a position > 0, and slot snapshot / restore. Model-level equivalence of the forms is
//! in `tests/tests/engine/decode_forms.rs`.

use std::path::Path;

use super::*;
use crate::model::Family;
use crate::state::PoolError;

/// A tiny random checkpoint of `family` in a temporary directory.
fn tiny(family: Family) -> tempfile::TempDir {
    crate::init::tiny_checkpoint(family, 5)
}

/// A decoder of the checkpoint in `dir`, loaded afresh as one rank (a decoder owns its model).
fn decoder(dir: &Path, cfg: DecoderConfig) -> Result<Decoder> {
    Decoder::single(ShardedModel::from_dir(dir, 1, 0).expect("load"), cfg)
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

/// `max |got − want| / max |want|`.
fn rel(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "row lengths differ");
    let max = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    got.iter().zip(want).fold(0.0f32, |m, (g, w)| m.max((g - w).abs())) / max.max(1e-12)
}

#[test]
fn form_names_and_bad_configs() {
    for c in FormChoice::ALL {
        assert_eq!(c.name().parse::<FormChoice>().expect("parse"), c);
    }
    invalid("fast".parse::<FormChoice>(), "unknown decode form `fast`");
    let dir = tiny(Family::NemotronH);
    invalid(decoder(dir.path(), config(1, 1)), "at least 2");
    invalid(decoder(dir.path(), config(5, 3)), "needs L ≥ 2T");
    invalid(decoder(dir.path(), config(4, 0)), "at least 1 token");
    decoder(dir.path(), config(2, 1)).expect("the smallest ring");
}

#[test]
fn bad_slots_tokens_and_commits_are_errors() {
    let dir = tiny(Family::NemotronH);
    let mut dec = decoder(dir.path(), config(8, 2)).expect("decoder");
    let vocab = dec.model().config().vocab_size as u32;
    assert!(matches!(
        dec.decode(&[(1, 3)]),
        Err(EngineError::Pool(PoolError::NotAllocated { slot: 1 }))
    ));
    invalid(dec.decode(&[(99, 3)]), "out of range");
    invalid(dec.decode(&[]), "empty step");
    let a = dec.start(FormChoice::Replay).expect("slot");
    let b = dec.start(FormChoice::KvOnly).expect("slot");
    invalid(dec.decode(&[(a, vocab)]), "out of range");
    invalid(dec.decode(&[(a, 1), (a, 2)]), "appears twice in one step");
    invalid(dec.prefill(a, &[], Rows::Last), "no tokens");
    invalid(dec.prefill(a, &[1, vocab], Rows::Last), "out of range");
    dec.prefill(a, &[1, 2, 3], Rows::Last).expect("prefill");
    // A later prompt chunk continues the sequence.
    assert_eq!(
        dec.prefill(a, &[4], Rows::None).expect("a second chunk"),
        Vec::<f32>::new()
    );
    assert_eq!(dec.position(a).expect("position"), 4);
    invalid(
        dec.prefill(a, &vec![1; 61], Rows::Last),
        "beyond the decoder's context of 64",
    );
    invalid(dec.verify(a, &[]), "1 to 2 tokens");
    invalid(dec.verify(a, &[1, 2, 3]), "1 to 2 tokens");
    invalid(dec.commit(a, 0), "no verify to commit");
    dec.verify(a, &[5, 6]).expect("verify");
    invalid(dec.decode(&[(b, 1), (a, 2)]), "awaiting commit");
    invalid(dec.verify(a, &[5]), "awaiting commit");
    invalid(dec.prefill(a, &[5], Rows::Last), "awaiting commit");
    invalid(dec.snapshot(a), "awaiting commit");
    invalid(dec.commit(a, 3), "cannot accept 3 of 2");
    dec.commit(a, 1).expect("commit");
    assert_eq!(dec.position(a).expect("position"), 5);
    dec.decode(&[(b, 1), (a, 2)]).expect("a mixed batch");
    let snap = dec.snapshot(a).expect("snapshot");
    invalid(dec.restore(b, &snap), "already in use");
    dec.release(b).expect("release");
    assert!(matches!(
        dec.release(b),
        Err(EngineError::Pool(PoolError::DoubleFree { .. }))
    ));
    invalid(dec.decode(&[(b, 1)]), "not allocated");
    invalid(dec.snapshot(b), "not allocated");
}

#[test]
fn commit_moves_pointers_only() {
    for family in [Family::NemotronH, Family::Qwen35] {
        let dir = tiny(family);
        let mut dec = decoder(dir.path(), config(8, 3)).expect("decoder");
        let slot = dec.start(FormChoice::Replay).expect("slot");
        dec.prefill(slot, &[3, 1, 4, 1, 5], Rows::Last).expect("prefill");
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
    let dir = tiny(Family::NemotronH);
    let threshold = 4;
    let cfg = DecoderConfig {
        kv_only_threshold: Some(threshold),
        ..config(4, 1)
    };
    let mut dec = decoder(dir.path(), cfg).expect("decoder");
    assert_eq!(dec.kv_only_threshold(), threshold);
    let rec = dec.start(FormChoice::Recurrent).expect("slot");
    let rep = dec.start(FormChoice::Replay).expect("slot");
    let kv = dec.start(FormChoice::KvOnly).expect("slot");
    for s in [rec, rep, kv] {
        dec.prefill(s, &[7, 8], Rows::Last).expect("prefill");
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

const PROMPT: [u32; 9] = [3, 1, 4, 1, 5, 9, 2, 6, 5];

/// A prompt in two chunks (5 then 4 tokens, the second at position 5) gives the last logits of one 9-token prefill,
/// in every form; so does a chunk after a decode step (a replay or kv-only ring holding an entry is folded first).
/// A kv-only sequence whose first chunk stays below the threshold compresses into replay at the second.
#[test]
fn a_prompt_in_chunks_equals_one_prefill() {
    for family in [Family::NemotronH, Family::Qwen35] {
        let dir = tiny(family);
        for form in [FormChoice::Recurrent, FormChoice::Replay, FormChoice::KvOnly] {
            let mut dec = decoder(dir.path(), config(8, 1)).expect("decoder");
            assert!(
                dec.kv_only_threshold() > 5,
                "{family:?}: the first chunk must stay kv-only"
            );
            let whole = dec.start(form).expect("slot");
            let want = dec.prefill(whole, &PROMPT, Rows::Last).expect("one prefill");
            let all = dec.prefill(whole, &[7], Rows::All).expect("a one-token chunk");

            let chunks = dec.start(form).expect("slot");
            assert!(dec
                .prefill(chunks, &PROMPT[..5], Rows::None)
                .expect("chunk 1")
                .is_empty());
            if form == FormChoice::KvOnly {
                assert_eq!(dec.form(chunks).expect("form"), DecodeForm::KvOnly);
            }
            let rows = dec.prefill(chunks, &PROMPT[5..], Rows::All).expect("chunk 2");
            let vocab = want.len();
            assert_eq!(rows.len(), 4 * vocab, "Rows::All of a later chunk: one row per token");
            assert_eq!(dec.position(chunks).expect("position"), 9);
            if form == FormChoice::KvOnly {
                assert_eq!(
                    dec.form(chunks).expect("form"),
                    DecodeForm::Replay,
                    "{family:?}: a later chunk compresses a kv-only sequence"
                );
            }
            let e = rel(&rows[3 * vocab..], &want);
            assert!(e < 1e-4, "{family:?} {form}: two chunks vs one prefill: {e:e}");
            let after = dec.prefill(chunks, &[7], Rows::All).expect("a third chunk");
            let e = rel(&after, &all);
            assert!(e < 1e-4, "{family:?} {form}: a third chunk: {e:e}");
            dec.release(chunks).expect("release");

            // A chunk after a decode step.
            let mixed = dec.start(form).expect("slot");
            dec.prefill(mixed, &PROMPT[..5], Rows::Last).expect("chunk 1");
            dec.decode(&[(mixed, PROMPT[5])]).expect("decode");
            let ring = dec.pools().counters().ring_len()[mixed];
            if form != FormChoice::Recurrent {
                assert!(ring > 0, "{family:?} {form}: the decode left a ring entry");
            }
            let got = dec
                .prefill(mixed, &PROMPT[6..], Rows::Last)
                .expect("chunk after decode");
            assert_eq!(
                dec.pools().counters().ring_len()[mixed],
                0,
                "{family:?} {form}: ring folded"
            );
            let e = rel(&got, &want);
            assert!(
                e < 1e-4,
                "{family:?} {form}: prefill, decode, prefill vs one prefill: {e:e}"
            );
        }
    }
}

/// A slot's snapshot restored into another free slot continues exactly as the original: decodes, a verify and its
/// commit give the same logits, in every form (a kv-only sequence both before and after it compresses).
#[test]
fn snapshot_restore_continues_identically() {
    for family in [Family::NemotronH, Family::Qwen35] {
        let dir = tiny(family);
        let cfg = DecoderConfig {
            kv_only_threshold: Some(8),
            ..config(4, 2)
        };
        for form in [FormChoice::Recurrent, FormChoice::Replay, FormChoice::KvOnly] {
            for decodes in [0, 3, 6] {
                let label = format!("{family:?} {form} after {decodes} decodes");
                let mut dec = decoder(dir.path(), cfg.clone()).expect("decoder");
                // Take slot 0 and free it, so the original and its copy sit at other rows of the pools.
                let first = dec.start(form).expect("slot");
                let a = dec.start(form).expect("slot");
                dec.release(first).expect("release");
                dec.prefill(a, &PROMPT[..5], Rows::Last).expect("prefill");
                for k in 0..decodes {
                    dec.decode(&[(a, PROMPT[k % 9])]).expect("decode");
                }
                let snap = dec.snapshot(a).expect("snapshot");
                assert_eq!(snap.position, 5 + decodes, "{label}");
                let b = 2;
                dec.restore(b, &snap).expect("restore");
                assert_eq!(dec.position(b).expect("position"), dec.position(a).expect("position"));
                assert_eq!(dec.form(b).expect("form"), dec.form(a).expect("form"), "{label}");
                assert_eq!(dec.form_choice(b).expect("choice"), form);
                let c = dec.pools().counters();
                assert_eq!(c.ring_len()[b], c.ring_len()[a], "{label}");
                for step in 0..4u32 {
                    let tok = 10 + step;
                    let x = dec.decode(&[(a, tok)]).expect("decode original");
                    let y = dec.decode(&[(b, tok)]).expect("decode copy");
                    assert_eq!(x, y, "{label}: decode {step}");
                    assert_eq!(dec.form(b).expect("form"), dec.form(a).expect("form"), "{label}");
                }
                let x = dec.verify(a, &[20, 21]).expect("verify original");
                let y = dec.verify(b, &[20, 21]).expect("verify copy");
                assert_eq!(x, y, "{label}: verify");
                dec.commit(a, 1).expect("commit");
                dec.commit(b, 1).expect("commit");
                let x = dec.decode(&[(a, 22)]).expect("decode original");
                let y = dec.decode(&[(b, 22)]).expect("decode copy");
                assert_eq!(x, y, "{label}: decode after the commit");
                // The original slot is untouched by the copy and can go first.
                dec.release(a).expect("release");
                dec.decode(&[(b, 23)]).expect("the copy outlives the original");
            }
        }
    }
}

/// A stored state restores as its snapshot does, stays stored across restores and after its slot is released, and
/// is gone once dropped (dropping an unknown id is no error).
#[test]
fn a_stored_state_restores_like_its_snapshot_until_dropped() {
    let dir = tiny(Family::NemotronH);
    let mut dec = decoder(dir.path(), config(4, 2)).expect("decoder");
    let a = dec.start(FormChoice::Replay).expect("slot");
    dec.prefill(a, &PROMPT[..6], Rows::Last).expect("prefill");
    dec.decode(&[(a, 3)]).expect("decode");
    let snap = dec.snapshot(a).expect("snapshot");
    assert_eq!(dec.store(a, 7).expect("store"), snap.bytes());
    dec.release(a).expect("release");
    for slot in [1, 2] {
        dec.restore_stored(slot, 7).expect("restore stored");
        assert_eq!(dec.snapshot(slot).expect("snapshot"), snap, "slot {slot}");
    }
    let x = dec.decode(&[(1, 9)]).expect("decode");
    let y = dec.decode(&[(2, 9)]).expect("decode");
    assert_eq!(x, y);
    dec.drop_stored(&[7, 8]);
    assert_eq!(dec.stored_count(), 0);
    invalid(dec.restore_stored(3, 7), "no state is stored under id 7");
}
