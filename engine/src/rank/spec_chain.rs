//! Chained speculative steps ([`StepPlan::spec_chain`]): a plan of verifies that runs `1 + c` verify steps back to
//! back. After each step the ranks judge the verify themselves, commit the accepted tokens, draft the next step's
//! window and verify it, with no host round trip: on a GPU every decision is device data
//! (`engine/src/gpu/spec_chain.rs`); a CPU rank runs the same rules as a loop of single steps (the twin).
//!
//! A sequence is judged greedily, or by sampling from its rows' one-pass summaries ([`super::SpecSample`]: plain
//! temperature sampling keyed by the request's seed and each row's output index). The index of the token a step's
//! row 0 predicts moves with the sequence's position, so the ranks key every later step themselves
//! ([`rewind_kernels::cpu::chain::ChainSample`]) and a chain draws exactly what single verifies draw.
//!
//! The drafters that run on the ranks are those whose proposals follow from the stream alone: the n-gram (prompt
//! lookup) drafter, and a table of proposals by stream position (the oracle benchmarking drafter, whose proposals
//! depend on the position only). Every step verifies a full window: a drafter that proposes fewer tokens is padded
//! with the stream's last token ([`rewind_kernels::cpu::chain::chain_drafts`]), so every step has one shape and one
//! CUDA graph. Acceptance keeps the target's distribution (greedy: exactly its greedy tokens) whatever the drafts,
//! so padding changes only how many are accepted.
//!
//! The ranks report each step's rows (step-major, as a chain of decodes does) and a [`ChainLog`]: the drafts every
//! step verified and its verdict. The books of the group and of every rank settle the committed tokens from the log
//! ([`super::Books::settle_chain`]); the last step's verify waits for the next plan's commit, as a single verify does.

pub use rewind_kernels::cpu::chain::chain_drafts;
use rewind_kernels::cpu::chain::{ngram_lookup, table_proposal};

use super::plan::{Rows, SeqKind, StepPlan};
use crate::error::{EngineError, Result};

/// How the ranks draft the chained steps' windows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainDrafter {
    /// Prompt lookup over the stream: the tokens after the latest earlier occurrence of its last `n` tokens (the
    /// longest `n` in `min_n ..= max_n` first), as [`crate::spec::NgramDrafter`].
    Ngram { min_n: usize, max_n: usize },
    /// Each sequence's proposals by stream position ([`SpecChain::tables`]).
    Table,
}

/// What the ranks need to draft a chain's later steps.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecChain {
    pub drafter: ChainDrafter,
    /// Per sequence (plan order): the stream so far, ending with the verify's input token (`tokens[0]`), so its
    /// length is the sequence's position + 1.
    pub streams: Vec<Vec<u32>>,
    /// With [`ChainDrafter::Table`], per sequence: the proposal for each stream position (−1: none; a proposal run
    /// stops at the first −1). Empty otherwise.
    pub tables: Vec<Vec<i32>>,
}

/// What the ranks did in a chain, step-major: per step and sequence the drafts verified and the verdict.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChainLog {
    /// `[steps, seqs, T]`: the drafts each step verified (step 0's are the plan's).
    pub drafts: Vec<u32>,
    /// `[steps, seqs]`: drafts accepted.
    pub accepted: Vec<usize>,
    /// `[steps, seqs]`: the token after the accepted drafts (the correction, or the bonus).
    pub tokens: Vec<u32>,
}

impl ChainLog {
    /// Tokens each sequence committed in the chain before its last step (whose verify awaits the next plan's
    /// commit): the input token and the accepted drafts of every earlier step.
    pub fn committed(&self, seqs: usize) -> Vec<usize> {
        let steps = self.accepted.len() / seqs.max(1);
        (0..seqs)
            .map(|q| {
                (0..steps.saturating_sub(1))
                    .map(|k| self.accepted[k * seqs + q] + 1)
                    .sum()
            })
            .collect()
    }
}

impl SpecChain {
    /// The drafts of the step after one whose stream is `stream` (ending with that step's input token), `count` of
    /// them: the drafter's proposal, padded.
    pub fn draft(&self, seq: usize, stream: &[u32], count: usize) -> Vec<u32> {
        let proposed = match self.drafter {
            ChainDrafter::Ngram { min_n, max_n } => ngram_lookup(stream, min_n, max_n, count),
            ChainDrafter::Table => table_proposal(&self.tables[seq], stream.len(), count),
        };
        chain_drafts(stream, proposed, count)
    }
}

