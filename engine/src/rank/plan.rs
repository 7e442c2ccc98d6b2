//! The typed messages between the coordinator and a rank: what one step asks for ([`StepPlan`]) and what a rank
//! answers ([`StepOut`]), plus the slot snapshot and health report of the [`Rank`](super::Rank) interface.
//!
//! Every rank receives the same plan. A rank answers for its own vocabulary slice only (compact per-position
//! summaries, and its slice of the logits when the plan asks for them); [`super::vocab`] merges the ranks' answers.

use std::ops::Range;

use rewind_kernels::cpu::lm_head::{LogprobRequest, RowPass, SpecRequest};

use crate::decode::FormChoice;
pub use crate::decode::{Rows, SlotSnapshot, SsmSnapshot};

/// What a sequence does in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum SeqKind {
    /// A prompt chunk: the chunked scans, committed. The first chunk of a slot (at position 0) starts the sequence in
    /// the plan's form; a later chunk continues it (its ring is folded into the checkpoint first).
    Prefill,
    /// One token, committed.
    Decode,
    /// `1 + T` tokens whose outputs are computed but not committed until a later plan's [`Commit`].
    Verify,
}

/// One row's sampling on the rank: the engine Sampler's filters (see `rewind_kernels::cpu::sample::sample_row`), the
/// repetition penalty over `history`, the additive `bias`, and the draw `uniform`. Under tensor parallelism every rank joins the row from
/// every rank's vocabulary slice and samples the whole row, so every rank draws the same token.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SampleRow {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    /// The context the penalty applies to (ignored when the penalty is 1).
    pub history: Vec<u32>,
    /// Added to the logits after the repetition penalty, ascending distinct ids: the presence and frequency
    /// penalties, `logit_bias` and the `min_tokens` mask of this step
    /// ([`SamplingParams::logit_bias_at`](crate::sample::SamplingParams::logit_bias_at)). Under tensor parallelism
    /// every rank adds them to the row it joined from every rank's vocabulary slice.
    pub bias: Vec<(u32, f32)>,
    /// A constrained row's token mask (structured outputs, [`crate::grammar`]): bit `id % 32` of word `id / 32` set
    /// for each id the grammar allows; every other logit becomes [`MASKED`](crate::sample::MASKED) after the bias.
    /// Every tensor-parallel rank applies it to the row it joined.
    pub mask: Option<std::sync::Arc<[u32]>>,
    /// Uniform in `[0, 1)`.
    pub uniform: f32,
}

impl SampleRow {
    /// Checks the draw, the history and the bias against a vocabulary of `vocab` ids.
    pub fn validate(&self, vocab: usize) -> crate::Result<()> {
        check_draw(self.uniform)?;
        if let Some(&t) = self.history.iter().find(|&&t| t as usize >= vocab) {
            return Err(crate::EngineError::InvalidInput(format!(
                "previous token id {t} is out of range (vocab size {vocab})"
            )));
        }
        if let Some(&(t, b)) = self.bias.iter().find(|&&(t, b)| t as usize >= vocab || !b.is_finite()) {
            return Err(crate::EngineError::InvalidInput(format!(
                "logit bias {b} of token id {t} is not a finite bias of a token (vocab size {vocab})"
            )));
        }
        if self.bias.windows(2).any(|w| w[0].0 >= w[1].0) {
            return Err(crate::EngineError::InvalidInput(
                "logit bias ids are not ascending and distinct".into(),
            ));
        }
        if let Some(mask) = self.mask.as_deref() {
            if mask.len() != vocab.div_ceil(32) || mask.iter().all(|&w| w == 0) {
                return Err(crate::EngineError::InvalidInput(format!(
                    "a token mask of {} words allowing {} ids does not fit a vocabulary of {vocab} ids",
                    mask.len(),
                    mask.iter().map(|w| w.count_ones()).sum::<u32>()
                )));
            }
        }
        Ok(())
    }

