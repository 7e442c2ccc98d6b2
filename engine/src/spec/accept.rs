//! Acceptance and resampling of a verify (speculative sampling, Leviathan et al.; FlashSpec's one-pass form).
//!
//! A verify of `[t, d_1 … d_k]` reports `k + 1` rows: row `i` is the target's prediction after `d_i` (row 0 after
//! `t`). Drafts are accepted left to right; the first rejected one is replaced by a sample of the residual, and when
//! all are accepted the last row gives a bonus token. The result is an exact sample of the target's distribution
//! (greedy: exactly the argmax chain plain decoding gives).
//!
//! - [`accept_summaries`]: greedy, or sampling at a temperature with deterministic drafts, from the one-pass
//!   summaries alone: `p(d) = exp(ℓ_d / τ − LSE)`, and the residual `p` without `d` is sampled by the Gumbel-max
//!   candidate that skipped `d`. Nothing of the vocabulary's size exists on this path.
//! - [`accept_rows`]: whole logit rows, for what the summaries cannot express — the top-k / top-p / min-p filters,
//!   the repetition penalty, and drafts sampled from a draft model's `q` (accept with `min(1, p/q)`, residual
//!   `max(0, p − q)`).
//!
//! Randomness is keyed by the request's seed and each row's output index, so a run is reproducible and a re-run
//! after a fault draws the same numbers: the acceptance test uses [`accept_uniform`], the residual and bonus draws
//! (whole rows) use the Sampler's stream ([`crate::sample::Sampler::draw_at`]) and the one-pass candidates use the
//! Gumbel noise of `rewind_kernels::cpu::lm_head`.

use rewind_kernels::cpu::accept::{judge, JudgedRow};
use rewind_kernels::cpu::sample::{argmax, kept_weights};

use crate::error::{EngineError, Result};
use crate::sample::{apply_logit_bias, apply_repetition_penalty, distinct_ids, Sampler, SamplingParams};
use rewind_kernels::cpu::lm_head::RowPass;

pub use rewind_kernels::cpu::accept::accept_uniform;

/// The seed a drafter that samples uses for request seed `seed`: a stream independent of the acceptance test's and
/// the residual draws'.
pub fn draft_seed(seed: u64) -> u64 {
    rewind_kernels::cpu::lm_head::mix64(seed ^ 0x6472_6166_7473_2121)
}

/// What a verify yields: the number of drafts accepted, and the token after them (the residual sample at the first
/// rejection, or the bonus token when every draft was accepted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Acceptance {
    pub accepted: usize,
    pub token: u32,
}

/// Judges `drafts` from the verify's whole-vocabulary summaries (`drafts.len() + 1` rows): greedy when `sampled` is
/// `None`, else sampling at the temperature the summaries were made with, keyed by `(seed, index)` where `index`
/// is the output index of row 0's token. The rule is `rewind_kernels::cpu::accept::judge`, the twin of the device's
/// `spec_accept`.
pub fn accept_summaries(rows: &[RowPass], drafts: &[u32], sampled: Option<(u64, u64)>) -> Result<Acceptance> {
    let judged: Vec<JudgedRow> = rows
        .iter()
        .map(|r| JudgedRow {
            argmax: r.argmax,
            spec: r.spec,
        })
        .collect();
    let v = judge(&judged, drafts, sampled).map_err(|e| EngineError::InvalidInput(e.to_string()))?;
    Ok(Acceptance {
        accepted: v.accepted,
        token: v.token,
    })
}

fn check_rows(rows: usize, drafts: usize) -> Result<()> {
    if rows != drafts + 1 {
        return Err(EngineError::InvalidInput(format!(
            "a verify of {drafts} drafts reports {} rows, got {rows}",
            drafts + 1
        )));
    }
    Ok(())
}

/// The sampling of a request, for [`accept_rows`].
#[derive(Clone, Copy, Debug)]
pub struct RowSampling<'a> {
    pub params: &'a SamplingParams,
    /// The context before the verify's first output (prompt and generated tokens): the repetition penalty's; its
    /// last `index` tokens are the generated ones (the presence and frequency penalties').
    pub history: &'a [u32],
    /// The model's EOS ids, masked before `min_tokens`.
    pub eos: &'a [u32],
    pub seed: u64,
    /// The output index of row 0's token.
    pub index: u64,
}

