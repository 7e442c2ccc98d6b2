//! Draft-model drafter tests on tiny random checkpoints: a draft model that is the target drafts the target's own
//! greedy continuation through partial acceptance, catch-ups and restarts; vocabulary and tokenizer checks; sampled
//! drafts' distributions; slot bookkeeping.

use std::path::Path;

use rewind_kernels::cpu::sample::kept_weights;

use super::worker::pick;
use super::*;
use crate::decode::FormChoice;
use crate::decode::Rows;
use crate::model::Family;
use crate::sample::argmax;

fn tiny(family: Family, seed: u64) -> tempfile::TempDir {
    crate::init::tiny_checkpoint(family, seed)
}

fn vocab_of(dir: &Path) -> usize {
    ModelConfig::from_dir(dir).expect("config").vocab_size
}

/// A plain decoder of the checkpoint in `dir` with `stream` prefilled; returns it, its slot and the last row.
fn prefilled(dir: &Path, stream: &[u32]) -> (Decoder, usize, Vec<f32>) {
    let model = ShardedModel::from_dir(dir, 1, 0).expect("load");
    let mut dec = Decoder::single(model, DecoderConfig::new(1, 256)).expect("decoder");
    let slot = dec.start(FormChoice::Replay).expect("slot");
    let row = dec.prefill(slot, stream, Rows::Last).expect("prefill");
    (dec, slot, row)
}

/// The greedy continuation of `stream` by `n` tokens: a prefill, then decode steps.
fn greedy(dir: &Path, stream: &[u32], n: usize) -> Vec<u32> {
    let (mut dec, slot, mut row) = prefilled(dir, stream);
    let mut out = Vec::with_capacity(n);
    loop {
        let t = argmax(&row);
        out.push(t);
        if out.len() == n {
            return out;
        }
        row = dec.decode(&[(slot, t)]).expect("decode");
    }
}

fn propose(d: &mut DraftModelDrafter, tokens: &[u32], max: usize) -> Draft {
    d.propose(&DraftInput {
        tokens,
        hidden: None,
        max,
    })
    .expect("propose")
}

fn err_text<T: std::fmt::Debug>(r: Result<T>) -> String {
    match r {
        Err(e) => e.to_string(),
        Ok(v) => panic!("expected an error, got {v:?}"),
    }
}

/// A draft model that is the target, drafting greedily, proposes the target's greedy continuation: for 1 to 4
/// drafts, and on one session through every way a coordinator's stream grows.
#[test]
fn the_target_as_its_own_draft_model_drafts_its_greedy_continuation() {
    for family in [Family::NemotronH, Family::Qwen35] {
        let dir = tiny(family, 11);
        let path = dir.path();
        let vocab = vocab_of(path);
        let model = DraftModel::load(path, vocab, 2, 256, 4, Some(path)).expect("load");
        let prompt: Vec<u32> = vec![5, 17, 42, 9, 100, 3];
        let g = greedy(path, &prompt, 4);
        for k in 1..=4 {
            let mut s = model.session(DraftSampling::greedy()).expect("session");
            assert_eq!(s.name(), "draft");
            let d = propose(&mut s, &prompt, k);
            assert_eq!(d.tokens, g[..k], "{family:?}: {k} drafts");
            assert_eq!(d.probs, None);
        }

        let mut s = model.session(DraftSampling::greedy()).expect("session");
        let mut stream = prompt.clone();
        let check = |s: &mut DraftModelDrafter, stream: &[u32], what: &str| {
            let want = greedy(path, stream, 4);
            assert_eq!(propose(s, stream, 4).tokens, want, "{family:?}: {what}");
            want
        };
        assert_eq!(propose(&mut s, &stream, 3).tokens, g[..3]);
        // The coordinator accepts 1 of the 3 drafts, then the target's token differs from draft 2.
        stream.extend([g[0], (g[1] + 1) % vocab as u32]);
        let d = check(&mut s, &stream, "after accepting 1 of 3");
        // Every draft accepted, then the bonus token: two tokens to catch up.
        stream.extend(&d);
        stream.push(greedy(path, &stream, 1)[0]);
        let d = check(&mut s, &stream, "after accepting all");
        // None accepted.
        stream.push((d[0] + 3) % vocab as u32);
        check(&mut s, &stream, "after accepting none");
        // More than a verify takes at once: a prefill catches up.
        stream.extend((0..13u32).map(|i| (i * 37 + 1) % vocab as u32));
        check(&mut s, &stream, "after a long catch-up");
        // A few tokens more than fit beside 4 drafts: a verify catches up.
        stream.extend([8, 6, 4, 2]);
        check(&mut s, &stream, "after a short catch-up");
        // A stream that is not a continuation restarts the slot.
        check(&mut s, &[9, 8, 7], "after a rewritten stream");
        check(&mut s, &[4], "from a one-token stream");
        check(&mut s, &[4, 2], "from a one-token stream's continuation");
        check(&mut s, &[4, 2], "from the same stream again");
    }
}

