//! The coordinator actor: it owns the scheduler ([`rewind_engine::sched`]), the books of the ranks' slots and the
//! live requests; each step it plans a batch, runs it on every rank actor under a deadline, streams the sampled
//! tokens to their requests and releases what finished. It supervises the rank actors: a rank that fails, stops or
//! misses the deadline starts a recovery ([`recovery`]) that costs no request.
//!
//! Steps run inside the actor's message handler, one at a time; the coordinator sends itself [`CoordinatorMsg::Step`]
//! while there is work, so submissions and cancellations queued meanwhile are taken between steps.

mod choices;
mod grammar;
mod logprobs;
mod prefix;
mod ranks;
mod recovery;
mod sessions;
mod spec;
mod spec_window;
mod step;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use rewind_engine::decode::FormChoice;
use rewind_engine::rank::{Books, FaultSpec, Faults, Launcher, RankHealth};
use rewind_engine::sample::SamplingParams;
use rewind_engine::sched::{OutputStream, SchedConfig, Scheduler};
use rewind_engine::spec::{DrafterFactory, SpecConfig, WindowPolicy};
use rewind_engine::tokenizer::Tokenizer;
use rewind_engine::{EngineError, Result};
use serde::Serialize;
use tokio::sync::mpsc::UnboundedSender;
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::request::{Event, FailureKind, GenerateRequest};
use crate::session::Sessions;
pub use prefix::{PrefixCacheConfig, DEFAULT_PREFIX_CACHE_MEMORY, DEFAULT_PREFIX_MIN_TOKENS};
pub use ranks::Fault;
use ranks::Generation;
pub use sessions::SessionMsg;
use sessions::{LiveSession, Save};
use spec::LiveSpec;

/// How the engine runs.
#[derive(Clone)]
pub struct EngineConfig {
    /// The most tokens one step may run (decodes and prompt chunks together).
    pub max_batch_tokens: usize,
    /// How long every rank gets to answer a step before the step counts as a fault (a hang).
    pub step_deadline: Duration,
    /// How long a generation of ranks gets to load.
    pub load_deadline: Duration,
    /// Faults a request may live through; one more fails it with an error (never a hang).
    pub max_retries: usize,
    /// Faults to inject (a testing aid).
    pub faults: Vec<FaultSpec>,
    /// The decode form of every sequence.
    pub form: FormChoice,
    /// Tokens that end a request unless it sets `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// Turns tokens into text and finds stop strings; without it only ids stream.
    pub tokenizer: Option<Tokenizer>,
    /// Speculative decoding, when on.
    pub spec: Option<EngineSpec>,
    /// Requests that may wait at once; one more is refused as back-pressure (`FailureKind::ResourceExhausted`).
    pub max_waiting: usize,
    /// Sessions held at once, and how long one may sit idle before it is evicted (`None`: never).
    pub max_sessions: usize,
    pub session_idle_timeout: Option<Duration>,
    /// The most host bytes the sessions' saved states may hold together (shared states counted once): saving past it
    /// evicts the least recently used idle sessions (`--session-memory`).
    pub session_memory: usize,
    /// The most decode steps one engine step may chain on the ranks with no host round trip between them (1: none;
    /// `--decode-steps`, like vLLM's `--num-scheduler-steps`). See `rewind_engine::sched` for when a step chains.
    pub decode_steps: usize,
    /// Automatic prefix caching (`prefix/`); `None` turns it off (`--no-enable-prefix-caching`).
    pub prefix_cache: Option<PrefixCacheConfig>,
    /// Run each rank in a worker process of its own (`--rank-processes`); `None`: rank threads of this process.
    pub rank_processes: Option<Arc<crate::rank_process::RankProcesses>>,
}

/// Speculative decoding as the engine runs it: the settings and the drafters' factory.
#[derive(Clone)]
pub struct EngineSpec {
    pub config: SpecConfig,
    pub factory: Arc<dyn DrafterFactory>,
}

/// The sessions' saved states' default host-memory budget: 8 GiB (some 900 sessions of 4K tokens of a small hybrid
/// model; `--session-memory`).
pub const DEFAULT_SESSION_MEMORY: usize = 8 << 30;

impl EngineConfig {
    /// Defaults for a model decoded in `form`: a 2048-token step budget, a 60 s step deadline, 3 retries, the prefix
    /// cache on.
    pub fn new(form: FormChoice) -> Self {
        EngineConfig {
            max_batch_tokens: 2048,
            step_deadline: Duration::from_secs(60),
            load_deadline: Duration::from_secs(1800),
            max_retries: 3,
            faults: Vec::new(),
            form,
            eos_token_ids: Vec::new(),
            tokenizer: None,
            spec: None,
            max_waiting: 4096,
            max_sessions: 4096,
            session_idle_timeout: Some(Duration::from_secs(1800)),
            session_memory: DEFAULT_SESSION_MEMORY,
            decode_steps: 1,
            prefix_cache: Some(PrefixCacheConfig::default()),
            rank_processes: None,
        }
    }
}

