//! A request's `n` choices on CPU ranks: the prompt is prefilled once and forked (the prefill metric counts the shared
//! prompt once and each choice's last prompt token); greedy choices are equal and equal one sequence run through the
//! same prefills and decodes; seeded choices differ, repeat, and choice `i` samples as a lone request with seed
//! `s + i` run the same way; a choice rebuilt after an injected fault (at TP 2: the fork prefill's step, the choices'
//! first step from the forked state, a decode) gives its fault-free tokens, and so do choices waiting for each other's
//! slots; dropping the stream cancels every choice; each choice reports its own tokens' log-probabilities and the
//! prompt's come once; `n` past the slots or on a session turn is refused. (A fault requeues every sequence through
//! the scheduler's preemption, `engine/src/sched/scheduler/requeue.rs`, so a preempted choice is rebuilt the same way;
//! the CPU ranks' KV pool holds every slot's whole context, so the scheduler never preempts for blocks here.)

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rewind_actors::{
    choice_seed, EngineConfig, EngineHandle, Event, EventStream, FailureKind, GenerateRequest, SessionOptions,
    SessionOwner,
};
use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::rank::{CpuLauncher, CpuOptions, FaultKind, FaultSpec, GroupSequence, Rows, SampleRow, SeqKind};
use rewind_engine::sample::{Sampler, SamplingParams};
use rewind_engine::sched::FinishReason;
use rewind_tests::{argmax, fixtures, group, name, runtime, tokens};

const CONTEXT: usize = 96;

async fn engine(dir: &Path, tp: usize, slots: usize, config: EngineConfig) -> EngineHandle {
    let launcher = CpuLauncher::new(
        dir,
        CpuOptions {
            tp,
            decoder: DecoderConfig::new(slots, CONTEXT),
        },
    )
    .expect("launcher");
    EngineHandle::start(Arc::new(launcher), config)
        .await
        .unwrap_or_else(|e| panic!("{} at tp {tp}: {e}", name(dir)))
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..SamplingParams::greedy()
    }
}

fn sampled(max_tokens: usize, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        ..greedy(max_tokens)
    }
}

fn request(prompt: &[u32], params: SamplingParams, n: usize) -> GenerateRequest {
    GenerateRequest {
        n,
        ..GenerateRequest::new(prompt.to_vec(), params)
    }
}

/// Every choice's tokens and finish reason, by choice; or the request's failure.
async fn choices(mut s: EventStream, n: usize) -> Result<Vec<(Vec<u32>, FinishReason)>, (FailureKind, String)> {
    let mut out: Vec<(Vec<u32>, Option<FinishReason>)> = vec![(Vec::new(), None); n];
    while let Some(e) = s.next().await {
        match e {
            Event::Token {
                token, index, choice, ..
            } => {
                let c = &mut out[choice].0;
                assert_eq!(index, c.len(), "choice {choice}'s tokens arrive in order");
                c.push(token);
            }
            Event::Finished {
                reason, usage, choice, ..
            } => {
                assert!(out[choice].1.is_none(), "choice {choice} finished twice");
                assert_eq!(usage.completion_tokens, out[choice].0.len());
                out[choice].1 = Some(reason);
            }
            // The tokens are what is compared here.
            Event::PromptLogprobs { .. } => {}
            Event::Failed { error, kind } => return Err((kind, error)),
        }
    }
    Ok(out
        .into_iter()
        .enumerate()
        .map(|(i, (t, r))| (t, r.unwrap_or_else(|| panic!("choice {i} never finished"))))
        .collect())
}

async fn run(e: &EngineHandle, r: GenerateRequest) -> Result<Vec<(Vec<u32>, FinishReason)>, (FailureKind, String)> {
    let n = r.n;
    choices(e.submit(r).expect("submit"), n).await
}