    /// Samples a whole-vocabulary logit row: the repetition penalty, the bias, the token mask, then the filters and
    /// the draw (the device kernels' CPU twin, so CPU and GPU ranks pick the same token, from whole rows or rows
    /// joined across ranks).
    pub fn sample(&self, row: &[f32]) -> u32 {
        let mut row = row.to_vec();
        if self.repetition_penalty != 1.0 {
            let mut seen = Vec::new();
            crate::sample::distinct_ids(&self.history, &mut seen);
            crate::sample::apply_repetition_penalty(&mut row, &seen, self.repetition_penalty);
        }
        crate::sample::apply_logit_bias(&mut row, &self.bias);
        if let Some(mask) = self.mask.as_deref() {
            rewind_kernels::cpu::sample::apply_token_mask(&mut row, mask);
        }
        rewind_kernels::cpu::sample::sample_row(
            &row,
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.uniform,
        )
    }
}

fn check_draw(u: f32) -> crate::Result<()> {
    if (0.0..1.0).contains(&u) {
        return Ok(());
    }
    Err(crate::EngineError::InvalidInput(format!(
        "uniform {u} is outside [0, 1)"
    )))
}

/// One sequence of a [`Program::Batch`].
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SeqStep {
    /// The sequence's slot (the coordinator's books hand slots out; a rank claims the slot at its first step).
    pub slot: usize,
    pub kind: SeqKind,
    /// The position of `tokens[0]`: the sequence's committed length, which every rank checks.
    pub position: usize,
    pub tokens: Vec<u32>,
    /// The decode form the sequence asked for; fixed at its first step.
    pub form: FormChoice,
    pub rows: Rows,
    /// Sample the (last) reported row on the rank. Needs `rows != Rows::None`.
    pub sample: Option<SampleRow>,
    /// A speculative verify's sampled acceptance: every reported row also gets its one-pass summary
    /// ([`RowSummary::spec`]); row `i`'s draft is `tokens[i + 1]` (the last row has none). Needs `Rows::All`.
    pub spec: Option<SpecSample>,
    /// Log-probabilities: every reported row also gets its top entries and a target's logit
    /// ([`RowPass::logprob`]); `None` (the common step) costs nothing.
    pub logprobs: Option<LogprobRows>,
}

/// What a sequence's reported rows ask for their log-probabilities: the `top` largest logits of each (0 ..=
/// [`MAX_TOP`](rewind_kernels::cpu::lm_head::MAX_TOP)) and per reported row the id whose logit to report: the next
/// prompt token for a prompt row, `None` for the row that picks the next token (its sampled token's logit comes from
/// the sampler, the argmax's from the summary).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LogprobRows {
    pub top: usize,
    /// One entry per reported row ([`SeqStep::row_count`]).
    pub targets: Vec<Option<u32>>,
}

/// The temperature and noise key of a verify's one-pass summaries (FlashSpec): per row the log-sum-exp of
/// `logit / temperature`, the drafted token's scaled logit and a Gumbel-max candidate excluding the draft, whose
/// noise is keyed by `(seed, index + row)` (see `rewind_kernels::cpu::lm_head`).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SpecSample {
    /// > 0 and finite.
    pub temperature: f32,
    pub seed: u64,
    /// The output-stream index of the token that row 0 predicts.
    pub index: u64,
}

impl SeqStep {
    /// How many positions this sequence reports on.
    pub fn row_count(&self) -> usize {
        match self.rows {
            Rows::None => 0,
            Rows::Last => 1,
            Rows::All => self.tokens.len(),
        }
    }

    /// How many final hidden rows this sequence returns when the batch asks for them ([`Batch::hidden`]): every
    /// token of a prefill chunk, so that a drafter running on them (an MTP layer) sees every prompt position, and
    /// the reported rows of a decode or verify. A prefill's extra rows are copies of the residual stream; no head
    /// runs over them.
    pub fn hidden_row_count(&self) -> usize {
        match self.kind {
            SeqKind::Prefill => self.tokens.len(),
            SeqKind::Decode | SeqKind::Verify => self.row_count(),
        }
    }

