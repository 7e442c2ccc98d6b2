//! The oracle drafter, a benchmarking tool (`--spec oracle:P`): it proposes the target's own greedy continuation
//! (computed once, without speculation, and handed to the request), each token replaced with probability `P` by a
//! different id. With `P = 0` every draft of a greedy run is accepted; with `P` the acceptance per draft is about
//! `1 − P`, so speculation's cost and gain can be measured at a controlled acceptance on a random-weight model whose
//! own drafts would never be accepted. It knows nothing a real drafter could know and is never a serving option.

use super::{Draft, DraftInput, Drafter};
use crate::error::{EngineError, Result};

/// Proposes `reference[i]` for stream position `prompt_len + i`, corrupted with probability `p`.
#[derive(Clone, Debug, PartialEq)]
pub struct OracleDrafter {
    reference: Vec<u32>,
    prompt_len: usize,
    p: f64,
    vocab: usize,
    seed: u64,
}

impl OracleDrafter {
    /// An oracle over `reference`, the greedy continuation of a prompt of `prompt_len` tokens, in a vocabulary of
    /// `vocab` ids; `seed` makes the corruption reproducible.
    pub fn new(reference: Vec<u32>, prompt_len: usize, p: f64, vocab: usize, seed: u64) -> Result<Self> {
        if !(0.0..=1.0).contains(&p) {
            return Err(EngineError::InvalidInput(format!(
                "oracle:P needs P in [0, 1], got {p}"
            )));
        }
        if vocab < 2 {
            return Err(EngineError::InvalidInput(
                "the oracle drafter needs a vocabulary of at least 2 ids to corrupt a token".into(),
            ));
        }
        if let Some(&t) = reference.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::InvalidInput(format!(
                "the oracle's reference holds token id {t}, outside the vocabulary of {vocab}"
            )));
        }
        Ok(OracleDrafter {
            reference,
            prompt_len,
            p,
            vocab,
            seed,
        })
    }

    /// The (possibly corrupted) draft for stream position `pos`, when the reference reaches it.
    fn token_at(&self, pos: usize) -> Option<u32> {
        let t = *self.reference.get(pos.checked_sub(self.prompt_len)?)?;
        let key = rewind_kernels::cpu::lm_head::mix64(self.seed ^ (pos as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let u = (key >> 11) as f64 / (1u64 << 53) as f64;
        if u >= self.p {
            return Some(t);
        }
        // Any other id, uniformly.
        let shift = 1 + (rewind_kernels::cpu::lm_head::mix64(key) % (self.vocab as u64 - 1)) as u32;
        Some((t + shift) % self.vocab as u32)
    }
}

impl Drafter for OracleDrafter {
    fn name(&self) -> &'static str {
        "oracle"
    }

    fn propose(&mut self, input: &DraftInput<'_>) -> Result<Draft> {
        let next = input.tokens.len();
        let tokens = (next..next + input.max).map_while(|pos| self.token_at(pos)).collect();
        Ok(Draft { tokens, probs: None })
    }

    fn on_ranks(&self, context: usize) -> Option<(super::ChainDrafter, Vec<i32>)> {
        let table = (0..context)
            .map(|pos| self.token_at(pos).map_or(-1, |t| t as i32))
            .collect();
        Some((super::ChainDrafter::Table, table))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn propose(d: &mut OracleDrafter, stream: &[u32], max: usize) -> Vec<u32> {
        let input = DraftInput {
            tokens: stream,
            hidden: None,
            max,
        };
        d.propose(&input).expect("propose").tokens
    }

    #[test]
    fn proposes_the_reference_and_corrupts_at_the_asked_rate() {
        let reference: Vec<u32> = (0..200).map(|i| (i * 7 % 50) as u32).collect();
        let mut exact = OracleDrafter::new(reference.clone(), 3, 0.0, 50, 1).expect("oracle");
        // Stream: 3 prompt tokens + the first generated one; drafts continue at reference[1].
        let stream = [9, 9, 9, reference[0]];
        assert_eq!(propose(&mut exact, &stream, 4), reference[1..5]);
        let mut near_end: Vec<u32> = vec![9, 9, 9];
        near_end.extend_from_slice(&reference[..198]);
        assert_eq!(
            propose(&mut exact, &near_end, 4),
            reference[198..],
            "the reference ends"
        );

        let mut noisy = OracleDrafter::new(reference.clone(), 0, 0.25, 50, 1).expect("oracle");
        let drafts = propose(&mut noisy, &[], 200);
        let wrong = drafts.iter().zip(&reference).filter(|(a, b)| a != b).count();
        assert!((30..=70).contains(&wrong), "{wrong} of 200 corrupted at p = 0.25");
        assert_eq!(drafts, propose(&mut noisy, &[], 200), "reproducible");
        assert!(OracleDrafter::new(vec![50], 0, 0.1, 50, 1).is_err());
        assert!(OracleDrafter::new(vec![], 0, 1.5, 50, 1).is_err());
    }
}
