//! [`ServeState`]: the engine and everything both APIs read about the served model, shared by every connection.

use std::hash::{BuildHasher, Hash, Hasher, RandomState};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use rewind_actors::{EngineHandle, Event, EventStream, FailureKind, SessionOwner};
use rewind_engine::grammar::{Constraint, ConstraintSpec, GrammarCompiler};
use rewind_engine::sample::SamplingParams;
use rewind_engine::tools::ToolFormat;
use tokio::sync::watch;

use super::conn::ConnStats;
use super::limits::RequestLimits;
use super::model::ServedModel;
use crate::cli::ToolCallParserArg;

/// What every request handler shares.
pub struct ServeState {
    pub engine: Arc<EngineHandle>,
    pub model: ServedModel,
    /// The model id both APIs report and accept (`/v1/models`, the `model` field).
    pub model_name: String,
    /// When there are any, every request must present one (gRPC `authorization: Bearer K` metadata, HTTP
    /// `Authorization: Bearer K`); health checks too, except HTTP `/health`.
    pub api_keys: ApiKeys,
    /// `max_tokens` when a request gives none, and the most a request may ask for.
    pub default_max_tokens: usize,
    pub max_tokens_limit: usize,
    /// Refuse HTTP requests with top-level fields the API does not know (`--strict-fields`), instead of ignoring them
    /// with a warning.
    pub strict_fields: bool,
    /// Split chat answers into `reasoning_content` and `content` at a `<think>...</think>` block (`--reasoning-parser
    /// qwen3`; by default when the chat template mentions `<think>`).
    pub reasoning: bool,
    /// The format tool calls are read out of chat answers in (`--tool-call-parser`; by default the one the chat
    /// template writes), and why there is none when there is none.
    pub tool_format: Result<ToolFormat, NoToolFormat>,
    /// How large a request may be and how long its body may take (`--max-request-bytes`, `--body-timeout`).
    pub limits: RequestLimits,
    /// Both servers' connection counters (`/metrics`).
    pub connections: Arc<ConnStats>,
    /// Set on SIGINT / SIGTERM: new requests are refused (UNAVAILABLE / 503) while in-flight ones finish.
    draining: AtomicBool,
    /// Set when the server stops without waiting (a second signal, the drain timeout): every in-flight request ends
    /// with a failure event, so its stream gets a final error instead of being cut off.
    cut_off: watch::Sender<bool>,
    pub started: Instant,
    /// Structured outputs' compiler for this model, built by the first constrained request (the token trie of a
    /// large vocabulary takes a moment); the error says why this model's tokenizer cannot be constrained.
    grammar: OnceLock<Result<GrammarCompiler, String>>,
}

/// Why a server reads no tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoToolFormat {
    /// The chat template writes no tool-call format this server knows.
    NotInTemplate,
    /// `--tool-call-parser none`.
    Disabled,
}

/// What an in-flight request is told when the server stops without waiting for it.
pub const CUT_OFF_MESSAGE: &str = "the server is shutting down without waiting for in-flight requests";

/// Reads a request's events until the server cuts in-flight requests off ([`ServeState::cut_off`]); then a
/// `Failed` event ([`CUT_OFF_MESSAGE`], unavailable) takes the place of the rest.
pub struct CutOff(watch::Receiver<bool>);

impl CutOff {
    /// The next event of `events`, or the cut-off failure once the server stops without waiting.
    pub async fn next(&mut self, events: &mut EventStream) -> Option<Event> {
        let failed = || Event::Failed {
            error: CUT_OFF_MESSAGE.to_string(),
            kind: FailureKind::Unavailable,
        };
        if *self.0.borrow() {
            return Some(failed());
        }
        tokio::select! {
            // Checked first: a request that keeps producing tokens must still see the cut-off.
            biased;
            () = cut(&mut self.0) => Some(failed()),
            e = events.next() => e,
        }
    }
}

