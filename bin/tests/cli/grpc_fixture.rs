//! The shared fixture of `grpc_api.rs`: a tiny random model served over gRPC on a loopback port, the request
//! builders and the one-line calls the tests make.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rewind_actors::{EngineConfig, EngineHandle};
use rewind_bin::serve::grpc::client::{connect, Client};
use rewind_bin::serve::grpc::{self, pb};
use rewind_bin::serve::{ServeState, ServedModel};
use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::init::{init_model, InitOptions};
use rewind_engine::model::Family;
use rewind_engine::rank::{CpuLauncher, CpuOptions};
use tokio::sync::oneshot;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Code, Status};

/// The pools' length: every test's sequences fit.
pub const CONTEXT: usize = 256;

/// The pools' length of a server whose first request must still run when the test acts on it (a dropped stream, a
/// full queue): the tiny model makes 200 tokens in well under a second, so such a request asks for
/// [`LONG_REQUEST`] tokens (as the HTTP tests' disconnect does).
pub const LONG_CONTEXT: usize = 4096;

/// Tokens of a request that must outlast the test's next moves (see [`LONG_CONTEXT`]).
pub const LONG_REQUEST: i64 = 4000;

/// A tiny random Nemotron-H checkpoint, written once per test process.
pub fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("rewind-grpc-api-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        init_model(&InitOptions {
            family: Family::NemotronH,
            preset: "tiny".into(),
            layers: None,
            seed: 0,
            out: dir.clone(),
            dtype: None,
            mtp: false,
        })
        .expect("init-model");
        dir
    })
}

/// A server on a loopback port over its own engine; stops when dropped.
pub struct Server {
    pub addr: String,
    pub state: Arc<ServeState>,
    /// The API keys it accepts ([`Server::client`] presents the first).
    pub keys: Vec<String>,
    pub _stop: oneshot::Sender<()>,
}

impl Server {
    pub async fn start(slots: usize, api_key: Option<&str>) -> Server {
        Self::start_with(slots, api_key, |_| {}).await
    }

    /// A server whose engine settings `tune` changes.
    pub async fn start_with(slots: usize, api_key: Option<&str>, tune: impl FnOnce(&mut EngineConfig)) -> Server {
        Self::start_in(slots, CONTEXT, api_key.as_slice(), tune).await
    }

    /// A server accepting each of `keys`.
    pub async fn start_with_keys(slots: usize, keys: &[&str]) -> Server {
        Self::start_in(slots, CONTEXT, keys, |_| {}).await
    }

    /// A server with pools of `context` tokens whose engine settings `tune` changes.
    pub async fn start_in(slots: usize, context: usize, keys: &[&str], tune: impl FnOnce(&mut EngineConfig)) -> Server {
        let dir = model_dir();
        let model = ServedModel::load(dir).expect("model");
        let launcher = CpuLauncher::new(
            dir,
            CpuOptions {
                tp: 1,
                decoder: DecoderConfig::new(slots, context),
            },
        )
        .expect("launcher");
        let mut config = EngineConfig::new(FormChoice::Auto);
        config.eos_token_ids = model.eos_token_ids.clone();
        config.tokenizer = Some(model.tokenizer.clone());
        tune(&mut config);
        let engine = EngineHandle::start(Arc::new(launcher), config).await.expect("engine");
        let state = Arc::new(ServeState::new(
            Arc::new(engine),
            model,
            "tiny".into(),
            keys.iter().map(|k| k.to_string()).collect(),
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = format!("http://{}", listener.local_addr().expect("addr"));
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tonic::transport::Server::builder()
            .add_service(grpc::service(state.clone()))
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                let _ = stopped.await;
            });
        tokio::spawn(server);
        Server {
            addr,
            state,
            keys: keys.iter().map(|k| k.to_string()).collect(),
            _stop: stop,
        }
    }

    pub async fn client(&self) -> Client {
        connect(&self.addr, self.keys.first().map(String::as_str))
            .await
            .expect("connect")
    }

    pub fn prefilled(&self) -> u64 {
        self.state.engine.metrics().snapshot().prefill_tokens
    }
}

pub fn greedy(max_tokens: i64) -> Option<pb::Sampling> {
    Some(pb::Sampling {
        temperature: Some(0.0),
        ignore_eos: Some(true),
        max_tokens: Some(max_tokens),
        ..Default::default()
    })
}

