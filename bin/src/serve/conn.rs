//! The servers' connections: each listener accepts at most `--max-connections` at once (one past it is closed at
//! once; HTTP answers it 503 first), and a connection is closed when its client is too slow or silent:
//!
//! - HTTP: a request's headers must arrive within `--header-timeout` of their first byte (slowloris), and a
//!   connection with no request in flight is closed after `--keep-alive-timeout` without a byte.
//! - gRPC: the HTTP/2 preface must arrive within `--header-timeout` of the connect; after that HTTP/2 keep-alive
//!   pings close connections whose peer is gone. A live gRPC channel may stay idle: clients keep one open on purpose.
//!
//! Both timers live in the socket wrapper ([`Watched`]), which fails the read that hyper waits on once a deadline
//! passes; for HTTP the request handler tells it when requests start and when their responses end ([`Activity`]).
//! [`ConnStats`] counts all of it for `/metrics`.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use futures::Stream;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};
use tower::ServiceExt;

use super::limits::ConnLimits;

/// How long a refused HTTP connection is given to take its 503 before it is closed.
const REFUSE_LINGER: Duration = Duration::from_secs(1);
/// Refused HTTP connections being answered at once; past that (a flood) they are closed without an answer, so that
/// refusing costs no more descriptors than this.
const REFUSALS_IN_FLIGHT: usize = 64;
/// The pause after a failed accept: the usual cause is running out of descriptors, which a busy retry cannot fix.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// HTTP/2 keep-alive pings on gRPC connections: how often, and how long an answer may take before the connection is
/// counted dead.
const GRPC_PING_INTERVAL: Duration = Duration::from_secs(60);
const GRPC_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// The two servers, as the metrics label them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Server {
    Http,
    Grpc,
}

impl Server {
    fn label(self) -> &'static str {
        match self {
            Server::Http => "http",
            Server::Grpc => "grpc",
        }
    }
}

/// Why the server closed a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closed {
    /// A request's headers (or the gRPC preface) took longer than `--header-timeout`.
    HeaderTimeout,
    /// No request and no byte for `--keep-alive-timeout`.
    IdleTimeout,
}

impl Closed {
    fn label(self) -> &'static str {
        match self {
            Closed::HeaderTimeout => "header_timeout",
            Closed::IdleTimeout => "idle_timeout",
        }
    }
}

/// One server's connection counters.
#[derive(Debug, Default)]
struct Counters {
    open: AtomicI64,
    accepted: AtomicU64,
    refused: AtomicU64,
    header_timeouts: AtomicU64,
    idle_timeouts: AtomicU64,
    accept_errors: AtomicU64,
}

/// Connection counters of both servers, rendered in `/metrics`.
#[derive(Debug, Default)]
pub struct ConnStats {
    http: Counters,
    grpc: Counters,
}

impl ConnStats {
    fn of(&self, server: Server) -> &Counters {
        match server {
            Server::Http => &self.http,
            Server::Grpc => &self.grpc,
        }
    }

