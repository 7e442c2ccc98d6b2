//! `rewind perplexity`: exp of the mean negative log-likelihood of a text under the model (CPU, through the rank
//! interface: each window is one sequence whose prompt chunks report every position).

use anyhow::{bail, Context, Result};
use rewind_engine::decode::FormChoice;
use rewind_engine::rank::{GroupSequence, Rows, SeqKind};
use rewind_engine::tokenizer::Tokenizer;
use serde_json::json;

use super::backend::{self, Needs};
use crate::cli::PerplexityArgs;
use crate::output::outln;

/// Negative log-likelihood of `next` under `logits` (log-sum-exp in f64).
fn nll(logits: &[f32], next: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let lse = max + logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    lse - logits[next as usize] as f64
}

/// Tokens per prompt chunk (bounds the logits held at once).
const CHUNK: usize = 512;

pub fn run(args: PerplexityArgs) -> Result<()> {
    // Bad device values are errors before anything is read.
    args.device.check()?;
    let dir = super::generate::model_dir(&args.model)?;
    let config = rewind_engine::model::ModelConfig::from_dir(&dir)?;
    let limit = config.max_position_embeddings;
    let window = match args.window {
        Some(w) if w > limit => bail!("--window {w} exceeds the model's context limit of {limit} tokens"),
        Some(w) if w < 2 => bail!("--window must be at least 2 tokens, got {w}"),
        Some(w) => w,
        None => limit,
    };
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let tokenizer = Tokenizer::from_dir(&dir)?;
    let tokens = tokenizer.encode(&text, true)?;
    if tokens.len() < 2 {
        bail!(
            "{}: needs at least 2 tokens to score, found {}",
            args.file.display(),
            tokens.len()
        );
    }
    // One sequence at a time: the pools hold one window, not the GPU default's 64 sequences.
    let mut device = args.device.clone();
    device.max_seqs = Some(1);
    let needs = Needs {
        mtp: false,
        time_mtp: false,
        slots: 1,
        context: window.min(tokens.len()),
        verify: 1,
        prefix_store: 0,
    };
    let mut loaded = backend::open(&dir, &device, None, needs)?;
    let on = loaded.device.clone();
    let vocab = config.vocab_size;
    let start = std::time::Instant::now();
    let (mut total, mut count) = (0.0f64, 0usize);
    // Windows overlap by one token so that every token after the first is scored exactly once.
    let mut begin = 0;
    while begin + 1 < tokens.len() {
        let end = (begin + window).min(tokens.len());
        let chunk = &tokens[begin..end];
        let mut seq = GroupSequence::open(&mut loaded.group, FormChoice::Recurrent, chunk.len())?;
        for (c, part) in chunk.chunks(CHUNK).enumerate() {
            let out = seq.run(SeqKind::Prefill, part, Rows::All, true)?;
            let logits = out.logits.context("the step returned no logits")?;
            for (i, row) in logits.chunks_exact(vocab).enumerate() {
                let at = c * CHUNK + i;
                if at + 1 < chunk.len() {
                    total += nll(row, chunk[at + 1]);
                    count += 1;
                }
            }
        }
        begin = end - 1;
    }
    let ppl = (total / count as f64).exp();
    let secs = start.elapsed().as_secs_f64();
    if args.json {
        outln!(
            "{}",
            json!({"perplexity": ppl, "tokens_scored": count, "mean_nll": total / count as f64, "seconds": secs, "device": on})
        )?;
    } else {
        outln!(
            "perplexity {ppl:.4} over {count} tokens ({:.0} tok/s)",
            count as f64 / secs
        )?;
    }
    Ok(())
}
