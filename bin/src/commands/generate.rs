//! `rewind generate`: stream text from a prompt.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::output::{errln, write_stdout};
use anyhow::{Context, Result};
use rewind_actors::{EngineHandle, Event, GenerateRequest};
use rewind_engine::generate::{GenerationOutput, GenerationStats, SpecReport};
use rewind_engine::generation_config::GenerationDefaults;
use rewind_engine::init::has_random_init_marker;
use rewind_engine::sample::SamplingParams;
use rewind_engine::spec::{DrafterKind, SpecConfig};
use rewind_engine::tokenizer::chat::ChatMessage;

use super::backend::{self, Needs};
use crate::cli::{GenerateArgs, ModelArgs, SamplingArgs};
use crate::default_model::default_model_dir;
use crate::serve::ServedModel;

const DEFAULT_PROMPT: &str = "The quick brown fox";

/// Printed (to stderr) whenever a command loads a checkpoint that `rewind init-model` made.
pub(crate) const RANDOM_WEIGHTS_NOTE: &str =
    "note: this model has RANDOM weights (made by `rewind init-model`): its output is noise";

/// The model directory a command runs: `--model`, else the embedded trained model `--default-model` names (written
/// to the cache on first use). A checkpoint of random weights (one carrying init-model's marker) earns
/// [`RANDOM_WEIGHTS_NOTE`] on stderr.
pub(crate) fn model_dir(args: &ModelArgs) -> Result<PathBuf> {
    let dir = match &args.path {
        Some(dir) => dir.clone(),
        None => default_model_dir(args.default_model)?,
    };
    if has_random_init_marker(&dir) {
        errln!("{RANDOM_WEIGHTS_NOTE}");
    }
    Ok(dir)
}

/// `text` without one trailing line ending (what `echo` and editors append).
fn strip_one_newline(mut text: String) -> String {
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    text
}

/// The prompt's text: `--prompt-file`, stdin for a `-` prompt (or `--prompt-file -`), the prompt given, or the
/// default.
fn prompt_text(args: &GenerateArgs) -> Result<String> {
    let stdin = args.prompt.as_deref() == Some("-") || args.prompt_file.as_deref() == Some(Path::new("-"));
    let (text, from) = if stdin {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .context("reading the prompt from stdin")?;
        (text, "stdin".to_string())
    } else if let Some(path) = &args.prompt_file {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading the prompt file {}", path.display()))?;
        (text, format!("the prompt file {}", path.display()))
    } else {
        return Ok(args.prompt.clone().unwrap_or_else(|| DEFAULT_PROMPT.to_string()));
    };
    let text = strip_one_newline(text);
    anyhow::ensure!(!text.is_empty(), "the prompt read from {from} is empty");
    Ok(text)
}

/// Sampling parameters: the model's generation_config.json, overridden by flags.
pub fn sampling_params(defaults: &GenerationDefaults, args: &SamplingArgs) -> SamplingParams {
    let mut p = defaults.sampling_params();
    if let Some(t) = args.temperature {
        p.temperature = t;
    }
    if let Some(v) = args.top_p {
        p.top_p = v;
    }
    if let Some(v) = args.top_k {
        p.top_k = v;
    }
    if let Some(v) = args.min_p {
        p.min_p = v;
    }
    if let Some(v) = args.repetition_penalty {
        p.repetition_penalty = v;
    }
    p.seed = args.seed;
    p.max_tokens = Some(args.max_tokens);
    p.stop_strings = args.stop.clone();
    p.stop_token_ids = args.stop_token_ids.clone();
    p.ignore_eos = args.ignore_eos;
    if let Some(v) = args.presence_penalty {
        p.presence_penalty = v;
    }
    if let Some(v) = args.frequency_penalty {
        p.frequency_penalty = v;
    }
    if !args.logit_bias.is_empty() {
        p.logit_bias = args.logit_bias.iter().copied().collect();
    }
    if let Some(v) = args.min_tokens {
        p.min_tokens = v;
    }
    p.include_stop_str_in_output = args.include_stop_str_in_output;
    p
}