impl StepPlan {
    /// Checks a plan of chained verifies ([`StepPlan::spec_chain`]): verifies of one window reporting every row
    /// (judged greedily, or sampled from their one-pass summaries, never from whole rows), each with its stream (and table) consistent with its tokens, no whole logits or hidden states, and every
    /// stream and table token inside the vocabulary.
    pub(super) fn check_spec_chain(&self, vocab: usize) -> Result<()> {
        let Some(chain) = &self.spec_chain else {
            return Ok(());
        };
        let bad = |m: String| {
            Err(EngineError::InvalidInput(format!(
                "a plan chaining {} verify steps: {m}",
                self.chained
            )))
        };
        if self.chained == 0 {
            return bad("a speculative chain needs chained steps".into());
        }
        if self.full_logits || self.hidden {
            return bad("whole logits and hidden states are returned for single steps only".into());
        }
        if chain.streams.len() != self.seqs.len() {
            return bad(format!(
                "{} streams for {} sequences",
                chain.streams.len(),
                self.seqs.len()
            ));
        }
        match chain.drafter {
            ChainDrafter::Ngram { min_n, max_n } if min_n == 0 || max_n < min_n => {
                return bad(format!("n-gram sizes {min_n} ..= {max_n} (need 1 ≤ min ≤ max)"))
            }
            ChainDrafter::Table if chain.tables.len() != self.seqs.len() => {
                return bad(format!(
                    "{} draft tables for {} sequences",
                    chain.tables.len(),
                    self.seqs.len()
                ))
            }
            ChainDrafter::Ngram { .. } if !chain.tables.is_empty() => {
                return bad("draft tables given to the n-gram drafter".into())
            }
            _ => {}
        }
        let t = self.seqs.first().map_or(0, |s| s.tokens.len());
        for (q, s) in self.seqs.iter().enumerate() {
            if s.kind != SeqKind::Verify || s.rows != Rows::All || s.sample.is_some() {
                return bad(format!(
                    "slot {} is not a verify reporting every row, judged greedily or by its one-pass summaries \
                     (only those chain)",
                    s.slot
                ));
            }
            if s.tokens.len() != t || t < 2 {
                return bad(format!(
                    "slot {} verifies {} tokens; every sequence of a chain verifies the same window of at least one \
                     draft ({t})",
                    s.slot,
                    s.tokens.len()
                ));
            }
            let stream = &chain.streams[q];
            if stream.len() != s.position + 1 || stream.last() != s.tokens.first() {
                return bad(format!(
                    "slot {}: its stream of {} tokens must end with the verify's input token at position {}",
                    s.slot,
                    stream.len(),
                    s.position
                ));
            }
            if let Some(&tok) = stream.iter().find(|&&x| x as usize >= vocab) {
                return bad(format!(
                    "slot {}: stream token id {tok} is outside the vocabulary of {vocab}",
                    s.slot
                ));
            }
            if let Some(&tok) = chain
                .tables
                .get(q)
                .into_iter()
                .flatten()
                .find(|&&x| x >= vocab as i32 || x < -1)
            {
                return bad(format!(
                    "slot {}: draft table entry {tok} is not a token id or −1",
                    s.slot
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_counts_every_step_but_the_last() {
        let log = ChainLog {
            drafts: vec![0; 3 * 2 * 2],
            accepted: vec![2, 0, 1, 1, 0, 2],
            tokens: vec![0; 6],
        };
        assert_eq!(log.committed(2), [3 + 2, 1 + 2]);
    }

    #[test]
    fn drafts_are_padded_to_the_window() {
        let chain = SpecChain {
            drafter: ChainDrafter::Ngram { min_n: 1, max_n: 2 },
            streams: Vec::new(),
            tables: Vec::new(),
        };
        assert_eq!(chain.draft(0, &[1, 2, 3, 1, 2], 3), [3, 1, 2]);
        assert_eq!(chain.draft(0, &[4, 5], 3), [5, 5, 5], "no match: the last token");
        let table = SpecChain {
            drafter: ChainDrafter::Table,
            streams: Vec::new(),
            tables: vec![vec![-1, -1, 7, 8, -1, 9]],
        };
        assert_eq!(table.draft(0, &[1, 2], 3), [7, 8, 8], "proposals stop at −1");
    }
}