/// A choice's computation as one sequence: the prompt but its last token prefilled as one chunk, the last token as a
/// chunk of its own, then a decode per token; each row greedy, or sampled with `seed` as the engine draws.
fn reference(dir: &Path, prompt: &[u32], n: usize, params: &SamplingParams, seed: Option<u64>) -> Vec<u32> {
    let mut g = group(dir, 1, DecoderConfig::new(1, CONTEXT));
    let mut seq = GroupSequence::open(&mut g, FormChoice::Auto, CONTEXT).expect("open");
    let (shared, last) = prompt.split_at(prompt.len() - 1);
    seq.run(SeqKind::Prefill, shared, Rows::None, false).expect("prefill");
    let mut logits = seq
        .run(SeqKind::Prefill, last, Rows::Last, true)
        .expect("last prompt token")
        .logits
        .expect("logits");
    let mut out = Vec::new();
    loop {
        let t = match seed {
            None => argmax(&logits),
            Some(s) => SampleRow {
                temperature: params.temperature,
                top_k: params.top_k,
                top_p: params.top_p,
                min_p: params.min_p,
                repetition_penalty: 1.0,
                history: Vec::new(),
                bias: Vec::new(),
                mask: None,
                uniform: Sampler::draw_at(s, out.len() as u64),
            }
            .sample(&logits),
        };
        out.push(t);
        if out.len() == n {
            break;
        }
        logits = seq
            .run(SeqKind::Decode, &[t], Rows::Last, true)
            .expect("decode")
            .logits
            .expect("logits");
    }
    out
}

#[test]
fn greedy_choices_share_one_prefill_and_equal_the_forked_sequence() {
    let rt = runtime();
    for dir in fixtures() {
        let (toks, prefill) = tokens(&dir);
        let prompt = &toks[..prefill];
        let want = reference(&dir, prompt, 6, &greedy(6), None);
        for tp in [1, 2] {
            rt.block_on(async {
                let e = engine(&dir, tp, 4, EngineConfig::new(FormChoice::Auto)).await;
                let got = run(&e, request(prompt, greedy(6), 3)).await.expect("n = 3");
                for (i, (t, reason)) in got.iter().enumerate() {
                    assert_eq!(t, &want, "{} tp {tp}: choice {i}", name(&dir));
                    assert_eq!(*reason, FinishReason::Length);
                }
                let m = e.metrics().snapshot();
                // The shared prompt once, then each choice's last prompt token from the forked state.
                assert_eq!(
                    m.prefill_tokens as usize,
                    prompt.len() - 1 + 3,
                    "{} tp {tp}: {m:?}",
                    name(&dir)
                );
                assert_eq!(m.restored_tokens as usize, 3 * (prompt.len() - 1));
                assert_eq!((m.requests_submitted, m.requests_finished), (1, 1));
                let h = e.health().await.expect("health");
                assert_eq!((h.running, h.waiting, h.free_slots), (0, 0, 4), "{h:?}");
                e.shutdown().await;
            });
        }
    }
}

#[test]
fn seeded_choices_differ_repeat_and_sample_with_their_derived_seeds() {
    let dir = &fixtures()[0];
    let (toks, prefill) = tokens(dir);
    let prompt = &toks[..prefill];
    let seed = 11;
    let want: Vec<Vec<u32>> = (0..3)
        .map(|i| reference(dir, prompt, 8, &sampled(8, seed), Some(choice_seed(seed, i))))
        .collect();
    assert!(
        want[0] != want[1] || want[1] != want[2],
        "three seeds sampled one continuation: {want:?}"
    );
    runtime().block_on(async {
        let e = engine(dir, 1, 4, EngineConfig::new(FormChoice::Auto)).await;
        for attempt in 0..2 {
            let got = run(&e, request(prompt, sampled(8, seed), 3)).await.expect("n = 3");
            let tokens: Vec<Vec<u32>> = got.into_iter().map(|(t, _)| t).collect();
            assert_eq!(tokens, want, "attempt {attempt}");
        }
        // A one-token prompt has nothing to share: its choices start afresh, seeded the same way.
        let one = run(&e, request(&prompt[..1], sampled(4, seed), 2))
            .await
            .expect("one token");
        assert_eq!(one.len(), 2);
        // Without a seed each choice draws its own.
        let mut s = e.submit(request(prompt, greedy(2), 2)).expect("submit");
        let mut seeds = Vec::new();
        while let Some(ev) = s.next().await {
            if let Event::Finished { seed, .. } = ev {
                seeds.push(seed);
            }
        }
        assert_eq!(seeds.len(), 2);
        e.shutdown().await;
    });
}