/// Judges `drafts` from whole logit rows `logits` `[drafts.len() + 1, vocab]`, with the request's filters, repetition
/// penalty and additive bias (row `i`'s penalty context is the history plus the drafts before it). `q`: per draft, the
/// drafter's probabilities when it sampled the drafts (`None`: deterministic drafts).
pub fn accept_rows(
    logits: &[f32],
    vocab: usize,
    drafts: &[u32],
    q: Option<&[Vec<f32>]>,
    s: &RowSampling<'_>,
) -> Result<Acceptance> {
    check_rows(logits.len().checked_div(vocab).unwrap_or(0), drafts.len())?;
    if let Some(q) = q {
        if q.len() != drafts.len() || q.iter().any(|r| r.len() != vocab) {
            return Err(EngineError::InvalidInput(format!(
                "draft probabilities must be {} rows of {vocab}",
                drafts.len()
            )));
        }
    }
    let p = s.params;
    let mut context = s.history.to_vec();
    let (mut seen, mut bias) = (Vec::new(), Vec::new());
    for i in 0..=drafts.len() {
        let mut row = logits[i * vocab..(i + 1) * vocab].to_vec();
        if row.iter().any(|v| !v.is_finite()) {
            return Err(EngineError::NonFinite {
                position: context.len(),
            });
        }
        if p.repetition_penalty != 1.0 {
            distinct_ids(&context, &mut seen);
            apply_repetition_penalty(&mut row, &seen, p.repetition_penalty);
        }
        let index = s.index + i as u64;
        let generated = &context[context
            .len()
            .saturating_sub(usize::try_from(index).unwrap_or(usize::MAX))..];
        p.logit_bias_at(generated, s.eos, &mut bias);
        if let Some(&(id, _)) = bias.iter().find(|&&(id, _)| id as usize >= vocab) {
            return Err(EngineError::InvalidInput(format!(
                "logit bias token id {id} is out of range (vocab size {vocab})"
            )));
        }
        apply_logit_bias(&mut row, &bias);
        let draft = drafts.get(i).copied();
        if p.temperature == 0.0 {
            let best = argmax(&row);
            match draft {
                Some(d) if d == best => {
                    context.push(d);
                    continue;
                }
                _ => {
                    return Ok(Acceptance {
                        accepted: i,
                        token: best,
                    })
                }
            }
        }
        let mut probs = vec![0.0f64; vocab];
        let kept = kept_weights(&row, p.temperature, p.top_k, p.top_p, p.min_p);
        let total: f64 = kept.iter().map(|&(_, w)| f64::from(w)).sum();
        for &(id, w) in &kept {
            probs[id as usize] = f64::from(w) / total;
        }
        let Some(d) = draft else {
            let token = draw(&probs, Sampler::draw_at(s.seed, index));
            return Ok(Acceptance { accepted: i, token });
        };
        let qd = q.map_or(1.0, |q| f64::from(q[i][d as usize]));
        let ratio = if qd > 0.0 {
            (probs[d as usize] / qd).min(1.0)
        } else {
            0.0
        };
        if f64::from(accept_uniform(s.seed, index)) < ratio {
            context.push(d);
            continue;
        }
        // Residual max(0, p − q); q is one-hot on d for deterministic drafts.
        let mut residual: Vec<f64> = match q {
            Some(q) => probs
                .iter()
                .zip(&q[i])
                .map(|(&a, &b)| (a - f64::from(b)).max(0.0))
                .collect(),
            None => {
                let mut r = probs.clone();
                r[d as usize] = 0.0;
                r
            }
        };
        if residual.iter().sum::<f64>() <= 0.0 {
            residual = probs;
        }
        let token = draw(&residual, Sampler::draw_at(s.seed, index));
        return Ok(Acceptance { accepted: i, token });
    }
    unreachable!("the last row has no draft and always returns")
}

/// The first id whose cumulative weight exceeds `u · total` (ascending ids), or the last id with weight.
fn draw(weights: &[f64], u: f32) -> u32 {
    let total: f64 = weights.iter().sum();
    let x = f64::from(u) * total;
    let mut cum = 0.0;
    let mut last = 0;
    for (id, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            cum += w;
            last = id;
            if x < cum {
                return id as u32;
            }
        }
    }
    last as u32
}