    /// The log-probability requests of the reported rows (`None` for each when the step asks for none).
    pub fn logprob_requests(&self) -> impl Iterator<Item = Option<LogprobRequest>> + '_ {
        (0..self.row_count()).map(move |i| {
            self.logprobs.as_ref().map(|l| LogprobRequest {
                top: l.top,
                target: l.targets.get(i).copied().flatten(),
            })
        })
    }

    /// The one-pass requests of the reported rows (`None` for each when the step asks for none): row `i` asks about
    /// the draft at `i + 1` (the last row, the bonus, has none) at output index `index + i`.
    pub fn spec_requests(&self) -> impl Iterator<Item = Option<SpecRequest>> + '_ {
        let n = self.row_count();
        let first = self.tokens.len() - n;
        (0..n).map(move |i| {
            self.spec.map(|sp| SpecRequest {
                draft: self.tokens.get(first + i + 1).copied(),
                temperature: sp.temperature,
                seed: sp.seed,
                index: sp.index + i as u64,
            })
        })
    }
}

/// Accepts the first `accepted` (0..=T) tokens of a slot's pending verify.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Commit {
    pub slot: usize,
    pub accepted: usize,
}

/// Everything one step does, identical for every rank: first the commits, then the program.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepPlan {
    pub commits: Vec<Commit>,
    pub program: Program,
}

/// What a step runs after its commits. Each kind of step is a variant carrying only its own fields, so a plan that
/// mixes what cannot go together (a chained prompt chunk, whole logits of a chain, a penalty whose history would
/// need the chained tokens on the host) cannot be written.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Program {
    /// One pass over a batch: prompt chunks, decodes and verifies mixed, each in its own form.
    Batch(Batch),
    /// Decode steps run back to back with no host round trip between them (like vLLM's multi-step scheduling).
    DecodeChain(DecodeChain),
    /// Verify steps run back to back: between them the ranks judge, commit and draft themselves (`super::spec_chain`).
    VerifyChain(VerifyChain),
}

/// A single step's sequences and what it returns besides the row summaries.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Batch {
    pub seqs: Vec<SeqStep>,
    /// Return each rank's slice of the reported rows' logits as well as the summaries.
    pub full_logits: bool,
    /// Return final hidden states (before the final norm; the same on every rank), for drafters that run on them
    /// (MTP): per sequence, in plan order, its [`SeqStep::hidden_row_count`] last rows. A rank that returns only the
    /// reported rows instead (the GPU rank, so far) still serves the MTP drafter, whose KV then starts at the last
    /// prompt row rather than at the prompt's start.
    pub hidden: bool,
    /// Sequences that run the rank's MTP layer ([`super::mtp`]): their rows feed its KV and it proposes the next
    /// window's drafts ([`StepOut::mtp`]). Needs a rank that loaded one ([`RankInfo::mtp`]).
    pub mtp: Vec<super::mtp::MtpRequest>,
}

/// `1 + steps` decode steps of the same sequences. Step `k` feeds each sequence the token step `k − 1` picked for it
/// (its sampled token, else the argmax over the whole vocabulary: tensor-parallel ranks merge their slices'
/// summaries among themselves) at the next position; on a GPU the pick stays on the device. The ranks answer
/// step-major: one row per sequence for step 0, then for step 1, and so on.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DecodeChain {
    pub seqs: Vec<ChainedDecode>,
    /// Further steps after the first: 1 ..= [`MAX_CHAINED`].
    pub steps: usize,
}

/// One sequence of a [`DecodeChain`].
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChainedDecode {
    pub slot: usize,
    /// The position of `token`: the sequence's committed length.
    pub position: usize,
    /// The first step's input token.
    pub token: u32,
    pub form: FormChoice,
    /// Sampled rather than greedy picks.
    pub sample: Option<ChainSample>,
}

/// A chained sequence's sampling: the filters of [`SampleRow`] (no penalty or bias: their history would need every
/// chained token on the host) and one draw per step of the chain.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChainSample {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// `1 + steps` draws in `[0, 1)`, in step order.
    pub draws: Vec<f32>,
}

impl ChainedDecode {
    /// Step `k` of the chain as a single decode fed `token` at `position + k`, reporting its last row.
    pub fn step(&self, k: usize, token: u32) -> SeqStep {
        SeqStep {
            slot: self.slot,
            kind: SeqKind::Decode,
            position: self.position + k,
            tokens: vec![token],
            form: self.form,
            rows: Rows::Last,
            sample: self.sample.as_ref().map(|s| s.row(k)),
            spec: None,
            logprobs: None,
        }
    }
}

