//! Chained speculative steps ([`Program::VerifyChain`](super::Program::VerifyChain)): a plan of verifies that runs `1 + c` verify steps back to
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

pub use crate::spec::ChainDrafter;

use super::plan::VerifyChain;
use crate::error::{EngineError, Result};

/// What the ranks did in a chain, step-major: per step and sequence the drafts verified and the verdict.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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

impl VerifyChain {
    /// The drafts of sequence `seq`'s step after one whose stream is `stream` (ending with that step's input token),
    /// `count` of them: the drafter's proposal, padded.
    pub fn draft(&self, seq: usize, stream: &[u32], count: usize) -> Vec<u32> {
        self.drafter.draft(&self.seqs[seq].table, stream, count)
    }

    /// The window every sequence verifies (`1 + T` tokens).
    pub fn window(&self) -> usize {
        self.seqs.first().map_or(0, |s| s.tokens.len())
    }

    /// Checks what the types leave open: at least one further step, a drafter with sane sizes (and tables only for
    /// the table drafter), one window of at least one draft for every sequence, each stream ending with the
    /// verify's input token at its position, and every stream and table token inside the vocabulary.
    pub fn check(&self, vocab: usize) -> Result<()> {
        let bad = |m: String| {
            Err(EngineError::InvalidInput(format!(
                "a plan chaining {} verify steps: {m}",
                self.steps
            )))
        };
        if self.steps == 0 {
            return bad("a speculative chain needs chained steps".into());
        }
        if self.seqs.is_empty() {
            return bad("it holds no sequence".into());
        }
        if let ChainDrafter::Ngram { min_n, max_n } = self.drafter {
            if min_n == 0 || max_n < min_n {
                return bad(format!("n-gram sizes {min_n} ..= {max_n} (need 1 ≤ min ≤ max)"));
            }
        }
        let t = self.window();
        for s in &self.seqs {
            if matches!(self.drafter, ChainDrafter::Ngram { .. }) && !s.table.is_empty() {
                return bad("draft tables given to the n-gram drafter".into());
            }
            if s.tokens.len() != t || t < 2 {
                return bad(format!(
                    "slot {} verifies {} tokens; every sequence of a chain verifies the same window of at least one \
                     draft ({t})",
                    s.slot,
                    s.tokens.len()
                ));
            }
            if s.stream.len() != s.position + 1 || s.stream.last() != s.tokens.first() {
                return bad(format!(
                    "slot {}: its stream of {} tokens must end with the verify's input token at position {}",
                    s.slot,
                    s.stream.len(),
                    s.position
                ));
            }
            if let Some(&tok) = s.stream.iter().find(|&&x| x as usize >= vocab) {
                return bad(format!(
                    "slot {}: stream token id {tok} is outside the vocabulary of {vocab}",
                    s.slot
                ));
            }
            if let Some(&tok) = s.table.iter().find(|&&x| x >= vocab as i32 || x < -1) {
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
        let ngram = ChainDrafter::Ngram { min_n: 1, max_n: 2 };
        assert_eq!(ngram.draft(&[], &[1, 2, 3, 1, 2], 3), [3, 1, 2]);
        assert_eq!(ngram.draft(&[], &[4, 5], 3), [5, 5, 5], "no match: the last token");
        let table = VerifyChain {
            seqs: vec![crate::rank::ChainedVerify {
                slot: 0,
                position: 1,
                tokens: vec![2, 0, 0, 0],
                form: crate::decode::FormChoice::Replay,
                spec: None,
                stream: vec![1, 2],
                table: vec![-1, -1, 7, 8, -1, 9],
            }],
            steps: 1,
            drafter: ChainDrafter::Table,
        };
        assert_eq!(table.draft(0, &[1, 2], 3), [7, 8, 8], "proposals stop at −1");
    }
}
