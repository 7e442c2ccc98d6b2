//! Automatic prefix caching on CPU ranks (`actors/src/coordinator/prefix/`): a request whose prompt starts with a
//! finished sequence's tokens starts from that sequence's saved state and gives exactly the tokens of a cold run
//! (greedy, and sampled with the same seed) in every decode form at TP 1–4; a multi-turn conversation hits at the
//! whole previous conversation; a prompt leaving a cached path hits at the deepest cached state before the point it
//! leaves; a small budget evicts the least recently used states; `n > 1` choices and session turns share the cache;
//! a request asking for log-probabilities computes its whole prompt; turning it off restores nothing; and random
//! request streams (shared prefixes, divergence anywhere, eviction) give every request its cold tokens, the hits the
//! cache's contents predict, and accounts within the budget.

use std::cell::{Cell, RefCell};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use rewind_actors::{
    EngineConfig, EngineHandle, EngineSpec, Event, GenerateRequest, MetricsSnapshot, PrefixCacheConfig, SessionOptions,
    SessionOwner, Usage,
};
use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::rank::{CpuLauncher, CpuOptions, FaultKind, FaultSpec};
use rewind_engine::sample::SamplingParams;
use rewind_engine::spec::factory::{build, Target};
use rewind_engine::spec::{DrafterKind, SpecConfig, SpecPolicy};
use rewind_tests::{fixtures, name, runtime, tokens};

const CONTEXT: usize = 96;

/// A cache that takes every state (no minimum length) within `memory` bytes.
fn cache(memory: usize) -> Option<PrefixCacheConfig> {
    Some(PrefixCacheConfig { memory, min_tokens: 1 })
}

const LARGE: usize = 256 << 20;

/// An engine of `slots` slots at `tp` decoding in `form`, with the prefix cache `prefix`; `None` when the model
/// cannot be split `tp` ways.
async fn engine(
    dir: &Path,
    tp: usize,
    slots: usize,
    form: FormChoice,
    prefix: Option<PrefixCacheConfig>,
) -> Option<EngineHandle> {
    let launcher = CpuLauncher::new(
        dir,
        CpuOptions {
            tp,
            decoder: DecoderConfig::new(slots, CONTEXT),
        },
    )
    .ok()?;
    let mut config = EngineConfig::new(form);
    config.prefix_cache = prefix;
    Some(
        EngineHandle::start(Arc::new(launcher), config)
            .await
            .unwrap_or_else(|e| panic!("{} at tp {tp} {form}: {e}", name(dir))),
    )
}

/// The engine's metrics once the step that finished the last request is done (its states are copied into the cache
/// after its client hears it finished; a health query waits behind that step).
async fn metrics(e: &EngineHandle) -> MetricsSnapshot {
    e.health().await.expect("health");
    e.metrics().snapshot()
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

/// A request's tokens (by choice) and its first choice's usage.
async fn run_n(e: &EngineHandle, r: GenerateRequest) -> (Vec<Vec<u32>>, Usage) {
    let n = r.n;
    let mut s = e.submit(r).expect("submit");
    let mut out = vec![Vec::new(); n];
    let (mut usage, mut finished) = (None, 0);
    while let Some(ev) = s.next().await {
        match ev {
            Event::Token { token, choice, .. } => out[choice].push(token),
            Event::Finished { usage: u, choice, .. } => {
                if choice == 0 {
                    usage = Some(u);
                }
                finished += 1;
                if finished == n {
                    break;
                }
            }
            Event::PromptLogprobs { .. } => {}
            Event::Failed { error, kind } => panic!("the request failed ({kind:?}): {error}"),
        }
    }
    (out, usage.expect("a finished event"))
}

async fn run(e: &EngineHandle, prompt: &[u32], params: SamplingParams) -> (Vec<u32>, Usage) {
    let (mut out, usage) = run_n(e, GenerateRequest::new(prompt.to_vec(), params)).await;
    (out.swap_remove(0), usage)
}

/// The fixtures the form and TP matrix runs on: a Mamba-2 hybrid and a Gated DeltaNet hybrid.
fn two_fixtures() -> Vec<PathBuf> {
    fixtures()
        .into_iter()
        .filter(|d| ["nemotron_h_dense", "qwen3_5"].contains(&name(d).as_str()))
        .collect()
}

/// `n` more tokens for a prompt, valid in any fixture's vocabulary, different for each `salt`.
fn more(n: usize, salt: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 37 + salt * 11 + 5) % 150) as u32).collect()
}

