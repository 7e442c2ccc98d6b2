//! `rewind bench --concurrency N --requests M`: serving through the engine (coordinator and rank actors). M requests,
//! each a fixed pseudo-random prompt generating a fixed number of greedy tokens, are submitted with at most N in
//! flight; reported are output tokens/s over the run, time to first token and inter-token latency (p50 / p99), and
//! the process's peak memory. The JSON also holds every request's tokens (first pass) and the pools before the first
//! request and after the last, so a run with `--inject-fault` can be checked against a fault-free one: same tokens,
//! pools back to where they started (`bench/gpu/multi_gpu.sh`).
//!
//! With `--spec`, the same requests run alternately without and with speculation in one engine (`--repeats`
//! passes each, medians reported), so the speed-up is measured side by side; the plain pass's tokens are the
//! oracle drafter's references, and every speculative pass must reproduce them exactly (greedy).

use rewind_engine::spec::DrafterKind;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::output::{errln, outln};
use anyhow::Result;
use rewind_actors::{EngineConfig, EngineHandle, Event, GenerateRequest};
use rewind_engine::generate::SpecReport;
use rewind_engine::sample::SamplingParams;
use rewind_engine::spec::{SpecConfig, SpecStats};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use super::backend::{self, Needs};
use super::bench::{tokens, Progress};
use crate::cli::BenchArgs;

/// The `q`-quantile (0..=1) of `xs` by the nearest rank (NaN for none).
fn quantile(xs: &mut [f64], q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let i = ((q * xs.len() as f64).ceil() as usize).clamp(1, xs.len()) - 1;
    xs[i]
}

/// The process's peak resident memory in MiB (Linux), if known.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// The scheduler's free slots and KV blocks, every rank's slots in use and the rank generation: taken before the
/// first request and after the last, they show that a run (faults and recoveries included) leaves the pools empty.
fn pool_json(h: &rewind_actors::EngineHealth) -> Value {
    json!({
        "free_slots": h.free_slots,
        "free_kv_blocks": h.free_kv_blocks,
        "running": h.running,
        "waiting": h.waiting,
        "generation": h.generation,
        "slots_in_use": h.ranks.iter().map(|r| r.slots_in_use).collect::<Vec<_>>(),
    })
}

/// What one request saw: its submit time, each token's arrival, and how it ended.
struct Trace {
    submitted: Instant,
    arrivals: Vec<Instant>,
    tokens: Vec<u32>,
    spec: Option<SpecStats>,
    error: Option<String>,
}

/// Requests finished so far, reported on stderr about every tenth of the run.
struct Done {
    count: AtomicUsize,
    of: usize,
    progress: Progress,
}

impl Done {
    fn one_more(&self) {
        let k = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        let every = self.of.div_ceil(10).max(1);
        if k.is_multiple_of(every) || k == self.of {
            self.progress.line(&format!("serving: {k}/{} requests done", self.of));
        }
    }
}

async fn one(engine: Arc<EngineHandle>, request: GenerateRequest, gate: Arc<Semaphore>, done: Arc<Done>) -> Trace {
    let trace = traced(engine, request, gate).await;
    done.one_more();
    trace
}

async fn traced(engine: Arc<EngineHandle>, request: GenerateRequest, gate: Arc<Semaphore>) -> Trace {
    let _permit = gate.acquire_owned().await;
    let submitted = Instant::now();
    let mut trace = Trace {
        submitted,
        arrivals: Vec::new(),
        tokens: Vec::new(),
        spec: None,
        error: None,
    };
    let mut events = match engine.submit(request) {
        Ok(s) => s,
        Err(e) => {
            trace.error = Some(e.to_string());
            return trace;
        }
    };
    while let Some(e) = events.next().await {
        match e {
            Event::Token { token, .. } => {
                trace.arrivals.push(Instant::now());
                trace.tokens.push(token);
            }
            // Not asked for here.
            Event::PromptLogprobs { .. } => {}
            Event::Finished { spec, .. } => {
                trace.spec = spec;
                break;
            }
            Event::Failed { error, .. } => {
                trace.error = Some(error);
                break;
            }
        }
    }
    trace
}

/// The range `[x·(1 − r), x·(1 + r)]` (at least 1) request lengths are drawn from, as vLLM's random dataset does.
fn length_range(x: usize, ratio: f64) -> (usize, usize) {
    let lo = ((x as f64 * (1.0 - ratio)).floor() as usize).max(1);
    let hi = ((x as f64 * (1.0 + ratio)).floor() as usize).max(lo);
    (lo, hi)
}

