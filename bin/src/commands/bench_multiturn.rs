//! `rewind bench multi-turn`: multi-turn chat through the serving engine, the workload automatic prefix caching is
//! for (`actors/src/coordinator/prefix/`). Every conversation resends its whole history each turn: a system prompt
//! all conversations share, a prefix of its own, then its user turns and the model's replies so far. Clients run
//! their conversations' turns one after another (a turn is sent when the previous reply is complete), so a turn's
//! prompt ends with the previous turn's whole sequence — what a chat client sends.
//!
//! The same workload runs with the cache off and then on, each pass in a fresh engine. Reported per pass: prompt
//! tokens sent and tokens prefilled (the engine's counter), time to first token (p50 / p99, and per turn), wall time
//! and output tokens/s; and whether every reply of the two passes is the same (greedy). Token ids are drawn
//! pseudo-randomly (random-weight models have no text), keyed by the conversation and turn, so a pass never depends
//! on the other.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use rewind_actors::{EngineHandle, Event, GenerateRequest, MetricsSnapshot};
use rewind_engine::sample::SamplingParams;
use serde_json::{json, Value};
use tokio::sync::Mutex;

use super::backend::{self, Needs};
use super::bench::{git_commit, median, tokens, Progress};
use crate::cli::BenchMultiTurnArgs;
use crate::output::{errln, outln};

/// An inclusive range of lengths, `N` or `LO-HI`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Span {
    lo: usize,
    hi: usize,
}

impl Span {
    fn parse(flag: &str, s: &str) -> Result<Span> {
        let parse = |x: &str| {
            x.trim()
                .parse::<usize>()
                .with_context(|| format!("{flag} {s}: expected N or LO-HI with whole numbers"))
        };
        let span = match s.split_once('-') {
            Some((lo, hi)) => Span {
                lo: parse(lo)?,
                hi: parse(hi)?,
            },
            None => {
                let n = parse(s)?;
                Span { lo: n, hi: n }
            }
        };
        anyhow::ensure!(
            span.lo >= 1 && span.lo <= span.hi,
            "{flag} {s}: the range must be at least 1 and LO ≤ HI"
        );
        Ok(span)
    }

    /// The length keyed by `key` (uniform in the range).
    fn draw(self, key: u64) -> usize {
        let r = rewind_kernels::cpu::lm_head::mix64(key);
        self.lo + (r % (self.hi - self.lo + 1) as u64) as usize
    }
}

/// The workload, fixed before anything runs.
#[derive(Clone, Debug)]
struct Workload {
    conversations: usize,
    clients: usize,
    turns: Span,
    system: usize,
    prefix: usize,
    user: Span,
    reply: Span,
}

impl Workload {
    fn check(args: &BenchMultiTurnArgs) -> Result<Workload> {
        anyhow::ensure!(args.conversations >= 1, "--conversations must be at least 1");
        anyhow::ensure!(args.clients >= 1, "--clients must be at least 1");
        Ok(Workload {
            conversations: args.conversations,
            clients: args.clients.min(args.conversations),
            turns: Span::parse("--turns", &args.turns)?,
            system: args.system,
            prefix: args.prefix,
            user: Span::parse("--user", &args.user)?,
            reply: Span::parse("--reply", &args.reply)?,
        })
    }

