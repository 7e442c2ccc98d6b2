//! One sequence of a [`GpuModel`] as the generation loop's backend.

use super::GpuModel;
use crate::error::Result;
use crate::generate::SequenceStepper;
use crate::model::hybrid::Logits;

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
}

impl Drop for GpuSequence<'_> {
    fn drop(&mut self) {
        // A release can only fail for a sequence that is not open, which this one is.
        let _ = self.model.release(self.seq);
    }
}
