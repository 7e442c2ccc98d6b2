//! The self-test's row for speculation under structured outputs on the GPU: a greedy constrained request speculates
//! (its drafts cut at the first token its grammar's mask refuses, the token after the accepted drafts taken only when
//! its mask allows it, else the verify commits fewer tokens, as few as none, and the next step decodes that position
//! with the mask: `actors/src/coordinator/grammar.rs`), and must give exactly the tokens of the same request without
//! speculation. The oracle drafter proposes that output itself, a quarter of it corrupted, so drafts are accepted,
//! cut and refused on a random-weight model.

use std::path::Path;
use std::sync::Arc;

use rewind_actors::{EngineConfig, EngineHandle, EngineSpec, Event, GenerateRequest};
use rewind_engine::decode::FormChoice;
use rewind_engine::gpu::{GpuLauncher, GpuOptions};
use rewind_engine::grammar::{Constraint, ConstraintSpec, GrammarCompiler};
use rewind_engine::sample::SamplingParams;
use rewind_engine::spec::factory::{build, Target};
use rewind_engine::spec::{DrafterKind, SpecConfig, SpecPolicy};
use rewind_engine::tokenizer::Tokenizer;
use serde_json::{json, Value};

/// Drafts per verify, tokens per request, and the oracle's corruption probability.
const WINDOW: usize = 4;
const TOKENS: usize = 24;
const CORRUPT: f64 = 0.25;

/// A request's tokens, and whether it speculated.
async fn run(e: &EngineHandle, request: GenerateRequest) -> Result<(Vec<u32>, bool), String> {
    let mut s = e.submit(request).map_err(|e| e.to_string())?;
    let mut tokens = Vec::new();
    while let Some(ev) = s.next().await {
        match ev {
            Event::Token { token, .. } => tokens.push(token),
            Event::Finished { spec, .. } => return Ok((tokens, spec.is_some())),
            Event::PromptLogprobs { .. } => {}
            Event::Failed { error, .. } => return Err(error),
        }
    }
    Err("the stream ended without a final event".into())
}

/// The check of one prompt under one constraint; `Err` names the difference.
async fn check(e: &EngineHandle, prompt: &[u32], constraint: &Constraint) -> Result<(), String> {
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(TOKENS),
        constraint: Some(constraint.clone()),
        ..SamplingParams::default()
    };
    let mut alone = GenerateRequest::new(prompt.to_vec(), params.clone());
    alone.speculate = false;
    let (want, _) = run(e, alone).await?;
    let mut request = GenerateRequest::new(prompt.to_vec(), params);
    request.reference = Some(want.clone());
    let (got, speculated) = run(e, request).await?;
    if !speculated {
        return Err(format!(
            "{:?}: the greedy constrained request did not speculate",
            constraint.spec()
        ));
    }
    if got != want {
        return Err(format!(
            "{:?}: speculation gave {got:?}, without it {want:?}",
            constraint.spec()
        ));
    }
    Ok(())
}

/// One row: a serving engine on `opts`'s GPUs speculating with the oracle runs the check on every prompt under a
/// regex, a permissive regex the model's own picks often satisfy, and a JSON schema.
pub(super) fn rows(case: &str, dir: &Path, prompts: &[Vec<u32>], opts: &GpuOptions, tp: usize) -> (Value, bool) {
    // A grammar is compiled against the model's tokenizer: the weight-only fixtures have none, so the row does not
    // apply to them (reported, not run and not failed).
    if !dir.join("tokenizer.json").is_file() {
        let reason = "the model has no tokenizer.json to compile grammars against";
        println!("{case:<20} tp {tp}  constrained speculation (oracle)  not applicable: {reason}");
        return (
            json!({ "case": case, "tp": tp, "check": "constrained_speculation", "status": "not applicable",
                    "reason": reason }),
            true,
        );
    }
    let result = (|| -> Result<(), String> {
        let tokenizer = Tokenizer::from_dir(dir).map_err(|e| e.to_string())?;
        let eos = tokenizer
            .eos_token_id()
            .ok_or("the model's tokenizer names no end-of-sequence token")?;
        let vocab = rewind_engine::model::ModelConfig::from_dir(dir)
            .map_err(|e| e.to_string())?
            .vocab_size;
        let compiler = GrammarCompiler::new(&tokenizer, vocab, &[eos]).map_err(|e| e.to_string())?;
        let constraints = [
            ConstraintSpec::Regex("(ab )+(cd )*".into()),
            ConstraintSpec::Regex("[^0-9\\n]{12,40}".into()),
            ConstraintSpec::JsonSchema(json!({
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
                "required": ["name", "age"]
            })),
        ]
        .into_iter()
        .map(|c| compiler.compile(c).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
        let spec = SpecConfig {
            drafter: DrafterKind::Oracle { p: CORRUPT },
            window: WINDOW,
            policy: SpecPolicy::Fixed,
            profile: None,
        };
        let opts = GpuOptions {
            buffer_len: opts.buffer_len.max(2 * spec.max_verify()),
            max_verify: spec.max_verify(),
            ..opts.clone()
        };
        let factory = build(
            &spec.drafter,
            &Target {
                dir,
                vocab,
                slots: opts.max_seqs,
                max_context: opts.max_model_len.unwrap_or(4096),
                window: WINDOW,
                mtp_on_ranks: false,
            },
        )
        .map_err(|e| e.to_string())?;
        let rt = super::backend::runtime().map_err(|e| e.to_string())?;
        let launcher = Arc::new(GpuLauncher::new(dir, &opts).map_err(|e| e.to_string())?);
        rt.block_on(async {
            let mut config = EngineConfig::new(FormChoice::Auto);
            config.eos_token_ids = vec![eos];
            config.spec = Some(EngineSpec { config: spec, factory });
            let e = EngineHandle::start(launcher, config).await.map_err(|e| e.to_string())?;
            let mut r = Ok(());
            'all: for (p, prompt) in prompts.iter().enumerate() {
                for constraint in &constraints {
                    if let Err(why) = check(&e, prompt, constraint).await {
                        r = Err(format!("prompt {p}: {why}"));
                        break 'all;
                    }
                }
            }
            e.shutdown().await;
            r
        })
    })();
    let ok = result.is_ok();
    match &result {
        Ok(()) => println!("{case:<20} tp {tp}  constrained speculation (oracle)  pass"),
        Err(e) => println!("{case:<20} tp {tp}  constrained speculation (oracle)  FAIL: {e}"),
    }
    (
        json!({
            "case": case,
            "tp": tp,
            "check": "constrained_speculation",
            "status": if ok { "pass" } else { "fail" },
            "error": result.err(),
        }),
        ok,
    )
}