/// Resolves when `rx` turns true; never when its sender is gone (nothing can cut off any more).
async fn cut(rx: &mut watch::Receiver<bool>) {
    if rx.wait_for(|c| *c).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// `max_tokens` of a request that sets none, unless `--default-max-tokens` says otherwise.
pub const DEFAULT_MAX_TOKENS: usize = 256;

impl ServeState {
    /// The state for `engine` serving `model` under `model_name`.
    pub fn new(engine: Arc<EngineHandle>, model: ServedModel, model_name: String, api_keys: Vec<String>) -> Self {
        let context = engine.info().max_context;
        let template = model.tokenizer.chat_template();
        let reasoning = template.is_some_and(|t| rewind_engine::tokenizer::reasoning::template_reasons(t.source()));
        let tool_format = template
            .and_then(|t| ToolFormat::detect(t.source()))
            .ok_or(NoToolFormat::NotInTemplate);
        ServeState {
            engine,
            model,
            model_name,
            api_keys: ApiKeys::new(api_keys),
            default_max_tokens: DEFAULT_MAX_TOKENS.min(context),
            max_tokens_limit: context,
            strict_fields: false,
            reasoning,
            tool_format,
            limits: RequestLimits::default(),
            connections: Arc::new(ConnStats::default()),
            draining: AtomicBool::new(false),
            cut_off: watch::channel(false).0,
            started: Instant::now(),
            grammar: OnceLock::new(),
        }
    }

    /// The same state with `n` as the default `max_tokens` (at most the context).
    pub fn with_default_max_tokens(mut self, n: usize) -> Self {
        self.default_max_tokens = n.min(self.max_tokens_limit);
        self
    }

    /// The same state refusing unknown HTTP request fields when `strict` (`--strict-fields`).
    pub fn with_strict_fields(mut self, strict: bool) -> Self {
        self.strict_fields = strict;
        self
    }

    /// The same state splitting chat answers' reasoning when `reasoning` says so (`--reasoning-parser qwen3` /
    /// `none`); `None` keeps what the chat template implies.
    pub fn with_reasoning(mut self, reasoning: Option<bool>) -> Self {
        if let Some(r) = reasoning {
            self.reasoning = r;
        }
        tracing::info!(
            reasoning_parser = if self.reasoning { "qwen3" } else { "none" },
            "chat answers"
        );
        self
    }

    /// The same state reading tool calls as `--tool-call-parser` says (`auto` keeps the template's format).
    pub fn with_tool_call_parser(mut self, parser: ToolCallParserArg) -> Self {
        if let Some(format) = parser.format() {
            self.tool_format = format.ok_or(NoToolFormat::Disabled);
        }
        tracing::info!(
            tool_call_parser = self.tool_format.map_or("none", ToolFormat::name),
            "chat answers"
        );
        self
    }

    /// The same state with request `limits` (the serving flags').
    pub fn with_limits(mut self, limits: RequestLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Refuses a text (the request's `what`) longer than any prompt the context can hold, before it is tokenized:
    /// an error in the words of an over-long prompt, else `Ok`.
    pub fn check_text_len(&self, what: &str, bytes: usize) -> Result<(), String> {
        let context = self.engine.info().max_context;
        let most = self.model.tokenizer.max_text_bytes(context);
        if bytes > most {
            return Err(format!(
                "This model's maximum context length is {context} tokens, and the {what} has {bytes} bytes, more \
                 than {context} tokens can hold (at most {most} bytes)."
            ));
        }
        Ok(())
    }

    /// Whether the servers refuse new requests (shutting down).
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Starts refusing new requests.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Ends every in-flight request with a failure event (see [`CutOff`]).
    pub fn cut_off(&self) {
        self.cut_off.send_replace(true);
    }

    /// What a handler reads its request's events through, so that [`ServeState::cut_off`] ends them.
    pub fn cut_off_watch(&self) -> CutOff {
        CutOff(self.cut_off.subscribe())
    }

    /// Who `presented` (a bearer token, or none) lets in, or `None` when it is refused.
    pub fn authorized(&self, presented: Option<&str>) -> Option<SessionOwner> {
        self.api_keys.owner(presented)
    }

    /// Compiles a request's structured-output constraint (blocking: call it on the blocking pool). The error is the
    /// message of a 400 / INVALID_ARGUMENT; the caller names the field.
    pub fn compile_constraint(&self, spec: ConstraintSpec) -> Result<Constraint, String> {
        let compiler = self.grammar.get_or_init(|| {
            let eos = &self.model.eos_token_ids;
            GrammarCompiler::new(&self.model.tokenizer, self.engine.info().vocab, eos).map_err(|e| e.to_string())
        });
        let compiler = compiler.as_ref().map_err(Clone::clone)?;
        compiler.compile(spec).map_err(|e| match e {
            rewind_engine::EngineError::InvalidInput(m) => m,
            e => e.to_string(),
        })
    }

    /// The sampling parameters a request starts from (generation_config.json's) with this server's default
    /// `max_tokens`.
    pub fn sampling_defaults(&self) -> SamplingParams {
        let mut p = self.model.sampling_defaults();
        p.max_tokens = Some(self.default_max_tokens);
        p
    }
}

/// The API keys a server accepts, each with the session owner it stands for.
pub struct ApiKeys {
    keys: Vec<(String, SessionOwner)>,
}

impl ApiKeys {
    /// `keys`, each fingerprinted as its sessions' owner: SipHash under a key drawn at random for this process, so
    /// the sessions store no key, and a fingerprint says nothing about its key (nor matches another process's).
    pub fn new(keys: Vec<String>) -> Self {
        let secret = RandomState::new();
        let half = |k: &str, part: u8| {
            let mut h = secret.build_hasher();
            part.hash(&mut h);
            k.hash(&mut h);
            h.finish()
        };
        let keys = keys
            .into_iter()
            .map(|k| {
                let owner = SessionOwner::new((u128::from(half(&k, 0)) << 64) | u128::from(half(&k, 1)));
                (k, owner)
            })
            .collect();
        ApiKeys { keys }
    }

    /// Whether requests must present a key.
    pub fn required(&self) -> bool {
        !self.keys.is_empty()
    }

    /// The owner whose key `presented` is (every key compared, in time independent of which matched); without keys,
    /// the one owner every client is; `None` for a missing or wrong key.
    pub fn owner(&self, presented: Option<&str>) -> Option<SessionOwner> {
        if self.keys.is_empty() {
            return Some(SessionOwner::default());
        }
        let p = presented?;
        self.keys.iter().fold(None, |found, (k, owner)| {
            if constant_time_eq(p.as_bytes(), k.as_bytes()) {
                Some(*owner)
            } else {
                found
            }
        })
    }
}

/// Compares two secrets in time that depends only on their lengths.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::{constant_time_eq, ApiKeys};
    use rewind_actors::SessionOwner;

    #[test]
    fn each_key_is_its_own_session_owner() {
        let open = ApiKeys::new(Vec::new());
        assert!(!open.required());
        assert_eq!(open.owner(None), Some(SessionOwner::default()));
        assert_eq!(open.owner(Some("anything")), Some(SessionOwner::default()));
        let keys = ApiKeys::new(vec!["alpha".into(), "beta".into()]);
        let (a, b) = (keys.owner(Some("alpha")), keys.owner(Some("beta")));
        assert!(a.is_some() && b.is_some() && a != b);
        assert_ne!(a, Some(SessionOwner::default()));
        assert_eq!(keys.owner(Some("alpha")), a, "the same key is the same owner");
        assert_eq!(keys.owner(Some("gamma")), None);
        assert_eq!(keys.owner(Some("alph")), None);
        assert_eq!(keys.owner(None), None);
    }

    #[test]
    fn secrets_compare_exactly() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
    }
}
