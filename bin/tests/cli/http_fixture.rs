//! The shared fixture of `http_api.rs`: a tiny random model served on the CPU over loopback sockets, and the curl-driven
//! helpers the tests use (requests, SSE parsing, live streams). Shared by several test binaries, each using a part.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Lines};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::{Arc, OnceLock};

use rewind_actors::{EngineConfig, EngineHandle};
use rewind_bin::serve::http::router;
use rewind_bin::serve::{ServeState, ServedModel};
use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::init::{init_model, InitOptions};
use rewind_engine::model::Family;
use rewind_engine::rank::{CpuLauncher, CpuOptions};
use serde_json::Value;

pub const MODEL_NAME: &str = "tiny-test";

/// The tiny nemotron_h checkpoint (seed 0), built once per target directory: deterministic, so a copy another run
/// built is the same model.
pub fn model_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(build_model).clone()
}

pub fn build_model() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("http-api-tiny-nemotron_h-v1");
    if dir.join("config.json").is_file() {
        return dir;
    }
    let tmp = dir.with_extension(format!("building-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    init_model(&InitOptions {
        family: Family::NemotronH,
        preset: "tiny".into(),
        layers: None,
        seed: 0,
        out: tmp.clone(),
        dtype: None,
        mtp: false,
    })
    .expect("init-model");
    if std::fs::rename(&tmp, &dir).is_err() {
        // Another test binary finished first: use its copy.
        let _ = std::fs::remove_dir_all(&tmp);
        assert!(dir.join("config.json").is_file(), "no model in {}", dir.display());
    }
    dir
}

/// An engine on the CPU and the runtime the servers over it run on.
pub struct Fixture {
    pub rt: tokio::runtime::Runtime,
    pub engine: Arc<EngineHandle>,
    pub model: ServedModel,
    /// The server without an API key.
    pub url: String,
}

impl Fixture {
    pub fn start(slots: usize, context: usize) -> Self {
        Self::start_with(slots, context, EngineConfig::new(FormChoice::Auto))
    }

    /// A fixture whose engine runs as `config` says (the model's stop tokens and tokenizer set here).
    pub fn start_with(slots: usize, context: usize, mut config: EngineConfig) -> Self {
        let dir = model_dir();
        let model = ServedModel::load(&dir).expect("served model");
        let launcher = CpuLauncher::new(
            &dir,
            CpuOptions {
                tp: 1,
                decoder: DecoderConfig::new(slots, context),
            },
        )
        .expect("launcher");
        config.eos_token_ids = model.eos_token_ids.clone();
        config.tokenizer = Some(model.tokenizer.clone());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let engine = Arc::new(
            rt.block_on(EngineHandle::start(Arc::new(launcher), config))
                .expect("engine"),
        );
        let mut f = Fixture {
            rt,
            engine,
            model,
            url: String::new(),
        };
        f.url = f.serve(f.state(None));
        f
    }

    pub fn state(&self, api_key: Option<&str>) -> Arc<ServeState> {
        Arc::new(ServeState::new(
            self.engine.clone(),
            self.model.clone(),
            MODEL_NAME.into(),
            api_key.into_iter().map(str::to_string).collect(),
        ))
    }

    /// Serves the HTTP API over `state` on a free loopback port; its base URL.
    pub fn serve(&self, state: Arc<ServeState>) -> String {
        let listener = self
            .rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        self.rt.spawn(async move {
            axum::serve(listener, router(state, addr, "127.0.0.1"))
                .await
                .expect("serve");
        });
        format!("http://{addr}")
    }
}

/// The engine most tests share (4 slots, 1024-token context).
pub fn shared() -> &'static Fixture {
    static SHARED: OnceLock<Fixture> = OnceLock::new();
    SHARED.get_or_init(|| Fixture::start(4, 1024))
}

/// Runs curl with `args` and `url`; the status and the body.
pub fn curl(url: &str, args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "60", "-w", "\n%{http_code}"])
        .args(args)
        .arg(url)
        .output()
        .expect("run curl");
    assert!(
        out.status.success(),
        "curl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf8");
    let (body, code) = text.rsplit_once('\n').expect("status line");
    (code.trim().parse().expect("status"), body.to_string())
}

