//! The coordinator's step: admit and plan with the scheduler, run the plan on every rank, stream the sampled
//! tokens, release what finished. Also submission and cancellation.

use std::time::Instant;

use ractor::ActorRef;
use rewind_engine::rank::{
    finish, prepare, Batch, ChainSample, ChainedDecode, Commit, DecodeChain, Program, Rows, SampleRow, SeqKind,
    SeqStep, StepPlan, StepResult, MAX_TOP,
};
use rewind_engine::sample::Sampler;
use rewind_engine::sched::{OutputStream, Planned, Request, Step, StepWork};
use rewind_engine::spec::DraftRequest;
use rewind_engine::EngineError;
use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, info_span, warn, Instrument};

use super::choices::Sequence;
use super::grammar::StepMasks;
use super::logprobs::{entry, LiveLogprobs, Reporting};
use super::prefix::PrefixSave;
use super::spec::{HiddenLayout, Judge, LiveSpec};
use super::{CoordinatorMsg, CoordinatorState, Fault, Live, Save};
use crate::metrics::Metrics;
use crate::rank_actor::RankActorMsg;
use crate::request::{Event, FailureKind, GenerateRequest, RequestTiming, StepStats, TokenLogprob, Usage};

impl CoordinatorState {
    /// Takes a request, or fails it alone with a clear error.
    pub(super) fn submit(&mut self, id: u64, request: GenerateRequest, events: UnboundedSender<Event>) {
        if let Err((kind, error)) = self.admit(id, request, &events) {
            Metrics::inc(&self.metrics.requests_failed);
            let _ = events.send(Event::failed(kind, error));
        }
    }