/// Near the context limit a proposal drafts fewer tokens, and none past it, without an error.
#[test]
fn drafts_stop_at_the_context_limit() {
    let dir = tiny(Family::NemotronH, 3);
    let path = dir.path();
    let model = DraftModel::load(path, vocab_of(path), 1, 16, 4, None).expect("load");
    assert_eq!((model.max_context(), model.max_verify(), model.window()), (16, 6, 4));
    let mut s = model.session(DraftSampling::greedy()).expect("session");
    let mut stream: Vec<u32> = (1..=12).collect();
    assert_eq!(propose(&mut s, &stream, 4).tokens, greedy(path, &stream, 4));
    for (n, drafts) in [(14, 3), (15, 2), (16, 1), (17, 0), (30, 0)] {
        stream.resize(n, 7);
        let d = propose(&mut s, &stream, 4);
        let want = if drafts > 0 {
            greedy(path, &stream, drafts)
        } else {
            Vec::new()
        };
        assert_eq!(d.tokens, want, "a stream of {n} tokens");
    }
    // A shorter stream restarts and drafts again.
    stream.truncate(5);
    assert_eq!(propose(&mut s, &stream, 4).tokens, greedy(path, &stream, 4));
    assert_eq!(propose(&mut s, &[], 4), Draft::default());
}