    fn closed(&self, server: Server, why: Closed) {
        let c = self.of(server);
        match why {
            Closed::HeaderTimeout => &c.header_timeouts,
            Closed::IdleTimeout => &c.idle_timeouts,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    /// The counters in Prometheus' text format.
    pub fn prometheus(&self) -> String {
        let mut out = String::new();
        let servers = [Server::Http, Server::Grpc];
        let _ = writeln!(
            out,
            "# HELP rewind_connections_open Connections each server has open.\n# TYPE rewind_connections_open gauge"
        );
        for s in servers {
            let n = self.of(s).open.load(Ordering::Relaxed);
            let _ = writeln!(out, "rewind_connections_open{{server=\"{}\"}} {n}", s.label());
        }
        for (name, help, get) in [
            (
                "rewind_connections_accepted_total",
                "Connections each server accepted.",
                (|c: &Counters| &c.accepted) as fn(&Counters) -> &AtomicU64,
            ),
            (
                "rewind_connections_refused_total",
                "Connections closed at once because the server had --max-connections open.",
                |c| &c.refused,
            ),
            (
                "rewind_connection_accept_errors_total",
                "Failed accepts (out of file descriptors, most often).",
                |c| &c.accept_errors,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for s in servers {
                let n = get(self.of(s)).load(Ordering::Relaxed);
                let _ = writeln!(out, "{name}{{server=\"{}\"}} {n}", s.label());
            }
        }
        let name = "rewind_connections_timed_out_total";
        let _ = writeln!(
            out,
            "# HELP {name} Connections the server closed for a client too slow (header_timeout) or idle \
             (idle_timeout).\n# TYPE {name} counter"
        );
        for s in servers {
            for why in [Closed::HeaderTimeout, Closed::IdleTimeout] {
                let c = self.of(s);
                let n = match why {
                    Closed::HeaderTimeout => &c.header_timeouts,
                    Closed::IdleTimeout => &c.idle_timeouts,
                }
                .load(Ordering::Relaxed);
                let _ = writeln!(out, "{name}{{server=\"{}\",reason=\"{}\"}} {n}", s.label(), why.label());
            }
        }
        out
    }
}

/// A connection's place under the cap: its permit, and its count in the open gauge, both given back on drop.
struct Slot {
    _permit: OwnedSemaphorePermit,
    stats: Arc<ConnStats>,
    server: Server,
}

impl Slot {
    fn new(permit: OwnedSemaphorePermit, stats: Arc<ConnStats>, server: Server) -> Self {
        let c = stats.of(server);
        c.open.fetch_add(1, Ordering::Relaxed);
        c.accepted.fetch_add(1, Ordering::Relaxed);
        Slot {
            _permit: permit,
            stats,
            server,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.stats.of(self.server).open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a connection's requests are doing, as the idle and header timers need it.
#[derive(Debug)]
struct ActivityState {
    /// Requests whose response has not ended yet.
    busy: usize,
    /// When the connection last became free of requests (or was accepted).
    idle_since: Instant,
    /// When the first byte of the next request arrived, while none is in flight.
    head_since: Option<Instant>,
    /// The read waiting on the timers: woken when the last request ends, so that the idle timer starts.
    reader: Option<Waker>,
}

/// The shared record of a connection's requests ([`Activity::begin`] for each).
#[derive(Debug)]
pub struct Activity(Mutex<ActivityState>);

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Activity(Mutex::new(ActivityState {
            busy: 0,
            idle_since: Instant::now(),
            head_since: None,
            reader: None,
        })))
    }

    fn lock(&self) -> MutexGuard<'_, ActivityState> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request's headers arrived: it is in flight until the guard drops (when its response body ends).
    fn begin(self: &Arc<Self>) -> Busy {
        let mut s = self.lock();
        s.busy += 1;
        s.head_since = None;
        Busy(self.clone())
    }
}

/// A request in flight on its connection.
struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        let mut s = self.0.lock();
        s.busy -= 1;
        if s.busy == 0 {
            s.idle_since = Instant::now();
            if let Some(w) = s.reader.take() {
                w.wake();
            }
        }
    }
}

/// A response body that keeps its request counted in flight until it ends or is dropped.
struct Tracked {
    inner: Body,
    _busy: Busy,
}

impl http_body::Body for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Which deadlines a [`Watched`] socket keeps.
#[derive(Clone, Copy, Debug)]
enum Timers {
    /// HTTP: headers within `header` of their first byte; idle at most `idle` with no request in flight.
    Http { header: Duration, idle: Duration },
    /// gRPC: the first byte (the HTTP/2 preface) within this of the connect.
    Preface(Duration),
}

/// A socket whose reads fail with `TimedOut` once its connection is too slow or idle (see the module docs); it holds
/// the connection's [`Slot`] under the cap.
pub struct Watched {
    io: TcpStream,
    activity: Arc<Activity>,
    timers: Timers,
    accepted: Instant,
    /// Bytes read so far are none (the gRPC preface timer runs until one arrives).
    silent: bool,
    sleep: Pin<Box<Sleep>>,
    expired: Arc<Mutex<Option<Closed>>>,
    _slot: Slot,
}

impl Watched {
    fn new(io: TcpStream, timers: Timers, slot: Slot) -> Self {
        let now = Instant::now();
        Watched {
            io,
            activity: Activity::new(),
            timers,
            accepted: now,
            silent: true,
            sleep: Box::pin(tokio::time::sleep_until(now)),
            expired: Arc::new(Mutex::new(None)),
            _slot: slot,
        }
    }

