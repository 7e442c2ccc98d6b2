//! [`EngineHandle`]: the one client handle every front end uses. `submit` returns an [`EventStream`] of the request's
//! events; dropping the stream before its end cancels the request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorRef, SpawnErr};
use rewind_engine::rank::Launcher;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::coordinator::{
    Coordinator, CoordinatorArgs, CoordinatorMsg, EngineConfig, EngineHealth, EngineInfo, SessionMsg,
};
use crate::error::ActorsError;
use crate::metrics::Metrics;
use crate::request::{Event, FailureKind, GenerateRequest};
use crate::session::{SessionInfo, SessionOptions, SessionOwner};

/// A running engine: the coordinator actor and its rank actors.
pub struct EngineHandle {
    coordinator: ActorRef<CoordinatorMsg>,
    join: Option<tokio::task::JoinHandle<()>>,
    next_id: AtomicU64,
    metrics: Arc<Metrics>,
    info: EngineInfo,
    rank_processes: Option<Arc<crate::rank_process::RankProcesses>>,
}

impl EngineHandle {
    /// Starts the coordinator and the first generation of `launcher`'s ranks (waiting for them to load).
    pub async fn start(launcher: Arc<dyn Launcher>, config: EngineConfig) -> Result<Self, ActorsError> {
        let metrics = Arc::new(Metrics::default());
        let rank_processes = config.rank_processes.clone();
        let args = CoordinatorArgs {
            launcher,
            config,
            metrics: metrics.clone(),
        };
        let (coordinator, join) = Actor::spawn(None, Coordinator, args).await.map_err(|e| match e {
            SpawnErr::StartupFailed(e) => ActorsError::Start(e.to_string()),
            e => ActorsError::Start(e.to_string()),
        })?;
        let info = ractor::call!(coordinator, CoordinatorMsg::Info).map_err(|e| ActorsError::Start(e.to_string()))?;
        Ok(EngineHandle {
            coordinator,
            rank_processes,
            join: Some(join),
            next_id: AtomicU64::new(1),
            metrics,
            info,
        })
    }

    /// What the engine serves.
    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// The engine's counters and gauges.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// With ranks in worker processes (`--rank-processes`): how often each rank's worker was restarted.
    pub fn worker_restarts(&self) -> Option<Vec<u64>> {
        self.rank_processes.as_ref().map(|p| p.restarts())
    }

    /// Queues a request; its events arrive on the returned stream. A request the engine cannot take (bad
    /// parameters, a prompt too long) gets a single `Failed` event.
    pub fn submit(&self, request: GenerateRequest) -> Result<EventStream, ActorsError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let open = request.n.max(1);
        let (tx, rx) = unbounded_channel();
        self.coordinator
            .send_message(CoordinatorMsg::Submit {
                id,
                request,
                events: tx,
            })
            .map_err(|_| ActorsError::Stopped)?;
        Ok(EventStream {
            id,
            rx,
            coordinator: self.coordinator.clone(),
            open,
            ended: false,
        })
    }

    /// Every rank's health and the scheduler's counts.
    pub async fn health(&self) -> Result<EngineHealth, ActorsError> {
        ractor::call!(self.coordinator, CoordinatorMsg::Health)
            .map_err(|_| ActorsError::Stopped)?
            .map_err(ActorsError::Engine)
    }

    async fn session_call<T: Send + 'static>(
        &self,
        make: impl FnOnce(ractor::RpcReplyPort<T>) -> SessionMsg,
    ) -> Result<T, ActorsError> {
        ractor::call!(self.coordinator, |reply| CoordinatorMsg::Session(make(reply))).map_err(|_| ActorsError::Stopped)
    }

    /// Opens a session of `owner` (see `session.rs`): its turns are requests with [`GenerateRequest::session`] and
    /// [`GenerateRequest::owner`] set. Every session call names its caller's owner; another owner's sessions behave
    /// as if they did not exist.
    pub async fn create_session(
        &self,
        owner: SessionOwner,
        options: SessionOptions,
    ) -> Result<SessionInfo, ActorsError> {
        Ok(self.session_call(|r| SessionMsg::Create(owner, options, r)).await??)
    }

    /// A new session of `owner` sharing their session `id`'s tokens and saved state (refused while `id` runs a
    /// turn); the state is copied only when one of them saves a new one.
    pub async fn fork_session(&self, owner: SessionOwner, id: &str) -> Result<SessionInfo, ActorsError> {
        Ok(self
            .session_call(|r| SessionMsg::Fork(owner, id.to_string(), r))
            .await??)
    }

    /// Removes `owner`'s session `id` (a turn it is running finishes, but is not saved).
    pub async fn close_session(&self, owner: SessionOwner, id: &str) -> Result<(), ActorsError> {
        Ok(self
            .session_call(|r| SessionMsg::Close(owner, id.to_string(), r))
            .await??)
    }

    /// `owner`'s session `id`.
    pub async fn session(&self, owner: SessionOwner, id: &str) -> Result<SessionInfo, ActorsError> {
        Ok(self
            .session_call(|r| SessionMsg::Get(owner, id.to_string(), r))
            .await??)
    }

    /// Every session of `owner`, by id.
    pub async fn list_sessions(&self, owner: SessionOwner) -> Result<Vec<SessionInfo>, ActorsError> {
        self.session_call(|r| SessionMsg::List(owner, r)).await
    }

    /// Stops the engine: live requests fail with "the engine stopped", the ranks end.
    pub async fn shutdown(mut self) {
        let _ = self
            .coordinator
            .stop_and_wait(None, Some(Duration::from_secs(120)))
            .await;
        if let Some(j) = self.join.take() {
            let _ = j.await;
        }
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        if self.join.is_some() {
            self.coordinator.stop(None);
        }
    }
}

/// The events of one request; see [`Event`]. Dropped before its end, it cancels the request (every choice).
pub struct EventStream {
    id: u64,
    rx: UnboundedReceiver<Event>,
    coordinator: ActorRef<CoordinatorMsg>,
    /// Choices not yet finished: the stream ends with the last one's `Finished`.
    open: usize,
    ended: bool,
}

impl EventStream {
    /// The request's id in the engine.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether the last event came (every choice's `Finished`, or a `Failed`).
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// The next event; `None` after the last one (every choice's `Finished`, or a `Failed`).
    pub async fn next(&mut self) -> Option<Event> {
        if self.ended {
            return None;
        }
        let e = self.rx.recv().await;
        match &e {
            Some(Event::Finished { .. }) => {
                self.open = self.open.saturating_sub(1);
                self.ended = self.open == 0;
            }
            Some(Event::Failed { .. }) | None => self.ended = true,
            Some(Event::Token { .. } | Event::PromptLogprobs { .. }) => {}
        }
        if e.is_none() {
            return Some(Event::failed(FailureKind::Unavailable, "the engine stopped"));
        }
        e
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        if !self.ended {
            let _ = self.coordinator.send_message(CoordinatorMsg::Cancel(self.id));
        }
    }
}
