//! The coordinator's side of sessions (`session.rs` holds the store): the session operations, a turn's admission
//! (the session's tokens before the turn's, its saved state restored instead of prefilled), restoring that state into
//! the slot a turn starts in, and saving the slot's state when a turn finishes.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use ractor::RpcReplyPort;
use rewind_engine::rank::{Commit, StepPlan};
use tracing::warn;

use super::prefix::Start;
use super::{CoordinatorState, Fault};
use crate::metrics::Metrics;
use crate::rank_actor::RankActorMsg;
use crate::request::{Event, FailureKind};
use crate::session::{Saved, SavedState, SessionError, SessionInfo, SessionOptions, SessionOwner};

/// A session operation, on the sessions of the owner it names.
pub enum SessionMsg {
    Create(
        SessionOwner,
        SessionOptions,
        RpcReplyPort<Result<SessionInfo, SessionError>>,
    ),
    Fork(SessionOwner, String, RpcReplyPort<Result<SessionInfo, SessionError>>),
    Close(SessionOwner, String, RpcReplyPort<Result<(), SessionError>>),
    Get(SessionOwner, String, RpcReplyPort<Result<SessionInfo, SessionError>>),
    List(SessionOwner, RpcReplyPort<Vec<SessionInfo>>),
    /// Evict idle sessions (sent by a timer).
    EvictIdle,
}

/// A live request's session: which one, and the state its turn started from.
pub(super) struct LiveSession {
    pub id: String,
    pub state: Option<(SavedState, usize)>,
}

/// A turn that finished in the step just run, to save before its slot is released.
pub(super) struct Save {
    pub session: String,
    pub request: u64,
    pub slot: usize,
    /// Every token of the session now (the last one sampled, not yet run).
    pub tokens: Vec<u32>,
    /// The position of the verify the turn finished in, if it did: the slot's state then holds every drafted token
    /// until a commit keeps those before the turn's last token.
    pub verify_at: Option<usize>,
    /// The turn's `Finished` event, sent once the state is saved: a turn whose state does not fit the memory budget
    /// fails instead, leaving its session as it was.
    pub finished: Event,
    pub events: tokio::sync::mpsc::UnboundedSender<Event>,
}

/// Freed saved-state bytes after which the coordinator asks the allocator to hand free memory back to the OS.
const TRIM_AFTER_FREED: usize = 64 << 20;

/// What a turn starts from.
pub(super) struct Turn {
    pub prompt: Vec<u32>,
    pub restored: usize,
    pub speculate: bool,
    pub session: LiveSession,
}