impl ChainSample {
    /// The sampling of step `k` (its draw); greedy rows of a sampling chain use [`ChainSample::greedy`].
    pub fn row(&self, k: usize) -> SampleRow {
        SampleRow {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: 1.0,
            history: Vec::new(),
            bias: Vec::new(),
            mask: None,
            uniform: self.draws.get(k).copied().unwrap_or(0.0),
        }
    }
}

/// `1 + steps` verify steps of the same sequences, all of one window; see `super::spec_chain`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct VerifyChain {
    pub seqs: Vec<ChainedVerify>,
    /// Further steps after the first: at least 1. The ranks may end a chain early; the log says how many ran.
    pub steps: usize,
    pub drafter: super::spec_chain::ChainDrafter,
}

/// One sequence of a [`VerifyChain`], judged greedily or by sampling from its rows' one-pass summaries.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChainedVerify {
    pub slot: usize,
    /// The position of `tokens[0]`: the sequence's committed length after the plan's commits.
    pub position: usize,
    /// The first step's input token and drafts (`1 + T`, the same `T` for every sequence of the chain).
    pub tokens: Vec<u32>,
    pub form: FormChoice,
    /// Sampled acceptance from the one-pass summaries; `None`: greedy.
    pub spec: Option<SpecSample>,
    /// The stream so far, ending with `tokens[0]` (so its length is `position + 1`): the drafter reads it.
    pub stream: Vec<u32>,
    /// With [`ChainDrafter::Table`](super::spec_chain::ChainDrafter::Table): the proposal for each stream position
    /// (−1: none; a proposal run stops at the first −1). Empty otherwise.
    pub table: Vec<i32>,
}

impl ChainedVerify {
    /// The chain's first step of this sequence as a single verify reporting every row.
    pub fn step(&self) -> SeqStep {
        SeqStep {
            slot: self.slot,
            kind: SeqKind::Verify,
            position: self.position,
            tokens: self.tokens.clone(),
            form: self.form,
            rows: Rows::All,
            sample: None,
            spec: self.spec,
            logprobs: None,
        }
    }
}

/// A sequence of any program, as far as the books care: where it is, in which form, and how far its steps may reach.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSpan<'a> {
    pub slot: usize,
    pub position: usize,
    pub form: FormChoice,
    /// The tokens the sequence's first step runs.
    pub tokens: &'a [u32],
    /// Tokens its steps add to the context at most.
    pub span: usize,
    /// Whether its (last) step leaves a verify pending.
    pub verify: bool,
}

impl<'a> SeqSpan<'a> {
    /// A sequence whose `steps` steps each run `tokens` (a window) or its successor, the last leaving a verify
    /// pending when `verify`.
    fn of(slot: usize, position: usize, form: FormChoice, tokens: &'a [u32], steps: usize, verify: bool) -> Self {
        SeqSpan {
            slot,
            position,
            form,
            tokens,
            span: tokens.len() * steps,
            verify,
        }
    }
}

impl StepPlan {
    /// A single step of `seqs` with no commits, returning summaries only.
    pub fn batch(seqs: Vec<SeqStep>) -> Self {
        StepPlan {
            commits: Vec::new(),
            program: Program::Batch(Batch {
                seqs,
                ..Batch::default()
            }),
        }
    }

    /// A step that only commits.
    pub fn commits(commits: Vec<Commit>) -> Self {
        StepPlan {
            commits,
            program: Program::Batch(Batch::default()),
        }
    }

    /// A chain of `1 + steps` decodes of `seqs`, with no commits.
    pub fn decode_chain(seqs: Vec<ChainedDecode>, steps: usize) -> Self {
        StepPlan {
            commits: Vec::new(),
            program: Program::DecodeChain(DecodeChain { seqs, steps }),
        }
    }

    /// A chain of verifies, with no commits.
    pub fn verify_chain(chain: VerifyChain) -> Self {
        StepPlan {
            commits: Vec::new(),
            program: Program::VerifyChain(chain),
        }
    }

    /// This plan with `commits` run first.
    pub fn with_commits(mut self, commits: Vec<Commit>) -> Self {
        self.commits = commits;
        self
    }

    /// This plan asking for whole logit slices (a single step only; a chain is left as it is).
    pub fn with_logits(mut self, full_logits: bool) -> Self {
        if let Program::Batch(b) = &mut self.program {
            b.full_logits = full_logits;
        }
        self
    }

