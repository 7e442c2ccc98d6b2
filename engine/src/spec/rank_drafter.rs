//! The drafters that run on the ranks: inside a chain of verifies ([`crate::rank::VerifyChain`]), those whose
//! proposals follow from the sequence's stream alone, so a device can draft each chained step's window itself; and
//! the checkpoint's MTP layer after any step ([`crate::rank::mtp`]), whose proposals [`RankMtpDrafter`] hands on.

use rewind_kernels::cpu::chain::{chain_drafts, ngram_lookup, table_proposal};

/// How the ranks draft the chained steps' windows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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

/// A sequence of a batch that runs the rank's MTP layer, and the drafts to propose after the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct MtpRequest {
    pub slot: usize,
    /// Drafts to propose for the next step (0: only keep the layer's KV current).
    pub window: usize,
}

/// The drafts a rank's MTP layer proposes for a sequence after a step: for the verify that starts at `position`
/// with `token` (the rank's verdict on this step).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MtpProposal {
    pub slot: usize,
    pub position: usize,
    pub token: u32,
    pub drafts: Vec<u32>,
}

/// The MTP drafter of a request whose ranks run the MTP layer ([`crate::rank::mtp`]): it proposes the drafts the
/// ranks made after the last step, when they drafted after the token the coordinator kept at that position (a cut
/// verify or an overridden token leaves none: the step decodes, and the ranks draft again after it).
#[derive(Clone, Debug, Default)]
pub struct RankMtpDrafter {
    last: Option<MtpProposal>,
}

impl super::Drafter for RankMtpDrafter {
    fn name(&self) -> &'static str {
        "mtp"
    }

    fn propose(&mut self, input: &super::DraftInput<'_>) -> crate::error::Result<super::Draft> {
        let tokens = match self.last.take() {
            Some(p) if p.position + 1 == input.tokens.len() && input.tokens.last() == Some(&p.token) => {
                p.drafts.into_iter().take(input.max).collect()
            }
            _ => Vec::new(),
        };
        Ok(super::Draft { tokens, probs: None })
    }

    fn offer(&mut self, proposal: &MtpProposal) {
        self.last = Some(proposal.clone());
    }
}
