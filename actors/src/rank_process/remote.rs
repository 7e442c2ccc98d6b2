//! The coordinator side: [`RankProcesses`] (the coordinator's cluster node and how to start a worker) and
//! [`ProcessRankActor`], a rank actor whose rank lives in a worker process. It answers the same [`RankActorMsg`]s as
//! [`crate::rank_actor::RankActor`], so the coordinator cannot tell the two apart.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ractor::concurrency::oneshot;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::{BoxRead, BoxWrite, ClusterBidiStream, NodeServer, NodeServerMessage};
use rewind_engine::rank::{Abort, RankInfo};
use rewind_engine::{EngineError, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::AsyncBufReadExt;
use tokio::sync::{watch, OnceCell};
use tracing::{info, warn};

use super::wire::{LoadArgs, Wire, WorkerMsg};
use super::worker::COOKIE_ENV;
use crate::rank_actor::RankActorMsg;

/// How often the coordinator looks for a started worker's actor in the cluster's process groups.
const FIND_POLL: Duration = Duration::from_millis(10);
/// How long a stopping rank actor waits for its killed worker to be reaped.
const REAP_TIMEOUT: Duration = Duration::from_secs(10);

/// How to start rank workers, and the coordinator's cluster node (started with the first generation).
pub struct RankProcesses {
    program: PathBuf,
    args: Vec<String>,
    cluster: OnceCell<Cluster>,
    generations: AtomicU64,
    /// Worker processes started, per rank (a rank's restarts are this less one).
    started: Vec<AtomicU64>,
}

impl std::fmt::Debug for RankProcesses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankProcesses")
            .field("program", &self.program)
            .field("args", &self.args)
            .finish()
    }
}

struct Cluster {
    addr: SocketAddr,
    cookie: String,
}

/// A TCP connection a worker opened, handed to the coordinator's node server.
struct Incoming(tokio::net::TcpStream);

impl ClusterBidiStream for Incoming {
    fn split(self: Box<Self>) -> (BoxRead, BoxWrite) {
        let (r, w) = self.0.into_split();
        (Box::new(r), Box::new(w))
    }
}

impl RankProcesses {
    /// Workers of `tp` ranks, each started as `program args... --rank R --coordinator ADDR --group G` (the cookie in
    /// the environment): `args` say which model and options, the rest is added per worker.
    pub fn new(program: PathBuf, args: Vec<String>, tp: usize) -> Self {
        RankProcesses {
            program,
            args,
            cluster: OnceCell::new(),
            generations: AtomicU64::new(0),
            started: (0..tp).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Restarts of each rank's worker so far (workers started less the first).
    pub fn restarts(&self) -> Vec<u64> {
        self.started
            .iter()
            .map(|s| s.load(Ordering::Relaxed).saturating_sub(1))
            .collect()
    }

    async fn cluster(&self) -> Result<&Cluster> {
        self.cluster.get_or_try_init(Cluster::start).await
    }
}

impl Cluster {
    /// The coordinator's node: a node server, and a listener of our own on loopback whose port we know (the node
    /// server's own listener does not report the port it chose), whose connections go to the node server.
    async fn start() -> Result<Cluster> {
        let failed = |what: &str, e: &dyn std::fmt::Display| EngineError::Communicator(format!("{what}: {e}"));
        let cookie = format!("{:032x}", rand::random::<u128>());
        let server = NodeServer::new(
            0,
            cookie.clone(),
            "rewind-coordinator".into(),
            Ipv4Addr::LOCALHOST.to_string(),
            None,
            None,
        )
        .with_listen_addr(Ipv4Addr::LOCALHOST.into());
        let (node, _) = Actor::spawn(None, server, ())
            .await
            .map_err(|e| failed("starting the coordinator's cluster node", &e))?;
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .map_err(|e| failed("listening for rank workers", &e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| failed("reading the cluster address", &e))?;
        let n = node.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let _ = stream.set_nodelay(true);
                let opened = NodeServerMessage::ConnectionOpenedExternal {
                    stream: Box::new(Incoming(stream)),
                    is_server: true,
                };
                if n.cast(opened).is_err() {
                    break;
                }
            }
        });
        info!(%addr, "the coordinator's cluster node is listening for rank workers");
        Ok(Cluster { addr, cookie })
    }
}