    /// The batch of a single step, if the plan is one.
    pub fn as_batch(&self) -> Option<&Batch> {
        match &self.program {
            Program::Batch(b) => Some(b),
            Program::DecodeChain(_) | Program::VerifyChain(_) => None,
        }
    }

    /// Whether the step asks for whole logit slices.
    pub fn full_logits(&self) -> bool {
        self.as_batch().is_some_and(|b| b.full_logits)
    }

    /// Whether the step asks for final hidden rows.
    pub fn hidden(&self) -> bool {
        self.as_batch().is_some_and(|b| b.hidden)
    }

    /// Further steps the ranks run after the first (0 for a single step).
    pub fn chained(&self) -> usize {
        match &self.program {
            Program::Batch(_) => 0,
            Program::DecodeChain(c) => c.steps,
            Program::VerifyChain(c) => c.steps,
        }
    }

    /// Sequences in the step.
    pub fn seq_count(&self) -> usize {
        match &self.program {
            Program::Batch(b) => b.seqs.len(),
            Program::DecodeChain(c) => c.seqs.len(),
            Program::VerifyChain(c) => c.seqs.len(),
        }
    }

    /// Every sequence as the books see it, in plan order.
    pub fn spans(&self) -> Vec<SeqSpan<'_>> {
        match &self.program {
            Program::Batch(b) => b
                .seqs
                .iter()
                .map(|s| SeqSpan::of(s.slot, s.position, s.form, &s.tokens, 1, s.kind == SeqKind::Verify))
                .collect(),
            Program::DecodeChain(c) => c
                .seqs
                .iter()
                .map(|s| {
                    SeqSpan::of(
                        s.slot,
                        s.position,
                        s.form,
                        std::slice::from_ref(&s.token),
                        1 + c.steps,
                        false,
                    )
                })
                .collect(),
            Program::VerifyChain(c) => c
                .seqs
                .iter()
                .map(|s| SeqSpan::of(s.slot, s.position, s.form, &s.tokens, 1 + c.steps, true))
                .collect(),
        }
    }

    /// How many rows the step reports, over all sequences and chained steps.
    pub fn row_count(&self) -> usize {
        match &self.program {
            Program::Batch(b) => b.seqs.iter().map(SeqStep::row_count).sum(),
            Program::DecodeChain(c) => c.seqs.len() * (1 + c.steps),
            Program::VerifyChain(c) => c.seqs.iter().map(|s| s.tokens.len()).sum::<usize>() * (1 + c.steps),
        }
    }

    /// How many final hidden rows the step returns when it asks for them ([`Batch::hidden`]).
    pub fn hidden_row_count(&self) -> usize {
        self.as_batch()
            .map_or(0, |b| b.seqs.iter().map(SeqStep::hidden_row_count).sum())
    }

    /// The tokens the step's first step runs through the model.
    pub fn token_count(&self) -> usize {
        self.spans().iter().map(|s| s.tokens.len()).sum()
    }
}

impl DecodeChain {
    /// Checks what the types leave open: a non-empty chain of 1 ..= `max_chained` further steps, each sampling
    /// sequence carrying one draw in `[0, 1)` per step.
    pub fn check(&self, max_chained: usize) -> crate::Result<()> {
        let bad = |m: String| {
            Err(crate::EngineError::InvalidInput(format!(
                "a plan chaining {} decode steps: {m}",
                self.steps
            )))
        };
        if self.steps == 0 {
            return bad("a chain needs at least one further step".into());
        }
        if self.steps > max_chained {
            return Err(crate::EngineError::NotSupported(format!(
                "a plan chaining {} decode steps: this backend chains at most {max_chained}",
                self.steps
            )));
        }
        if self.seqs.is_empty() {
            return bad("it holds no sequence".into());
        }
        for s in &self.seqs {
            if let Some(sample) = &s.sample {
                if sample.draws.len() != 1 + self.steps {
                    return bad(format!(
                        "slot {} carries {} draws for its {} steps",
                        s.slot,
                        sample.draws.len(),
                        1 + self.steps
                    ));
                }
                sample.draws.iter().try_for_each(|&u| check_draw(u))?;
            }
        }
        Ok(())
    }
}

