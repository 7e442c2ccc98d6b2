//! The coordinator over CPU ranks: a bad plan is rejected before any rank computes; merged summaries equal the
//! single-rank ones; a slot snapshot restored into another slot continues identically; release returns every pool
//! entry; a mixed batch (prompt chunks, decodes and verifies in different forms) equals each sequence run alone.

use std::path::Path;

use super::*;
use crate::decode::{Decoder, DecoderConfig, FormChoice};
use crate::model::Family;
use crate::shard::ShardedModel;

fn tiny(family: Family) -> tempfile::TempDir {
    crate::init::tiny_checkpoint(family, 11)
}

fn config(slots: usize) -> DecoderConfig {
    DecoderConfig {
        buffer_len: 6,
        max_verify: 3,
        ..DecoderConfig::new(slots, 64)
    }
}

fn cpu(dir: &Path, tp: usize, slots: usize) -> RankGroup {
    cpu_group(
        dir,
        &CpuOptions {
            tp,
            decoder: config(slots),
        },
    )
    .expect("group")
}

fn seq(slot: usize, kind: SeqKind, position: usize, tokens: &[u32], form: FormChoice, rows: Rows) -> SeqStep {
    SeqStep {
        slot,
        kind,
        position,
        tokens: tokens.to_vec(),
        form,
        rows,
        sample: None,
        spec: None,
        logprobs: None,
    }
}

fn plan(seqs: Vec<SeqStep>) -> StepPlan {
    StepPlan::batch(seqs).with_logits(true)
}

/// A decode of `slot` at `pos` fed `token`, chaining `chained` further steps (a single step when 0), sampled by
/// `sample` (which carries a draw per step).
fn decodes(
    slot: usize,
    pos: usize,
    token: u32,
    form: FormChoice,
    chained: usize,
    sample: Option<ChainSample>,
) -> StepPlan {
    let d = ChainedDecode {
        slot,
        position: pos,
        token,
        form,
        sample,
    };
    match chained {
        0 => StepPlan::batch(vec![d.step(0, token)]),
        c => StepPlan::decode_chain(vec![d], c),
    }
}

