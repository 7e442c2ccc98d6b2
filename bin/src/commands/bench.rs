//! `rewind bench`: the prefill rate of one prompt and the greedy decode rate at each batch size, on any backend,
//! through the rank interface. On the CPU the chunked prefill is also timed against the same prompt run token by
//! token, side by side in one process. Every measure is repeated and the median reported.

use std::time::Instant;

use crate::output::{errln, outln};
use anyhow::{Context, Result};
use rewind_engine::rank::{RankGroup, Rows, SeqKind, SeqStep, StageTimes, StepPlan};
use serde_json::json;

use super::backend::{self, Loaded, Needs};
use super::bench_steps;
use crate::cli::{BenchArgs, BenchCommand, Device};

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

/// The commit this binary was built from (recorded at build time; uncommitted changes are not marked, see
/// `build.rs`).
pub(super) fn git_commit() -> Option<String> {
    Some(env!("REWIND_GIT_COMMIT").to_string())
}

/// One step of one sequence.
fn one(loaded: &Loaded, slot: usize, kind: SeqKind, position: usize, tokens: Vec<u32>, logits: bool) -> StepPlan {
    StepPlan::batch(vec![SeqStep {
        slot,
        kind,
        position,
        tokens,
        form: loaded.form,
        rows: Rows::Last,
        sample: None,
        spec: None,
        logprobs: None,
    }])
    .with_logits(logits)
}

/// Seconds to prefill `prompt` into a fresh sequence, in one step (the chunked scans) or token by token (one
/// decode step per token); returns the last position's logits too.
fn prefill(loaded: &mut Loaded, prompt: &[u32], token_by_token: bool) -> Result<(f64, Vec<f32>)> {
    let slot = loaded.group.open(loaded.form)?;
    loaded.group.synchronize()?;
    let t0 = Instant::now();
    let out = if token_by_token {
        let mut last = None;
        for (i, &tok) in prompt.iter().enumerate() {
            let plan = one(loaded, slot, SeqKind::Decode, i, vec![tok], i + 1 == prompt.len());
            last = Some(loaded.group.step(plan)?);
        }
        last.context("an empty prompt")?
    } else {
        let plan = one(loaded, slot, SeqKind::Prefill, 0, prompt.to_vec(), true);
        loaded.group.step(plan)?
    };
    loaded.group.synchronize()?;
    let secs = t0.elapsed().as_secs_f64();
    loaded.group.release(slot)?;
    Ok((secs, out.logits.unwrap_or_default()))
}

/// The progress label of run `rep` of a measure: 0 is the untimed warm-up, then the timed repeats 1 ..= `repeats`.
pub(super) fn run_label(rep: usize, repeats: usize) -> String {
    if rep == 0 {
        "warm-up (untimed)".into()
    } else {
        format!("repeat {rep}/{repeats}")
    }
}

/// Greedy decode tokens per second of a batch of `b` sequences (each its own `prompt`-token prompt), `steps` timed
/// steps after 3 warm-up plans, in plans of `chain` chained steps; the argmax comes back as each row's summary (on
/// the device for a GPU, where a chain feeds it to the next step without a round trip).
fn decode_rate(
    group: &mut RankGroup,
    form: rewind_engine::decode::FormChoice,
    b: usize,
    prompt: usize,
    steps: usize,
    chain: usize,
    seed: u64,
) -> Result<(f64, Option<StageTimes>)> {
    let shape = bench_steps::StepShape {
        batch: b,
        prompt,
        window: 0,
        accepted: 0,
        chain,
    };
    let (secs, stages) = bench_steps::step_secs(group, form, shape, steps, seed)?;
    Ok((b as f64 / secs, stages))
}

/// The stage profiles of a measure's timed runs summed (`None` when the ranks do not profile stages).
fn sum_stages<'a>(runs: impl Iterator<Item = Option<&'a StageTimes>>) -> Option<StageTimes> {
    let mut total: Option<StageTimes> = None;
    for s in runs.flatten() {
        total.get_or_insert_with(StageTimes::default).merge(s);
    }
    total
}

