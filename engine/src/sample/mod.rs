//! Token sampling parameters and their validation, a request's seeded draw stream, the logit adjustments the ranks
//! apply before sampling (`rank::SampleRow::sample`: the repetition penalty, then the additive presence / frequency
//! penalties, `logit_bias` and the `min_tokens` mask), and stop-string detection for streaming.

mod stop;

pub use stop::{StopChecker, StopOutcome};

use std::collections::BTreeMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

use crate::error::{EngineError, Result};
use crate::grammar::Constraint;

/// Per-request sampling parameters. The defaults sample from the model's full distribution (temperature 1, no
/// filtering); `temperature == 0` is greedy decoding.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Logits are divided by this; 0 selects the argmax. Finite and ≥ 0.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables the filter.
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest most-likely set whose probability reaches `top_p`. In (0, 1]; 1 = off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` × the top token's probability. In [0, 1]; 0 = off.
    pub min_p: f32,
    /// HF repetition penalty over the set of previous tokens; 1 = off. Finite and > 0.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty: subtracted once from the logit of every token generated so far (not the prompt's, as
    /// vLLM); 0 = off. In [-2, 2].
    pub presence_penalty: f32,
    /// OpenAI frequency penalty: subtracted from a token's logit once per time it was generated so far; 0 = off. In
    /// [-2, 2].
    pub frequency_penalty: f32,
    /// Added to the logits of these token ids before sampling. Each bias in [-100, 100]; ids below the vocabulary.
    pub logit_bias: BTreeMap<u32, f32>,
    /// EOS and stop token ids cannot be sampled, and stop strings do not end the request, before this many tokens
    /// are generated; 0 = off.
    pub min_tokens: usize,
    /// RNG seed; `None` draws one at random (see [`Sampler::seed`]).
    pub seed: Option<u64>,
    /// Maximum number of generated tokens; `None` = until a stop condition or the context limit.
    pub max_tokens: Option<usize>,
    /// Generation stops at any of these strings (the string itself is emitted only with
    /// `include_stop_str_in_output`).
    pub stop_strings: Vec<String>,
    /// Emit the stop string that ended the request.
    pub include_stop_str_in_output: bool,
    /// Generation stops after any of these tokens (in addition to EOS unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the model's EOS tokens.
    pub ignore_eos: bool,
    /// Structured outputs: the output follows this compiled grammar (see [`crate::grammar`]); a constrained request
    /// samples every token on the penalised path (greedy too), does not chain and does not speculate.
    pub constraint: Option<Constraint>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: BTreeMap::new(),
            min_tokens: 0,
            seed: None,
            max_tokens: None,
            stop_strings: Vec::new(),
            include_stop_str_in_output: false,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            constraint: None,
        }
    }
}

fn invalid(name: &str, requirement: &str, value: impl std::fmt::Display) -> EngineError {
    EngineError::InvalidInput(format!("{name} must be {requirement}, got {value}"))
}

/// The most stop strings one request may give. Every generated token is checked against each of them on the engine's
/// step path, so an unbounded list would slow every other sequence of the batch (OpenAI allows 4; vLLM does not
/// limit them).
pub const MAX_STOP_STRINGS: usize = 64;

/// The largest presence or frequency penalty, either sign (OpenAI's range).
pub const MAX_PENALTY: f32 = 2.0;

/// The largest `logit_bias` value, either sign (OpenAI's range): ±100 bans or forces a token.
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// What the `min_tokens` mask adds to an EOS or stop token's logit: the lowest finite `f32` rather than −∞, because
/// the samplers refuse a row holding a non-finite logit (a model fault); the token's weight `exp((l − max) / t)` is
/// still exactly 0 and it is never the argmax while any token is unmasked. Logits are far below 2^100, so the sum
/// stays finite.
pub const MASKED: f32 = f32::MIN;

/// The longest stop string, in bytes: longer ones would be scanned on every token for nothing a model generates in one
/// request.
pub const MAX_STOP_BYTES: usize = 4096;

/// Checks a request's stop strings, named `name` in the message: none empty, at most [`MAX_STOP_STRINGS`] of them,
/// each at most [`MAX_STOP_BYTES`] long. Every API checks them here, under its own field name.
pub fn check_stop_strings(stops: &[String], name: &str) -> std::result::Result<(), String> {
    if let Some(i) = stops.iter().position(String::is_empty) {
        return Err(format!("{name}[{i}] must not be empty"));
    }
    if stops.len() > MAX_STOP_STRINGS {
        return Err(format!(
            "{name}: at most {MAX_STOP_STRINGS} strings, got {}",
            stops.len()
        ));
    }
    if let Some((i, s)) = stops.iter().enumerate().find(|(_, s)| s.len() > MAX_STOP_BYTES) {
        return Err(format!("{name}[{i}]: at most {MAX_STOP_BYTES} bytes, got {}", s.len()));
    }
    Ok(())
}

impl SamplingParams {
    /// Greedy decoding with otherwise default parameters.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Checks the numeric ranges (everything that does not depend on the model).
    pub fn validate_ranges(&self) -> Result<()> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(invalid("temperature", "a finite number >= 0", t));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid("top_p", "in (0, 1]", self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(invalid("min_p", "in [0, 1]", self.min_p));
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(invalid("repetition_penalty", "a finite number > 0", r));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-MAX_PENALTY..=MAX_PENALTY).contains(&v) {
                return Err(invalid(name, "in [-2, 2]", v));
            }
        }
        if let Some((id, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(*b))
        {
            return Err(invalid(&format!("logit_bias[{id}]"), "in [-100, 100]", b));
        }
        if self.max_tokens == Some(0) {
            return Err(invalid("max_tokens", "at least 1", 0));
        }
        if let Some(max) = self.max_tokens.filter(|&m| self.min_tokens > m) {
            return Err(invalid(
                "min_tokens",
                &format!("at most max_tokens ({max})"),
                self.min_tokens,
            ));
        }
        check_stop_strings(&self.stop_strings, "stop_strings").map_err(EngineError::InvalidInput)?;
        if self.constraint.is_some() {
            // A complete grammar allows only EOS: ignoring it, or masking it below `min_tokens`, would leave a row
            // with no token to sample.
            if self.ignore_eos {
                return Err(EngineError::InvalidInput(
                    "ignore_eos cannot be combined with structured outputs (the grammar ends the output with EOS)"
                        .into(),
                ));
            }
            if self.min_tokens > 0 {
                return Err(EngineError::InvalidInput(
                    "min_tokens cannot be combined with structured outputs (the grammar decides where the output \
                     ends)"
                        .into(),
                ));
            }
        }
        Ok(())
    }

    /// Checks every parameter, including that stop token ids are below `vocab_size`.
    pub fn validate(&self, vocab_size: usize) -> Result<()> {
        self.validate_ranges()?;
        if let Some(&id) = self.stop_token_ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(EngineError::InvalidInput(format!(
                "stop_token_ids: token id {id} is out of range for a vocabulary of {vocab_size} tokens"
            )));
        }
        if let Some(&id) = self.logit_bias.keys().find(|&&id| id as usize >= vocab_size) {
            return Err(EngineError::InvalidInput(format!(
                "logit_bias: token id {id} is out of range for a vocabulary of {vocab_size} tokens"
            )));
        }
        Ok(())
    }

    /// Whether the logits are changed before sampling (a repetition, presence or frequency penalty, a logit bias,
    /// `min_tokens`, a constraint's token mask): such a request's picks need its history on the host, so it samples
    /// on the penalised path even when greedy, and none of its decodes chain.
    pub fn adjusts_logits(&self) -> bool {
        self.constraint.is_some()
            || self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || !self.logit_bias.is_empty()
            || self.min_tokens > 0
    }

    /// The additive logit adjustments of the step after `generated` (the request's generated tokens so far, not its
    /// prompt), into `out` as ascending distinct `(id, amount)`: minus the presence and frequency penalties of each
    /// generated token, plus `logit_bias`, plus [`MASKED`] for the `eos` ids (unless `ignore_eos`) and the stop ids
    /// while fewer than `min_tokens` are generated. Applied after the repetition penalty by [`apply_logit_bias`]; the
    /// coordinator computes them once, so every rank and device adds the same numbers.
    pub fn logit_bias_at(&self, generated: &[u32], eos: &[u32], out: &mut Vec<(u32, f32)>) {
        out.clear();
        if self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 {
            let mut ids = generated.to_vec();
            ids.sort_unstable();
            for run in ids.chunk_by(|a, b| a == b) {
                let count = run.len() as f32;
                out.push((run[0], -(self.presence_penalty + self.frequency_penalty * count)));
            }
        }
        out.extend(self.logit_bias.iter().map(|(&id, &b)| (id, b)));
        if generated.len() < self.min_tokens {
            let eos = if self.ignore_eos { &[][..] } else { eos };
            out.extend(eos.iter().chain(&self.stop_token_ids).map(|&id| (id, MASKED)));
        }
        // A stable sort keeps each id's parts in the order above, so the sums are the same on every call.
        out.sort_by_key(|&(id, _)| id);
        out.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same && kept.1 != MASKED {
                kept.1 = if later.1 == MASKED { MASKED } else { kept.1 + later.1 };
            }
            same
        });
    }
}

/// A request's draw stream: the seed its sampling draws come from, reproducibly.
pub struct Sampler {
    seed: u64,
}

impl Sampler {
    /// The stream for `params` (validated with [`SamplingParams::validate_ranges`]): ChaCha20 seeded from
    /// `params.seed`, or from a random seed when it is `None`.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate_ranges()?;
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        Ok(Self { seed })
    }

    /// Draw number `index` of seed `seed`'s stream, in `[0, 1)`, without drawing the ones before it: the serving
    /// coordinator draws by token index, so a request re-run after a fault or a preemption draws exactly what it
    /// would have.
    pub fn draw_at(seed: u64, index: u64) -> f32 {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        rng.set_word_pos(u128::from(index));
        // `random::<f32>()` is in [0, 1); keep it strictly below 1 after any rounding.
        rng.random::<f32>().min(1.0 - f32::EPSILON)
    }

    /// The seed actually in use (drawn at random when the parameters had none).
    pub fn seed(&self) -> u64 {
        self.seed
    }
}

/// The distinct ids of `previous`, ascending, into `out` (the tokens a repetition penalty applies to).
pub fn distinct_ids(previous: &[u32], out: &mut Vec<u32>) {
    out.clear();
    out.extend_from_slice(previous);
    out.sort_unstable();
    out.dedup();
}

/// HF `RepetitionPenaltyLogitsProcessor` over distinct in-range ids: a logit is divided by `penalty` when positive and
/// multiplied by it otherwise.
pub fn apply_repetition_penalty(scores: &mut [f32], distinct: &[u32], penalty: f32) {
    for &id in distinct {
        let s = &mut scores[id as usize];
        *s = if *s > 0.0 { *s / penalty } else { *s * penalty };
    }
}

/// Adds `bias` (ascending distinct in-range ids, as [`SamplingParams::logit_bias_at`] gives) to `scores`: the CPU
/// twin of the device kernel `logit_bias`.
pub fn apply_logit_bias(scores: &mut [f32], bias: &[(u32, f32)]) {
    for &(id, b) in bias {
        scores[id as usize] += b;
    }
}

/// Index of the largest value, the lowest index on ties: the kernels' CPU twin of the device argmax, which every
/// greedy pick in the engine uses.
pub use rewind_kernels::cpu::sample::argmax;

#[cfg(test)]
mod tests;
