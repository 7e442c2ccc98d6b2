//! Structured outputs beside speculation and chained decodes. A constrained request never joins a chain of decodes
//! (each of its tokens needs a mask computed from the one before, on the host). A greedy one speculates exactly: its
//! drafts are cut at the first token its grammar's mask refuses, and a verify's token after the accepted drafts is
//! taken only when its mask allows it (`actors/src/coordinator/grammar.rs`), so its output is token for token the
//! same request's without speculation, over regexes, a JSON schema and a choice, with the n-gram drafter and the
//! oracle (exact and corrupted drafts), while the counters show drafts cut and picks refused, and the oracle's drafts
//! accepted (the random model's own picks rarely repeat what the n-gram drafter proposes). A sampled
//! constrained request does not speculate; an unconstrained request on the same engine still does.

use std::sync::Arc;

use rewind_actors::{EngineConfig, EngineHandle, EngineSpec, GenerateRequest};
use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::grammar::{Constraint, ConstraintSpec, GrammarCompiler};
use rewind_engine::model::Family;
use rewind_engine::rank::{CpuLauncher, CpuOptions};
use rewind_engine::sample::SamplingParams;
use rewind_engine::spec::{DrafterKind, SpecConfig};
use rewind_engine::tokenizer::Tokenizer;
use rewind_tests::runtime;
use serde_json::json;

use crate::speculative_support;
use speculative_support::{factory, run, spec_config, tiny, CONTEXT, RING};

/// An engine on the tiny model in `dir` decoding in `form`, speculating with `spec`, chaining up to 4 decodes, ending
/// at `eos`.
async fn engine(dir: &std::path::Path, form: FormChoice, spec: &SpecConfig, eos: u32) -> EngineHandle {
    let mut decoder = DecoderConfig::new(2, CONTEXT);
    decoder.buffer_len = RING;
    decoder.max_verify = spec.max_verify();
    let launcher = CpuLauncher::new(dir, CpuOptions { tp: 1, decoder }).expect("launcher");
    let mut config = EngineConfig::new(form);
    config.decode_steps = 4;
    config.eos_token_ids = vec![eos];
    config.spec = Some(EngineSpec {
        config: spec.clone(),
        factory: factory(dir, 2, spec),
    });
    EngineHandle::start(Arc::new(launcher), config).await.expect("engine")
}

#[test]
fn greedy_constrained_requests_speculate_exactly() {
    let dir = tiny(Family::NemotronH, "tiny", 0, false);
    let tokenizer = Tokenizer::from_dir(dir.path()).expect("tokenizer");
    let eos = tokenizer.eos_token_id().expect("eos");
    let vocab = rewind_engine::model::ModelConfig::from_dir(dir.path())
        .expect("config")
        .vocab_size;
    let compiler = GrammarCompiler::new(&tokenizer, vocab, &[eos]).expect("compiler");
    let constraints: Vec<Constraint> = [
        ConstraintSpec::Regex("(ab )+(cd )*".into()),
        // Permissive ones, which the model's own picks often satisfy (so drafts are accepted), and which still
        // refuse some of them.
        ConstraintSpec::Regex("[^0-9\\n]{12,40}".into()),
        ConstraintSpec::Regex("[a-z ,.]{8,30}".into()),
        ConstraintSpec::JsonSchema(json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "kind": {"enum": ["cat", "dog", "bird"]},
                "age": {"type": "integer", "minimum": 0, "maximum": 99},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}
            },
            "required": ["name", "kind", "age"]
        })),
        ConstraintSpec::Choice(vec!["alpha beta".into(), "alpha gamma delta".into(), "omega".into()]),
    ]
    .into_iter()
    .map(|c| compiler.compile(c).expect("compiles"))
    .collect();
    let prompts: Vec<Vec<u32>> = ["ab ab ab ab ab ab", "the cat, the dog, the bird"]
        .iter()
        .map(|p| tokenizer.encode(p, false).expect("prompt"))
        .collect();
    // Every form: a verify that yields no token commits as few as none of its tokens, by pointer moves or (the
    // recurrent form) a snapshot copy.
    let runs = [
        ("ngram", FormChoice::Replay),
        ("oracle:0", FormChoice::Replay),
        ("oracle:0.3", FormChoice::Replay),
        ("oracle:0.3", FormChoice::Recurrent),
        ("oracle:0.3", FormChoice::KvOnly),
    ];
    let rt = runtime();
    for (drafter, form) in runs {
        let spec = spec_config(drafter.parse::<DrafterKind>().expect("drafter"), 4);
        rt.block_on(async {
            let engine = engine(dir.path(), form, &spec, eos).await;
            let before = engine.metrics().snapshot();
            let (mut drafted, mut accepted) = (0, 0);
            for constraint in &constraints {
                for prompt in &prompts {
                    let params = SamplingParams {
                        temperature: 0.0,
                        max_tokens: Some(40),
                        constraint: Some(constraint.clone()),
                        ..SamplingParams::default()
                    };
                    let mut alone = GenerateRequest::new(prompt.clone(), params.clone());
                    alone.speculate = false;
                    let (want, none) = run(engine.submit(alone).expect("submit")).await;
                    assert!(none.is_none());
                    let mut request = GenerateRequest::new(prompt.clone(), params);
                    request.reference = Some(want.clone());
                    let (got, stats) = run(engine.submit(request).expect("submit")).await;
                    let what = format!("{drafter}, {form}, {:?}", constraint.spec());
                    assert_eq!(got, want, "{what}: speculation changed the constrained output");
                    let stats = stats.unwrap_or_else(|| panic!("{what}: a greedy constrained request speculates"));
                    drafted += stats.drafted;
                    accepted += stats.accepted;
                }
            }
            let after = engine.metrics().snapshot();
            assert_eq!(
                after.chained_steps, before.chained_steps,
                "no constrained decode chained"
            );
            assert_eq!(after.spec_chained_steps, before.spec_chained_steps);
            assert!(drafted > 0, "{drafter}: nothing was drafted");
            let (cut, unresolved) = (
                after.spec_grammar_cut - before.spec_grammar_cut,
                after.spec_grammar_unresolved - before.spec_grammar_unresolved,
            );
            println!(
                "{drafter} ({form}): {accepted} of {drafted} drafts accepted, {cut} cut, {unresolved} verifies \
                 unresolved"
            );
            if drafter.starts_with("oracle") {
                assert!(accepted > 0, "{drafter}: no draft was accepted ({drafted} drafted)");
                // The oracle drafts the constrained output itself, which the model's own picks often are not.
                assert!(unresolved > 0, "{drafter}: no verify's pick was refused by its grammar");
            }
            if drafter == "oracle:0.3" {
                assert!(cut > 0, "{drafter}: no corrupted draft was cut");
            }
            engine.shutdown().await;
        });
    }
}