/// What one generation's process rank actors share: rank 0's rendezvous address, once it has one.
pub struct ProcessGeneration {
    processes: Arc<RankProcesses>,
    id: u64,
    rendezvous: watch::Sender<Option<std::result::Result<String, String>>>,
    faults: Vec<String>,
}

impl ProcessGeneration {
    /// A new generation of `processes`' workers (`faults`: the engine's `--inject-fault` specs).
    pub async fn new(processes: &Arc<RankProcesses>, faults: Vec<String>) -> Result<Arc<Self>> {
        processes.cluster().await?;
        Ok(Arc::new(ProcessGeneration {
            processes: processes.clone(),
            id: processes.generations.fetch_add(1, Ordering::Relaxed),
            rendezvous: watch::channel(None).0,
            faults,
        }))
    }
}

/// What starts a process rank actor.
pub struct ProcessRankArgs {
    pub rank: usize,
    pub generation: Arc<ProcessGeneration>,
    /// The generation's abort: it kills the worker (a rank stuck in a collective cannot hear a message).
    pub abort: Abort,
}

/// A process rank actor's state.
pub struct ProcessRankState {
    rank: usize,
    generation: Arc<ProcessGeneration>,
    pid: u32,
    /// Set to why once the worker has exited.
    exited: watch::Receiver<Option<String>>,
    /// The worker's stdin: it exits when this closes (the coordinator's process has gone).
    _stdin: Option<tokio::process::ChildStdin>,
    remote: Option<ActorRef<WorkerMsg>>,
}

/// See the module docs.
pub struct ProcessRankActor;

/// Sends `SIGKILL` to `pid` unless the worker is known to have exited (its pid could be reused then).
fn kill(pid: u32, exited: &watch::Receiver<Option<String>>) {
    if exited.borrow().is_none() {
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    }
}

async fn wait_exit(mut exited: watch::Receiver<Option<String>>) -> String {
    match exited.wait_for(Option::is_some).await {
        Ok(why) => why.clone().unwrap_or_default(),
        Err(_) => "the worker's watcher ended".into(),
    }
}

