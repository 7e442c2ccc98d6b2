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
    /// Speculation's counters, when the run speculated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec: Option<SpecReport>,
}

/// What `generate` reports about speculation (stderr and `--json`).
#[derive(Clone, Debug, Serialize)]
pub struct SpecReport {
    /// The drafter as configured, e.g. `ngram (n 1..=3)`, `oracle:0.25`.
    pub drafter: String,
    pub window: usize,
    pub policy: String,
    pub drafted: usize,
    pub accepted: usize,
    /// Verify steps.
    pub steps: usize,
    pub accepted_per_step: f64,
    pub acceptance_rate: f64,
}

impl SpecReport {
    /// The report of `stats` under `config`.
    pub fn new(config: &crate::spec::SpecConfig, stats: &crate::spec::SpecStats) -> Self {
        SpecReport {
            drafter: config.drafter.to_string(),
            window: config.window,
            policy: config.policy.to_string(),
            drafted: stats.drafted,
            accepted: stats.accepted,
            steps: stats.verifies,
            accepted_per_step: stats.accepted_per_step(),
            acceptance_rate: stats.acceptance_rate(),
        }
    }

    /// The line `generate` prints to stderr.
    pub fn line(&self) -> String {
        format!(
            "[spec {} T={} {}: drafted {}, accepted {} ({:.1}%), {:.2} accepted per step over {} steps]",
            self.drafter,
            self.window,
            self.policy,
            self.drafted,
            self.accepted,
            100.0 * self.acceptance_rate,
            self.accepted_per_step,
            self.steps
        )
    }
}

/// One generation's text, tokens and statistics.
#[derive(Clone, Debug, Serialize)]
pub struct GenerationOutput {
    pub text: String,
    /// Generated token ids (the prompt excluded; a final stop token included).
    pub tokens: Vec<u32>,
    pub stats: GenerationStats,
}