#[test]
fn a_hit_gives_the_cold_tokens_in_every_form_and_tp() {
    let rt = runtime();
    for dir in two_fixtures() {
        let (toks, prefill) = tokens(&dir);
        let p = toks[..prefill].to_vec();
        // The cold runs: TP 1, recurrent, no cache.
        let (a, b_cold, c_cold, b_prompt) = rt.block_on(async {
            let e = engine(&dir, 1, 2, FormChoice::Recurrent, None).await.expect("tp 1");
            let (a, _) = run(&e, &p, greedy(6)).await;
            let mut b_prompt = p.clone();
            b_prompt.extend_from_slice(&a);
            b_prompt.extend(more(3, 1));
            let (b, u) = run(&e, &b_prompt, greedy(6)).await;
            assert_eq!(u.cached_tokens, 0, "no cache, no hit");
            let (c, _) = run(&e, &b_prompt, sampled(6, 7)).await;
            e.shutdown().await;
            (a, b, c, b_prompt)
        });
        let cached = p.len() + a.len() - 1;
        for tp in 1..=4 {
            for form in [
                FormChoice::Recurrent,
                FormChoice::Replay,
                FormChoice::KvOnly,
                FormChoice::Auto,
            ] {
                let label = format!("{} tp {tp} {form}", name(&dir));
                rt.block_on(async {
                    let Some(e) = engine(&dir, tp, 2, form, cache(LARGE)).await else {
                        assert!(tp > 3, "{label}: TP {tp} is required");
                        return;
                    };
                    let (got_a, u) = run(&e, &p, greedy(6)).await;
                    assert_eq!(
                        (&got_a, u.cached_tokens),
                        (&a, 0),
                        "{label}: the first request runs cold"
                    );
                    let (b, u) = run(&e, &b_prompt, greedy(6)).await;
                    assert_eq!(
                        u.cached_tokens, cached,
                        "{label}: the first request's state is a prefix"
                    );
                    assert_eq!(b, b_cold, "{label}: greedy after a hit");
                    let (c, u) = run(&e, &b_prompt, sampled(6, 7)).await;
                    assert_eq!(u.cached_tokens, cached, "{label}");
                    assert_eq!(c, c_cold, "{label}: sampled with the same seed after a hit");
                    let m = metrics(&e).await;
                    assert_eq!(m.prefix_cache_hit_tokens as usize, 2 * cached, "{label}");
                    assert_eq!(
                        m.prefix_cache_query_tokens as usize,
                        p.len() + 2 * b_prompt.len(),
                        "{label}"
                    );
                    // The prompt tokens prefilled: the first request's, then each hit's rest.
                    assert_eq!(
                        m.prefill_tokens as usize,
                        p.len() + 2 * (b_prompt.len() - cached),
                        "{label}"
                    );
                    // The finished sequences' states, and the branch point the repeated prompt left the second
                    // one's path at (its last token: the state of all of it but its last token).
                    let distinct = if c == b { 3 } else { 4 };
                    assert_eq!(
                        m.prefix_cache_states, distinct,
                        "{label}: the finished sequences' states and a branch point"
                    );
                    e.shutdown().await;
                });
            }
        }
    }
}

