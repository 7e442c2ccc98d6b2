//! `rewind bench`'s chained verify steps (`--verify-window T --decode-steps N`): greedy speculative decoding in
//! plans of `N` verify steps whose drafts, verdicts and commits stay on the ranks (`Program::VerifyChain`), at a
//! controlled acceptance.
//!
//! The drafts come from a table by stream position (the oracle drafter on the ranks): each sequence's greedy
//! continuation, decoded first, with the position after every `k` kept drafts corrupted, so that each verify keeps
//! `k` drafts and commits `k + 1` tokens, as the single verify steps of the same row do (`bench_steps::step_secs`,
//! which forces the count instead). Where the batched verify's argmax differs from the decode's on a near tie, a step
//! keeps a different count; the measured mean is reported next to the time.

use std::time::Instant;

use anyhow::Result;
use rewind_engine::decode::FormChoice;
use rewind_engine::rank::{
    ChainDrafter, ChainedDecode, ChainedVerify, Commit, RankGroup, StepPlan, VerifyChain, MAX_CHAINED,
};

use serde_json::{json, Value};

use super::backend::Loaded;
use super::bench::{median, run_label, tokens, Progress};
use super::bench_steps::{open_batch, StepShape};

/// Tokens a measure of `steps` timed verifies of `window` drafts in plans of `chain` needs past the prompt (one
/// untimed warm-up plan first, and a window of slack); none when `chain` < 2 (no chained measure runs).
pub(super) fn context_needed(window: usize, chain: usize, steps: usize) -> usize {
    if chain < 2 {
        return 0;
    }
    (chain + steps.next_multiple_of(chain) + 1) * (window + 1) + 1
}

/// The greedy continuation of each sequence of `seqs` (slot, position, next token), `n` tokens from the next token
/// on, decoded in chained plans; releases the slots.
fn continuations(
    group: &mut RankGroup,
    form: FormChoice,
    seqs: &[(usize, usize, u32)],
    n: usize,
) -> Result<Vec<Vec<u32>>> {
    let mut out: Vec<Vec<u32>> = seqs.iter().map(|s| vec![s.2]).collect();
    while out[0].len() < n {
        let chain = (n - out[0].len()).min(MAX_CHAINED + 1);
        let decodes: Vec<ChainedDecode> = seqs
            .iter()
            .zip(&out)
            .map(|(s, c)| ChainedDecode {
                slot: s.0,
                position: s.1 + c.len() - 1,
                token: c[c.len() - 1],
                form,
                sample: None,
            })
            .collect();
        let plan = if chain > 1 {
            StepPlan::decode_chain(decodes, chain - 1)
        } else {
            StepPlan::batch(decodes.iter().map(|d| d.step(0, d.token)).collect())
        };
        let r = group.step(plan)?;
        for step in r.rows.chunks_exact(seqs.len()) {
            for (c, row) in out.iter_mut().zip(step) {
                c.push(row.argmax);
            }
        }
    }
    for s in seqs {
        group.release(s.0)?;
    }
    Ok(out)
}

