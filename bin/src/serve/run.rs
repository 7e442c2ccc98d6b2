//! Runs both servers over one engine until SIGINT / SIGTERM, then drains: new requests are refused, in-flight ones
//! finish (bounded by the drain timeout), both servers shut down gracefully and the engine stops.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{AbortHandle, JoinError, JoinHandle};

use super::conn::{self, ConnStats};
use super::limits::{self, ConnLimits, RequestLimits};
use super::ServeState;
use crate::cli::ListenArgs;
use crate::output::errln;

/// How often the drain polls the engine for in-flight requests.
const DRAIN_POLL: Duration = Duration::from_millis(50);
/// How long both servers get to close their connections once the engine is idle (a client that keeps a stream open
/// past that is cut off).
const SERVER_STOP_GRACE: Duration = Duration::from_secs(10);
/// How long the engine waits for the last handler to let go of it before it is stopped without waiting.
const ENGINE_RELEASE_GRACE: Duration = Duration::from_secs(5);

/// Where and how the servers listen, from the flags.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub host: String,
    /// 0: any free port (the bound one is printed).
    pub grpc_port: u16,
    pub http_port: u16,
    /// The longest a drain waits for in-flight requests.
    pub drain_timeout: Duration,
    /// How long a gRPC session may sit idle before the engine evicts it (`None`: never).
    pub session_idle_timeout: Option<Duration>,
    /// Connection bounds of both servers (`--max-connections`, `--header-timeout`, `--keep-alive-timeout`).
    pub conn: ConnLimits,
    /// Request bounds (`--max-request-bytes`, `--body-timeout`), which the state carries to the handlers.
    pub request: RequestLimits,
    /// The most host bytes the sessions' saved states may hold together.
    pub session_memory: usize,
}

impl ServeOptions {
    /// The options of the serving flags, checked.
    pub fn from_args(a: &ListenArgs) -> Result<Self> {
        let seconds = |v: f64, flag: &str| crate::cli::seconds(v, flag, true);
        anyhow::ensure!(!a.host.trim().is_empty(), "--host must not be empty");
        let idle = seconds(a.session_idle_timeout, "--session-idle-timeout")?;
        let (conn, request) = limits::from_args(a)?;
        Ok(ServeOptions {
            host: a.host.clone(),
            grpc_port: a.grpc_port,
            http_port: a.http_port,
            drain_timeout: seconds(a.drain_timeout, "--drain-timeout")?,
            session_idle_timeout: (!idle.is_zero()).then_some(idle),
            conn,
            request,
            session_memory: usize::try_from(a.session_memory).map_err(|_| {
                anyhow::anyhow!(
                    "--session-memory {} is more than this host can address",
                    a.session_memory
                )
            })?,
        })
    }
}

/// The runtime the servers and the engine's actors run on (one worker per core: the engine's heavy work runs on its
/// rank threads, the workers carry connections).
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .thread_name("rewind-serve")
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// SIGINT and SIGTERM, registered when made (so a signal that arrives while the servers start is not lost to its
/// default action).
struct Signals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Signals {
                term: signal(SignalKind::terminate()).context("listening for SIGTERM")?,
                int: signal(SignalKind::interrupt()).context("listening for SIGINT")?,
            })
        }
        #[cfg(not(unix))]
        Ok(Signals {})
    }

    /// The next signal's name.
    async fn next(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.term.recv() => "SIGTERM",
                _ = self.int.recv() => "SIGINT",
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            "Ctrl-C"
        }
    }
}

/// The two servers' bound addresses.
#[derive(Clone, Copy, Debug)]
pub struct Bound {
    pub grpc: SocketAddr,
    pub http: SocketAddr,
}

/// A handle to servers started by [`start`]: their addresses and the way to stop them.
pub struct Running {
    pub bound: Bound,
    state: Arc<ServeState>,
    stop: watch::Sender<bool>,
    /// `None` once the server's task has ended and its result was taken: a finished `JoinHandle` must not be polled
    /// again (tokio panics).
    http: Option<JoinHandle<std::io::Result<()>>>,
    grpc: Option<JoinHandle<std::result::Result<(), tonic::transport::Error>>>,
}

/// The result of the task in `slot`, which is emptied; never resolves for an empty slot.
async fn ended<T>(slot: &mut Option<JoinHandle<T>>) -> std::result::Result<T, JoinError> {
    let Some(handle) = slot.as_mut() else {
        return std::future::pending().await;
    };
    let r = handle.await;
    *slot = None;
    r
}

/// The result of the task in `slot` when it is still there (`None` for one already taken).
async fn join<T>(slot: Option<JoinHandle<T>>) -> Option<std::result::Result<T, JoinError>> {
    match slot {
        Some(h) => Some(h.await),
        None => None,
    }
}