fn rel(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-12);
    got.iter().zip(want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

fn steps(g: &RankGroup) -> Vec<u64> {
    g.health().expect("health").iter().map(|h| h.steps).collect()
}

const PROMPT: [u32; 7] = [3, 14, 15, 92, 65, 35, 89];

#[test]
fn a_bad_plan_is_rejected_before_any_rank_computes() {
    let dir = tiny(Family::NemotronH);
    let mut g = cpu(dir.path(), 2, 2);
    let vocab = g.vocab_size() as u32;
    let f = FormChoice::Replay;
    let a = g.open(f).expect("open");
    g.step(plan(vec![seq(a, SeqKind::Prefill, 0, &PROMPT, f, Rows::Last)]))
        .expect("prefill");
    let before = steps(&g);
    let pos = PROMPT.len();
    let bad: Vec<(StepPlan, &str)> = vec![
        (plan(vec![]), "empty step"),
        (
            plan(vec![seq(a, SeqKind::Decode, pos, &[vocab], f, Rows::Last)]),
            "out of range",
        ),
        (
            plan(vec![seq(a, SeqKind::Decode, pos + 1, &[1], f, Rows::Last)]),
            "position",
        ),
        (
            plan(vec![seq(a, SeqKind::Decode, pos, &[1, 2], f, Rows::Last)]),
            "takes 1 token",
        ),
        (
            plan(vec![seq(a, SeqKind::Verify, pos, &[1, 2, 3, 4], f, Rows::All)]),
            "1 to 3 tokens",
        ),
        (plan(vec![seq(1, SeqKind::Decode, 0, &[1], f, Rows::Last)]), "not open"),
        (
            plan(vec![seq(
                a,
                SeqKind::Decode,
                pos,
                &[1],
                FormChoice::Recurrent,
                Rows::Last,
            )]),
            "form",
        ),
        (
            plan(vec![
                seq(a, SeqKind::Decode, pos, &[1], f, Rows::Last),
                seq(a, SeqKind::Decode, pos, &[2], f, Rows::Last),
            ]),
            "twice",
        ),
        (
            StepPlan {
                commits: vec![Commit { slot: a, accepted: 1 }],
                ..plan(vec![])
            },
            "no verify to commit",
        ),
        (
            plan(vec![seq(a, SeqKind::Prefill, pos, &[7; 60], f, Rows::Last)]),
            "context limit",
        ),
    ];
    for (p, needle) in bad {
        let e = g.step(p).expect_err(needle).to_string();
        assert!(e.contains(needle), "`{e}` lacks `{needle}`");
        assert_eq!(steps(&g), before, "no rank ran a step for a plan failing with `{e}`");
    }
    // The slot is untouched: the next good step lands at the same position on every rank.
    g.step(plan(vec![seq(a, SeqKind::Decode, pos, &[1], f, Rows::Last)]))
        .expect("a good step after the bad ones");
}

#[test]
fn merged_summaries_equal_one_rank() {
    for family in [Family::NemotronH, Family::Qwen35] {
        let dir = tiny(family);
        let mut want = None;
        for tp in [1, 2, 3] {
            let mut g = cpu(dir.path(), tp, 1);
            let s = g.open(FormChoice::Recurrent).expect("open");
            let out = g
                .step(plan(vec![seq(
                    s,
                    SeqKind::Prefill,
                    0,
                    &PROMPT,
                    FormChoice::Recurrent,
                    Rows::All,
                )]))
                .expect("prefill");
            let logits = out.logits.clone().expect("logits");
            let vocab = g.vocab_size();
            for (row, l) in out.rows.iter().zip(logits.chunks_exact(vocab)) {
                let whole = vocab::summarise_row(l, 0);
                assert_eq!(row.argmax, whole.pass.argmax);
                let (a, b) = (row.lse, whole.pass.lse);
                assert!((a - b).abs() < 1e-4 * b.abs().max(1.0), "tp {tp}: lse {a} vs {b}");
            }
            match &want {
                None => want = Some(logits),
                Some(w) => assert!(rel(&logits, w) < 1e-4, "tp {tp} vs tp 1"),
            }
        }
    }
}

/// Decodes `tokens` one step at a time in `slot` from `position`; returns each step's logits.
fn decode_all(g: &mut RankGroup, slot: usize, mut position: usize, tokens: &[u32], form: FormChoice) -> Vec<Vec<f32>> {
    tokens
        .iter()
        .map(|&t| {
            let out = g
                .step(plan(vec![seq(slot, SeqKind::Decode, position, &[t], form, Rows::Last)]))
                .expect("decode");
            position += 1;
            out.logits.expect("logits")
        })
        .collect()
}

#[test]
fn a_restored_snapshot_continues_identically() {
    for (family, form) in [
        (Family::NemotronH, FormChoice::Replay),
        (Family::Qwen35, FormChoice::Replay),
        (Family::NemotronH, FormChoice::KvOnly),
        (Family::Qwen35, FormChoice::Recurrent),
    ] {
        let dir = tiny(family);
        let mut g = cpu(dir.path(), 2, 3);
        let a = g.open(form).expect("open");
        g.step(plan(vec![seq(a, SeqKind::Prefill, 0, &PROMPT, form, Rows::Last)]))
            .expect("prefill");
        // A few decodes leave committed entries in the ring (L = 6), so the snapshot holds more than the checkpoint.
        decode_all(&mut g, a, PROMPT.len(), &[5, 6, 7], form);
        let snap = g.snapshot(a).expect("snapshot");
        let b = g.restore(&snap).expect("restore");
        assert_ne!(a, b);
        let more = [8, 9, 10, 11, 12, 13, 14, 15];
        let pos = PROMPT.len() + 3;
        let from_a = decode_all(&mut g, a, pos, &more, form);
        let from_b = decode_all(&mut g, b, pos, &more, form);
        for (i, (x, y)) in from_a.iter().zip(&from_b).enumerate() {
            assert_eq!(x, y, "{family:?} {form}: step {i} after the restore");
        }
        // A snapshot with a verify pending is refused.
        g.step(plan(vec![seq(
            a,
            SeqKind::Verify,
            pos + more.len(),
            &[1, 2],
            form,
            Rows::All,
        )]))
        .expect("verify");
        assert!(g.snapshot(a).is_err());
    }
}

#[test]
fn release_returns_every_pool_entry() {
    let dir = tiny(Family::NemotronH);
    let model = ShardedModel::from_dir(dir.path(), 1, 0).expect("model");
    let mut rank = Decoder::single(model, config(3)).expect("decoder");
    let (kv_total, slots) = (rank.pools().kv_blocks().free_count(), rank.pools().slots().free_count());
    let forms = [FormChoice::Recurrent, FormChoice::Replay, FormChoice::KvOnly];
    let seqs: Vec<SeqStep> = forms
        .iter()
        .enumerate()
        .map(|(s, &f)| seq(s, SeqKind::Prefill, 0, &PROMPT[..4 + s], f, Rows::Last))
        .collect();
    Rank::step(&mut rank, &plan(seqs)).expect("prefill");
    let verify: Vec<SeqStep> = forms
        .iter()
        .enumerate()
        .map(|(s, &f)| seq(s, SeqKind::Verify, 4 + s, &[1, 2, 3], f, Rows::All))
        .collect();
    Rank::step(&mut rank, &plan(verify)).expect("verify");
    assert!(rank.pools().kv_blocks().free_count() < kv_total);
    for s in 0..3 {
        Rank::release(&mut rank, s).expect("release");
    }
    assert_eq!(
        rank.pools().kv_blocks().free_count(),
        kv_total,
        "every KV block is back"
    );
    assert_eq!(rank.pools().slots().free_count(), slots, "every slot is back");
    for s in 0..3 {
        assert_eq!(rank.pools().counters().ring(s).len, 0, "slot {s}: an empty ring");
        assert_eq!(rank.pools().counters().kv_len()[s], 0, "slot {s}: no KV");
    }
    assert!(Rank::release(&mut rank, 0).is_err(), "a double release is an error");
    // The same through a group: the books and every rank's slots come back.
    let mut g = cpu(dir.path(), 2, 2);
    let a = g.open(FormChoice::Replay).expect("open");
    let b = g.open(FormChoice::Auto).expect("open");
    g.step(plan(vec![
        seq(a, SeqKind::Prefill, 0, &PROMPT, FormChoice::Replay, Rows::Last),
        seq(b, SeqKind::Prefill, 0, &PROMPT[..3], FormChoice::Auto, Rows::Last),
    ]))
    .expect("step");
    g.release(a).expect("release");
    g.release(b).expect("release");
    assert_eq!(g.books().slots_in_use(), 0);
    assert!(g.health().expect("health").iter().all(|h| h.slots_in_use == 0));
    assert!(g.release(a).is_err());
}

#[test]
fn a_mixed_batch_equals_each_sequence_alone() {
    for family in [Family::NemotronH, Family::Qwen35] {
        let dir = tiny(family);
        // Sequence 0 decodes, 1 starts its prompt, 2 continues its prompt in a second chunk, 3 verifies drafts.
        let forms = [
            FormChoice::Replay,
            FormChoice::Recurrent,
            FormChoice::KvOnly,
            FormChoice::Auto,
        ];
        let setup: [&[u32]; 4] = [&PROMPT, &[], &PROMPT[..3], &PROMPT[..5]];
        let step_tokens: [(&[u32], SeqKind); 4] = [
            (&[44], SeqKind::Decode),
            (&PROMPT[2..], SeqKind::Prefill),
            (&PROMPT[3..], SeqKind::Prefill),
            (&[21, 22, 23], SeqKind::Verify),
        ];
        let prepare = |g: &mut RankGroup, which: &[usize]| -> Vec<usize> {
            which
                .iter()
                .map(|&i| {
                    let s = g.open(forms[i]).expect("open");
                    if !setup[i].is_empty() {
                        g.step(plan(vec![seq(s, SeqKind::Prefill, 0, setup[i], forms[i], Rows::Last)]))
                            .expect("setup");
                    }
                    s
                })
                .collect()
        };
        let row_of = |i: usize, slot: usize| {
            let (t, kind) = step_tokens[i];
            let rows = if kind == SeqKind::Verify { Rows::All } else { Rows::Last };
            seq(slot, kind, setup[i].len(), t, forms[i], rows)
        };
        let mut alone = Vec::new();
        for i in 0..4 {
            let mut g = cpu(dir.path(), 2, 4);
            let slot = prepare(&mut g, &[i])[0];
            alone.push(
                g.step(plan(vec![row_of(i, slot)]))
                    .expect("alone")
                    .logits
                    .expect("logits"),
            );
        }
        let mut g = cpu(dir.path(), 2, 4);
        let slots = prepare(&mut g, &[0, 1, 2, 3]);
        let out = g
            .step(plan((0..4).map(|i| row_of(i, slots[i])).collect()))
            .expect("mixed");
        let mixed = out.logits.expect("logits");
        let want: Vec<f32> = alone.concat();
        assert_eq!(mixed.len(), want.len());
        assert!(
            rel(&mixed, &want) < 1e-5,
            "{family:?}: mixed batch vs alone: {}",
            rel(&mixed, &want)
        );
        // The verify's drafts commit in a later plan, together with the next decode of the same slot.
        let v = slots[3];
        let pos = setup[3].len();
        g.step(StepPlan {
            commits: vec![Commit { slot: v, accepted: 2 }],
            program: Program::Batch(Batch {
                seqs: vec![seq(v, SeqKind::Decode, pos + 2, &[9], forms[3], Rows::Last)],
                full_logits: false,
                hidden: false,
                mtp: Vec::new(),
            }),
        })
        .expect("commit and decode");
        assert_eq!(g.books().len(v).expect("len"), pos + 3);
    }
}

/// A CPU rank that fails its `at`-th step: with an error, or by panicking.
#[test]
fn a_rank_failing_a_valid_step_stops_the_group() {
    let dir = tiny(Family::NemotronH);
    let launcher = CpuLauncher::new(
        dir.path(),
        CpuOptions {
            tp: 2,
            decoder: config(1),
        },
    )
    .expect("launcher");
    for kind in [FaultKind::Error, FaultKind::Panic, FaultKind::Nan] {
        // Rank 1 fails the group's second step. An error or a panic aborts the generation's communicator, so rank 0
        // fails its collective instead of waiting for rank 1.
        let faults = Faults::new(vec![FaultSpec { rank: 1, kind, step: 2 }], 2).expect("faults");
        let mut g = RankGroup::start_with_faults(&launcher, std::sync::Arc::new(faults)).expect("group");
        let f = FormChoice::Replay;
        let s = g.open(f).expect("open");
        g.step(plan(vec![seq(s, SeqKind::Prefill, 0, &PROMPT, f, Rows::Last)]))
            .expect("first step");
        let e = g
            .step(plan(vec![seq(s, SeqKind::Decode, PROMPT.len(), &[1], f, Rows::Last)]))
            .expect_err("the injected fault");
        let want = match kind {
            FaultKind::Error | FaultKind::Panic => "rank 1",
            _ => "non-finite",
        };
        assert!(e.to_string().contains(want), "{kind}: {e}");
        if kind == FaultKind::Nan {
            // The ranks ran the step: only the answer was poisoned, and the group may go on.
            continue;
        }
        assert!(g.failure().is_some());
        let again = g
            .step(plan(vec![seq(s, SeqKind::Decode, PROMPT.len(), &[1], f, Rows::Last)]))
            .expect_err("refused");
        assert!(matches!(again, crate::EngineError::GroupFailed(_)), "{again}");
    }
}

/// A new sequence in `form` that took PROMPT: its slot and the argmax after it.
fn prefilled(g: &mut RankGroup, form: FormChoice) -> (usize, u32) {
    let a = g.open(form).expect("open");
    let out = g
        .step(plan(vec![seq(a, SeqKind::Prefill, 0, &PROMPT, form, Rows::Last)]))
        .expect("prefill");
    (a, out.rows[0].argmax)
}

/// A chain's sampling (T 0.7) carrying two draws: enough for one chained step.
pub(super) fn sampled_with_two_draws() -> ChainSample {
    ChainSample {
        temperature: 0.7,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        draws: vec![0.5, 0.5],
    }
}

/// Under tensor parallelism sampled rows are drawn by the ranks, each from the whole row it gathers from every rank's
/// slice: a chain draws what single steps with the same draws draw, and each single step's draw is the sampler's
/// draw from the logit row joined on the host.
#[test]
fn a_sampled_chain_over_tensor_parallel_ranks_draws_what_single_steps_draw() {
    let dir = tiny(Family::NemotronH);
    let f = FormChoice::Replay;
    let mut g = cpu(dir.path(), 2, 3);
    let open = |g: &mut RankGroup| prefilled(g, f);
    let (a, t) = open(&mut g);
    let (b, _) = open(&mut g);
    let draws = [0.9, 0.05, 0.5, 0.7];
    let row = |k: usize, chained: usize| ChainSample {
        temperature: 1.3,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.0,
        draws: draws[k..k + 1 + chained].to_vec(),
    };
    let step = |slot: usize, pos: usize, token: u32, k: usize, chained: usize| {
        decodes(slot, pos, token, f, chained, Some(row(k, chained)))
    };
    let chained = g.step(step(a, PROMPT.len(), t, 0, 3)).expect("tp 2 sampled chain");
    let tokens: Vec<u32> = chained.sampled.iter().map(|s| s.expect("every step sampled")).collect();
    assert_eq!(tokens.len(), 4);
    // The same steps one at a time on the other slot, which took the same prompt, returning their joined rows too.
    let mut next = t;
    for (k, want) in tokens.iter().enumerate() {
        let one = g
            .step(step(b, PROMPT.len() + k, next, k, 0).with_logits(true))
            .expect("single");
        let got = one.sampled[0].expect("sampled");
        assert_eq!(got, *want, "step {k}");
        let joined = one.logits.as_deref().expect("the joined row");
        assert_eq!(
            got,
            row(k, 0).row(0).sample(joined),
            "step {k}: the ranks' draw against the joined row's"
        );
        next = got;
    }
    // The draws matter: a chain drawn differently from the first step on departs somewhere (the tiny model's rows
    // are not one-hot at this temperature).
    let (c, t) = open(&mut g);
    let other = ChainSample {
        draws: vec![0.02, 0.98, 0.02, 0.98],
        ..row(0, 3)
    };
    let other = g
        .step(decodes(c, PROMPT.len(), t, f, 3, Some(other)))
        .expect("other draws");
    let other: Vec<u32> = other.sampled.iter().map(|s| s.expect("sampled")).collect();
    assert_ne!(other, tokens);
}

/// Under tensor parallelism the additive bias (logit_bias, the presence / frequency penalties, the min_tokens mask)
/// uses whole-vocabulary ids on the row every rank joins: +100 forces an id of either rank's slice, a ban moves the
/// greedy pick off the argmax, and every pick is the CPU twin's from the joined row; a bias outside the vocabulary is
/// refused before any rank computes.
#[test]
fn a_logit_bias_steers_the_pick_across_tensor_parallel_slices() {
    let dir = tiny(Family::NemotronH);
    let f = FormChoice::Replay;
    let mut g = cpu(dir.path(), 2, 2);
    let vocab = g.vocab_size() as u32;
    let greedy = |bias: Vec<(u32, f32)>, temperature: f32| SampleRow {
        temperature,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        history: Vec::new(),
        bias,
        mask: None,
        uniform: 0.5,
    };
    // Each step on a fresh slot that took the same prompt.
    let step = |g: &mut RankGroup, sample: SampleRow| {
        let (a, t) = prefilled(g, f);
        let mut s = seq(a, SeqKind::Decode, PROMPT.len(), &[t], f, Rows::Last);
        s.sample = Some(sample.clone());
        let out = g.step(StepPlan::batch(vec![s]).with_logits(true)).expect("step");
        let got = out.sampled[0].expect("sampled");
        let joined = out.logits.as_deref().expect("the joined row");
        assert_eq!(got, sample.sample(joined), "{sample:?}");
        g.release(a).expect("release");
        (got, out.rows[0].argmax)
    };
    for forced in [1, vocab / 2 + 3, vocab - 2] {
        assert_eq!(step(&mut g, greedy(vec![(forced, 100.0)], 0.0)).0, forced);
    }
    let (_, argmax) = step(&mut g, greedy(Vec::new(), 0.0));
    let (banned, _) = step(&mut g, greedy(vec![(argmax, -100.0)], 0.0));
    assert_ne!(banned, argmax);
    let masked = vec![(argmax, crate::sample::MASKED), (vocab - 1, -1.5)];
    assert_ne!(step(&mut g, greedy(masked, 1.0)).0, argmax);
    let (a, t) = prefilled(&mut g, f);
    let mut s = seq(a, SeqKind::Decode, PROMPT.len(), &[t], f, Rows::Last);
    s.sample = Some(greedy(vec![(vocab, 1.0)], 0.0));
    let e = g.step(StepPlan::batch(vec![s])).expect_err("out of range").to_string();
    assert!(e.contains("logit bias"), "{e}");
}

#[test]
fn chained_plans_are_checked_and_count_every_step() {
    let dir = tiny(Family::Qwen35);
    let f = FormChoice::Replay;
    let prefill = |g: &mut RankGroup| prefilled(g, f);
    let chain = |a: usize, pos: usize, token: u32, chained: usize| decodes(a, pos, token, f, chained, None);
    // Tensor parallelism: a greedy chain merges the ranks' slices at every step, as the coordinator does for single
    // steps; a sampled row is drawn by every rank from the slices it gathers (below).
    let mut g = cpu(dir.path(), 2, 2);
    let (a, t) = prefill(&mut g);
    let (b, _) = prefill(&mut g);
    let chained = g.step(chain(a, PROMPT.len(), t, 3)).expect("tp 2 greedy chain");
    let mut next = t;
    for (k, want) in chained.rows.iter().enumerate() {
        let one = g.step(chain(b, PROMPT.len() + k, next, 0)).expect("single");
        assert_eq!(one.rows[0].argmax, want.argmax, "tp 2 step {k}");
        next = one.rows[0].argmax;
    }
    let sampled = decodes(a, PROMPT.len() + 4, next, f, 1, Some(sampled_with_two_draws()));
    let out = g.step(sampled).expect("tp 2 sampled chain");
    assert_eq!(out.sampled.len(), 2);
    assert!(out.sampled.iter().all(Option::is_some), "{:?}", out.sampled);
    // One rank: a chain of 4 steps equals 4 single steps, and the books count its 4 tokens.
    let mut g = cpu(dir.path(), 1, 3);
    let (a, t) = prefill(&mut g);
    let (b, _) = prefill(&mut g);
    let chained = g.step(chain(a, PROMPT.len(), t, 3)).expect("chain");
    assert_eq!(chained.rows.len(), 4);
    let mut next = t;
    for (k, want) in chained.rows.iter().enumerate() {
        let one = g.step(chain(b, PROMPT.len() + k, next, 0)).expect("single");
        assert_eq!(one.rows[0].argmax, want.argmax, "step {k}");
        next = one.rows[0].argmax;
    }
    g.step(chain(a, PROMPT.len() + 4, next, 0))
        .expect("the chain left the slot at its 4th token's position");
    // What a chain may not hold beyond what its type rules out (a prefill, whole logits, a penalty): a sampled row
    // without its draws, a draw outside [0, 1), more steps than the limit, no sequence.
    let sampled = decodes(a, PROMPT.len() + 5, next, f, 2, Some(sampled_with_two_draws()));
    let e = g.step(sampled).expect_err("two draws for three steps");
    assert!(e.to_string().contains("draws"), "{e}");
    let bad_draw = ChainSample {
        draws: vec![0.5, 1.5],
        ..sampled_with_two_draws()
    };
    let e = g
        .step(decodes(a, PROMPT.len() + 5, next, f, 1, Some(bad_draw)))
        .expect_err("a draw of 1.5");
    assert!(e.to_string().contains("outside [0, 1)"), "{e}");
    assert!(g.step(StepPlan::decode_chain(Vec::new(), 1)).is_err());
    assert!(g.step(chain(a, PROMPT.len() + 5, next, MAX_CHAINED + 1)).is_err());
}
