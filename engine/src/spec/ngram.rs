//! Prompt lookup (n-gram) drafting: find the most recent earlier occurrence of the stream's last `n` tokens (the
//! longest `n` in the configured range first) and propose the tokens that followed it. Costs no model work, so it
//! is the default drafter for text that repeats its context (code edits, extraction, quoting).

use super::{Draft, DraftInput, Drafter};
use crate::error::Result;

/// The n-gram drafter; stateless, so one per request costs nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NgramDrafter {
    min_n: usize,
    max_n: usize,
}

impl NgramDrafter {
    /// Matches of `min_n..=max_n` tokens (`1 ≤ min_n ≤ max_n`, checked by [`super::SpecConfig::validate`]).
    pub fn new(min_n: usize, max_n: usize) -> Self {
        NgramDrafter {
            min_n: min_n.max(1),
            max_n: max_n.max(min_n.max(1)),
        }
    }

    /// Up to `max` tokens that followed the latest earlier occurrence of `tokens`' last n-gram: the rule of
    /// [`rewind_kernels::cpu::chain::ngram_lookup`], which the device's chained drafts (`chain_draft`) follow too.
    pub fn lookup(&self, tokens: &[u32], max: usize) -> Vec<u32> {
        rewind_kernels::cpu::chain::ngram_lookup(tokens, self.min_n, self.max_n, max)
    }
}

impl Drafter for NgramDrafter {
    fn name(&self) -> &'static str {
        "ngram"
    }

    fn propose(&mut self, input: &DraftInput<'_>) -> Result<Draft> {
        Ok(Draft {
            tokens: self.lookup(input.tokens, input.max),
            probs: None,
        })
    }

    fn on_ranks(&self, _context: usize) -> Option<(super::ChainDrafter, Vec<i32>)> {
        Some((
            super::ChainDrafter::Ngram {
                min_n: self.min_n,
                max_n: self.max_n,
            },
            Vec::new(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_latest_longest_match() {
        let d = NgramDrafter::new(1, 3);
        // "1 2 3" occurred before, followed by 4 5; "3" alone was later followed by 9.
        let s = [1, 2, 3, 4, 5, 3, 9, 7, 1, 2, 3];
        assert_eq!(d.lookup(&s, 2), [4, 5], "the 3-gram match wins over the later 1-gram");
        assert_eq!(d.lookup(&s, 10), [4, 5, 3, 9, 7, 1, 2, 3], "bounded by the stream");
        let d1 = NgramDrafter::new(1, 1);
        assert_eq!(d1.lookup(&s, 2), [9, 7], "the latest 1-gram match");
        assert!(d.lookup(&[1, 2, 3], 4).is_empty(), "no earlier occurrence");
        assert!(d.lookup(&[5], 4).is_empty());
        assert!(d.lookup(&[], 4).is_empty());
        // A repeating run proposes its continuation.
        assert_eq!(NgramDrafter::new(2, 2).lookup(&[7, 7, 7], 3), [7]);
    }
}