pub fn run(args: GenerateArgs) -> Result<()> {
    // The flags are checked, and the prompt read, before any model is built or loaded.
    if args.system.is_some() && !args.chat {
        anyhow::bail!("--system needs --chat (the system message is rendered with the model's chat template)");
    }
    args.run.device.check()?;
    let spec = super::spec::config(&args.run.spec, &args.run.decode)?;
    let prompt_text = prompt_text(&args)?;
    let dir = model_dir(&args.model)?;
    let ServedModel {
        config,
        defaults,
        tokenizer,
        eos_token_ids,
        ..
    } = ServedModel::load(&dir)?;
    let params = sampling_params(&defaults, &args.sampling);
    params.validate(config.vocab_size)?;

    let prompt = if args.chat {
        let mut messages = Vec::with_capacity(2);
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system.clone()));
        }
        messages.push(ChatMessage::new("user", prompt_text));
        let rendered = tokenizer.render(&messages, true)?;
        tokenizer.encode_chat(&messages, true, &rendered)?
    } else {
        tokenizer.encode(&prompt_text, true)?
    };

    // One sequence: the pools hold what this generation can reach, not the model's whole context.
    let want = prompt
        .len()
        .saturating_add(params.max_tokens.unwrap_or(usize::MAX))
        .min(config.max_position_embeddings);
    let mut dargs = args.run.device.clone();
    dargs.max_seqs = Some(dargs.max_seqs().min(8));
    let needs = Needs {
        mtp: spec.as_ref().is_some_and(|s| s.drafter == DrafterKind::Mtp),
        time_mtp: false,
        slots: 1,
        context: want,
        verify: spec.as_ref().map_or(1, SpecConfig::max_verify),
        prefix_store: backend::prefix_store(&args.run.engine)?,
    };
    let b = backend::backend(&dir, &dargs, Some(&args.run.decode), needs)?;
    let mut engine_config = backend::engine_config(&args.run.engine, b.form)?;
    engine_config.eos_token_ids = eos_token_ids;
    engine_config.tokenizer = Some(tokenizer);
    if let Some(s) = &spec {
        engine_config.spec = Some(super::spec::engine_spec(
            s,
            &dir,
            config.vocab_size,
            1,
            want,
            b.mtp_on_ranks,
        )?);
    }
    let json = args.json;
    let result = backend::runtime()?.block_on(async {
        let (engine, _device) = backend::start_engine(&b, engine_config).await?;
        let mut request = GenerateRequest::new(prompt.clone(), params.clone());
        if matches!(spec.as_ref().map(|s| &s.drafter), Some(DrafterKind::Oracle { .. })) {
            // The oracle proposes the target's own greedy continuation, computed here once without speculation.
            let greedy = SamplingParams {
                temperature: 0.0,
                repetition_penalty: 1.0,
                stop_strings: Vec::new(),
                ..params.clone()
            };
            let mut plain = GenerateRequest::new(prompt.clone(), greedy);
            plain.speculate = false;
            request.reference = Some(collect(&engine, plain).await?);
        }
        let out = stream(&engine, request, json, spec.as_ref()).await;
        let recoveries = engine.metrics().snapshot().recoveries_log;
        engine.shutdown().await;
        for r in recoveries {
            errln!(
                "[recovered from a fault ({}: {}): ranks restarted in {:.3} s, {} sequence(s) re-prefilled]",
                r.fault,
                r.message,
                r.restart_seconds,
                r.requeued
            );
        }
        out
    })?;
    if json {
        write_stdout(&(serde_json::to_string(&result)? + "\n"))?;
    } else {
        write_stdout("\n")?;
        let s = &result.stats;
        errln!(
            "[{} prompt tokens, {} generated | prefill {:.1} tok/s | decode {:.1} tok/s | finish: {} | seed {}]",
            s.prompt_tokens,
            s.generated_tokens,
            s.prefill_tokens_per_second,
            s.decode_tokens_per_second,
            s.finish_reason,
            s.seed
        );
        if let Some(r) = &s.spec {
            errln!("{}", r.line());
        }
    }
    Ok(())
}

/// Runs `request` to its end without streaming; its generated tokens.
async fn collect(engine: &EngineHandle, request: GenerateRequest) -> Result<Vec<u32>> {
    let mut events = engine.submit(request)?;
    let mut tokens = Vec::new();
    while let Some(event) = events.next().await {
        match event {
            Event::Token { token, .. } => tokens.push(token),
            // Not asked for here.
            Event::PromptLogprobs { .. } => {}
            Event::Finished { .. } => return Ok(tokens),
            Event::Failed { error, .. } => anyhow::bail!("{error}"),
        }
    }
    anyhow::bail!("the engine ended the request without a final event")
}

/// Runs one request through the engine, streaming its text to stdout unless `json`.
async fn stream(
    engine: &EngineHandle,
    request: GenerateRequest,
    json: bool,
    spec_config: Option<&SpecConfig>,
) -> Result<GenerationOutput> {
    let prompt_tokens = request.prompt.len();
    let t0 = Instant::now();
    let mut events = engine.submit(request)?;
    let (mut text, mut tokens) = (String::new(), Vec::new());
    let mut first: Option<f64> = None;
    while let Some(event) = events.next().await {
        match event {
            Event::Token { token, text: piece, .. } => {
                first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                tokens.push(token);
                if !json && !piece.is_empty() {
                    write_stdout(&piece)?;
                }
                text.push_str(&piece);
            }
            // Not asked for here.
            Event::PromptLogprobs { .. } => {}
            Event::Finished { reason, seed, spec, .. } => {
                let total = t0.elapsed().as_secs_f64();
                // The first token comes from the prompt's step; every later one costs one decode step.
                let prefill_seconds = first.unwrap_or(total);
                let decode_seconds = total - prefill_seconds;
                let decoded = tokens.len().saturating_sub(1);
                return Ok(GenerationOutput {
                    text,
                    stats: GenerationStats {
                        prompt_tokens,
                        generated_tokens: tokens.len(),
                        prefill_seconds,
                        decode_seconds,
                        prefill_tokens_per_second: prompt_tokens as f64 / prefill_seconds.max(1e-9),
                        decode_tokens_per_second: if decoded > 0 {
                            decoded as f64 / decode_seconds.max(1e-9)
                        } else {
                            0.0
                        },
                        finish_reason: reason,
                        seed,
                        spec: spec_config.zip(spec).map(|(c, s)| SpecReport::new(c, &s)),
                    },
                    tokens,
                });
            }
            Event::Failed { error, .. } => anyhow::bail!("{error}"),
        }
    }
    anyhow::bail!("the engine ended the request without a final event")
}