#[test]
fn a_forked_choice_rebuilt_after_a_fault_gives_its_fault_free_tokens() {
    let dir = fixtures()
        .into_iter()
        .find(|d| name(d) == "nemotron_h_dense")
        .expect("fixture");
    let (toks, prefill) = tokens(&dir);
    let prompt = &toks[..prefill];
    let rt = runtime();
    let reqs = [
        request(prompt, sampled(10, 5), 3),
        request(&toks[1..prefill], greedy(7), 2),
    ];
    let serve = |e: &EngineHandle| {
        let streams: Vec<_> = reqs
            .iter()
            .map(|r| (e.submit(r.clone()).expect("submit"), r.n))
            .collect();
        async move {
            let mut out = Vec::new();
            for (s, n) in streams {
                out.push(choices(s, n).await.expect("served"));
            }
            out
        }
    };
    let clean = rt.block_on(async {
        let e = engine(&dir, 2, 8, EngineConfig::new(FormChoice::Auto)).await;
        let out = serve(&e).await;
        assert_eq!(e.metrics().snapshot().faults, 0);
        e.shutdown().await;
        out
    });
    // Step 1 runs the fork prefills, step 2 the choices' first tokens from the forked states, step 6 their decodes.
    for (step, kind) in [(1, FaultKind::Error), (2, FaultKind::Panic), (6, FaultKind::Nan)] {
        rt.block_on(async {
            let mut config = EngineConfig::new(FormChoice::Auto);
            config.faults = vec![FaultSpec { rank: 1, kind, step }];
            config.step_deadline = Duration::from_secs(5);
            let e = engine(&dir, 2, 8, config).await;
            let out = serve(&e).await;
            assert_eq!(
                out, clean,
                "a {kind} at step {step}: outputs differ from the fault-free run"
            );
            let m = e.metrics().snapshot();
            assert_eq!((m.faults, m.recoveries), (1, 1), "{kind} at {step}: {m:?}");
            let h = e.health().await.expect("health");
            assert_eq!((h.running, h.waiting, h.free_slots), (0, 0, 8), "{h:?}");
            e.shutdown().await;
        });
    }
    // Three slots for five choices: the second request's choices wait for the first's slots.
    rt.block_on(async {
        let e = engine(&dir, 1, 3, EngineConfig::new(FormChoice::Auto)).await;
        let out = serve(&e).await;
        assert_eq!(out, clean, "with three slots");
        e.shutdown().await;
    });
}