    fn admit(
        &mut self,
        id: u64,
        mut request: GenerateRequest,
        events: &UnboundedSender<Event>,
    ) -> Result<(), (FailureKind, String)> {
        let refused = |e: EngineError| (FailureKind::of(&e), e.to_string());
        if let Some(why) = &self.broken {
            return Err((FailureKind::Unavailable, why.clone()));
        }
        let waiting = self.sched.counts().0;
        if waiting >= self.config.max_waiting {
            Metrics::inc(&self.metrics.requests_refused);
            return Err((
                FailureKind::ResourceExhausted,
                format!("the engine is full: {waiting} requests are waiting (the limit); retry later"),
            ));
        }
        if let Some((i, &t)) = request
            .prompt
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= self.info.vocab)
        {
            return Err(refused(EngineError::InvalidInput(format!(
                "prompt token id {t} at index {i} is out of range (vocab size {})",
                self.info.vocab
            ))));
        }
        self.check_choices(&request).map_err(refused)?;
        check_logprobs(&request).map_err(refused)?;
        // A turn runs on the session's tokens and starts from its saved state. A refused turn leaves the session
        // idle: it is busy only while its request is live.
        let (request, turn) = match request.session.take() {
            Some(sid) => {
                let t = self.begin_turn(request.owner, &sid, id, &request.prompt, request.speculate)?;
                let request = GenerateRequest {
                    prompt: t.prompt,
                    speculate: t.speculate,
                    ..request
                };
                (request, Some((t.session, t.restored)))
            }
            None => (request, None),
        };
        self.admit_sequence(id, request, turn, events).map_err(refused)
    }

    /// Queues a sequence (a plain request, or a session's turn with its session and restored tokens).
    fn admit_sequence(
        &mut self,
        id: u64,
        request: GenerateRequest,
        turn: Option<(super::sessions::LiveSession, usize)>,
        events: &UnboundedSender<Event>,
    ) -> rewind_engine::Result<()> {
        let GenerateRequest {
            prompt,
            mut params,
            priority,
            reference,
            speculate,
            session: _,
            owner: _,
            n,
            logprobs,
            prompt_logprobs,
        } = request;
        // Scoring a prompt (`max_tokens: 0` with its log-probabilities): the prefill's picking row runs as for one
        // token, which is dropped.
        let prompt_only = prompt_logprobs.is_some() && params.max_tokens == Some(0);
        if prompt_only {
            params.max_tokens = Some(1);
        }
        params.validate(self.info.vocab)?;
        let logprobs = LiveLogprobs::new(logprobs, prompt_logprobs, &prompt, prompt_only);
        if logprobs.is_some() && !self.books.logprobs() {
            return Err(EngineError::InvalidInput(
                "log-probabilities are not supported on this backend (its LM-head passes compute no top entries; \
                 the CPU backend does)"
                    .into(),
            ));
        }
        // A constrained request speculates when its verifies can be judged exactly against its grammar (greedily,
        // `grammar.rs`). A request asking for log-probabilities neither chains nor speculates: each of its tokens
        // then comes from one step's row that the plan asked about (a chained or verified token's row carries none).
        let speculate = speculate && super::grammar::may_speculate(&params) && logprobs.is_none();
        let (session, restored) = match turn {
            Some((s, n)) => (Some(s), n),
            None => (None, 0),
        };
        if prompt.is_empty() {
            return Err(EngineError::InvalidInput(
                "the prompt is empty (no tokens to start from)".into(),
            ));
        }
        let room = self.info.max_context.saturating_sub(prompt.len());
        if room == 0 {
            return Err(EngineError::InvalidInput(format!(
                "the prompt's {} tokens leave no room to generate within the context limit of {} (the pools' length, \
                 at most the model's max_position_embeddings)",
                prompt.len(),
                self.info.max_context
            )));
        }
        if let Some(m) = params.max_tokens.filter(|&m| m > room) {
            return Err(EngineError::InvalidInput(format!(
                "max_tokens {m} and the prompt's {} tokens exceed the context limit of {} (the pools' length, at \
                 most the model's max_position_embeddings; at most {room} tokens can be generated)",
                prompt.len(),
                self.info.max_context
            )));
        }
        // A request starts from the longest cached prefix of its prompt (a session's turn only when its session has
        // no saved state). A request asking for log-probabilities computes its whole prompt, so that its values are
        // a cold run's to the last bit (a restored state differs from a prefilled one in rounding), and scoring a
        // prompt needs every prompt row; `n > 1` leaves the fork prefill (the prompt but its last token) at least
        // one token to run.
        let (mut restored, mut fork) = (restored, None);
        if restored == 0 && logprobs.is_none() {
            let limit = prompt.len().saturating_sub(if n > 1 { 2 } else { 1 });
            if let Some((state, q)) = self.prefix_hit(id, &prompt, limit) {
                (restored, fork) = (q, Some((state, q)));
            }
        }
        let seq = Sequence {
            request: id,
            choice: 0,
            prompt,
            params,
            seed: None,
            priority,
            reference,
            speculate,
            restored,
            session,
            fork,
            cached: restored,
            forking: None,
            logprobs,
            submitted: Instant::now(),
        };
        if n > 1 {
            return self.admit_choices(id, n, seq, events);
        }
        // Not for a request asking for log-probabilities: its prompt runs in a cold run's chunks.
        let branch = match seq.logprobs {
            None => self.prefix_branch(&seq.prompt, restored),
            Some(_) => None,
        };
        let seed = seq.params.seed;
        self.queue(id, Sequence { seed, ..seq }, events)?;
        if let Some(at) = branch.filter(|&at| self.sched.cut_at(id, at)) {
            if let Some(l) = self.live.get_mut(&id) {
                l.cut = Some(at);
            }
        }
        Metrics::inc(&self.metrics.requests_submitted);
        self.gauges();
        Ok(())
    }

    /// Queues sequence `id` with the scheduler and makes it live: a request's only choice, one of its `n`
    /// choices, or its fork's prefill (see `choices.rs`).
    pub(super) fn queue(
        &mut self,
        id: u64,
        seq: Sequence,
        events: &UnboundedSender<Event>,
    ) -> rewind_engine::Result<()> {
        let Sequence {
            request,
            choice,
            prompt,
            params,
            seed,
            priority,
            reference,
            speculate,
            restored,
            session,
            fork,
            cached,
            forking,
            logprobs,
            submitted,
        } = seq;
        let room = self.info.max_context.saturating_sub(prompt.len());
        let chain = self.may_chain(&params, speculate, session.is_some() || logprobs.is_some());
        let output = OutputStream::new(
            self.config.tokenizer.as_ref(),
            &params,
            &self.config.eos_token_ids,
            room,
        );
        self.sched
            .submit(Request {
                id,
                prompt: prompt.clone(),
                max_tokens: output.limit(),
                priority,
                restored,
                chain,
            })
            .map_err(|e| EngineError::InvalidInput(e.to_string()))?;
        let (prompt_len, limit) = (prompt.len(), output.limit());
        let seed = seed.unwrap_or_else(|| {
            // A fresh seed per sequence, reproducible from the event stream (it is reported at the end).
            Sampler::new(params.clone()).map(|s| s.seed()).unwrap_or(id)
        });
        let spec = match self.config.spec.as_ref().filter(|_| speculate) {
            Some(s) => Some(LiveSpec::new(
                s,
                &DraftRequest {
                    prompt: &prompt,
                    params: &params,
                    seed,
                    reference: reference.as_deref(),
                },
                chain.chains(),
            )?),
            None => None,
        };
        let span = info_span!(
            "request",
            id = request,
            choice,
            prompt_tokens = prompt_len,
            max_tokens = limit,
            restored
        );
        let grammar = params
            .constraint
            .as_ref()
            .map(|c| super::grammar::LiveGrammar::new(c.start()));
        self.live.insert(
            id,
            Live {
                events: events.clone(),
                output,
                params,
                seed,
                prompt_len: prompt.len(),
                history: prompt,
                submitted,
                first_token: None,
                retries: Default::default(),
                preemptions: 0,
                recoveries: 0,
                span,
                spec,
                session,
                request,
                choice,
                fork,
                cached,
                cut: None,
                forking,
                grammar,
                logprobs,
            },
        );
        Ok(())
    }

    /// Drops a request wherever it is (its client went away).
    /// Every choice of it ends.
    pub(super) async fn cancel(&mut self, id: u64) {
        if !self.choices_left(id) {
            return;
        }
        Metrics::inc(&self.metrics.requests_cancelled);
        let slots = self.drop_choices(id);
        self.release(&slots).await;
        self.gauges();
    }

    /// Ends the sequences in `slots` on every rank; a rank that fails to is a fault.
    pub(super) async fn release(&mut self, slots: &[usize]) {
        for &slot in slots {
            // A slot that never ran a step is only in the books.
            let started = self.books.started(slot);
            let _ = self.books.close(slot);
            if !started {
                continue;
            }
            let Some(g) = &self.ranks else { return };
            if let Err(f) = g
                .call(|r| RankActorMsg::Release(slot, r), self.config.step_deadline)
                .await
            {
                self.pending_fault.get_or_insert(f);
                return;
            }
        }
    }

    pub(super) fn gauges(&self) {
        let m = &self.metrics;
        let (waiting, running) = self.sched.counts();
        let (slots, blocks) = self.sched.free();
        Metrics::set(&m.queue_depth, waiting as u64);
        Metrics::set(&m.running, running as u64);
        Metrics::set(&m.free_slots, slots as u64);
        Metrics::set(&m.free_kv_blocks, blocks as u64);
    }

    /// The sampling row of `id`'s next token; `None` for greedy decoding that changes no logit (the argmax).
    fn sample_row(&self, id: u64, masks: &StepMasks) -> Option<SampleRow> {
        let l = self.live.get(&id)?;
        let p = &l.params;
        if p.temperature == 0.0 && !p.adjusts_logits() {
            return None;
        }
        let generated = &l.history[l.history.len().saturating_sub(l.output.generated())..];
        let mut bias = Vec::new();
        p.logit_bias_at(generated, &self.config.eos_token_ids, &mut bias);
        Some(SampleRow {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            history: if p.repetition_penalty != 1.0 {
                l.history.clone()
            } else {
                Vec::new()
            },
            bias,
            mask: masks.masks.get(&id).cloned(),
            uniform: Sampler::draw_at(l.seed, l.output.generated() as u64),
        })
    }

    /// The sampling of `id`'s next `1 + steps` tokens in a chain of decodes; `None` for greedy decoding. The
    /// scheduler chains no request that adjusts its logits (a penalty, a bias, `min_tokens`: their history would need
    /// every chained token here).
    fn chain_sample(&self, id: u64, steps: usize) -> Option<ChainSample> {
        let l = self.live.get(&id)?;
        let p = &l.params;
        (p.temperature != 0.0).then(|| ChainSample {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            draws: (0..=steps)
                .map(|k| Sampler::draw_at(l.seed, (l.output.generated() + k) as u64))
                .collect(),
        })
    }

    fn seq_step(&self, p: &Planned, masks: &StepMasks) -> SeqStep {
        let (kind, position, tokens) = match &p.work {
            StepWork::Prefill { position, tokens, .. } => (SeqKind::Prefill, *position, tokens.clone()),
            StepWork::Decode { position, token, .. } => (SeqKind::Decode, *position, vec![*token]),
            StepWork::Verify { position, tokens } => {
                return SeqStep {
                    slot: p.slot,
                    kind: SeqKind::Verify,
                    position: *position,
                    tokens: tokens.clone(),
                    form: self.config.form,
                    rows: Rows::All,
                    sample: None,
                    spec: self.spec_sample(p.id),
                    logprobs: None,
                };
            }
        };
        let samples = p.samples();
        let lp = self.live.get(&p.id).and_then(|l| l.logprobs.as_ref());
        let report = match (lp, kind) {
            (Some(lp), SeqKind::Prefill) => lp.prefill(position, tokens.len(), samples),
            (Some(lp), _) => Reporting {
                rows: Rows::Last,
                logprobs: lp.decode(),
            },
            (None, _) => Reporting {
                rows: if samples { Rows::Last } else { Rows::None },
                logprobs: None,
            },
        };
        SeqStep {
            slot: p.slot,
            kind,
            position,
            tokens,
            form: self.config.form,
            rows: report.rows,
            sample: if samples { self.sample_row(p.id, masks) } else { None },
            spec: None,
            logprobs: report.logprobs,
        }
    }

    /// One step, in its phases: recover from a fault left by the last one, let the drafters propose, schedule,
    /// build the plan, run it on every rank, and deliver its tokens. A phase that fails hands the fault to recovery
    /// with the requests the step involved.
    pub(super) async fn step(&mut self, _myself: &ActorRef<CoordinatorMsg>) {
        if let Some(f) = self.pending_fault.take() {
            self.recover(f, &[]).await;
        }
        if self.ranks.is_none() {
            return;
        }
        self.draft().await;
        let Some(planned) = self.schedule_step().await else {
            return;
        };
        let ids = involved(&planned);
        let masks = self.grammar_masks(&planned).await;
        let plan = match self.build_plan(&planned, &masks) {
            Ok(plan) => plan,
            Err(f) => return self.recover(f, &ids).await,
        };
        self.index += 1;
        let (index, seqs, tokens) = (self.index, plan.seq_count(), step_tokens(&plan));
        let span = info_span!("engine_step", step = index, seqs, tokens);
        // While the ranks run the step, the masks of constrained requests that do not sample in it are computed.
        let sampling: Vec<u64> = planned.work.iter().filter(|p| p.samples()).map(|p| p.id).collect();
        self.start_masks_ahead(|id, _| !sampling.contains(&id));
        let t0 = Instant::now();
        let ran = self.run(index, &plan).instrument(span).await;
        self.join_masks_ahead().await;
        let result = match ran {
            Ok(r) => r,
            Err(f) => return self.recover(f, &ids).await,
        };
        for &(id, end) in &ids {
            if let Some(l) = self.live.get_mut(&id) {
                l.retries.succeeded(end);
            }
        }
        let stats = StepStats {
            index,
            seqs,
            tokens,
            seconds: t0.elapsed().as_secs_f64(),
        };
        self.step_metrics(&planned, &plan, &result, stats);
        self.measure_step(&planned, &result, stats.seconds);
        self.deliver_step(&planned, &plan, &result, stats, masks.failed).await;
    }

    /// The schedule phase: the scheduler's next step, with the preempted sequences released, the fresh ones
    /// opened in the books and the restored ones restored on the ranks. `None` when there is nothing to run (or a
    /// fault was handed to recovery).
    async fn schedule_step(&mut self) -> Option<Step> {
        let planned = self.sched.schedule();
        if !planned.preempted.is_empty() {
            Metrics::add(&self.metrics.preemptions, planned.preempted.len() as u64);
            let slots: Vec<usize> = planned
                .preempted
                .iter()
                .map(|&(id, slot)| {
                    if let Some(l) = self.live.get_mut(&id) {
                        l.preemptions += 1;
                        if let Some(s) = l.spec.as_mut() {
                            s.reset();
                        }
                    }
                    slot
                })
                .collect();
            self.release(&slots).await;
            if let Some(f) = self.pending_fault.take() {
                self.recover(f, &involved(&planned)).await;
                return None;
            }
        }
        if planned.work.is_empty() && planned.commits.is_empty() {
            self.gauges();
            return None;
        }
        for p in planned.work.iter().filter(|p| p.fresh) {
            if let Err(e) = self.books.open_at(p.slot, self.config.form) {
                // The scheduler and the books disagree: a bug, charged to the whole step as a fault.
                self.recover(
                    Fault::Rank(0, format!("opening slot {}: {e}", p.slot), false),
                    &involved(&planned),
                )
                .await;
                return None;
            }
        }
        let restores: Vec<(u64, usize)> = planned
            .work
            .iter()
            .filter(|p| p.fresh && p.restored > 0)
            .map(|p| (p.id, p.slot))
            .collect();
        if let Err(f) = self.restore(&restores).await {
            self.recover(f, &involved(&planned)).await;
            return None;
        }
        let restored: usize = planned.work.iter().filter(|p| p.fresh).map(|p| p.restored).sum();
        Metrics::add(&self.metrics.restored_tokens, restored as u64);
        Some(planned)
    }

    /// The build phase: the scheduler's step as the program every rank runs. A chain the ranks cannot run is the
    /// scheduler's bug, charged to the step as a fault.
    fn build_plan(&mut self, planned: &Step, masks: &StepMasks) -> Result<StepPlan, Fault> {
        let commits = planned
            .commits
            .iter()
            .map(|&(slot, accepted)| Commit { slot, accepted })
            .collect();
        let program = if planned.spec_chain {
            Program::VerifyChain(
                self.verify_chain(planned)
                    .map_err(|e| Fault::Rank(0, e.to_string(), false))?,
            )
        } else if planned.chained > 0 {
            let seqs = planned
                .work
                .iter()
                .map(|p| match &p.work {
                    StepWork::Decode { position, token, .. } => Ok(ChainedDecode {
                        slot: p.slot,
                        position: *position,
                        token: *token,
                        form: self.config.form,
                        sample: self.chain_sample(p.id, planned.chained),
                    }),
                    StepWork::Prefill { .. } | StepWork::Verify { .. } => Err(Fault::Rank(
                        0,
                        format!("the scheduler chained request {}, which is not a decode", p.id),
                        false,
                    )),
                })
                .collect::<Result<_, _>>()?;
            Program::DecodeChain(DecodeChain {
                seqs,
                steps: planned.chained,
            })
        } else {
            let seqs: Vec<SeqStep> = planned.work.iter().map(|p| self.seq_step(p, masks)).collect();
            let mtp = self.mtp_requests(planned, &seqs);
            Program::Batch(Batch {
                seqs,
                full_logits: planned
                    .work
                    .iter()
                    .any(|p| matches!(p.work, StepWork::Verify { .. }) && self.judge_of(p.id) == Judge::Rows),
                hidden: self.wants_hidden(),
                mtp,
            })
        };
        Ok(StepPlan { commits, program })
    }

    /// The run phase's counters and gauges.
    fn step_metrics(&self, planned: &Step, plan: &StepPlan, result: &StepResult, stats: StepStats) {
        let m = &self.metrics;
        Metrics::inc(&m.steps);
        match (&plan.program, &result.chain) {
            // The steps the ranks ran (they may end a chain of verifies early).
            (Program::VerifyChain(c), Some(log)) => Metrics::add(
                &m.spec_chained_steps,
                (log.accepted.len() / c.seqs.len().max(1)).saturating_sub(1) as u64,
            ),
            (Program::DecodeChain(c), _) => Metrics::add(&m.chained_steps, c.steps as u64),
            _ => {}
        }
        Metrics::set(&m.batch_seqs, stats.seqs as u64);
        Metrics::set(&m.batch_tokens, stats.tokens as u64);
        let prefill: usize = planned
            .work
            .iter()
            .map(|p| match &p.work {
                StepWork::Prefill { tokens, .. } => tokens.len(),
                StepWork::Decode { .. } | StepWork::Verify { .. } => 0,
            })
            .sum();
        Metrics::add(&m.prefill_tokens, prefill as u64);
        debug!(
            step = stats.index,
            seqs = stats.seqs,
            tokens = stats.tokens,
            seconds = stats.seconds,
            "step"
        );
    }

    /// The deliver phase: hidden rows to the drafters that read them, each sequence's new tokens to its stream, then
    /// session saves, releases of what finished and failures of what could not be judged.
    /// `grammar_failed`: constrained requests that ran unmasked because their grammar failed; they are failed, not
    /// delivered.
    async fn deliver_step(
        &mut self,
        planned: &Step,
        plan: &StepPlan,
        result: &StepResult,
        stats: StepStats,
        grammar_failed: Vec<(u64, String)>,
    ) {
        let mut finished = Vec::new();
        let mut failed = Vec::new();
        self.offer_mtp(planned, result);
        // Hidden rows for drafters that run on them: every prefill and decode row is committed now; a verify's
        // are kept up to its accepted drafts, once judged. Plan sequence `i` is `planned.work[i]`.
        let layout = HiddenLayout::of(plan, result, self.hidden_width());
        for (i, p) in planned.work.iter().enumerate() {
            let Some(layout) = &layout else { break };
            match &p.work {
                StepWork::Prefill { position, tokens, .. } => {
                    self.note_hidden(p.id, layout, result, i, position + tokens.len() - 1)
                }
                StepWork::Decode { position, .. } => self.note_hidden(p.id, layout, result, i, *position),
                StepWork::Verify { .. } => {}
            }
        }
        let n = planned.work.len();
        // A single step's sequences report rows in plan order: sequence `i`'s first is `firsts[i]`.
        let firsts: Vec<usize> = plan.as_batch().map_or_else(Vec::new, |b| {
            b.seqs
                .iter()
                .scan(0, |at, s| {
                    let first = *at;
                    *at += s.row_count();
                    Some(first)
                })
                .collect()
        });
        for (i, p) in planned.work.iter().enumerate() {
            if let Err(e) = self.note_prompt_rows(p, plan, result, &firsts, i) {
                failed.push((p.id, e));
            }
        }
        self.note_branch_points(&planned.work);
        for (i, p) in planned.work.iter().enumerate().filter(|(_, p)| p.samples()) {
            if grammar_failed.iter().any(|(id, _)| *id == p.id) || failed.iter().any(|(id, _)| *id == p.id) {
                continue;
            }
            let first = firsts.get(i).copied().unwrap_or(0);
            let picked = match (&plan.program, &p.work) {
                (Program::VerifyChain(_), StepWork::Verify { tokens, .. }) => self
                    .chain_judged(p.id, i, n, tokens.len(), result)
                    .map_err(|e| format!("a chain of verifies failed: {e}")),
                (Program::Batch(_), StepWork::Verify { position, tokens }) => {
                    let hidden = layout.as_ref().map(|l| (l, i));
                    self.judge(p.id, *position, tokens, result, first, hidden)
                        .map_err(|e| format!("judging the speculative verify failed: {e}"))
                }
                // A chain answers step-major, one row per sequence a step. Tokens after a stop inside a chain are
                // dropped below (the slot is released; nothing it left in the state is kept).
                (Program::DecodeChain(c), _) => Ok((0..=c.steps).map(|k| pick(result, k * n + i)).collect()),
                (_, StepWork::Prefill { .. } | StepWork::Decode { .. }) => {
                    let last = first + plan.as_batch().map_or(1, |b| b.seqs[i].row_count()) - 1;
                    Ok(vec![pick(result, last)])
                }
            };
            // A request asking for log-probabilities runs only single steps' prefills and decodes (it neither chains
            // nor speculates), whose picking row asked about its pick.
            let top = self.live.get(&p.id).and_then(|l| l.logprobs.as_ref()?.generated());
            let picked = picked.and_then(|tokens| match top {
                None => Ok(tokens.into_iter().map(|t| (t, None)).collect::<Vec<_>>()),
                Some(top) => match (&plan.program, &p.work, tokens.as_slice()) {
                    (Program::Batch(b), StepWork::Prefill { .. } | StepWork::Decode { .. }, &[token]) => {
                        let last = first + b.seqs[i].row_count() - 1;
                        let e = entry(&result.rows[last], token, top)
                            .map_err(|e| format!("the token's log-probability: {e}"))?;
                        Ok(vec![(token, Some(e))])
                    }
                    _ => Err(
                        "log-probabilities were asked for, but the token came from a chained or speculative step, \
                         which reports none"
                            .to_string(),
                    ),
                },
            });
            let tokens = match picked {
                Ok(t) => t,
                Err(e) => {
                    failed.push((p.id, e));
                    continue;
                }
            };
            let verify_at = match &p.work {
                StepWork::Verify { position, .. } => Some(*position),
                StepWork::Prefill { .. } | StepWork::Decode { .. } => None,
            };
            for (token, logprob) in tokens {
                if let Some(slot) = self.deliver(p.id, token, logprob, stats, verify_at) {
                    finished.push(slot);
                    break;
                }
                if !self.live.contains_key(&p.id) {
                    break;
                }
            }
        }
        if layout.is_some() {
            let ids: Vec<u64> = planned.work.iter().map(|p| p.id).collect();
            self.feed_hidden(&ids, &mut failed);
        }
        // The next masks of the constrained requests that do not speculate are computed while the rest of the
        // delivery and the next step's drafting and scheduling run (a speculating one's come from its drafts' check).
        self.start_masks_ahead(|_, l| l.spec.is_none());
        let saves = std::mem::take(&mut self.saves);
        self.save(saves).await;
        let cached = std::mem::take(&mut self.prefix_saves);
        self.cache_finished(cached).await;
        let forks = std::mem::take(&mut self.forks);
        self.fork(forks).await;
        finished.append(&mut self.dropped);
        self.release(&finished).await;
        for (id, error) in failed {
            self.fail(id, error).await;
        }
        for (id, error) in grammar_failed {
            self.fail_as(id, FailureKind::InvalidArgument, error).await;
        }
        self.gauges();
    }

    /// Records the prompt rows a prefill chunk of request `p` (plan sequence `i`, first row `firsts[i]`) reported,
    /// sending the prompt's log-probabilities when the chunk ends the prompt.
    fn note_prompt_rows(
        &mut self,
        p: &Planned,
        plan: &StepPlan,
        result: &StepResult,
        firsts: &[usize],
        i: usize,
    ) -> Result<(), String> {
        let (Some(b), StepWork::Prefill { position, tokens, .. }) = (plan.as_batch(), &p.work) else {
            return Ok(());
        };
        let s = &b.seqs[i];
        if s.rows != Rows::All || s.logprobs.is_none() {
            return Ok(());
        }
        let Some(l) = self.live.get_mut(&p.id) else {
            return Ok(());
        };
        let Some(lp) = l.logprobs.as_mut() else {
            return Ok(());
        };
        let rows = result
            .rows
            .get(firsts[i]..firsts[i] + tokens.len())
            .ok_or_else(|| "the step reported fewer rows than the plan asked for".to_string())?;
        if let Some(entries) = lp.note_prompt(*position, rows, p.samples())? {
            let first_token = l.history.first().copied().unwrap_or(0);
            let _ = l.events.send(Event::PromptLogprobs { first_token, entries });
        }
        Ok(())
    }

    /// Runs `plan` as step `index` on every rank and merges the answers.
    pub(super) async fn run(&mut self, index: u64, plan: &StepPlan) -> Result<rewind_engine::rank::StepResult, Fault> {
        let g = self.ranks.as_ref().ok_or(Fault::Stopped(0))?;
        let sent = prepare(&self.books, plan).map_err(|e| Fault::Rank(0, e.to_string(), false))?;
        let outs = g
            .call(
                |reply| RankActorMsg::Step {
                    index,
                    plan: sent.clone(),
                    reply,
                },
                self.config.step_deadline,
            )
            .await?;
        finish(&mut self.books, plan, &outs, self.info.vocab).map_err(|e| match e {
            EngineError::NonFinite { .. } => Fault::NonFinite(e.to_string()),
            e => Fault::Rank(0, e.to_string(), false),
        })
    }

    /// Streams request `id`'s new token; returns its slot when the request ended.
    /// A session turn that finishes is queued to be saved (`verify_at`: the position of the verify it ran in, if).
    fn deliver(
        &mut self,
        id: u64,
        token: u32,
        logprob: Option<TokenLogprob>,
        step: StepStats,
        verify_at: Option<usize>,
    ) -> Option<usize> {
        let Some(l) = self.live.get_mut(&id) else {
            // Cancelled while the step ran: the scheduler let it go already.
            return None;
        };
        if l.forking.is_some() {
            return self.prefilled(id, token);
        }
        Metrics::inc(&self.metrics.generated_tokens);
        let span = l.span.clone();
        let _entered = span.enter();
        let index = l.output.generated();
        if let Some(Err(e)) = l.grammar.as_mut().map(|g| g.accept(token)) {
            warn!(request = id, %e, "the output's grammar failed");
            Metrics::inc(&self.metrics.requests_failed);
            let _ = l
                .events
                .send(Event::failed(FailureKind::InvalidArgument, e.to_string()));
            self.live.remove(&id);
            return self.sched.cancel(id);
        }
        let pushed = l.output.push(token);
        l.history.push(token);
        let now = Instant::now();
        l.first_token.get_or_insert(now);
        let prompt_only = l.logprobs.as_ref().is_some_and(|lp| lp.prompt_only);
        let (text, finish) = match pushed {
            // Scoring a prompt: the picked token is dropped and the request ends as `max_tokens: 0` asked.
            Ok(_) if prompt_only => (String::new(), Some(rewind_engine::sched::FinishReason::Length)),
            Ok(p) => (p.text, p.finish),
            Err(e) => {
                warn!(request = id, %e, "detokenizing failed");
                Metrics::inc(&self.metrics.requests_failed);
                let _ = l.events.send(Event::failed(FailureKind::Internal, e.to_string()));
                let request = l.request;
                self.live.remove(&id);
                // The request's other choices end with it (released with this step's finished slots).
                let slot = self.sched.cancel(id);
                let others = self.drop_choices(request);
                self.dropped.extend(others);
                return slot;
            }
        };
        let client_gone = !prompt_only
            && l.events
                .send(Event::Token {
                    token,
                    text,
                    index,
                    step,
                    choice: l.choice,
                    logprob,
                })
                .is_err();
        let slot = match self.sched.sampled(id, token, finish.is_some() || client_gone) {
            Ok(slot) => slot,
            Err(e) => {
                warn!(request = id, %e, "the scheduler lost a request");
                None
            }
        };
        if let Some(reason) = finish {
            let l = self.live.remove(&id)?;
            if !self.choices_left(l.request) {
                Metrics::inc(&self.metrics.requests_finished);
            }
            debug!(
                ?reason,
                tokens = l.output.generated(),
                preemptions = l.preemptions,
                recoveries = l.recoveries,
                "finished"
            );
            let finished = Event::Finished {
                reason,
                usage: Usage {
                    prompt_tokens: l.prompt_len,
                    completion_tokens: if prompt_only { 0 } else { l.output.generated() },
                    cached_tokens: l.cached,
                },
                timing: RequestTiming {
                    ttft_seconds: l.first_token.map_or(0.0, |t| (t - l.submitted).as_secs_f64()),
                    total_seconds: now.duration_since(l.submitted).as_secs_f64(),
                    preemptions: l.preemptions,
                    recoveries: l.recoveries,
                },
                seed: l.seed,
                spec: l.spec.as_ref().map(|s| s.stats),
                choice: l.choice,
            };
            match (&l.session, slot) {
                // A session's turn is finished once its state is saved (or fails if it cannot be).
                (Some(s), Some(slot)) => self.saves.push(Save {
                    session: s.id.clone(),
                    request: id,
                    slot,
                    tokens: l.history.clone(),
                    verify_at,
                    finished,
                    events: l.events.clone(),
                }),
                (None, Some(slot)) => {
                    // The state holds every token but the last sampled one.
                    let tokens = &l.history[..l.history.len() - 1];
                    if self.prefix_wants(slot, tokens, verify_at) {
                        self.prefix_saves.push(PrefixSave {
                            slot,
                            tokens: tokens.to_vec(),
                            verify_at,
                        });
                    }
                    let _ = l.events.send(finished);
                }
                (_, None) => {
                    let _ = l.events.send(finished);
                }
            }
        } else if client_gone {
            if let Some(l) = self.live.remove(&id) {
                if !self.choices_left(l.request) {
                    Metrics::inc(&self.metrics.requests_cancelled);
                }
            }
        }
        slot
    }
}