/// A rank's answer for one reported row: the pass over its vocabulary slice (greedy token as a global id, its
/// logit, the slice's log-sum-exp, and the one-pass speculative summary when [`SeqStep::spec`] asked for it; a NaN
/// max when the row holds a NaN, which the coordinator turns into an error), and the token it sampled when the plan
/// asked it to sample the row.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RowSummary {
    pub pass: RowPass,
    pub sampled: Option<u32>,
}

impl From<RowPass> for RowSummary {
    /// A row's pass, not sampled.
    fn from(pass: RowPass) -> Self {
        RowSummary { pass, sampled: None }
    }
}

/// A rank's answer to a [`StepPlan`].
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepOut {
    /// The vocabulary ids this rank's summaries and logits cover.
    pub vocab: Range<usize>,
    /// One summary per reported row, in plan order.
    pub rows: Vec<RowSummary>,
    /// `[rows, vocab.len()]`, when the plan asked for the logits.
    pub logits: Option<Vec<f32>>,
    /// `[rows, hidden]` final hidden states, when the plan asked for them (the rows [`Batch::hidden`] names).
    pub hidden: Option<Vec<f32>>,
    /// What a chain of verifies drafted and judged ([`Program::VerifyChain`]; `None` otherwise).
    pub chain: Option<super::spec_chain::ChainLog>,
    /// The MTP layer's proposals, one per [`Batch::mtp`] request, in its order (the same on every rank).
    pub mtp: Vec<super::mtp::MtpProposal>,
}

/// What a rank reports about itself.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RankHealth {
    pub rank: usize,
    pub tp: usize,
    /// `cpu` or the GPU's name.
    pub device: String,
    /// Slots holding a sequence.
    pub slots_in_use: usize,
    /// Steps run since the rank was loaded.
    pub steps: u64,
    /// A GPU rank's CUDA-graph counters (`None` on the CPU).
    pub graphs: Option<GraphStats>,
    /// A GPU rank's device time by stage since it was loaded, when it profiles stages (`GpuOptions::stage_profile`;
    /// `None` otherwise and on the CPU).
    pub stages: Option<StageTimes>,
}

/// Device time of a rank's steps by stage, summed since the rank was loaded: `embed`; per block `mlp` or `moe`, or an
/// SSM block's `<kind> in_proj`, `<kind> conv`, `<kind> ssm` and `<kind> out` (kind `mamba2` or `gdn`), or an
/// attention block's `attention qkv`, `attention core` and `attention out` (`engine/src/gpu/forward.rs`); and `head`.
/// The difference of two reports ([`StageTimes::since`]) is what the steps between them spent where.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StageTimes {
    pub stages: std::collections::BTreeMap<String, StageTime>,
}

/// The stage a GPU rank that times its MTP work (`GpuOptions::time_mtp`) records each step's catch-up and draft loop
/// under, in [`RankHealth::stages`].
pub const MTP_DRAFT_STAGE: &str = "mtp draft";

/// One stage's total device time (nanoseconds) and how many times it ran (a layer kind runs once per such layer
/// and step).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StageTime {
    pub ns: u64,
    pub count: u64,
}

impl StageTimes {
    /// Adds one run of `stage` that took `ms` milliseconds.
    pub fn add(&mut self, stage: &str, ms: f64) {
        let t = self.stages.entry(stage.to_string()).or_default();
        t.ns += (ms.max(0.0) * 1e6).round() as u64;
        t.count += 1;
    }

    /// Adds every stage of `other` (another stretch of the same rank's steps).
    pub fn merge(&mut self, other: &StageTimes) {
        for (k, t) in &other.stages {
            let e = self.stages.entry(k.clone()).or_default();
            e.ns += t.ns;
            e.count += t.count;
        }
    }

    /// What was spent after `earlier` (a report of the same rank taken before this one); stages that did not run
    /// in between are left out.
    pub fn since(&self, earlier: &StageTimes) -> StageTimes {
        let stages = self
            .stages
            .iter()
            .filter_map(|(k, t)| {
                let e = earlier.stages.get(k).copied().unwrap_or_default();
                let d = StageTime {
                    ns: t.ns.saturating_sub(e.ns),
                    count: t.count.saturating_sub(e.count),
                };
                (d.count > 0).then(|| (k.clone(), d))
            })
            .collect();
        StageTimes { stages }
    }

