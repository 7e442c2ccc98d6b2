//! Speculative decoding in the coordinator: each request's drafter proposes before the step is planned, the
//! scheduler turns a sampled decode into a verify of the input token and the drafts, and after the step the
//! verify's rows are judged ([`rewind_engine::spec::accept`]) into the accepted drafts and one more token. The
//! slot commits them at the start of the next step (a pointer move in the replay and kv-only forms).
//!
//! How a verify is judged depends on the request's sampling: greedy from the rows' argmax; a plain temperature
//! from the ranks' one-pass summaries (nothing of the vocabulary's size leaves a rank); the filters, the repetition
//! penalty or drafts sampled from a draft model from whole logit rows.

use std::sync::Arc;

use rewind_engine::rank::{Books, SpecSample, StepResult};
use rewind_engine::sample::SamplingParams;
use rewind_engine::spec::{
    accept_rows, accept_summaries, Acceptance, AcceptanceMeter, Draft, DraftInput, DraftRequest, Drafter,
    DrafterFactory, HiddenRows, RowSampling, SpecStats,
};
use rewind_engine::{EngineError, Result};
use tracing::warn;

use super::{CoordinatorState, EngineSpec};
use crate::metrics::Metrics;
use crate::request::{Event, FailureKind};

/// A request's speculation state.
pub(super) struct LiveSpec {
    factory: Arc<dyn DrafterFactory>,
    /// Made when the request first drafts, dropped when its sequence leaves the ranks.
    drafter: Option<Box<dyn Drafter>>,
    prompt: Vec<u32>,
    reference: Option<Vec<u32>>,
    meter: AcceptanceMeter,
    pub(super) stats: SpecStats,
    /// Hidden states of the positions committed since the last proposal (drafters that want them).
    hidden: Option<HiddenRows>,
    /// The drafts proposed for the next step, and their `q` when sampled.
    drafts: Option<Draft>,
}

/// How a request's verify rows are judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Judge {
    Greedy,
    OnePass,
    Rows,
}

/// Checks that the ranks can run what the speculation settings ask.
pub(super) fn check_ranks(spec: &EngineSpec, books: &Books) -> Result<()> {
    let need = spec.config.max_verify();
    if books.max_verify() < need {
        return Err(EngineError::InvalidInput(format!(
            "--spec-window {} verifies {need} tokens a step, the ranks take at most {} (size the ranks' verify window \
             for the speculation window)",
            spec.config.window,
            books.max_verify()
        )));
    }
    if spec.factory.wants_hidden() && !books.hidden_states() {
        return Err(EngineError::NotSupported(format!(
            "the {} drafter runs on the target's hidden states, which this backend's ranks do not return",
            spec.factory.kind().name()
        )));
    }
    Ok(())
}

fn plain_temperature(p: &SamplingParams) -> bool {
    p.temperature > 0.0 && p.top_k == 0 && p.top_p >= 1.0 && p.min_p == 0.0 && p.repetition_penalty == 1.0
}

impl LiveSpec {
    /// Speculation for a new request (its drafter is made when it first drafts).
    pub(super) fn new(spec: &EngineSpec, request: &DraftRequest<'_>) -> Result<Self> {
        spec.factory.check(request)?;
        Ok(LiveSpec {
            factory: spec.factory.clone(),
            drafter: None,
            prompt: request.prompt.to_vec(),
            reference: request.reference.map(<[u32]>::to_vec),
            meter: AcceptanceMeter::default(),
            stats: SpecStats::default(),
            hidden: None,
            drafts: None,
        })
    }

    /// Whether the drafter needs hidden states.
    pub(super) fn wants_hidden(&self) -> bool {
        self.factory.wants_hidden()
    }

    /// Forgets state tied to the slot and drops the drafter (after a preemption or a recovery the sequence is
    /// rebuilt; a draft model's slot is freed meanwhile).
    pub(super) fn reset(&mut self) {
        self.hidden = None;
        self.drafts = None;
        self.drafter = None;
    }

    /// Records the hidden states of committed rows.
    pub(super) fn set_hidden(&mut self, hidden: Option<HiddenRows>) {
        if self.factory.wants_hidden() {
            self.hidden = hidden;
        }
    }

    /// Proposes up to `max` drafts after `tokens`, making the drafter first if needed.
    fn propose(&mut self, tokens: &[u32], max: usize, params: &SamplingParams, seed: u64) -> Result<Draft> {
        let drafter = match &mut self.drafter {
            Some(d) => d,
            None => self.drafter.insert(self.factory.drafter(&DraftRequest {
                prompt: &self.prompt,
                params,
                seed,
                reference: self.reference.as_deref(),
            })?),
        };
        drafter.propose(&DraftInput {
            tokens,
            hidden: self.hidden.as_ref(),
            max,
        })
    }
}

impl CoordinatorState {
    /// How request `id`'s verifies are judged.
    pub(super) fn judge_of(&self, id: u64) -> Judge {
        let Some(l) = self.live.get(&id) else {
            return Judge::Greedy;
        };
        let p = &l.params;
        let sampled_drafts = l
            .spec
            .as_ref()
            .is_some_and(|s| s.drafts.as_ref().is_some_and(|d| d.probs.is_some()));
        if p.temperature == 0.0 && p.repetition_penalty == 1.0 {
            Judge::Greedy
        } else if plain_temperature(p) && !sampled_drafts && self.books.spec_summaries() {
            Judge::OnePass
        } else {
            Judge::Rows
        }
    }

    /// The one-pass summary request of `id`'s verify, when it is judged that way.
    pub(super) fn spec_sample(&self, id: u64) -> Option<SpecSample> {
        let l = self.live.get(&id)?;
        (self.judge_of(id) == Judge::OnePass).then(|| SpecSample {
            temperature: l.params.temperature,
            seed: l.seed,
            index: l.output.generated() as u64,
        })
    }

