//! The GPU's log-probabilities (`gpu/head.rs`: top lists folded in the head pass, the sampled token's raw logit)
//! checked against a full softmax of the GPU's own whole logit rows, as `rewind logits` returns them. Two rank
//! groups run the same prompts and the same teacher tokens: one reports whole rows (the reference), the other asks
//! for log-probabilities only — every prompt row with its next prompt token as the target (`echo` scoring), then a
//! decode row per step with top lists of 0, 1, 5 and 20 entries, half the sequences sampling (through a repetition
//! penalty, which rewrites the sampler's logits, so the sampled token's value must still be the raw one). Its last
//! step also asks for whole rows, so the top lists are folded over the head's whole rows there as well.

use std::path::Path;

use serde::Serialize;

use super::{gpu_group, GpuOptions};
use crate::decode::FormChoice;
use crate::error::{EngineError, Result};
use crate::model::ModelConfig;
use crate::rank::{Batch, LogprobRows, Program, RowPass, Rows, SampleRow, SeqKind, SeqStep, StepPlan, StepResult};
use rewind_kernels::cpu::lm_head::MAX_TOP;

/// The outcome of the log-probability check.
#[derive(Clone, Debug, Serialize)]
pub struct LogprobReport {
    pub form: String,
    pub dtype: String,
    /// Rows whose log-probabilities were compared (prompt rows and decode rows).
    pub rows: usize,
    /// Of them, rows whose value is a sampled token's.
    pub sampled_rows: usize,
    /// Worst `|Δ|` of a log-probability (top entries, targets, sampled tokens) against the reference's softmax.
    pub worst_abs: f64,
    /// Rows whose top list is not a top-k of the reference row (beyond ties within the tolerance).
    pub wrong_tops: usize,
    pub tolerance: f64,
    pub pass: bool,
}

/// Top-list sizes the decode rows cycle through.
const TOPS: [usize; 4] = [0, 1, 5, MAX_TOP];

/// Runs the check for the checkpoint in `dir` on `prompts` (decoded together), `steps` decode steps each, the GPU
/// decoding in `form`.
pub fn logprobs_forced(
    dir: &Path,
    prompts: &[Vec<u32>],
    steps: usize,
    opts: &GpuOptions,
    form: FormChoice,
    tolerance: f64,
) -> Result<LogprobReport> {
    if prompts.is_empty() || prompts.iter().any(|p| p.len() < 2) || steps == 0 {
        return Err(EngineError::InvalidInput(
            "the log-probability check needs prompts of two tokens or more and at least one step".into(),
        ));
    }
    let vocab = ModelConfig::from_dir(dir)?.vocab_size;
    let (mut reference, _) = gpu_group(dir, opts)?;
    let (mut asked, _) = gpu_group(dir, opts)?;
    let mut tally = Tally::default();
    let mut slots = Vec::with_capacity(prompts.len());
    let mut next = Vec::with_capacity(prompts.len());
    for (k, p) in prompts.iter().enumerate() {
        let slot = reference.open(form)?;
        if asked.open(form)? != slot {
            return Err(EngineError::InvalidInput(
                "the two groups opened different slots".into(),
            ));
        }
        let prefill = |logprobs: bool| SeqStep {
            slot,
            kind: SeqKind::Prefill,
            position: 0,
            tokens: p.clone(),
            form,
            rows: Rows::All,
            sample: (logprobs && k % 2 == 1).then(|| sampled_row(p, k)),
            spec: None,
            logprobs: logprobs.then(|| LogprobRows {
                top: MAX_TOP,
                targets: (1..=p.len()).map(|i| p.get(i).copied()).collect(),
            }),
        };
        let full = reference.step(batch(vec![prefill(false)], true))?;
        let got = asked.step(batch(vec![prefill(true)], false))?;
        let rows = full.logits.as_deref().unwrap_or_default();
        for (i, row) in rows.chunks_exact(vocab).enumerate() {
            tally.row(&got, i, row, p.get(i + 1).copied(), MAX_TOP)?;
        }
        next.push(rows.chunks_exact(vocab).last().map_or(0, argmax));
        slots.push(slot);
    }
    for i in 0..steps {
        let last = i + 1 == steps;
        let decode = |k: usize, logprobs: bool| SeqStep {
            slot: slots[k],
            kind: SeqKind::Decode,
            position: prompts[k].len() + i,
            tokens: vec![next[k]],
            form,
            rows: Rows::Last,
            sample: (logprobs && k % 2 == 1).then(|| sampled_row(&prompts[k], k + i)),
            spec: None,
            logprobs: logprobs.then(|| LogprobRows {
                top: TOPS[(k + i) % TOPS.len()],
                targets: vec![None],
            }),
        };
        let full = reference.step(batch((0..slots.len()).map(|k| decode(k, false)).collect(), true))?;
        let got = asked.step(batch((0..slots.len()).map(|k| decode(k, true)).collect(), last))?;
        let rows = full.logits.as_deref().unwrap_or_default();
        for (k, row) in rows.chunks_exact(vocab).enumerate() {
            tally.row(&got, k, row, None, TOPS[(k + i) % TOPS.len()])?;
            next[k] = argmax(row);
        }
    }
    let pass = tally.rows > 0 && tally.sampled > 0 && tally.worst <= tolerance && tally.wrong_tops == 0;
    Ok(LogprobReport {
        form: form.name().to_string(),
        dtype: opts.dtype.to_string(),
        rows: tally.rows,
        sampled_rows: tally.sampled,
        worst_abs: tally.worst,
        wrong_tops: tally.wrong_tops,
        tolerance,
        pass,
    })
}