impl CoordinatorState {
    fn busy(&self) -> impl Fn(u64) -> bool + '_ {
        |request| self.live.contains_key(&request)
    }

    /// Answers a session operation (the gauges updated first, so a client that reads them after the answer sees the
    /// operation's effect).
    pub(super) fn session_msg(&mut self, msg: SessionMsg) {
        self.evict_idle();
        match msg {
            SessionMsg::Create(owner, options, reply) => {
                let r = self
                    .sessions
                    .create(owner, options)
                    .and_then(|id| self.session_info(owner, &id));
                self.session_gauges();
                drop(reply.send(r));
            }
            SessionMsg::Fork(owner, id, reply) => {
                let live = &self.live;
                let r = self.sessions.fork(owner, &id, |q| live.contains_key(&q));
                let r = r.and_then(|new| self.session_info(owner, &new));
                self.session_gauges();
                drop(reply.send(r));
            }
            SessionMsg::Close(owner, id, reply) => {
                let r = self.sessions.close(owner, &id).map(drop);
                self.session_gauges();
                drop(reply.send(r));
            }
            SessionMsg::Get(owner, id, reply) => {
                self.session_gauges();
                drop(reply.send(self.session_info(owner, &id)));
            }
            SessionMsg::List(owner, reply) => {
                let all = self
                    .sessions
                    .ids(owner)
                    .iter()
                    .filter_map(|id| self.session_info(owner, id).ok())
                    .collect();
                self.session_gauges();
                drop(reply.send(all));
            }
            SessionMsg::EvictIdle => self.session_gauges(),
        }
    }

    fn session_info(&self, owner: SessionOwner, id: &str) -> Result<SessionInfo, SessionError> {
        self.sessions.info(owner, id, self.busy())
    }

    pub(super) fn evict_idle(&mut self) {
        let live = &self.live;
        let n = self.sessions.evict_idle(|q| live.contains_key(&q));
        if n > 0 {
            Metrics::add(&self.metrics.sessions_evicted, n as u64);
        }
    }

    /// Updates the session gauges, and hands the memory of freed saved states back to the OS once enough went.
    fn session_gauges(&mut self) {
        Metrics::set(&self.metrics.sessions, self.sessions.len() as u64);
        Metrics::set(&self.metrics.session_state_bytes, self.sessions.state_bytes() as u64);
        self.freed_state_bytes += self.sessions.take_freed();
        if self.freed_state_bytes >= TRIM_AFTER_FREED {
            self.freed_state_bytes = 0;
            // Off the coordinator's thread: a trim walks the allocator's arenas.
            tokio::task::spawn_blocking(crate::memory::release_free_memory);
        }
    }

    /// Starts a turn of `owner`'s session `id` with the turn's new tokens `prompt`, marking the session busy with
    /// `request`.
    pub(super) fn begin_turn(
        &mut self,
        owner: SessionOwner,
        id: &str,
        request: u64,
        prompt: &[u32],
        speculate: bool,
    ) -> Result<Turn, (FailureKind, String)> {
        self.evict_idle();
        let busy = {
            let live = &self.live;
            self.sessions
                .owned(owner, id)
                .map(|s| s.turn.is_some_and(|q| live.contains_key(&q)))
        };
        match busy {
            Err(e) => return Err((FailureKind::NotFound, e.to_string())),
            Ok(true) => {
                return Err((
                    FailureKind::FailedPrecondition,
                    SessionError::Busy { id: id.to_string() }.to_string(),
                ))
            }
            Ok(false) => {}
        }
        let s = self
            .sessions
            .owned_mut(owner, id)
            .map_err(|e| (FailureKind::NotFound, e.to_string()))?;
        let mut full = s.tokens.clone();
        full.extend_from_slice(prompt);
        s.turn = Some(request);
        s.touched = Instant::now();
        Ok(Turn {
            prompt: full,
            restored: s.state.as_ref().map_or(0, |(_, n)| *n),
            speculate: speculate && s.options.speculate,
            session: LiveSession {
                id: id.to_string(),
                state: s.state.clone(),
            },
        })
    }

    /// Restores the saved state of every sequence starting afresh in this step (`(request, slot)`: a session's
    /// turn, a forked choice) into its slot.
    pub(super) async fn restore(&mut self, starts: &[(u64, usize)]) -> Result<(), Fault> {
        for &(request, slot) in starts {
            let Some((state, n)) = self.live.get(&request).and_then(|l| {
                l.session
                    .as_ref()
                    .and_then(|s| s.state.clone())
                    .map(|(s, n)| (Start::Host(s), n))
                    .or_else(|| l.fork.clone())
            }) else {
                return Err(Fault::Rank(
                    0,
                    format!("request {request} starts from a restored state it does not have"),
                    false,
                ));
            };
            let g = self.ranks.as_ref().ok_or(Fault::Stopped(0))?;
            match state {
                Start::Host(state) => {
                    if state.ranks.len() != g.ranks.len() {
                        return Err(Fault::Rank(
                            0,
                            format!(
                                "a saved state of {} ranks cannot be restored on {}",
                                state.ranks.len(),
                                g.ranks.len()
                            ),
                            false,
                        ));
                    }
                    g.call_each(
                        |r, reply| RankActorMsg::Restore(slot, Box::new(state.ranks[r].clone()), reply),
                        self.config.step_deadline,
                    )
                    .await?;
                }
                Start::Stored(stored) => {
                    if stored.generation != self.generation {
                        return Err(Fault::Rank(
                            0,
                            format!("request {request} starts from a stored state its ranks lost in a restart"),
                            false,
                        ));
                    }
                    g.call(
                        |reply| RankActorMsg::RestoreStored(slot, stored.id, reply),
                        self.config.step_deadline,
                    )
                    .await?;
                }
            }
            self.books
                .restored(slot, n)
                .map_err(|e| Fault::Rank(0, format!("restoring slot {slot}: {e}"), false))?;
        }
        Ok(())
    }

    /// Saves the state of each turn that finished (before its slot is released), then tells its client. A turn
    /// whose state cannot be taken keeps its tokens, so its session's next turn prefills them all; the failure counts
    /// as a fault. A turn whose state does not fit the memory budget, even after evicting every idle session's,
    /// fails (resource exhausted) and leaves its session as it was before the turn.
    pub(super) async fn save(&mut self, saves: Vec<Save>) {
        // Told after the gauges are updated, so a client that reads them after its turn sees the turn's state.
        let mut told = Vec::with_capacity(saves.len());
        // Turns finished but not yet saved are still running as far as eviction goes: their requests have left
        // `live`, and their sessions must not be evicted before their own saves.
        let unsaved: HashSet<u64> = saves.iter().map(|s| s.request).collect();
        for s in saves {
            let taken = self.save_one(&s).await;
            let live = &self.live;
            let busy = |q: u64| live.contains_key(&q) || unsaved.contains(&q);
            // Whether the new state is kept, or the error that fails the turn.
            let (kept, failed) = match taken {
                Err(f) => {
                    warn!(session = %s.session, fault = %f, "saving the session's state failed; its next turn re-prefills");
                    self.pending_fault.get_or_insert(f);
                    (false, None)
                }
                Ok((state, n)) => match self.sessions.save_state(&s.session, state.clone(), n, busy) {
                    Ok(evicted) => {
                        Metrics::add(&self.metrics.sessions_evicted_memory, evicted as u64);
                        // Stored in the prefix cache too: another conversation with the same start resumes from it.
                        if let Err(f) = self.prefix_store(s.slot, &s.tokens[..n]).await {
                            warn!(session = %s.session, fault = %f, "storing the turn's state in the prefix cache failed");
                            self.pending_fault.get_or_insert(f);
                        }
                        (true, None)
                    }
                    Err(e @ SessionError::Memory { .. }) => {
                        Metrics::inc(&self.metrics.session_saves_refused);
                        warn!(session = %s.session, error = %e, "a session's turn failed: its state does not fit");
                        (false, Some(e))
                    }
                    // Closed or evicted during the turn: nothing to keep.
                    Err(_) => (false, None),
                },
            };
            if let Some(session) = self.sessions.get_mut(&s.session) {
                if session.turn == Some(s.request) {
                    session.turn = None;
                }
                if failed.is_none() {
                    if !kept {
                        session.state = None;
                    }
                    session.tokens = s.tokens;
                    session.turns += 1;
                    session.touched = Instant::now();
                }
            }
            let event = match failed {
                Some(e) => Event::failed(FailureKind::ResourceExhausted, e.to_string()),
                None => s.finished,
            };
            told.push((s.events, event));
        }
        self.session_gauges();
        for (events, event) in told {
            let _ = events.send(event);
        }
    }

    async fn save_one(&mut self, s: &Save) -> Result<(SavedState, usize), Fault> {
        let keep = s.tokens.len() - 1;
        self.settle_snapshot(s.slot, keep, s.verify_at)
            .await
            .map(|state| (state, keep))
    }

    /// A host copy of the state of a sequence that ended in `slot` holding `keep` tokens ([`Self::settle`]).
    pub(super) async fn settle_snapshot(
        &mut self,
        slot: usize,
        keep: usize,
        verify_at: Option<usize>,
    ) -> Result<SavedState, Fault> {
        self.settle(slot, keep, verify_at).await?;
        self.snapshot(slot, keep).await
    }

    /// Makes the state of a sequence that ended in `slot` hold exactly its `keep` tokens, `verify_at` the position of
    /// the verify it ended in, if it did: the slot's state then holds every drafted token, until a commit keeps those
    /// before the sequence's last one (a session's turn, a sequence cached for its prefix).
    pub(super) async fn settle(&mut self, slot: usize, keep: usize, verify_at: Option<usize>) -> Result<(), Fault> {
        if let Some(position) = verify_at {
            // Keep the verify's tokens before the sequence's last one (its input token and the drafts emitted before
            // it: a commit counts the verify's tokens kept); drop the rest.
            let accepted = keep.checked_sub(position).filter(|&n| n >= 1).ok_or_else(|| {
                Fault::Rank(
                    0,
                    format!("a verify at {position} cannot end a sequence of {keep} tokens"),
                    false,
                )
            })?;
            let plan = StepPlan::commits(vec![Commit { slot, accepted }]);
            self.index += 1;
            self.run(self.index, &plan).await?;
        }
        Ok(())
    }

    /// A host copy of `slot`'s state on every rank, which must hold `keep` tokens (a session's turn, a fork's prompt).
    pub(super) async fn snapshot(&mut self, slot: usize, keep: usize) -> Result<SavedState, Fault> {
        let g = self.ranks.as_ref().ok_or(Fault::Stopped(0))?;
        let parts = g
            .call(|reply| RankActorMsg::Snapshot(slot, reply), self.config.step_deadline)
            .await?;
        if let Some(p) = parts.iter().find(|p| p.position != keep) {
            return Err(Fault::Rank(
                0,
                format!("slot {slot}'s state holds {} tokens, the sequence {keep}", p.position),
                false,
            ));
        }
        Ok(Arc::new(Saved::new(parts)))
    }
}