/// Adds a measure's stage profile to its JSON row and prints it.
fn report_stages(row: &mut serde_json::Value, what: &str, stages: Option<StageTimes>, step_ms: f64) {
    // Ranks that time only their MTP work (`--mtp-draft`) report no stage for steps without it.
    if let Some(s) = stages.filter(|s| !s.stages.is_empty()) {
        let p = bench_steps::stage_json(&s, step_ms);
        errln!("{what}, ms per step by stage: {}", bench_steps::stage_line(&p));
        row["stage_profile"] = p;
    }
}

/// Plain progress on stderr: `[elapsed] what ... ` before a measurement and its result after it, so a long run shows
/// what it is doing.
#[derive(Clone, Copy)]
pub(super) struct Progress {
    start: Instant,
}

impl Progress {
    pub(super) fn new() -> Self {
        Progress { start: Instant::now() }
    }

    /// Seconds since the bench began.
    pub(super) fn elapsed(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// One line: `[elapsed] message`.
    pub(super) fn line(&self, message: &str) {
        errln!("[{:7.1} s] {message}", self.elapsed());
    }

    /// Runs `f` between `[elapsed] what ... ` and what `done` makes of its result and its wall-clock seconds.
    pub(super) fn timed<T>(
        &self,
        what: &str,
        f: impl FnOnce() -> Result<T>,
        done: impl FnOnce(&T, f64) -> String,
    ) -> Result<T> {
        crate::output::write_stderr(&format!("[{:7.1} s] {what} ... ", self.elapsed()));
        let t0 = Instant::now();
        let r = f();
        let secs = t0.elapsed().as_secs_f64();
        match &r {
            Ok(v) => errln!("{}", done(v, secs)),
            Err(_) => errln!("failed after {secs:.3} s"),
        }
        r
    }
}

/// Checks that the bench fits the model's context: the prompt plus the decoded tokens (the serving mode's requests;
/// the batched-step bench reports one prompt's prefill and decodes after a `--step-prompt` prompt and 3 warm-up
/// steps).
fn check_context(args: &BenchArgs, limit: usize) -> Result<()> {
    anyhow::ensure!(
        args.prompt_len <= limit,
        "--prompt-len {} exceeds the model's context limit of {limit} tokens (max_position_embeddings)",
        args.prompt_len
    );
    let total = args.prompt_len.checked_add(args.decode_tokens);
    anyhow::ensure!(
        total.is_some_and(|t| t <= limit),
        "--prompt-len {} plus --decode-tokens {} is {} tokens, more than the model's context limit of {limit} tokens \
         (max_position_embeddings); lower one of them",
        args.prompt_len,
        args.decode_tokens,
        total.map_or_else(|| "too many".to_string(), |t| t.to_string())
    );
    anyhow::ensure!(
        args.decode_tokens.saturating_add(args.step_prompt).saturating_add(3) <= limit,
        "--decode-tokens {} after a --step-prompt of {} tokens and 3 warm-up steps exceeds the model's context limit \
         of {limit} tokens (max_position_embeddings)",
        args.decode_tokens,
        args.step_prompt
    );
    Ok(())
}

pub fn run(mut args: BenchArgs) -> Result<()> {
    // `rewind bench kernels`: no model (clap refused the model flags beside it).
    match args.command.take() {
        Some(BenchCommand::Kernels(k)) => return super::bench_kernels::run(k),
        Some(BenchCommand::E2e(e)) => return super::bench_e2e::run(*e),
        Some(BenchCommand::Plot(p)) => return super::bench_plot::run(p),
        Some(BenchCommand::MultiTurn(m)) => return super::bench_multiturn::run(*m),
        None => {}
    }
    let flags = Flags::check(&args)?;
    let dir = super::generate::model_dir(&args.model)?;
    let config = rewind_engine::model::ModelConfig::from_dir(&dir)?;
    flags.check_model(&args, &config)?;
    let progress = Progress::new();
    if args.serving_only {
        let (n, m) = flags.serving.context("--serving-only needs --concurrency")?;
        let mut result = header(&args, &config);
        outln!("| measure | value |")?;
        outln!("|---|---|")?;
        outln!("| cpu | {} |", result["cpu"].as_str().unwrap_or("unknown"))?;
        result["serving"] = super::serve_bench::run(&args, &dir, n, m, &progress)?;
        return write_json(&args, &result);
    }
    let steps = Steps::check(&args, &config)?;
    // The roofline's copy bandwidth is measured before the model takes the device's memory.
    let copy_gbs = match &flags.device {
        Device::Cuda(gpus) => Some(progress.timed(
            "copy bandwidth (1 GiB device-to-device)",
            || bench_steps::copy_bandwidth(gpus),
            |gbs, _| format!("{gbs:.0} GB/s"),
        )?),
        Device::Cpu => None,
    };
    let biggest = flags.batches.iter().copied().max().unwrap_or(1);
    let needs = Needs {
        mtp: args.mtp_draft,
        time_mtp: args.mtp_draft,
        slots: biggest,
        context: args
            .prompt_len
            .max(args.step_prompt + 3 * steps.chain + args.decode_tokens.div_ceil(steps.chain) * steps.chain)
            .max(steps.verify_context),
        verify: steps.window + 1,
        prefix_store: 0,
    };
    let mut dargs = args.run.device.clone();
    dargs.max_seqs = Some(dargs.max_seqs().max(biggest));
    progress.line(&format!("loading {} ...", dir.display()));
    let loaded = backend::open(&dir, &dargs, Some(&args.run.decode), needs)?;
    let prompt = tokens(args.prompt_len, config.vocab_size, PROMPT_SEED);
    errln!(
        "model: {} | {} | prompt {} tokens | {} form | {} repeats",
        config.summary(),
        loaded.device,
        prompt.len(),
        loaded.form,
        args.repeats
    );
    let mut bench = Bench {
        args: &args,
        progress: &progress,
        loaded,
        steps,
        cpu: flags.device == Device::Cpu,
        copy_gbs,
    };
    let prefill = bench.prefill(&prompt)?;
    let mut rows = Vec::new();
    let mut verify_rows = Vec::new();
    let mut mtp_rows = Vec::new();
    for &b in &flags.batches {
        let (row, step_ms) = bench.decode(b)?;
        rows.push(row);
        let verifies = bench.verifies(b, step_ms)?;
        if args.mtp_draft {
            mtp_rows.push(bench.mtp_draft(b, &verifies)?);
        }
        verify_rows.extend(verifies);
    }
    let mut result = bench.report(&config, &prompt, &prefill, &rows, &verify_rows)?;
    if args.mtp_draft {
        for r in &mtp_rows {
            outln!(
                "| MTP draft, T = {}, batch {} | {:.3} ms on the device ({:.3}× the verify step of {:.2} ms); {:.2} \
                 ms per step with it, {:.2} drafts accepted |",
                r["window"],
                r["batch"],
                r["draft_ms_median"].as_f64().unwrap_or(f64::NAN),
                r["draft_vs_verify"].as_f64().unwrap_or(f64::NAN),
                r["verify_ms"].as_f64().unwrap_or(f64::NAN),
                r["step_ms_median"].as_f64().unwrap_or(f64::NAN),
                r["accepted_per_step"].as_f64().unwrap_or(f64::NAN)
            )?;
        }
        result["mtp_draft"] = json!(mtp_rows);
    }
    if let Some(path) = &args.write_step_profile {
        let context = bench_steps::mean_context(args.step_prompt, args.decode_tokens, 1);
        let profile = bench_steps::step_profile(&rows, &verify_rows, &bench.loaded, context)?;
        profile.save(path)?;
        errln!(
            "step profile: {} points written to {} (for --spec-policy adaptive --spec-profile {})",
            profile.points.len(),
            path.display(),
            path.display()
        );
    }
    if let Some((n, m)) = flags.serving {
        // The batched-step group is dropped first: the engine loads its own ranks.
        drop(bench);
        result["serving"] = super::serve_bench::run(&args, &dir, n, m, &progress)?;
    }
    write_json(&args, &result)
}

/// What the flags ask for, checked before any model is built or loaded.
struct Flags {
    device: Device,
    batches: Vec<usize>,
    /// `--concurrency` and `--requests`: the serving pass.
    serving: Option<(usize, usize)>,
}

impl Flags {
    fn check(args: &BenchArgs) -> Result<Flags> {
        anyhow::ensure!(args.repeats > 0, "--repeats must be at least 1");
        anyhow::ensure!(args.prompt_len > 1, "--prompt-len must be at least 2");
        anyhow::ensure!(args.decode_tokens > 0, "--decode-tokens must be at least 1");
        anyhow::ensure!(args.step_prompt > 0, "--step-prompt must be at least 1");
        if let Some(path) = &args.json {
            check_writable(path, "--json")?;
        }
        if let Some(path) = &args.write_step_profile {
            anyhow::ensure!(
                !args.serving_only,
                "--write-step-profile writes the batched-step measures, which --serving-only skips"
            );
            check_writable(path, "--write-step-profile")?;
        }
        // Speculation is measured through the serving engine; the batched-step measures would silently ignore it.
        anyhow::ensure!(
            args.concurrency.is_some() || super::spec::config(&args.run.spec, &args.run.decode)?.is_none(),
            "--spec {} needs --concurrency N: speculative decoding is measured through the serving engine, plain and \
             speculative passes side by side (the batched-step measures time verify steps with --verify-window T)",
            args.run.spec.spec
        );
        let device = args.run.device.check()?;
        anyhow::ensure!(
            !args.mtp_draft || device != Device::Cpu,
            "--mtp-draft times the MTP layer on GPU ranks with CUDA events: add --device cuda"
        );
        let batches = args
            .batch
            .clone()
            .unwrap_or_else(|| if device == Device::Cpu { vec![1] } else { vec![1, 64] });
        anyhow::ensure!(batches.iter().all(|&b| b > 0), "--batch sizes must be positive");
        let serving = match (args.concurrency, args.requests) {
            (Some(n), m) => {
                anyhow::ensure!(n > 0, "--concurrency must be at least 1");
                anyhow::ensure!(m != Some(0), "--requests must be at least 1");
                Some((n, m.unwrap_or(4 * n)))
            }
            (None, _) => None,
        };
        super::serve_bench::check_flags(args)?;
        Ok(Flags {
            device,
            batches,
            serving,
        })
    }