fn batch(seqs: Vec<SeqStep>, full_logits: bool) -> StepPlan {
    StepPlan {
        commits: Vec::new(),
        program: Program::Batch(Batch {
            seqs,
            full_logits,
            hidden: false,
            mtp: Vec::new(),
        }),
    }
}

/// A sampled row whose repetition penalty rewrites the logits of the prompt's ids before the draw.
fn sampled_row(prompt: &[u32], seed: usize) -> SampleRow {
    SampleRow {
        temperature: 0.9,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.3,
        bias: Vec::new(),
        history: prompt.to_vec(),
        mask: None,
        uniform: ((seed as f32 * 0.618_034) % 1.0).clamp(0.01, 0.99),
    }
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

#[derive(Default)]
struct Tally {
    rows: usize,
    sampled: usize,
    worst: f64,
    wrong_tops: usize,
}

impl Tally {
    /// Compares row `i` of `got` (its top list of `top` entries, its `target`'s value and its sampled token's)
    /// with the reference's whole row.
    fn row(&mut self, got: &StepResult, i: usize, reference: &[f32], target: Option<u32>, top: usize) -> Result<()> {
        let row: &RowPass = got
            .rows
            .get(i)
            .ok_or_else(|| EngineError::InvalidInput(format!("the step reported no row {i}")))?;
        let lp = row
            .logprob
            .as_ref()
            .ok_or_else(|| EngineError::InvalidInput(format!("row {i} carries no log-probabilities")))?;
        let max = reference.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let lse = f64::from(max) + reference.iter().map(|&v| f64::from(v - max).exp()).sum::<f64>().ln();
        let want = |id: u32| f64::from(reference[id as usize]) - lse;
        let mut worst = 0.0f64;
        let mut value = |id: u32| -> Result<()> {
            let logit = row
                .logit_of(id)
                .ok_or_else(|| EngineError::InvalidInput(format!("row {i} does not know the logit of token {id}")))?;
            worst = worst.max((f64::from(logit) - f64::from(row.lse) - want(id)).abs());
            Ok(())
        };
        let entries: Vec<(u32, f32)> = lp.top.entries().collect();
        for &(id, _) in &entries {
            value(id)?;
        }
        if let Some(t) = target {
            value(t)?;
        }
        if let Some(id) = got.sampled.get(i).copied().flatten() {
            value(id)?;
            self.sampled += 1;
        }
        // A top-k up to ties: as many entries as asked, and the reference's k-th best no better than the list's
        // worst (beyond the tolerance).
        let mut sorted: Vec<f32> = reference.to_vec();
        sorted.sort_unstable_by(|a, b| b.total_cmp(a));
        let k = top.min(reference.len());
        let kth = sorted.get(k.wrapping_sub(1)).copied();
        let lowest = entries.iter().map(|&(_, v)| v).fold(f32::INFINITY, f32::min);
        let scale = f64::from(max.abs()).max(1.0);
        if entries.len() != k || kth.is_some_and(|kth| f64::from(kth - lowest) > 1e-4 * scale) {
            self.wrong_tops += 1;
        }
        self.worst = self.worst.max(worst);
        self.rows += 1;
        Ok(())
    }
}
