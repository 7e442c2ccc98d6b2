//! The worker side: one process hosting one rank. It joins the coordinator's cluster, offers a [`WorkerActor`] under
//! the process group the coordinator named, and serves the rank through a local [`RankActor`] — the same actor and
//! OS thread as an in-process rank, so a worker runs exactly what a thread would.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use ractor::concurrency::oneshot;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use ractor_cluster::NodeServer;
use rewind_engine::rank::{Abort, CpuLauncher, FaultSpec, Faults, Meet};
use rewind_engine::shard::TcpRendezvous;
use rewind_engine::{EngineError, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::{info, warn};

use super::wire::{LoadArgs, RemoteError, Wire, WorkerMsg};
use crate::rank_actor::{RankActor, RankActorMsg, RankArgs};

/// The environment variable that carries the cluster's cookie to a worker (kept off the command line, which any
/// local user can read).
pub const COOKIE_ENV: &str = "REWIND_CLUSTER_COOKIE";

/// How long a worker whose rank stopped waits before exiting, so that its last answers (a panic's error) reach the
/// coordinator before the connection closes.
const EXIT_GRACE: Duration = Duration::from_millis(300);

/// Where a worker finds its coordinator, and which rank it hosts.
#[derive(Clone, Debug)]
pub struct WorkerArgs {
    pub rank: usize,
    /// The coordinator's cluster address.
    pub coordinator: SocketAddr,
    /// The process group the coordinator looks for this worker's actor under.
    pub group: String,
    pub cookie: String,
}

struct WorkerState {
    rank: usize,
    tp: usize,
    launcher: CpuLauncher,
    /// Rank 0's rendezvous, from `Listen` until `Load`.
    rendezvous: Option<TcpRendezvous>,
    actor: Option<ActorRef<RankActorMsg>>,
    abort: Option<Abort>,
}

/// The worker's face to the coordinator: forwards [`WorkerMsg`]s to the local [`RankActor`].
struct WorkerActor;

/// Forwards a call to the local rank actor; its answer goes back over the wire. Sent in the handler, so calls reach
/// the rank in the order they arrived.
fn relay<T: Serialize + DeserializeOwned + Send + 'static>(
    state: &WorkerState,
    make: impl FnOnce(RpcReplyPort<Result<T>>) -> RankActorMsg,
    reply: RpcReplyPort<Wire<T>>,
) {
    let Some(actor) = &state.actor else {
        let _ = reply.send(Wire(Err(RemoteError::Other(format!(
            "rank {} has not been loaded",
            state.rank
        )))));
        return;
    };
    let (tx, rx) = oneshot();
    if actor.send_message(make(tx.into())).is_err() {
        let _ = reply.send(Wire(Err(RemoteError::Stopped)));
        return;
    }
    tokio::spawn(async move {
        let out = match rx.await {
            Ok(r) => r.map_err(RemoteError::from),
            Err(_) => Err(RemoteError::Stopped),
        };
        let _ = reply.send(Wire(out));
    });
}

impl Actor for WorkerActor {
    type Msg = WorkerMsg;
    type State = WorkerState;
    type Arguments = (usize, CpuLauncher);