/// GETs `url`; the status and the body parsed.
pub fn get(url: &str, headers: &[&str]) -> (u16, Value) {
    let args: Vec<&str> = headers.iter().flat_map(|h| ["-H", h]).collect();
    let (status, text) = curl(url, &args);
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// curl's arguments that POST `body` as JSON.
pub fn post_args(body: &str) -> Vec<&str> {
    let mut args = vec!["-X", "POST", "-H", "content-type: application/json"];
    args.extend(["--data-binary", body]);
    args
}

/// POSTs `body` as JSON; the status and the body parsed (`Value::Null` when it is not JSON, e.g. an SSE stream).
pub fn post(url: &str, body: &str, headers: &[&str]) -> (u16, Value) {
    let mut args = post_args(body);
    for h in headers {
        args.extend(["-H", h]);
    }
    let (status, text) = curl(url, &args);
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

pub fn ok(url: &str, body: Value) -> Value {
    let (status, v) = post(url, &body.to_string(), &[]);
    assert_eq!(status, 200, "{body}: {v}");
    v
}

/// The error message of an error body.
pub fn message(v: &Value) -> &str {
    v["error"]["message"].as_str().unwrap_or_default()
}

/// The JSON of every `data:` line of a stream, `[DONE]` as a string.
pub fn sse_events(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| match d {
            "[DONE]" => Value::String("[DONE]".into()),
            d => serde_json::from_str(d).unwrap_or_else(|e| panic!("bad chunk {d}: {e}")),
        })
        .collect()
}

/// Streams `body` through `curl -N`; the status and the events.
pub fn stream(url: &str, body: &Value) -> (u16, Vec<Value>) {
    let b = body.to_string();
    let mut args = vec!["-N"];
    args.extend(post_args(&b));
    let (status, text) = curl(url, &args);
    (status, sse_events(&text))
}

/// A `curl -N` stream read as it comes.
pub struct Live {
    pub child: Child,
    pub lines: Lines<BufReader<ChildStdout>>,
}

impl Live {
    /// POSTs `body` to `url` and waits for the stream's first `data:` line, which it returns.
    pub fn start(url: &str, body: &Value) -> (Self, String) {
        let body = body.to_string();
        let mut child = Command::new("curl")
            .args(["-sS", "-N"])
            .args(post_args(&body))
            .arg(url)
            .stdout(Stdio::piped())
            .spawn()
            .expect("curl");
        let lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let mut live = Live { child, lines };
        let first = live
            .lines
            .find_map(|l| l.ok().filter(|l| l.starts_with("data: ")))
            .expect("a first chunk");
        (live, first)
    }

    /// The rest of the stream.
    pub fn finish(self) -> String {
        let rest: Vec<String> = self.lines.map_while(Result::ok).collect();
        rest.join("\n")
    }
}

/// A chat stream's content, checking its shape: the role first, content deltas, one finish chunk, `[DONE]` last.
pub fn chat_stream_content(events: &[Value]) -> (String, String) {
    assert!(events.len() >= 3, "{events:?}");
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant", "{:?}", events[0]);
    assert_eq!(events.last(), Some(&Value::String("[DONE]".into())));
    let chunks: Vec<&Value> = events.iter().filter(|e| e.is_object()).collect();
    let mut content = String::new();
    let mut finish = None;
    for c in &chunks {
        assert!(c.get("error").is_none(), "stream failed: {c}");
        if c["choices"].as_array().is_some_and(Vec::is_empty) {
            continue; // the usage chunk
        }
        assert_eq!(c["object"], "chat.completion.chunk");
        assert!(c["id"].as_str().is_some_and(|id| id.starts_with("chatcmpl-")));
        if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
            content.push_str(t);
        }
        if let Some(r) = c["choices"][0]["finish_reason"].as_str() {
            assert!(finish.is_none(), "two finish chunks");
            finish = Some(r.to_string());
        }
    }
    (content, finish.expect("a finish chunk"))
}