/// What the engine serves, fixed at start-up.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EngineInfo {
    pub tp: usize,
    /// The ranks' devices.
    pub devices: Vec<String>,
    pub vocab: usize,
    pub max_context: usize,
    pub slots: usize,
    pub kv_blocks: usize,
    pub kv_block_size: usize,
}

/// The engine's state at one moment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EngineHealth {
    pub ranks: Vec<RankHealth>,
    /// Requests waiting and sequences running.
    pub waiting: usize,
    pub running: usize,
    /// Free slots and KV blocks, as the scheduler counts them.
    pub free_slots: usize,
    pub free_kv_blocks: usize,
    /// Generations of ranks started (1 + recoveries).
    pub generation: u64,
}

/// A message to the coordinator.
pub enum CoordinatorMsg {
    /// A new request; its events go to `events`.
    Submit {
        id: u64,
        request: GenerateRequest,
        events: UnboundedSender<Event>,
    },
    /// The client went away.
    Cancel(u64),
    /// Run the next step (sent by the coordinator to itself).
    Step,
    Info(RpcReplyPort<EngineInfo>),
    Health(RpcReplyPort<Result<EngineHealth>>),
    /// A session operation.
    Session(SessionMsg),
}

// Local-only (see the note on `RankActorMsg`'s impl).
impl ractor::Message for CoordinatorMsg {}

/// What starts the coordinator.
pub struct CoordinatorArgs {
    pub launcher: Arc<dyn Launcher>,
    pub config: EngineConfig,
    pub metrics: Arc<Metrics>,
}

/// A request the coordinator is serving.
struct Live {
    events: UnboundedSender<Event>,
    output: OutputStream,
    params: SamplingParams,
    seed: u64,
    /// The prompt, then every generated token (the repetition penalty's context; the last `output.generated()` are
    /// the presence and frequency penalties').
    history: Vec<u32>,
    prompt_len: usize,
    submitted: Instant,
    first_token: Option<Instant>,
    /// The faults charged to this request, as retries of the work it was doing.
    retries: recovery::Retries,
    preemptions: usize,
    recoveries: usize,
    /// The request's tracing span (its tokens and its end are recorded inside it).
    span: tracing::Span,
    /// Speculation: the request's drafter and what it has done.
    spec: Option<LiveSpec>,
    /// The session this request is a turn of.
    session: Option<LiveSession>,
    /// The request this sequence answers (the key of its events and of its cancellation) and which of its choices
    /// it is: the sequence's own id and 0 unless the request asked for `n > 1` (see `choices.rs`).
    request: u64,
    choice: usize,
    /// The forked prompt state a choice starts from, and its tokens: restored at every (re)start of the sequence,
    /// like a session's saved state.
    fork: Option<(prefix::Start, usize)>,
    /// Prompt tokens restored rather than computed for this request (its usage's `cached_tokens`).
    cached: usize,
    /// Where a prompt chunk ends so that the prefix cache can store the state there (a branch point, `prefix/`).
    cut: Option<usize>,
    /// When this sequence is a request's fork prefill: the choices to start from its state.
    forking: Option<Box<choices::Forking>>,
    /// Structured outputs: where the request is in its grammar (see `grammar.rs`).
    grammar: Option<grammar::LiveGrammar>,
    /// What the request asked for its log-probabilities.
    logprobs: Option<logprobs::LiveLogprobs>,
}

/// The coordinator's state.
pub struct CoordinatorState {
    launcher: Arc<dyn Launcher>,
    config: EngineConfig,
    metrics: Arc<Metrics>,
    faults: Arc<Faults>,
    info: EngineInfo,
    sched: Scheduler,
    /// `None` while no generation is up (after a recovery failed).
    ranks: Option<Generation>,
    books: Books,
    generation: u64,
    live: HashMap<u64, Live>,
    /// Steps run, over the engine's life (the index each step carries).
    index: u64,
    /// A `Step` message is queued.
    step_queued: bool,
    /// A rank failed between steps (heard from its supervisor link): recover before the next step.
    pending_fault: Option<Fault>,
    /// Set when the ranks could not be restarted: every request fails with it.
    broken: Option<String>,
    /// The scheduler's limits from the first generation; a restarted one must match them.
    capacity: SchedConfig,
    /// The coordinator itself, the supervisor of every rank actor.
    myself: ActorCell,
    /// Speculation's window per step, when on.
    window: Option<WindowPolicy>,
    sessions: Sessions,
    /// Turns that finished in the step being run, saved before their slots are released.
    saves: Vec<Save>,
    /// Saved-state bytes freed since the allocator last handed free memory back to the OS.
    freed_state_bytes: usize,
    /// Fork prefills that finished in the step being run (`(sequence, slot)`), forked before their slots are released.
    forks: Vec<(u64, usize)>,
    /// The id of the next choice sequence (see `choices.rs`).
    next_choice: u64,
    /// Slots of sequences ended in the step being run because another choice of their request failed.
    dropped: Vec<usize>,
    /// The prefix cache, when on.
    prefix: Option<prefix::PrefixCache>,
    /// Sequences that finished in the step being run whose states go into the prefix cache before their slots are
    /// released.
    prefix_saves: Vec<prefix::PrefixSave>,
    /// Grammar masks being computed ahead, on a blocking thread (see `grammar.rs`).
    masks_ahead: Option<grammar::MasksAhead>,
}