async fn bind(host: &str, port: u16, what: &str) -> Result<TcpListener> {
    TcpListener::bind((host, port))
        .await
        .with_context(|| format!("binding the {what} server to {host}:{port}"))
}

/// Both servers' sockets, bound before the model loads: a port in use is reported at once, not after minutes of
/// loading weights.
pub struct Listeners {
    grpc: TcpListener,
    http: TcpListener,
    /// `--host`, a name the HTTP server answers to without an API key.
    host: String,
    limits: ConnLimits,
}

impl Listeners {
    /// Binds the gRPC and HTTP ports of `opts` on its host.
    pub async fn bind(opts: &ServeOptions) -> Result<Self> {
        Ok(Listeners {
            grpc: bind(&opts.host, opts.grpc_port, "gRPC").await?,
            http: bind(&opts.host, opts.http_port, "HTTP").await?,
            host: opts.host.clone(),
            limits: opts.conn.clone(),
        })
    }
}

/// Resolves when `stop` turns true (or its sender is gone).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Starts both servers on `listeners`; calls `announce` with the bound addresses, then prints them on stderr.
pub async fn start(state: Arc<ServeState>, listeners: Listeners, announce: impl FnOnce(Bound)) -> Result<Running> {
    let Listeners {
        grpc: grpc_listener,
        http: http_listener,
        host,
        limits,
    } = listeners;
    let bound = Bound {
        grpc: grpc_listener.local_addr()?,
        http: http_listener.local_addr()?,
    };
    let (stop, stop_rx) = watch::channel(false);
    let router = super::http::router(state.clone(), bound.http, &host);
    let stats: Arc<ConnStats> = state.connections.clone();
    let http = tokio::spawn(conn::serve_http(
        http_listener,
        router,
        limits.clone(),
        stats.clone(),
        stop_rx.clone(),
    ));
    let grpc = tokio::spawn(
        conn::grpc_server()
            .add_service(super::grpc::service(state.clone()))
            .serve_with_incoming_shutdown(conn::grpc_incoming(grpc_listener, limits, stats), stopped(stop_rx)),
    );
    announce(bound);
    // Tests and scripts read the ports from these lines (port 0 binds any free one); errln! does not buffer.
    errln!("rewind: grpc listening on {}", bound.grpc);
    errln!("rewind: http listening on {}", bound.http);
    Ok(Running {
        bound,
        state,
        stop,
        http: Some(http),
        grpc: Some(grpc),
    })
}

impl Running {
    /// Waits until a server fails (an error) or `until` resolves (Ok).
    async fn watch(&mut self, until: impl std::future::Future<Output = ()>) -> Result<()> {
        tokio::select! {
            r = ended(&mut self.http) => Err(server_end("HTTP", r.map(|r| r.map_err(anyhow::Error::from)))),
            r = ended(&mut self.grpc) => Err(server_end("gRPC", r.map(|r| r.map_err(anyhow::Error::from)))),
            () = until => Ok(()),
        }
    }

    /// Stops both servers gracefully (open connections get [`SERVER_STOP_GRACE`] to end), then the engine.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let Running { state, http, grpc, .. } = self;
        let aborts: Vec<_> = [
            http.as_ref().map(|h| h.abort_handle()),
            grpc.as_ref().map(|h| h.abort_handle()),
        ]
        .into_iter()
        .flatten()
        .collect();
        // Each handle is awaited once, by this join, to its end; the grace period only aborts the tasks.
        let joined = async { tokio::join!(join(http), join(grpc)) };
        tokio::pin!(joined);
        let (h, g) = tokio::select! {
            r = &mut joined => r,
            () = tokio::time::sleep(SERVER_STOP_GRACE) => {
                errln!(
                    "rewind: connections still open {} s after the shutdown began; closing them",
                    SERVER_STOP_GRACE.as_secs()
                );
                // Aborted tasks drop their handlers (and their holds on the engine) as they end.
                aborts.iter().for_each(AbortHandle::abort);
                joined.await
            }
        };
        for (what, r) in [
            ("HTTP", h.map(|r| r.map(|r| r.map_err(anyhow::Error::from)))),
            ("gRPC", g.map(|r| r.map(|r| r.map_err(anyhow::Error::from)))),
        ] {
            match r {
                Some(Ok(Err(e))) => errln!("rewind: the {what} server ended with an error: {e:#}"),
                Some(Err(e)) if !e.is_cancelled() => errln!("rewind: the {what} server task failed: {e}"),
                _ => {}
            }
        }
        stop_engine(state).await;
    }
}

