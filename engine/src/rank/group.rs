//! [`RankGroup`]: one OS thread per rank, each owning its [`Rank`] (built on that thread: a GPU rank's context and
//! NCCL communicator cannot move) and serving typed [`RankMsg`]s; and the coordinator's step over them — validate the
//! plan against the [`Books`], send the same plan to every rank, merge their answers ([`super::vocab`]), record it.
//!
//! Ranks run the same step in lockstep (their collectives meet inside the communicator). A rank that errors or stops
//! on a validated step fails it for the caller, and the group then refuses further steps ([`EngineError::GroupFailed`]):
//! the ranks may no longer agree with the books. Recovering (restart, re-prefill) is the actor runtime's job.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use tracing::debug_span;

use super::books::Books;
use super::plan::{RankHealth, RankInfo, SlotSnapshot, StepOut, StepPlan};
use super::vocab::{merge_step, VocabSummary};
use super::Rank;
use crate::decode::FormChoice;
use crate::error::{EngineError, Result};

/// A message to a rank's thread; each carries the channel its answer goes back on.
pub enum RankMsg {
    Step(Arc<StepPlan>, Sender<Result<StepOut>>),
    Release(usize, Sender<Result<()>>),
    Snapshot(usize, Sender<Result<SlotSnapshot>>),
    Restore(usize, Box<SlotSnapshot>, Sender<Result<()>>),
    Health(Sender<Result<RankHealth>>),
    Synchronize(Sender<Result<()>>),
}

struct RankThread {
    msgs: Sender<RankMsg>,
    thread: Option<JoinHandle<()>>,
}

/// Every rank's part of one slot's state, in rank order (see [`Rank::snapshot`]).
#[derive(Clone, Debug, PartialEq)]
pub struct GroupSnapshot {
    pub ranks: Vec<SlotSnapshot>,
}

/// The whole-vocabulary answer to one step: per reported row (in plan order) its summary, the token chosen for it
/// when the plan asked to sample, and the logits `[rows, vocab]` when the plan asked for them.
#[derive(Clone, Debug, PartialEq)]
pub struct StepResult {
    pub rows: Vec<VocabSummary>,
    pub sampled: Vec<Option<u32>>,
    pub logits: Option<Vec<f32>>,
}

/// The ranks of one model, driven in lockstep; see the module docs.
pub struct RankGroup {
    ranks: Vec<RankThread>,
    infos: Vec<RankInfo>,
    books: Books,
    vocab: usize,
    /// Why a validated step failed on a rank, after which the ranks' states may differ from the books.
    failed: Option<String>,
}

fn serve(rank: &mut dyn Rank, msgs: Receiver<RankMsg>) {
    // A send fails only when the coordinator stopped waiting; the rank keeps serving the next message.
    while let Ok(msg) = msgs.recv() {
        match msg {
            RankMsg::Step(plan, reply) => drop(reply.send(rank.step(&plan))),
            RankMsg::Release(slot, reply) => drop(reply.send(rank.release(slot))),
            RankMsg::Snapshot(slot, reply) => drop(reply.send(rank.snapshot(slot))),
            RankMsg::Restore(slot, snap, reply) => drop(reply.send(rank.restore(slot, &snap))),
            RankMsg::Health(reply) => drop(reply.send(rank.health())),
            RankMsg::Synchronize(reply) => drop(reply.send(rank.synchronize())),
        }
    }
}