#[test]
fn a_conversation_hits_at_the_whole_previous_turn() {
    let rt = runtime();
    for dir in two_fixtures() {
        let (toks, prefill) = tokens(&dir);
        rt.block_on(async {
            let cold = engine(&dir, 1, 1, FormChoice::Auto, None).await.expect("cold");
            let e = engine(&dir, 2, 1, FormChoice::Auto, cache(LARGE)).await.expect("tp 2");
            let mut conversation = toks[..prefill].to_vec();
            let mut last: Option<usize> = None;
            for turn in 0..4 {
                let (want, _) = run(&cold, &conversation, greedy(5)).await;
                let (got, u) = run(&e, &conversation, greedy(5)).await;
                assert_eq!(got, want, "{} turn {turn}", name(&dir));
                // The previous turn's state holds its prompt and every reply token but the last.
                assert_eq!(u.cached_tokens, last.unwrap_or(0), "{} turn {turn}", name(&dir));
                last = Some(conversation.len() + got.len() - 1);
                conversation.extend_from_slice(&got);
                conversation.extend(more(4, turn));
            }
            cold.shutdown().await;
            e.shutdown().await;
        });
    }
}

/// A rank fault while a request that hit is running loses the ranks' stored states: the request re-prefills its
/// whole prompt (no cached tokens reported) and still gives the cold run's tokens; the cache fills again after.
#[test]
fn a_fault_during_a_hit_reprefills_the_lost_prefix_and_changes_no_token() {
    let dir = &two_fixtures()[0];
    let p = more(12, 5);
    runtime().block_on(async {
        let cold = engine(dir, 1, 2, FormChoice::Auto, None).await.expect("cold");
        let (a, _) = run(&cold, &p, greedy(4)).await;
        let mut q = p.clone();
        q.extend_from_slice(&a);
        q.extend(more(3, 9));
        let (want, _) = run(&cold, &q, greedy(8)).await;
        cold.shutdown().await;

        let launcher = CpuLauncher::new(
            dir,
            CpuOptions {
                tp: 2,
                decoder: DecoderConfig::new(2, CONTEXT),
            },
        )
        .expect("launcher");
        let mut config = EngineConfig::new(FormChoice::Auto);
        config.prefix_cache = cache(LARGE);
        // Steps 1-4 run the first request (a prefill and three decodes); the second restores its state and
        // prefills from step 5, so step 8 breaks one of its decodes.
        config.faults = vec![FaultSpec {
            rank: 1,
            kind: FaultKind::Error,
            step: 8,
        }];
        let e = EngineHandle::start(Arc::new(launcher), config).await.expect("engine");
        let (got_a, _) = run(&e, &p, greedy(4)).await;
        assert_eq!(got_a, a);
        let (got, u) = run(&e, &q, greedy(8)).await;
        assert_eq!(got, want, "tokens after the fault");
        assert_eq!(u.cached_tokens, 0, "the restored prefix was lost and computed again");
        let m = metrics(&e).await;
        assert_eq!((m.faults, m.recoveries), (1, 1), "{m:?}");
        // The restart emptied the cache; the second request's own state went in after it.
        assert_eq!(m.prefix_cache_states, 1);
        let mut r = q.clone();
        r.extend_from_slice(&got);
        r.extend(more(2, 11));
        let (_, u) = run(&e, &r, greedy(2)).await;
        assert_eq!(
            u.cached_tokens,
            q.len() + got.len() - 1,
            "a hit on the state stored after the fault"
        );
        e.shutdown().await;
    });
}

/// A prompt that leaves a cached path hits at the deepest state before the point it leaves, and the state at that
/// point (its prompt chunk cut there) is cached for the prompts that share the same start.
/// Prompts that share only a start (a system prompt, then different user turns): the second one's prompt chunk is
/// cut where it leaves the first's path and the state there stored, so every later one hits the shared start, at TP 2.
#[test]
fn prompts_sharing_a_system_prompt_hit_it_from_the_third_on() {
    let dir = &two_fixtures()[1];
    let system = more(24, 21);
    runtime().block_on(async {
        let cold = engine(dir, 1, 2, FormChoice::Auto, None).await.expect("cold");
        let e = engine(dir, 2, 2, FormChoice::Auto, cache(LARGE)).await.expect("tp 2");
        for user in 0..4 {
            let mut prompt = system.clone();
            // User turns that differ in their first token.
            prompt.push(140 + user as u32);
            prompt.extend(more(5, 200 + user));
            let (want, _) = run(&cold, &prompt, greedy(3)).await;
            let (got, u) = run(&e, &prompt, greedy(3)).await;
            assert_eq!(got, want, "user turn {user}");
            let expect = if user < 2 { 0 } else { system.len() };
            assert_eq!(u.cached_tokens, expect, "user turn {user}");
        }
        cold.shutdown().await;
        e.shutdown().await;
    });
}

