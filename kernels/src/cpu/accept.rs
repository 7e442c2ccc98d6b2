//! Judging a speculative verify from its rows' one-pass summaries (speculative sampling, Leviathan et al., in
//! FlashSpec's one-pass form): the CPU twin of `spec_accept` (`kernels/src/cuda/kernels/lm_head.cu`), and what
//! `rewind_engine::spec::accept_summaries` runs over whole-vocabulary summaries.
//!
//! A verify of `[t, d_1 … d_k]` reports `k + 1` rows; row `i` predicts the token after `d_i`. Drafts are accepted left
//! to right. Greedy: while the row's argmax is the draft; the first mismatch is replaced by that argmax, and when all
//! match the last row's argmax is the bonus. Sampling at the temperature the summaries were made with: draft `d` is
//! accepted when `u < exp(ℓ_d/τ − LSE)`, `u` keyed by the request's seed and the row's output index; the first
//! rejected one is replaced by the row's Gumbel-max candidate (which skipped the draft), and the bonus is the last
//! row's candidate.

use super::lm_head::{uniform_at, SpecSummary};

/// The noise id reserved for acceptance tests (no vocabulary reaches it).
pub const ACCEPT_ID: u32 = u32::MAX;

/// The acceptance test's uniform for the row predicting output token `index`.
pub fn accept_uniform(seed: u64, index: u64) -> f32 {
    uniform_at(seed, index, ACCEPT_ID)
}

/// One verify row as the judge reads it: the greedy token, and the speculative summary when the row has one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct JudgedRow {
    pub argmax: u32,
    pub spec: Option<SpecSummary>,
}

/// What a verify yields: the drafts accepted, and the token after them (the replacement at the first rejection, or
/// the bonus token when every draft was accepted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub accepted: usize,
    pub token: u32,
}

/// Why a verify cannot be judged from its summaries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JudgeError {
    /// `rows` rows for `drafts` drafts (there must be one more row than drafts).
    Rows { drafts: usize, rows: usize },
    /// Row `row` of a sampled verify carries no speculative summary.
    NoSummary { row: usize },
    /// Row `row` rejected its draft and had no other id to resample (a one-token vocabulary).
    NothingLeft { row: usize },
}

impl std::fmt::Display for JudgeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            JudgeError::Rows { drafts, rows } => {
                write!(f, "a verify of {drafts} drafts reports {} rows, got {rows}", drafts + 1)
            }
            JudgeError::NoSummary { row } => write!(f, "verify row {row} came back without its speculative summary"),
            JudgeError::NothingLeft { row } => write!(f, "verify row {row}: no token left to resample"),
        }
    }
}

impl std::error::Error for JudgeError {}

/// Judges `drafts` from their verify's `rows` (`drafts.len() + 1`): greedy when `sampled` is `None`, else sampling
/// keyed by `(seed, index)`, `index` the output index of row 0's token.
pub fn judge(rows: &[JudgedRow], drafts: &[u32], sampled: Option<(u64, u64)>) -> Result<Verdict, JudgeError> {
    if rows.len() != drafts.len() + 1 {
        return Err(JudgeError::Rows {
            drafts: drafts.len(),
            rows: rows.len(),
        });
    }
    let spec = |i: usize| rows[i].spec.ok_or(JudgeError::NoSummary { row: i });
    let replacement = |i: usize| -> Result<u32, JudgeError> {
        match sampled {
            None => Ok(rows[i].argmax),
            Some(_) => {
                let s = spec(i)?;
                if s.score == f32::NEG_INFINITY {
                    return Err(JudgeError::NothingLeft { row: i });
                }
                Ok(s.candidate)
            }
        }
    };
    for (i, &d) in drafts.iter().enumerate() {
        let accept = match sampled {
            None => rows[i].argmax == d,
            Some((seed, index)) => {
                let s = spec(i)?;
                let p = s.drafted.map_or(0.0, |l| (l - s.lse).exp());
                accept_uniform(seed, index + i as u64) < p
            }
        };
        if !accept {
            return Ok(Verdict {
                accepted: i,
                token: replacement(i)?,
            });
        }
    }
    Ok(Verdict {
        accepted: drafts.len(),
        token: replacement(drafts.len())?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(argmax: u32, lse: f32, drafted: Option<f32>, candidate: u32, score: f32) -> JudgedRow {
        JudgedRow {
            argmax,
            spec: Some(SpecSummary {
                lse,
                drafted,
                candidate,
                score,
            }),
        }
    }

    #[test]
    fn greedy_follows_the_argmax_chain_and_sampling_the_probabilities() {
        let rows = [
            row(4, 0.0, Some(0.0), 9, 1.0),
            row(5, 0.0, Some(0.0), 8, 1.0),
            row(6, 0.0, None, 7, 1.0),
        ];
        // Greedy: the first draft matches, the second does not and is replaced by the argmax.
        assert_eq!(judge(&rows, &[4, 3], None), Ok(Verdict { accepted: 1, token: 5 }));
        assert_eq!(judge(&rows, &[4, 5], None), Ok(Verdict { accepted: 2, token: 6 }));
        // Sampling: p = exp(0 − 0) = 1 accepts every draft whatever the uniform; the bonus is the last candidate.
        assert_eq!(
            judge(&rows, &[1, 2], Some((3, 10))),
            Ok(Verdict { accepted: 2, token: 7 })
        );
        // A draft the row never saw has p = 0: rejected, replaced by the candidate.
        let unseen = [row(4, 0.0, None, 9, 1.0), rows[2]];
        assert_eq!(
            judge(&unseen, &[4], Some((3, 10))),
            Ok(Verdict { accepted: 0, token: 9 })
        );
        // Nothing to resample, and rows that do not fit the drafts.
        let empty = [row(4, 0.0, None, 0, f32::NEG_INFINITY), rows[2]];
        assert_eq!(
            judge(&empty, &[4], Some((3, 10))),
            Err(JudgeError::NothingLeft { row: 0 })
        );
        assert_eq!(judge(&rows, &[4], None), Err(JudgeError::Rows { drafts: 1, rows: 3 }));
        let plain = [JudgedRow { argmax: 1, spec: None }, rows[2]];
        assert_eq!(
            judge(&plain, &[1], Some((3, 10))),
            Err(JudgeError::NoSummary { row: 0 })
        );
        assert_eq!(judge(&plain, &[1], None), Ok(Verdict { accepted: 1, token: 6 }));
    }
}
