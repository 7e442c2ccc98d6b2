//! Chains of verifies through the serving engine on CPU ranks (`--spec ngram|oracle:P --decode-steps N`,
//! `Program::VerifyChain`): speculating requests whose drafters the ranks can run verify several windows per
//! engine step, judged, committed and drafted on the ranks, and give exactly the greedy output, on every fixture, in
//! the replay, kv-only and auto forms, at TP 1 and 2. The oracle's verifies did chain (`spec_chained_steps`), and every
//! slot is free afterwards. Sampled requests (plain temperature, judged from the rows' one-pass summaries) chain
//! too and draw what single verifies draw.

use std::path::Path;
use std::sync::Arc;

use rewind_actors::{EngineConfig, EngineHandle, EngineSpec, GenerateRequest};
use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::rank::{CpuLauncher, CpuOptions};
use rewind_engine::sample::SamplingParams;
use rewind_engine::spec::{DrafterKind, SpecConfig, SpecStats};
use rewind_tests::{fixtures, name, runtime};

use crate::speculative_support;
use speculative_support::{factory, params, run_all, spec_config, CONTEXT, RING};

/// An engine of 4 slots on `tp` CPU ranks of the checkpoint in `dir`, speculating by `spec` and chaining up to
/// `decode_steps` steps.
async fn engine(dir: &Path, tp: usize, form: FormChoice, spec: &SpecConfig, decode_steps: usize) -> EngineHandle {
    let mut decoder = DecoderConfig::new(4, CONTEXT);
    decoder.buffer_len = RING;
    decoder.max_verify = spec.max_verify();
    let launcher = CpuLauncher::new(dir, CpuOptions { tp, decoder }).expect("launcher");
    let mut config = EngineConfig::new(form);
    config.decode_steps = decode_steps;
    config.spec = Some(EngineSpec {
        config: spec.clone(),
        factory: factory(dir, 4, spec),
    });
    EngineHandle::start(Arc::new(launcher), config)
        .await
        .unwrap_or_else(|e| panic!("{} at tp {tp}: {e}", name(dir)))
}

type Outputs = Vec<(Vec<u32>, Option<SpecStats>)>;

/// Each prompt's plain greedy output of `reference` tokens (the oracle's reference), then its speculating request
/// with `spec(i)`; returns both and the verify steps that chained meanwhile.
async fn greedy_then_speculative(
    e: &EngineHandle,
    prompts: &[Vec<u32>],
    reference: usize,
    spec: impl Fn(usize) -> SamplingParams,
) -> (Outputs, Outputs, u64) {
    let plain_reqs = prompts
        .iter()
        .map(|p| {
            let mut r = GenerateRequest::new(p.clone(), params(reference, 0.0, 1));
            r.speculate = false;
            r
        })
        .collect();
    let plain = run_all(e, plain_reqs).await;
    let reqs = prompts
        .iter()
        .zip(&plain)
        .enumerate()
        .map(|(i, (p, (reference, _)))| {
            let mut r = GenerateRequest::new(p.clone(), spec(i));
            r.reference = Some(reference.clone());
            r
        })
        .collect();
    let before = e.metrics().snapshot().spec_chained_steps;
    let out = run_all(e, reqs).await;
    let chained = e.metrics().snapshot().spec_chained_steps - before;
    (plain, out, chained)
}

