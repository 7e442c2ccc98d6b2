//! A rank's own OS thread: it builds the rank (a GPU rank's context, stream and NCCL communicator cannot move) and
//! serves typed [`RankMsg`]s from a crossbeam channel, answering each through the [`Reply`] it carries. Both drivers
//! use it: the synchronous [`super::RankGroup`] and the actor runtime's rank actors.
//!
//! The thread turns every failure into an answer: a step that errors or panics aborts the generation's
//! communicators first (the other ranks may be waiting in a collective for this one), and after a panic the thread
//! stops serving and reports why through its exit hook. Injected faults ([`super::fault`]) fire here.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};
use tracing::{debug_span, warn};

use super::fault::{FaultKind, Faults};
use super::launch::{Abort, Launch};
use super::plan::{RankHealth, RankInfo, SlotSnapshot, StepOut, StepPlan};
use super::Rank;
use crate::error::{EngineError, Result};

/// Where a rank's answer goes (a channel send, an actor's reply port).
pub type Reply<T> = Box<dyn FnOnce(Result<T>) + Send>;

/// A message to a rank's thread.
pub enum RankMsg {
    /// Run the coordinator's step number `index` (from 1; faults are injected by it).
    Step {
        index: u64,
        plan: Arc<StepPlan>,
        reply: Reply<StepOut>,
    },
    Release(usize, Reply<()>),
    Snapshot(usize, Reply<SlotSnapshot>),
    Restore(usize, Box<SlotSnapshot>, Reply<()>),
    /// [`Rank::store`]: `(slot, id)`.
    Store(usize, u64, Reply<Option<u64>>),
    /// [`Rank::restore_stored`]: `(slot, id)`.
    RestoreStored(usize, u64, Reply<()>),
    DropStored(Vec<u64>, Reply<()>),
    Health(Reply<RankHealth>),
    Synchronize(Reply<()>),
}

/// Called once when the thread stops serving for a reason other than its channel closing (a panic).
pub type ExitHook = Box<dyn FnOnce(String) + Send>;

/// The handle on one rank's thread.
pub struct RankThread {
    rank: usize,
    msgs: Option<Sender<RankMsg>>,
    ready: Option<Receiver<Result<RankInfo>>>,
    thread: Option<JoinHandle<()>>,
}

impl RankThread {
    /// Starts thread `{name}-{rank}`, which builds its rank with `launch.load(rank)` and then serves messages.
    /// [`RankThread::ready`] waits for the load.
    pub fn spawn(
        name: &str,
        rank: usize,
        launch: &Launch,
        faults: Arc<Faults>,
        on_exit: Option<ExitHook>,
    ) -> Result<Self> {
        let (msg_tx, msg_rx) = unbounded::<RankMsg>();
        let (ready_tx, ready_rx) = bounded::<Result<RankInfo>>(1);
        let launch = launch.clone();
        let thread = std::thread::Builder::new()
            .name(format!("{name}-{rank}"))
            .spawn(move || {
                let loaded = catch_unwind(AssertUnwindSafe(|| (launch.load)(rank)))
                    .unwrap_or_else(|p| Err(panicked(rank, p.as_ref())));
                let exit = match loaded {
                    Ok(mut r) => {
                        if ready_tx.send(Ok(r.info())).is_err() {
                            return;
                        }
                        serve(rank, &mut *r, &msg_rx, &launch.abort, &faults)
                    }
                    Err(e) => {
                        // Ranks still loading would wait for this one in their first collective. The failure is
                        // the answer to `ready`, not an exit to report.
                        launch.abort.abort(&format!("rank {rank} failed to load: {e}"));
                        let _ = ready_tx.send(Err(e));
                        None
                    }
                };
                if let (Some(why), Some(hook)) = (exit, on_exit) {
                    hook(why);
                }
            })
            .map_err(|e| EngineError::InvalidInput(format!("starting the thread of rank {rank}: {e}")))?;
        Ok(RankThread {
            rank,
            msgs: Some(msg_tx),
            ready: Some(ready_rx),
            thread: Some(thread),
        })
    }

    /// Waits for the rank to load; returns what it reported (once; later calls fail).
    pub fn ready(&mut self) -> Result<RankInfo> {
        let rx = self.ready.take().ok_or(EngineError::RankStopped { rank: self.rank })?;
        rx.recv().unwrap_or(Err(EngineError::RankStopped { rank: self.rank }))
    }

    /// Queues `msg`; fails when the thread has stopped (the message's reply is then dropped unanswered).
    pub fn send(&self, msg: RankMsg) -> Result<()> {
        self.msgs
            .as_ref()
            .and_then(|m| m.send(msg).ok())
            .ok_or(EngineError::RankStopped { rank: self.rank })
    }

