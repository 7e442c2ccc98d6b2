//! The typed messages between the coordinator and a rank: what one step asks for ([`StepPlan`]) and what a rank
//! answers ([`StepOut`]), plus the slot snapshot and health report of the [`Rank`](super::Rank) interface.
//!
//! Every rank receives the same plan. A rank answers for its own vocabulary slice only (compact per-position
//! summaries, and its slice of the logits when the plan asks for them); [`super::vocab`] merges the ranks' answers.

use std::ops::Range;

use rewind_kernels::cpu::lm_head::SpecRequest;

use crate::decode::FormChoice;

/// What a sequence does in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SeqKind {
    /// A prompt chunk: the chunked scans, committed. The first chunk of a slot (at position 0) starts the sequence in
    /// the plan's form; a later chunk continues it (its ring is folded into the checkpoint first).
    Prefill,
    /// One token, committed.
    Decode,
    /// `1 + T` tokens whose outputs are computed but not committed until a later plan's [`Commit`].
    Verify,
}

/// Which positions of a sequence's tokens the rank reports on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Rows {
    /// None (an intermediate prompt chunk).
    None,
    /// The last position only.
    #[default]
    Last,
    /// Every position (verification, `rewind logits`).
    All,
}

/// One row's sampling on the rank: the engine Sampler's filters (see `rewind_kernels::cpu::sample::sample_row`), the
/// repetition penalty over `history`, and the draw `uniform`. Under tensor parallelism every rank joins the row from
/// every rank's vocabulary slice and samples the whole row, so every rank draws the same token.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleRow {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    /// The context the penalty applies to (ignored when the penalty is 1).
    pub history: Vec<u32>,
    /// Uniform in `[0, 1)`.
    pub uniform: f32,
    /// The draws of the plan's chained steps ([`StepPlan::chained`]), one per further step in order, each in
    /// `[0, 1)`; empty for a plan that chains nothing.
    pub chained_uniforms: Vec<f32>,
}

impl SampleRow {
    /// Checks the draw and the history against a vocabulary of `vocab` ids.
    pub fn validate(&self, vocab: usize) -> crate::Result<()> {
        if let Some(u) = std::iter::once(&self.uniform)
            .chain(&self.chained_uniforms)
            .find(|u| !(0.0..1.0).contains(*u))
        {
            return Err(crate::EngineError::InvalidInput(format!(
                "uniform {u} is outside [0, 1)"
            )));
        }
        if let Some(&t) = self.history.iter().find(|&&t| t as usize >= vocab) {
            return Err(crate::EngineError::InvalidInput(format!(
                "previous token id {t} is out of range (vocab size {vocab})"
            )));
        }
        Ok(())
    }

