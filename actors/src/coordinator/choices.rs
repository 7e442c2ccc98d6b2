//! A request's `n` choices ([`GenerateRequest::n`], OpenAI's `n`): the prompt is prefilled once and its state forked
//! into `n` sequences, each of them afterwards a sequence of its own in the scheduler (its own stop and finish
//! reason, its own preemption and recovery).
//!
//! The fork prefill runs every prompt token but the last as a sequence of its own (its one sampled row is dropped).
//! When it finishes, its slot's state is copied to the host (the ranks' snapshot, what a session's turn saves: the
//! SSM checkpoint, the replay and conv rings, the KV rows) and every choice starts from that copy as a session's
//! turn starts from its saved state: restored into the choice's slot, then the prompt's last token prefilled as a
//! one-token chunk whose row the choice samples with its own seed. vLLM has the same shape: its `n` child requests
//! share the prompt's cached blocks and each computes the last prompt token itself. The copy stays with the choices
//! (one, shared) until they end, so a choice that is preempted or rebuilt after a fault is restored from it again and
//! computes exactly what it first computed (the same restore, the same one-token chunk, then its tokens fed again).
//! A one-token prompt has nothing to share: its choices start afresh.
//!
//! Seeds: with a request seed `s`, choice `i` samples with `s + i` ([`choice_seed`]); without one, each choice draws
//! its own. Every event carries its choice's index; a choice that fails fails the request (its other choices end),
//! and cancelling the request ends every choice.
//!
//! Log-probabilities: the prompt's are gathered once, from the fork prefill's rows (they predict every prompt token
//! after the first), and sent once for the request; each choice's tokens' come from its own rows.

use std::time::Instant;

use rewind_engine::sample::SamplingParams;
use rewind_engine::sched::Request;
use rewind_engine::{EngineError, Result};
use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, warn};

use super::logprobs::LiveLogprobs;
use super::prefix::Start;
use super::sessions::LiveSession;
use super::CoordinatorState;
use crate::metrics::Metrics;
use crate::request::{choice_seed, Event, FailureKind, GenerateRequest};

/// Choice sequences take ids from here up, apart from the ids the handle gives requests (counted from 1).
pub(super) const FIRST_CHOICE_ID: u64 = 1 << 63;

/// A sequence to queue ([`CoordinatorState::queue`]).
pub(super) struct Sequence {
    /// The request it answers, and which of its choices it is.
    pub request: u64,
    pub choice: usize,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Its sampling seed; `None` draws one.
    pub seed: Option<u64>,
    pub priority: i32,
    pub reference: Option<Vec<u32>>,
    pub speculate: bool,
    /// Leading prompt tokens restored from a saved state (a session's, or `fork`'s) instead of prefilled.
    pub restored: usize,
    pub session: Option<LiveSession>,
    pub fork: Option<(Start, usize)>,
    /// Prompt tokens restored rather than computed for this request (a session's state, a prefix cache hit).
    pub cached: usize,
    pub forking: Option<Box<Forking>>,
    /// What the sequence asks for its log-probabilities (of a request's `n` choices: the prompt's entries in the
    /// fork prefill, each choice its own tokens'; see [`LiveLogprobs::split`]).
    pub logprobs: Option<LiveLogprobs>,
    /// When the request arrived (its choices' time to first token counts from there).
    pub submitted: Instant,
}

/// What a fork prefill starts its choices with.
pub(super) struct Forking {
    n: usize,
    /// The whole prompt (the fork prefill runs all of it but the last token).
    prompt: Vec<u32>,
    params: SamplingParams,
    priority: i32,
    reference: Option<Vec<u32>>,
    speculate: bool,
    /// Prompt tokens the fork prefill restored from the prefix cache.
    cached: usize,
    /// What the request asked for its log-probabilities.
    logprobs: Option<LiveLogprobs>,
}

impl CoordinatorState {
    /// Refuses a request's `n` that the engine cannot serve: none, more choices than sequence slots (they could never
    /// all run), or several on a session's turn (a turn continues one sequence).
    pub(super) fn check_choices(&self, request: &GenerateRequest) -> Result<()> {
        let n = request.n;
        if n == 0 {
            return Err(EngineError::InvalidInput("n must be at least 1".into()));
        }
        if n > self.info.slots {
            return Err(EngineError::InvalidInput(format!(
                "n {n} exceeds the {} sequences the engine runs at once (--max-seqs)",
                self.info.slots
            )));
        }
        if n > 1 && request.session.is_some() {
            return Err(EngineError::InvalidInput(format!(
                "n {n}: a session's turn continues one sequence, so it takes n = 1 (fork the session for more)"
            )));
        }
        Ok(())
    }

    /// Queues request `id`'s `n > 1` choices of `seq` (checked as one sequence): its fork prefill, or with a
    /// one-token prompt the choices themselves.
    pub(super) fn admit_choices(
        &mut self,
        id: u64,
        n: usize,
        seq: Sequence,
        events: &UnboundedSender<Event>,
    ) -> Result<()> {
        // Every choice is the whole sequence: check it once as the scheduler would, before anything is queued.
        let room = self.info.max_context.saturating_sub(seq.prompt.len());
        let limit = seq.params.max_tokens.map_or(room, |m| m.min(room));
        self.sched
            .check(&Request {
                id,
                prompt: seq.prompt.clone(),
                max_tokens: limit,
                priority: seq.priority,
                restored: 0,
                chain: Default::default(),
            })
            .map_err(|e| EngineError::InvalidInput(e.to_string()))?;
        let forking = Box::new(Forking {
            n,
            prompt: seq.prompt.clone(),
            params: seq.params.clone(),
            priority: seq.priority,
            reference: seq.reference.clone(),
            speculate: seq.speculate,
            cached: seq.cached,
            logprobs: seq.logprobs.clone(),
        });
        let queued = if seq.prompt.len() == 1 {
            self.start_choices(id, &forking, None, seq.submitted, events)
        } else {
            let shared = seq.prompt.len() - 1;
            let prefill = Sequence {
                prompt: seq.prompt[..shared].to_vec(),
                params: SamplingParams {
                    max_tokens: Some(1),
                    ignore_eos: true,
                    ..SamplingParams::greedy()
                },
                seed: Some(0),
                reference: None,
                speculate: false,
                forking: Some(forking),
                // The prompt's log-probabilities are gathered once, here; each choice reports its own tokens'.
                logprobs: seq.logprobs.clone().and_then(|l| l.split().0),
                ..seq
            };
            self.queue(id, prefill, events)
        };
        if let Err(e) = queued {
            self.drop_choices(id);
            return Err(e);
        }
        Metrics::inc(&self.metrics.requests_submitted);
        self.gauges();
        Ok(())
    }