    /// Total device time in milliseconds.
    pub fn total_ms(&self) -> f64 {
        self.stages.values().map(|t| t.ns as f64 / 1e6).sum()
    }
}

/// How a GPU rank's decode and verify steps ran: replays of captured CUDA graphs or eager launches
/// (`engine/src/gpu/graphs.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GraphStats {
    /// Whether steps are captured at all (`--no-cuda-graphs` turns it off).
    pub enabled: bool,
    /// Graphs captured, and replays of them.
    pub captured: u64,
    pub replayed: u64,
    /// Decode and verify steps run eagerly: a shape's first sighting, or every step with graphs off.
    pub eager: u64,
    /// Graphs dropped to bound how many a rank keeps.
    pub evicted: u64,
    /// Of `captured` and `replayed`: the MTP layer's draft loops and catch-ups (`engine/src/gpu/mtp.rs`).
    pub mtp_captured: u64,
    pub mtp_replayed: u64,
}

/// The most further decode steps a plan may chain ([`DecodeChain::steps`]) on a rank that chains: 16 steps in all,
/// as vLLM's multi-step scheduling tops out; past a few steps the saving per step is small and a stop is noticed late.
pub const MAX_CHAINED: usize = 15;

/// A rank's fixed capacity, reported once after loading; the coordinator's books are built from it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RankInfo {
    pub rank: usize,
    pub tp: usize,
    pub device: String,
    /// The vocabulary ids this rank's logits cover.
    pub vocab: Range<usize>,
    /// Sequence slots.
    pub slots: usize,
    /// The longest context a slot may reach.
    pub max_context: usize,
    /// The most tokens one verify may take (`T`; 0 when the rank cannot verify).
    pub max_verify: usize,
    /// The most sequences one step may hold (the activation buffers' rows); `None`: no limit.
    pub max_batch: Option<usize>,
    /// KV blocks shared by all slots and their size in tokens (0 blocks when the model has no attention layer).
    pub kv_blocks: usize,
    pub kv_block_size: usize,
    /// Whether the rank can run more than one prompt chunk per sequence (prefill at a position > 0).
    pub chunked_prefill: bool,
    /// The decode forms the rank runs.
    pub forms: Vec<FormChoice>,
    /// Whether [`Rank::snapshot`](super::Rank::snapshot) / restore work.
    pub snapshots: bool,
    /// Whether the rank computes the one-pass speculative summaries ([`SeqStep::spec`]).
    pub spec_summaries: bool,
    /// Whether the rank computes the log-probability summaries ([`SeqStep::logprobs`]).
    pub logprobs: bool,
    /// Whether the rank returns final hidden states ([`Batch::hidden`]).
    pub hidden_states: bool,
    /// Whether the rank loaded the checkpoint's MTP layer and drafts with it ([`Batch::mtp`]).
    pub mtp: bool,
    /// The most further decode steps one plan may chain on this rank ([`DecodeChain::steps`]; 0: none).
    pub max_chained: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_times_difference_is_what_ran_in_between() {
        let mut t = StageTimes::default();
        t.add("embed", 0.5);
        t.add("gdn", 1.25);
        let before = t.clone();
        t.add("embed", 0.5);
        t.add("gdn", 1.0);
        t.add("gdn", 2.0);
        t.add("head", 0.75);
        let d = t.since(&before);
        assert_eq!(d.stages.len(), 3, "{d:?}");
        assert_eq!(d.stages["embed"], StageTime { ns: 500_000, count: 1 });
        assert_eq!(
            d.stages["gdn"],
            StageTime {
                ns: 3_000_000,
                count: 2
            }
        );
        assert_eq!(d.stages["head"], StageTime { ns: 750_000, count: 1 });
        assert!((d.total_ms() - 4.25).abs() < 1e-9);
        // Nothing ran: nothing is reported.
        assert!(t.since(&t).stages.is_empty());
        // Two stretches merged are their sum.
        let mut both = before.clone();
        both.merge(&d);
        assert_eq!(both, t);
    }

    #[test]
    fn negative_event_times_count_as_zero() {
        let mut t = StageTimes::default();
        t.add("mlp", -0.001);
        assert_eq!(t.stages["mlp"], StageTime { ns: 0, count: 1 });
    }
}
