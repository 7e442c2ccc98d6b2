//! Speculative decoding through the serving engine on CPU ranks: greedy speculative output equals greedy output
//! token for token (every fixture, every drafter, T from 1 to 8, every decode form, TP 1 and 2, speculating and plain
//! requests mixed in one batch); sampled speculative output follows the target's distribution (chi-square against
//! plain sampling, for deterministic and sampled drafts, one-pass and whole-row judging) and is the same at TP 1 and
//! 2; the one-pass verify writes O(1) bytes per row whatever the vocabulary. The MTP drafter's tests are in
//! `speculative_mtp.rs`.

use std::path::Path;

use rewind_actors::{Event, GenerateRequest};
use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::rank::{Rank, Rows, SeqKind, SeqStep, SpecSample, StepPlan};
use rewind_engine::spec::step_cost::{StepPoint, StepProfile, PROFILE_VERSION};
use rewind_engine::spec::{DrafterKind, SpecConfig, SpecPolicy, SpecStats};
use rewind_tests::{fixtures, name, runtime, single, tokens};

use crate::speculative_support;
use speculative_support::{engine, params, run_all, spec_config, tiny_qwen};

/// Prompts with repeats (so prompt lookup finds matches) from a fixture's tokens.
fn prompts(dir: &Path) -> Vec<Vec<u32>> {
    let (toks, prefill) = tokens(dir);
    let base = &toks[..prefill.min(8)];
    vec![
        [base, base].concat(),
        toks[..prefill].to_vec(),
        [&base[..3], &base[..3], &base[..3]].concat(),
    ]
}

#[test]
fn greedy_speculation_changes_no_token() {
    let rt = runtime();
    let mut window = 0;
    for dir in fixtures() {
        let self_draft = DrafterKind::Draft(dir.clone());
        for tp in [1, 2] {
            for form in FormChoice::ALL {
                for drafter in [
                    DrafterKind::Ngram { min_n: 1, max_n: 3 },
                    DrafterKind::Oracle { p: 0.25 },
                    self_draft.clone(),
                ] {
                    // Every window from 1 to 8 comes round for every drafter and form.
                    window = window % 8 + 1;
                    let spec = spec_config(drafter.clone(), window);
                    let what = format!("{} tp {tp} {form} {drafter} T={window}", name(&dir));
                    let (plain, spec_out) = rt.block_on(async {
                        let e = engine(&dir, tp, form, 8, &spec).await;
                        let ps = prompts(&dir);
                        let plain_reqs: Vec<GenerateRequest> = ps
                            .iter()
                            .map(|p| {
                                let mut r = GenerateRequest::new(p.clone(), params(20, 0.0, 1));
                                r.speculate = false;
                                r
                            })
                            .collect();
                        let plain = run_all(&e, plain_reqs).await;
                        // Speculating and plain requests share the batch.
                        let mut reqs = Vec::new();
                        for (p, (reference, _)) in ps.iter().zip(&plain) {
                            let mut r = GenerateRequest::new(p.clone(), params(20, 0.0, 1));
                            r.reference = Some(reference.clone());
                            reqs.push(r);
                            let mut q = GenerateRequest::new(p.clone(), params(20, 0.0, 1));
                            q.speculate = false;
                            reqs.push(q);
                        }
                        let out = run_all(&e, reqs).await;
                        e.shutdown().await;
                        (plain, out)
                    });
                    for (i, (want, _)) in plain.iter().enumerate() {
                        let (got, stats) = &spec_out[2 * i];
                        assert_eq!(got, want, "{what}: prompt {i}");
                        assert_eq!(
                            &spec_out[2 * i + 1].0,
                            want,
                            "{what}: plain request {i} beside speculation"
                        );
                        let stats = stats.expect("speculation counters");
                        assert!(stats.accepted <= stats.drafted, "{what}");
                        if !matches!(drafter, DrafterKind::Ngram { .. }) {
                            assert!(stats.verifies > 0 && stats.accepted > 0, "{what}: {stats:?}");
                        }
                        if matches!(drafter, DrafterKind::Draft(_)) {
                            // The target drafting for itself is (up to rounding) always right.
                            assert!(stats.accepted * 10 >= stats.drafted * 9, "{what}: {stats:?}");
                        }
                    }
                }
            }
        }
    }
}