/// The longest prompt and output a request may get with `--random-range-ratio ratio`.
pub(super) fn longest(prompt: usize, decode: usize, ratio: f64) -> (usize, usize) {
    (length_range(prompt, ratio).1, length_range(decode, ratio).1)
}

/// Request `i`'s prompt and output lengths: uniform in `prompt` / `decode` ± `ratio`, keyed by `i` alone (two
/// independent streams), so every run and every pass of a run sends the same requests. A ratio of 0 gives exactly
/// `(prompt, decode)`.
pub(super) fn request_lengths(prompt: usize, decode: usize, ratio: f64, i: usize) -> (usize, usize) {
    let draw = |x: usize, stream: u64| {
        let (lo, hi) = length_range(x, ratio);
        let r = rewind_kernels::cpu::lm_head::mix64(stream ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        lo + (r % (hi - lo + 1) as u64) as usize
    };
    // A prompt keeps at least 2 tokens, as --prompt-len does.
    (
        draw(prompt, 0x7072_6f6d_7074).max(2.min(prompt)),
        draw(decode, 0x6f75_7470_7574),
    )
}

/// Checks the serving flags' values (before anything is loaded): the length spread and the temperature.
pub fn check_flags(args: &BenchArgs) -> Result<()> {
    let ratio = args.random_range_ratio;
    anyhow::ensure!(
        ratio.is_finite() && (0.0..1.0).contains(&ratio),
        "--random-range-ratio must be at least 0 and below 1, got {ratio}"
    );
    anyhow::ensure!(
        args.temperature.is_finite() && args.temperature >= 0.0,
        "--temperature must be finite and at least 0, got {}",
        args.temperature
    );
    Ok(())
}

/// A serving pass's throughput and latencies (seconds): time to first token, inter-token and request latency, each
/// `(p50, p99)`, and the process's peak memory.
struct Latencies {
    generated: usize,
    wall: f64,
    out_tps: f64,
    ttft: (f64, f64),
    itl: (f64, f64),
    latency: (f64, f64),
    peak: Option<f64>,
}

impl Latencies {
    fn of(traces: &[Trace], wall: f64) -> Latencies {
        let generated: usize = traces.iter().map(|t| t.arrivals.len()).sum();
        let mut ttft: Vec<f64> = traces
            .iter()
            .filter_map(|t| t.arrivals.first().map(|a| (*a - t.submitted).as_secs_f64()))
            .collect();
        let mut itl: Vec<f64> = traces
            .iter()
            .flat_map(|t| t.arrivals.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()))
            .collect();
        let mut latency: Vec<f64> = traces
            .iter()
            .filter_map(|t| t.arrivals.last().map(|a| (*a - t.submitted).as_secs_f64()))
            .collect();
        Latencies {
            generated,
            wall,
            out_tps: generated as f64 / wall,
            ttft: (quantile(&mut ttft, 0.5), quantile(&mut ttft, 0.99)),
            itl: (quantile(&mut itl, 0.5), quantile(&mut itl, 0.99)),
            latency: (quantile(&mut latency, 0.5), quantile(&mut latency, 0.99)),
            peak: peak_rss_mib(),
        }
    }

    /// The pass's line on stderr and its table rows.
    fn print(
        &self,
        metrics: &rewind_actors::MetricsSnapshot,
        device: &str,
        requests: usize,
        concurrency: usize,
        args: &BenchArgs,
        spread: &str,
    ) -> Result<()> {
        let (out_tps, (ttft50, ttft99), (itl50, itl99)) = (self.out_tps, self.ttft, self.itl);
        errln!(
            "serving: {requests} requests, concurrency {concurrency} on {device}: {out_tps:.1} output tok/s | TTFT p50 {:.1} ms \
             p99 {:.1} ms | ITL p50 {:.2} ms p99 {:.2} ms | {} steps, {} preemptions, {} faults",
            ttft50 * 1e3,
            ttft99 * 1e3,
            itl50 * 1e3,
            itl99 * 1e3,
            metrics.steps,
            metrics.preemptions,
            metrics.faults
        );
        outln!("| serving: {requests} requests, {concurrency} in flight, {} + {} tokens each{spread} | {out_tps:.1} output tok/s over {:.2} s |", args.prompt_len, args.decode_tokens, self.wall)?;
        outln!(
            "| serving: time to first token p50 / p99 | {:.1} / {:.1} ms |",
            ttft50 * 1e3,
            ttft99 * 1e3
        )?;
        outln!(
            "| serving: inter-token latency p50 / p99 | {:.2} / {:.2} ms |",
            itl50 * 1e3,
            itl99 * 1e3
        )?;
        outln!(
            "| serving: request latency p50 / p99 | {:.3} / {:.3} s |",
            self.latency.0,
            self.latency.1
        )?;
        if let Some(p) = self.peak {
            outln!("| serving: peak resident memory | {p:.0} MiB |")?;
        }
        Ok(())
    }
}

