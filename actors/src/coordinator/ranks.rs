//! One generation of rank actors as the coordinator sees them: starting them (linked to the coordinator, their
//! supervisor), calling all of them under a deadline, and stopping them. A rank actor is either a
//! [`RankActor`] (the rank is a thread of this process) or a [`ProcessRankActor`] (the rank is a worker process,
//! `--rank-processes`); both answer the same [`RankActorMsg`]s, and nothing below tells them apart.

use std::sync::Arc;
use std::time::Duration;

use ractor::concurrency::oneshot;
use ractor::{Actor, ActorCell, ActorRef, RpcReplyPort};
use rewind_engine::rank::{Abort, Faults, Launch, Launcher, RankInfo};
use rewind_engine::{EngineError, Result};

use crate::rank_actor::{RankActor, RankActorMsg, RankArgs};
use crate::rank_process::{ProcessGeneration, ProcessRankActor, ProcessRankArgs, RankProcesses};

/// Why a call to the ranks failed.
#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    /// A rank did not answer within the deadline.
    Deadline(Duration),
    /// A rank's actor or thread has stopped (its reply was dropped).
    Stopped(usize),
    /// A rank answered with an error.
    Rank(usize, String, bool),
    /// The merged answer held a NaN or an infinity.
    NonFinite(String),
}

impl Fault {
    /// The fault's class, for metrics and logs.
    pub fn class(&self) -> &'static str {
        match self {
            Fault::Deadline(_) => "deadline",
            Fault::Stopped(_) => "stopped",
            Fault::Rank(_, _, true) => "panic",
            Fault::Rank(..) => "error",
            Fault::NonFinite(_) => "non_finite",
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Deadline(d) => write!(
                f,
                "a rank did not answer within the step deadline of {:.1} s",
                d.as_secs_f64()
            ),
            Fault::Stopped(r) => write!(f, "rank {r} has stopped"),
            Fault::Rank(r, e, _) => write!(f, "rank {r}: {e}"),
            Fault::NonFinite(e) => f.write_str(e),
        }
    }
}

/// How long stopping a generation waits for its ranks' communicator aborts to finish ([`Launch::settle`]).
const SETTLE_TIMEOUT: Duration = Duration::from_secs(20);

/// Where a generation's ranks run.
enum Kind {
    /// Threads of this process, sharing one launch.
    Threads(Launch),
    /// Worker processes.
    Processes(Arc<ProcessGeneration>),
}

/// The rank actors of one generation.
pub struct Generation {
    pub ranks: Vec<ActorRef<RankActorMsg>>,
    /// Ends the generation's collectives (rank threads) or its worker processes.
    pub abort: Abort,
    /// See [`rewind_engine::rank::Launch::settle`].
    pub settle: fn(Duration) -> usize,
    pub infos: Vec<RankInfo>,
}

impl Generation {
    /// Launches a generation of `launcher`'s ranks as actors supervised by `supervisor` and waits (up to
    /// `load_deadline`) for every rank to load.
    pub async fn start(
        launcher: &Arc<dyn Launcher>,
        faults: &Arc<Faults>,
        processes: Option<&Arc<RankProcesses>>,
        supervisor: ActorCell,
        load_deadline: Duration,
    ) -> Result<Generation> {
        // Threads share one launch (its communicators and abort); worker processes each launch their own rank, and
        // the generation's abort kills them.
        let kind = match processes {
            Some(p) => {
                let specs = faults.specs().iter().map(ToString::to_string).collect();
                Kind::Processes(ProcessGeneration::new(p, specs).await?)
            }
            None => Kind::Threads(launcher.launch()?),
        };
        let mut g = Generation {
            ranks: Vec::with_capacity(launcher.tp()),
            abort: match &kind {
                Kind::Threads(l) => l.abort.clone(),
                Kind::Processes(_) => Abort::new(),
            },
            settle: match &kind {
                Kind::Threads(l) => l.settle,
                Kind::Processes(_) => rewind_engine::rank::launch::settled,
            },
            infos: Vec::new(),
        };
        for rank in 0..launcher.tp() {
            let spawned = match &kind {
                Kind::Threads(launch) => {
                    let args = RankArgs {
                        rank,
                        name: launcher.name().to_string(),
                        launch: launch.clone(),
                        faults: faults.clone(),
                    };
                    Actor::spawn_linked(None, RankActor, args, supervisor.clone()).await
                }
                Kind::Processes(generation) => {
                    let args = ProcessRankArgs {
                        rank,
                        generation: generation.clone(),
                        abort: g.abort.clone(),
                    };
                    Actor::spawn_linked(None, ProcessRankActor, args, supervisor.clone()).await
                }
            };
            match spawned {
                Ok((r, _)) => g.ranks.push(r),
                Err(e) => {
                    g.stop(&format!("starting rank {rank}: {e}")).await;
                    return Err(EngineError::GroupFailed(format!(
                        "starting the actor of rank {rank}: {e}"
                    )));
                }
            }
        }
        match g.call(RankActorMsg::Ready, load_deadline).await {
            Ok(infos) => {
                if let Some((r, i)) = infos
                    .iter()
                    .enumerate()
                    .find(|(r, i)| i.rank != *r || i.tp != infos.len())
                {
                    let why = format!("actor {r} loaded rank {} of {}", i.rank, i.tp);
                    g.stop(&why).await;
                    return Err(EngineError::Communicator(why));
                }
                g.infos = infos;
                Ok(g)
            }
            Err(f) => {
                let why = match &f {
                    Fault::Rank(_, e, _) => e.clone(),
                    f => f.to_string(),
                };
                g.stop(&why).await;
                Err(EngineError::RankLoad(why))
            }
        }
    }

