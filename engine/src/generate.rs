//! Single-sequence generation over any backend ([`SequenceStepper`]; a rank group's is
//! [`crate::rank::GroupSequence`]): chunked prefill of the prompt, then sample → decode one token at a time,
//! streaming text as it becomes complete UTF-8 and stopping on EOS, stop ids, stop strings, length or context limit.

use std::time::Instant;

use serde::Serialize;
use tracing::info_span;

use crate::error::{EngineError, Result};
use crate::sample::{Sampler, SamplingParams, StopChecker, StopOutcome};
use crate::tokenizer::Tokenizer;

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

/// The result of [`generate`].
#[derive(Clone, Debug, Serialize)]
pub struct GenerationOutput {
    pub text: String,
    /// Generated token ids (the prompt excluded; a final stop token included).
    pub tokens: Vec<u32>,
    pub stats: GenerationStats,
}

/// What the generation loop needs from a backend running one sequence.
pub trait SequenceStepper {
    /// The longest context the sequence may reach.
    fn context_limit(&self) -> usize;
    /// Runs the prompt; returns the last position's logits (`[vocab]`).
    fn prefill(&mut self, prompt: &[u32]) -> Result<Vec<f32>>;
    /// Appends one token; returns the next position's logits.
    fn decode(&mut self, token: u32) -> Result<Vec<f32>>;
    /// Appends one token and returns the greedy next token, where the backend can pick it without handing back the
    /// logits (a GPU's argmax); `None` when it cannot (the caller then uses [`SequenceStepper::decode`]).
    fn decode_greedy(&mut self, _token: u32) -> Result<Option<u32>> {
        Ok(None)
    }

    /// Appends one token and samples the next on the backend with `sampler`'s parameters and next uniform draw;
    /// `None` when the backend hands back logits instead (the caller then samples them itself).
    fn decode_sampled(&mut self, _token: u32, _sampler: &mut Sampler, _history: &[u32]) -> Result<Option<u32>> {
        Ok(None)
    }
}

