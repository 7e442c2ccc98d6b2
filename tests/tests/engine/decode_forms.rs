//! The decode forms at model level, on every fixture under `tests/fixtures/`: replay (`L = 3` and 16), kv-only and
//! auto decode give the recurrent form's greedy tokens and logits within 1e-4 relative at every position, across
//! flushes and compressions; speculative verify + commit (replay, kv-only and the recurrent baseline) reproduces the
//! recurrent decode of the same committed history under a random walk of accepted counts; a batch mixing forms
//! equals each sequence run alone; and kv-only / auto keep no state until the context reaches the kv-only threshold
//! (independent of `L`, also when a verify window crosses it), then continue in replay.
//!
//! The oracle is the recurrent form at TP = 1 in a decoder of its own ([`Oracle`]): a prompt through the chunked
//! scan, then one token at a time. The rows a verify must give are probed without advancing the reference: its slot's
//! snapshot is restored into a spare slot, which decodes the drafts and is released. The recurrent prefill itself is
//! checked against the recurrent decode of every token from position 0.

use std::path::Path;

use rewind_engine::decode::{Decoder, DecoderConfig, FormChoice};
use rewind_engine::rank::Rows;
use rewind_engine::state::DecodeForm;
use rewind_tests::{argmax, fixtures, name, rel, single, tokens, Rng};

/// max |Δlogit| / max |logit| allowed against the recurrent form.
const TOLERANCE: f64 = 1e-4;
/// Greedy tokens decoded after the fixture's tokens.
const EXTRA: usize = 14;

/// The recurrent form at TP = 1, independent of the decoder under test: one slot per reference sequence plus a spare
/// that probes restore into.
struct Oracle {
    dec: Decoder,
    vocab: usize,
    /// Reference sequences started so far (they hold slots `0..started`).
    started: usize,
    spare: usize,
}

impl Oracle {
    /// Room for `sequences` reference sequences of up to `context` tokens.
    fn new(dir: &Path, sequences: usize, context: usize) -> Self {
        let dec = single(dir, DecoderConfig::new(sequences + 1, context));
        let vocab = dec.model().config().vocab_size;
        Oracle {
            dec,
            vocab,
            started: 0,
            spare: sequences,
        }
    }

    /// Starts a reference sequence with `prompt` (one chunked prefill); returns its slot and the prompt's last
    /// logits.
    fn start(&mut self, prompt: &[u32]) -> (usize, Vec<f32>) {
        let slot = self.started;
        assert!(slot < self.spare, "the oracle holds {} sequences", self.spare);
        self.dec.start_at(slot, FormChoice::Recurrent).expect("oracle slot");
        self.started += 1;
        let row = self.dec.prefill(slot, prompt, Rows::Last).expect("oracle prefill");
        (slot, row)
    }

    /// Appends `token` to a reference sequence; its logits.
    fn decode(&mut self, slot: usize, token: u32) -> Vec<f32> {
        self.dec.decode(&[(slot, token)]).expect("oracle decode")
    }

    /// The rows `[T, vocab]` a verify of `drafts` after the sequence in `slot` must give, leaving the sequence as it
    /// is: its snapshot restored into the spare slot decodes the drafts one at a time, then the spare is released.
    fn probe(&mut self, slot: usize, drafts: &[u32]) -> Vec<f32> {
        let snap = self.dec.snapshot(slot).expect("oracle snapshot");
        self.dec.restore(self.spare, &snap).expect("oracle restore");
        let mut rows = Vec::with_capacity(drafts.len() * self.vocab);
        for &d in drafts {
            rows.extend(self.decode(self.spare, d));
        }
        self.dec.release(self.spare).expect("oracle release");
        rows
    }

    /// Appends the accepted drafts to a reference sequence. Their logits must be exactly the probe's rows: a restored
    /// snapshot continues as the sequence itself.
    fn commit(&mut self, slot: usize, accepted: &[u32], probed: &[f32]) {
        for (s, &d) in accepted.iter().enumerate() {
            let row = self.decode(slot, d);
            assert!(
                row[..] == probed[s * self.vocab..(s + 1) * self.vocab],
                "a probe through snapshot / restore differs from the reference's own decode at draft {s}"
            );
        }
    }

    /// A reference sequence's committed tokens.
    fn position(&self, slot: usize) -> usize {
        self.dec.position(slot).expect("oracle position")
    }
}

