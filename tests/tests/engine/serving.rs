//! The actor runtime on CPU ranks: greedy outputs equal the engine's own sequence loop at TP 1–3 on every fixture;
//! 32 concurrent requests at TP 2 survive each injected fault kind with identical outputs and empty pools; a
//! request with bad parameters fails alone.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rewind_actors::{EngineConfig, EngineHandle, Event, GenerateRequest};
use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::rank::{CpuLauncher, CpuOptions, FaultKind, FaultSpec, GroupSequence, Rows, SeqKind};
use rewind_engine::sample::SamplingParams;
use rewind_engine::sched::FinishReason;
use rewind_tests::{argmax, fixtures, group, name, runtime, tokens, Rng};

use crate::outcomes;
use outcomes::{collect, serve_all, Outcome};

async fn engine(dir: &Path, tp: usize, slots: usize, context: usize, config: EngineConfig) -> EngineHandle {
    let launcher = CpuLauncher::new(
        dir,
        CpuOptions {
            tp,
            decoder: DecoderConfig::new(slots, context),
        },
    )
    .expect("launcher");
    EngineHandle::start(Arc::new(launcher), config)
        .await
        .unwrap_or_else(|e| panic!("{} at tp {tp}: {e}", dir.display()))
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..SamplingParams::greedy()
    }
}

/// The greedy continuation of `prompt` by the engine's own sequence loop (one rank group, recurrent form).
fn reference(dir: &Path, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut g = group(dir, 1, DecoderConfig::new(1, prompt.len() + n + 1));
    let mut seq = GroupSequence::open(&mut g, FormChoice::Recurrent, prompt.len() + n + 1).expect("open");
    let mut out = Vec::new();
    let mut logits = seq
        .run(SeqKind::Prefill, prompt, Rows::Last, true)
        .expect("prefill")
        .logits
        .expect("logits");
    for _ in 0..n {
        let t = argmax(&logits);
        out.push(t);
        logits = seq
            .run(SeqKind::Decode, &[t], Rows::Last, true)
            .expect("decode")
            .logits
            .expect("logits");
    }
    out
}

#[test]
fn greedy_tokens_match_the_sequence_loop_at_tp_1_2_3() {
    let rt = runtime();
    for dir in fixtures() {
        let (toks, prefill) = tokens(&dir);
        let prompt = &toks[..prefill];
        let want = reference(&dir, prompt, 8);
        for tp in 1..=3 {
            let got = rt.block_on(async {
                let e = engine(&dir, tp, 2, prompt.len() + 16, EngineConfig::new(FormChoice::Auto)).await;
                let out = collect(
                    e.submit(GenerateRequest::new(prompt.to_vec(), greedy(8)))
                        .expect("submit"),
                )
                .await;
                e.shutdown().await;
                out
            });
            assert_eq!(
                got,
                Outcome::Done(want.clone(), FinishReason::Length),
                "{} at tp {tp}",
                name(&dir)
            );
        }
    }
}

/// 32 requests of random prompts over the fixture's vocabulary.
fn requests(vocab: usize) -> Vec<GenerateRequest> {
    let mut rng = Rng(7);
    (0..32)
        .map(|i| {
            let len = 3 + rng.below(30);
            let prompt = (0..len).map(|_| rng.below(vocab) as u32).collect();
            GenerateRequest::new(prompt, greedy(6 + i % 7))
        })
        .collect()
}

