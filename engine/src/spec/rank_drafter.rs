//! The drafters that run on the ranks inside a chain of verifies ([`crate::rank::VerifyChain`]): those whose
//! proposals follow from the sequence's stream alone, so a device can draft each chained step's window itself.

use rewind_kernels::cpu::chain::{chain_drafts, ngram_lookup, table_proposal};

/// How the ranks draft the chained steps' windows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainDrafter {
    /// Prompt lookup over the stream: the tokens after the latest earlier occurrence of its last `n` tokens (the
    /// longest `n` in `min_n ..= max_n` first), as [`super::NgramDrafter`].
    Ngram { min_n: usize, max_n: usize },
    /// Each sequence's proposals by stream position ([`crate::rank::ChainedVerify::table`]).
    Table,
}

impl ChainDrafter {
    /// The drafts after `stream` (ending with a step's input token), `count` of them: the proposal, padded. `table`
    /// is the sequence's proposals by position ([`ChainDrafter::Table`]; ignored by the n-gram drafter).
    pub fn draft(&self, table: &[i32], stream: &[u32], count: usize) -> Vec<u32> {
        let proposed = match *self {
            ChainDrafter::Ngram { min_n, max_n } => ngram_lookup(stream, min_n, max_n, count),
            ChainDrafter::Table => table_proposal(table, stream.len(), count),
        };
        chain_drafts(stream, proposed, count)
    }
}
