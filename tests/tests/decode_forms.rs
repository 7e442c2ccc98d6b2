//! The decode forms at model level, on every fixture under `tests/fixtures/`: replay (`L = 3` and 16), kv-only and
//! auto decode give the recurrent form's greedy tokens and logits within 1e-4 relative at every position, across
//! flushes and compressions; speculative verify + commit (replay, kv-only and the recurrent baseline) reproduces the
//! recurrent decode of the same committed history under a random walk of accepted counts; a batch mixing forms
//! equals each sequence run alone; and kv-only / auto keep no state until the context reaches the kv-only threshold
//! (independent of `L`, also when a verify window crosses it), then continue in replay.

use std::path::{Path, PathBuf};

use rewind_engine::decode::{Decoder, DecoderConfig, FormChoice};
use rewind_engine::model::{Logits, Model, SequenceState};
use rewind_engine::state::DecodeForm;
use serde_json::Value;

/// max |Δlogit| / max |logit| allowed against the recurrent form.
const TOLERANCE: f64 = 1e-4;
/// Greedy tokens decoded after the fixture's tokens.
const EXTRA: usize = 14;

fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("reading {}: {e}", root.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("reference.json").is_file())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no fixtures under {}", root.display());
    dirs
}

/// The model, the fixture's tokens and its prefill length.
fn load(dir: &Path) -> (Model, Vec<u32>, usize) {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).expect("read reference"))
            .expect("json");
    let tokens: Vec<u32> = reference["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect();
    let prefill = reference["prefill_len"].as_u64().expect("prefill_len") as usize;
    let model = Model::from_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    (model, tokens, prefill)
}

fn name(dir: &Path) -> String {
    dir.file_name().expect("name").to_string_lossy().to_string()
}

fn rel(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "row lengths differ");
    let max_ref = want.iter().fold(0.0f64, |m, x| m.max(x.abs() as f64));
    let max_diff = got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (g, w)| m.max((*g as f64 - *w as f64).abs()));
    max_diff / max_ref.max(1e-12)
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// A small deterministic generator (splitmix64), so the walks are reproducible without extra dependencies.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// One sequence decoded in `form`: `tokens[..prefill]` through prefill, then every later token one at a time.
/// Returns the logits of the prefill's last position and of every decode step.
fn run_form(model: &Model, form: FormChoice, buffer_len: usize, tokens: &[u32], prefill: usize) -> Vec<Vec<f32>> {
    let config = DecoderConfig {
        buffer_len,
        ..DecoderConfig::new(1, tokens.len())
    };
    let mut dec = Decoder::new(model, config).expect("decoder");
    let slot = dec.start(form).expect("slot");
    let mut rows = vec![dec.prefill(slot, &tokens[..prefill], Logits::Last).expect("prefill")];
    for &t in &tokens[prefill..] {
        rows.push(dec.decode(&[(slot, t)]).expect("decode"));
    }
    rows
}

/// The fixture's tokens followed by `EXTRA` greedy tokens of the recurrent form, and the recurrent logits.
fn recurrent_reference(model: &Model, tokens: &[u32], prefill: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let config = DecoderConfig::new(1, tokens.len() + EXTRA);
    let mut dec = Decoder::new(model, config).expect("decoder");
    let slot = dec.start(FormChoice::Recurrent).expect("slot");
    let mut rows = vec![dec.prefill(slot, &tokens[..prefill], Logits::Last).expect("prefill")];
    let mut all = tokens.to_vec();
    for i in prefill..tokens.len() + EXTRA {
        if i >= tokens.len() {
            all.push(argmax(rows.last().expect("row")));
        }
        rows.push(dec.decode(&[(slot, all[i])]).expect("decode"));
    }
    all.truncate(tokens.len() + EXTRA);
    (all, rows)
}