impl ProcessRankState {
    /// Sends `msg` to the worker now (so calls reach it in order) and forwards the answer to `reply` from a task; a
    /// worker that exits first drops `reply`, so the coordinator hears a stopped rank at once.
    fn call<T: Serialize + DeserializeOwned + Send + 'static>(
        &self,
        make: impl FnOnce(RpcReplyPort<Wire<T>>) -> WorkerMsg,
        reply: RpcReplyPort<Result<T>>,
    ) -> std::result::Result<(), ActorProcessingErr> {
        let remote = self.remote.as_ref().ok_or("the rank's worker has not been loaded")?;
        let (tx, rx) = oneshot();
        remote
            .send_message(make(tx.into()))
            .map_err(|e| format!("rank {}'s worker is unreachable: {e}", self.rank))?;
        let exited = self.exited.clone();
        tokio::spawn(async move {
            tokio::select! {
                answer = rx => match answer {
                    Ok(Wire(Ok(v))) => drop(reply.send(Ok(v))),
                    Ok(Wire(Err(e))) => {
                        if let Some(e) = e.into_engine() {
                            let _ = reply.send(Err(e));
                        }
                    }
                    Err(_) => {}
                },
                _ = wait_exit(exited) => {}
            }
        });
        Ok(())
    }

    /// Waits for the worker's actor to appear in the cluster (or the worker to exit).
    async fn find(&self) -> std::result::Result<ActorRef<WorkerMsg>, String> {
        let group = group_name(&self.generation, self.rank);
        loop {
            if let Some(cell) = ractor::pg::get_members(&group).into_iter().next() {
                return Ok(cell.into());
            }
            if let Some(why) = self.exited.borrow().clone() {
                return Err(format!("rank {}'s worker exited before it joined: {why}", self.rank));
            }
            tokio::time::sleep(FIND_POLL).await;
        }
    }

    /// A remote call answered by the worker, or the reason it was not.
    async fn ask<T: Serialize + DeserializeOwned + Send + 'static>(
        &self,
        remote: &ActorRef<WorkerMsg>,
        make: impl FnOnce(RpcReplyPort<Wire<T>>) -> WorkerMsg,
    ) -> std::result::Result<T, String> {
        let (tx, rx) = oneshot();
        remote
            .send_message(make(tx.into()))
            .map_err(|e| format!("rank {}'s worker is unreachable: {e}", self.rank))?;
        tokio::select! {
            answer = rx => match answer {
                Ok(Wire(Ok(v))) => Ok(v),
                Ok(Wire(Err(e))) => Err(e.into_engine().map_or_else(|| format!("rank {} has stopped", self.rank), |e| e.to_string())),
                Err(_) => Err(format!("rank {}'s worker dropped the call", self.rank)),
            },
            why = wait_exit(self.exited.clone()) => Err(format!("rank {}'s worker exited: {why}", self.rank)),
        }
    }

    /// Connects to the worker, meets at the rendezvous and loads the rank.
    async fn load(&mut self) -> std::result::Result<RankInfo, String> {
        let remote = self.find().await?;
        self.remote = Some(remote.clone());
        let g = self.generation.clone();
        let rendezvous = if self.rank == 0 {
            let addr = self.ask(&remote, WorkerMsg::Listen).await;
            g.rendezvous.send_replace(Some(addr.clone()));
            addr?
        } else {
            let mut rx = g.rendezvous.subscribe();
            let got = tokio::select! {
                got = rx.wait_for(Option::is_some) => got.map(|v| v.clone()).ok().flatten(),
                why = wait_exit(self.exited.clone()) => return Err(format!("rank {}'s worker exited: {why}", self.rank)),
            };
            match got {
                Some(Ok(addr)) => addr,
                Some(Err(e)) => return Err(format!("rank 0 could not open the rendezvous: {e}")),
                None => return Err("the generation ended before rank 0 opened the rendezvous".into()),
            }
        };
        let args = LoadArgs {
            rendezvous,
            faults: g.faults.clone(),
        };
        self.ask(&remote, |r| WorkerMsg::Load(Wire::ok(args), r)).await
    }
}

fn group_name(g: &ProcessGeneration, rank: usize) -> String {
    format!("rewind-g{}-rank{rank}", g.id)
}

