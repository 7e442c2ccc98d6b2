//! `rewind bench`: chunked prefill against token-by-token prefill on one prompt, and the decode rate.
//!
//! Both prefill variants run side by side in one process on the same prompt; each is repeated and the median reported.

use std::time::Instant;

use anyhow::{Context, Result};
use rewind_engine::model::{Logits, Model};
use serde_json::json;

use crate::cli::{BenchArgs, Device};
use crate::default_model::default_model_dir;

/// Seed of the benchmark prompt (CPU and GPU benches use the same prompt).
pub(super) const PROMPT_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// The median (NaN for no samples).
pub(super) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// A fixed pseudo-random token sequence (xorshift from `seed`), the same on every run.
pub(super) fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

/// The commit this binary was built from (recorded at build time; `-dirty` marks uncommitted changes).
fn git_commit() -> Option<String> {
    Some(env!("REWIND_GIT_COMMIT").to_string())
}

pub fn run(args: BenchArgs) -> Result<()> {
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => default_model_dir()?,
    };
    anyhow::ensure!(args.repeats > 0, "--repeats must be at least 1");
    anyhow::ensure!(args.prompt_len > 1, "--prompt-len must be at least 2");
    match args.device.device()? {
        Device::Cpu => anyhow::ensure!(
            args.batch.is_none(),
            "--batch: the batched decode benchmark runs on GPUs (--device cuda); the CPU bench decodes one sequence"
        ),
        #[cfg(feature = "cuda")]
        Device::Cuda(devices) => return super::gpu::bench(&args, &dir, devices, git_commit()),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => return Err(super::no_cuda()),
    }
    let model = Model::from_dir(&dir)?;
    let limit = model.config().max_position_embeddings;
    // Checked before anything is allocated for the prompt.
    anyhow::ensure!(
        args.prompt_len <= limit,
        "--prompt-len {} exceeds the model's context limit of {limit} tokens (max_position_embeddings)",
        args.prompt_len
    );
    anyhow::ensure!(
        args.decode_tokens.saturating_add(16) <= limit,
        "--decode-tokens {} (after a 16-token prompt) exceeds the model's context limit of {limit} tokens",
        args.decode_tokens
    );
    // A fixed pseudo-random prompt: the same tokens for every variant and every run.
    let prompt = tokens(args.prompt_len, model.config().vocab_size, PROMPT_SEED);
    model.check_tokens(&prompt, 0)?;
    let threads = rayon::current_num_threads();
    eprintln!(
        "model: {} | prompt {} tokens | {threads} threads | {} repeats",
        model.config().summary(),
        prompt.len(),
        args.repeats
    );

    let mut chunked = Vec::new();
    let mut stepwise = Vec::new();
    let mut max_rel_diff = 0.0f64;
    for r in 0..args.repeats {
        let mut s = model.new_state();
        let t0 = Instant::now();
        let a = model.forward(&prompt, &mut s, Logits::Last)?;
        chunked.push(t0.elapsed().as_secs_f64());

        let mut s = model.new_state();
        let t0 = Instant::now();
        let mut b = Vec::new();
        for &tok in &prompt {
            b = model.forward(&[tok], &mut s, Logits::Last)?;
        }
        stepwise.push(t0.elapsed().as_secs_f64());
        let num: f64 = a.iter().zip(&b).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
        let den: f64 = b.iter().map(|q| (*q as f64).powi(2)).sum();
        max_rel_diff = max_rel_diff.max((num / den.max(1e-30)).sqrt());
        eprintln!(
            "  repeat {}: chunked {:.3} s, token-by-token {:.3} s",
            r + 1,
            chunked[r],
            stepwise[r]
        );
    }

    let mut decode = Vec::new();
    for _ in 0..args.repeats {
        let mut s = model.new_state();
        let mut logits = model.forward(&prompt[..16.min(prompt.len())], &mut s, Logits::Last)?;
        let t0 = Instant::now();
        for _ in 0..args.decode_tokens {
            let next = rewind_engine::sample::argmax(&logits);
            logits = model.forward(&[next], &mut s, Logits::Last)?;
        }
        decode.push(args.decode_tokens as f64 / t0.elapsed().as_secs_f64());
    }

    let (c, s, d) = (
        median(chunked.clone()),
        median(stepwise.clone()),
        median(decode.clone()),
    );
    let result = json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "date_unix": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "commit": git_commit(),
        "device": format!("cpu ({threads} threads)"),
        "model": model.config().summary(),
        "prompt_tokens": prompt.len(),
        "prefill_chunked_s": chunked,
        "prefill_token_by_token_s": stepwise,
        "prefill_chunked_median_s": c,
        "prefill_token_by_token_median_s": s,
        "prefill_speedup": s / c,
        "prefill_chunked_tok_per_s": prompt.len() as f64 / c,
        "chunked_vs_stepwise_rel_diff": max_rel_diff,
        "decode_tokens": args.decode_tokens,
        "decode_tok_per_s": decode,
        "decode_tok_per_s_median": d,
    });
    println!("| measure | value |");
    println!("|---|---|");
    println!(
        "| prefill, chunked ({} tokens) | {:.3} s ({:.0} tok/s) |",
        prompt.len(),
        c,
        prompt.len() as f64 / c
    );
    println!(
        "| prefill, token by token | {:.3} s ({:.0} tok/s) |",
        s,
        prompt.len() as f64 / s
    );
    println!("| chunked speed-up | {:.1}× |", s / c);
    println!("| decode | {:.1} tok/s |", d);
    println!(
        "| last-logit difference chunked vs token-by-token | {:.2e} (relative L2) |",
        max_rel_diff
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&result)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