    /// The deadline in force and what passing it means; `None` while a request is in flight (or, for gRPC, once the
    /// preface arrived).
    fn deadline(&self, cx: &Context<'_>) -> Option<(Instant, Closed)> {
        match self.timers {
            Timers::Preface(t) => self.silent.then_some((self.accepted + t, Closed::HeaderTimeout)),
            Timers::Http { header, idle } => {
                let mut s = self.activity.lock();
                if s.busy > 0 {
                    s.reader = Some(cx.waker().clone());
                    return None;
                }
                Some(match s.head_since {
                    Some(t) => (t + header, Closed::HeaderTimeout),
                    None => (s.idle_since + idle, Closed::IdleTimeout),
                })
            }
        }
    }

    /// Notes that bytes arrived: the gRPC preface began, or (with no request in flight) an HTTP request's headers.
    fn arrived(&mut self) {
        self.silent = false;
        if let Timers::Http { .. } = self.timers {
            let mut s = self.activity.lock();
            if s.busy == 0 && s.head_since.is_none() {
                s.head_since = Some(Instant::now());
            }
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    self.arrived();
                }
                return Poll::Ready(Ok(()));
            }
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => {}
        }
        let Some((deadline, why)) = self.deadline(cx) else {
            return Poll::Pending;
        };
        if self.sleep.deadline() != deadline {
            self.sleep.as_mut().reset(deadline);
        }
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                *self.expired.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, why.label())))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncWrite for Watched {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for Watched {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// Resolves when `stop` turns true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Logs and counts a failed accept, then pauses (see [`ACCEPT_BACKOFF`]).
async fn accept_failed(stats: &ConnStats, server: Server, e: &io::Error) {
    stats.of(server).accept_errors.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(server = server.label(), error = %e, "accepting a connection failed");
    tokio::time::sleep(ACCEPT_BACKOFF).await;
}

/// The answer of a connection past the cap: OpenAI's error shape, so clients retry as for any 503.
fn refusal(max_connections: usize) -> Vec<u8> {
    let body = serde_json::json!({"error": {
        "message": format!(
            "The server has its maximum of {max_connections} connections open (--max-connections); retry later."
        ),
        "type": "server_error",
        "param": null,
        "code": "too_many_connections",
    }})
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Answers a connection past the cap with a 503 and closes it, in the background and within [`REFUSE_LINGER`];
/// closed at once when [`REFUSALS_IN_FLIGHT`] are already being answered.
fn refuse_http(mut stream: TcpStream, refusals: &Arc<Semaphore>, answer: Arc<[u8]>) {
    let Ok(permit) = refusals.clone().try_acquire_owned() else {
        return;
    };
    tokio::spawn(async move {
        let _permit = permit;
        let _ = tokio::time::timeout(REFUSE_LINGER, async {
            stream.write_all(&answer).await?;
            stream.shutdown().await?;
            // Reading what the client sent until it closes: closing with unread bytes would reset the connection,
            // and a reset can discard the 503 before the client reads it.
            let mut sink = [0u8; 4096];
            while stream.read(&mut sink).await? > 0 {}
            Ok::<_, io::Error>(())
        })
        .await;
    });
}

/// Serves `router` on `listener` until `stop` turns true, within `limits` (see the module docs); then stops accepting
/// and shuts every connection down gracefully (a request in flight finishes). Dropping the future closes them all.
pub async fn serve_http(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    stats: Arc<ConnStats>,
    stop: watch::Receiver<bool>,
) -> io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let refusals = Arc::new(Semaphore::new(REFUSALS_IN_FLIGHT));
    let answer: Arc<[u8]> = refusal(limits.max_connections).into();
    let timers = Timers::Http {
        header: limits.header_timeout,
        idle: limits.keep_alive_timeout,
    };
    // The connections live in the set, so that dropping this future (the server task aborted) closes them.
    let mut conns = JoinSet::new();
    let mut stop_accepting = stop.clone();
    loop {
        tokio::select! {
            () = stopped(&mut stop_accepting) => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => match slots.clone().try_acquire_owned() {
                    Ok(permit) => {
                        let io = Watched::new(stream, timers, Slot::new(permit, stats.clone(), Server::Http));
                        conns.spawn(http_connection(io, peer, router.clone(), stats.clone(), stop.clone()));
                    }
                    Err(_) => {
                        stats.http.refused.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(%peer, max = limits.max_connections, "HTTP connection refused: at the cap");
                        refuse_http(stream, &refusals, answer.clone());
                    }
                },
                Err(e) => accept_failed(&stats, Server::Http, &e).await,
            },
        }
    }
    drop(listener);
    while conns.join_next().await.is_some() {}
    Ok(())
}

/// One HTTP connection (HTTP/1.1 or HTTP/2 without TLS, as the client speaks), until it closes, fails, times out or
/// `stop` shuts it down gracefully.
async fn http_connection(
    io: Watched,
    peer: SocketAddr,
    router: Router,
    stats: Arc<ConnStats>,
    mut stop: watch::Receiver<bool>,
) {
    let _ = io.io.set_nodelay(true);
    let activity = io.activity.clone();
    let expired = io.expired.clone();
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let busy = activity.begin();
        let answer = router.clone().oneshot(req.map(Body::new));
        async move {
            let response = answer.await.unwrap_or_else(|never: Infallible| match never {});
            Ok::<_, Infallible>(response.map(|inner| Body::new(Tracked { inner, _busy: busy })))
        }
    });
    // The timers are the socket's (see `Watched`); hyper's own header timer would also run while idle.
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(None);
    builder.http2().timer(TokioTimer::new());
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    tokio::pin!(conn);
    let mut shutting_down = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                let why = *expired.lock().unwrap_or_else(|e| e.into_inner());
                match (why, r) {
                    (Some(why), _) => {
                        stats.closed(Server::Http, why);
                        tracing::debug!(%peer, reason = why.label(), "HTTP connection closed");
                    }
                    (None, Err(e)) => tracing::debug!(%peer, error = %e, "HTTP connection failed"),
                    (None, Ok(())) => {}
                }
                break;
            }
            () = stopped(&mut stop), if !shutting_down => {
                conn.as_mut().graceful_shutdown();
                shutting_down = true;
            }
        }
    }
}