/// The scheduler's limits from the ranks' capacity.
fn sched_config(books: &Books, info: &EngineInfo, c: &EngineConfig) -> SchedConfig {
    let (kv_blocks, kv_block_size) = if info.kv_blocks > 0 {
        (info.kv_blocks, info.kv_block_size)
    } else {
        // No attention layer: the context is bounded by the slots' length only.
        (info.slots * books.max_context(), 1)
    };
    SchedConfig {
        slots: info.slots,
        kv_blocks,
        kv_block_size,
        max_batch_tokens: c.max_batch_tokens,
        max_context: books.max_context(),
        decode_steps: c.decode_steps,
    }
}

/// See the module docs.
pub struct Coordinator;

impl Actor for Coordinator {
    type Msg = CoordinatorMsg;
    type State = CoordinatorState;
    type Arguments = CoordinatorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<CoordinatorMsg>,
        args: CoordinatorArgs,
    ) -> std::result::Result<CoordinatorState, ActorProcessingErr> {
        let c = &args.config;
        if c.max_batch_tokens == 0 {
            return Err(Box::new(EngineError::InvalidInput(
                "--max-batch-tokens must be at least 1".into(),
            )));
        }
        if c.decode_steps == 0 {
            return Err(Box::new(EngineError::InvalidInput(
                "--decode-steps must be at least 1 (1 runs one decode step per engine step)".into(),
            )));
        }
        if c.step_deadline.is_zero() {
            return Err(Box::new(EngineError::InvalidInput(
                "the step deadline must be positive".into(),
            )));
        }
        if let Some(f) = c.faults.iter().find(|f| f.kind.ends_process()) {
            if c.rank_processes.is_none() {
                return Err(Box::new(EngineError::InvalidInput(format!(
                    "--inject-fault {f}: `{}` ends the rank's process, which is this server unless the ranks run in \
                     worker processes (--rank-processes)",
                    f.kind
                ))));
            }
        }
        let faults = Arc::new(Faults::new(c.faults.clone(), args.launcher.tp())?);
        let g = Generation::start(
            &args.launcher,
            &faults,
            c.rank_processes.as_ref(),
            myself.get_cell(),
            c.load_deadline,
        )
        .await?;
        let vocab = g.infos.last().map_or(0, |i| i.vocab.end);
        let books = Books::new(&g.infos, vocab)?;
        if !books.forms().contains(&c.form) {
            let why = format!("the ranks cannot decode in the {} form", c.form);
            g.stop(&why).await;
            return Err(Box::new(EngineError::NotSupported(why)));
        }
        if let Some(spec) = &c.spec {
            if let Err(e) = spec::check_ranks(spec, &books) {
                g.stop(&e.to_string()).await;
                return Err(Box::new(e));
            }
        }
        let info = EngineInfo {
            tp: g.infos.len(),
            devices: g.infos.iter().map(|i| i.device.clone()).collect(),
            vocab,
            max_context: books.max_context(),
            slots: books.slots(),
            kv_blocks: g.infos.iter().map(|i| i.kv_blocks).min().unwrap_or(0),
            kv_block_size: g.infos.first().map_or(0, |i| i.kv_block_size),
        };
        if c.decode_steps > 1 && c.decode_steps - 1 > books.max_chained() {
            let why = format!(
                "--decode-steps {}: the ranks chain at most {} decode steps",
                c.decode_steps,
                books.max_chained() + 1
            );
            g.stop(&why).await;
            return Err(Box::new(EngineError::NotSupported(why)));
        }
        let capacity = sched_config(&books, &info, c);
        let sched = Scheduler::new(capacity)?;
        info!(
            tp = info.tp,
            slots = info.slots,
            max_context = info.max_context,
            "engine started"
        );
        if let Some(t) = c.session_idle_timeout {
            // Evicted lazily on every session operation too; the timer frees an idle server's memory.
            let period = (t / 4).clamp(Duration::from_millis(50), Duration::from_secs(60));
            myself.send_interval(period, || CoordinatorMsg::Session(SessionMsg::EvictIdle));
        }
        if c.session_memory == 0 {
            return Err(Box::new(EngineError::InvalidInput(
                "the session memory budget must be positive".into(),
            )));
        }
        let sessions = Sessions::new(c.max_sessions, c.session_idle_timeout, c.session_memory);
        Metrics::set(&args.metrics.session_memory_budget, c.session_memory as u64);
        if let Some(p) = &c.prefix_cache {
            if p.memory == 0 {
                return Err(Box::new(EngineError::InvalidInput(
                    "the prefix cache's memory budget must be positive (--no-enable-prefix-caching turns it off)"
                        .into(),
                )));
            }
            Metrics::set(&args.metrics.prefix_cache_memory_budget, p.memory as u64);
        }
        let prefix = c.prefix_cache.map(prefix::PrefixCache::new);
        let window = c.spec.as_ref().map(spec_window::policy);
        Ok(CoordinatorState {
            launcher: args.launcher,
            config: args.config,
            metrics: args.metrics,
            faults,
            info,
            sched,
            ranks: Some(g),
            books,
            generation: 1,
            live: HashMap::new(),
            index: 0,
            step_queued: false,
            pending_fault: None,
            broken: None,
            capacity,
            myself: myself.get_cell(),
            window,
            sessions,
            saves: Vec::new(),
            freed_state_bytes: 0,
            forks: Vec::new(),
            next_choice: choices::FIRST_CHOICE_ID,
            dropped: Vec::new(),
            prefix,
            prefix_saves: Vec::new(),
            masks_ahead: None,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<CoordinatorMsg>,
        msg: CoordinatorMsg,
        st: &mut CoordinatorState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        match msg {
            CoordinatorMsg::Submit { id, request, events } => {
                st.submit(id, request, events);
                st.kick(&myself);
            }
            CoordinatorMsg::Cancel(id) => st.cancel(id).await,
            CoordinatorMsg::Step => {
                st.step_queued = false;
                st.step(&myself).await;
                st.kick(&myself);
            }
            CoordinatorMsg::Info(reply) => drop(reply.send(st.info.clone())),
            CoordinatorMsg::Health(reply) => drop(reply.send(st.health().await)),
            CoordinatorMsg::Session(msg) => st.session_msg(msg),
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<CoordinatorMsg>,
        evt: SupervisionEvent,
        st: &mut CoordinatorState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        // Ranks of an older generation end during a recovery; only the current one's matter.
        let (cell, why) = match evt {
            SupervisionEvent::ActorFailed(cell, e) => (cell, e.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => (cell, reason.unwrap_or_else(|| "stopped".into())),
            _ => return Ok(()),
        };
        let Some(g) = &st.ranks else { return Ok(()) };
        if let Some(r) = g.ranks.iter().position(|a| a.get_id() == cell.get_id()) {
            warn!(rank = r, %why, "a rank actor stopped");
            st.pending_fault.get_or_insert(Fault::Stopped(r));
            st.kick(&myself);
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<CoordinatorMsg>,
        st: &mut CoordinatorState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        for (_, l) in st.live.drain() {
            let _ = l
                .events
                .send(Event::failed(FailureKind::Unavailable, "the engine stopped"));
        }
        if let Some(g) = st.ranks.take() {
            g.stop("the engine stopped").await;
        }
        Ok(())
    }
}

impl CoordinatorState {
    /// Queues a `Step` when there is work and none is queued.
    fn kick(&mut self, myself: &ActorRef<CoordinatorMsg>) {
        let (waiting, running) = self.sched.counts();
        let work = waiting + running > 0 || self.pending_fault.is_some();
        if work && !self.step_queued && myself.send_message(CoordinatorMsg::Step).is_ok() {
            self.step_queued = true;
        }
    }

    async fn health(&self) -> Result<EngineHealth> {
        let g = self
            .ranks
            .as_ref()
            .ok_or_else(|| EngineError::GroupFailed(self.broken.clone().unwrap_or_default()))?;
        let ranks = g
            .call(RankActorMsg::Health, self.config.step_deadline)
            .await
            .map_err(|f| EngineError::GroupFailed(f.to_string()))?;
        let (waiting, running) = self.sched.counts();
        let (free_slots, free_kv_blocks) = self.sched.free();
        Ok(EngineHealth {
            ranks,
            waiting,
            running,
            free_slots,
            free_kv_blocks,
            generation: self.generation,
        })
    }
}

use crate::rank_actor::RankActorMsg;