#[test]
fn a_different_vocabulary_or_tokenizer_is_refused() {
    let dir = tiny(Family::NemotronH, 5);
    let path = dir.path();
    let vocab = vocab_of(path);
    let e = err_text(DraftModel::load(path, vocab + 1, 1, 64, 4, None));
    let want = format!(
        "the draft model in {} has a vocabulary of {vocab} tokens, the target's has {}; a draft model must share \
         the target's tokenizer",
        path.display(),
        vocab + 1
    );
    assert!(e.contains(&want), "`{e}`");

    // A target whose tokenizer.json is written differently but maps the same ids passes; one with two ids swapped
    // does not.
    let text = std::fs::read_to_string(path.join("tokenizer.json")).expect("tokenizer.json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("json");
    let target = tempfile::tempdir().expect("tempdir");
    let compact = serde_json::to_string(&json).expect("json");
    assert_ne!(compact, text, "the same bytes prove nothing");
    std::fs::write(target.path().join("tokenizer.json"), compact).expect("write");
    DraftModel::load(path, vocab, 1, 64, 4, Some(target.path())).expect("the same vocabulary");

    let mut swapped = json;
    let map = swapped["model"]["vocab"].as_object_mut().expect("a vocab map");
    let key = |id: u64| {
        map.iter()
            .find(|(_, v)| v.as_u64() == Some(id))
            .map(|(k, _)| k.clone())
            .expect("id in the vocab")
    };
    let (a, b) = (key(300), key(301));
    map.insert(a.clone(), 301.into());
    map.insert(b, 300.into());
    std::fs::write(
        target.path().join("tokenizer.json"),
        serde_json::to_string(&swapped).expect("json"),
    )
    .expect("write");
    let e = err_text(DraftModel::load(path, vocab, 1, 64, 4, Some(target.path())));
    assert!(
        e.contains("has a different tokenizer from the target's") && e.contains("in the draft's and id"),
        "`{e}`"
    );
}

#[test]
fn sampled_drafts_come_with_their_distributions() {
    let dir = tiny(Family::Qwen35, 7);
    let path = dir.path();
    let vocab = vocab_of(path);
    let model = DraftModel::load(path, vocab, 2, 128, 4, None).expect("load");
    let sampling = DraftSampling {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.0,
        seed: 7,
    };
    let prompt: Vec<u32> = vec![11, 22, 33, 44];
    let mut a = model.session(sampling.clone()).expect("session");
    let first = propose(&mut a, &prompt, 4);
    let probs = first.probs.clone().expect("sampled drafts have probabilities");
    assert_eq!((first.tokens.len(), probs.len()), (4, 4));
    for (q, &d) in probs.iter().zip(&first.tokens) {
        assert_eq!(q.len(), vocab);
        let sum: f32 = q.iter().sum();
        assert!((sum - 1.0).abs() < 1e-4, "sum {sum}");
        assert!(q.iter().all(|&p| (0.0..=1.0).contains(&p)));
        assert!(q[d as usize] > 0.0, "draft {d} has q = 0");
        assert!(q.iter().filter(|&&p| p > 0.0).count() <= 40, "top-k keeps 40");
    }
    // q_1 is the filtered distribution of the model's logits after the prompt.
    let (_, _, row) = prefilled(path, &prompt);
    let kept = kept_weights(&row, 0.8, 40, 0.95, 0.0);
    let total: f32 = kept.iter().map(|&(_, w)| w).sum();
    for &(id, w) in &kept {
        assert!((probs[0][id as usize] - w / total).abs() < 1e-4, "q_1 of token {id}");
    }

    // The same seed draws the same drafts, round after round.
    let mut b = model.session(sampling).expect("session");
    assert_eq!(propose(&mut b, &prompt, 4), first);
    let mut stream = prompt.clone();
    stream.extend([first.tokens[0], 3]);
    assert_eq!(propose(&mut a, &stream, 4), propose(&mut b, &stream, 4));
}

/// Proposals announced together ([`Drafter::prepare`]) run as one batch and give what each session proposes on its
/// own: greedy and sampled sessions of different streams (a fresh prefill, a catch-up, a one-token stream), round
/// after round; a proposal asked with another input than announced runs on its own.
#[test]
fn batched_proposals_equal_proposals_one_by_one() {
    let dir = tiny(Family::NemotronH, 13);
    let path = dir.path();
    let vocab = vocab_of(path);
    let sampled = DraftSampling {
        temperature: 0.8,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 5,
    };
    let samplings = [
        DraftSampling::greedy(),
        sampled.clone(),
        DraftSampling::greedy(),
        sampled,
    ];
    let mut streams: Vec<Vec<u32>> = vec![vec![5, 17, 42, 9, 100, 3], vec![11, 22, 33, 44], vec![7], vec![1, 2, 3]];
    let open = |m: &Arc<DraftModel>| -> Vec<DraftModelDrafter> {
        samplings
            .iter()
            .map(|s| m.session(s.clone()).expect("session"))
            .collect()
    };
    let (batched_model, single_model) = (
        DraftModel::load(path, vocab, 4, 256, 4, None).expect("load"),
        DraftModel::load(path, vocab, 4, 256, 4, None).expect("load"),
    );
    let (mut batched, mut single) = (open(&batched_model), open(&single_model));
    for round in 0..4 {
        let maxes = [4, 3, 4, 1 + round % 4];
        let input = |i: usize| DraftInput {
            tokens: &streams[i],
            hidden: None,
            max: maxes[i],
        };
        for (i, s) in batched.iter_mut().enumerate() {
            s.prepare(&input(i)).expect("prepare");
        }
        let got: Vec<Draft> = batched
            .iter_mut()
            .enumerate()
            .map(|(i, s)| s.propose(&input(i)).expect("batched"))
            .collect();
        let want: Vec<Draft> = single
            .iter_mut()
            .enumerate()
            .map(|(i, s)| s.propose(&input(i)).expect("single"))
            .collect();
        assert_same(&got, &want, &format!("round {round}"));
        // Streams grow as a coordinator's do: the first draft accepted, then a token of the target's; a long jump
        // for one of them (a prefill catch-up).
        for (i, (stream, d)) in streams.iter_mut().zip(&got).enumerate() {
            stream.extend(d.tokens.first());
            stream.push(((round * 31 + i * 7 + 1) % vocab) as u32);
            if i == 1 && round == 1 {
                stream.extend((0..12u32).map(|t| (t * 13 + 2) % vocab as u32));
            }
        }
    }
    // Announced with one input, asked with another: the announced batch is dropped for that session.
    let stream: Vec<u32> = vec![9, 9, 9];
    batched[0]
        .prepare(&DraftInput {
            tokens: &stream,
            hidden: None,
            max: 2,
        })
        .expect("prepare");
    let asked = propose(&mut batched[0], &stream, 3);
    assert_same(
        &[asked],
        &[propose(&mut single[0], &stream, 3)],
        "asked with another input",
    );
}

/// Asserts equal drafts, and their distributions equal to float rounding (a batched head sums in another order).
fn assert_same(got: &[Draft], want: &[Draft], what: &str) {
    let tokens = |d: &[Draft]| d.iter().map(|d| d.tokens.clone()).collect::<Vec<_>>();
    assert_eq!(tokens(got), tokens(want), "{what}");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.probs.is_some(), w.probs.is_some(), "{what}");
        let (g, w) = (g.probs.iter().flatten().flatten(), w.probs.iter().flatten().flatten());
        let worst = g.zip(w).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst < 1e-5, "{what}: q differs by {worst}");
    }
}

