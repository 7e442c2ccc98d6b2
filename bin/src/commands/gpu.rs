//! The GPU paths of the commands: loading a [`GpuModel`] from the device flags, and the GPU benchmark.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use rewind_engine::gpu::{GpuModel, GpuOptions};
use rewind_engine::model::Logits;
use serde_json::json;

use super::bench::{median, tokens, PROMPT_SEED};
use crate::cli::{BenchArgs, DeviceArgs};

/// The engine's options from the flags.
pub fn options(d: &DeviceArgs, devices: Vec<usize>) -> Result<GpuOptions> {
    Ok(GpuOptions {
        devices,
        gpu_memory_fraction: d.gpu_memory_fraction,
        max_seqs: d.max_seqs,
        max_model_len: d.max_model_len,
        prefill_chunk: d.prefill_chunk,
        dtype: d.dtype.parse()?,
    })
}

/// Loads `dir` onto `devices`, printing what was placed where.
pub fn load(dir: &Path, d: &DeviceArgs, devices: Vec<usize>) -> Result<GpuModel> {
    let t0 = Instant::now();
    let model = GpuModel::load(dir, &options(d, devices)?)?;
    let r = model.report();
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    eprintln!(
        "GPU: {} | tp {} | {} activations | weights {:.2} GiB, state pools {:.2} GiB, activations {:.2} GiB per rank of {:.1} GiB | \
         {} sequences × {} tokens, {} KV blocks | loaded in {:.1} s",
        r.devices.join(", "),
        model.tp(),
        d.dtype,
        gib(r.weight_bytes.iter().copied().max().unwrap_or(0)),
        gib(r.state_bytes.iter().copied().max().unwrap_or(0)),
        gib(r.scratch_bytes.iter().copied().max().unwrap_or(0)),
        gib(r.total_bytes.first().copied().unwrap_or(0)),
        r.sizes.max_seqs,
        r.sizes.max_len,
        r.sizes.num_blocks,
        t0.elapsed().as_secs_f64()
    );
    Ok(model)
}

/// `rewind bench --device cuda`: prefill rate of one prompt, and greedy decode rates of the batched step at each
/// `--batch` size (every row a sequence of its own), medians over `--repeats`.
pub fn bench(args: &BenchArgs, dir: &Path, devices: Vec<usize>, commit: Option<String>) -> Result<()> {
    let batches = args.batch.clone().unwrap_or_else(|| vec![1, 64]);
    anyhow::ensure!(batches.iter().all(|&b| b > 0), "--batch sizes must be positive");
    let biggest = batches.iter().copied().max().unwrap_or(1);
    let mut dargs = args.device.clone();
    dargs.max_seqs = dargs.max_seqs.max(biggest);
    let context = args.prompt_len.max(16) + args.decode_tokens + 8;
    dargs.max_model_len = Some(dargs.max_model_len.unwrap_or(context).max(context));
    let mut model = load(dir, &dargs, devices)?;
    let vocab = model.config().vocab_size;
    let summary = model.config().summary();
    let device_names = model.report().devices.clone();

    let prompt = tokens(args.prompt_len, vocab, PROMPT_SEED);
    let mut prefill = Vec::new();
    for _ in 0..args.repeats + 1 {
        let seq = model.open()?;
        model.synchronize()?;
        let t0 = Instant::now();
        model.prefill(seq, &prompt, Logits::Last)?;
        prefill.push(t0.elapsed().as_secs_f64());
        model.release(seq)?;
    }
    prefill.remove(0); // the first run compiles nothing but warms cuBLAS's heuristics and the allocator
    let prefill_s = median(prefill.clone());
    eprintln!(
        "prefill {} tokens: {:.3} s median ({:.0} tok/s)",
        prompt.len(),
        prefill_s,
        prompt.len() as f64 / prefill_s
    );

    let mut rows = Vec::new();
    for &b in &batches {
        let mut rates = Vec::new();
        for rep in 0..args.repeats {
            let seqs: Vec<usize> = (0..b).map(|_| model.open()).collect::<Result<_, _>>()?;
            let mut next = Vec::with_capacity(b);
            for (i, &s) in seqs.iter().enumerate() {
                let p = tokens(16, vocab, 1000 + i as u64 + 7919 * rep as u64);
                let logits = model.prefill(s, &p, Logits::Last)?;
                next.push(rewind_engine::sample::argmax(&logits));
            }
            // Warm-up steps, then the timed ones.
            for _ in 0..3 {
                let batch: Vec<(usize, u32)> = seqs.iter().copied().zip(next.iter().copied()).collect();
                next = model.decode_greedy(&batch)?;
            }
            model.synchronize()?;
            let t0 = Instant::now();
            for _ in 0..args.decode_tokens {
                let batch: Vec<(usize, u32)> = seqs.iter().copied().zip(next.iter().copied()).collect();
                next = model.decode_greedy(&batch)?;
            }
            let secs = t0.elapsed().as_secs_f64();
            rates.push((b * args.decode_tokens) as f64 / secs);
            for s in seqs {
                model.release(s)?;
            }
        }
        let m = median(rates.clone());
        eprintln!(
            "decode batch {b}: {m:.1} tok/s median ({:.2} ms per step)",
            1e3 * b as f64 / m
        );
        rows.push(json!({
            "batch": b,
            "decode_tok_per_s": rates,
            "decode_tok_per_s_median": m,
            "step_ms_median": 1e3 * b as f64 / m,
        }));
    }

    println!("| measure | value |");
    println!("|---|---|");
    println!(
        "| prefill ({} tokens, one sequence) | {:.3} s ({:.0} tok/s) |",
        prompt.len(),
        prefill_s,
        prompt.len() as f64 / prefill_s
    );
    for r in &rows {
        println!(
            "| decode, batch {} | {:.1} tok/s ({:.2} ms per step) |",
            r["batch"],
            r["decode_tok_per_s_median"].as_f64().unwrap_or(f64::NAN),
            r["step_ms_median"].as_f64().unwrap_or(f64::NAN)
        );
    }
    if let Some(path) = &args.json {
        let result = json!({
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "date_unix": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            "commit": commit,
            "device": device_names,
            "tp": model.tp(),
            "model": summary,
            "prompt_tokens": prompt.len(),
            "prefill_s": prefill,
            "prefill_median_s": prefill_s,
            "prefill_tok_per_s": prompt.len() as f64 / prefill_s,
            "decode_tokens_per_sequence": args.decode_tokens,
            "decode_form": "recurrent",
            "dtype": args.device.dtype,
            "sampling": "greedy, argmax on the device",
            "decode": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&result)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