    /// Sends a message built by `make` to every rank and waits for all answers (rank order) until `deadline`; the
    /// first failure, in rank order, is returned.
    pub async fn call<T: Send + 'static>(
        &self,
        make: impl Fn(RpcReplyPort<Result<T>>) -> RankActorMsg,
        deadline: Duration,
    ) -> std::result::Result<Vec<T>, Fault> {
        self.call_each(|_, reply| make(reply), deadline).await
    }

    /// [`Generation::call`] with a message per rank: `make` gets the rank's index.
    pub async fn call_each<T: Send + 'static>(
        &self,
        make: impl Fn(usize, RpcReplyPort<Result<T>>) -> RankActorMsg,
        deadline: Duration,
    ) -> std::result::Result<Vec<T>, Fault> {
        let mut replies = Vec::with_capacity(self.ranks.len());
        for (r, actor) in self.ranks.iter().enumerate() {
            let (tx, rx) = oneshot();
            actor.send_message(make(r, tx.into())).map_err(|_| Fault::Stopped(r))?;
            replies.push(rx);
        }
        let until = tokio::time::Instant::now() + deadline;
        let mut out = Vec::with_capacity(replies.len());
        let mut faults = Vec::new();
        for (r, rx) in replies.into_iter().enumerate() {
            match tokio::time::timeout_at(until, rx).await {
                Err(_) => return Err(Fault::Deadline(deadline)),
                Ok(Err(_)) => faults.push(Fault::Stopped(r)),
                Ok(Ok(Err(e))) => {
                    let panicked = matches!(e, EngineError::RankPanicked { .. });
                    faults.push(Fault::Rank(r, e.to_string(), panicked));
                }
                Ok(Ok(Ok(v))) => out.push(v),
            }
        }
        // A failing rank aborts the generation, so the others answer too; the root cause is reported: a panic, then
        // an error that is not a communicator abort, then whatever came first.
        let rank = |f: &Fault| match f {
            Fault::Rank(_, _, true) => 0,
            Fault::Rank(_, e, false) if !e.contains("communicator:") => 1,
            Fault::Stopped(_) => 2,
            _ => 3,
        };
        match faults.into_iter().min_by_key(rank) {
            Some(f) => Err(f),
            None => Ok(out),
        }
    }

    /// Aborts the generation (ranks waiting in a collective return) and stops its actors, waiting for their threads.
    pub async fn stop(&self, why: &str) {
        self.abort.abort(why);
        for r in &self.ranks {
            // An actor that already failed has nothing left to stop.
            let _ = r
                .stop_and_wait(Some(why.to_string()), Some(Duration::from_secs(60)))
                .await;
        }
        let settle = self.settle;
        let t0 = std::time::Instant::now();
        match tokio::task::spawn_blocking(move || settle(SETTLE_TIMEOUT)).await {
            Ok(0) => tracing::info!(
                seconds = t0.elapsed().as_secs_f64(),
                "the stopped generation's aborts have settled"
            ),
            Ok(left) => tracing::warn!(left, "aborts of the stopped generation still running; left behind"),
            Err(e) => tracing::warn!(%e, "waiting for the stopped generation's aborts failed"),
        }
    }
}