    /// Closes the message channel (the thread ends after its current message) and waits up to `timeout` for it;
    /// returns whether it ended. A thread stuck in a call that never returns is left behind.
    pub fn stop(mut self, timeout: Duration) -> bool {
        self.msgs = None;
        let Some(t) = self.thread.take() else {
            return true;
        };
        let deadline = Instant::now() + timeout;
        while !t.is_finished() {
            if Instant::now() >= deadline {
                warn!(rank = self.rank, "a rank thread did not stop; leaving it behind");
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        // A panic was already answered and reported by the thread itself.
        let _ = t.join();
        true
    }
}

impl Drop for RankThread {
    fn drop(&mut self) {
        self.msgs = None;
        if let Some(t) = self.thread.take() {
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

fn panic_text(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

fn panicked(rank: usize, p: &(dyn Any + Send)) -> EngineError {
    EngineError::RankPanicked {
        rank,
        message: panic_text(p),
    }
}

/// Runs one step with its injected fault, if any.
fn run_step(
    rank: &mut dyn Rank,
    id: usize,
    plan: &StepPlan,
    fault: Option<FaultKind>,
    abort: &Abort,
) -> Result<StepOut> {
    match fault {
        Some(FaultKind::Panic) => panic!("injected panic on rank {id}"),
        Some(FaultKind::Error) => Err(EngineError::Injected(format!("error on rank {id}"))),
        Some(FaultKind::Hang) => {
            // A stuck rank: nothing but the generation's abort (the coordinator's deadline) ends it.
            let why = loop {
                if let Some(why) = abort.wait(Duration::from_secs(3600)) {
                    break why;
                }
            };
            Err(EngineError::Injected(format!(
                "hang on rank {id}, ended by the abort ({why})"
            )))
        }
        Some(FaultKind::Kill) => {
            // SAFETY: kill(2) on our own pid has no memory-safety preconditions; SIGKILL cannot be caught, so the
            // process ends here as one the OOM killer takes would.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            unreachable!("SIGKILL did not end the process")
        }
        Some(FaultKind::Abort) => std::process::abort(),
        Some(FaultKind::Nan) => {
            let mut out = rank.step(plan)?;
            for r in &mut out.rows {
                r.pass.max = f32::NAN;
            }
            if let Some(l) = &mut out.logits {
                l.fill(f32::NAN);
            }
            Ok(out)
        }
        None => rank.step(plan),
    }
}

/// Serves messages until the channel closes (`None`) or a call panics (the reason).
fn serve(id: usize, rank: &mut dyn Rank, msgs: &Receiver<RankMsg>, abort: &Abort, faults: &Faults) -> Option<String> {
    while let Ok(msg) = msgs.recv() {
        // Every call is caught: a panic is answered as an error, aborts the generation and ends the thread.
        macro_rules! answer {
            ($reply:expr, $call:expr) => {{
                match catch_unwind(AssertUnwindSafe(|| $call)) {
                    Ok(out) => $reply(out),
                    Err(p) => {
                        let e = panicked(id, p.as_ref());
                        let why = e.to_string();
                        abort.abort(&why);
                        $reply(Err(e));
                        return Some(why);
                    }
                }
            }};
        }
        match msg {
            RankMsg::Step { index, plan, reply } => {
                let _span = debug_span!("rank_step", rank = id, step = index).entered();
                let fault = faults.take(id, index);
                if let Some(kind) = fault {
                    warn!(rank = id, step = index, %kind, "injecting a fault");
                }
                answer!(
                    |out: Result<StepOut>| {
                        if let Err(e) = &out {
                            // The other ranks may be inside a collective waiting for this one.
                            abort.abort(&format!("rank {id} failed step {index}: {e}"));
                        }
                        reply(out)
                    },
                    run_step(rank, id, &plan, fault, abort)
                )
            }
            RankMsg::Release(slot, reply) => answer!(reply, rank.release(slot)),
            RankMsg::Snapshot(slot, reply) => answer!(reply, rank.snapshot(slot)),
            RankMsg::Restore(slot, snap, reply) => answer!(reply, rank.restore(slot, &snap)),
            RankMsg::Store(slot, id, reply) => answer!(reply, rank.store(slot, id)),
            RankMsg::RestoreStored(slot, id, reply) => answer!(reply, rank.restore_stored(slot, id)),
            RankMsg::DropStored(ids, reply) => answer!(reply, rank.drop_stored(&ids)),
            RankMsg::Health(reply) => answer!(reply, rank.health()),
            RankMsg::Synchronize(reply) => answer!(reply, rank.synchronize()),
        }
    }
    None
}