    /// The checks that need the model's config, before anything is allocated for the prompt.
    fn check_model(&self, args: &BenchArgs, config: &rewind_engine::model::ModelConfig) -> Result<()> {
        check_context(args, config.max_position_embeddings)?;
        let ratio = args.random_range_ratio;
        if self.serving.is_some() && ratio > 0.0 {
            let (p, d) = super::serve_bench::longest(args.prompt_len, args.decode_tokens, ratio);
            let limit = config.max_position_embeddings;
            anyhow::ensure!(
                p.saturating_add(d) <= limit,
                "with --random-range-ratio {ratio} the longest request is {p} + {d} tokens, more than the model's \
                 context limit of {limit} tokens (max_position_embeddings); lower --prompt-len, --decode-tokens or \
                 the ratio"
            );
        }
        Ok(())
    }
}

/// The shape of the batched-step measures: the verify window, the chains of `--decode-steps` and the verifies each
/// run makes.
struct Steps {
    window: usize,
    chain: usize,
    verify_steps: usize,
    verify_context: usize,
}

impl Steps {
    fn check(args: &BenchArgs, config: &rewind_engine::model::ModelConfig) -> Result<Steps> {
        let window = args.verify_window.unwrap_or(0);
        // `--decode-steps N`: the decode rows are measured again in chains of N steps.
        let chain = args.run.engine.decode_steps;
        anyhow::ensure!(
            (1..=rewind_engine::rank::MAX_CHAINED + 1).contains(&chain),
            "--decode-steps must be 1 to {}, got {chain}",
            rewind_engine::rank::MAX_CHAINED + 1
        );
        anyhow::ensure!(args.verify_window != Some(0), "--verify-window must be at least 1");
        let verify_steps = (args.decode_tokens / (window + 1)).max(4);
        let verify_context = args.step_prompt
            + ((3 + verify_steps) * (window + 1)).max(super::bench_spec_chain::context_needed(
                window,
                chain,
                verify_steps,
            ));
        anyhow::ensure!(
            window == 0 || verify_context <= config.max_position_embeddings,
            "--verify-window {window}: {verify_steps} verify steps reach {verify_context} tokens, beyond the model's \
             context limit of {} (max_position_embeddings)",
            config.max_position_embeddings
        );
        Ok(Steps {
            window,
            chain,
            verify_steps,
            verify_context,
        })
    }
}

/// The prefill's timed runs: chunked, and on the CPU token by token with the last logits' largest difference.
struct PrefillRuns {
    chunked: Vec<f64>,
    stepwise: Vec<f64>,
    max_rel_diff: f64,
}

/// The batched-step measures over one loaded model.
struct Bench<'a> {
    args: &'a BenchArgs,
    progress: &'a Progress,
    loaded: Loaded,
    steps: Steps,
    cpu: bool,
    /// The device's copy bandwidth (GB/s), the roofline's reference; `None` on the CPU.
    copy_gbs: Option<f64>,
}