#[test]
fn a_prompt_leaving_a_cached_path_hits_before_it_and_caches_the_branch_point() {
    let dir = &two_fixtures()[0];
    let base = more(30, 3);
    // The deepest cached state of at most `limit` tokens that `prompt` starts with.
    let deepest = |states: &[Vec<u32>], prompt: &[u32], limit: usize| {
        states
            .iter()
            .filter(|t| t.len() <= limit && prompt.starts_with(t))
            .map(Vec::len)
            .max()
            .unwrap_or(0)
    };
    runtime().block_on(async {
        let cold = engine(dir, 1, 1, FormChoice::Auto, None).await.expect("cold");
        let e = engine(dir, 1, 1, FormChoice::Auto, cache(LARGE)).await.expect("engine");
        // States after 10 and after 20 tokens of `base` (one generated token each: the state holds the prompt).
        run(&e, &base[..10], greedy(1)).await;
        run(&e, &base[..20], greedy(1)).await;
        // Every state cached: those two, then each query's branch point and its own.
        let mut states = vec![base[..10].to_vec(), base[..20].to_vec()];
        for leave in [4, 10, 11, 15, 19, 20, 21, 27] {
            let mut prompt = base[..leave].to_vec();
            prompt.extend(more(6, 100 + leave));
            let common = prompt.iter().zip(&base).take_while(|(a, b)| a == b).count();
            let want_cached = deepest(&states, &prompt, prompt.len() - 1);
            assert!(want_cached <= common, "leaving at {leave}");
            let (want, _) = run(&cold, &prompt, greedy(4)).await;
            let (got, u) = run(&e, &prompt, greedy(4)).await;
            assert_eq!(u.cached_tokens, want_cached, "leaving at {leave}");
            assert_eq!(got, want, "leaving at {leave}");
            // Where the prompt left the cached paths, past its hit: that state was stored.
            let branch = states
                .iter()
                .map(|t| t.iter().zip(&prompt).take_while(|(a, b)| a == b).count())
                .max()
                .unwrap_or(0)
                .min(prompt.len() - 1);
            if branch > want_cached {
                states.push(prompt[..branch].to_vec());
            }
            states.push(prompt.iter().chain(&got[..3]).copied().collect());
        }
        let m = metrics(&e).await;
        assert_eq!(m.prefix_cache_states, states.len() as u64, "{states:?}");
        // A prompt that is exactly a cached state's tokens still computes its last token (for its logits): it hits
        // at the branch point the query leaving at 19 cached.
        let (_, u) = run(&e, &base[..20], greedy(1)).await;
        assert_eq!(u.cached_tokens, 19);
        cold.shutdown().await;
        e.shutdown().await;
    });
}

