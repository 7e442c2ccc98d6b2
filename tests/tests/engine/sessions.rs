//! Sessions on CPU ranks: a turn continues the session's saved state (only its new tokens are prefilled) and gives
//! exactly the tokens of one sequence run through the same prefills and decodes; forks diverge independently; a
//! session survives a rank fault mid-turn; a turn that ends inside a speculative verify saves the right state;
//! busy, closed and unknown sessions are refused with their reason; forks share their saved state, and the memory
//! budget evicts idle sessions or fails a turn whose state cannot fit.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rewind_actors::{
    EngineConfig, EngineHandle, EngineSpec, Event, FailureKind, GenerateRequest, SessionOptions, SessionOwner, Usage,
};
use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::rank::{CpuLauncher, CpuOptions, FaultKind, FaultSpec, GroupSequence, Rows, SeqKind};
use rewind_engine::sample::SamplingParams;
use rewind_engine::spec::factory::{build, Target};
use rewind_engine::spec::{DrafterKind, SpecConfig, SpecPolicy};
use rewind_tests::{argmax, fixtures, group, name, runtime, tokens};

const CONTEXT: usize = 96;

/// The one owner of an engine whose front end has no API keys.
const ANYONE: SessionOwner = SessionOwner::new(0);

async fn engine(dir: &Path, tp: usize, config: EngineConfig) -> EngineHandle {
    let mut decoder = DecoderConfig::new(2, CONTEXT);
    decoder.max_verify = config.spec.as_ref().map_or(1, |s| s.config.max_verify());
    let launcher = CpuLauncher::new(dir, CpuOptions { tp, decoder }).expect("launcher");
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

fn options() -> SessionOptions {
    SessionOptions {
        defaults: greedy(8),
        speculate: true,
    }
}

fn turn(session: &str, prompt: &[u32], n: usize) -> GenerateRequest {
    let mut r = GenerateRequest::new(prompt.to_vec(), greedy(n));
    r.session = Some(session.to_string());
    r
}

/// A request's tokens and usage, or its failure.
async fn run(e: &EngineHandle, r: GenerateRequest) -> Result<(Vec<u32>, Usage), (FailureKind, String)> {
    let mut s = e.submit(r).expect("submit");
    let mut out = Vec::new();
    while let Some(ev) = s.next().await {
        match ev {
            Event::Token { token, .. } => out.push(token),
            Event::PromptLogprobs { .. } => panic!("no prompt log-probabilities were asked for"),
            Event::Finished { usage, .. } => return Ok((out, usage)),
            Event::Failed { error, kind } => return Err((kind, error)),
        }
    }
    panic!("the stream ended without a final event")
}

/// The session's computation as one sequence: each turn's tokens prefilled as one chunk (the previous turn's last
/// token first), then greedy decodes one token at a time; the generated tokens of each turn.
fn reference(dir: &Path, turns: &[(&[u32], usize)]) -> Vec<Vec<u32>> {
    let mut g = group(dir, 1, DecoderConfig::new(1, CONTEXT));
    let mut seq = GroupSequence::open(&mut g, FormChoice::Auto, CONTEXT).expect("open");
    let mut carry: Option<u32> = None;
    let mut outs = Vec::new();
    for &(prompt, n) in turns {
        let mut chunk: Vec<u32> = carry.into_iter().collect();
        chunk.extend_from_slice(prompt);
        let mut logits = seq
            .run(SeqKind::Prefill, &chunk, Rows::Last, true)
            .expect("prefill")
            .logits
            .expect("logits");
        let mut out = Vec::new();
        loop {
            let t = argmax(&logits);
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
        carry = out.last().copied();
        outs.push(out);
    }
    outs
}

#[test]
fn turns_continue_the_saved_state_and_forks_diverge_independently() {
    let rt = runtime();
    for dir in fixtures() {
        let (toks, prefill) = tokens(&dir);
        let (a, b, c) = (&toks[..prefill], &toks[prefill..prefill + 3], &toks[1..3]);
        let want_ab = reference(&dir, &[(a, 6), (b, 5)]);
        let want_ac = reference(&dir, &[(a, 6), (c, 4)]);
        let want_abc = reference(&dir, &[(a, 6), (b, 5), (c, 3)]);
        for tp in [1, 2] {
            rt.block_on(async {
                let e = engine(&dir, tp, EngineConfig::new(FormChoice::Auto)).await;
                let s = e.create_session(ANYONE, options()).await.expect("create").id;
                let (t1, u1) = run(&e, turn(&s, a, 6)).await.expect("turn 1");
                assert_eq!(t1, want_ab[0], "{} tp {tp}: turn 1", name(&dir));
                assert_eq!(u1.cached_tokens, 0);
                let fork = e.fork_session(ANYONE, &s).await.expect("fork");
                assert_eq!(fork.tokens, a.len() + 6);
                assert_eq!(fork.forked_from.as_deref(), Some(s.as_str()));

                let before = e.metrics().snapshot().prefill_tokens;
                let (t2, u2) = run(&e, turn(&s, b, 5)).await.expect("turn 2");
                assert_eq!(t2, want_ab[1], "{} tp {tp}: turn 2", name(&dir));
                // Only the previous turn's last token and the new ones were prefilled.
                assert_eq!(u2.cached_tokens, a.len() + 5);
                assert_eq!(u2.prompt_tokens, a.len() + 6 + b.len());
                assert_eq!(e.metrics().snapshot().prefill_tokens - before, 1 + b.len() as u64);

                let (f2, _) = run(&e, turn(&fork.id, c, 4)).await.expect("fork's turn");
                assert_eq!(f2, want_ac[1], "{} tp {tp}: the fork's turn", name(&dir));
                let (t3, _) = run(&e, turn(&s, c, 3)).await.expect("turn 3");
                assert_eq!(
                    t3,
                    want_abc[2],
                    "{} tp {tp}: the original after the fork ran",
                    name(&dir)
                );

                let info = e.session(ANYONE, &s).await.expect("info");
                assert_eq!(
                    (info.turns, info.tokens, info.busy),
                    (3, a.len() + 6 + b.len() + 5 + c.len() + 3, false)
                );
                assert_eq!(e.list_sessions(ANYONE).await.expect("list").len(), 2);
                let h = e.health().await.expect("health");
                assert_eq!((h.running, h.waiting), (0, 0), "idle sessions hold no slot");
                e.shutdown().await;
            });
        }
    }
}

#[test]
fn a_session_survives_a_rank_fault_mid_turn() {
    let rt = runtime();
    let dir = &fixtures()[0];
    let (toks, prefill) = tokens(dir);
    let (a, b) = (&toks[..prefill], &toks[prefill..prefill + 2]);
    let want = reference(dir, &[(a, 4), (b, 6), (b, 2)]);
    rt.block_on(async {
        let mut config = EngineConfig::new(FormChoice::Auto);
        // Turn 1 takes steps 1–4 (a prefill, three decodes); step 7 is mid-way through turn 2.
        config.faults = vec![FaultSpec {
            rank: 1,
            kind: FaultKind::Error,
            step: 7,
        }];
        let e = engine(dir, 2, config).await;
        let s = e.create_session(ANYONE, options()).await.expect("create").id;
        assert_eq!(run(&e, turn(&s, a, 4)).await.expect("turn 1").0, want[0]);
        let (t2, u2) = run(&e, turn(&s, b, 6)).await.expect("turn 2 across the fault");
        assert_eq!(t2, want[1]);
        assert_eq!(u2.cached_tokens, a.len() + 3);
        assert_eq!(e.metrics().snapshot().recoveries, 1);
        assert_eq!(run(&e, turn(&s, b, 2)).await.expect("turn 3").0, want[2]);
        e.shutdown().await;
    });
}

#[test]
fn a_turn_ending_inside_a_verify_saves_the_state_before_its_last_token() {
    let rt = runtime();
    for dir in fixtures() {
        let (toks, prefill) = tokens(&dir);
        let (a, b) = (&toks[..prefill], &toks[prefill..prefill + 2]);
        // Turn lengths that are not multiples of the window, so turns end inside a verify of accepted drafts.
        let want = reference(&dir, &[(a, 7), (b, 6)]);
        let spec = SpecConfig {
            drafter: DrafterKind::Oracle { p: 0.0 },
            window: 3,
            policy: SpecPolicy::Fixed,
            profile: None,
        };
        let vocab = rewind_engine::model::ModelConfig::from_dir(&dir)
            .expect("config")
            .vocab_size;
        let target = Target {
            dir: &dir,
            vocab,
            slots: 2,
            max_context: CONTEXT,
            window: spec.window,
            mtp_on_ranks: false,
        };
        let factory = build(&spec.drafter, &target).expect("drafter");
        rt.block_on(async {
            let mut config = EngineConfig::new(FormChoice::Replay);
            config.spec = Some(EngineSpec {
                config: spec.clone(),
                factory,
            });
            let e = engine(&dir, 1, config).await;
            let s = e.create_session(ANYONE, options()).await.expect("create").id;
            let mut r1 = turn(&s, a, 7);
            r1.reference = Some(want[0].clone());
            assert_eq!(run(&e, r1).await.expect("turn 1").0, want[0], "{}", name(&dir));
            let mut r2 = turn(&s, b, 6);
            r2.reference = Some(want[1].clone());
            let (t2, u2) = run(&e, r2).await.expect("turn 2");
            assert_eq!(
                t2,
                want[1],
                "{}: turn 2 after a turn that ended in a verify",
                name(&dir)
            );
            assert_eq!(u2.cached_tokens, a.len() + 6);
            assert!(
                e.metrics().snapshot().spec_accepted > 0,
                "the oracle's drafts were accepted"
            );
            e.shutdown().await;
        });
    }
}

#[test]
fn busy_closed_and_unknown_sessions_are_refused_with_their_reason() {
    let rt = runtime();
    let dir = &fixtures()[0];
    let (toks, prefill) = tokens(dir);
    let a = &toks[..prefill];
    rt.block_on(async {
        let e = engine(dir, 1, EngineConfig::new(FormChoice::Auto)).await;
        let s = e.create_session(ANYONE, options()).await.expect("create").id;
        let long = e.submit(turn(&s, a, 40)).expect("submit");
        let busy = run(&e, turn(&s, a, 2)).await.expect_err("a second turn while one runs");
        assert_eq!(busy.0, FailureKind::FailedPrecondition, "{busy:?}");
        assert!(busy.1.contains("running a turn"), "{}", busy.1);
        assert!(
            e.fork_session(ANYONE, &s).await.is_err(),
            "a busy session cannot be forked"
        );
        // Cancelling the turn leaves the session as it was, and free.
        drop(long);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let info = e.session(ANYONE, &s).await.expect("info");
        assert_eq!((info.tokens, info.turns), (0, 0));
        assert!(run(&e, turn(&s, a, 2)).await.is_ok());

        e.close_session(ANYONE, &s).await.expect("close");
        let gone = run(&e, turn(&s, a, 2)).await.expect_err("a closed session");
        assert_eq!(gone.0, FailureKind::NotFound);
        assert!(gone.1.contains("closed"), "{}", gone.1);
        let unknown = run(&e, turn("sess-0000", a, 2)).await.expect_err("an unknown session");
        assert_eq!(unknown.0, FailureKind::NotFound);
        assert!(unknown.1.contains("no session has this id"), "{}", unknown.1);
        let h = e.health().await.expect("health");
        assert_eq!((h.running, h.waiting), (0, 0));
        e.shutdown().await;
    });
}

#[test]
fn idle_sessions_are_evicted() {
    let rt = runtime();
    let dir = &fixtures()[0];
    let (toks, prefill) = tokens(dir);
    rt.block_on(async {
        let mut config = EngineConfig::new(FormChoice::Auto);
        config.session_idle_timeout = Some(Duration::from_millis(200));
        let e = engine(dir, 1, config).await;
        let s = e.create_session(ANYONE, options()).await.expect("create").id;
        run(&e, turn(&s, &toks[..prefill], 2)).await.expect("turn");
        tokio::time::sleep(Duration::from_millis(600)).await;
        // The timer evicted it without any session call in between.
        assert_eq!(e.metrics().snapshot().sessions, 0);
        let gone = run(&e, turn(&s, &toks[..1], 2)).await.expect_err("an evicted session");
        assert_eq!(gone.0, FailureKind::NotFound);
        assert!(gone.1.contains("evicted"), "{}", gone.1);
        e.shutdown().await;
    });
}

#[test]
fn forks_share_state_and_the_memory_budget_evicts_or_refuses() {
    let rt = runtime();
    let dir = &fixtures()[0];
    let (toks, prefill) = tokens(dir);
    let a = &toks[..prefill];
    let bytes = |e: &EngineHandle| e.metrics().snapshot().session_state_bytes;
    let one = rt.block_on(async {
        let e = engine(dir, 1, EngineConfig::new(FormChoice::Auto)).await;
        let s = e.create_session(ANYONE, options()).await.expect("create").id;
        run(&e, turn(&s, a, 2)).await.expect("turn");
        let one = bytes(&e);
        assert!(one > 0);
        // Forks share the saved state: counted (and held) once, until one of them saves its own.
        let forks = [
            e.fork_session(ANYONE, &s).await.expect("fork").id,
            e.fork_session(ANYONE, &s).await.expect("fork").id,
        ];
        assert_eq!(bytes(&e), one);
        run(&e, turn(&forks[0], &a[..1], 2)).await.expect("the fork's turn");
        assert!(bytes(&e) > one, "the fork saved a state of its own");
        for id in [&s, &forks[0], &forks[1]] {
            e.close_session(ANYONE, id).await.expect("close");
        }
        assert_eq!(bytes(&e), 0);
        e.shutdown().await;
        one
    });
    rt.block_on(async {
        // Room for one such state, not two: the second session's save evicts the idle first one.
        let mut config = EngineConfig::new(FormChoice::Auto);
        config.session_memory = one as usize * 3 / 2;
        let e = engine(dir, 1, config).await;
        let first = e.create_session(ANYONE, options()).await.expect("create").id;
        run(&e, turn(&first, a, 2)).await.expect("turn");
        let second = e.create_session(ANYONE, options()).await.expect("create").id;
        run(&e, turn(&second, a, 2)).await.expect("turn");
        let m = e.metrics().snapshot();
        assert_eq!(
            (m.sessions, m.sessions_evicted_memory, m.session_state_bytes),
            (1, 1, one)
        );
        let gone = run(&e, turn(&first, a, 2)).await.expect_err("an evicted session");
        assert_eq!(gone.0, FailureKind::NotFound);
        assert!(gone.1.contains("memory budget"), "{}", gone.1);
        e.shutdown().await;
    });
    rt.block_on(async {
        // No room for even one: the turn fails, the session stays as it was.
        let mut config = EngineConfig::new(FormChoice::Auto);
        config.session_memory = one as usize / 2;
        let e = engine(dir, 1, config).await;
        let s = e.create_session(ANYONE, options()).await.expect("create").id;
        let refused = run(&e, turn(&s, a, 2)).await.expect_err("a state over the budget");
        assert_eq!(refused.0, FailureKind::ResourceExhausted, "{refused:?}");
        assert!(refused.1.contains("--session-memory"), "{}", refused.1);
        let info = e.session(ANYONE, &s).await.expect("info");
        assert_eq!((info.tokens, info.turns, info.busy), (0, 0, false));
        let m = e.metrics().snapshot();
        assert_eq!((m.session_saves_refused, m.session_state_bytes), (1, 0));
        e.shutdown().await;
    });
}