/// The error of a server that ended on its own.
fn server_end(what: &str, r: std::result::Result<Result<()>, tokio::task::JoinError>) -> anyhow::Error {
    match r {
        Ok(Ok(())) => anyhow::anyhow!("the {what} server stopped unexpectedly"),
        Ok(Err(e)) => e.context(format!("the {what} server failed")),
        Err(e) => anyhow::anyhow!("the {what} server task failed: {e}"),
    }
}

/// Stops the engine once every handler has let go of it; one that still holds it after [`ENGINE_RELEASE_GRACE`]
/// (a client that never reads its stream) gets an engine stopped without waiting (its requests fail).
async fn stop_engine(state: Arc<ServeState>) {
    let deadline = Instant::now() + ENGINE_RELEASE_GRACE;
    let mut engine = state.engine.clone();
    drop(state);
    loop {
        match Arc::try_unwrap(engine) {
            Ok(e) => return e.shutdown().await,
            Err(still) if Instant::now() >= deadline => {
                errln!("rewind: the engine is still in use after the servers stopped; stopping it without waiting");
                // Dropping the last handle but one stops the coordinator (EngineHandle's Drop) once the rest go.
                drop(still);
                return;
            }
            Err(still) => {
                engine = still;
                tokio::time::sleep(DRAIN_POLL).await;
            }
        }
    }
}

/// Waits until the engine has nothing waiting or running, at most `timeout`; `Err` with the counts left on timeout.
async fn wait_idle(state: &ServeState, timeout: Duration) -> std::result::Result<(), String> {
    let deadline = Instant::now() + timeout;
    // Two idle polls in a row: a request a handler took just before the drain began reaches the engine a moment
    // later, and must not be cut off by a shutdown that saw the engine idle in between.
    let mut idle_polls = 0;
    loop {
        let last = match state.engine.health().await {
            Ok(h) if h.running == 0 && h.waiting == 0 => {
                idle_polls += 1;
                if idle_polls >= 2 {
                    return Ok(());
                }
                "idle".to_string()
            }
            Ok(h) => {
                idle_polls = 0;
                format!("{} running, {} waiting", h.running, h.waiting)
            }
            // A stopped engine has nothing in flight.
            Err(rewind_actors::ActorsError::Stopped) => return Ok(()),
            Err(e) => {
                idle_polls = 0;
                format!("health check failed: {e}")
            }
        };
        if Instant::now() >= deadline {
            return Err(last);
        }
        tokio::time::sleep(DRAIN_POLL).await;
    }
}

/// Serves `state` on `opts` until SIGINT / SIGTERM (see the module docs); a second signal during the drain stops
/// waiting for in-flight requests. An error when a port cannot be bound or a server fails. The caller should hold no
/// other reference to `state`: the engine stops once the servers have let go of it.
pub async fn serve(state: Arc<ServeState>, listeners: Listeners, opts: &ServeOptions) -> Result<()> {
    serve_with(state, listeners, opts, |_| {}).await
}

/// [`serve`], calling `announce` with the bound addresses once both servers listen (`rewind-launch`'s banner).
pub async fn serve_with(
    state: Arc<ServeState>,
    listeners: Listeners,
    opts: &ServeOptions,
    announce: impl FnOnce(Bound),
) -> Result<()> {
    let mut signals = Signals::new()?;
    let mut running = start(state.clone(), listeners, announce).await?;
    let mut signal = None;
    let outcome = running
        .watch(async {
            signal = Some(signals.next().await);
        })
        .await;
    if let Err(e) = outcome {
        state.drain();
        running.stop().await;
        return Err(e);
    }
    let signal = signal.unwrap_or("a signal");
    state.drain();
    errln!(
        "rewind: {signal}: draining (new requests refused; waiting up to {:.0} s for in-flight ones)",
        opts.drain_timeout.as_secs_f64()
    );
    let t0 = Instant::now();
    let mut forced = false;
    tokio::select! {
        r = wait_idle(&state, opts.drain_timeout) => match r {
            Ok(()) => errln!("rewind: drained in {:.1} s", t0.elapsed().as_secs_f64()),
            Err(left) => {
                errln!(
                    "rewind: drain timeout ({:.0} s) with requests in flight ({left}); stopping anyway",
                    opts.drain_timeout.as_secs_f64()
                );
                forced = true;
            }
        },
        again = signals.next() => {
            errln!("rewind: {again} again: stopping without waiting for in-flight requests");
            forced = true;
        }
    }
    if forced {
        // In-flight streams end with an error event / status rather than being cut off mid-stream, and their
        // connections close, so the servers stop at once instead of after the grace period.
        state.cut_off();
    }
    drop(state);
    running.stop().await;
    errln!("rewind: stopped");
    Ok(())
}
