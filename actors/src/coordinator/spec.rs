//! Speculative decoding in the coordinator: each request's drafter proposes before the step is planned, the
//! scheduler turns a sampled decode into a verify of the input token and the drafts, and after the step the
//! verify's rows are judged ([`rewind_engine::spec::accept`]) into the accepted drafts and one more token. The
//! slot commits them at the start of the next step (a pointer move in the replay and kv-only forms).
//!
//! How a verify is judged depends on the request's sampling: greedy from the rows' argmax (a constrained greedy
//! request's drafts and the token after them checked against its grammar's masks, `grammar.rs`); a plain temperature
//! from the ranks' one-pass summaries (nothing of the vocabulary's size leaves a rank); the filters, adjusted logits
//! (penalties, a bias, `min_tokens`) or drafts sampled from a draft model from whole logit rows.

use std::sync::Arc;

use rewind_engine::decode::FormChoice;
use rewind_engine::grammar;
use rewind_engine::rank::spec_chain::chain_drafts;
use rewind_engine::rank::{Books, ChainDrafter, ChainedVerify, SeqStep, SpecSample, StepPlan, StepResult, VerifyChain};
use rewind_engine::sample::SamplingParams;
use rewind_engine::sched::{Chain, Step, StepWork};
use rewind_engine::spec::{
    accept_rows, accept_summaries, Acceptance, AcceptanceMeter, Draft, DraftInput, DraftRequest, Drafter,
    DrafterFactory, Drafting, HiddenRows, MtpProposal, MtpRequest, RowSampling, SpecStats,
};
use rewind_engine::{EngineError, Result};
use tracing::warn;

use super::grammar::{masked_greedy, RowMasks};
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
    /// Hidden states of committed positions not yet observed by the drafter (drafters that want them): rows wait
    /// here until the token after each is known.
    hidden: Option<HiddenRows>,
    /// The drafts proposed for the next step, and their `q` when sampled.
    drafts: Option<Draft>,
    /// Its verifies may chain on the ranks ([`rewind_engine::sched::Step::spec_chain`]): proposals are padded
    /// to the window, so that every sequence verifies the same window and a chain keeps one shape.
    on_ranks: bool,
    /// A constrained request: the masks of its next rows, from its drafts' check (`grammar.rs`).
    pub(super) row_masks: Option<RowMasks>,
    /// A constrained request's last verify yielded no token after its accepted drafts: the next step decodes that
    /// position with the mask instead of drafting (a verify would compute the same refused row again).
    decode_next: bool,
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
    if spec.factory.mtp_on_ranks() && !books.mtp() {
        return Err(EngineError::NotSupported(
            "--spec mtp drafts on the ranks, but these ranks did not load the MTP layer".into(),
        ));
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
    p.temperature > 0.0 && p.top_k == 0 && p.top_p >= 1.0 && p.min_p == 0.0 && !p.adjusts_logits()
}

