//! `rewind generate`: stream text from a prompt.

use std::io::Write;

use anyhow::{Context, Result};
use rewind_engine::generate::generate_on;
use rewind_engine::generation_config::GenerationDefaults;
use rewind_engine::model::json::parse_relaxed;
use rewind_engine::rank::GroupSequence;
use rewind_engine::sample::SamplingParams;
use rewind_engine::tokenizer::chat::ChatMessage;
use rewind_engine::tokenizer::Tokenizer;

use super::backend::{self, Needs};
use crate::cli::{GenerateArgs, SamplingArgs};
use crate::default_model::default_model_dir;

const DEFAULT_PROMPT: &str = "The quick brown fox";

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
    p
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let dir = match &args.model {
        Some(dir) => dir.clone(),
        None => {
            eprintln!(
                "note: the default model has RANDOM weights (no trained default model yet): its output is noise, not language"
            );
            default_model_dir()?
        }
    };
    let config_path = dir.join("config.json");
    let config_text =
        std::fs::read_to_string(&config_path).with_context(|| format!("reading {}", config_path.display()))?;
    let config_json =
        parse_relaxed(&config_text).with_context(|| format!("{}: malformed JSON", config_path.display()))?;
    let defaults = GenerationDefaults::from_dir(&dir, &config_json)?;
    let params = sampling_params(&defaults, &args.sampling);
    let tokenizer = Tokenizer::from_dir(&dir)?;
    if args.device.device()? != crate::cli::Device::Cpu {
        args.decode.check_gpu()?;
    }
    let config = rewind_engine::model::ModelConfig::from_dir(&dir)?;
    params.validate(config.vocab_size)?;

    let prompt_text = args.prompt.clone().unwrap_or_else(|| DEFAULT_PROMPT.to_string());
    let prompt = if args.chat {
        let rendered = tokenizer.render(&[ChatMessage::new("user", prompt_text)], true)?;
        tokenizer.encode(&rendered, false)?
    } else {
        tokenizer.encode(&prompt_text, true)?
    };
    let mut eos = defaults.eos_token_ids.clone();
    for id in config.eos_token_ids.iter().chain(tokenizer.eos_token_id().as_ref()) {
        if !eos.contains(id) {
            eos.push(*id);
        }
    }

    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let json = args.json;
    let mut write_err: Option<std::io::Error> = None;
    let mut on_text = |piece: &str| {
        if !json && write_err.is_none() {
            if let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
                write_err = Some(e);
            }
        }
    };
    // One sequence: the pools hold what this generation can reach, not the model's whole context.
    let want = prompt
        .len()
        .saturating_add(params.max_tokens.unwrap_or(usize::MAX))
        .min(config.max_position_embeddings);
    let mut dargs = args.device.clone();
    dargs.max_seqs = dargs.max_seqs.min(8);
    let needs = Needs {
        slots: 1,
        context: want,
    };
    let mut loaded = backend::open(&dir, &dargs, Some(&args.decode), needs)?;
    let result = {
        let mut seq = GroupSequence::open(&mut loaded.group, loaded.form, want)?;
        generate_on(&mut seq, &tokenizer, &prompt, &params, &eos, &mut on_text)?
    };
    if let Some(e) = write_err {
        return Err(e).context("writing to stdout");
    }
    if json {
        serde_json::to_writer(&mut out, &result)?;
        writeln!(out)?;
    } else {
        writeln!(out)?;
        let s = &result.stats;
        eprintln!(
            "[{} prompt tokens, {} generated | prefill {:.1} tok/s | decode {:.1} tok/s | finish: {:?} | seed {}]",
            s.prompt_tokens,
            s.generated_tokens,
            s.prefill_tokens_per_second,
            s.decode_tokens_per_second,
            s.finish_reason,
            s.seed
        );
    }
    Ok(())
}