#[test]
fn every_fault_kind_at_tp2_costs_no_request_and_changes_no_token() {
    let dir = fixtures()
        .into_iter()
        .find(|d| name(d) == "nemotron_h_dense")
        .expect("fixture");
    let rt = runtime();
    let vocab = rt.block_on(async {
        let e = engine(&dir, 1, 1, 16, EngineConfig::new(FormChoice::Auto)).await;
        let v = e.info().vocab;
        e.shutdown().await;
        v
    });
    let reqs = requests(vocab);
    let clean = rt.block_on(async {
        let e = engine(&dir, 2, 8, 64, EngineConfig::new(FormChoice::Auto)).await;
        let out = serve_all(&e, &reqs).await;
        assert_eq!(e.metrics().snapshot().faults, 0);
        e.shutdown().await;
        out
    });
    assert!(clean.iter().all(|o| matches!(o, Outcome::Done(..))), "{clean:?}");
    for kind in [FaultKind::Panic, FaultKind::Hang, FaultKind::Error, FaultKind::Nan] {
        rt.block_on(async {
            let mut config = EngineConfig::new(FormChoice::Auto);
            // Step 9 is mid-decode: with 8 slots the first requests are decoding, later ones still waiting.
            config.faults = vec![FaultSpec { rank: 1, kind, step: 9 }];
            config.step_deadline = Duration::from_secs(5);
            let e = engine(&dir, 2, 8, 64, config).await;
            let out = serve_all(&e, &reqs).await;
            assert_eq!(out, clean, "{kind}: outputs differ from the fault-free run");
            let m = e.metrics().snapshot();
            assert_eq!((m.faults, m.recoveries), (1, 1), "{kind}: {m:?}");
            let r = &m.recoveries_log[0];
            let class = match kind {
                FaultKind::Panic => "panic",
                FaultKind::Hang => "deadline",
                FaultKind::Error => "error",
                FaultKind::Nan => "non_finite",
                // Not in the list above: they end a worker process (bin/tests/cli/serve_cli.rs).
                FaultKind::Kill | FaultKind::Abort => unreachable!("{kind} needs worker processes"),
            };
            assert_eq!(r.fault, class, "{kind}: {r:?}");
            assert!(r.requeued > 0, "{kind}: the fault hit running sequences");
            eprintln!(
                "{kind}: restart {:.3} s, {} sequences re-prefilled",
                r.restart_seconds, r.requeued
            );
            let h = e.health().await.expect("health");
            assert!(h.ranks.iter().all(|r| r.slots_in_use == 0), "{kind}: {h:?}");
            assert_eq!(
                (h.waiting, h.running, h.free_slots, h.generation),
                (0, 0, 8, 2),
                "{kind}: {h:?}"
            );
            e.shutdown().await;
        });
    }
}

#[test]
fn repeated_faults_fail_the_affected_requests_with_a_clear_error() {
    let dir = fixtures()
        .into_iter()
        .find(|d| name(d) == "nemotron_h_dense")
        .expect("fixture");
    let rt = runtime();
    rt.block_on(async {
        let mut config = EngineConfig::new(FormChoice::Auto);
        config.max_retries = 1;
        // Step 3 feeds the request's second token; after it breaks, steps 4 and 5 replay the prompt and the first
        // token, and step 6 breaks the second token's step again: two faults of its new work in a row.
        config.faults = [3, 6]
            .map(|step| FaultSpec {
                rank: 0,
                kind: FaultKind::Error,
                step,
            })
            .to_vec();
        let e = engine(&dir, 1, 2, 64, config).await;
        let out = collect(
            e.submit(GenerateRequest::new(vec![1, 2, 3], greedy(10)))
                .expect("submit"),
        )
        .await;
        let Outcome::Failed(error) = out else { panic!("{out:?}") };
        assert!(
            error.contains("retry limit is 1") && error.contains("injected"),
            "{error}"
        );
        // The engine keeps serving.
        let ok = collect(
            e.submit(GenerateRequest::new(vec![1, 2, 3], greedy(4)))
                .expect("submit"),
        )
        .await;
        assert!(matches!(ok, Outcome::Done(_, FinishReason::Length)), "{ok:?}");
        e.shutdown().await;
    });
}