impl LiveSpec {
    /// Speculation for a new request (its drafter is made when it first drafts).
    pub(super) fn new(spec: &EngineSpec, request: &DraftRequest<'_>, on_ranks: bool) -> Result<Self> {
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
            on_ranks,
            row_masks: None,
            decode_next: false,
        })
    }

    /// Records one verify of `drafted` drafts that accepted `accepted`: the acceptance meter, the request's counters
    /// and the engine's metrics.
    fn record(&mut self, drafted: usize, accepted: usize, metrics: &Metrics) {
        self.meter.record(drafted, accepted);
        self.stats.drafted += drafted;
        self.stats.accepted += accepted;
        self.stats.verifies += 1;
        Metrics::inc(&metrics.spec_verifies);
        Metrics::add(&metrics.spec_drafted, drafted as u64);
        Metrics::add(&metrics.spec_accepted, accepted as u64);
    }

    /// Hands the ranks' MTP proposal to the drafter (made now if the request has not drafted yet).
    fn offer(&mut self, proposal: &MtpProposal, params: &SamplingParams, seed: u64) -> Result<()> {
        self.drafter(params, seed)?.offer(proposal);
        Ok(())
    }

    /// What the sequence brings to its step's window ([`rewind_engine::spec::WindowPolicy::choose`]) with
    /// `remaining` tokens left to generate; `None` when its next step decodes whatever the window.
    pub(super) fn drafting(&self, remaining: usize) -> Option<Drafting> {
        (!self.decode_next).then(|| Drafting {
            acceptance: self.meter.rate(),
            cap: remaining.saturating_sub(1),
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
        self.row_masks = None;
        self.decode_next = false;
    }

    /// Records the hidden states of committed rows: appended to the rows still waiting when they continue them,
    /// replacing them otherwise (the drafter restarts its state at a gap).
    fn add_hidden(&mut self, rows: HiddenRows) {
        if !self.factory.wants_hidden() || rows.hidden == 0 || rows.rows.is_empty() {
            return;
        }
        match &mut self.hidden {
            Some(h) if h.hidden == rows.hidden && h.position + h.rows.len() / h.hidden == rows.position => {
                h.rows.extend_from_slice(&rows.rows);
            }
            slot => *slot = Some(rows),
        }
    }

    /// The request's drafter, made now if it was not yet.
    fn drafter(&mut self, params: &SamplingParams, seed: u64) -> Result<&mut Box<dyn Drafter>> {
        let d = match self.drafter.take() {
            Some(d) => d,
            None => self.factory.drafter(&DraftRequest {
                prompt: &self.prompt,
                params,
                seed,
                reference: self.reference.as_deref(),
            })?,
        };
        Ok(self.drafter.insert(d))
    }

    /// Hands the drafter the waiting hidden rows whose next token is in `tokens` (the sequence so far), so that its
    /// state (an MTP layer's KV) follows the target from the prompt's first chunk on; the rest keep waiting.
    fn feed(&mut self, tokens: &[u32], params: &SamplingParams, seed: u64) -> Result<()> {
        let Some(h) = self.hidden.take() else { return Ok(()) };
        let n = h.rows.len() / h.hidden.max(1);
        let known = n.min(tokens.len().saturating_sub(h.position + 1));
        if known == 0 {
            self.hidden = Some(h);
            return Ok(());
        }
        let (ready, rest) = h.rows.split_at(known * h.hidden);
        if !rest.is_empty() {
            self.hidden = Some(HiddenRows {
                position: h.position + known,
                hidden: h.hidden,
                rows: rest.to_vec(),
            });
        }
        let ready = HiddenRows {
            position: h.position,
            hidden: h.hidden,
            rows: ready.to_vec(),
        };
        self.drafter(params, seed)?.observe(tokens, &ready)
    }

    /// Announces a proposal of up to `max` drafts after `tokens` ([`Drafter::prepare`]), making the drafter first if
    /// needed and handing it the hidden rows it has not seen.
    fn prepare(&mut self, tokens: &[u32], max: usize, params: &SamplingParams, seed: u64) -> Result<()> {
        self.feed(tokens, params, seed)?;
        let hidden = self.hidden.clone();
        self.drafter(params, seed)?.prepare(&DraftInput {
            tokens,
            hidden: hidden.as_ref(),
            max,
        })
    }

    /// Proposes up to `max` drafts after `tokens` (announced with [`LiveSpec::prepare`]).
    fn propose(&mut self, tokens: &[u32], max: usize, params: &SamplingParams, seed: u64) -> Result<Draft> {
        self.feed(tokens, params, seed)?;
        let hidden = self.hidden.take();
        self.drafter(params, seed)?.propose(&DraftInput {
            tokens,
            hidden: hidden.as_ref(),
            max,
        })
    }
}

/// Where each sequence's final hidden rows lie in a step's output: rows of `width` values, per plan sequence its
/// first row and count. A rank returns every prefill row ([`SeqStep::hidden_row_count`]) or, as the GPU rank so far,
/// only the reported rows; the lengths tell which (they are equal only where the two agree).
pub(super) struct HiddenLayout {
    width: usize,
    spans: Vec<(usize, usize)>,
}

impl HiddenLayout {
    /// The layout of `result`'s hidden rows for `plan`, when it returned any of the drafters' `width`.
    pub(super) fn of(plan: &StepPlan, result: &StepResult, width: Option<usize>) -> Option<Self> {
        let (h, width) = (result.hidden.as_ref()?, width?);
        let seqs = &plan.as_batch()?.seqs;
        let counts: Vec<usize> = if h.len() == plan.hidden_row_count() * width {
            seqs.iter().map(SeqStep::hidden_row_count).collect()
        } else if h.len() == plan.row_count() * width {
            seqs.iter().map(SeqStep::row_count).collect()
        } else {
            warn!(
                values = h.len(),
                width, "the step's hidden rows match neither layout; the drafters get none"
            );
            return None;
        };
        let mut at = 0;
        let spans = counts
            .into_iter()
            .map(|n| {
                at += n;
                (at - n, n)
            })
            .collect();
        Some(HiddenLayout { width, spans })
    }

    /// Sequence `seq`'s rows, the last of which is position `last` (they end there).
    fn rows(&self, result: &StepResult, seq: usize, last: usize) -> Option<HiddenRows> {
        let (first, n) = *self.spans.get(seq)?;
        let h = result.hidden.as_ref()?;
        (n > 0).then(|| HiddenRows {
            position: last + 1 - n,
            hidden: self.width,
            rows: h[first * self.width..(first + n) * self.width].to_vec(),
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
        if p.temperature == 0.0 && (!p.adjusts_logits() || masked_greedy(p)) {
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

    /// The MTP requests of a step's sequences `seqs` (`planned`'s, in order): every sequence of a request whose
    /// ranks draft with the MTP layer, asking for the window the policy would give it now (every such step feeds
    /// the layer's KV, even when it drafts nothing).
    pub(super) fn mtp_requests(&self, planned: &Step, seqs: &[SeqStep]) -> Vec<MtpRequest> {
        let mtp: Vec<(u64, usize)> = planned
            .work
            .iter()
            .zip(seqs)
            .filter(|(p, s)| {
                // The layer needs every row of the step; a sequence stepping otherwise waits for its next step.
                s.hidden_row_count() == s.tokens.len()
                    && self
                        .live
                        .get(&p.id)
                        .and_then(|l| l.spec.as_ref())
                        .is_some_and(|sp| sp.factory.mtp_on_ranks())
            })
            .map(|(p, _)| (p.id, p.slot))
            .collect();
        if mtp.is_empty() {
            return Vec::new();
        }
        let ids: Vec<u64> = mtp.iter().map(|&(id, _)| id).collect();
        let Some(window) = self.step_window(&ids) else {
            return Vec::new();
        };
        let window = window.min(self.books.max_verify().saturating_sub(1));
        mtp.into_iter().map(|(_, slot)| MtpRequest { slot, window }).collect()
    }

    /// Hands each proposal of the ranks' MTP layer to its request's drafter.
    pub(super) fn offer_mtp(&mut self, planned: &Step, result: &StepResult) {
        for proposal in &result.mtp {
            let Some(p) = planned.work.iter().find(|p| p.slot == proposal.slot) else {
                continue;
            };
            let Some(l) = self.live.get_mut(&p.id) else { continue };
            let (params, seed) = (&l.params, l.seed);
            if let Some(s) = l.spec.as_mut() {
                if let Err(e) = s.offer(proposal, params, seed) {
                    warn!(request = p.id, %e, "dropping the ranks' MTP proposal");
                }
            }
        }
    }

    /// Asks every sequence about to sample for drafts, within the window policy and the tokens it may still
    /// generate. A drafter that fails fails its request alone.
    pub(super) async fn draft(&mut self) {
        let ready = self.sched.draft_ready();
        let Some(window) = self.step_window(&ready) else { return };
        let mut failed = Vec::new();
        // Every proposal is announced first, so that drafters sharing a model draft for the whole batch at once.
        let mut asked = Vec::with_capacity(ready.len());
        for id in ready {
            let Some(l) = self.live.get_mut(&id) else { continue };
            let Some(s) = l.spec.as_mut() else { continue };
            // The verify's last row always yields a token, so at most `remaining − 1` drafts can be used.
            let remaining = l.output.limit().saturating_sub(l.output.generated());
            let max = window.min(remaining.saturating_sub(1));
            s.drafts = None;
            s.row_masks = None;
            if std::mem::take(&mut s.decode_next) || max == 0 {
                continue;
            }
            match s.prepare(&l.history, max, &l.params, l.seed) {
                Ok(()) => asked.push((id, max)),
                Err(e) => failed.push((id, format!("the {} drafter failed: {e}", s.factory.kind().name()))),
            }
        }
        let mut proposed = Vec::with_capacity(asked.len());
        for (id, max) in asked {
            let Some(l) = self.live.get_mut(&id) else { continue };
            let Some(s) = l.spec.as_mut() else { continue };
            match s.propose(&l.history, max, &l.params, l.seed) {
                Ok(mut d) => {
                    d.tokens.truncate(max);
                    // A proposal is padded to the window so that windows match and verifies chain; none stays
                    // none (the step decodes, and decodes chain too).
                    if s.on_ranks && d.probs.is_none() && !d.tokens.is_empty() {
                        d.tokens = chain_drafts(&l.history, d.tokens, max);
                    }
                    if let Some(&bad) = d.tokens.iter().find(|&&t| t as usize >= self.info.vocab) {
                        failed.push((
                            id,
                            format!("the drafter proposed token id {bad}, outside the vocabulary"),
                        ));
                        continue;
                    }
                    proposed.push((id, d));
                }
                Err(e) => failed.push((id, format!("the {} drafter failed: {e}", s.factory.kind().name()))),
            }
        }
        let grammar_failed = self.cut_drafts(&mut proposed);
        for (id, d) in proposed {
            // Nothing left to verify (or its grammar failed): the step decodes.
            if d.tokens.is_empty() {
                continue;
            }
            if let Err(e) = self.sched.propose(id, d.tokens.clone()) {
                warn!(request = id, %e, "dropping drafts");
                continue;
            }
            if let Some(s) = self.live.get_mut(&id).and_then(|l| l.spec.as_mut()) {
                s.drafts = Some(d);
            }
        }
        for (id, error) in failed {
            self.fail(id, error).await;
        }
        for (id, error) in grammar_failed {
            self.fail_as(id, FailureKind::InvalidArgument, error).await;
        }
    }

    /// Fails request `id` alone (its slot is released).
    pub(super) async fn fail(&mut self, id: u64, error: String) {
        self.fail_as(id, FailureKind::Internal, error).await
    }

    /// Ends request `id` with a failure of `kind`, releasing its slot (and those of its other choices).
    pub(super) async fn fail_as(&mut self, id: u64, kind: FailureKind, error: String) {
        let mut slots = Vec::new();
        if let Some(l) = self.live.remove(&id) {
            Metrics::inc(&self.metrics.requests_failed);
            let _ = l.events.send(Event::failed(kind, error));
            // The request's other choices end with it.
            slots = self.drop_choices(l.request);
        }
        slots.extend(self.sched.cancel(id));
        self.release(&slots).await;
    }

    /// Judges request `id`'s verify of `tokens` at `position` from its rows `row..` of `result`: the accepted
    /// drafts and the token after them, in order. Records the acceptance with the scheduler and the counters, and
    /// the committed rows' hidden states (`hidden`: the step's layout and this sequence's index in the plan).
    pub(super) fn judge(
        &mut self,
        id: u64,
        position: usize,
        tokens: &[u32],
        result: &StepResult,
        row: usize,
        hidden: Option<(&HiddenLayout, usize)>,
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
        let row_masks = l.spec.as_mut().and_then(|s| s.row_masks.take());
        let q = l
            .spec
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
                    eos: &self.config.eos_token_ids,
                    seed: l.seed,
                    index,
                };
                accept_rows(&logits[row * vocab..(row + n) * vocab], vocab, drafts, q, &sampling)?
            }
        };
        // A constrained request's drafts are all allowed (cut before the verify), so an accepted one is the masked
        // argmax too; the token after them is taken only when its row's mask allows it (see `grammar.rs`).
        let unresolved = match (&l.grammar, judge) {
            (None, _) => false,
            (Some(_), Judge::Greedy) => {
                let mask = row_masks
                    .as_ref()
                    .filter(|m| m.tokens == l.history.len())
                    .and_then(|m| m.masks.get(a.accepted))
                    .ok_or_else(|| {
                        EngineError::InvalidInput(format!(
                            "request {id}'s verify has no grammar mask for its row {}",
                            a.accepted
                        ))
                    })?;
                !grammar::allows(mask, a.token)
            }
            (Some(_), _) => {
                return Err(EngineError::InvalidInput(format!(
                    "request {id} is constrained, and its verify can be judged exactly only greedily"
                )))
            }
        };
        // The verify's rows of its input token and the accepted drafts are committed; when no token follows them,
        // all but the last accepted token's (that position runs again).
        let committed = if unresolved { a.accepted } else { 1 + a.accepted };
        if let Some(s) = l.spec.as_mut() {
            s.record(drafts.len(), a.accepted, &self.metrics);
            s.drafts = None;
            s.decode_next = unresolved;
            if let Some(mut h) = hidden.and_then(|(layout, seq)| layout.rows(result, seq, position + n - 1)) {
                h.rows.truncate(committed * h.hidden);
                s.add_hidden(h);
            }
        }
        let mut out = drafts[..a.accepted].to_vec();
        let verified = if unresolved {
            Metrics::inc(&self.metrics.spec_grammar_unresolved);
            self.sched.verified_unresolved(id, a.accepted)
        } else {
            out.push(a.token);
            self.sched.verified(id, a.accepted)
        };
        verified.map_err(|e| EngineError::InvalidInput(e.to_string()))?;
        Ok(out)
    }

    /// How far a request's steps may chain on the ranks ([`rewind_engine::sched::Request::chain`]).
    ///
    /// Chained steps keep every pick on the ranks: none for a session's turn (its saved state must end at its last
    /// token, and a chain may run past a stop) or adjusted logits (a penalty, a bias, `min_tokens`: their history needs
    /// each token on the host).
    /// Decodes chain, greedy or sampled: the ranks draw a sampled row themselves, under tensor parallelism from the
    /// row they join from every rank's slice. A speculating request chains where its drafter's proposals can be made
    /// on the ranks (n-gram, oracle) and the form's verify commits by pointer moves (not the recurrent form's
    /// snapshot copy), and its verifies are judged greedily or from their one-pass summaries (plain temperature
    /// sampling, which the ranks key themselves step by step and merge over tensor parallelism).
    pub(super) fn may_chain(&self, params: &SamplingParams, speculate: bool, session: bool) -> Chain {
        chain_rule(&ChainAsk {
            greedy: params.temperature == 0.0,
            one_pass: plain_temperature(params) && self.books.spec_summaries(),
            pinned: session || params.adjusts_logits(),
            speculates: speculate && self.config.spec.is_some(),
            verifies_chain: self.config.decode_steps > 1
                && self.config.form != FormChoice::Recurrent
                && self.config.spec.as_ref().is_some_and(|s| s.factory.on_ranks()),
        })
    }

    /// A chain of verifies of the planned sequences ([`Program::VerifyChain`](rewind_engine::rank::Program::VerifyChain)): the drafter every sequence's
    /// request runs on the ranks, and each sequence's stream and draft table. A sequence whose drafter the ranks
    /// cannot run, or two that the ranks would draft differently, are an error (the scheduler chained them wrongly).
    pub(super) fn verify_chain(&mut self, planned: &Step) -> Result<VerifyChain> {
        let context = self.info.max_context;
        let (mut drafter, mut seqs) = (None, Vec::with_capacity(planned.work.len()));
        for p in &planned.work {
            let StepWork::Verify { position, tokens } = &p.work else {
                return Err(EngineError::InvalidInput(format!(
                    "request {} is not a verify, so it cannot join a chain of verifies",
                    p.id
                )));
            };
            let spec = self.spec_sample(p.id);
            let l = self
                .live
                .get_mut(&p.id)
                .ok_or_else(|| EngineError::InvalidInput(format!("request {} is gone", p.id)))?;
            let (params, seed) = (l.params.clone(), l.seed);
            let rule = l
                .spec
                .as_mut()
                .map(|s| s.drafter(&params, seed).map(|d| d.on_ranks(context)))
                .transpose()?
                .flatten()
                .ok_or_else(|| {
                    EngineError::InvalidInput(format!("request {}'s drafter cannot run on the ranks", p.id))
                })?;
            if *drafter.get_or_insert(rule.0) != rule.0 {
                return Err(EngineError::InvalidInput(
                    "a chain of verifies mixes drafters the ranks run differently".into(),
                ));
            }
            if l.history.len() != position + 1 {
                return Err(EngineError::InvalidInput(format!(
                    "request {}: its stream of {} tokens does not end at its verify's position {position}",
                    p.id,
                    l.history.len()
                )));
            }
            seqs.push(ChainedVerify {
                slot: p.slot,
                position: *position,
                tokens: tokens.clone(),
                form: self.config.form,
                spec,
                stream: l.history.clone(),
                table: if rule.0 == ChainDrafter::Table {
                    rule.1
                } else {
                    Vec::new()
                },
            });
        }
        Ok(VerifyChain {
            seqs,
            steps: planned.chained,
            drafter: drafter.ok_or_else(|| EngineError::InvalidInput("a chain of no verifies".into()))?,
        })
    }

    /// Request `id`'s part of a chain of verifies (plan sequence `seq` of `seqs`, windows of `t` tokens): every step's
    /// accepted drafts and the token after them, in order, from the ranks' log. Records the acceptance with the
    /// scheduler and the counters as single verifies do.
    pub(super) fn chain_judged(
        &mut self,
        id: u64,
        seq: usize,
        seqs: usize,
        t: usize,
        result: &StepResult,
    ) -> Result<Vec<u32>> {
        let log = result
            .chain
            .as_ref()
            .ok_or_else(|| EngineError::InvalidInput("a chain of verifies answered without its log".into()))?;
        let steps = log.accepted.len() / seqs.max(1);
        let w = t - 1;
        let l = self
            .live
            .get_mut(&id)
            .ok_or_else(|| EngineError::InvalidInput(format!("request {id} is gone")))?;
        // Steps past the request's last token ran on the ranks (a chain runs past it), but their tokens are dropped
        // and they count in no statistic.
        let remaining = l.output.limit().saturating_sub(l.output.generated());
        let mut accepted = Vec::with_capacity(steps);
        let mut out = Vec::new();
        for k in 0..steps {
            let i = k * seqs + seq;
            let a = log.accepted[i];
            accepted.push(a);
            if out.len() >= remaining {
                continue;
            }
            out.extend_from_slice(&log.drafts[i * w..i * w + a]);
            out.push(log.tokens[i]);
            if let Some(s) = l.spec.as_mut() {
                s.record(w, a, &self.metrics);
            }
        }
        if let Some(s) = l.spec.as_mut() {
            s.drafts = None;
        }
        self.sched
            .chain_verified(id, &accepted)
            .map_err(|e| EngineError::InvalidInput(e.to_string()))?;
        Ok(out)
    }

    /// Records the hidden rows of plan sequence `seq` (request `id`'s prefill chunk or decode, whose last token is
    /// at position `last`).
    pub(super) fn note_hidden(&mut self, id: u64, layout: &HiddenLayout, result: &StepResult, seq: usize, last: usize) {
        let Some(s) = self.live.get_mut(&id).and_then(|l| l.spec.as_mut()) else {
            return;
        };
        if let Some(rows) = layout.rows(result, seq, last) {
            s.add_hidden(rows);
        }
    }

    /// Hands every request in `ids` the hidden rows whose next token is now known (after the step's tokens were
    /// delivered); a drafter that fails fails its request alone.
    pub(super) fn feed_hidden(&mut self, ids: &[u64], failed: &mut Vec<(u64, String)>) {
        for &id in ids {
            let Some(l) = self.live.get_mut(&id) else { continue };
            let Some(s) = l.spec.as_mut() else { continue };
            if let Err(e) = s.feed(&l.history, &l.params, l.seed) {
                failed.push((id, format!("the {} drafter failed: {e}", s.factory.kind().name())));
            }
        }
    }

    /// The hidden-row width the drafters take, when they take any.
    pub(super) fn hidden_width(&self) -> Option<usize> {
        self.config.spec.as_ref().and_then(|s| s.factory.hidden_width())
    }

    /// Whether any live request's drafter wants hidden states.
    pub(super) fn wants_hidden(&self) -> bool {
        self.live
            .values()
            .any(|l| l.spec.as_ref().is_some_and(LiveSpec::wants_hidden))
    }
}

/// What [`CoordinatorState::may_chain`] decides from.
#[derive(Clone, Copy, Debug)]
struct ChainAsk {
    /// Temperature 0.
    greedy: bool,
    /// Plain temperature sampling, and ranks that give one-pass summaries: its verifies are judged from them.
    one_pass: bool,
    /// A session's turn or adjusted logits: every token must reach the host before the next step.
    pinned: bool,
    /// It speculates.
    speculates: bool,
    /// Verifies may chain at all: more than one step an engine step, a form that commits by pointer moves, and a
    /// drafter the ranks run.
    verifies_chain: bool,
}

/// Whether a request may chain ([`CoordinatorState::may_chain`]).
fn chain_rule(a: &ChainAsk) -> Chain {
    if a.pinned {
        return Chain::None;
    }
    if !a.speculates || ((a.greedy || a.one_pass) && a.verifies_chain) {
        return Chain::All;
    }
    Chain::None
}

#[cfg(test)]
#[path = "spec_tests.rs"]
mod tests;