/// Pearson's chi-square homogeneity statistic of two samples over `bins` categories (sparse bins pooled) and its
/// degrees of freedom.
fn homogeneity(a: &[usize], b: &[usize]) -> (f64, usize) {
    let (na, nb) = (a.iter().sum::<usize>() as f64, b.iter().sum::<usize>() as f64);
    let mut pooled: Vec<(f64, f64)> = Vec::new();
    let (mut pa, mut pb) = (0.0, 0.0);
    for (&x, &y) in a.iter().zip(b) {
        if x + y >= 10 {
            pooled.push((x as f64, y as f64));
        } else {
            pa += x as f64;
            pb += y as f64;
        }
    }
    if pa + pb > 0.0 {
        pooled.push((pa, pb));
    }
    let n = na + nb;
    let mut chi = 0.0;
    for (x, y) in &pooled {
        let col = x + y;
        let (ea, eb) = (col * na / n, col * nb / n);
        chi += (x - ea).powi(2) / ea + (y - eb).powi(2) / eb;
    }
    (chi, pooled.len().saturating_sub(1))
}

/// The chi-square critical value at p = 0.001 (Wilson–Hilferty).
fn critical(dof: usize) -> f64 {
    let k = dof.max(1) as f64;
    k * (1.0 - 2.0 / (9.0 * k) + 3.090 * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// A step profile: decode steps of 1 ms at batches 1 and 8, verify steps of 4 drafts of 1.1 ms at batch 1 and
/// `crowded_verify_ms` at batch 8.
fn profile(crowded_verify_ms: f64) -> StepProfile {
    let point = |batch, window, step_ms| StepPoint { batch, window, step_ms };
    StepProfile {
        step_profile_version: PROFILE_VERSION,
        device: "test".into(),
        model: "qwen3_5 fixture".into(),
        decode_form: "replay".into(),
        context: 16,
        points: vec![
            point(1, 0, 1.0),
            point(1, 4, 1.1),
            point(8, 0, 1.0),
            point(8, 4, crowded_verify_ms),
        ],
    }
}

/// The adaptive policy drafts for a lone sequence, and beside a crowd of plain requests it drafts where the measured
/// step costs say verifying pays and stops where they say it does not (Snakes and Ladders §4), with the tokens
/// unchanged either way. (It replaces a test of the fixed batch cut-off the policy no longer has.)
#[test]
fn adaptive_speculation_follows_the_measured_step_costs() {
    let rt = runtime();
    let fixture = fixtures()
        .into_iter()
        .find(|d| name(d) == "qwen3_5")
        .expect("qwen3_5 fixture");
    let fillers = 8;
    let prompt: Vec<u32> = vec![3, 1, 4, 1, 5, 9];
    // Nearly free verifies in a crowd (memory-bound), then verifies a thousand times a decode step.
    for (crowded_verify_ms, drafts_in_crowd) in [(1.2, true), (1000.0, false)] {
        let spec = SpecConfig {
            policy: SpecPolicy::Adaptive,
            profile: Some(profile(crowded_verify_ms)),
            ..spec_config(DrafterKind::Oracle { p: 0.0 }, 4)
        };
        let (alone, crowded) = rt.block_on(async {
            let e = engine(&fixture, 1, FormChoice::Replay, fillers + 1, &spec).await;
            let mut greedy = GenerateRequest::new(prompt.clone(), params(12, 0.0, 0));
            greedy.speculate = false;
            let reference = run_all(&e, vec![greedy]).await.remove(0).0;
            let request = || {
                let mut r = GenerateRequest::new(prompt.clone(), params(12, 0.0, 0));
                r.reference = Some(reference.clone());
                r
            };
            let alone = run_all(&e, vec![request()]).await.remove(0);
            // The fillers are all decoding (each has streamed a token) before the speculating request arrives, so
            // its every step holds more sequences than the profile's crowd.
            let mut streams = Vec::new();
            for _ in 0..fillers {
                let mut r = GenerateRequest::new(prompt.clone(), params(60, 0.0, 0));
                r.speculate = false;
                streams.push(e.submit(r).expect("submit"));
            }
            for s in &mut streams {
                while !matches!(s.next().await.expect("an event"), Event::Token { .. }) {}
            }
            let crowded = run_all(&e, vec![request()]).await.remove(0);
            let metrics = e.metrics().snapshot();
            // The fillers are not needed further: dropping their streams cancels them.
            drop(streams);
            e.shutdown().await;
            assert_eq!(metrics.spec_cost_source, 2, "the server measured its own steps");
            assert!(metrics.spec_cost_steps > 0, "{metrics:?}");
            (alone, crowded)
        });
        let stats = alone.1.expect("counters");
        assert!(stats.drafted > 0 && stats.accepted == stats.drafted, "alone: {stats:?}");
        assert_eq!(crowded.0, alone.0, "the policy changes the window, never the tokens");
        let stats = crowded.1.expect("counters");
        assert_eq!(
            stats.drafted > 0,
            drafts_in_crowd,
            "beside {fillers} sequences, verifies of {crowded_verify_ms} ms: {stats:?}"
        );
    }
}

/// Low enough that the random models' distributions are peaked: drafts are often right, and often wrong.
const TEMPERATURE: f32 = 0.5;

#[test]
fn sampled_speculation_follows_the_target_distribution() {
    let rt = runtime();
    let fixture = fixtures()
        .into_iter()
        .find(|d| name(d) == "qwen3_5")
        .expect("qwen3_5 fixture");
    // A draft model with the target's vocabulary but other weights, so its q differs from p.
    let (target, draft) = (tiny_qwen(1, false), tiny_qwen(2, false));
    let n = 3000;
    // (target, drafter, top_k): deterministic drafts judged in one pass, deterministic drafts judged on whole rows
    // (top-k), and drafts sampled from a draft model (whole rows with its q).
    let cases = [
        (fixture.clone(), DrafterKind::Oracle { p: 0.5 }, 0),
        (fixture.clone(), DrafterKind::Oracle { p: 0.5 }, 5),
        (
            target.path().to_path_buf(),
            DrafterKind::Draft(draft.path().to_path_buf()),
            0,
        ),
    ];
    for (dir, drafter, top_k) in cases {
        let vocab = rewind_engine::model::ModelConfig::from_dir(&dir)
            .expect("config")
            .vocab_size;
        let prompt: Vec<u32> = vec![3, 1, 4, 1, 5, 9];
        let spec = spec_config(drafter.clone(), 2);
        let (plain, spec_out) = rt.block_on(async {
            let e = engine(&dir, 1, FormChoice::Auto, 64, &spec).await;
            // The oracle drafts the greedy continuation (likely tokens, so acceptance tests have power).
            let mut greedy = GenerateRequest::new(prompt.clone(), params(3, 0.0, 0));
            greedy.speculate = false;
            let reference = run_all(&e, vec![greedy]).await.remove(0).0;
            let mk = |seed: u64, speculate: bool| {
                let mut p = params(3, TEMPERATURE, seed);
                p.top_k = top_k;
                let mut r = GenerateRequest::new(prompt.clone(), p);
                r.speculate = speculate;
                r.reference = Some(reference.clone());
                r
            };
            let plain = run_all(&e, (0..n).map(|s| mk(s, false)).collect()).await;
            let spec_out = run_all(&e, (0..n).map(|s| mk(s + 1_000_000, true)).collect()).await;
            e.shutdown().await;
            (plain, spec_out)
        });
        let stats = spec_out.iter().fold(SpecStats::default(), |mut acc, (_, s)| {
            acc.add(&s.expect("counters"));
            acc
        });
        assert!(
            stats.accepted > 0 && stats.accepted < stats.drafted,
            "{drafter}: {stats:?}"
        );
        // Tokens 1 and 2 come out of verifies: accepted drafts, residual samples and bonus tokens.
        for index in 1..3 {
            let mut a = vec![0usize; vocab];
            let mut b = vec![0usize; vocab];
            for (t, _) in &plain {
                a[t[index] as usize] += 1;
            }
            for (t, _) in &spec_out {
                b[t[index] as usize] += 1;
            }
            let (chi, dof) = homogeneity(&a, &b);
            assert!(
                chi < critical(dof),
                "{drafter} top-k {top_k}, token {index}: chi-square {chi:.1} over {dof} degrees of freedom"
            );
        }
    }
}

/// Under vocabulary-parallel ranks the verify's per-position summaries (one pass) or logit slices (whole rows) are
/// merged, never sampled per rank, so sampled speculative output at TP 2 is the TP 1 output token for token.
#[test]
fn sampled_speculation_is_the_same_at_tp_1_and_2() {
    let rt = runtime();
    let fixture = fixtures()
        .into_iter()
        .find(|d| name(d) == "qwen3_5")
        .expect("qwen3_5 fixture");
    let prompt: Vec<u32> = vec![3, 1, 4, 1, 5, 9];
    for top_k in [0, 5] {
        let spec = spec_config(DrafterKind::Oracle { p: 0.5 }, 3);
        let outs: Vec<_> = [1, 2]
            .into_iter()
            .map(|tp| {
                rt.block_on(async {
                    let e = engine(&fixture, tp, FormChoice::Replay, 16, &spec).await;
                    let mut greedy = GenerateRequest::new(prompt.clone(), params(12, 0.0, 0));
                    greedy.speculate = false;
                    let reference = run_all(&e, vec![greedy]).await.remove(0).0;
                    let reqs = (0..48)
                        .map(|seed| {
                            let mut p = params(12, TEMPERATURE, seed);
                            p.top_k = top_k;
                            let mut r = GenerateRequest::new(prompt.clone(), p);
                            r.reference = Some(reference.clone());
                            r
                        })
                        .collect();
                    let out = run_all(&e, reqs).await;
                    e.shutdown().await;
                    out
                })
            })
            .collect();
        let stats = outs[1].iter().fold(SpecStats::default(), |mut acc, (_, s)| {
            acc.add(&s.expect("counters"));
            acc
        });
        assert!(
            stats.accepted > 0 && stats.accepted < stats.drafted,
            "top-k {top_k}: {stats:?}"
        );
        for (i, (a, b)) in outs[0].iter().zip(&outs[1]).enumerate() {
            assert_eq!(a.0, b.0, "top-k {top_k}, seed {i}: TP 1 and TP 2 differ");
        }
    }
}

#[test]
fn one_pass_verify_writes_o1_bytes_per_row() {
    let mut per_row = Vec::new();
    for dir in fixtures() {
        let vocab = rewind_engine::model::ModelConfig::from_dir(&dir)
            .expect("config")
            .vocab_size;
        let mut config = DecoderConfig::new(1, 64);
        config.max_verify = 5;
        let mut rank = single(&dir, config);
        let (toks, _) = tokens(&dir);
        let step = |kind, tokens: &[u32], position, spec, full_logits| {
            StepPlan::batch(vec![SeqStep {
                slot: 0,
                kind,
                position,
                tokens: tokens.to_vec(),
                form: FormChoice::Replay,
                rows: if kind == SeqKind::Verify { Rows::All } else { Rows::Last },
                sample: None,
                spec,
                logprobs: None,
            }])
            .with_logits(full_logits)
        };
        rank.step(&step(SeqKind::Prefill, &toks[..6], 0, None, false))
            .expect("prefill");
        let spec = Some(SpecSample {
            temperature: 0.7,
            seed: 3,
            index: 0,
        });
        let out = rank
            .step(&step(SeqKind::Verify, &toks[6..11], 6, spec, false))
            .expect("verify");
        assert!(out.rows.iter().all(|r| r.pass.spec.is_some()), "{}", name(&dir));
        let one_pass = rank.last_head_traffic().outputs;
        assert_eq!(one_pass % 5, 0);
        per_row.push(one_pass / 5);
        // The same verify asking for whole rows writes every logit.
        rank.step(
            &step(SeqKind::Verify, &toks[6..11], 6, spec, true)
                .with_commits(vec![rewind_engine::rank::Commit { slot: 0, accepted: 0 }]),
        )
        .expect("verify with logits");
        assert_eq!(rank.last_head_traffic().outputs, 5 * 4 * vocab as u64, "{}", name(&dir));
    }
    assert!(
        per_row.windows(2).all(|w| w[0] == w[1]),
        "bytes per row vary with the vocabulary: {per_row:?}"
    );
    assert!(per_row[0] <= 32, "{} bytes per row", per_row[0]);
}
