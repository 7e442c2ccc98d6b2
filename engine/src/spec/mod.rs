//! Speculative decoding: drafters propose tokens, the target verifies them in one step (the decode forms'
//! verify / commit, whose rollback is a pointer move), and [`accept`] turns the verify's per-position summaries into
//! the tokens that come out: exactly what plain decoding would give (greedy), or a sample of exactly the target's
//! distribution (sampled).
//!
//! - [`config`]: the `--spec` / `--spec-window` / `--spec-policy` settings and their validation;
//! - [`window`]: the policy that sizes each step's window (fixed, or adaptive: the most expected tokens per second
//!   for the measured acceptance and step times, Snakes and Ladders §4);
//! - [`step_cost`]: the step times the adaptive window is chosen on (a measured profile, the server's own steps, or
//!   an analytic prior);
//! - [`accept`]: acceptance and resampling from the one-pass summaries (FlashSpec) or, for filtered sampling and
//!   sampled drafts, from whole rows;
//! - the drafters, one module each: [`ngram`] (prompt lookup), [`oracle`] (a benchmark tool), [`draft_model`] (a
//!   separate checkpoint), [`mtp`] (the checkpoint's own multi-token-prediction layer).
//!
//! The coordinator (actors/src/coordinator) owns one [`Drafter`] per running request.

pub mod accept;
pub mod config;
pub mod draft_model;
pub mod factory;
pub mod mtp;
pub mod ngram;
pub mod oracle;
pub mod rank_drafter;
pub mod step_cost;
pub mod window;

#[cfg(test)]
mod tests;

pub use accept::{accept_rows, accept_summaries, Acceptance, RowSampling};
pub use config::{DrafterKind, SpecConfig, SpecPolicy};
pub use rank_drafter::{ChainDrafter, MtpProposal, MtpRequest, RankMtpDrafter};
pub use step_cost::{StepCostModel, StepProfile};
pub use window::{AcceptanceMeter, Drafting, WindowChoice, WindowPolicy};

use crate::error::Result;

/// The target's final hidden states (before the final norm) of committed positions, for drafters that run on them
/// (MTP): rows `[n, hidden]` of positions `position .. position + n`; the token that followed row `i` is
/// `tokens[position + i + 1]` of the [`DraftInput`].
#[derive(Clone, Debug, PartialEq)]
pub struct HiddenRows {
    pub position: usize,
    pub hidden: usize,
    pub rows: Vec<f32>,
}

/// What a drafter sees when asked for drafts.
#[derive(Clone, Copy, Debug)]
pub struct DraftInput<'a> {
    /// The sequence so far: prompt, then every generated token. The last one is the token the next verify starts
    /// with (it is not yet in the target's state); drafts continue after it.
    pub tokens: &'a [u32],
    /// Hidden states of committed positions not yet [`Drafter::observe`]d, when the drafter asked for them
    /// ([`Drafter::wants_hidden`]) and the ranks could give them (rows that end just before the last token).
    pub hidden: Option<&'a HiddenRows>,
    /// The most drafts to propose (≥ 1).
    pub max: usize,
}

/// A drafter's proposal.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Draft {
    /// The drafted tokens, in order (possibly none: the step then decodes one token).
    pub tokens: Vec<u32>,
    /// Per drafted token, the drafter's whole-vocabulary probabilities `q` when the tokens were sampled from it;
    /// `None` for deterministic drafts (`q` one-hot on the token), which is what the one-pass acceptance needs.
    pub probs: Option<Vec<Vec<f32>>>,
}

/// Proposes tokens for one sequence. A drafter may keep state between proposals (its own KV, a draft model's
/// sequence); every proposal sees the whole token stream, so a drafter that kept state finds what was accepted by
/// comparing it with what it proposed.
pub trait Drafter: Send + Sync {
    /// The drafter's name, as `--spec` spells it.
    fn name(&self) -> &'static str;