    fn turns_of(&self, c: usize) -> usize {
        self.turns
            .draw(0x7475_726e ^ (c as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }

    fn key(c: usize, t: usize, stream: u64) -> u64 {
        stream ^ ((c as u64) << 32 | t as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    /// The longest conversation any turn reaches.
    fn longest(&self) -> usize {
        self.system + self.prefix + self.turns.hi * (self.user.hi + self.reply.hi)
    }
}

/// One turn as a pass saw it.
#[derive(Clone, Debug)]
struct Turn {
    prompt: usize,
    ttft: f64,
    reply: Vec<u32>,
}

/// What one pass measured.
struct Pass {
    /// Per conversation, its turns in order.
    turns: Vec<Vec<Turn>>,
    wall: f64,
    before: MetricsSnapshot,
    after: MetricsSnapshot,
    device: String,
}

/// Runs one conversation's turns; the first failure ends it.
async fn conversation(engine: &EngineHandle, w: &Workload, c: usize, vocab: usize) -> Result<Vec<Turn>> {
    let mut history = tokens(w.system, vocab, 0x5959_7e77);
    history.extend(tokens(w.prefix, vocab, Workload::key(c, 0, 0x7072_6566)));
    let mut turns = Vec::new();
    for t in 0..w.turns_of(c) {
        let user = w.user.draw(Workload::key(c, t, 0x7573_6572));
        history.extend(tokens(user, vocab, Workload::key(c, t, 0x7573_6572_7478)));
        let reply = w.reply.draw(Workload::key(c, t, 0x7265_706c));
        let params = SamplingParams {
            max_tokens: Some(reply),
            ignore_eos: true,
            ..SamplingParams::greedy()
        };
        let submitted = Instant::now();
        let mut events = engine
            .submit(GenerateRequest::new(history.clone(), params))
            .with_context(|| format!("conversation {c}, turn {t}"))?;
        let (mut first, mut out) = (None, Vec::with_capacity(reply));
        while let Some(e) = events.next().await {
            match e {
                Event::Token { token, .. } => {
                    first.get_or_insert_with(|| submitted.elapsed().as_secs_f64());
                    out.push(token);
                }
                Event::PromptLogprobs { .. } => {}
                Event::Finished { .. } => break,
                Event::Failed { error, .. } => anyhow::bail!("conversation {c}, turn {t} failed: {error}"),
            }
        }
        turns.push(Turn {
            prompt: history.len(),
            ttft: first.unwrap_or(f64::NAN),
            reply: out.clone(),
        });
        history.extend(out);
    }
    Ok(turns)
}

/// One pass of the workload in a fresh engine, the prefix cache on or off.
fn pass(args: &BenchMultiTurnArgs, w: &Workload, cache: bool, progress: &Progress) -> Result<Pass> {
    let dir = super::generate::model_dir(&args.model)?;
    let needs = Needs {
        mtp: false,
        time_mtp: false,
        slots: w.clients,
        context: w.longest(),
        verify: 1,
        prefix_store: if cache {
            backend::prefix_store(&args.run.engine)?
        } else {
            0
        },
    };
    let mut dargs = args.run.device.clone();
    dargs.max_seqs = Some(dargs.max_seqs().max(w.clients));
    let b = backend::backend(&dir, &dargs, Some(&args.run.decode), needs)?;
    let mut config = backend::engine_config(&args.run.engine, b.form)?;
    config.prefix_cache = if cache {
        Some(backend::prefix_cache_config(&args.run.engine)?.context(
            "the cache-on pass needs the prefix cache: drop --no-enable-prefix-caching (or run --passes off)",
        )?)
    } else {
        None
    };
    config.eos_token_ids = Vec::new();
    let vocab = b.config.vocab_size;
    let label = if cache { "on" } else { "off" };
    backend::runtime()?.block_on(async {
        progress.line(&format!(
            "multi-turn, prefix cache {label}: loading {} ...",
            dir.display()
        ));
        let (engine, device) = backend::start_engine(&b, config).await?;
        let engine = Arc::new(engine);
        let before = engine.metrics().snapshot();
        let next = Arc::new(Mutex::new(0usize));
        let t0 = Instant::now();
        let clients: Vec<_> = (0..w.clients)
            .map(|_| {
                let (engine, next, w) = (engine.clone(), next.clone(), w.clone());
                tokio::spawn(async move {
                    let mut done = Vec::new();
                    loop {
                        let c = {
                            let mut n = next.lock().await;
                            let c = *n;
                            *n += 1;
                            c
                        };
                        if c >= w.conversations {
                            return anyhow::Ok(done);
                        }
                        done.push((c, conversation(&engine, &w, c, vocab).await?));
                    }
                })
            })
            .collect();
        let mut turns = vec![Vec::new(); w.conversations];
        for client in clients {
            for (c, t) in client.await.context("a client task panicked")?? {
                turns[c] = t;
            }
        }
        let wall = t0.elapsed().as_secs_f64();
        let after = engine.metrics().snapshot();
        progress.line(&format!("multi-turn, prefix cache {label}: {wall:.1} s"));
        if let Ok(engine) = Arc::try_unwrap(engine) {
            engine.shutdown().await;
        }
        anyhow::Ok(Pass {
            turns,
            wall,
            before,
            after,
            device,
        })
    })
}

/// The `q`-quantile of `xs` by the nearest rank.
fn quantile(mut xs: Vec<f64>, q: f64) -> f64 {
    xs.retain(|x| x.is_finite());
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    xs[((q * xs.len() as f64).ceil() as usize).clamp(1, xs.len()) - 1]
}

/// A pass's summary (and its table row).
fn summary(label: &str, p: &Pass) -> Value {
    let all: Vec<&Turn> = p.turns.iter().flatten().collect();
    let prompt: usize = all.iter().map(|t| t.prompt).sum();
    let generated: usize = all.iter().map(|t| t.reply.len()).sum();
    let prefilled = p.after.prefill_tokens - p.before.prefill_tokens;
    let hit = p.after.prefix_cache_hit_tokens - p.before.prefix_cache_hit_tokens;
    let ttft: Vec<f64> = all.iter().map(|t| t.ttft).collect();
    let (p50, p99) = (quantile(ttft.clone(), 0.5), quantile(ttft, 0.99));
    let turns = p.turns.iter().map(Vec::len).max().unwrap_or(0);
    let by_turn: Vec<Value> = (0..turns)
        .map(|k| {
            let xs: Vec<f64> = p.turns.iter().filter_map(|c| c.get(k)).map(|t| t.ttft).collect();
            json!({ "turn": k + 1, "requests": xs.len(), "ttft_ms_median": 1e3 * median(xs) })
        })
        .collect();
    let ratio = prefilled as f64 / prompt.max(1) as f64;
    errln!(
        "prefix cache {label}: {prefilled} of {prompt} prompt tokens prefilled ({ratio:.3}), {hit} restored; TTFT p50 \
         {:.1} ms p99 {:.1} ms; {:.1} s, {:.1} output tok/s",
        p50 * 1e3,
        p99 * 1e3,
        p.wall,
        generated as f64 / p.wall
    );
    json!({
        "prefix_cache": label,
        "device": p.device,
        "requests": all.len(),
        "prompt_tokens": prompt,
        "prefilled_tokens": prefilled,
        "prefilled_over_prompt": ratio,
        "cache_hit_tokens": hit,
        "cache_inserts": p.after.prefix_cache_inserts - p.before.prefix_cache_inserts,
        "cache_evictions": p.after.prefix_cache_evictions - p.before.prefix_cache_evictions,
        "output_tokens": generated,
        "wall_s": p.wall,
        "output_tok_per_s": generated as f64 / p.wall,
        "ttft_ms": { "p50": p50 * 1e3, "p99": p99 * 1e3 },
        "ttft_by_turn": by_turn,
    })
}

/// How many turns of the two passes replied alike, compared per conversation up to its first difference (after it
/// the two conversations' histories differ, so their later turns are different requests).
fn same_replies(off: &Pass, on: &Pass) -> (usize, usize, Option<(usize, usize)>) {
    let (mut same, mut total, mut first) = (0, 0, None);
    for (c, (a, b)) in off.turns.iter().zip(&on.turns).enumerate() {
        total += a.len();
        for (t, (x, y)) in a.iter().zip(b).enumerate() {
            if x.reply != y.reply {
                first.get_or_insert((c, t));
                break;
            }
            same += 1;
        }
    }
    (same, total, first)
}

/// Runs the benchmark; see the module docs.
pub fn run(args: BenchMultiTurnArgs) -> Result<()> {
    let w = Workload::check(&args)?;
    if let Some(path) = &args.json {
        super::bench::check_writable(path, "--json")?;
    }
    let progress = Progress::new();
    let modes: &[bool] = match args.passes.as_str() {
        "on" => &[true],
        "off" => &[false],
        _ => &[false, true],
    };
    let passes: Vec<(bool, Pass)> = modes
        .iter()
        .map(|&cache| pass(&args, &w, cache, &progress).map(|p| (cache, p)))
        .collect::<Result<_>>()?;
    let rows: Vec<Value> = passes
        .iter()
        .map(|(cache, p)| summary(if *cache { "on" } else { "off" }, p))
        .collect();
    outln!("| prefix cache | requests | prefilled / prompt tokens | TTFT p50 / p99 (ms) | output tok/s |")?;
    outln!("|---|---|---|---|---|")?;
    for r in &rows {
        outln!(
            "| {} | {} | {} / {} ({:.3}) | {:.1} / {:.1} | {:.1} |",
            r["prefix_cache"].as_str().unwrap_or("?"),
            r["requests"],
            r["prefilled_tokens"],
            r["prompt_tokens"],
            r["prefilled_over_prompt"].as_f64().unwrap_or(f64::NAN),
            r["ttft_ms"]["p50"].as_f64().unwrap_or(f64::NAN),
            r["ttft_ms"]["p99"].as_f64().unwrap_or(f64::NAN),
            r["output_tok_per_s"].as_f64().unwrap_or(f64::NAN)
        )?;
    }
    let mut result = json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "date_unix": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        "commit": git_commit(),
        "workload": {
            "conversations": w.conversations,
            "clients": w.clients,
            "turns": [w.turns.lo, w.turns.hi],
            "system_tokens": w.system,
            "prefix_tokens": w.prefix,
            "user_tokens": [w.user.lo, w.user.hi],
            "reply_tokens": [w.reply.lo, w.reply.hi],
        },
        "passes": rows,
    });
    if let [(false, off), (true, on)] = &passes[..] {
        let (same, total, first) = same_replies(off, on);
        let speedup = |q: &str| {
            result["passes"][0]["ttft_ms"][q].as_f64().unwrap_or(f64::NAN)
                / result["passes"][1]["ttft_ms"][q].as_f64().unwrap_or(f64::NAN)
        };
        let (s50, s99) = (speedup("p50"), speedup("p99"));
        outln!("| replies equal (off vs on) | {same} of {total} turns |")?;
        outln!("| TTFT off / on | p50 {s50:.2}×, p99 {s99:.2}× |")?;
        result["replies_equal"] = json!({ "turns": same, "of": total, "first_difference": first });
        result["ttft_off_over_on"] = json!({ "p50": s50, "p99": s99 });
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&result)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Span;

    #[test]
    fn spans_parse_single_values_and_ranges_and_refuse_the_rest() {
        assert_eq!(Span::parse("--turns", "8-12").unwrap(), Span { lo: 8, hi: 12 });
        assert_eq!(Span::parse("--turns", "3").unwrap(), Span { lo: 3, hi: 3 });
        for bad in ["0", "12-8", "a-3", "", "3-"] {
            let e = Span::parse("--turns", bad).unwrap_err().to_string();
            assert!(e.contains("--turns"), "{bad}: {e}");
        }
        let s = Span { lo: 80, hi: 120 };
        assert!((0..200).all(|k| (80..=120).contains(&s.draw(k))));
    }
}
