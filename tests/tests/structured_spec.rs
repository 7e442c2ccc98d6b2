//! Structured outputs beside speculation and chained decodes: the rule is that a constrained request neither
//! speculates (its drafts would not be checked against its grammar) nor joins a chain of decodes (each of its tokens
//! needs a mask computed from the one before, on the host). On an engine that speculates with the n-gram drafter
//! and chains up to 4 decodes, a constrained request reports no speculation, no step of its run chains, and its
//! output follows the grammar; an unconstrained request on the same engine still speculates.

use std::sync::Arc;

use rewind_actors::{EngineConfig, EngineHandle, EngineSpec, GenerateRequest};
use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::grammar::{ConstraintSpec, GrammarCompiler};
use rewind_engine::model::Family;
use rewind_engine::rank::{CpuLauncher, CpuOptions};
use rewind_engine::sample::SamplingParams;
use rewind_engine::spec::DrafterKind;
use rewind_engine::tokenizer::Tokenizer;
use rewind_tests::runtime;

mod speculative_support;
use speculative_support::{factory, run, spec_config, tiny, CONTEXT, RING};

#[test]
fn constrained_requests_neither_speculate_nor_chain() {
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
        let mut decoder = DecoderConfig::new(2, CONTEXT);
        decoder.buffer_len = RING;
        decoder.max_verify = spec.max_verify();
        let launcher = CpuLauncher::new(dir.path(), CpuOptions { tp: 1, decoder }).expect("launcher");
        let mut config = EngineConfig::new(FormChoice::Replay);
        config.decode_steps = 4;
        config.eos_token_ids = vec![eos];
        config.spec = Some(EngineSpec {
            config: spec.clone(),
            factory: factory(dir.path(), 2, &spec),
        });
        let engine = EngineHandle::start(Arc::new(launcher), config).await.expect("engine");
        let prompt = tokenizer.encode("ab ab ab ab ab ab", false).expect("prompt");
        for temperature in [0.0, 1.0] {
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
            assert!(spec_stats.is_none(), "a constrained request does not speculate");
            assert_eq!(after.chained_steps, before.chained_steps, "no decode of it chained");
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