/// The ranks and engine settings a serving run (speculating as `spec` says) of `concurrency` sequences of up to `context` tokens needs: the
/// flags' device, decode form, speculation and prefix cache, end-of-sequence ids dropped (every request runs its
/// whole `--decode-tokens`).
fn serving_engine(
    args: &BenchArgs,
    dir: &std::path::Path,
    spec: Option<&SpecConfig>,
    concurrency: usize,
    context: usize,
) -> Result<(backend::Backend, EngineConfig)> {
    let needs = Needs {
        mtp: spec.is_some_and(|s| s.drafter == DrafterKind::Mtp),
        time_mtp: false,
        slots: concurrency,
        context,
        verify: spec.map_or(1, SpecConfig::max_verify),
        prefix_store: backend::prefix_store(&args.run.engine)?,
    };
    let mut dargs = args.run.device.clone();
    dargs.max_seqs = Some(dargs.max_seqs().max(concurrency));
    let b = backend::backend(dir, &dargs, Some(&args.run.decode), needs)?;
    let mut config = backend::engine_config(&args.run.engine, b.form)?;
    config.eos_token_ids = Vec::new();
    if let Some(s) = spec {
        config.spec = Some(super::spec::engine_spec(
            s,
            dir,
            b.config.vocab_size,
            concurrency,
            context,
            b.mtp_on_ranks,
        )?);
    }
    Ok((b, config))
}

