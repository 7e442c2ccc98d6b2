//! Chained verifies ([`Program::VerifyChain`]) checked against the same verifies run one plan at a time, on any
//! [`RankGroup`] (the GPU self-test runs it on the device, the tests on CPU ranks).
//!
//! After each prompt, speculative decoding runs twice: once step by step (the host drafts with the chain's own rule,
//! judges each verify from its rows and commits it in the next plan) and once in chains whose drafts, verdicts and
//! commits never leave the ranks. Judging is greedy, or sampled at a temperature from the rows' one-pass summaries
//! (each sequence with its own seed), so the ranks' own keying of every later step's noise is checked too. Every step
//! must verify the same drafts, reach the same verdict and report the same rows (max logit and log-sum-exp to
//! `tolerance`). Two drafters run: the n-gram drafter, then a table by position holding the continuation the first
//! run found with a quarter of its tokens corrupted (the oracle benchmarking drafter), so that windows are accepted
//! whole, in part and not at all, and the rings cross flushes.

use serde::Serialize;

use super::group::RankGroup;
use super::plan::{Batch, ChainedVerify, Commit, Program, Rows, SeqKind, SeqStep, SpecSample, StepPlan, VerifyChain};
use super::spec_chain::ChainDrafter;
use super::StepResult;
use crate::decode::FormChoice;
use crate::error::{EngineError, Result};
use crate::spec::accept::accept_summaries;
use rewind_kernels::cpu::lm_head::mix64;

/// The outcome of a chain-of-verifies check.
#[derive(Clone, Debug, Serialize)]
pub struct SpecChainReport {
    pub form: String,
    /// The sampling temperature (`None`: greedy judging).
    pub temperature: Option<f32>,
    pub sequences: usize,
    pub tp: usize,
    /// Drafts per verify (`T`), steps per chain (`1 + chained`) and chains per drafter.
    pub window: usize,
    pub chain_steps: usize,
    pub chains: usize,
    /// Verify steps compared over both drafters, and the drafts they accepted.
    pub steps: usize,
    pub accepted: usize,
    /// Steps whose drafts or verdict differ between the chain and single steps (must be 0).
    pub mismatches: usize,
    /// Worst relative difference of a row's max logit or log-sum-exp.
    pub worst_rel: f64,
    pub tolerance: f64,
    pub pass: bool,
    /// The first step that differs, described (drafter, sequence, step, both sides).
    pub first_mismatch: Option<String>,
}

/// One verify step of one sequence as both paths see it.
#[derive(Clone, Debug, PartialEq)]
struct Verified {
    drafts: Vec<u32>,
    accepted: usize,
    token: u32,
    /// Per row: max logit and log-sum-exp.
    rows: Vec<(f32, f32)>,
}

fn row_values(out: &StepResult, from: usize, n: usize) -> Vec<(f32, f32)> {
    out.rows[from..from + n].iter().map(|r| (r.max, r.lse)).collect()
}

/// Runs `steps` verifies of `window` drafts after each prompt, `chain` steps a plan (1: single steps, the host
/// drafting and judging), judged greedily or at `temperature`. Returns per sequence its verified steps.
#[allow(clippy::too_many_arguments)]
fn speculate(
    group: &mut RankGroup,
    prompts: &[Vec<u32>],
    form: FormChoice,
    drafter: ChainDrafter,
    tables: &[Vec<i32>],
    window: usize,
    steps: usize,
    chain: usize,
    temperature: Option<f32>,
) -> Result<Vec<Vec<Verified>>> {
    let (slots, first) = group.prefill_prompts(prompts, form)?;
    let mut streams: Vec<Vec<u32>> = prompts
        .iter()
        .zip(first)
        .map(|(p, x)| p.iter().copied().chain([x]).collect())
        .collect();
    let n = slots.len();
    let t = window + 1;
    let mut done: Vec<Vec<Verified>> = vec![Vec::new(); n];
    let mut commits: Vec<Commit> = Vec::new();
    let mut ran = 0;
    while ran < steps {
        let chain = chain.min(steps - ran);
        let seqs: Vec<SeqStep> = (0..n)
            .map(|q| {
                let stream = &streams[q];
                let mut tokens = vec![stream[stream.len() - 1]];
                tokens.extend(drafter.draft(tables.get(q).map_or(&[][..], Vec::as_slice), stream, window));
                SeqStep {
                    slot: slots[q],
                    kind: SeqKind::Verify,
                    position: stream.len() - 1,
                    tokens,
                    form,
                    rows: Rows::All,
                    sample: None,
                    // Row 0 predicts the output token after the `stream.len() − prompt` generated so far.
                    spec: temperature.map(|temperature| SpecSample {
                        temperature,
                        seed: mix64(0x5eed ^ q as u64),
                        index: (stream.len() - prompts[q].len()) as u64,
                    }),
                    logprobs: None,
                }
            })
            .collect();
        let program = if chain > 1 {
            Program::VerifyChain(VerifyChain {
                seqs: seqs
                    .iter()
                    .enumerate()
                    .map(|(q, s)| ChainedVerify {
                        slot: s.slot,
                        position: s.position,
                        tokens: s.tokens.clone(),
                        form: s.form,
                        spec: s.spec,
                        stream: streams[q].clone(),
                        table: tables.get(q).cloned().unwrap_or_default(),
                    })
                    .collect(),
                steps: chain - 1,
                drafter,
            })
        } else {
            Program::Batch(Batch {
                seqs: seqs.clone(),
                ..Batch::default()
            })
        };
        let plan = StepPlan {
            commits: std::mem::take(&mut commits),
            program,
        };
        let out = group.step(plan)?;
        let per_step = n * t;
        // A rank may end a chain early; its log says how many steps ran.
        let chain = out.chain.as_ref().map_or(1, |log| log.accepted.len() / n);
        ran += chain;
        for k in 0..chain {
            for q in 0..n {
                let from = k * per_step + q * t;
                let rows = row_values(&out, from, t);
                let (drafts, accepted, token) = match &out.chain {
                    Some(log) => {
                        let i = k * n + q;
                        (
                            log.drafts[i * window..(i + 1) * window].to_vec(),
                            log.accepted[i],
                            log.tokens[i],
                        )
                    }
                    None => {
                        let drafts = seqs[q].tokens[1..].to_vec();
                        let key = seqs[q].spec.map(|sp| (sp.seed, sp.index));
                        let v = accept_summaries(&out.rows[from..from + t], &drafts, key)?;
                        (drafts, v.accepted, v.token)
                    }
                };
                streams[q].extend_from_slice(&drafts[..accepted]);
                streams[q].push(token);
                if k + 1 == chain {
                    commits.push(Commit {
                        slot: slots[q],
                        accepted: accepted + 1,
                    });
                }
                done[q].push(Verified {
                    drafts,
                    accepted,
                    token,
                    rows,
                });
            }
        }
    }
    for slot in slots {
        group.release(slot)?;
    }
    Ok(done)
}

