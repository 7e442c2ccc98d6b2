//! [`RankGroup`]: the synchronous driver of one generation of ranks — one OS thread per rank
//! ([`super::thread::RankThread`]), each owning its [`super::Rank`] — and the coordinator's step over them
//! ([`super::lockstep`]): validate the plan against the [`Books`], send the same plan to every rank, merge their
//! answers, record it. The actor runtime drives the same threads through rank actors.
//!
//! Ranks run the same step in lockstep (their collectives meet inside the communicator). A rank that errors or stops
//! on a validated step fails it for the caller (and aborts the generation's communicators, so no rank waits), and
//! the group then refuses further steps ([`EngineError::GroupFailed`]): the ranks may no longer agree with the
//! books. Recovering (restart, re-prefill) is the actor runtime's job.

use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::Duration;

use tracing::debug_span;

use super::books::Books;
use super::fault::Faults;
use super::launch::{Launch, Launcher};
use super::lockstep::{finish, prepare, StepResult};
use super::plan::{RankHealth, RankInfo, Rows, SeqKind, SeqStep, SlotSnapshot, StepOut, StepPlan};
use super::thread::{RankMsg, RankThread, Reply};
use crate::decode::FormChoice;
use crate::error::{EngineError, Result};

/// Every rank's part of one slot's state, in rank order (see [`super::Rank::snapshot`]).
#[derive(Clone, Debug, PartialEq)]
pub struct GroupSnapshot {
    pub ranks: Vec<SlotSnapshot>,
}

/// The ranks of one model, driven in lockstep; see the module docs.
pub struct RankGroup {
    ranks: Vec<RankThread>,
    infos: Vec<RankInfo>,
    books: Books,
    vocab: usize,
    launch: Launch,
    /// Steps run (the index each step carries to the ranks).
    steps: u64,
    /// Why a validated step failed on a rank, after which the ranks' states may differ from the books.
    failed: Option<String>,
}

