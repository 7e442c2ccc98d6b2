//! One sequence of a [`GpuModel`] as the generation loop's backend.

use super::{GpuModel, SampleRow};
use crate::error::Result;
use crate::generate::SequenceStepper;
use crate::model::hybrid::Logits;
use crate::sample::Sampler;

/// A sequence opened on a [`GpuModel`]; released when dropped.
pub struct GpuSequence<'m> {
    model: &'m mut GpuModel,
    seq: usize,
    limit: usize,
}

impl<'m> GpuSequence<'m> {
    /// Opens a sequence that may grow to `limit` tokens (at most the pools' length).
    pub fn open(model: &'m mut GpuModel, limit: usize) -> Result<Self> {
        let limit = limit.min(model.report().sizes.max_len);
        let seq = model.open()?;
        Ok(GpuSequence { model, seq, limit })
    }
}

impl SequenceStepper for GpuSequence<'_> {
    fn context_limit(&self) -> usize {
        self.limit
    }

    fn prefill(&mut self, prompt: &[u32]) -> Result<Vec<f32>> {
        self.model.prefill(self.seq, prompt, Logits::Last)
    }

    fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        self.model.decode(&[(self.seq, token)])
    }

    fn decode_greedy(&mut self, token: u32) -> Result<Option<u32>> {
        Ok(Some(self.model.decode_greedy(&[(self.seq, token)])?[0]))
    }

    fn decode_sampled(&mut self, token: u32, sampler: &mut Sampler, history: &[u32]) -> Result<Option<u32>> {
        let p = sampler.params();
        let row = SampleRow {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            history: if p.repetition_penalty != 1.0 {
                history.to_vec()
            } else {
                Vec::new()
            },
            uniform: sampler.uniform(),
        };
        Ok(Some(self.model.decode_sampled(&[(self.seq, token)], &[row])?[0]))
    }
}

impl Drop for GpuSequence<'_> {
    fn drop(&mut self) {
        // A release can only fail for a sequence that is not open, which this one is.
        let _ = self.model.release(self.seq);
    }
}