/// Runs the serving benchmark; returns its JSON (and prints its table rows).
pub fn run(
    args: &BenchArgs,
    dir: &std::path::Path,
    concurrency: usize,
    requests: usize,
    progress: &Progress,
) -> Result<Value> {
    anyhow::ensure!(concurrency > 0, "--concurrency must be at least 1");
    anyhow::ensure!(requests > 0, "--requests must be at least 1");
    // No more can be in flight than there are requests: slots past that would only take memory.
    let concurrency = concurrency.min(requests);
    let ratio = args.random_range_ratio;
    let lengths: Vec<(usize, usize)> = (0..requests)
        .map(|i| request_lengths(args.prompt_len, args.decode_tokens, ratio, i))
        .collect();
    let (longest_prompt, longest_output) = longest(args.prompt_len, args.decode_tokens, ratio);
    let context = longest_prompt + longest_output;
    let spec = super::spec::config(&args.run.spec, &args.run.decode)?;
    let (b, config) = serving_engine(args, dir, spec.as_ref(), concurrency, context)?;
    let vocab = b.config.vocab_size;
    let params = SamplingParams {
        max_tokens: Some(args.decode_tokens),
        ignore_eos: true,
        temperature: args.temperature,
        ..SamplingParams::greedy()
    };
    let spread = if ratio > 0.0 {
        format!(" (± {ratio} each)")
    } else {
        String::new()
    };
    let rt = backend::runtime()?;
    let (traces, wall, metrics, device, side, pools) = rt.block_on(async {
        progress.line(&format!("serving: loading {} ...", dir.display()));
        let (engine, device) = backend::start_engine(&b, config).await?;
        let before = engine.health().await?;
        let engine = Arc::new(engine);
        let gate = Arc::new(Semaphore::new(concurrency));
        progress.line(&format!(
            "serving: {requests} requests of {} + {} tokens{spread}, {concurrency} in flight ...",
            args.prompt_len, args.decode_tokens
        ));
        let pass = |speculate: bool, references: Option<Vec<Vec<u32>>>| {
            let (engine, gate, params, lengths) = (engine.clone(), gate.clone(), params.clone(), &lengths);
            async move {
                let done = Arc::new(Done {
                    count: AtomicUsize::new(0),
                    of: requests,
                    progress: *progress,
                });
                let t0 = Instant::now();
                let tasks: Vec<_> = (0..requests)
                    .map(|i| {
                        let (prompt_len, output_len) = lengths[i];
                        let prompt = tokens(prompt_len, vocab, 0x5eed + i as u64);
                        let params = SamplingParams {
                            max_tokens: Some(output_len),
                            seed: Some(0x5eed + i as u64),
                            ..params.clone()
                        };
                        let mut req = GenerateRequest::new(prompt, params);
                        req.speculate = speculate;
                        req.reference = references.as_ref().map(|r| r[i].clone());
                        tokio::spawn(one(engine.clone(), req, gate.clone(), done.clone()))
                    })
                    .collect();
                let mut traces = Vec::with_capacity(tasks.len());
                for t in tasks {
                    traces.push(t.await?);
                }
                anyhow::Ok((traces, t0.elapsed().as_secs_f64()))
            }
        };
        let (traces, wall) = pass(false, None).await?;
        let mut side = None;
        if spec.is_some() {
            // Alternate plain and speculative passes so drift hits both alike; the first plain pass above warms up.
            let references: Vec<Vec<u32>> = traces.iter().map(|t| t.tokens.clone()).collect();
            let (mut plain_walls, mut spec_walls, mut spec_traces) = (Vec::new(), Vec::new(), Vec::new());
            let mut plain_traces = Vec::new();
            for r in 0..args.repeats {
                progress.line(&format!("serving: side-by-side pass {}/{} ...", r + 1, args.repeats));
                let (t, w) = pass(false, None).await?;
                plain_walls.push(w);
                plain_traces = t;
                let (t, w) = pass(true, Some(references.clone())).await?;
                spec_walls.push(w);
                spec_traces = t;
            }
            side = Some((references, plain_walls, spec_walls, spec_traces, plain_traces));
        }
        let metrics = engine.metrics().snapshot();
        let pools = json!({"before": pool_json(&before), "after": pool_json(&engine.health().await?)});
        if let Ok(engine) = Arc::try_unwrap(engine) {
            engine.shutdown().await;
        }
        anyhow::Ok((traces, wall, metrics, device, side, pools))
    })?;
    let failed: Vec<&String> = traces.iter().filter_map(|t| t.error.as_ref()).collect();
    anyhow::ensure!(
        failed.is_empty(),
        "{} of {requests} requests failed; the first: {}",
        failed.len(),
        failed[0]
    );
    let lat = Latencies::of(&traces, wall);
    lat.print(&metrics, &device, requests, concurrency, args, &spread)?;
    let speculation = match (&spec, side) {
        (Some(config), Some((references, mut plain_walls, mut spec_walls, spec_traces, plain_traces))) => {
            // Exact output is required where the arithmetic is deterministic across batch shapes (the CPU, and f32
            // on GPUs); in bf16 a verify's GEMMs round differently from a decode step's, so near-tied greedy picks
            // may flip, in plain batches of other shapes too: there the matches are reported.
            let exact = device.starts_with("cpu") || args.run.device.dtype == "f32";
            let greedy = args.temperature == 0.0;
            Some(side_by_side(
                config,
                &references,
                &mut plain_walls,
                &mut spec_walls,
                (&spec_traces, &plain_traces),
                greedy.then_some(exact),
            )?)
        }
        _ => None,
    };
    Ok(json!({
        "speculation": speculation,
        "device": device,
        "requests": requests,
        "concurrency": concurrency,
        "prompt_tokens": args.prompt_len,
        "output_tokens_per_request": args.decode_tokens,
        "random_range_ratio": ratio,
        "temperature": args.temperature,
        "prompt_tokens_total": lengths.iter().map(|l| l.0).sum::<usize>(),
        "max_batch_tokens": args.run.engine.max_batch_tokens,
        "wall_s": wall,
        "output_tokens": lat.generated,
        "output_tok_per_s": lat.out_tps,
        "ttft_ms": {"p50": lat.ttft.0 * 1e3, "p99": lat.ttft.1 * 1e3},
        "itl_ms": {"p50": lat.itl.0 * 1e3, "p99": lat.itl.1 * 1e3},
        "request_latency_s": {"p50": lat.latency.0, "p99": lat.latency.1},
        "peak_rss_mib": lat.peak,
        "engine": {
            "steps": metrics.steps,
            "prefill_tokens": metrics.prefill_tokens,
            "preemptions": metrics.preemptions,
            "faults": metrics.faults,
            "recoveries": metrics.recoveries_log,
        },
        "pools": pools,
        "tokens": traces.iter().map(|t| &t.tokens).collect::<Vec<_>>(),
    }))
}