impl Bench<'_> {
    /// The prompt's prefill after an untimed warm-up (caches, allocators and, on a GPU, cuBLAS's heuristics); on the
    /// CPU also token by token, with the difference of the last logits.
    fn prefill(&mut self, prompt: &[u32]) -> Result<PrefillRuns> {
        let (args, progress, cpu) = (self.args, self.progress, self.cpu);
        let n = prompt.len();
        let rate = |(secs, _): &(f64, Vec<f32>), _| format!("{secs:.3} s ({:.0} tok/s)", n as f64 / secs);
        progress.timed(
            &format!("prefill {n} tokens, warm-up (untimed)"),
            || prefill(&mut self.loaded, prompt, false),
            rate,
        )?;
        let mut runs = PrefillRuns {
            chunked: Vec::new(),
            stepwise: Vec::new(),
            max_rel_diff: 0.0,
        };
        for r in 1..=args.repeats {
            let how = if cpu { " (chunked)" } else { "" };
            let (c, a) = progress.timed(
                &format!("prefill {n} tokens{how}, repeat {r}/{}", args.repeats),
                || prefill(&mut self.loaded, prompt, false),
                rate,
            )?;
            runs.chunked.push(c);
            if cpu {
                let (s, b) = progress.timed(
                    &format!("prefill {n} tokens (token by token), repeat {r}/{}", args.repeats),
                    || prefill(&mut self.loaded, prompt, true),
                    rate,
                )?;
                runs.stepwise.push(s);
                let num: f64 = a.iter().zip(&b).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
                let den: f64 = b.iter().map(|q| (*q as f64).powi(2)).sum();
                runs.max_rel_diff = runs.max_rel_diff.max((num / den.max(1e-30)).sqrt());
            }
        }
        Ok(runs)
    }

    /// Batch `b`'s decode row (and, with `--decode-steps`, the same decode in chains), with its median step time.
    fn decode(&mut self, b: usize) -> Result<(serde_json::Value, f64)> {
        let (args, progress, chain) = (self.args, self.progress, self.steps.chain);
        // Run 0 is an untimed warm-up: it meets every step shape the timed runs meet (the replay ring's fills), so
        // the CUDA graphs are captured there and not inside a timed run.
        let mut runs = (0..=args.repeats)
            .map(|rep| {
                progress.timed(
                    &format!(
                        "decode batch {b}, {} tokens each, {}",
                        args.decode_tokens,
                        run_label(rep, args.repeats)
                    ),
                    || {
                        let (p, n) = (args.step_prompt, args.decode_tokens);
                        decode_rate(&mut self.loaded.group, self.loaded.form, b, p, n, 1, 7919 * rep as u64)
                    },
                    |(rate, _), secs| format!("{secs:.3} s ({rate:.1} tok/s)"),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        runs.remove(0);
        let rates: Vec<f64> = runs.iter().map(|r| r.0).collect();
        let m = median(rates.clone());
        let step_ms = 1e3 * b as f64 / m;
        errln!("decode batch {b}: {m:.1} tok/s median ({step_ms:.2} ms per step)");
        let mut row = json!({
            "batch": b,
            "decode_tok_per_s": rates,
            "decode_tok_per_s_median": m,
            "step_ms_median": step_ms,
        });
        report_stages(
            &mut row,
            &format!("decode batch {b}"),
            sum_stages(runs.iter().map(|r| r.1.as_ref())),
            step_ms,
        );
        let context = bench_steps::mean_context(args.step_prompt, args.decode_tokens, 1);
        bench_steps::roofline(&mut row, &self.loaded, args, self.copy_gbs, b, context, 0, 0, step_ms)?;
        if chain > 1 {
            // The same decode in chains of `--decode-steps` steps, side by side with the single steps above.
            let mut rates = (0..=args.repeats)
                .map(|rep| {
                    progress.timed(
                        &format!(
                            "decode batch {b}, chains of {chain} steps, {}",
                            run_label(rep, args.repeats)
                        ),
                        || {
                            let (p, n) = (args.step_prompt, args.decode_tokens);
                            decode_rate(
                                &mut self.loaded.group,
                                self.loaded.form,
                                b,
                                p,
                                n,
                                chain,
                                7919 * rep as u64,
                            )
                            .map(|(rate, _)| rate)
                        },
                        |rate, secs| format!("{secs:.3} s ({rate:.1} tok/s)"),
                    )
                })
                .collect::<Result<Vec<f64>>>()?;
            rates.remove(0);
            let cm = median(rates.clone());
            let chained_ms = 1e3 * b as f64 / cm;
            errln!(
                "decode batch {b}, chains of {chain}: {cm:.1} tok/s median ({chained_ms:.3} ms per step, {:.3}× the \
                 single steps' time)",
                chained_ms / step_ms
            );
            row["chain_steps"] = json!(chain);
            row["chained_tok_per_s"] = json!(rates);
            row["chained_step_ms_median"] = json!(chained_ms);
            row["chained_vs_single_step"] = json!(chained_ms / step_ms);
        }
        Ok((row, step_ms))
    }

    /// Batch `b`'s verify rows, one per kept count `0 ..= T` (none without `--verify-window`), each against the
    /// decode step's `step_ms`.
    fn verifies(&mut self, b: usize, step_ms: f64) -> Result<Vec<serde_json::Value>> {
        let (args, progress) = (self.args, self.progress);
        let Steps {
            window,
            chain,
            verify_steps,
            ..
        } = self.steps;
        let mut rows = Vec::new();
        for k in (0..=window).filter(|_| window > 0) {
            let mut runs = (0..=args.repeats)
                .map(|rep| {
                    progress.timed(
                        &format!(
                            "verify batch {b}, T = {window}, {k} kept, {}",
                            run_label(rep, args.repeats)
                        ),
                        || {
                            let shape = bench_steps::StepShape {
                                batch: b,
                                prompt: args.step_prompt,
                                window,
                                accepted: k,
                                chain: 1,
                            };
                            bench_steps::step_secs(
                                &mut self.loaded.group,
                                self.loaded.form,
                                shape,
                                verify_steps,
                                7919 * rep as u64,
                            )
                        },
                        |(s, _), _| format!("{:.2} ms per step", 1e3 * s),
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            runs.remove(0);
            let secs: Vec<f64> = runs.iter().map(|r| r.0).collect();
            let ms = 1e3 * median(secs.clone());
            let mut v = json!({
                "batch": b,
                "window": window,
                "kept_drafts": k,
                "step_ms": secs.iter().map(|s| 1e3 * s).collect::<Vec<_>>(),
                "step_ms_median": ms,
                "tokens_per_s": (b * (k + 1)) as f64 / ms * 1e3,
                "vs_decode_step": ms / step_ms,
                "speedup_over_decode": (k + 1) as f64 * step_ms / ms,
            });
            report_stages(
                &mut v,
                &format!("verify batch {b}, T = {window}, {k} kept"),
                sum_stages(runs.iter().map(|r| r.1.as_ref())),
                ms,
            );
            let context = bench_steps::mean_context(args.step_prompt, verify_steps * (k + 1), k + 1);
            bench_steps::roofline(&mut v, &self.loaded, args, self.copy_gbs, b, context, window, k, ms)?;
            if chain > 1 {
                // The same verifies in chains of `--decode-steps` steps, side by side with the single steps above.
                let shape = bench_steps::StepShape {
                    batch: b,
                    prompt: args.step_prompt,
                    window,
                    accepted: k,
                    chain,
                };
                super::bench_spec_chain::measure(
                    &mut v,
                    &mut self.loaded,
                    progress,
                    shape,
                    verify_steps,
                    args.repeats,
                    ms,
                )?;
            }
            rows.push(v);
        }
        Ok(rows)
    }

    /// Batch `b`'s MTP drafting row (`--mtp-draft`, `bench_mtp.rs`): the device time of a step's MTP work (median
    /// over the repeats) against the verify step of the same window (the mean of `verifies`' medians over their kept
    /// counts, as the step profile takes it).
    fn mtp_draft(&mut self, b: usize, verifies: &[serde_json::Value]) -> Result<serde_json::Value> {
        let (args, progress) = (self.args, self.progress);
        let Steps {
            window, verify_steps, ..
        } = self.steps;
        let mut runs = (0..=args.repeats)
            .map(|rep| {
                progress.timed(
                    &format!("MTP draft batch {b}, T = {window}, {}", run_label(rep, args.repeats)),
                    || {
                        super::bench_mtp::measure(
                            &mut self.loaded.group,
                            self.loaded.form,
                            b,
                            args.step_prompt,
                            window,
                            verify_steps,
                            7919 * rep as u64,
                        )
                    },
                    |c, _| format!("{:.3} ms drafting, {:.2} ms per step", c.draft_ms, c.step_ms),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        runs.remove(0);
        let verify: Vec<f64> = verifies.iter().filter_map(|v| v["step_ms_median"].as_f64()).collect();
        anyhow::ensure!(
            !verify.is_empty(),
            "no verify step of batch {b} to compare MTP drafting with"
        );
        let verify_ms = verify.iter().sum::<f64>() / verify.len() as f64;
        let draft: Vec<f64> = runs.iter().map(|c| c.draft_ms).collect();
        let step: Vec<f64> = runs.iter().map(|c| c.step_ms).collect();
        let draft_ms = median(draft.clone());
        let step_ms = median(step.clone());
        errln!(
            "MTP draft batch {b}, T = {window}: {draft_ms:.3} ms on the device, {:.3}× the verify step",
            draft_ms / verify_ms
        );
        Ok(json!({
            "batch": b,
            "window": window,
            "draft_ms": draft,
            "draft_ms_median": draft_ms,
            "verify_ms": verify_ms,
            "draft_vs_verify": draft_ms / verify_ms,
            "step_ms": step,
            "step_ms_median": step_ms,
            "added_ms": step_ms - verify_ms,
            "accepted_per_step": median(runs.iter().map(|c| c.accepted).collect()),
        }))
    }

    /// The table on stdout and the JSON result of the batched-step measures.
    fn report(
        &self,
        config: &rewind_engine::model::ModelConfig,
        prompt: &[u32],
        prefill: &PrefillRuns,
        rows: &[serde_json::Value],
        verify_rows: &[serde_json::Value],
    ) -> Result<serde_json::Value> {
        let (args, loaded) = (self.args, &self.loaded);
        let c = median(prefill.chunked.clone());
        outln!("| measure | value |")?;
        outln!("|---|---|")?;
        outln!("| cpu | {} |", cpu_model())?;
        outln!(
            "| prefill, chunked ({} tokens, one sequence) | {:.3} s ({:.0} tok/s) |",
            prompt.len(),
            c,
            prompt.len() as f64 / c
        )?;
        let mut result = header(args, config);
        let more = json!({
            "device": loaded.device,
            "tp": loaded.group.tp(),
            "prompt_tokens": prompt.len(),
            "prefill_s": prefill.chunked,
            "prefill_median_s": c,
            "prefill_tok_per_s": prompt.len() as f64 / c,
            "decode_tokens_per_sequence": args.decode_tokens,
            "decode_form": loaded.form.name(),
            "sampling": "greedy, each row's argmax from the ranks' summaries",
            "decode": rows,
        });
        for (k, v) in more.as_object().into_iter().flatten() {
            result[k] = v.clone();
        }
        if self.cpu {
            let s = median(prefill.stepwise.clone());
            outln!(
                "| prefill, token by token | {:.3} s ({:.0} tok/s) |",
                s,
                prompt.len() as f64 / s
            )?;
            outln!("| chunked speed-up | {:.1}× |", s / c)?;
            outln!(
                "| last-logit difference chunked vs token-by-token | {:.2e} (relative L2) |",
                prefill.max_rel_diff
            )?;
            result["prefill_token_by_token_s"] = json!(prefill.stepwise);
            result["prefill_token_by_token_median_s"] = json!(s);
            result["prefill_speedup"] = json!(s / c);
            result["chunked_vs_stepwise_rel_diff"] = json!(prefill.max_rel_diff);
        } else {
            result["dtype"] = json!(args.run.device.dtype);
            // How the decode and verify steps ran: replays of captured CUDA graphs, or eagerly (--no-cuda-graphs).
            let graphs = loaded.group.health()?.first().and_then(|h| h.graphs);
            if let Some(g) = graphs {
                outln!(
                    "| CUDA graphs | {} |",
                    if g.enabled {
                        format!(
                            "{} captured, {} replays, {} eager steps",
                            g.captured, g.replayed, g.eager
                        )
                    } else {
                        "off (every step launched eagerly)".to_string()
                    }
                )?;
            }
            result["cuda_graphs"] = json!(graphs);
        }
        for r in rows {
            outln!(
                "| decode, batch {} | {:.1} tok/s ({:.2} ms per step) |",
                r["batch"],
                r["decode_tok_per_s_median"].as_f64().unwrap_or(f64::NAN),
                r["step_ms_median"].as_f64().unwrap_or(f64::NAN)
            )?;
        }
        bench_steps::print_steps(rows, verify_rows)?;
        if let Some(gbs) = self.copy_gbs {
            result["copy_gb_s"] = json!(gbs);
        }
        if self.steps.window > 0 {
            result["verify"] = json!(verify_rows);
        }
        Ok(result)
    }
}

/// What every bench result records: the command, date, commit and model.
fn header(args: &BenchArgs, config: &rewind_engine::model::ModelConfig) -> serde_json::Value {
    json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "date_unix": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "commit": git_commit(),
        "model": config.summary(),
        "tp": args.run.device.tp,
        "cpu": cpu_model(),
    })
}

/// The CPU's model name, from `/proc/cpuinfo`, or `unknown`: CPU rates differ by 2× between machines, so a report
/// names the CPU it was measured on (the host's CPU also feeds a GPU run).
pub(super) fn cpu_model() -> String {
    cpu_model_in(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default())
}

/// The first `model name` of a `/proc/cpuinfo` text, or `unknown`.
fn cpu_model_in(cpuinfo: &str) -> String {
    cpuinfo
        .lines()
        .find_map(|l| {
            let (key, value) = l.split_once(':')?;
            (key.trim() == "model name").then(|| value.trim().to_string())
        })
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// Fails unless a file can be written at `path` (the value of `flag`): checked before a benchmark runs, so that a
/// bad path is not found out only after minutes of measuring. Nothing is left behind at `path`.
pub(super) fn check_writable(path: &std::path::Path, flag: &str) -> Result<()> {
    anyhow::ensure!(
        !path.is_dir(),
        "{flag} {} is a directory; give a file path",
        path.display()
    );
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    // A scratch file beside it proves the directory exists and takes new files.
    tempfile::NamedTempFile::new_in(dir)
        .map(drop)
        .with_context(|| format!("{flag} {}: cannot write in {}", path.display(), dir.display()))
}

fn write_json(args: &BenchArgs, result: &serde_json::Value) -> Result<()> {
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(result)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::cpu_model_in;

    #[test]
    fn the_cpu_model_is_the_first_model_name() {
        let info = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480C\n\n\
                    processor\t: 1\nmodel name\t: other\n";
        assert_eq!(cpu_model_in(info), "Intel(R) Xeon(R) Platinum 8480C");
        assert_eq!(cpu_model_in("processor : 0\nCPU part : 0xd0c\n"), "unknown");
        assert_eq!(cpu_model_in("model name :   \n"), "unknown");
        assert_eq!(cpu_model_in(""), "unknown");
    }
}