#[test]
fn chained_verifies_give_the_greedy_output() {
    let rt = runtime();
    let mut total = 0;
    for dir in fixtures() {
        let (toks, _) = rewind_tests::tokens(&dir);
        let base = &toks[..8.min(toks.len())];
        let prompts = [
            [base, base].concat(),
            base[..5].to_vec(),
            [&base[..3], &base[..3]].concat(),
        ];
        for tp in [1, 2] {
            for form in [FormChoice::Replay, FormChoice::KvOnly, FormChoice::Auto] {
                for (drafter, window) in [
                    (DrafterKind::Ngram { min_n: 1, max_n: 3 }, 3),
                    (DrafterKind::Oracle { p: 0.25 }, 4),
                ] {
                    let spec = spec_config(drafter.clone(), window);
                    let what = format!("{} tp {tp} {form} {drafter} T={window}", name(&dir));
                    let (plain, spec_out, chained) = rt.block_on(async {
                        let e = engine(&dir, tp, form, &spec, 4).await;
                        let run = greedy_then_speculative(&e, &prompts, 24, |_| params(24, 0.0, 1)).await;
                        let h = e.health().await.expect("health");
                        assert!(h.ranks.iter().all(|r| r.slots_in_use == 0), "{what}: {h:?}");
                        e.shutdown().await;
                        run
                    });
                    for (i, ((want, _), (got, stats))) in plain.iter().zip(&spec_out).enumerate() {
                        assert_eq!(got, want, "{what}: prompt {i}");
                        let stats = stats.expect("speculation counters");
                        assert!(stats.accepted <= stats.drafted, "{what}: {stats:?}");
                    }
                    // The oracle proposes at every step, so its verifies chain; the n-gram drafter proposes only
                    // where the stream repeats (on random weights, not always).
                    if matches!(drafter, DrafterKind::Oracle { .. }) {
                        assert!(chained > 0, "{what}: no verify step chained");
                    }
                    total += chained;
                }
            }
        }
    }
    assert!(total > 0);
}

/// Sampled speculating requests whose verifies chain (the ranks key each later step's noise themselves) draw the
/// tokens single verifies draw. Single verify steps shorten their last windows to the tokens left, which changes
/// what the last step draws, so the outputs are compared up to the last window.
#[test]
fn chained_sampled_verifies_draw_what_single_verifies_draw() {
    const MAX: usize = 24;
    const WINDOW: usize = 4;
    // Low, so that the fixtures' random weights accept drafts now and then, yet sampled.
    const TEMPERATURE: f32 = 0.1;
    let rt = runtime();
    // Over all fixtures: some output is not the greedy one, some drafts are accepted and some not.
    let (mut sampled, mut accepted, mut drafted) = (false, 0, 0);
    for dir in fixtures() {
        let (toks, _) = rewind_tests::tokens(&dir);
        let base = &toks[..8.min(toks.len())];
        let prompts = [[base, base].concat(), base[..5].to_vec()];
        let spec = spec_config(DrafterKind::Oracle { p: 0.25 }, WINDOW);
        for tp in [1, 2] {
            let what = format!("{} tp {tp}", name(&dir));
            let run = |decode_steps: usize| {
                rt.block_on(async {
                    let e = engine(&dir, tp, FormChoice::Auto, &spec, decode_steps).await;
                    let sampled = |i: usize| params(MAX, TEMPERATURE, 7 + i as u64);
                    let run = greedy_then_speculative(&e, &prompts, MAX + WINDOW, sampled).await;
                    e.shutdown().await;
                    run
                })
            };
            let (greedy, single, none) = run(1);
            let (_, chain, chained) = run(4);
            assert_eq!(none, 0, "{what}: one decode step per engine step chains nothing");
            assert!(chained > 0, "{what}: no verify step chained");
            for (i, (((a, _), (b, stats)), (g, _))) in single.iter().zip(&chain).zip(&greedy).enumerate() {
                assert_eq!((a.len(), b.len()), (MAX, MAX), "{what}: prompt {i}");
                let upto = MAX - WINDOW - 1;
                assert_eq!(a[..upto], b[..upto], "{what}: prompt {i}");
                sampled |= a[..] != g[..MAX];
                let stats = stats.expect("speculation counters");
                (accepted, drafted) = (accepted + stats.accepted, drafted + stats.drafted);
            }
        }
    }
    assert!(sampled, "the sampled outputs are the greedy ones");
    assert!(
        accepted > 0 && accepted < drafted,
        "{accepted} of {drafted} drafts accepted"
    );
}