pub fn ids_input(ids: &[u32]) -> pb::TokenIds {
    pb::TokenIds { ids: ids.to_vec() }
}

pub fn complete_ids(ids: &[u32], sampling: Option<pb::Sampling>) -> pb::CompleteRequest {
    pb::CompleteRequest {
        input: Some(pb::complete_request::Input::TokenIds(ids_input(ids))),
        sampling,
        speculate: None,
        logprobs: false,
        n: None,
        top_logprobs: None,
        prompt_logprobs: None,
    }
}

pub fn turn_ids(session: &str, ids: &[u32], sampling: Option<pb::Sampling>) -> pb::GenerateRequest {
    pb::GenerateRequest {
        session_id: session.to_string(),
        input: Some(pb::generate_request::Input::TokenIds(ids_input(ids))),
        sampling,
        logprobs: false,
        n: None,
        top_logprobs: None,
    }
}

pub type Reply = Result<(Vec<u32>, pb::GenerateChunk), Status>;

/// Every token of a streamed reply, and its last chunk.
pub async fn drain(response: Result<tonic::Response<tonic::Streaming<pb::GenerateChunk>>, Status>) -> Reply {
    let mut stream = response?.into_inner();
    let mut tokens = Vec::new();
    let mut last = None;
    while let Some(chunk) = stream.message().await? {
        tokens.extend_from_slice(&chunk.token_ids);
        last = Some(chunk);
    }
    Ok((tokens, last.expect("at least one chunk")))
}

/// The calls the tests make, each in one line.
pub trait Calls {
    async fn complete_all(&mut self, ids: &[u32], sampling: Option<pb::Sampling>) -> Reply;
    async fn turn(&mut self, id: &str, ids: &[u32], sampling: Option<pb::Sampling>) -> Reply;
    async fn create(&mut self, defaults: Option<pb::Sampling>) -> pb::SessionInfo;
    async fn get(&mut self, id: &str) -> Result<pb::SessionInfo, Status>;
    async fn fork(&mut self, id: &str) -> Result<pb::SessionInfo, Status>;
    async fn close(&mut self, id: &str) -> Result<(), Status>;
    async fn stats_now(&mut self) -> pb::StatsResponse;
}

impl Calls for Client {
    async fn complete_all(&mut self, ids: &[u32], sampling: Option<pb::Sampling>) -> Reply {
        drain(self.complete(complete_ids(ids, sampling)).await).await
    }
    async fn turn(&mut self, id: &str, ids: &[u32], sampling: Option<pb::Sampling>) -> Reply {
        drain(self.generate(turn_ids(id, ids, sampling)).await).await
    }
    async fn create(&mut self, defaults: Option<pb::Sampling>) -> pb::SessionInfo {
        let r = pb::CreateSessionRequest {
            defaults,
            speculate: None,
        };
        self.create_session(r).await.expect("create").into_inner()
    }
    async fn get(&mut self, id: &str) -> Result<pb::SessionInfo, Status> {
        let r = pb::GetSessionRequest { session_id: id.into() };
        self.get_session(r).await.map(tonic::Response::into_inner)
    }
    async fn fork(&mut self, id: &str) -> Result<pb::SessionInfo, Status> {
        let r = pb::ForkSessionRequest { session_id: id.into() };
        self.fork_session(r).await.map(tonic::Response::into_inner)
    }
    async fn close(&mut self, id: &str) -> Result<(), Status> {
        let r = pb::CloseSessionRequest { session_id: id.into() };
        self.close_session(r).await.map(drop)
    }
    async fn stats_now(&mut self) -> pb::StatsResponse {
        self.stats(pb::StatsRequest {}).await.expect("stats").into_inner()
    }
}

/// Asserts `r` failed with `code` and a message containing every one of `words`.
#[track_caller]
pub fn assert_status<T: std::fmt::Debug>(r: Result<T, Status>, code: Code, words: &[&str]) {
    let s = r.expect_err("the call should fail");
    assert_eq!(s.code(), code, "{s:?}");
    for w in words {
        assert!(s.message().contains(w), "`{}` should mention `{w}`", s.message());
    }
}

/// Waits until `check` holds (the coordinator updates its books between steps).
pub async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !check() {
        assert!(t0.elapsed() < Duration::from_secs(20), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