impl RankGroup {
    /// Starts `tp` rank threads named `{name}-{rank}`; thread `r` builds its rank with `load(r)`. Fails (after every
    /// thread has answered) when any rank fails to load.
    pub fn spawn<F>(tp: usize, name: &str, load: F) -> Result<Self>
    where
        F: Fn(usize) -> Result<Box<dyn Rank>> + Send + Sync + 'static,
    {
        if tp == 0 {
            return Err(EngineError::InvalidInput("a group needs at least one rank".into()));
        }
        let load = Arc::new(load);
        let mut ranks = Vec::with_capacity(tp);
        let mut ready = Vec::with_capacity(tp);
        for r in 0..tp {
            let (msg_tx, msg_rx) = channel::<RankMsg>();
            let (ready_tx, ready_rx) = channel::<Result<RankInfo>>();
            let load = load.clone();
            let thread = std::thread::Builder::new()
                .name(format!("{name}-{r}"))
                .spawn(move || match load(r) {
                    Ok(mut rank) => {
                        if ready_tx.send(Ok(rank.info())).is_ok() {
                            serve(&mut *rank, msg_rx);
                        }
                    }
                    Err(e) => drop(ready_tx.send(Err(e))),
                })
                .map_err(|e| EngineError::InvalidInput(format!("starting the thread of rank {r}: {e}")))?;
            ranks.push(RankThread {
                msgs: msg_tx,
                thread: Some(thread),
            });
            ready.push(ready_rx);
        }
        let mut infos = Vec::with_capacity(tp);
        let mut first_err = None;
        for (r, rx) in ready.into_iter().enumerate() {
            match rx.recv().unwrap_or(Err(EngineError::RankStopped { rank: r })) {
                Ok(info) => infos.push(info),
                Err(e) => first_err = first_err.or(Some(e)),
            }
        }
        if first_err.is_none() {
            if let Some((r, info)) = infos.iter().enumerate().find(|(r, i)| i.rank != *r || i.tp != tp) {
                first_err = Some(EngineError::Communicator(format!(
                    "thread {r} loaded rank {} of {}, expected rank {r} of {tp}",
                    info.rank, info.tp
                )));
            }
        }
        let vocab = infos.last().map_or(0, |i| i.vocab.end);
        let books = match first_err {
            Some(e) => Err(e),
            None => Books::new(&infos, vocab),
        };
        match books {
            Ok(books) => Ok(RankGroup {
                ranks,
                infos,
                books,
                vocab,
                failed: None,
            }),
            Err(e) => {
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
    fn broadcast<T>(&self, make: impl Fn(Sender<Result<T>>) -> RankMsg) -> Result<Vec<T>> {
        let mut replies = Vec::with_capacity(self.ranks.len());
        for (r, h) in self.ranks.iter().enumerate() {
            let (tx, rx) = channel();
            h.msgs
                .send(make(tx))
                .map_err(|_| EngineError::RankStopped { rank: r })?;
            replies.push(rx);
        }
        let mut out = Vec::with_capacity(replies.len());
        let mut err = None;
        for (r, rx) in replies.into_iter().enumerate() {
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

    /// Ends the sequence in `slot` on every rank.
    pub fn release(&mut self, slot: usize) -> Result<()> {
        if self.books.close(slot)? {
            self.broadcast(|tx| RankMsg::Release(slot, tx))?;
        }
        Ok(())
    }

    /// Runs one step on every rank. The plan is checked against the books first (a bad plan fails here, before any
    /// rank computes). Under tensor parallelism the ranks hold vocabulary slices, so sampled rows come back as
    /// logits and are sampled here with the same function a whole-vocabulary rank uses.
    pub fn step(&mut self, plan: StepPlan) -> Result<StepResult> {
        let _span = debug_span!("group_step", seqs = plan.seqs.len(), tokens = plan.token_count()).entered();
        if let Some(why) = &self.failed {
            return Err(EngineError::GroupFailed(why.clone()));
        }
        self.books.validate(&plan)?;
        let tp = self.ranks.len();
        let mut sent = plan.clone();
        // Per reported row: the sampling the coordinator does itself (tensor parallelism only).
        let mut host_samples = Vec::new();
        if tp > 1 {
            for s in &mut sent.seqs {
                let rows = s.row_count();
                for r in 0..rows {
                    host_samples.push(if r + 1 == rows { s.sample.take() } else { None });
                }
                sent.full_logits |= host_samples.iter().rev().take(rows).any(Option::is_some);
            }
        }
        let sent = Arc::new(sent);
        let outs = match self.broadcast(|tx| RankMsg::Step(sent.clone(), tx)) {
            Ok(outs) => outs,
            Err(e) => {
                self.failed = Some(e.to_string());
                return Err(e);
            }
        };
        self.books.apply(&plan)?;
        let merged = merge_step(&outs, self.vocab)?;
        let mut sampled = merged.sampled;
        if let Some(logits) = &merged.logits {
            for (row, s) in host_samples.iter().enumerate() {
                if let Some(s) = s {
                    sampled[row] = Some(s.sample(&logits[row * self.vocab..(row + 1) * self.vocab]));
                }
            }
        }
        if let Some(row) = merged.rows.iter().position(VocabSummary::poisoned) {
            return Err(EngineError::NonFinite {
                position: row_position(&plan, row),
            });
        }
        Ok(StepResult {
            rows: merged.rows,
            sampled,
            logits: if plan.full_logits { merged.logits } else { None },
        })
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
                h.msgs
                    .send(RankMsg::Restore(slot, Box::new(parts[r].clone()), tx))
                    .map_err(|_| EngineError::RankStopped { rank: r })?;
                replies.push(rx);
            }
            let mut err = None;
            for (r, rx) in replies.into_iter().enumerate() {
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

/// The position of reported row `row` of `plan` (for error messages).
fn row_position(plan: &StepPlan, mut row: usize) -> usize {
    for s in &plan.seqs {
        let n = s.row_count();
        if row < n {
            return s.position + s.tokens.len() - n + row;
        }
        row -= n;
    }
    0
}

/// Closes the rank threads' message channels (which ends them) and waits for them.
fn shutdown(mut ranks: Vec<RankThread>) {
    let threads: Vec<_> = ranks.iter_mut().filter_map(|h| h.thread.take()).collect();
    drop(ranks);
    for t in threads {
        // A rank that panicked has already failed its step; nothing is left to report here.
        let _ = t.join();
    }
}

impl Drop for RankGroup {
    fn drop(&mut self) {
        shutdown(std::mem::take(&mut self.ranks));
    }
}