    /// Up to `input.max` tokens to follow `input.tokens`.
    fn propose(&mut self, input: &DraftInput<'_>) -> Result<Draft>;

    /// Announces that [`Drafter::propose`] with the same input follows once every sequence of the step was
    /// announced: drafters that share a model (a draft model's slots) run all the announced proposals as one batch
    /// when the first is asked for. A proposal asked with another input is run on its own.
    fn prepare(&mut self, _input: &DraftInput<'_>) -> Result<()> {
        Ok(())
    }

    /// Takes the target's hidden states of committed positions as they come (each prompt chunk's, each step's),
    /// before any proposal needs them: row `i` of `hidden` is position `hidden.position + i`, and `tokens` (the
    /// sequence so far) holds the token after every row. Only drafters that [`Drafter::wants_hidden`] are called.
    fn observe(&mut self, _tokens: &[u32], _hidden: &HiddenRows) -> Result<()> {
        Ok(())
    }

    /// Whether hidden states are needed ([`Drafter::observe`], [`DraftInput::hidden`]): the ranks then return the
    /// final hidden states of every prompt row and of the committed rows.
    fn wants_hidden(&self) -> bool {
        false
    }

    /// The same proposals as the ranks make them in a chain of verifies ([`crate::rank::VerifyChain`]), for a
    /// sequence whose stream may reach `context` tokens: the rule, and for a table its proposal per stream
    /// position. `None` (the default) for drafters whose proposals need more than the stream (a model's state).
    fn on_ranks(&self, _context: usize) -> Option<(ChainDrafter, Vec<i32>)> {
        None
    }

    /// Takes the proposal the ranks' MTP layer made after a step for this sequence, for drafters whose factory
    /// drafts there ([`DrafterFactory::mtp_on_ranks`]); others ignore it.
    fn offer(&mut self, _proposal: &MtpProposal) {}
}

/// What a drafter is made for: one request.
#[derive(Clone, Copy, Debug)]
pub struct DraftRequest<'a> {
    pub prompt: &'a [u32],
    pub params: &'a crate::sample::SamplingParams,
    /// The request's sampling seed (drafters that sample derive their own stream from it).
    pub seed: u64,
    /// The oracle drafter's reference continuation (benchmarking only).
    pub reference: Option<&'a [u32]>,
}

/// Makes one [`Drafter`] per request (sharing whatever is expensive: a draft model's weights, MTP weights).
pub trait DrafterFactory: Send + Sync {
    /// The drafter kind, for reports.
    fn kind(&self) -> &DrafterKind;

    /// Checks, when the request arrives, what [`DrafterFactory::drafter`] will need of it (so a request that can
    /// never be served fails at once).
    fn check(&self, _request: &DraftRequest<'_>) -> Result<()> {
        Ok(())
    }

    /// A drafter for `request`, or a clear error (the request alone fails). Made when the request starts running
    /// and dropped when it stops (a draft model's slot is held only meanwhile).
    fn drafter(&self, request: &DraftRequest<'_>) -> Result<Box<dyn Drafter>>;

    /// Whether the drafters need the target's hidden states.
    fn wants_hidden(&self) -> bool {
        false
    }

    /// Whether the drafters' proposals can be made on the ranks ([`Drafter::on_ranks`]), so that verifies
    /// (greedy, or judged from one-pass summaries) may chain there.
    fn on_ranks(&self) -> bool {
        false
    }

    /// The width of the hidden rows the drafters take (the target's hidden size), when they take any: how the
    /// coordinator reads the rows a step returns.
    fn hidden_width(&self) -> Option<usize> {
        None
    }

    /// Whether the ranks draft with the checkpoint's MTP layer: every step of a speculating sequence asks them to
    /// ([`crate::rank::Batch::mtp`]) and their proposals go to its drafter ([`Drafter::offer`]).
    fn mtp_on_ranks(&self) -> bool {
        false
    }
}

/// A request's speculation counters, as `generate` reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SpecStats {
    /// Tokens drafted and accepted.
    pub drafted: usize,
    pub accepted: usize,
    /// Verify steps run.
    pub verifies: usize,
}

impl SpecStats {
    /// Accepted drafts per verify step.
    pub fn accepted_per_step(&self) -> f64 {
        if self.verifies == 0 {
            0.0
        } else {
            self.accepted as f64 / self.verifies as f64
        }
    }

    /// Accepted over drafted.
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Adds another request's counters.
    pub fn add(&mut self, o: &SpecStats) {
        self.drafted += o.drafted;
        self.accepted += o.accepted;
        self.verifies += o.verifies;
    }
}