#[test]
fn a_small_budget_evicts_the_least_recently_used_state() {
    let dir = &two_fixtures()[0];
    let prompts: Vec<Vec<u32>> = (0..3).map(|k| more(12, 40 + k)).collect();
    runtime().block_on(async {
        // One state's size, from a roomy cache: every prompt below leaves a state of the same length.
        let e = engine(dir, 1, 1, FormChoice::Auto, cache(LARGE)).await.expect("engine");
        run(&e, &prompts[0], greedy(3)).await;
        let one = metrics(&e).await.prefix_cache_bytes as usize;
        assert!(one > 0);
        e.shutdown().await;

        let budget = 2 * one + one / 2;
        let e = engine(dir, 1, 1, FormChoice::Auto, cache(budget))
            .await
            .expect("engine");
        let extend = |k: usize, out: &[u32]| {
            let mut p = prompts[k].clone();
            p.extend_from_slice(out);
            p.extend(more(2, 90 + k));
            p
        };
        let (a, _) = run(&e, &prompts[0], greedy(3)).await;
        let (b, _) = run(&e, &prompts[1], greedy(3)).await;
        // A use of the first state makes the second the least recently used; this request's own state (longer,
        // and so larger) then evicts it.
        let (_, u) = run(&e, &extend(0, &a), greedy(1)).await;
        assert_eq!(u.cached_tokens, 12 + 2, "the first state is cached");
        let m = metrics(&e).await;
        assert!(m.prefix_cache_evictions >= 1, "{m:?}");
        assert!(m.prefix_cache_bytes as usize <= budget, "{m:?}");
        let (_, u) = run(&e, &extend(1, &b), greedy(1)).await;
        assert_eq!(u.cached_tokens, 0, "the second state was the least recently used");
        let m = metrics(&e).await;
        assert!(m.prefix_cache_bytes as usize <= budget, "{m:?}");
        assert_eq!(
            m.prefix_cache_states,
            m.prefix_cache_inserts - m.prefix_cache_evictions,
            "every state inserted is held or evicted: {m:?}"
        );
        assert_eq!(m.prefix_cache_memory_budget as usize, budget);
        e.shutdown().await;
    });
}

#[test]
fn choices_and_session_turns_share_the_cache_and_off_restores_nothing() {
    let dir = &two_fixtures()[1];
    let p = more(14, 7);
    runtime().block_on(async {
        let cold = engine(dir, 1, 3, FormChoice::Auto, None).await.expect("cold");
        let e = engine(dir, 1, 3, FormChoice::Auto, cache(LARGE)).await.expect("engine");
        let (a, _) = run(&e, &p, greedy(4)).await;
        let mut q = p.clone();
        q.extend_from_slice(&a);
        q.extend(more(3, 8));
        // n = 2: the fork prefill (all of q but its last token) starts from the cached state.
        let (want, _) = run(&cold, &q, greedy(4)).await;
        let r = GenerateRequest {
            n: 2,
            ..GenerateRequest::new(q.clone(), greedy(4))
        };
        let (got, u) = run_n(&e, r).await;
        assert_eq!(got, vec![want.clone(), want], "both greedy choices");
        assert_eq!(u.cached_tokens, p.len() + a.len() - 1);
        // The fork's state (all of q but its last token) is cached too: a lone request for q hits it.
        let (_, u) = run(&e, &q, greedy(2)).await;
        assert_eq!(u.cached_tokens, q.len() - 1);
        // Asking for log-probabilities computes the whole prompt (its values are then a cold run's to the bit).
        let r = GenerateRequest {
            logprobs: Some(2),
            ..GenerateRequest::new(q.clone(), greedy(2))
        };
        let (_, u) = run_n(&e, r).await;
        assert_eq!(u.cached_tokens, 0, "no hit for a request asking for log-probabilities");

        // A session's first turn (no saved state yet) starts from the cache; its saved state joins the cache.
        let s = e
            .create_session(
                SessionOwner::new(0),
                SessionOptions {
                    defaults: greedy(4),
                    speculate: false,
                },
            )
            .await
            .expect("session");
        let mut r = GenerateRequest::new(q.clone(), greedy(3));
        r.session = Some(s.id.clone());
        let (turn, u) = run(&e, &q, greedy(3)).await;
        let (got, tu) = {
            let (mut out, u2) = run_n(&e, r).await;
            (out.swap_remove(0), u2)
        };
        assert_eq!(
            got, turn,
            "a session turn from the cache gives the plain request's tokens"
        );
        assert_eq!((tu.cached_tokens, u.cached_tokens), (q.len() - 1, q.len() - 1));

        let off = engine(dir, 1, 3, FormChoice::Auto, None).await.expect("off");
        run(&off, &p, greedy(4)).await;
        let (_, u) = run(&off, &q, greedy(2)).await;
        let m = metrics(&off).await;
        assert_eq!(
            (u.cached_tokens, m.prefix_cache_states, m.prefix_cache_query_tokens),
            (0, 0, 0)
        );
        for h in [cold, e, off] {
            h.shutdown().await;
        }
    });
}