    async fn pre_start(
        &self,
        _myself: ActorRef<WorkerMsg>,
        (rank, launcher): (usize, CpuLauncher),
    ) -> std::result::Result<WorkerState, ActorProcessingErr> {
        use rewind_engine::rank::Launcher;
        Ok(WorkerState {
            rank,
            tp: launcher.tp(),
            launcher,
            rendezvous: None,
            actor: None,
            abort: None,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<WorkerMsg>,
        msg: WorkerMsg,
        state: &mut WorkerState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        match msg {
            WorkerMsg::Listen(reply) => {
                let out = if state.rank != 0 {
                    Err(RemoteError::Other(format!(
                        "rank {} was asked to host the rendezvous",
                        state.rank
                    )))
                } else {
                    TcpRendezvous::bind(Ipv4Addr::LOCALHOST.into())
                        .map(|rv| {
                            let addr = rv.addr().to_string();
                            state.rendezvous = Some(rv);
                            addr
                        })
                        .map_err(RemoteError::from)
                };
                let _ = reply.send(Wire(out));
            }
            WorkerMsg::Load(Wire(args), reply) => match self.load(&myself, state, args).await {
                Ok(actor) => {
                    // Loading waits for the peers at the rendezvous: answered from a task, so that an `Abort`
                    // reaches this actor meanwhile.
                    tokio::spawn(async move {
                        let out = match actor.call(RankActorMsg::Ready, None).await {
                            Ok(ractor::rpc::CallResult::Success(r)) => r.map_err(RemoteError::from),
                            _ => Err(RemoteError::Stopped),
                        };
                        let _ = reply.send(Wire(out));
                    });
                }
                Err(e) => {
                    let _ = reply.send(Wire(Err(e)));
                }
            },
            WorkerMsg::Step(Wire(args), reply) => match args {
                Ok((index, plan)) => relay(state, |r| RankActorMsg::Step { index, plan, reply: r }, reply),
                Err(e) => drop(reply.send(Wire(Err(e)))),
            },
            WorkerMsg::Release(Wire(slot), reply) => match slot {
                Ok(slot) => relay(state, |r| RankActorMsg::Release(slot, r), reply),
                Err(e) => drop(reply.send(Wire(Err(e)))),
            },
            WorkerMsg::Health(reply) => relay(state, RankActorMsg::Health, reply),
            WorkerMsg::Snapshot(Wire(slot), reply) => match slot {
                Ok(slot) => relay(state, |r| RankActorMsg::Snapshot(slot, r), reply),
                Err(e) => drop(reply.send(Wire(Err(e)))),
            },
            WorkerMsg::Restore(Wire(args), reply) => match args {
                Ok((slot, snap)) => relay(state, |r| RankActorMsg::Restore(slot, snap, r), reply),
                Err(e) => drop(reply.send(Wire(Err(e)))),
            },
            WorkerMsg::Store(Wire(args), reply) => match args {
                Ok((slot, id)) => relay(state, |r| RankActorMsg::Store(slot, id, r), reply),
                Err(e) => drop(reply.send(Wire(Err(e)))),
            },
            WorkerMsg::RestoreStored(Wire(args), reply) => match args {
                Ok((slot, id)) => relay(state, |r| RankActorMsg::RestoreStored(slot, id, r), reply),
                Err(e) => drop(reply.send(Wire(Err(e)))),
            },
            WorkerMsg::DropStored(Wire(ids), reply) => match ids {
                Ok(ids) => relay(state, |r| RankActorMsg::DropStored(ids, r), reply),
                Err(e) => drop(reply.send(Wire(Err(e)))),
            },
            WorkerMsg::Abort(Wire(why)) => {
                let why = why.unwrap_or_else(|e| format!("{e:?}"));
                if let Some(a) = &state.abort {
                    a.abort(&why);
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<WorkerMsg>,
        evt: SupervisionEvent,
        state: &mut WorkerState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        // The rank's thread stopped (a panic, a failed load): this worker cannot serve again; it ends, and the
        // coordinator's supervision starts a fresh one.
        let why = match evt {
            SupervisionEvent::ActorFailed(_, e) => e.to_string(),
            SupervisionEvent::ActorTerminated(_, _, reason) => reason.unwrap_or_else(|| "stopped".into()),
            _ => return Ok(()),
        };
        Err(format!("rank {}'s actor stopped: {why}", state.rank).into())
    }
}

impl WorkerActor {
    async fn load(
        &self,
        myself: &ActorRef<WorkerMsg>,
        state: &mut WorkerState,
        args: std::result::Result<LoadArgs, RemoteError>,
    ) -> std::result::Result<ActorRef<RankActorMsg>, RemoteError> {
        let args = args?;
        if state.actor.is_some() {
            return Err(RemoteError::Other(format!("rank {} is already loaded", state.rank)));
        }
        let meet =
            if state.rank == 0 {
                Meet::Host(state.rendezvous.take().ok_or_else(|| {
                    RemoteError::Other("rank 0 was asked to load before it opened the rendezvous".into())
                })?)
            } else {
                Meet::Join(args.rendezvous.parse().map_err(|e| {
                    RemoteError::Other(format!(
                        "the rendezvous address {:?} is not an address: {e}",
                        args.rendezvous
                    ))
                })?)
            };
        let specs = args
            .faults
            .iter()
            .map(|s| s.parse::<FaultSpec>())
            .collect::<Result<Vec<_>>>()
            .map_err(RemoteError::from)?;
        let faults = Arc::new(Faults::new(specs, state.tp).map_err(RemoteError::from)?);
        let launch = state
            .launcher
            .launch_process(state.rank, meet)
            .map_err(RemoteError::from)?;
        state.abort = Some(launch.abort.clone());
        let rank_args = RankArgs {
            rank: state.rank,
            name: "cpu-rank".into(),
            launch,
            faults,
        };
        let (actor, _) = Actor::spawn_linked(None, RankActor, rank_args, myself.get_cell())
            .await
            .map_err(|e| RemoteError::Other(format!("starting rank {}'s actor: {e}", state.rank)))?;
        state.actor = Some(actor.clone());
        Ok(actor)
    }
}

/// Runs a worker to its end: joins the coordinator's cluster at `args.coordinator`, serves rank `args.rank` of
/// `launcher`'s model, and returns once the rank has stopped (the process then exits; the coordinator starts a fresh
/// one). Also returns — with an error — when the coordinator cannot be reached.
pub async fn run(args: WorkerArgs, launcher: CpuLauncher) -> Result<()> {
    let failed = |what: &str, e: &dyn std::fmt::Display| EngineError::Communicator(format!("{what}: {e}"));
    let node = NodeServer::new(
        0,
        args.cookie.clone(),
        format!("{}-worker", args.group),
        Ipv4Addr::LOCALHOST.to_string(),
        None,
        None,
    )
    .with_listen_addr(Ipv4Addr::LOCALHOST.into());
    let (node, node_handle) = Actor::spawn(None, node, ())
        .await
        .map_err(|e| failed("starting the worker's cluster node", &e))?;
    ractor_cluster::client_connect(&node, args.coordinator)
        .await
        .map_err(|e| failed(&format!("connecting to the coordinator at {}", args.coordinator), &e))?;
    let (worker, handle) = Actor::spawn(None, WorkerActor, (args.rank, launcher))
        .await
        .map_err(|e| failed("starting the worker actor", &e))?;
    // The coordinator finds this worker by its group once the cluster has synchronised it.
    ractor::pg::join(args.group.clone(), vec![worker.get_cell()]);
    info!(rank = args.rank, coordinator = %args.coordinator, "the rank's worker joined the cluster");
    let ended = handle.await;
    warn!(rank = args.rank, ?ended, "the rank's worker is ending");
    tokio::time::sleep(EXIT_GRACE).await;
    node.stop(None);
    let _ = node_handle.await;
    Ok(())
}