/// Runs the check on `group` in `form`: `chains` chains of `1 + chained` verifies of `window` drafts after each
/// prompt, with each drafter, against single steps; judged greedily, or sampled at `temperature`.
#[allow(clippy::too_many_arguments)]
pub fn spec_chain_check(
    group: &mut RankGroup,
    prompts: &[Vec<u32>],
    form: FormChoice,
    window: usize,
    chained: usize,
    chains: usize,
    temperature: Option<f32>,
    tolerance: f64,
) -> Result<SpecChainReport> {
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) || window == 0 || chained == 0 || chains == 0 {
        return Err(EngineError::InvalidInput(
            "the chain-of-verifies check needs non-empty prompts, a window and at least one chain of two steps".into(),
        ));
    }
    let steps = chains * (chained + 1);
    let vocab = group.vocab_size() as u64;
    let (mut compared, mut accepted, mut mismatches, mut worst) = (0, 0, 0, 0.0f64);
    let mut tables: Vec<Vec<i32>> = Vec::new();
    let mut first_mismatch = None;
    for drafter in [ChainDrafter::Ngram { min_n: 1, max_n: 3 }, ChainDrafter::Table] {
        let run = |group: &mut RankGroup, chain| {
            speculate(
                group,
                prompts,
                form,
                drafter,
                &tables,
                window,
                steps,
                chain,
                temperature,
            )
        };
        let single = run(group, 1)?;
        let chain = run(group, chained + 1)?;
        for (q, (sa, sb)) in single.iter().zip(&chain).enumerate() {
            for (i, (a, b)) in sa.iter().zip(sb).enumerate() {
                let differs = (&a.drafts, a.accepted, a.token) != (&b.drafts, b.accepted, b.token);
                let rows_differ = a.rows != b.rows;
                if (differs || rows_differ) && first_mismatch.is_none() {
                    first_mismatch = Some(format!(
                        "{drafter:?}, sequence {q}, step {i}: single steps {a:?}, chain {b:?}"
                    ));
                }
            }
        }
        for (a, b) in single.iter().flatten().zip(chain.iter().flatten()) {
            compared += 1;
            accepted += a.accepted;
            mismatches += usize::from((&a.drafts, a.accepted, a.token) != (&b.drafts, b.accepted, b.token));
            for (x, y) in a.rows.iter().zip(&b.rows) {
                for (u, v) in [(x.0, y.0), (x.1, y.1)] {
                    let e = f64::from((u - v).abs()) / f64::from(u.abs()).max(1.0);
                    worst = if e.is_nan() || !v.is_finite() {
                        f64::INFINITY
                    } else {
                        worst.max(e)
                    };
                }
            }
        }
        mismatches += usize::from(single.iter().flatten().count() != chain.iter().flatten().count());
        // The table drafter's proposals: the continuation this run found, a quarter of it corrupted.
        tables = prompts
            .iter()
            .zip(&single)
            .enumerate()
            .map(|(q, (p, steps))| {
                let mut table = vec![-1i32; p.len() + 1];
                for s in steps {
                    table.extend(s.drafts[..s.accepted].iter().map(|&x| x as i32));
                    table.push(s.token as i32);
                }
                for (pos, x) in table.iter_mut().enumerate().skip(p.len() + 1) {
                    let key = mix64(0x7ab1e ^ ((q as u64) << 32) ^ pos as u64);
                    if key.is_multiple_of(4) {
                        *x = ((*x as u64 + 1 + mix64(key) % (vocab - 1)) % vocab) as i32;
                    }
                }
                table
            })
            .collect();
    }
    Ok(SpecChainReport {
        form: form.name().to_string(),
        temperature,
        sequences: prompts.len(),
        tp: group.tp(),
        window,
        chain_steps: chained + 1,
        chains,
        steps: compared,
        accepted,
        mismatches,
        worst_rel: worst,
        tolerance,
        pass: mismatches == 0 && worst <= tolerance && compared == 2 * steps * prompts.len(),
        first_mismatch,
    })
}