/// One sequence decoded in `form`: `tokens[..prefill]` through prefill, then every later token one at a time.
/// Returns the logits of the prefill's last position and of every decode step.
fn run_form(dir: &Path, form: FormChoice, buffer_len: usize, tokens: &[u32], prefill: usize) -> Vec<Vec<f32>> {
    let config = DecoderConfig {
        buffer_len,
        ..DecoderConfig::new(1, tokens.len())
    };
    let mut dec = single(dir, config);
    let slot = dec.start(form).expect("slot");
    let mut rows = vec![dec.prefill(slot, &tokens[..prefill], Rows::Last).expect("prefill")];
    for &t in &tokens[prefill..] {
        rows.push(dec.decode(&[(slot, t)]).expect("decode"));
    }
    rows
}

/// The fixture's tokens followed by `EXTRA` greedy tokens of the recurrent form, and the recurrent logits (of the
/// prefill's last position, then of every decode step).
fn recurrent_reference(dir: &Path, tokens: &[u32], prefill: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut oracle = Oracle::new(dir, 1, tokens.len() + EXTRA);
    let (slot, first) = oracle.start(&tokens[..prefill]);
    let mut rows = vec![first];
    let mut all = tokens.to_vec();
    for i in prefill..tokens.len() + EXTRA {
        if i >= tokens.len() {
            all.push(argmax(rows.last().expect("row")));
        }
        rows.push(oracle.decode(slot, all[i]));
    }
    all.truncate(tokens.len() + EXTRA);
    (all, rows)
}

/// The recurrent form decoding every token one at a time from position 0 (no chunked scan): the logits after each.
fn token_by_token(dir: &Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut dec = single(dir, DecoderConfig::new(1, tokens.len()));
    let slot = dec.start(FormChoice::Recurrent).expect("slot");
    tokens
        .iter()
        .map(|&t| dec.decode(&[(slot, t)]).expect("decode"))
        .collect()
}