/// The gRPC server's connections from `listener`, within `limits`: one past the cap is closed at once (a client
/// sees UNAVAILABLE and may retry), the preface timer runs on each. Accept failures are logged and retried, never
/// ended on.
pub fn grpc_incoming(
    listener: TcpListener,
    limits: ConnLimits,
    stats: Arc<ConnStats>,
) -> impl Stream<Item = io::Result<Watched>> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    futures::stream::unfold(
        (listener, slots, limits, stats),
        |(listener, slots, limits, stats)| async move {
            loop {
                match listener.accept().await {
                    Ok((stream, peer)) => match slots.clone().try_acquire_owned() {
                        Ok(permit) => {
                            let _ = stream.set_nodelay(true);
                            let slot = Slot::new(permit, stats.clone(), Server::Grpc);
                            let io = Watched::new(stream, Timers::Preface(limits.header_timeout), slot);
                            return Some((Ok(io), (listener, slots, limits, stats)));
                        }
                        Err(_) => {
                            stats.grpc.refused.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(%peer, max = limits.max_connections, "gRPC connection refused: at the cap");
                        }
                    },
                    Err(e) => accept_failed(&stats, Server::Grpc, &e).await,
                }
            }
        },
    )
}

/// The gRPC server's settings for its connections: keep-alive pings that close those whose peer is gone.
pub fn grpc_server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(GRPC_PING_INTERVAL))
        .http2_keepalive_timeout(Some(GRPC_PING_TIMEOUT))
}

/// Counts a gRPC connection closed by its preface timer: tonic hides the connection's end, so the socket reports it.
impl Drop for Watched {
    fn drop(&mut self) {
        if let Timers::Preface(_) = self.timers {
            if let Some(why) = *self.expired.lock().unwrap_or_else(|e| e.into_inner()) {
                self._slot.stats.closed(Server::Grpc, why);
            }
        }
    }
}