/// One measure: seconds per verify step and the mean drafts kept per step, over `steps` timed verifies of `window`
/// drafts per sequence of a batch of `b` (prompts of `prompt` tokens), in plans of `chain` steps, each step keeping
/// `kept` drafts by the table's construction.
#[allow(clippy::too_many_arguments)]
pub(super) fn spec_chain_secs(
    group: &mut RankGroup,
    form: FormChoice,
    b: usize,
    prompt: usize,
    window: usize,
    kept: usize,
    chain: usize,
    steps: usize,
    seed: u64,
) -> Result<(f64, f64)> {
    anyhow::ensure!(kept <= window && chain >= 2, "kept {kept} of {window}, chain {chain}");
    let vocab = group.vocab_size();
    let plans = 1 + steps.div_ceil(chain);
    let reference = {
        let seqs = open_batch(group, form, b, prompt, seed)?;
        continuations(group, form, &seqs, plans * chain * (kept + 1) + window + 2)?
    };
    let seqs = open_batch(group, form, b, prompt, seed)?;
    // Stream position `prompt + j` holds `reference[j]`; the first verify's drafts start at `prompt + 1`.
    let tables: Vec<Vec<i32>> = reference
        .iter()
        .map(|r| {
            let mut t = vec![-1i32; prompt];
            t.extend(r.iter().enumerate().map(|(j, &x)| {
                let corrupt = kept < window && j >= 1 && (j - 1) % (kept + 1) == kept;
                if corrupt {
                    ((x as usize + 1) % vocab) as i32
                } else {
                    x as i32
                }
            }));
            t
        })
        .collect();
    let mut streams: Vec<Vec<u32>> = (0..b)
        .map(|i| {
            let mut s = tokens(prompt, vocab, 1000 + i as u64 + seed);
            s.push(seqs[i].2);
            s
        })
        .collect();
    let mut commits: Vec<Commit> = Vec::new();
    let (mut timed_steps, mut kept_total) = (0usize, 0usize);
    let mut t0 = Instant::now();
    for p in 0..plans {
        if p == 1 {
            group.synchronize()?;
            t0 = Instant::now();
        }
        let verifies: Vec<ChainedVerify> = seqs
            .iter()
            .zip(&streams)
            .zip(&tables)
            .map(|((s, stream), table)| {
                let mut t = vec![stream[stream.len() - 1]];
                t.extend(ChainDrafter::Table.draft(table, stream, window));
                ChainedVerify {
                    slot: s.0,
                    position: stream.len() - 1,
                    tokens: t,
                    form,
                    spec: None,
                    stream: stream.clone(),
                    table: table.clone(),
                }
            })
            .collect();
        let plan = StepPlan::verify_chain(VerifyChain {
            seqs: verifies,
            steps: chain - 1,
            drafter: ChainDrafter::Table,
        })
        .with_commits(std::mem::take(&mut commits));
        let out = group.step(plan)?;
        let log = out
            .chain
            .ok_or_else(|| anyhow::anyhow!("a chain of verifies answered without its log"))?;
        let ran = log.accepted.len() / b;
        for k in 0..ran {
            for q in 0..b {
                let i = k * b + q;
                let a = log.accepted[i];
                streams[q].extend_from_slice(&log.drafts[i * window..i * window + a]);
                streams[q].push(log.tokens[i]);
                if k + 1 == ran {
                    commits.push(Commit {
                        slot: seqs[q].0,
                        accepted: a + 1,
                    });
                }
                if p > 0 {
                    kept_total += a;
                }
            }
        }
        if p > 0 {
            timed_steps += ran;
        }
    }
    group.synchronize()?;
    let secs = t0.elapsed().as_secs_f64() / timed_steps.max(1) as f64;
    for s in &seqs {
        group.release(s.0)?;
    }
    Ok((secs, kept_total as f64 / (timed_steps * b).max(1) as f64))
}

/// Measures `shape`'s verifies in chains of `shape.chain` steps (the untimed warm-up run, then `repeats` timed ones)
/// and adds the medians to `row`, the verify row whose single steps took `single_ms`.
pub(super) fn measure(
    row: &mut Value,
    loaded: &mut Loaded,
    progress: &Progress,
    shape: StepShape,
    steps: usize,
    repeats: usize,
    single_ms: f64,
) -> Result<()> {
    let StepShape {
        batch: b,
        prompt,
        window,
        accepted: k,
        chain,
    } = shape;
    let runs = (0..=repeats)
        .map(|rep| {
            progress.timed(
                &format!(
                    "verify batch {b}, T = {window}, {k} kept, chains of {chain}, {}",
                    run_label(rep, repeats)
                ),
                || {
                    spec_chain_secs(
                        &mut loaded.group,
                        loaded.form,
                        b,
                        prompt,
                        window,
                        k,
                        chain,
                        steps,
                        7919 * rep as u64,
                    )
                },
                |(s, kept), _| format!("{:.2} ms per step, {kept:.2} kept", 1e3 * s),
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let timed = &runs[1..];
    let chained_ms = 1e3 * median(timed.iter().map(|r| r.0).collect());
    row["chain_steps"] = json!(chain);
    row["chained_step_ms"] = json!(timed.iter().map(|r| 1e3 * r.0).collect::<Vec<_>>());
    row["chained_step_ms_median"] = json!(chained_ms);
    row["chained_kept_mean"] = json!(timed.iter().map(|r| r.1).collect::<Vec<_>>());
    row["chained_vs_single_step"] = json!(chained_ms / single_ms);
    Ok(())
}