#[test]
fn sampled_constrained_requests_do_not_speculate_and_none_chains() {
    let dir = tiny(Family::NemotronH, "tiny", 0, false);
    let tokenizer = Tokenizer::from_dir(dir.path()).expect("tokenizer");
    let eos = tokenizer.eos_token_id().expect("eos");
    let vocab = rewind_engine::model::ModelConfig::from_dir(dir.path())
        .expect("config")
        .vocab_size;
    let compiler = GrammarCompiler::new(&tokenizer, vocab, &[eos]).expect("compiler");
    let constraint = compiler
        .compile(ConstraintSpec::Regex("(ab )+(cd )*".into()))
        .expect("regex");
    let spec = spec_config("ngram".parse::<DrafterKind>().expect("ngram"), 4);
    let rt = runtime();
    rt.block_on(async {
        let engine = engine(dir.path(), FormChoice::Replay, &spec, eos).await;
        let prompt = tokenizer.encode("ab ab ab ab ab ab", false).expect("prompt");
        for temperature in [0.0f32, 1.0] {
            let params = SamplingParams {
                temperature,
                seed: Some(3),
                max_tokens: Some(30),
                constraint: Some(constraint.clone()),
                ..SamplingParams::default()
            };
            let before = engine.metrics().snapshot();
            let (tokens, spec_stats) = run(engine
                .submit(GenerateRequest::new(prompt.clone(), params))
                .expect("submit"))
            .await;
            let after = engine.metrics().snapshot();
            assert_eq!(
                spec_stats.is_some(),
                temperature == 0.0,
                "only a greedy constrained request speculates"
            );
            assert_eq!(after.chained_steps, before.chained_steps, "no decode of it chained");
            // A sampled one's masks are computed ahead, while the rest of each step's delivery and the next step's
            // planning run (its first on the prompt's step; a greedy one's come from its drafts' check).
            let (masks, ahead) = (
                after.grammar_masks - before.grammar_masks,
                after.grammar_masks_ahead - before.grammar_masks_ahead,
            );
            println!("temperature {temperature}: {ahead} of {masks} masks computed ahead");
            assert!(masks > 0);
            if temperature > 0.0 {
                assert!(ahead > 0 && ahead < masks, "{ahead} of {masks} masks computed ahead");
            }
            assert_eq!(after.spec_chained_steps, before.spec_chained_steps);
            let body: Vec<u32> = tokens.iter().copied().filter(|&t| t != eos).collect();
            let text = tokenizer.decode(&body, true).expect("decode");
            assert!(!text.is_empty());
            // The text so far is a prefix of a match of `(ab )+(cd )*`.
            let rest = text.trim_start_matches("ab ");
            assert!(rest.len() < text.len(), "{text:?} starts with `ab `");
            let rest = rest.trim_start_matches("cd ");
            assert!("cd ".starts_with(rest) || "ab ".starts_with(rest), "{text:?}");
        }
        // The same engine still speculates for an unconstrained request.
        let plain = SamplingParams {
            temperature: 0.0,
            max_tokens: Some(20),
            ignore_eos: true,
            ..SamplingParams::default()
        };
        let (_, spec_stats) = run(engine.submit(GenerateRequest::new(prompt, plain)).expect("submit")).await;
        assert!(spec_stats.is_some(), "the plain request speculates");
    });
}