/// One request of a random stream: which earlier sequence (or base prompt) its prompt starts from, how much of that
/// it keeps, what follows, and how it samples.
#[derive(Clone, Debug)]
struct Step {
    from: usize,
    keep: usize,
    extra: usize,
    max_tokens: usize,
    seed: Option<u64>,
}

fn step() -> impl Strategy<Value = Step> {
    (0usize..8, 0usize..64, 1usize..6, 1usize..5, prop::option::of(0u64..4)).prop_map(
        |(from, keep, extra, max_tokens, seed)| Step {
            from,
            keep,
            extra,
            max_tokens,
            seed,
        },
    )
}

/// Random request streams run one request at a time: every request gives its cold tokens, hits at the longest
/// cached state its prompt starts with (every finished sequence's and every branch point's, kept with a roomy
/// budget), and with a small budget the cache stays within it.
#[test]
fn random_streams_hit_what_is_cached_and_match_cold_runs() {
    let dir = two_fixtures()[0].clone();
    let rt = runtime();
    let (cold, roomy, small, budget) = rt.block_on(async {
        // The small budget holds about three states of 20 tokens.
        let e = engine(&dir, 1, 1, FormChoice::Replay, cache(LARGE))
            .await
            .expect("measure");
        run(&e, &more(20, 9), greedy(2)).await;
        let one = metrics(&e).await.prefix_cache_bytes as usize;
        e.shutdown().await;
        let budget = 3 * one;
        (
            engine(&dir, 1, 1, FormChoice::Auto, None).await.expect("cold"),
            engine(&dir, 2, 1, FormChoice::Auto, cache(LARGE)).await.expect("roomy"),
            engine(&dir, 1, 1, FormChoice::Replay, cache(budget))
                .await
                .expect("small"),
            budget,
        )
    });
    let mut runner = TestRunner::new(Config {
        cases: 24,
        failure_persistence: None,
        ..Config::default()
    });
    // The states the roomy cache holds (every finished sequence's, kept across cases as the engines keep them).
    let states: RefCell<Vec<Vec<u32>>> = RefCell::new(Vec::new());
    let case = Cell::new(0usize);
    let result = runner.run(&prop::collection::vec(step(), 2..9), |steps| {
        case.set(case.get() + 1);
        let salt = case.get() * 1000;
        rt.block_on(async {
            // The sequences run so far in this case (prompt + output).
            let mut seqs: Vec<Vec<u32>> = vec![more(20, salt), more(20, salt + 1)];
            for (i, s) in steps.iter().enumerate() {
                let from = &seqs[s.from % seqs.len()];
                let mut prompt = from[..(s.keep % (from.len() + 1)).max(1)].to_vec();
                prompt.extend(more(s.extra, salt + 10 + i));
                prompt.truncate(CONTEXT - s.max_tokens - 1);
                let params = match s.seed {
                    Some(seed) => sampled(s.max_tokens, seed),
                    None => greedy(s.max_tokens),
                };
                let (want, _) = run(&cold, &prompt, params.clone()).await;
                let (got, u) = run(&roomy, &prompt, params.clone()).await;
                let (got_small, us) = run(&small, &prompt, params).await;
                prop_assert_eq!(&got, &want, "request {} of {:?}", i, steps);
                prop_assert_eq!(&got_small, &want, "request {} (small cache) of {:?}", i, steps);
                let expect = states
                    .borrow()
                    .iter()
                    .filter(|t| t.len() < prompt.len() && prompt.starts_with(t))
                    .map(Vec::len)
                    .max()
                    .unwrap_or(0);
                prop_assert_eq!(u.cached_tokens, expect, "request {} of {:?}", i, steps);
                // The small cache evicts, so it makes branch points of its own: only its tokens are checked.
                prop_assert!(us.cached_tokens < prompt.len());
                // Where the prompt left the cached paths, past its hit: the state there was stored.
                let branch = states
                    .borrow()
                    .iter()
                    .map(|t| t.iter().zip(&prompt).take_while(|(a, b)| a == b).count())
                    .max()
                    .unwrap_or(0)
                    .min(prompt.len() - 1);
                let mut kept = Vec::new();
                if branch > expect {
                    kept.push(prompt[..branch].to_vec());
                }
                kept.push(prompt.iter().chain(&got[..got.len() - 1]).copied().collect());
                for state in kept {
                    if !states.borrow().contains(&state) {
                        states.borrow_mut().push(state);
                    }
                }
                let mut sequence = prompt;
                sequence.extend_from_slice(&got);
                seqs.push(sequence);
                let m = metrics(&small).await;
                prop_assert!(m.prefix_cache_bytes as usize <= budget, "{:?}", m);
                let m = metrics(&roomy).await;
                prop_assert_eq!(m.prefix_cache_states as usize, states.borrow().len());
            }
            Ok(())
        })
    });
    rt.block_on(async {
        let m = metrics(&roomy).await;
        assert!(m.prefix_cache_hit_tokens > 0, "the streams hit: {m:?}");
        assert!(
            metrics(&small).await.prefix_cache_evictions > 0,
            "the small cache evicted"
        );
        for e in [cold, roomy, small] {
            e.shutdown().await;
        }
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// A sequence that finishes inside a speculative verify of accepted drafts is cached at the state before its last
/// token (the verify's kept tokens committed first), and a hit on it gives the cold tokens.
#[test]
fn a_sequence_ending_inside_a_verify_is_cached_before_its_last_token() {
    let dir = &two_fixtures()[0];
    let (toks, prefill) = tokens(dir);
    let p = toks[..prefill].to_vec();
    let rt = runtime();
    let (a, b, q) = rt.block_on(async {
        let cold = engine(dir, 1, 2, FormChoice::Replay, None).await.expect("cold");
        let (a, _) = run(&cold, &p, greedy(7)).await;
        let mut q = p.clone();
        q.extend_from_slice(&a);
        q.extend(more(3, 5));
        let (b, _) = run(&cold, &q, greedy(6)).await;
        cold.shutdown().await;
        (a, b, q)
    });
    let spec = SpecConfig {
        drafter: DrafterKind::Oracle { p: 0.0 },
        window: 3,
        policy: SpecPolicy::Fixed,
        profile: None,
    };
    let vocab = rewind_engine::model::ModelConfig::from_dir(dir)
        .expect("config")
        .vocab_size;
    let target = Target {
        dir,
        vocab,
        slots: 2,
        max_context: CONTEXT,
        window: spec.window,
        mtp_on_ranks: false,
    };
    let factory = build(&spec.drafter, &target).expect("drafter");
    rt.block_on(async {
        let launcher = CpuLauncher::new(
            dir,
            CpuOptions {
                tp: 1,
                decoder: DecoderConfig {
                    max_verify: spec.max_verify(),
                    ..DecoderConfig::new(2, CONTEXT)
                },
            },
        )
        .expect("launcher");
        let mut config = EngineConfig::new(FormChoice::Replay);
        config.prefix_cache = cache(LARGE);
        config.spec = Some(EngineSpec {
            config: spec.clone(),
            factory,
        });
        let e = EngineHandle::start(Arc::new(launcher), config).await.expect("engine");
        // The oracle drafts the cold tokens: 7 tokens end inside a verify of a window of 3.
        let r = GenerateRequest {
            reference: Some(a.clone()),
            ..GenerateRequest::new(p.clone(), greedy(7))
        };
        let (got, _) = run_n(&e, r).await;
        assert_eq!(got[0], a);
        assert!(metrics(&e).await.spec_accepted > 0, "the oracle's drafts were accepted");
        let r = GenerateRequest {
            reference: Some(b.clone()),
            ..GenerateRequest::new(q.clone(), greedy(6))
        };
        let (got, u) = run_n(&e, r).await;
        assert_eq!(got[0], b, "after a hit on a state settled from a verify");
        assert_eq!(u.cached_tokens, p.len() + 6);
        e.shutdown().await;
    });
}