    /// Samples a whole-vocabulary logit row: the repetition penalty, then the filters and the draw (the device
    /// kernel's CPU twin, so CPU and GPU ranks pick the same token, from whole rows or rows joined across ranks).
    pub fn sample(&self, row: &[f32]) -> u32 {
        let mut row = row.to_vec();
        if self.repetition_penalty != 1.0 {
            let mut seen = Vec::new();
            crate::sample::distinct_ids(&self.history, &mut seen);
            crate::sample::apply_repetition_penalty(&mut row, &seen, self.repetition_penalty);
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

/// One sequence of a step.
#[derive(Clone, Debug, PartialEq)]
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
}

/// The temperature and noise key of a verify's one-pass summaries (FlashSpec): per row the log-sum-exp of
/// `logit / temperature`, the drafted token's scaled logit and a Gumbel-max candidate excluding the draft, whose
/// noise is keyed by `(seed, index + row)` (see `rewind_kernels::cpu::lm_head`).
#[derive(Clone, Copy, Debug, PartialEq)]
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

    /// How many final hidden rows this sequence returns when the plan asks for them ([`StepPlan::hidden`]): every
    /// token of a prefill chunk, so that a drafter running on them (an MTP layer) sees every prompt position, and
    /// the reported rows of a decode or verify. A prefill's extra rows are copies of the residual stream; no head
    /// runs over them.
    pub fn hidden_row_count(&self) -> usize {
        match self.kind {
            SeqKind::Prefill => self.tokens.len(),
            SeqKind::Decode | SeqKind::Verify => self.row_count(),
        }
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Commit {
    pub slot: usize,
    pub accepted: usize,
}

/// Everything one step does, identical for every rank: first the commits, then the sequences in one batch (prefill
/// chunks, decodes and verifies mixed, each in its own form).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepPlan {
    pub commits: Vec<Commit>,
    pub seqs: Vec<SeqStep>,
    /// Return each rank's slice of the reported rows' logits as well as the summaries.
    pub full_logits: bool,
    /// Return final hidden states (before the final norm; the same on every rank), for drafters that run on them
    /// (MTP): per sequence, in plan order, its [`SeqStep::hidden_row_count`] last rows. A rank that returns only the
    /// reported rows instead (the GPU rank, so far) still serves the MTP drafter, whose KV then starts at the last
    /// prompt row rather than at the prompt's start.
    pub hidden: bool,
    /// Further decode steps every rank runs after this one with no host round trip between them (0: none; like
    /// vLLM's multi-step scheduling). Step `k` feeds each sequence the token step `k − 1` picked for it (its sampled
    /// token, else the argmax over the whole vocabulary: tensor-parallel ranks merge their slices' summaries among
    /// themselves) at the next position; on a GPU the pick stays on the device. The ranks answer step-major: the
    /// plan's rows for step 0, then those of step 1, and so on. See [`StepPlan::check_chain`] for what a chained plan
    /// may hold. With [`StepPlan::spec_chain`] the chained steps are verifies instead.
    pub chained: usize,
    /// Chain verifies rather than decodes (`super::spec_chain`): every sequence is a verify, judged greedily or by
    /// its one-pass summaries ([`SeqStep::spec`]), and the ranks judge, commit and draft between the steps
    /// themselves. They run at most `1 + chained` steps (a rank may stop
    /// a chain early; its [`StepOut::chain`] log says how many ran).
    pub spec_chain: Option<super::spec_chain::SpecChain>,
}

impl StepPlan {
    /// How many rows the step reports, over all sequences and chained steps.
    pub fn row_count(&self) -> usize {
        self.seqs.iter().map(SeqStep::row_count).sum::<usize>() * (1 + self.chained)
    }

    /// Tokens each sequence's steps add to its context at most: its tokens, plus one per chained decode step or a
    /// whole window per chained verify step.
    pub fn span(&self, seq: &SeqStep) -> usize {
        match seq.kind {
            SeqKind::Verify if self.spec_chain.is_some() => seq.tokens.len() * (1 + self.chained),
            _ => seq.tokens.len() + self.chained,
        }
    }

    /// Checks what a plan with chained steps may hold (nothing to check when it chains none): decodes only, each
    /// reporting its last row, with no speculative summaries, whole logits or hidden states, and every sampling row
    /// free of the repetition penalty (whose history would need the chained tokens on the host) and carrying one
    /// draw per chained step.
    pub fn check_chain(&self) -> crate::Result<()> {
        if self.chained == 0 || self.spec_chain.is_some() {
            return Ok(());
        }
        let bad = |m: String| {
            Err(crate::EngineError::InvalidInput(format!(
                "a plan chaining {} decode steps: {m}",
                self.chained
            )))
        };
        if self.chained > MAX_CHAINED {
            return bad(format!("at most {MAX_CHAINED} further steps chain"));
        }
        if self.seqs.is_empty() {
            return bad("it holds no sequence".into());
        }
        if self.full_logits || self.hidden {
            return bad("whole logits and hidden states are returned for single steps only".into());
        }
        for s in &self.seqs {
            if s.kind != SeqKind::Decode || s.rows != Rows::Last || s.spec.is_some() {
                return bad(format!(
                    "slot {} is not a decode reporting its last row (only decodes chain)",
                    s.slot
                ));
            }
            if let Some(sample) = &s.sample {
                if sample.repetition_penalty != 1.0 {
                    return bad(format!(
                        "slot {} asks for a repetition penalty, whose history needs every chained token on the host",
                        s.slot
                    ));
                }
                if sample.chained_uniforms.len() != self.chained {
                    return bad(format!(
                        "slot {} carries {} draws for its chained steps",
                        s.slot,
                        sample.chained_uniforms.len()
                    ));
                }
            }
        }
        Ok(())
    }

    /// How many final hidden rows the step returns when it asks for them ([`StepPlan::hidden`]).
    pub fn hidden_row_count(&self) -> usize {
        self.seqs.iter().map(SeqStep::hidden_row_count).sum()
    }

    /// The tokens the step runs through the model.
    pub fn token_count(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }
}

/// A rank's summary of one reported row over its vocabulary slice.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowSummary {
    /// The slice's greedy token (a global id): the lowest id among the largest logits.
    pub argmax: u32,
    /// Its logit; `Some(NaN)` when the row holds a NaN (the coordinator turns that into an error); `None` when the
    /// backend did not compute it.
    pub max_logit: Option<f32>,
    /// `log Σ exp(logit)` over the slice, where the backend computes it (both the CPU and GPU ranks do).
    pub log_sum_exp: Option<f32>,
    /// The sampled token, when the plan asked the rank to sample this row.
    pub sampled: Option<u32>,
    /// The one-pass speculative summary over the slice, when the plan asked for it ([`SeqStep::spec`]).
    pub spec: Option<rewind_kernels::cpu::lm_head::SpecSummary>,
}

impl From<rewind_kernels::cpu::lm_head::RowPass> for RowSummary {
    /// A one-pass summary of a row (no draw).
    fn from(p: rewind_kernels::cpu::lm_head::RowPass) -> Self {
        RowSummary {
            argmax: p.argmax,
            max_logit: Some(p.max),
            log_sum_exp: Some(p.lse),
            sampled: None,
            spec: p.spec,
        }
    }
}

/// A rank's answer to a [`StepPlan`].
#[derive(Clone, Debug, PartialEq)]
pub struct StepOut {
    /// The vocabulary ids this rank's summaries and logits cover.
    pub vocab: Range<usize>,
    /// One summary per reported row, in plan order.
    pub rows: Vec<RowSummary>,
    /// `[rows, vocab.len()]`, when the plan asked for the logits.
    pub logits: Option<Vec<f32>>,
    /// `[rows, hidden]` final hidden states, when the plan asked for them (the rows [`StepPlan::hidden`] names).
    pub hidden: Option<Vec<f32>>,
    /// What a chain of verifies drafted and judged ([`StepPlan::spec_chain`]; `None` otherwise).
    pub chain: Option<super::spec_chain::ChainLog>,
}

/// One slot's whole state on one rank, enough to continue the sequence in any slot of any rank with the same shard:
/// the SSM checkpoint, input ring and conv ring per SSM layer, the KV rows per attention layer, and the counters.
/// Rings are stored in logical order (oldest first), so a restore needs no particular physical layout.
#[derive(Clone, Debug, PartialEq)]
pub struct SlotSnapshot {
    pub form_choice: FormChoice,
    /// The slot's current form (`recurrent`, `replay` or `kv-only`).
    pub form: crate::state::DecodeForm,
    /// Committed tokens.
    pub position: usize,
    /// The slot's ring capacity (`L`, or `threshold + T` in the kv-only form).
    pub ring_capacity: usize,
    /// Committed ring entries (the same in every SSM layer).
    pub ring_len: usize,
    /// Per SSM layer.
    pub ssm: Vec<SsmSnapshot>,
    /// Per attention layer: keys and values of positions `0..position`, `[position, kv row]` each.
    pub kv: Vec<(Vec<f32>, Vec<f32>)>,
}

/// One SSM layer of a [`SlotSnapshot`].
#[derive(Clone, Debug, PartialEq)]
pub struct SsmSnapshot {
    /// The checkpoint state.
    pub state: Vec<f32>,
    /// The committed ring entries, oldest first, per ring field (`[entries, field width]` each).
    pub ring: Vec<Vec<f32>>,
    /// The `K − 1` committed conv rows, oldest first.
    pub conv: Vec<f32>,
}

/// What a rank reports about itself.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
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
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StageTimes {
    pub stages: std::collections::BTreeMap<String, StageTime>,
}

/// One stage's total device time (nanoseconds) and how many times it ran (a layer kind runs once per such layer
/// and step).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
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
}

/// The most further decode steps a plan may chain ([`StepPlan::chained`]) on a rank that chains: 16 steps in all,
/// as vLLM's multi-step scheduling tops out; past a few steps the saving per step is small and a stop is noticed late.
pub const MAX_CHAINED: usize = 15;

/// A rank's fixed capacity, reported once after loading; the coordinator's books are built from it.
#[derive(Clone, Debug, PartialEq, Eq)]
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
    /// Whether the rank returns final hidden states ([`StepPlan::hidden`]).
    pub hidden_states: bool,
    /// The most further decode steps one plan may chain on this rank ([`StepPlan::chained`]; 0: none).
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