/// Four faults, each landing on the same 16 running requests: with the default three retries every request
/// completes with its fault-free tokens, because each got further between the faults. A re-admitted request first
/// replays its history (its prompt, then one step per token it had generated), so the faults are spaced to leave
/// each request a few steps of new work after its replay.
#[test]
fn faults_that_keep_landing_on_the_same_requests_cost_none_of_them() {
    let dir = fixtures()
        .into_iter()
        .find(|d| name(d) == "nemotron_h_dense")
        .expect("fixture");
    let rt = runtime();
    let mut rng = Rng(3);
    let reqs: Vec<_> = (0..48)
        .map(|_| {
            let prompt = (0..3 + rng.below(20)).map(|_| 1 + rng.below(60) as u32).collect();
            GenerateRequest::new(prompt, greedy(24))
        })
        .collect();
    let clean = rt.block_on(async {
        let e = engine(&dir, 1, 16, 64, EngineConfig::new(FormChoice::Auto)).await;
        let out = serve_all(&e, &reqs).await;
        e.shutdown().await;
        out
    });
    assert!(clean.iter().all(|o| matches!(o, Outcome::Done(..))), "{clean:?}");
    rt.block_on(async {
        let mut config = EngineConfig::new(FormChoice::Auto);
        assert_eq!(config.max_retries, 3);
        config.faults = [4, 14, 28, 46]
            .map(|step| FaultSpec {
                rank: 0,
                kind: FaultKind::Error,
                step,
            })
            .to_vec();
        let e = engine(&dir, 1, 16, 64, config).await;
        let out = serve_all(&e, &reqs).await;
        assert_eq!(out, clean, "a request failed or its tokens changed");
        let m = e.metrics().snapshot();
        assert_eq!((m.faults, m.recoveries, m.requests_failed), (4, 4, 0), "{m:?}");
        // The first 16 requests were running at every fault.
        assert!(
            m.recoveries_log.iter().all(|r| r.requeued == 16),
            "{:?}",
            m.recoveries_log
        );
        e.shutdown().await;
    });
}

#[test]
fn a_request_with_bad_parameters_fails_alone() {
    let dir = fixtures().into_iter().find(|d| name(d) == "qwen3_5").expect("fixture");
    let rt = runtime();
    rt.block_on(async {
        let e = engine(&dir, 2, 4, 64, EngineConfig::new(FormChoice::Auto)).await;
        let vocab = e.info().vocab as u32;
        let good: Vec<_> = (0..4)
            .map(|i| {
                e.submit(GenerateRequest::new(vec![1 + i, 2, 3], greedy(12)))
                    .expect("submit")
            })
            .collect();
        let bad = [
            (
                GenerateRequest::new(
                    vec![1, 2],
                    SamplingParams {
                        top_p: 2.0,
                        ..greedy(4)
                    },
                ),
                "top_p",
            ),
            (GenerateRequest::new(vec![1, vocab], greedy(4)), "out of range"),
            (GenerateRequest::new(Vec::new(), greedy(4)), "empty"),
            (GenerateRequest::new(vec![1], greedy(10_000)), "context"),
        ];
        for (req, want) in bad {
            let out = collect(e.submit(req).expect("submit")).await;
            let Outcome::Failed(error) = out else {
                panic!("{want}: {out:?}")
            };
            assert!(error.contains(want), "{want}: {error}");
        }
        for s in good {
            let out = collect(s).await;
            assert!(
                matches!(&out, Outcome::Done(t, FinishReason::Length) if t.len() == 12),
                "{out:?}"
            );
        }
        let m = e.metrics().snapshot();
        assert_eq!((m.requests_finished, m.requests_failed), (4, 4));
        e.shutdown().await;
    });
}

#[test]
fn a_dropped_stream_cancels_its_request_and_frees_its_slot() {
    let dir = fixtures().into_iter().find(|d| name(d) == "qwen3_5").expect("fixture");
    let rt = runtime();
    rt.block_on(async {
        let e = engine(&dir, 1, 2, 512, EngineConfig::new(FormChoice::Auto)).await;
        // As long as the fixture's 256 positions allow, so that it is still running when the drop reaches the
        // coordinator.
        let mut s = e
            .submit(GenerateRequest::new(vec![1, 2, 3], greedy(250)))
            .expect("submit");
        let first = s.next().await;
        assert!(matches!(first, Some(Event::Token { .. })), "{first:?}");
        drop(s);
        let ok = collect(e.submit(GenerateRequest::new(vec![4, 5], greedy(3))).expect("submit")).await;
        assert!(matches!(ok, Outcome::Done(..)), "{ok:?}");
        let mut h = e.health().await.expect("health");
        for _ in 0..100 {
            if h.running == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            h = e.health().await.expect("health");
        }
        assert_eq!((h.running, h.waiting, h.free_slots), (0, 0, 2), "{h:?}");
        assert!(h.ranks.iter().all(|r| r.slots_in_use == 0), "{h:?}");
        assert_eq!(e.metrics().snapshot().requests_cancelled, 1);
        e.shutdown().await;
    });
}