#[test]
fn every_form_matches_recurrent_on_every_fixture() {
    let mut failures = Vec::new();
    for dir in fixtures() {
        let (tokens, fixture_prefill) = tokens(&dir);
        for prefill in [fixture_prefill, 1] {
            let (all, want) = recurrent_reference(&dir, &tokens, prefill);
            // Chunked == recurrent at model level: the reference's prefill + decode is its own token-by-token decode.
            let direct = token_by_token(&dir, &all);
            assert_eq!(direct.len() - (prefill - 1), want.len());
            for (i, (d, w)) in direct[prefill - 1..].iter().zip(&want).enumerate() {
                let e = rel(w, d);
                assert!(
                    e < TOLERANCE,
                    "{}: recurrent prefill {prefill} + decode vs token-by-token decode at step {i}: {e:.2e}",
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
                let got = run_form(&dir, form, l, inputs, prefill);
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
fn verify_walk(dir: &Path, tokens: &[u32], prefill: usize, form: FormChoice, seed: u64) -> (f64, Vec<(usize, usize)>) {
    const T_MAX: usize = 4;
    let steps = 24;
    let context = prefill + steps * T_MAX + 8;
    let config = DecoderConfig {
        buffer_len: 8,
        max_verify: T_MAX,
        ..DecoderConfig::new(1, context)
    };
    let mut dec = single(dir, config);
    let vocab = dec.model().config().vocab_size;
    let slot = dec.start(form).expect("slot");
    let mut oracle = Oracle::new(dir, 1, context);
    let first = dec.prefill(slot, &tokens[..prefill], Rows::Last).expect("prefill");
    let (reference, want) = oracle.start(&tokens[..prefill]);
    let mut worst = rel(&first, &want);
    let mut rng = Rng(seed);
    let mut accepted_seen = Vec::new();
    for step in 0..steps {
        if step % 5 == 4 {
            // A plain decode step between speculative ones.
            let tok = rng.below(vocab) as u32;
            let got = dec.decode(&[(slot, tok)]).expect("decode");
            let want = oracle.decode(reference, tok);
            worst = worst.max(rel(&got, &want));
            continue;
        }
        let t = 1 + rng.below(T_MAX);
        let drafts: Vec<u32> = (0..t).map(|_| rng.below(vocab) as u32).collect();
        let got = dec.verify(slot, &drafts).expect("verify");
        assert_eq!(got.len(), t * vocab);
        let probed = oracle.probe(reference, &drafts);
        for s in 0..t {
            let row = s * vocab..(s + 1) * vocab;
            worst = worst.max(rel(&got[row.clone()], &probed[row]));
        }
        let accepted = rng.below(t + 1);
        dec.commit(slot, accepted).expect("commit");
        accepted_seen.push((accepted, t));
        oracle.commit(reference, &drafts[..accepted], &probed);
        assert_eq!(dec.position(slot).expect("position"), oracle.position(reference));
    }
    (worst, accepted_seen)
}

#[test]
fn verify_and_commit_match_recurrent_decode() {
    let mut failures = Vec::new();
    for (i, dir) in fixtures().into_iter().enumerate() {
        let (tokens, _) = tokens(&dir);
        // A short prompt, so that kv-only sequences verify from their ring before they compress.
        let prefill = 3;
        for form in [
            FormChoice::Replay,
            FormChoice::Recurrent,
            FormChoice::KvOnly,
            FormChoice::Auto,
        ] {
            let (worst, accepted) = verify_walk(&dir, &tokens, prefill, form, 17 + i as u64);
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
        let (tokens, _) = tokens(&dir);
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
            let mut dec = single(&dir, config(1));
            let slot = dec.start(*form).expect("slot");
            let mut rows = vec![dec.prefill(slot, &tokens[..p], Rows::Last).expect("prefill")];
            for i in 0..steps {
                let next = tokens.get(p + i).copied().unwrap_or_else(|| argmax(&rows[i]));
                rows.push(dec.decode(&[(slot, next)]).expect("decode"));
            }
            alone.push(rows);
        }
        // Together: one decoder, one batch per step.
        let mut dec = single(&dir, config(forms.len()));
        let slots: Vec<usize> = forms.iter().map(|f| dec.start(*f).expect("slot")).collect();
        let vocab = dec.model().config().vocab_size;
        let mut last: Vec<Vec<f32>> = slots
            .iter()
            .zip(&prefills)
            .map(|(&s, &p)| dec.prefill(s, &tokens[..p], Rows::Last).expect("prefill"))
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
        let (tokens, _) = tokens(&dir);
        let config = DecoderConfig {
            buffer_len: 6,
            max_verify: 3,
            ..DecoderConfig::new(forms.len(), 200)
        };
        let mut dec = single(&dir, config);
        let vocab = dec.model().config().vocab_size;
        let mut oracle = Oracle::new(&dir, forms.len(), 200);
        let mut rng = Rng(1000 + i as u64);
        let mut worst = 0.0f64;
        let mut slots = Vec::new();
        let mut refs = Vec::new();
        for form in forms {
            let slot = dec.start(form).expect("slot");
            let p = 1 + rng.below(6);
            let (reference, want) = oracle.start(&tokens[..p]);
            let got = dec.prefill(slot, &tokens[..p], Rows::Last).expect("prefill");
            worst = worst.max(rel(&got, &want));
            slots.push(slot);
            refs.push(reference);
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
                    let want = oracle.decode(refs[k], tok);
                    worst = worst.max(rel(row, &want));
                }
                decodes += 1;
            } else {
                let k = rng.below(forms.len());
                let t = 1 + rng.below(3);
                let drafts: Vec<u32> = (0..t).map(|_| rng.below(vocab) as u32).collect();
                let got = dec.verify(slots[k], &drafts).expect("verify");
                let probed = oracle.probe(refs[k], &drafts);
                for s in 0..t {
                    let row = s * vocab..(s + 1) * vocab;
                    worst = worst.max(rel(&got[row.clone()], &probed[row]));
                }
                let accepted = rng.below(t + 1);
                dec.commit(slots[k], accepted).expect("commit");
                oracle.commit(refs[k], &drafts[..accepted], &probed);
                verifies += 1;
            }
        }
        for (k, &slot) in slots.iter().enumerate() {
            assert_eq!(dec.position(slot).expect("position"), oracle.position(refs[k]));
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
fn threshold_decoder(dir: &Path, threshold: Option<usize>, max_verify: usize, context: usize) -> Decoder {
    let config = DecoderConfig {
        max_verify,
        kv_only_threshold: threshold,
        ..DecoderConfig::new(1, context)
    };
    assert_eq!(config.buffer_len, 16, "the default buffer length");
    single(dir, config)
}

/// kv-only and auto keep no state (no checkpoint read or written, form `KvOnly`) while the context is below the
/// threshold — with the default `L = 16`, an explicit threshold of 40 and the default one (the key dim) — then
/// compress once and continue in replay, with the recurrent form's logits and greedy tokens throughout.
#[test]
fn kv_only_and_auto_stay_stateless_below_the_threshold() {
    let mut failures = Vec::new();
    for dir in fixtures() {
        let (tokens, _) = tokens(&dir);
        let prefill = 3;
        let total = tokens.len().max(THRESHOLD + 12);
        // The recurrent reference, teacher-forced on the fixture's tokens and greedy after them.
        let mut oracle = Oracle::new(&dir, 1, total);
        let (reference, first) = oracle.start(&tokens[..prefill]);
        let mut want = vec![first];
        let mut all = tokens[..prefill].to_vec();
        for i in prefill..total {
            all.push(tokens.get(i).copied().unwrap_or_else(|| argmax(&want[i - prefill])));
            want.push(oracle.decode(reference, all[i]));
        }
        let default_threshold = rewind_engine::state::memory::kv_only_threshold(oracle.dec.model().config());
        for (threshold, expect) in [(Some(THRESHOLD), THRESHOLD), (None, default_threshold)] {
            for form in [FormChoice::KvOnly, FormChoice::Auto] {
                let mut dec = threshold_decoder(&dir, threshold, 1, total);
                assert_eq!(dec.kv_only_threshold(), expect);
                let slot = dec.start(form).expect("slot");
                let mut got = vec![dec.prefill(slot, &all[..prefill], Rows::Last).expect("prefill")];
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
        let (tokens, _) = tokens(&dir);
        let prefill = 3;
        for form in [FormChoice::KvOnly, FormChoice::Auto] {
            for accepted in [T, 2, 1, 0] {
                // Room for the walk: at most THRESHOLD + 2 + 6 decodes + 3 whole windows, and the last window.
                let context = THRESHOLD + 6 * T;
                let mut dec = threshold_decoder(&dir, Some(THRESHOLD), T, context);
                let vocab = dec.model().config().vocab_size;
                let slot = dec.start(form).expect("slot");
                let mut oracle = Oracle::new(&dir, 1, context);
                let got = dec.prefill(slot, &tokens[..prefill], Rows::Last).expect("prefill");
                let (reference, want) = oracle.start(&tokens[..prefill]);
                let mut worst = rel(&got, &want);
                let mut rng = Rng(7 + accepted as u64);
                // Plain decodes up to two tokens below the threshold.
                while dec.position(slot).expect("position") < THRESHOLD - 2 {
                    let tok = rng.below(vocab) as u32;
                    let got = dec.decode(&[(slot, tok)]).expect("decode");
                    let want = oracle.decode(reference, tok);
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
                let probed = oracle.probe(reference, &drafts);
                for s in 0..T {
                    let row = s * vocab..(s + 1) * vocab;
                    worst = worst.max(rel(&got[row.clone()], &probed[row]));
                }
                dec.commit(slot, accepted).expect("commit");
                oracle.commit(reference, &drafts[..accepted], &probed);
                let context = THRESHOLD - 2 + accepted;
                assert_eq!(dec.pools().counters().ring_len()[slot] as usize, context);
                // Steps until a few past the switch: kv-only exactly while the committed context is below it.
                for _ in 0..6 {
                    let before = dec.position(slot).expect("position");
                    let tok = rng.below(vocab) as u32;
                    let got = dec.decode(&[(slot, tok)]).expect("decode");
                    let want = oracle.decode(reference, tok);
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
                    let probed = oracle.probe(reference, &drafts);
                    for s in 0..T {
                        let row = s * vocab..(s + 1) * vocab;
                        worst = worst.max(rel(&got[row.clone()], &probed[row]));
                    }
                    let a = rng.below(T + 1);
                    dec.commit(slot, a).expect("commit");
                    oracle.commit(reference, &drafts[..a], &probed);
                }
                assert_eq!(dec.form(slot).expect("form"), DecodeForm::Replay);
                assert_eq!(dec.position(slot).expect("position"), oracle.position(reference));
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