impl Actor for ProcessRankActor {
    type Msg = RankActorMsg;
    type State = ProcessRankState;
    type Arguments = ProcessRankArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<RankActorMsg>,
        args: ProcessRankArgs,
    ) -> std::result::Result<ProcessRankState, ActorProcessingErr> {
        let g = args.generation;
        let rank = args.rank;
        let cluster = g.processes.cluster().await?;
        let mut cmd = tokio::process::Command::new(&g.processes.program);
        cmd.args(&g.processes.args)
            .arg("--rank")
            .arg(rank.to_string())
            .arg("--coordinator")
            .arg(cluster.addr.to_string())
            .arg("--group")
            .arg(group_name(&g, rank))
            .env(COOKIE_ENV, &cluster.cookie)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(false);
        // SAFETY: the closure runs in the child between fork and exec and only calls prctl(2), which is
        // async-signal-safe. PR_SET_PDEATHSIG kills the worker when the thread that forked it — a runtime worker
        // thread, alive as long as the coordinator's process — ends; the stdin pipe covers the rest.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| {
            EngineError::Communicator(format!(
                "starting rank {rank}'s worker process ({}): {e}",
                g.processes.program.display()
            ))
        })?;
        g.processes.started[rank].fetch_add(1, Ordering::Relaxed);
        let pid = child.id().ok_or("the worker exited at once")?;
        info!(rank, pid, generation = g.id, "started a rank worker process");
        for (out, is_err) in [
            (
                child
                    .stdout
                    .take()
                    .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Send + Unpin>),
                false,
            ),
            (
                child
                    .stderr
                    .take()
                    .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Send + Unpin>),
                true,
            ),
        ] {
            let Some(out) = out else { continue };
            // Worker logs, prefixed with their rank, on the coordinator's own streams.
            tokio::spawn(async move {
                let mut lines = tokio::io::BufReader::new(out).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if is_err {
                        eprintln!("[rank {rank}] {line}");
                    } else {
                        println!("[rank {rank}] {line}");
                    }
                }
            });
        }
        let stdin = child.stdin.take();
        let (exit_tx, exited) = watch::channel(None);
        let me = myself.clone();
        tokio::spawn(async move {
            let why = match child.wait().await {
                Ok(status) => status.to_string(),
                Err(e) => format!("waiting for it failed: {e}"),
            };
            exit_tx.send_replace(Some(why.clone()));
            let _ = me.send_message(RankActorMsg::ThreadExited(format!(
                "its worker process (pid {pid}) exited: {why}"
            )));
        });
        let ex = exited.clone();
        args.abort.on_abort(move |_| kill(pid, &ex));
        Ok(ProcessRankState {
            rank,
            generation: g,
            pid,
            exited,
            _stdin: stdin,
            remote: None,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<RankActorMsg>,
        msg: RankActorMsg,
        state: &mut ProcessRankState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        match msg {
            RankActorMsg::Ready(reply) => {
                let info = state.load().await;
                if state.rank == 0 {
                    // A rank 0 that failed before publishing leaves the others waiting: publish the failure.
                    if let Err(e) = &info {
                        state.generation.rendezvous.send_if_modified(|v| {
                            let unset = v.is_none();
                            if unset {
                                *v = Some(Err(e.clone()));
                            }
                            unset
                        });
                    }
                }
                let failed = info.as_ref().err().cloned();
                let _ = reply.send(info.map_err(EngineError::RankLoad));
                if let Some(why) = failed {
                    return Err(format!("rank {} failed to load: {why}", state.rank).into());
                }
            }
            RankActorMsg::Step { index, plan, reply } => {
                state.call(|r| WorkerMsg::Step(Wire::ok((index, plan)), r), reply)?
            }
            RankActorMsg::Release(slot, reply) => state.call(|r| WorkerMsg::Release(Wire::ok(slot), r), reply)?,
            RankActorMsg::Health(reply) => state.call(WorkerMsg::Health, reply)?,
            RankActorMsg::Snapshot(slot, reply) => state.call(|r| WorkerMsg::Snapshot(Wire::ok(slot), r), reply)?,
            RankActorMsg::Restore(slot, snap, reply) => {
                state.call(|r| WorkerMsg::Restore(Wire::ok((slot, snap)), r), reply)?
            }
            RankActorMsg::Store(slot, id, reply) => state.call(|r| WorkerMsg::Store(Wire::ok((slot, id)), r), reply)?,
            RankActorMsg::RestoreStored(slot, id, reply) => {
                state.call(|r| WorkerMsg::RestoreStored(Wire::ok((slot, id)), r), reply)?
            }
            RankActorMsg::DropStored(ids, reply) => state.call(|r| WorkerMsg::DropStored(Wire::ok(ids), r), reply)?,
            RankActorMsg::ThreadExited(why) => {
                return Err(Box::new(EngineError::GroupFailed(format!(
                    "rank {}: {why}",
                    state.rank
                ))))
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<RankActorMsg>,
        state: &mut ProcessRankState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        if let Some(remote) = &state.remote {
            let _ = remote.send_message(WorkerMsg::Abort(Wire::ok("the generation is stopping".into())));
        }
        kill(state.pid, &state.exited);
        if tokio::time::timeout(REAP_TIMEOUT, wait_exit(state.exited.clone()))
            .await
            .is_err()
        {
            warn!(
                rank = state.rank,
                pid = state.pid,
                "the rank's worker process did not exit after SIGKILL"
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restarts_count_workers_past_the_first() {
        let p = RankProcesses::new(PathBuf::from("/bin/true"), Vec::new(), 2);
        p.started[0].fetch_add(3, Ordering::Relaxed);
        p.started[1].fetch_add(1, Ordering::Relaxed);
        assert_eq!(p.restarts(), vec![2, 0]);
    }
}
