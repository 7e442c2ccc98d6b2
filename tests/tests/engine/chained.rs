//! Chained decode steps (`--decode-steps`, `Program::DecodeChain`) through the actor runtime on CPU ranks: on every
//! fixture and decode form, 24 concurrent requests — greedy and seeded sampling, with stop tokens that end some of
//! them inside a chain — give exactly the outputs of one decode step per engine step, and steps did chain; at TP 2
//! the same mix chains with the same outputs (the ranks merge their vocabulary slices' picks for greedy rows and
//! gather a sampled row's slices to draw from it whole). Out-of-range settings are refused at start-up with a clear
//! error.

use std::path::Path;
use std::sync::Arc;

use rewind_actors::{EngineConfig, EngineHandle, GenerateRequest};
use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::rank::{CpuLauncher, CpuOptions};
use rewind_engine::sample::SamplingParams;
use rewind_engine::sched::FinishReason;
use rewind_tests::{fixtures, name, runtime, Rng};

use crate::outcomes;
use outcomes::{serve_all, Outcome};

fn launcher(dir: &Path, tp: usize) -> Arc<CpuLauncher> {
    let opts = CpuOptions {
        tp,
        decoder: DecoderConfig::new(6, 96),
    };
    Arc::new(CpuLauncher::new(dir, opts).expect("launcher"))
}

fn config(form: FormChoice, decode_steps: usize) -> EngineConfig {
    let mut c = EngineConfig::new(form);
    c.decode_steps = decode_steps;
    c
}

/// 24 requests over the fixture's vocabulary: every third greedy, the others sampled with their own seed; request
/// `i` stops at the ids `stops[i]` (empty: none).
fn requests(vocab: usize, stops: &[Vec<u32>]) -> Vec<GenerateRequest> {
    let mut rng = Rng(11);
    (0..24)
        .map(|i| {
            let len = 2 + rng.below(20);
            let prompt = (0..len).map(|_| rng.below(vocab) as u32).collect();
            let mut p = if i % 3 == 0 {
                SamplingParams::greedy()
            } else {
                SamplingParams {
                    temperature: 0.9,
                    top_p: 0.95,
                    seed: Some(1000 + i as u64),
                    ..SamplingParams::greedy()
                }
            };
            p.max_tokens = Some(5 + i % 19);
            p.ignore_eos = true;
            p.stop_token_ids = stops.get(i).cloned().unwrap_or_default();
            GenerateRequest::new(prompt, p)
        })
        .collect()
}

/// Stop ids that end every third request inside its output (at the token a run without stops gave at index
/// 1 to 4): with chains of 4 steps, some stops fall inside a chain.
fn stops_within(outs: &[Outcome]) -> Vec<Vec<u32>> {
    outs.iter()
        .enumerate()
        .map(|(i, o)| match o {
            Outcome::Done(t, _) if i % 3 == 1 && t.len() > 1 => vec![t[(1 + i % 4).min(t.len() - 1)]],
            _ => Vec::new(),
        })
        .collect()
}

#[test]
fn chained_steps_give_the_outputs_of_single_steps() {
    let rt = runtime();
    let all = [
        FormChoice::Recurrent,
        FormChoice::Replay,
        FormChoice::KvOnly,
        FormChoice::Auto,
    ];
    for dir in fixtures() {
        for (tp, forms) in [(1, &all[..]), (2, &all[3..])] {
            for &form in forms {
                let run = |steps: usize, stops: &[Vec<u32>]| {
                    rt.block_on(async {
                        let e = EngineHandle::start(launcher(&dir, tp), config(form, steps))
                            .await
                            .unwrap_or_else(|e| panic!("{}: {e}", name(&dir)));
                        let out = serve_all(&e, &requests(e.info().vocab, stops)).await;
                        let m = e.metrics().snapshot();
                        let h = e.health().await.expect("health");
                        assert!(h.ranks.iter().all(|r| r.slots_in_use == 0), "{h:?}");
                        e.shutdown().await;
                        (out, m.chained_steps)
                    })
                };
                let what = format!("{} tp {tp} {form}", name(&dir));
                let stops = stops_within(&run(1, &[]).0);
                let (single, none) = run(1, &stops);
                assert_eq!(none, 0, "one step per engine step chains nothing");
                assert!(single.iter().all(|o| matches!(o, Outcome::Done(..))), "{single:?}");
                assert!(
                    single
                        .iter()
                        .any(|o| matches!(o, Outcome::Done(_, FinishReason::StopToken))),
                    "{what}: some request must stop on a stop id"
                );
                let (chained, count) = run(4, &stops);
                assert_eq!(chained, single, "{what}: chained outputs differ");
                assert!(count > 0, "{what}: no step chained");
            }
        }
    }
}

#[test]
fn bad_decode_steps_are_refused_at_start() {
    let dir = fixtures().into_iter().next().expect("a fixture");
    let rt = runtime();
    rt.block_on(async {
        for (tp, steps, want) in [
            (1, 0, "--decode-steps must be at least 1"),
            (1, 17, "the ranks chain at most 16 decode steps"),
            (2, 17, "the ranks chain at most 16 decode steps"),
        ] {
            let err = match EngineHandle::start(launcher(&dir, tp), config(FormChoice::Auto, steps)).await {
                Ok(e) => {
                    e.shutdown().await;
                    panic!("tp {tp}, --decode-steps {steps} started");
                }
                Err(e) => e.to_string(),
            };
            assert!(err.contains(want), "tp {tp}, {steps}: {err}");
        }
    });
}