#[test]
fn pick_is_greedy_or_draws_from_the_filtered_distribution() {
    let mut draws = 0;
    let row = [1.0, 3.0, 3.0, 2.0];
    assert_eq!(pick(&row, &DraftSampling::greedy(), &mut draws), (1, None));
    assert_eq!(draws, 0, "greedy draws nothing");
    let s = DraftSampling {
        temperature: 1.0,
        top_k: 2,
        seed: 3,
        ..DraftSampling::greedy()
    };
    for _ in 0..20 {
        let (token, q) = pick(&row, &s, &mut draws);
        let q = q.expect("probabilities");
        assert!(token == 1 || token == 2, "token {token} is outside the top 2");
        assert_eq!(q, vec![0.0, 0.5, 0.5, 0.0]);
    }
    assert_eq!(draws, 20);
}

#[test]
fn sessions_take_slots_until_dropped() {
    let dir = tiny(Family::NemotronH, 9);
    let path = dir.path();
    let model = DraftModel::load(path, vocab_of(path), 2, 64, 2, None).expect("load");
    let mut a = model.session(DraftSampling::greedy()).expect("session");
    let b = model.session(DraftSampling::greedy()).expect("session");
    assert_ne!(a.slot(), b.slot());
    let prompt = [3, 1, 4, 1, 5];
    propose(&mut a, &prompt, 2);
    let e = err_text(model.session(DraftSampling::greedy()));
    assert!(
        e.contains("all 2 sequence slots of the draft model are in use"),
        "`{e}`"
    );
    let slot = a.slot();
    drop(a);
    let mut c = model.session(DraftSampling::greedy()).expect("a freed slot");
    assert_eq!(c.slot(), slot);
    // The slot starts empty for its new session.
    assert_eq!(propose(&mut c, &prompt, 2).tokens, greedy(path, &prompt, 2));
    // Sessions keep the model alive; the last one to go stops its thread.
    drop(model);
    drop(b);
    assert_eq!(propose(&mut c, &[2, 7], 1).tokens, greedy(path, &[2, 7], 1));
}

#[test]
fn bad_settings_are_refused() {
    let dir = tiny(Family::NemotronH, 9);
    let path = dir.path();
    let vocab = vocab_of(path);
    assert!(err_text(DraftModel::load(path, vocab, 0, 64, 2, None)).contains("at least 1 slot"));
    assert!(err_text(DraftModel::load(path, vocab, 1, 64, 0, None)).contains("window must be at least 1"));
    let e = err_text(DraftModel::load(&path.join("absent"), vocab, 1, 64, 2, None));
    assert!(e.contains("config.json"), "`{e}`");
    let model = DraftModel::load(path, vocab, 1, 64, 2, None).expect("load");
    let hot = DraftSampling {
        temperature: f32::NAN,
        ..DraftSampling::greedy()
    };
    assert!(err_text(model.session(hot)).contains("temperature must be a finite number >= 0"));
    let wide = DraftSampling {
        top_p: 0.0,
        ..DraftSampling::greedy()
    };
    assert!(err_text(model.session(wide)).contains("top_p must be in (0, 1]"));
}