/// Checks the speculative pass against the plain one (greedy, `compare` `Some(exact)`: the same tokens, required
/// when `exact`; sampled, `None`: not compared) and reports the medians of the side-by-side passes and the
/// speculation counters.
fn side_by_side(
    config: &SpecConfig,
    references: &[Vec<u32>],
    plain_walls: &mut [f64],
    spec_walls: &mut [f64],
    (spec_traces, plain_traces): (&[Trace], &[Trace]),
    compare: Option<bool>,
) -> Result<Value> {
    if let Some(t) = spec_traces.iter().chain(plain_traces).find_map(|t| t.error.as_ref()) {
        anyhow::bail!("a side-by-side request failed: {t}");
    }
    let matching = |traces: &[Trace]| traces.iter().zip(references).filter(|(t, r)| &t.tokens == *r).count();
    let (same, plain_same) = (matching(spec_traces), matching(plain_traces));
    let exact = compare == Some(true);
    anyhow::ensure!(
        !exact || same == references.len(),
        "speculation changed the greedy output of {} of {} requests",
        references.len() - same,
        references.len()
    );
    if compare.is_some() && (same < references.len() || plain_same < references.len()) {
        errln!(
            "note: greedy outputs equal to the first plain pass: speculative {same} / {n}, plain {plain_same} / {n} \
             (bf16 rounding differs between batch shapes)",
            n = references.len()
        );
    }
    let mut stats = SpecStats::default();
    for t in spec_traces {
        if let Some(s) = &t.spec {
            stats.add(s);
        }
    }
    let report = SpecReport::new(config, &stats);
    let generated: usize = references.iter().map(Vec::len).sum();
    let (plain, spec) = (quantile(plain_walls, 0.5), quantile(spec_walls, 0.5));
    let speedup = plain / spec;
    errln!("{}", report.line());
    outln!(
        "| serving, side by side (median of {}): plain / spec {} | {:.1} / {:.1} output tok/s, speed-up {speedup:.2}x |",
        plain_walls.len(),
        report.drafter,
        generated as f64 / plain,
        generated as f64 / spec
    )?;
    outln!(
        "| serving, spec {}: accepted per step / acceptance | {:.2} / {:.1}% |",
        report.drafter,
        report.accepted_per_step,
        100.0 * report.acceptance_rate
    )?;
    Ok(json!({
        "report": report,
        "plain_wall_s": plain_walls,
        "spec_wall_s": spec_walls,
        "plain_tok_per_s_median": generated as f64 / plain,
        "spec_tok_per_s_median": generated as f64 / spec,
        "speedup": speedup,
        "requests_matching_reference": {"speculative": same, "plain": plain_same, "of": references.len()},
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lengths_spread_within_the_ratio_and_repeat() {
        // A ratio of 0: every request is --prompt-len + --decode-tokens.
        assert!((0..50).all(|i| request_lengths(100, 64, 0.0, i) == (100, 64)));
        let drawn: Vec<(usize, usize)> = (0..400).map(|i| request_lengths(100, 64, 0.5, i)).collect();
        assert!(drawn
            .iter()
            .all(|&(p, d)| (50..=150).contains(&p) && (32..=96).contains(&d)));
        // Both ends of each range occur, the two lengths vary independently, and the draw is a function of i.
        for (lo, hi, pick) in [(50, 150, 0), (32, 96, 1)] {
            let v: Vec<usize> = drawn.iter().map(|&l| if pick == 0 { l.0 } else { l.1 }).collect();
            assert!(v.contains(&lo) && v.contains(&hi), "{lo}..={hi} not covered");
        }
        assert!(drawn.iter().any(|&(p, d)| (p >= 100) != (d >= 64)));
        assert_eq!(drawn[7], request_lengths(100, 64, 0.5, 7));
        assert_eq!(longest(100, 64, 0.5), (150, 96));
        // Short lengths stay usable: a prompt of at least 2, an output of at least 1.
        assert!((0..100).all(|i| {
            let (p, d) = request_lengths(2, 1, 0.9, i);
            (2..=3).contains(&p) && d >= 1
        }));
    }
}
