//! Chains of verifies through the serving engine on CPU ranks (`--spec ngram|oracle:P --decode-steps N`,
//! `StepPlan::spec_chain`): greedy speculating requests whose drafters the ranks can run verify several windows per
//! engine step, judged, committed and drafted on the ranks, and give exactly the greedy output, on every fixture, in
//! the replay, kv-only and auto forms, at TP 1 and 2. The oracle's verifies did chain (`spec_chained_steps`), and every
//! slot is free afterwards.

use std::sync::Arc;

use rewind_actors::{EngineConfig, EngineHandle, EngineSpec, GenerateRequest};
use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::rank::{CpuLauncher, CpuOptions};
use rewind_engine::spec::DrafterKind;
use rewind_tests::{fixtures, name, runtime};

mod speculative_support;
use speculative_support::{factory, params, run_all, spec_config, CONTEXT, RING};

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
                        let mut decoder = DecoderConfig::new(4, CONTEXT);
                        decoder.buffer_len = RING;
                        decoder.max_verify = spec.max_verify();
                        let launcher = CpuLauncher::new(&dir, CpuOptions { tp, decoder }).expect("launcher");
                        let mut config = EngineConfig::new(form);
                        config.decode_steps = 4;
                        config.spec = Some(EngineSpec {
                            config: spec.clone(),
                            factory: factory(&dir, 4, &spec),
                        });
                        let e = EngineHandle::start(Arc::new(launcher), config)
                            .await
                            .unwrap_or_else(|e| panic!("{what}: {e}"));
                        let plain_reqs = prompts
                            .iter()
                            .map(|p| {
                                let mut r = GenerateRequest::new(p.clone(), params(24, 0.0, 1));
                                r.speculate = false;
                                r
                            })
                            .collect();
                        let plain = run_all(&e, plain_reqs).await;
                        let reqs = prompts
                            .iter()
                            .zip(&plain)
                            .map(|(p, (reference, _))| {
                                let mut r = GenerateRequest::new(p.clone(), params(24, 0.0, 1));
                                r.reference = Some(reference.clone());
                                r
                            })
                            .collect();
                        let before = e.metrics().snapshot().spec_chained_steps;
                        let out = run_all(&e, reqs).await;
                        let chained = e.metrics().snapshot().spec_chained_steps - before;
                        let h = e.health().await.expect("health");
                        assert!(h.ranks.iter().all(|r| r.slots_in_use == 0), "{what}: {h:?}");
                        e.shutdown().await;
                        (plain, out, chained)
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
