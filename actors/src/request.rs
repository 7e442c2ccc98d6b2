//! What a client sends ([`GenerateRequest`]) and what streams back ([`Event`]).

use rewind_engine::sample::SamplingParams;
use rewind_engine::sched::FinishReason;
use rewind_engine::spec::SpecStats;
use serde::Serialize;

use crate::session::SessionOwner;

/// One generation request: prompt ids and sampling parameters (`max_tokens`, stop strings and stop ids included).
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Higher runs first; equal priorities run in arrival order.
    pub priority: i32,
    /// The oracle drafter's reference continuation (`--spec oracle:P`, a benchmarking tool): the target's greedy
    /// output for this prompt, computed without speculation.
    pub reference: Option<Vec<u32>>,
    /// Whether the request speculates when the engine does (default true; the oracle's reference run does not).
    pub speculate: bool,
    /// A turn of this session (see `session.rs`): `prompt` holds only the turn's new tokens, which continue the
    /// session's state; the session holds the turn's tokens when it finishes.
    pub session: Option<String>,
    /// Who sends the request: a turn must name a session of this owner (see [`SessionOwner`]).
    pub owner: SessionOwner,
    /// Choices to generate (OpenAI's `n`; at least 1, at most the engine's sequence slots). The prompt is prefilled
    /// once and its state forked into `n` sequences, each sampled with its own seed ([`choice_seed`]); the events of
    /// every choice come on the one stream, tagged with their choice's index. A session turn takes only 1.
    pub n: usize,
    /// Log-probabilities of the generated tokens, each with this many top entries (0 ..= 20); `None`: none.
    pub logprobs: Option<usize>,
    /// Log-probabilities of the prompt's tokens ([`Event::PromptLogprobs`]), each with this many top entries
    /// (0 ..= 20); `None`: none. With it, `params.max_tokens == Some(0)` runs the prompt and generates nothing (how
    /// evaluation harnesses score a text).
    pub prompt_logprobs: Option<usize>,
}

impl GenerateRequest {
    /// A request with priority 0.
    pub fn new(prompt: Vec<u32>, params: SamplingParams) -> Self {
        GenerateRequest {
            prompt,
            params,
            priority: 0,
            reference: None,
            speculate: true,
            session: None,
            owner: SessionOwner::default(),
            n: 1,
            logprobs: None,
            prompt_logprobs: None,
        }
    }
}

/// The seed of choice `choice` of a request whose seed is `seed`: `seed + choice` (wrapping), as vLLM derives its
/// choices' seeds, so a seeded request's choices are reproducible (choice 0 draws with the request's own seed).
pub fn choice_seed(seed: u64, choice: usize) -> u64 {
    seed.wrapping_add(choice as u64)
}

/// The engine step that produced a token.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StepStats {
    /// The coordinator's step number (from 1, over the engine's life).
    pub index: u64,
    /// Sequences and tokens the step ran.
    pub seqs: usize,
    pub tokens: usize,
    /// Wall time of the step on the ranks.
    pub seconds: f64,
}

/// Prompt and generated token counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// The sequence's tokens before generation: a session turn counts the session's earlier tokens too.
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens restored from a session's saved state instead of prefilled.
    pub cached_tokens: usize,
}

/// How a finished request went.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct RequestTiming {
    /// From submission to the first token.
    pub ttft_seconds: f64,
    /// From submission to the end.
    pub total_seconds: f64,
    /// Times the request was preempted (and re-prefilled), and rebuilt after a fault.
    pub preemptions: usize,
    pub recoveries: usize,
}

/// One event of a request's stream. A stream ends with one `Finished` per choice (the request's `n`, in any order;
/// the choices' tokens interleave) or with one `Failed`, which ends every choice.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// A generated token and the text that became final with it (often empty mid-character or while a possible
    /// stop string is held back).
    Token {
        token: u32,
        text: String,
        /// The token's index among its choice's generated ones (from 0).
        index: usize,
        step: StepStats,
        /// The choice it belongs to (0 ..< the request's `n`).
        choice: usize,
        /// The token's log-probability, when the request asked for them ([`GenerateRequest::logprobs`]).
        logprob: Option<TokenLogprob>,
    },
    /// The prompt's log-probabilities ([`GenerateRequest::prompt_logprobs`]), one per prompt token: the first is
    /// `None` (nothing predicts it): `first_token` is that token. Sent once, before the first token.
    PromptLogprobs {
        first_token: u32,
        entries: Vec<Option<TokenLogprob>>,
    },
    /// The request ended (its last token's event came just before, with any held-back text).
    Finished {
        reason: FinishReason,
        usage: Usage,
        timing: RequestTiming,
        /// The sampling seed in use (drawn at random when the request had none).
        seed: u64,
        /// Speculation's counters, when the engine speculates.
        spec: Option<SpecStats>,
        /// The choice that ended (its `usage` counts the prompt and that choice's tokens).
        choice: usize,
    },
    /// The request failed (bad parameters, or faults beyond the retry limit); nothing more comes.
    Failed { error: String, kind: FailureKind },
}

impl Event {
    /// A `Failed` event.
    pub fn failed(kind: FailureKind, error: impl Into<String>) -> Self {
        Event::Failed {
            error: error.into(),
            kind,
        }
    }
}

/// A token's log-probability under the model's raw distribution (`logit − logsumexp(row)` of the unprocessed logits,
/// whatever the sampling did), and the row's most likely tokens with theirs, best first (ties to the lower id).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What kind of failure ended a request: what the front ends map to a status code (gRPC) or an HTTP status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// The request itself is wrong (a parameter, the prompt's length, a token id): retrying it cannot help.
    InvalidArgument,
    /// It names a session that does not exist (never did, closed or evicted).
    NotFound,
    /// Its session is running another turn.
    FailedPrecondition,
    /// The engine is full (the waiting queue is at its limit): back-pressure, retry later.
    ResourceExhausted,
    /// The engine stopped, is recovering from a fault beyond the request's retries, or could not be restarted.
    Unavailable,
    /// Something failed inside the engine (a drafter, the detokenizer).
    Internal,
}

impl FailureKind {
    /// The kind an engine error is.
    pub fn of(e: &rewind_engine::EngineError) -> Self {
        use rewind_engine::EngineError as E;
        match e {
            E::InvalidInput(_) | E::Config { .. } => FailureKind::InvalidArgument,
            E::GroupFailed(_) | E::Communicator(_) => FailureKind::Unavailable,
            _ => FailureKind::Internal,
        }
    }
}