#[test]
fn every_form_matches_recurrent_on_every_fixture() {
    let mut failures = Vec::new();
    for dir in fixtures() {
        let (model, tokens, fixture_prefill) = load(&dir);
        for prefill in [fixture_prefill, 1] {
            let (all, want) = recurrent_reference(&model, &tokens, prefill);
            // The recurrent decoder is the model's own prefill + decode path.
            let mut state = model.new_state();
            let mut direct = vec![model
                .forward(&all[..prefill], &mut state, Logits::Last)
                .expect("prefill")];
            for &t in &all[prefill..] {
                direct.push(model.forward(&[t], &mut state, Logits::All).expect("decode"));
            }
            for (i, (d, w)) in direct.iter().zip(&want).enumerate() {
                assert!(
                    rel(d, w) < 1e-6,
                    "{}: recurrent decoder vs Model::forward at step {i}",
                    name(&dir)
                );
            }
            let inputs = &all[..];
            for (form, l) in [
                (FormChoice::Replay, 3),
                (FormChoice::Replay, 16),
                (FormChoice::KvOnly, 16),
                (FormChoice::KvOnly, 128),
                (FormChoice::KvOnly, 3),
                (FormChoice::Auto, 16),
                (FormChoice::Auto, 4),
            ] {
                let got = run_form(&model, form, l, inputs, prefill);
                assert_eq!(got.len(), want.len());
                let mut worst = 0.0f64;
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    worst = worst.max(rel(g, w));
                    if argmax(g) != argmax(w) && i + prefill >= tokens.len() {
                        failures.push(format!(
                            "{} prefill {prefill} {form} L={l}: greedy token differs at step {i}",
                            name(&dir)
                        ));
                    }
                }
                println!(
                    "{:<18} prefill {prefill:>2} {form:<9} L={l:<3} worst {worst:.2e} over {} steps",
                    name(&dir),
                    got.len()
                );
                if worst > TOLERANCE {
                    failures.push(format!("{} prefill {prefill} {form} L={l}: {worst:.2e}", name(&dir)));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Replays speculative steps on `form` and checks every verified row against the recurrent decode of the committed
/// history plus the drafts before it. Returns the worst relative error and the accepted counts seen.
fn verify_walk(
    model: &Model,
    tokens: &[u32],
    prefill: usize,
    form: FormChoice,
    seed: u64,
) -> (f64, Vec<(usize, usize)>) {
    const T_MAX: usize = 4;
    let vocab = model.config().vocab_size;
    let steps = 24;
    let config = DecoderConfig {
        buffer_len: 8,
        max_verify: T_MAX,
        ..DecoderConfig::new(1, prefill + steps * T_MAX + 8)
    };
    let mut dec = Decoder::new(model, config).expect("decoder");
    let slot = dec.start(form).expect("slot");
    let mut reference: SequenceState = model.new_state();
    let first = dec.prefill(slot, &tokens[..prefill], Logits::Last).expect("prefill");
    let want = model
        .forward(&tokens[..prefill], &mut reference, Logits::Last)
        .expect("prefill");
    let mut worst = rel(&first, &want);
    let mut rng = Rng(seed);
    let mut accepted_seen = Vec::new();
    for step in 0..steps {
        if step % 5 == 4 {
            // A plain decode step between speculative ones.
            let tok = rng.below(vocab) as u32;
            let got = dec.decode(&[(slot, tok)]).expect("decode");
            let want = model.forward(&[tok], &mut reference, Logits::All).expect("decode");
            worst = worst.max(rel(&got, &want));
            continue;
        }
        let t = 1 + rng.below(T_MAX);
        let drafts: Vec<u32> = (0..t).map(|_| rng.below(vocab) as u32).collect();
        let got = dec.verify(slot, &drafts).expect("verify");
        assert_eq!(got.len(), t * vocab);
        let mut probe = reference.clone();
        for (s, &d) in drafts.iter().enumerate() {
            let want = model.forward(&[d], &mut probe, Logits::All).expect("probe");
            worst = worst.max(rel(&got[s * vocab..(s + 1) * vocab], &want));
        }
        let accepted = rng.below(t + 1);
        dec.commit(slot, accepted).expect("commit");
        accepted_seen.push((accepted, t));
        for &d in &drafts[..accepted] {
            model.forward(&[d], &mut reference, Logits::All).expect("advance");
        }
        assert_eq!(dec.position(slot).expect("position"), reference.position);
    }
    (worst, accepted_seen)
}

#[test]
fn verify_and_commit_match_recurrent_decode() {
    let mut failures = Vec::new();
    for (i, dir) in fixtures().into_iter().enumerate() {
        let (model, tokens, _) = load(&dir);
        // A short prompt, so that kv-only sequences verify from their ring before they compress.
        let prefill = 3;
        for form in [
            FormChoice::Replay,
            FormChoice::Recurrent,
            FormChoice::KvOnly,
            FormChoice::Auto,
        ] {
            let (worst, accepted) = verify_walk(&model, &tokens, prefill, form, 17 + i as u64);
            assert!(
                accepted.iter().any(|&(a, _)| a == 0),
                "the walk never rejects every draft"
            );
            assert!(
                accepted.iter().any(|&(a, t)| a == t && t > 1),
                "the walk never accepts a whole window"
            );
            println!(
                "{:<18} verify {form:<9} worst {worst:.2e} accepted {accepted:?}",
                name(&dir)
            );
            if worst > TOLERANCE {
                failures.push(format!("{} verify {form}: {worst:.2e}", name(&dir)));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn mixed_form_batch_equals_each_sequence_alone() {
    for dir in fixtures() {
        let (model, tokens, _) = load(&dir);
        let forms = [
            FormChoice::Recurrent,
            FormChoice::Replay,
            FormChoice::KvOnly,
            FormChoice::Auto,
        ];
        let prefills = [3, 5, 2, 7];
        let steps = 20;
        let config = |slots| DecoderConfig {
            buffer_len: 4,
            ..DecoderConfig::new(slots, tokens.len() + steps)
        };
        // Alone: each sequence in its own decoder, teacher-forced on the fixture's tokens, then greedy.
        let mut alone: Vec<Vec<Vec<f32>>> = Vec::new();
        for (form, &p) in forms.iter().zip(&prefills) {
            let mut dec = Decoder::new(&model, config(1)).expect("decoder");
            let slot = dec.start(*form).expect("slot");
            let mut rows = vec![dec.prefill(slot, &tokens[..p], Logits::Last).expect("prefill")];
            for i in 0..steps {
                let next = tokens.get(p + i).copied().unwrap_or_else(|| argmax(&rows[i]));
                rows.push(dec.decode(&[(slot, next)]).expect("decode"));
            }
            alone.push(rows);
        }
        // Together: one decoder, one batch per step.
        let mut dec = Decoder::new(&model, config(forms.len())).expect("decoder");
        let slots: Vec<usize> = forms.iter().map(|f| dec.start(*f).expect("slot")).collect();
        let vocab = model.config().vocab_size;
        let mut last: Vec<Vec<f32>> = slots
            .iter()
            .zip(&prefills)
            .map(|(&s, &p)| dec.prefill(s, &tokens[..p], Logits::Last).expect("prefill"))
            .collect();
        let mut kinds = std::collections::HashSet::new();
        for i in 0..steps {
            for (k, rows) in alone.iter().enumerate() {
                // Only rounding may differ: the FFN GEMMs run over every row of the batch at once.
                let e = rel(&last[k], &rows[i]);
                assert!(e < 1e-5, "{}: sequence {k} step {i}: {e:.2e}", name(&dir));
            }
            let batch: Vec<(usize, u32)> = slots
                .iter()
                .zip(&prefills)
                .zip(&last)
                .map(|((&s, &p), row)| (s, tokens.get(p + i).copied().unwrap_or_else(|| argmax(row))))
                .collect();
            for &s in &slots {
                kinds.insert(dec.form(s).expect("form"));
            }
            let out = dec.decode(&batch).expect("batch decode");
            last = out.chunks_exact(vocab).map(<[f32]>::to_vec).collect();
        }
        assert!(
            kinds.contains(&DecodeForm::KvOnly) && kinds.contains(&DecodeForm::Replay),
            "{}: the batch never mixed kv-only and replay rows",
            name(&dir)
        );
    }
}

/// Random events over one decoder whose slots hold sequences in every form: batched decodes of random subsets,
/// verifies with random accepted counts. Every row equals the recurrent decode of that sequence's committed history.
#[test]
fn random_events_over_mixed_slots_match_recurrent() {
    let forms = [
        FormChoice::Recurrent,
        FormChoice::Replay,
        FormChoice::KvOnly,
        FormChoice::Auto,
        FormChoice::Replay,
    ];
    let mut failures = Vec::new();
    for (i, dir) in fixtures().into_iter().enumerate() {
        let (model, tokens, _) = load(&dir);
        let vocab = model.config().vocab_size;
        let config = DecoderConfig {
            buffer_len: 6,
            max_verify: 3,
            ..DecoderConfig::new(forms.len(), 200)
        };
        let mut dec = Decoder::new(&model, config).expect("decoder");
        let mut rng = Rng(1000 + i as u64);
        let mut worst = 0.0f64;
        let mut slots = Vec::new();
        let mut refs: Vec<SequenceState> = Vec::new();
        for form in forms {
            let slot = dec.start(form).expect("slot");
            let p = 1 + rng.below(6);
            let mut state = model.new_state();
            let want = model.forward(&tokens[..p], &mut state, Logits::Last).expect("prefill");
            let got = dec.prefill(slot, &tokens[..p], Logits::Last).expect("prefill");
            worst = worst.max(rel(&got, &want));
            slots.push(slot);
            refs.push(state);
        }
        let (mut decodes, mut verifies) = (0, 0);
        for _ in 0..40 {
            if rng.below(3) < 2 {
                let mut members: Vec<usize> = (0..forms.len()).filter(|_| rng.below(2) == 0).collect();
                if members.is_empty() {
                    members.push(rng.below(forms.len()));
                }
                let batch: Vec<(usize, u32)> = members.iter().map(|&k| (slots[k], rng.below(vocab) as u32)).collect();
                let out = dec.decode(&batch).expect("batch decode");
                for (row, (&k, &(_, tok))) in out.chunks_exact(vocab).zip(members.iter().zip(&batch)) {
                    let want = model.forward(&[tok], &mut refs[k], Logits::All).expect("decode");
                    worst = worst.max(rel(row, &want));
                }
                decodes += 1;
            } else {
                let k = rng.below(forms.len());
                let t = 1 + rng.below(3);
                let drafts: Vec<u32> = (0..t).map(|_| rng.below(vocab) as u32).collect();
                let got = dec.verify(slots[k], &drafts).expect("verify");
                let mut probe = refs[k].clone();
                for (s, &d) in drafts.iter().enumerate() {
                    let want = model.forward(&[d], &mut probe, Logits::All).expect("probe");
                    worst = worst.max(rel(&got[s * vocab..(s + 1) * vocab], &want));
                }
                let accepted = rng.below(t + 1);
                dec.commit(slots[k], accepted).expect("commit");
                for &d in &drafts[..accepted] {
                    model.forward(&[d], &mut refs[k], Logits::All).expect("advance");
                }
                verifies += 1;
            }
        }
        for (k, &slot) in slots.iter().enumerate() {
            assert_eq!(dec.position(slot).expect("position"), refs[k].position);
        }
        println!(
            "{:<18} random events: {decodes} batched decodes, {verifies} verifies, worst {worst:.2e}",
            name(&dir)
        );
        if worst > TOLERANCE {
            failures.push(format!("{}: {worst:.2e}", name(&dir)));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Context length at which the threshold tests switch kv-only to replay: far past the default ring `L = 16` and
/// past every fixture's key dim, so a coupling of the threshold to `L` or to the key dim would show.
const THRESHOLD: usize = 40;

/// A one-slot decoder with the default ring length `L = 16` and the given threshold and verify window.
fn threshold_decoder(model: &Model, threshold: Option<usize>, max_verify: usize, context: usize) -> Decoder<'_> {
    let config = DecoderConfig {
        max_verify,
        kv_only_threshold: threshold,
        ..DecoderConfig::new(1, context)
    };
    assert_eq!(config.buffer_len, 16, "the default buffer length");
    Decoder::new(model, config).expect("decoder")
}

/// kv-only and auto keep no state (no checkpoint read or written, form `KvOnly`) while the context is below the
/// threshold — with the default `L = 16`, an explicit threshold of 40 and the default one (the key dim) — then
/// compress once and continue in replay, with the recurrent form's logits and greedy tokens throughout.
#[test]
fn kv_only_and_auto_stay_stateless_below_the_threshold() {
    let mut failures = Vec::new();
    for dir in fixtures() {
        let (model, tokens, _) = load(&dir);
        let prefill = 3;
        let total = tokens.len().max(THRESHOLD + 12);
        // The recurrent reference, teacher-forced on the fixture's tokens and greedy after them.
        let mut state = model.new_state();
        let mut want = vec![model
            .forward(&tokens[..prefill], &mut state, Logits::Last)
            .expect("prefill")];
        let mut all = tokens[..prefill].to_vec();
        for i in prefill..total {
            all.push(tokens.get(i).copied().unwrap_or_else(|| argmax(&want[i - prefill])));
            want.push(model.forward(&all[i..=i], &mut state, Logits::All).expect("decode"));
        }
        let default_threshold = rewind_engine::state::memory::kv_only_threshold(model.config());
        for (threshold, expect) in [(Some(THRESHOLD), THRESHOLD), (None, default_threshold)] {
            for form in [FormChoice::KvOnly, FormChoice::Auto] {
                let mut dec = threshold_decoder(&model, threshold, 1, total);
                assert_eq!(dec.kv_only_threshold(), expect);
                let slot = dec.start(form).expect("slot");
                let mut got = vec![dec.prefill(slot, &all[..prefill], Logits::Last).expect("prefill")];
                let mut switched_at = None;
                for (i, &tok) in all.iter().enumerate().skip(prefill) {
                    got.push(dec.decode(&[(slot, tok)]).expect("decode"));
                    let (f, tr) = (dec.form(slot).expect("form"), dec.last_traffic());
                    // `i` tokens were committed before this step.
                    if i < expect {
                        assert_eq!(f, DecodeForm::KvOnly, "{} {form}: context {i}", name(&dir));
                        assert_eq!(
                            (tr.state_read, tr.state_written),
                            (0, 0),
                            "{} {form}: context {i}: kv-only reads no state",
                            name(&dir)
                        );
                    } else {
                        assert_eq!(f, DecodeForm::Replay, "{} {form}: context {i}", name(&dir));
                        assert!(tr.state_read > 0, "{} {form}: context {i}", name(&dir));
                        switched_at.get_or_insert(i);
                    }
                }
                assert_eq!(switched_at, Some(expect.max(prefill)), "{} {form}", name(&dir));
                let mut worst = 0.0f64;
                for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                    worst = worst.max(rel(g, w));
                    if argmax(g) != argmax(w) && k + prefill >= tokens.len() {
                        failures.push(format!(
                            "{} {form} threshold {expect}: greedy differs at {k}",
                            name(&dir)
                        ));
                    }
                }
                println!(
                    "{:<18} {form:<9} threshold {expect:>2} L=16 switched at {switched_at:?} worst {worst:.2e}",
                    name(&dir)
                );
                if worst > TOLERANCE {
                    failures.push(format!("{} {form} threshold {expect}: {worst:.2e}", name(&dir)));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A verify window that crosses the threshold runs kv-only (its ring holds `threshold + T` entries); whatever it
/// commits, the first step with the committed context at or past the threshold compresses into replay. Every row
/// matches the recurrent decode.
#[test]
fn a_verify_window_crossing_the_threshold_stays_kv_only() {
    const T: usize = 4;
    let mut failures = Vec::new();
    for dir in fixtures() {
        let (model, tokens, _) = load(&dir);
        let vocab = model.config().vocab_size;
        let prefill = 3;
        for form in [FormChoice::KvOnly, FormChoice::Auto] {
            for accepted in [T, 2, 1, 0] {
                let mut dec = threshold_decoder(&model, Some(THRESHOLD), T, THRESHOLD + 4 * T);
                let slot = dec.start(form).expect("slot");
                let mut reference: SequenceState = model.new_state();
                let got = dec.prefill(slot, &tokens[..prefill], Logits::Last).expect("prefill");
                let want = model
                    .forward(&tokens[..prefill], &mut reference, Logits::Last)
                    .expect("prefill");
                let mut worst = rel(&got, &want);
                let mut rng = Rng(7 + accepted as u64);
                // Plain decodes up to two tokens below the threshold.
                while dec.position(slot).expect("position") < THRESHOLD - 2 {
                    let tok = rng.below(vocab) as u32;
                    let got = dec.decode(&[(slot, tok)]).expect("decode");
                    let want = model.forward(&[tok], &mut reference, Logits::All).expect("decode");
                    worst = worst.max(rel(&got, &want));
                }
                assert_eq!(dec.form(slot).expect("form"), DecodeForm::KvOnly);
                // The window covers positions threshold − 2 .. threshold + 2.
                let drafts: Vec<u32> = (0..T).map(|_| rng.below(vocab) as u32).collect();
                let got = dec.verify(slot, &drafts).expect("verify");
                let tr = dec.last_traffic();
                assert_eq!(
                    (dec.form(slot).expect("form"), tr.state_read, tr.state_written),
                    (DecodeForm::KvOnly, 0, 0),
                    "{} {form}: the crossing verify keeps no state",
                    name(&dir)
                );
                let mut probe = reference.clone();
                for (s, &d) in drafts.iter().enumerate() {
                    let want = model.forward(&[d], &mut probe, Logits::All).expect("probe");
                    worst = worst.max(rel(&got[s * vocab..(s + 1) * vocab], &want));
                }
                dec.commit(slot, accepted).expect("commit");
                for &d in &drafts[..accepted] {
                    model.forward(&[d], &mut reference, Logits::All).expect("advance");
                }
                let context = THRESHOLD - 2 + accepted;
                assert_eq!(dec.pools().counters().ring_len()[slot] as usize, context);
                // Steps until a few past the switch: kv-only exactly while the committed context is below it.
                for _ in 0..6 {
                    let before = dec.position(slot).expect("position");
                    let tok = rng.below(vocab) as u32;
                    let got = dec.decode(&[(slot, tok)]).expect("decode");
                    let want = model.forward(&[tok], &mut reference, Logits::All).expect("decode");
                    worst = worst.max(rel(&got, &want));
                    let (f, tr) = (dec.form(slot).expect("form"), dec.last_traffic());
                    if before < THRESHOLD {
                        assert_eq!((f, tr.state_read), (DecodeForm::KvOnly, 0), "{}", name(&dir));
                    } else {
                        assert_eq!(f, DecodeForm::Replay, "{}", name(&dir));
                        assert!(tr.state_read > 0);
                    }
                }
                // Replay verifies after the switch.
                for _ in 0..3 {
                    let drafts: Vec<u32> = (0..T).map(|_| rng.below(vocab) as u32).collect();
                    let got = dec.verify(slot, &drafts).expect("verify");
                    let mut probe = reference.clone();
                    for (s, &d) in drafts.iter().enumerate() {
                        let want = model.forward(&[d], &mut probe, Logits::All).expect("probe");
                        worst = worst.max(rel(&got[s * vocab..(s + 1) * vocab], &want));
                    }
                    let a = rng.below(T + 1);
                    dec.commit(slot, a).expect("commit");
                    for &d in &drafts[..a] {
                        model.forward(&[d], &mut reference, Logits::All).expect("advance");
                    }
                }
                assert_eq!(dec.form(slot).expect("form"), DecodeForm::Replay);
                assert_eq!(dec.position(slot).expect("position"), reference.position);
                println!(
                    "{:<18} crossing verify {form:<9} accepted {accepted} worst {worst:.2e}",
                    name(&dir)
                );
                if worst > TOLERANCE {
                    failures.push(format!("{} {form} accepted {accepted}: {worst:.2e}", name(&dir)));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