/// Refuses what a request's log-probabilities cannot be: more than [`MAX_TOP`] top entries, or a prompt's for a session
/// turn (its earlier tokens are restored from the session's state, which keeps no rows for them).
fn check_logprobs(r: &GenerateRequest) -> rewind_engine::Result<()> {
    for (name, k) in [("logprobs", r.logprobs), ("prompt_logprobs", r.prompt_logprobs)] {
        if let Some(k) = k.filter(|&k| k > MAX_TOP) {
            return Err(EngineError::InvalidInput(format!(
                "{name} asks for {k} top entries; at most {MAX_TOP}"
            )));
        }
    }
    if r.prompt_logprobs.is_some() && r.session.is_some() {
        return Err(EngineError::InvalidInput(
            "prompt_logprobs are not available for a session turn: the session's earlier tokens are restored from \
             its saved state, which keeps no log-probabilities"
                .into(),
        ));
    }
    Ok(())
}

/// Row `row`'s pick: its sampled token, else its argmax.
/// The requests a step carries, each with the position its work reaches (what a fault of the step is charged as).
fn involved(planned: &Step) -> Vec<(u64, usize)> {
    planned.work.iter().map(|p| (p.id, p.end())).collect()
}

fn pick(result: &StepResult, row: usize) -> u32 {
    result.sampled[row].unwrap_or(result.rows[row].argmax)
}

/// Tokens a step runs through the model over all its steps: a chain of decodes one per sequence and step, a chain
/// of verifies each window every step.
fn step_tokens(plan: &StepPlan) -> usize {
    plan.token_count() * (1 + plan.chained())
}
