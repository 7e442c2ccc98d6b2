//! The rank actor: one per device, the async face of a rank's own OS thread ([`RankThread`], which owns the rank —
//! a GPU rank's context, stream and NCCL communicator cannot move). It forwards typed messages to the thread, whose
//! answers go straight to the caller's reply port, so the actor never blocks on device work and a hung rank leaves
//! it responsive. When the thread stops (a panic), the actor fails, and its supervisor — the coordinator — hears it.

use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use rewind_engine::rank::{Faults, Launch, RankHealth, RankInfo, RankMsg, RankThread, SlotSnapshot, StepOut, StepPlan};
use rewind_engine::{EngineError, Result};
use tracing::warn;

/// How long a stopping rank actor waits for its thread to end (a thread stuck in a call is left behind).
const THREAD_STOP: Duration = Duration::from_secs(30);

/// A message to a rank actor.
pub enum RankActorMsg {
    /// Waits for the rank to load; answers what it reported.
    Ready(RpcReplyPort<Result<RankInfo>>),
    /// Runs the coordinator's step number `index`.
    Step {
        index: u64,
        plan: Arc<StepPlan>,
        reply: RpcReplyPort<Result<StepOut>>,
    },
    /// Ends the sequence in a slot.
    Release(usize, RpcReplyPort<Result<()>>),
    Health(RpcReplyPort<Result<RankHealth>>),
    /// Copies a slot's state to the host (no verify may await its commit).
    Snapshot(usize, RpcReplyPort<Result<SlotSnapshot>>),
    /// Starts the sequence in a free slot from a snapshot of this rank's shard.
    Restore(usize, Box<SlotSnapshot>, RpcReplyPort<Result<()>>),
    /// Copies a slot's state into the rank's own store under an id: `(slot, id)` (`Rank::store`).
    Store(usize, u64, RpcReplyPort<Result<Option<u64>>>),
    /// Starts the sequence in a free slot from a stored state: `(slot, id)`.
    RestoreStored(usize, u64, RpcReplyPort<Result<()>>),
    /// Frees stored states.
    DropStored(Vec<u64>, RpcReplyPort<Result<()>>),
    /// The rank's thread stopped serving (sent by the thread itself).
    ThreadExited(String),
}

// Local-only: the cluster feature of ractor (rank workers, `crate::rank_process`) asks every message type to say
// whether it crosses the wire; a process rank actor's wire messages are `crate::rank_process::WorkerMsg`.
impl ractor::Message for RankActorMsg {}

/// What starts a rank actor.
pub struct RankArgs {
    pub rank: usize,
    /// The rank threads' name.
    pub name: String,
    pub launch: Launch,
    pub faults: Arc<Faults>,
}

/// A rank actor's state: its thread, until the actor stops.
pub struct RankState {
    rank: usize,
    thread: Option<RankThread>,
}

/// See the module docs.
pub struct RankActor;

fn forward<T: Send + 'static>(port: RpcReplyPort<Result<T>>) -> rewind_engine::rank::Reply<T> {
    // A send fails only when the caller stopped waiting (a step past its deadline).
    Box::new(move |v| drop(port.send(v)))
}

impl RankActor {
    fn send(state: &RankState, msg: RankMsg) -> std::result::Result<(), ActorProcessingErr> {
        let thread = state.thread.as_ref().ok_or("the rank's thread is gone")?;
        // A failed send drops the message and its reply, so the caller hears the rank has stopped.
        thread.send(msg).map_err(|e| Box::new(e) as ActorProcessingErr)
    }
}

impl Actor for RankActor {
    type Msg = RankActorMsg;
    type State = RankState;
    type Arguments = RankArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<RankActorMsg>,
        args: RankArgs,
    ) -> std::result::Result<RankState, ActorProcessingErr> {
        // The thread loads the rank in the background: under tensor parallelism ranks meet while loading, so every
        // rank actor must exist before any load can finish (`Ready` waits for it).
        let me = myself.clone();
        let exit = Box::new(move |why: String| drop(me.send_message(RankActorMsg::ThreadExited(why))));
        let thread = RankThread::spawn(&args.name, args.rank, &args.launch, args.faults, Some(exit))?;
        Ok(RankState {
            rank: args.rank,
            thread: Some(thread),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<RankActorMsg>,
        msg: RankActorMsg,
        state: &mut RankState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        match msg {
            RankActorMsg::Ready(reply) => {
                let mut thread = state.thread.take().ok_or("the rank's thread is gone")?;
                let (thread, info) = tokio::task::spawn_blocking(move || {
                    let info = thread.ready();
                    (thread, info)
                })
                .await?;
                state.thread = Some(thread);
                let failed = info.as_ref().err().map(ToString::to_string);
                let _ = reply.send(info);
                if let Some(why) = failed {
                    return Err(format!("rank {} failed to load: {why}", state.rank).into());
                }
            }
            RankActorMsg::Step { index, plan, reply } => Self::send(
                state,
                RankMsg::Step {
                    index,
                    plan,
                    reply: forward(reply),
                },
            )?,
            RankActorMsg::Release(slot, reply) => Self::send(state, RankMsg::Release(slot, forward(reply)))?,
            RankActorMsg::Health(reply) => Self::send(state, RankMsg::Health(forward(reply)))?,
            RankActorMsg::Snapshot(slot, reply) => Self::send(state, RankMsg::Snapshot(slot, forward(reply)))?,
            RankActorMsg::Restore(slot, snap, reply) => {
                Self::send(state, RankMsg::Restore(slot, snap, forward(reply)))?
            }
            RankActorMsg::Store(slot, id, reply) => Self::send(state, RankMsg::Store(slot, id, forward(reply)))?,
            RankActorMsg::RestoreStored(slot, id, reply) => {
                Self::send(state, RankMsg::RestoreStored(slot, id, forward(reply)))?
            }
            RankActorMsg::DropStored(ids, reply) => Self::send(state, RankMsg::DropStored(ids, forward(reply)))?,
            RankActorMsg::ThreadExited(why) => {
                return Err(Box::new(EngineError::GroupFailed(format!(
                    "rank {}'s thread stopped: {why}",
                    state.rank
                ))))
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<RankActorMsg>,
        state: &mut RankState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        if let Some(thread) = state.thread.take() {
            let rank = state.rank;
            let ended = tokio::task::spawn_blocking(move || thread.stop(THREAD_STOP)).await?;
            if !ended {
                warn!(rank, "the rank's thread did not end; it is left behind");
            }
        }
        Ok(())
    }
}