    /// Queues the choices of request `id` (each a sequence with a fresh id), starting from `fork` when given.
    fn start_choices(
        &mut self,
        id: u64,
        f: &Forking,
        fork: Option<(Start, usize)>,
        submitted: Instant,
        events: &UnboundedSender<Event>,
    ) -> Result<()> {
        for choice in 0..f.n {
            let sid = self.next_choice;
            self.next_choice += 1;
            let seq = Sequence {
                request: id,
                choice,
                prompt: f.prompt.clone(),
                params: f.params.clone(),
                seed: f.params.seed.map(|s| choice_seed(s, choice)),
                priority: f.priority,
                reference: f.reference.clone(),
                speculate: f.speculate,
                restored: fork.as_ref().map_or(0, |(_, n)| *n),
                session: None,
                fork: fork.clone(),
                cached: f.cached,
                forking: None,
                // With no fork prefill (a one-token prompt), choice 0 gathers the prompt's log-probabilities.
                logprobs: if choice == 0 && fork.is_none() {
                    f.logprobs.clone()
                } else {
                    f.logprobs.clone().and_then(|l| l.split().1)
                },
                submitted,
            };
            self.queue(sid, seq, events)?;
        }
        Ok(())
    }

    /// The token sampled for fork prefill `id` (dropped: each choice samples that row itself): the prefill is done,
    /// and its slot (returned, to be released) is forked first.
    pub(super) fn prefilled(&mut self, id: u64, token: u32) -> Option<usize> {
        match self.sched.sampled(id, token, true) {
            Ok(slot) => {
                if let Some(slot) = slot {
                    self.forks.push((id, slot));
                }
                slot
            }
            Err(e) => {
                warn!(request = id, %e, "the scheduler lost a fork prefill");
                None
            }
        }
    }

    /// Forks every fork prefill that finished in this step (before its slot is released): its state copied once,
    /// its choices queued from the copy. A copy that cannot be taken is a fault; the prefill then runs again after
    /// the recovery, charged as a retry of its work.
    pub(super) async fn fork(&mut self, forks: Vec<(u64, usize)>) {
        for (id, slot) in forks {
            let Some(mut l) = self.live.remove(&id) else { continue };
            let Some(forking) = l.forking.take() else { continue };
            let shared = l.history.len();
            match self.snapshot(slot, shared).await {
                Ok(state) => {
                    debug!(request = id, choices = forking.n, shared, "forked the prompt's state");
                    if let Err(f) = self.prefix_store(slot, &l.history).await {
                        warn!(request = id, fault = %f, "storing the prompt's state in the prefix cache failed");
                        self.pending_fault.get_or_insert(f);
                    }
                    let queued =
                        self.start_choices(id, &forking, Some((Start::Host(state), shared)), l.submitted, &l.events);
                    if let Err(e) = queued {
                        self.drop_choices(id);
                        Metrics::inc(&self.metrics.requests_failed);
                        let _ = l.events.send(Event::failed(FailureKind::of(&e), e.to_string()));
                    }
                }
                Err(f) => {
                    warn!(request = id, fault = %f, "copying the prompt's state failed; the fork prefill runs again");
                    self.pending_fault.get_or_insert(f);
                    if let Some(why) = l.retries.fault(shared, self.config.max_retries) {
                        Metrics::inc(&self.metrics.requests_failed);
                        let _ = l.events.send(Event::failed(
                            FailureKind::Unavailable,
                            format!("copying the prompt's state for its choices failed: {why}"),
                        ));
                        continue;
                    }
                    let again = Request {
                        id,
                        prompt: l.history.clone(),
                        max_tokens: 1,
                        priority: forking.priority,
                        restored: 0,
                        chain: Default::default(),
                    };
                    if let Err(e) = self.sched.submit(again) {
                        let _ = l.events.send(Event::failed(FailureKind::Internal, e.to_string()));
                        continue;
                    }
                    l.forking = Some(forking);
                    self.live.insert(id, l);
                }
            }
        }
    }

    /// Ends every sequence of request `request` (its choices, or its fork prefill) without telling its client;
    /// returns the slots they free, for the ranks to release.
    pub(super) fn drop_choices(&mut self, request: u64) -> Vec<usize> {
        let ids: Vec<u64> = self
            .live
            .iter()
            .filter(|(_, l)| l.request == request)
            .map(|(&id, _)| id)
            .collect();
        ids.into_iter()
            .filter_map(|id| {
                self.live.remove(&id);
                self.sched.cancel(id)
            })
            .collect()
    }

    /// Whether request `request` still has a live sequence.
    pub(super) fn choices_left(&self, request: u64) -> bool {
        self.live.values().any(|l| l.request == request)
    }
}