#[test]
fn five_hundred_concurrent_requests_on_the_tiny_preset_all_complete() {
    let dir = tempfile::tempdir().expect("tempdir");
    rewind_engine::init::init_model(&rewind_engine::init::InitOptions {
        family: rewind_engine::model::Family::NemotronH,
        preset: "tiny".into(),
        layers: None,
        seed: 5,
        out: dir.path().to_path_buf(),
        dtype: None,
        mtp: false,
    })
    .expect("init-model");
    let rt = runtime();
    rt.block_on(async {
        let mut config = EngineConfig::new(FormChoice::Auto);
        config.max_batch_tokens = 512;
        let e = engine(dir.path(), 1, 32, 64, config).await;
        let vocab = e.info().vocab;
        let mut rng = Rng(11);
        let reqs: Vec<_> = (0..500)
            .map(|_| {
                let prompt = (0..4 + rng.below(12)).map(|_| rng.below(vocab) as u32).collect();
                GenerateRequest::new(prompt, greedy(1 + rng.below(8)))
            })
            .collect();
        let t0 = std::time::Instant::now();
        let out = serve_all(&e, &reqs).await;
        let wall = t0.elapsed().as_secs_f64();
        for (o, r) in out.iter().zip(&reqs) {
            let want = r.params.max_tokens.expect("max_tokens");
            assert!(
                matches!(o, Outcome::Done(t, FinishReason::Length) if t.len() == want),
                "{o:?}"
            );
        }
        let m = e.metrics().snapshot();
        assert_eq!(m.requests_finished, 500);
        // The queue never holds more than the requests, the slots never more than 32: memory is the pools'.
        let h = e.health().await.expect("health");
        assert_eq!((h.waiting, h.running, h.free_slots), (0, 0, 32), "{h:?}");
        eprintln!(
            "500 requests: {:.2} s, {:.0} output tok/s, {} steps",
            wall,
            m.generated_tokens as f64 / wall,
            m.steps
        );
        e.shutdown().await;
    });
}

#[test]
fn a_full_waiting_queue_refuses_requests_as_back_pressure() {
    let rt = runtime();
    let dir = &fixtures()[0];
    let (toks, prefill) = tokens(dir);
    let prompt = &toks[..prefill];
    rt.block_on(async {
        let mut config = EngineConfig::new(FormChoice::Auto);
        config.max_waiting = 1;
        let e = engine(dir, 1, 1, 64, config).await;
        let mut running = e
            .submit(GenerateRequest::new(prompt.to_vec(), greedy(30)))
            .expect("submit");
        // Once it streams, the one slot is taken: the next request waits and the one after is refused.
        assert!(matches!(running.next().await, Some(Event::Token { .. })));
        let waiting = e
            .submit(GenerateRequest::new(prompt.to_vec(), greedy(2)))
            .expect("submit");
        let refused = collect(
            e.submit(GenerateRequest::new(prompt.to_vec(), greedy(2)))
                .expect("submit"),
        )
        .await;
        match refused {
            Outcome::Failed(error) => assert!(error.contains("the engine is full"), "{error}"),
            other => panic!("not refused: {other:?}"),
        }
        assert!(matches!(collect(waiting).await, Outcome::Done(..)));
        let mut last = None;
        while let Some(ev) = running.next().await {
            last = Some(ev);
        }
        assert!(matches!(last, Some(Event::Finished { .. })), "{last:?}");
        assert_eq!(e.metrics().snapshot().requests_refused, 1);
        e.shutdown().await;
    });
}