#[test]
fn dropping_the_stream_cancels_every_choice() {
    let dir = &fixtures()[0];
    runtime().block_on(async {
        let e = engine(dir, 1, 4, EngineConfig::new(FormChoice::Auto)).await;
        let mut s = e.submit(request(&[1, 2, 3], greedy(80), 3)).expect("submit");
        let mut seen = std::collections::HashSet::new();
        while seen.len() < 3 {
            match s.next().await {
                Some(Event::Token { choice, .. }) => drop(seen.insert(choice)),
                other => panic!("{other:?}"),
            }
        }
        drop(s);
        let t0 = std::time::Instant::now();
        loop {
            let h = e.health().await.expect("health");
            if h.running == 0 && h.waiting == 0 {
                assert_eq!(h.free_slots, 4, "{h:?}");
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "choices still run: {h:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let m = e.metrics().snapshot();
        assert_eq!((m.requests_cancelled, m.requests_finished), (1, 0), "{m:?}");
        e.shutdown().await;
    });
}

#[test]
fn n_past_the_slots_or_on_a_session_turn_is_refused() {
    let dir = &fixtures()[0];
    runtime().block_on(async {
        let e = engine(dir, 1, 2, EngineConfig::new(FormChoice::Auto)).await;
        for (n, want) in [(0, "n must be at least 1"), (3, "n 3 exceeds the 2 sequences")] {
            let (kind, error) = run(&e, request(&[1, 2], greedy(2), n)).await.expect_err("refused");
            assert_eq!(kind, FailureKind::InvalidArgument, "{error}");
            assert!(error.contains(want), "{error}");
        }
        let owner = SessionOwner::new(0);
        let options = SessionOptions {
            defaults: greedy(2),
            speculate: true,
        };
        let sid = e.create_session(owner, options).await.expect("session").id;
        let mut turn = request(&[1, 2], greedy(2), 2);
        turn.session = Some(sid.clone());
        let (kind, error) = run(&e, turn).await.expect_err("refused");
        assert_eq!(kind, FailureKind::InvalidArgument);
        assert!(error.contains("session's turn") && error.contains("n = 1"), "{error}");
        // The session is not left busy, and the engine keeps serving.
        let mut ok = request(&[1, 2], greedy(2), 1);
        ok.session = Some(sid);
        assert_eq!(run(&e, ok).await.expect("a turn").len(), 1);
        assert_eq!(run(&e, request(&[1, 2], greedy(2), 2)).await.expect("n = 2").len(), 2);
        e.shutdown().await;
    });
}

#[test]
fn each_choice_reports_its_tokens_logprobs_and_the_prompt_comes_once() {
    let dir = &fixtures()[0];
    runtime().block_on(async {
        let e = engine(dir, 1, 4, EngineConfig::new(FormChoice::Auto)).await;
        // A prompt shared by a fork prefill, and a one-token prompt (its choices start afresh: choice 0 reports it).
        for prompt in [&[1u32, 2, 3][..], &[1]] {
            for (logprobs, prompt_logprobs) in [(Some(2), None), (None, Some(1)), (Some(0), Some(0))] {
                let mut r = request(prompt, sampled(3, 8), 3);
                r.logprobs = logprobs;
                r.prompt_logprobs = prompt_logprobs;
                let mut s = e.submit(r).expect("submit");
                let (mut prompts, mut tokens, mut finished) = (Vec::new(), 0, 0);
                while let Some(ev) = s.next().await {
                    match ev {
                        Event::PromptLogprobs { first_token, entries } => {
                            assert_eq!(first_token, prompt[0]);
                            prompts.push(entries)
                        }
                        Event::Token { token, logprob, .. } => {
                            tokens += 1;
                            match (logprobs, logprob) {
                                (Some(k), Some(l)) => {
                                    assert_eq!(l.token, token);
                                    assert_eq!(l.top.len(), k);
                                    assert!(l.logprob <= 0.0);
                                }
                                (None, None) => {}
                                (want, got) => panic!("asked {want:?}, got {got:?}"),
                            }
                        }
                        Event::Finished { .. } => finished += 1,
                        Event::Failed { error, .. } => panic!("{prompt:?}: {error}"),
                    }
                }
                assert_eq!((tokens, finished), (9, 3), "{prompt:?}");
                if prompt_logprobs.is_some() {
                    assert_eq!(prompts.len(), 1, "{prompt:?}: the prompt's entries come once");
                    let entries = &prompts[0];
                    assert_eq!(entries.len(), prompt.len());
                    assert!(entries[0].is_none());
                    for (i, entry) in entries.iter().enumerate().skip(1) {
                        assert_eq!(entry.as_ref().map(|x| x.token), Some(prompt[i]), "{prompt:?}");
                    }
                } else {
                    assert!(prompts.is_empty());
                }
            }
        }
        e.shutdown().await;
    });
}