/// The generation loop over any backend: prefill, then sample → decode until a stop condition. The backend has
/// already checked the prompt's ids; `params` must be valid for its vocabulary.
pub fn generate_on(
    stepper: &mut dyn SequenceStepper,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    params: &SamplingParams,
    eos_token_ids: &[u32],
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerationOutput> {
    if prompt.is_empty() {
        return Err(EngineError::InvalidInput(
            "the prompt is empty (no tokens to start from)".into(),
        ));
    }
    let limit = stepper.context_limit();
    let _span = info_span!("generate", prompt_tokens = prompt.len()).entered();
    let mut sampler = Sampler::new(params.clone())?;
    let mut stops = StopChecker::new(&params.stop_strings);
    let mut stream = tokenizer.decode_stream(true);
    let mut position = prompt.len();
    // Greedy without a penalty needs no logits on the host: the backend may pick the token itself.
    let greedy = params.temperature == 0.0 && params.repetition_penalty == 1.0;
    let mut picked: Option<u32> = None;

    let t0 = Instant::now();
    let mut logits = stepper.prefill(prompt)?;
    let prefill_seconds = t0.elapsed().as_secs_f64();

    let mut history: Vec<u32> = prompt.to_vec();
    let mut generated: Vec<u32> = Vec::new();
    let mut text = String::new();
    let max_tokens = params.max_tokens.unwrap_or(usize::MAX);
    let t1 = Instant::now();
    let mut emit = |piece: &str, text: &mut String| {
        if !piece.is_empty() {
            on_text(piece);
            text.push_str(piece);
        }
    };
    let finish = loop {
        if generated.len() >= max_tokens {
            break FinishReason::Length;
        }
        let next = match picked.take() {
            Some(t) => t,
            None => sampler.sample(&logits, &history)?,
        };
        generated.push(next);
        history.push(next);
        if !params.ignore_eos && eos_token_ids.contains(&next) {
            break FinishReason::Eos;
        }
        if params.stop_token_ids.contains(&next) {
            break FinishReason::StopToken;
        }
        if let Some(piece) = stream.step(next)? {
            match stops.push(&piece) {
                StopOutcome::Continue(out) => emit(&out, &mut text),
                StopOutcome::Stopped { emit: out, .. } => {
                    emit(&out, &mut text);
                    break FinishReason::StopString;
                }
            }
        }
        if position >= limit {
            break FinishReason::ContextLimit;
        }
        if generated.len() >= max_tokens {
            break FinishReason::Length;
        }
        let on_backend = if greedy {
            stepper.decode_greedy(next)?
        } else {
            stepper.decode_sampled(next, &mut sampler, &history)?
        };
        match on_backend {
            Some(t) => picked = Some(t),
            None => logits = stepper.decode(next)?,
        }
        position += 1;
    };
    if finish != FinishReason::StopString {
        if let Some(piece) = stream.flush()? {
            let (StopOutcome::Continue(out) | StopOutcome::Stopped { emit: out, .. }) = stops.push(&piece);
            emit(&out, &mut text);
        }
        let rest = stops.finish();
        emit(&rest, &mut text);
    }
    let decode_seconds = t1.elapsed().as_secs_f64();
    let decoded = generated.len().saturating_sub(1);
    Ok(GenerationOutput {
        text,
        stats: GenerationStats {
            prompt_tokens: prompt.len(),
            generated_tokens: generated.len(),
            prefill_seconds,
            decode_seconds,
            prefill_tokens_per_second: prompt.len() as f64 / prefill_seconds.max(1e-9),
            // The first token comes from the prefill's logits; every later one costs one decode step.
            decode_tokens_per_second: if decoded > 0 {
                decoded as f64 / decode_seconds.max(1e-9)
            } else {
                0.0
            },
            finish_reason: finish,
            seed: sampler.seed(),
        },
        tokens: generated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::bpe_builder::{self, SpecialTokenChoice};

    /// A backend whose logits always favour `last + 1`, and which can pick tokens itself (as a GPU does).
    struct Counting {
        vocab: usize,
        picks: bool,
        logits_calls: usize,
        greedy_calls: usize,
        sampled_calls: usize,
    }

    impl Counting {
        fn next(&self, token: u32) -> u32 {
            (token + 1) % self.vocab as u32
        }

        fn logits_after(&self, token: u32) -> Vec<f32> {
            let mut l = vec![0.0; self.vocab];
            l[self.next(token) as usize] = 10.0;
            l
        }
    }

    impl SequenceStepper for Counting {
        fn context_limit(&self) -> usize {
            1000
        }

        fn prefill(&mut self, prompt: &[u32]) -> Result<Vec<f32>> {
            Ok(self.logits_after(*prompt.last().expect("a prompt")))
        }

        fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
            self.logits_calls += 1;
            Ok(self.logits_after(token))
        }

        fn decode_greedy(&mut self, token: u32) -> Result<Option<u32>> {
            if !self.picks {
                return Ok(None);
            }
            self.greedy_calls += 1;
            Ok(Some(self.next(token)))
        }

        fn decode_sampled(&mut self, token: u32, sampler: &mut Sampler, _history: &[u32]) -> Result<Option<u32>> {
            if !self.picks {
                return Ok(None);
            }
            self.sampled_calls += 1;
            let _ = sampler.uniform();
            Ok(Some(self.next(token)))
        }
    }

    fn run(picks: bool, temperature: f32) -> (Vec<u32>, Counting) {
        let dir = tempfile::tempdir().expect("tempdir");
        let bpe = bpe_builder::build_bpe_tokenizer(600).expect("tokenizer");
        bpe_builder::write_tokenizer_files(dir.path(), &bpe, &SpecialTokenChoice::default()).expect("write");
        let tokenizer = Tokenizer::from_dir(dir.path()).expect("load");
        let mut backend = Counting {
            vocab: 600,
            picks,
            logits_calls: 0,
            greedy_calls: 0,
            sampled_calls: 0,
        };
        let params = SamplingParams {
            temperature,
            top_k: 1,
            max_tokens: Some(6),
            seed: Some(1),
            ..SamplingParams::default()
        };
        let out = generate_on(&mut backend, &tokenizer, &[40, 41], &params, &[], &mut |_| {}).expect("generate");
        (out.tokens, backend)
    }

    /// The loop takes the backend's own picks when it offers them (greedy and sampled), and the same tokens come out
    /// as when it samples the backend's logits itself.
    #[test]
    fn backend_picks_replace_host_sampling() {
        let want: Vec<u32> = (42..48).collect();
        let (tokens, b) = run(true, 0.0);
        assert_eq!(tokens, want);
        assert_eq!((b.greedy_calls, b.sampled_calls, b.logits_calls), (5, 0, 0));
        let (tokens, b) = run(true, 1.0);
        assert_eq!(tokens, want);
        assert_eq!((b.greedy_calls, b.sampled_calls, b.logits_calls), (0, 5, 0));
        let (tokens, b) = run(false, 0.0);
        assert_eq!(tokens, want);
        assert_eq!((b.greedy_calls, b.sampled_calls, b.logits_calls), (0, 0, 5));
    }
}
