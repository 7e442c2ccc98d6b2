//! The result of one generation as `rewind generate --json` prints it. Generation itself runs in the serving
//! engine (the coordinator actor in `actors/`; each request's text and finish rule in [`crate::sched::OutputStream`]).

use serde::Serialize;

pub use crate::sched::FinishReason;

/// Timing and counts of one generation.
#[derive(Clone, Debug, Serialize)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub prefill_tokens_per_second: f64,
    pub decode_tokens_per_second: f64,
    pub finish_reason: FinishReason,
    /// The sampler's seed, so a sampled run can be repeated.
    pub seed: u64,
}

/// One generation's text, tokens and statistics.
#[derive(Clone, Debug, Serialize)]
pub struct GenerationOutput {
    pub text: String,
    /// Generated token ids (the prompt excluded; a final stop token included).
    pub tokens: Vec<u32>,
    pub stats: GenerationStats,
}