    /// Asks every sequence about to sample for drafts, within the window policy and the tokens it may still
    /// generate. A drafter that fails fails its request alone.
    pub(super) async fn draft(&mut self) {
        let Some(policy) = self.window else { return };
        let ready = self.sched.draft_ready();
        let batch = self.sched.counts().1;
        let mut failed = Vec::new();
        for id in ready {
            let Some(l) = self.live.get_mut(&id) else { continue };
            let Some(s) = l.spec.as_mut() else { continue };
            // The verify's last row always yields a token, so at most `remaining − 1` drafts can be used.
            let remaining = l.output.limit().saturating_sub(l.output.generated());
            let max = policy.window(batch, s.meter.rate()).min(remaining.saturating_sub(1));
            s.drafts = None;
            if max == 0 {
                continue;
            }
            match s.propose(&l.history, max, &l.params, l.seed) {
                Ok(mut d) => {
                    d.tokens.truncate(max);
                    if let Some(&bad) = d.tokens.iter().find(|&&t| t as usize >= self.info.vocab) {
                        failed.push((
                            id,
                            format!("the drafter proposed token id {bad}, outside the vocabulary"),
                        ));
                        continue;
                    }
                    if let Err(e) = self.sched.propose(id, d.tokens.clone()) {
                        warn!(request = id, %e, "dropping drafts");
                        continue;
                    }
                    s.drafts = Some(d);
                }
                Err(e) => failed.push((id, format!("the {} drafter failed: {e}", s.factory.kind().name()))),
            }
        }
        for (id, error) in failed {
            self.fail(id, error).await;
        }
    }

    /// Fails request `id` alone (its slot is released).
    pub(super) async fn fail(&mut self, id: u64, error: String) {
        if let Some(l) = self.live.remove(&id) {
            Metrics::inc(&self.metrics.requests_failed);
            let _ = l.events.send(Event::failed(FailureKind::Internal, error));
        }
        if let Some(slot) = self.sched.cancel(id) {
            self.release(&[slot]).await;
        }
    }

    /// Judges request `id`'s verify of `tokens` at `position` from its rows `row..` of `result`: the accepted
    /// drafts and the token after them, in order. Records the acceptance with the scheduler and the counters.
    pub(super) fn judge(
        &mut self,
        id: u64,
        position: usize,
        tokens: &[u32],
        result: &StepResult,
        row: usize,
    ) -> Result<Vec<u32>> {
        let judge = self.judge_of(id);
        let vocab = self.info.vocab;
        let l = self
            .live
            .get_mut(&id)
            .ok_or_else(|| EngineError::InvalidInput(format!("request {id} is gone")))?;
        let drafts = &tokens[1..];
        let n = tokens.len();
        let index = l.output.generated() as u64;
        let s = l.spec.as_mut();
        let q = s
            .as_ref()
            .and_then(|s| s.drafts.as_ref())
            .and_then(|d| d.probs.as_deref());
        let q = q.map(|q| &q[..drafts.len().min(q.len())]);
        let a: Acceptance = match judge {
            Judge::Greedy => accept_summaries(&result.rows[row..row + n], drafts, None)?,
            Judge::OnePass => accept_summaries(&result.rows[row..row + n], drafts, Some((l.seed, index)))?,
            Judge::Rows => {
                let logits = result.logits.as_ref().ok_or_else(|| {
                    EngineError::InvalidInput("the step returned no logits for a verify judged on whole rows".into())
                })?;
                let sampling = RowSampling {
                    params: &l.params,
                    history: &l.history,
                    seed: l.seed,
                    index,
                };
                accept_rows(&logits[row * vocab..(row + n) * vocab], vocab, drafts, q, &sampling)?
            }
        };
        if let Some(s) = l.spec.as_mut() {
            s.meter.record(drafts.len(), a.accepted);
            s.stats.drafted += drafts.len();
            s.stats.accepted += a.accepted;
            s.stats.verifies += 1;
            s.drafts = None;
            if let Some(h) = &result.hidden {
                let width = h.len() / result.rows.len().max(1);
                s.set_hidden(Some(HiddenRows {
                    position,
                    hidden: width,
                    rows: h[row * width..(row + 1 + a.accepted) * width].to_vec(),
                }));
            }
        }
        Metrics::inc(&self.metrics.spec_verifies);
        Metrics::add(&self.metrics.spec_drafted, drafts.len() as u64);
        Metrics::add(&self.metrics.spec_accepted, a.accepted as u64);
        self.sched
            .verified(id, a.accepted)
            .map_err(|e| EngineError::InvalidInput(e.to_string()))?;
        let mut out = drafts[..a.accepted].to_vec();
        out.push(a.token);
        Ok(out)
    }

    /// Records the hidden state of a sampled decode or prompt row (`position` is the row's).
    pub(super) fn note_hidden(&mut self, id: u64, position: usize, result: &StepResult, row: usize) {
        let Some(h) = &result.hidden else { return };
        let Some(s) = self.live.get_mut(&id).and_then(|l| l.spec.as_mut()) else {
            return;
        };
        let width = h.len() / result.rows.len().max(1);
        s.set_hidden(Some(HiddenRows {
            position,
            hidden: width,
            rows: h[row * width..(row + 1) * width].to_vec(),
        }));
    }

    /// Whether any live request's drafter wants hidden states.
    pub(super) fn wants_hidden(&self) -> bool {
        self.live
            .values()
            .any(|l| l.spec.as_ref().is_some_and(LiveSpec::wants_hidden))
    }
}