/// Waits for every rank of a generation to load; checks that thread `r` loaded rank `r` of `tp`.
pub fn await_ranks(ranks: &mut [RankThread]) -> Result<Vec<RankInfo>> {
    let tp = ranks.len();
    let mut infos = Vec::with_capacity(tp);
    let mut first_err = None;
    for t in ranks.iter_mut() {
        match t.ready() {
            Ok(info) => infos.push(info),
            Err(e) => first_err = first_err.or(Some(e)),
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    if let Some((r, info)) = infos.iter().enumerate().find(|(r, i)| i.rank != *r || i.tp != tp) {
        return Err(EngineError::Communicator(format!(
            "thread {r} loaded rank {} of {}, expected rank {r} of {tp}",
            info.rank, info.tp
        )));
    }
    Ok(infos)
}

impl RankGroup {
    /// Starts a generation of `launcher`'s ranks, each on its own thread, and waits for them to load. Fails
    /// (after every thread has answered) when any rank fails to load.
    pub fn start(launcher: &dyn Launcher) -> Result<Self> {
        Self::start_with_faults(launcher, Arc::new(Faults::none()))
    }

    /// [`RankGroup::start`] with faults to inject (a testing aid).
    pub fn start_with_faults(launcher: &dyn Launcher, faults: Arc<Faults>) -> Result<Self> {
        let tp = launcher.tp();
        if tp == 0 {
            return Err(EngineError::InvalidInput("a group needs at least one rank".into()));
        }
        let launch = launcher.launch()?;
        let mut ranks = Vec::with_capacity(tp);
        for r in 0..tp {
            match RankThread::spawn(launcher.name(), r, &launch, faults.clone(), None) {
                Ok(t) => ranks.push(t),
                Err(e) => {
                    launch.abort.abort(&e.to_string());
                    return Err(e);
                }
            }
        }
        let loaded = await_ranks(&mut ranks).and_then(|infos| {
            let vocab = infos.last().map_or(0, |i| i.vocab.end);
            Ok((Books::new(&infos, vocab)?, infos, vocab))
        });
        match loaded {
            Ok((books, infos, vocab)) => Ok(RankGroup {
                ranks,
                infos,
                books,
                vocab,
                launch,
                steps: 0,
                failed: None,
            }),
            Err(e) => {
                launch.abort.abort(&e.to_string());
                shutdown(ranks);
                Err(e)
            }
        }
    }

    /// What each rank reported at load time, in rank order.
    pub fn infos(&self) -> &[RankInfo] {
        &self.infos
    }

    /// Tensor-parallel ranks.
    pub fn tp(&self) -> usize {
        self.ranks.len()
    }

    /// The model's vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// The coordinator's books (read-only).
    pub fn books(&self) -> &Books {
        &self.books
    }

    /// Sends a message built by `make` to every rank and collects the answers in rank order; the first error wins,
    /// after every rank has answered, so no rank is left mid-step.
    fn broadcast<T: Send + 'static>(&self, make: impl Fn(Reply<T>) -> RankMsg) -> Result<Vec<T>> {
        let mut replies = Vec::with_capacity(self.ranks.len());
        for (r, h) in self.ranks.iter().enumerate() {
            let (tx, rx) = channel();
            h.send(make(Box::new(move |v| drop(tx.send(v)))))?;
            replies.push((r, rx));
        }
        let mut out = Vec::with_capacity(replies.len());
        let mut err = None;
        for (r, rx) in replies {
            match rx.recv().unwrap_or(Err(EngineError::RankStopped { rank: r })) {
                Ok(v) => out.push(v),
                Err(e) => err = err.or(Some(e)),
            }
        }
        match err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// Opens a sequence decoded in `form`; returns its slot. The ranks take the slot at its first step.
    pub fn open(&mut self, form: FormChoice) -> Result<usize> {
        self.books.open(form)
    }

    /// Opens a sequence in `form` for each prompt and prefills it in one plan of its own; returns the slots and each
    /// prompt's greedy next token.
    pub fn prefill_prompts(&mut self, prompts: &[Vec<u32>], form: FormChoice) -> Result<(Vec<usize>, Vec<u32>)> {
        let (mut slots, mut next) = (Vec::with_capacity(prompts.len()), Vec::with_capacity(prompts.len()));
        for p in prompts {
            let slot = self.open(form)?;
            let out = self.step(StepPlan::batch(vec![SeqStep {
                slot,
                kind: SeqKind::Prefill,
                position: 0,
                tokens: p.clone(),
                form,
                rows: Rows::Last,
                sample: None,
                spec: None,
                logprobs: None,
            }]))?;
            slots.push(slot);
            next.push(out.rows.first().map_or(0, |r| r.argmax));
        }
        Ok((slots, next))
    }

    /// Ends the sequence in `slot` on every rank.
    pub fn release(&mut self, slot: usize) -> Result<()> {
        if self.books.close(slot)? {
            self.broadcast(|tx| RankMsg::Release(slot, tx))?;
        }
        Ok(())
    }

    /// Runs one step on every rank. The plan is checked against the books first (a bad plan fails here, before any
    /// rank computes). Every rank samples its sampled rows itself (under tensor parallelism from the rows it joins
    /// from every rank's vocabulary slice), so the ranks answer the same tokens.
    pub fn step(&mut self, plan: StepPlan) -> Result<StepResult> {
        let _span = debug_span!("group_step", seqs = plan.seq_count(), tokens = plan.token_count()).entered();
        if let Some(why) = &self.failed {
            return Err(EngineError::GroupFailed(why.clone()));
        }
        let sent = prepare(&self.books, &plan)?;
        self.steps += 1;
        let index = self.steps;
        let outs: Vec<StepOut> = match self.broadcast(|reply| RankMsg::Step {
            index,
            plan: sent.clone(),
            reply,
        }) {
            Ok(outs) => outs,
            Err(e) => {
                self.failed = Some(e.to_string());
                return Err(e);
            }
        };
        finish(&mut self.books, &plan, &outs, self.vocab)
    }

    /// Copies `slot`'s state from every rank (no verify may be pending).
    pub fn snapshot(&mut self, slot: usize) -> Result<GroupSnapshot> {
        if !self.books.started(slot) {
            return Err(EngineError::InvalidInput(format!(
                "slot {slot} holds no sequence state to snapshot"
            )));
        }
        if self.books.pending(slot)? > 0 {
            return Err(EngineError::InvalidInput(format!(
                "slot {slot} has a verify awaiting its commit; commit it before taking a snapshot"
            )));
        }
        Ok(GroupSnapshot {
            ranks: self.broadcast(|tx| RankMsg::Snapshot(slot, tx))?,
        })
    }

    /// Opens a new sequence from `snap`; returns its slot.
    pub fn restore(&mut self, snap: &GroupSnapshot) -> Result<usize> {
        if snap.ranks.len() != self.ranks.len() {
            return Err(EngineError::InvalidInput(format!(
                "a snapshot of {} ranks cannot be restored on {}",
                snap.ranks.len(),
                self.ranks.len()
            )));
        }
        let first = &snap.ranks[0];
        if snap
            .ranks
            .iter()
            .any(|s| s.position != first.position || s.form_choice != first.form_choice)
        {
            return Err(EngineError::InvalidInput("the ranks' snapshots disagree".into()));
        }
        let slot = self.books.open(first.form_choice)?;
        let parts = &snap.ranks;
        let result = {
            let mut replies = Vec::new();
            for (r, h) in self.ranks.iter().enumerate() {
                let (tx, rx) = channel();
                let reply: Reply<()> = Box::new(move |v| drop(tx.send(v)));
                h.send(RankMsg::Restore(slot, Box::new(parts[r].clone()), reply))?;
                replies.push((r, rx));
            }
            let mut err = None;
            for (r, rx) in replies {
                if let Err(e) = rx.recv().unwrap_or(Err(EngineError::RankStopped { rank: r })) {
                    err = err.or(Some(e));
                }
            }
            err
        };
        if let Some(e) = result {
            // Ranks that restored hold the slot; releasing it everywhere (errors from ranks that did not are
            // expected) leaves the group consistent.
            let _ = self.broadcast(|tx| RankMsg::Release(slot, tx));
            self.books.close(slot)?;
            return Err(e);
        }
        self.books.restored(slot, first.position)?;
        Ok(slot)
    }

    /// Why the group refuses steps, when a validated step failed on a rank.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// Every rank's health report, in rank order.
    pub fn health(&self) -> Result<Vec<RankHealth>> {
        self.broadcast(RankMsg::Health)
    }

    /// Waits for every rank's queued device work (for timing).
    pub fn synchronize(&self) -> Result<()> {
        self.broadcast(RankMsg::Synchronize).map(drop)
    }
}

/// Closes the rank threads' channels (which ends them) and waits for them; a thread stuck in a call is left behind
/// (its generation is aborted first, so a rank waiting in a collective returns).
fn shutdown(ranks: Vec<RankThread>) {
    for t in ranks {
        t.stop(Duration::from_secs(10));
    }
}

impl Drop for RankGroup {
    fn drop(&mut self) {
        if self.failed.is_some() {
            self.launch.abort.abort("the group was dropped after a failed step");
        }
        shutdown(std::mem::take(&mut self.ranks));
    }
}
