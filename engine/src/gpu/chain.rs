//! Chained decode steps on the GPU ([`DecodeChain`], like vLLM's multi-step scheduling): a plan of decodes
//! runs `1 + c` steps back to back with no host round trip between them.
//!
//! A decode always commits exactly one token, so everything a step needs but its tokens is known on the host in
//! advance: the counters move by the single step's rules (`gpu/steps.rs`, `stage_decode` / `after_decode`), and
//! the positions, lengths, replay rows and folds follow. The tokens are the picks of the step before: after each step
//! the `chain_pick` kernel writes them (the sampled id, else the head summary's argmax) straight into the next step's
//! token buffer, and logs the step's summaries and sampled ids on the device. The host queues every step, then reads
//! the log once.
//!
//! The CPU rank's loop of single steps (`rank/executor.rs`, `decode_chain`) is the twin; `rewind selftest` checks a chain
//! against single steps on the GPU (`gpu/check_chain.rs`).
//!
//! [`DecodeChain`]: crate::rank::DecodeChain

use rewind_kernels::cuda::ops::{self, SUMMARY_WORDS};
use rewind_kernels::cuda::{CudaDevice, CudaSlice};
use tracing::debug_span;

use super::head::{mark_sampled, sample_params, HeadSpec};
use super::rank::{to_i32, GpuRank, HeadOut};
use super::steps::greedy;
use super::whole_rows::joining_comm;
use super::Act;
use crate::error::{EngineError, Result};
use crate::rank::{DecodeChain, RowSummary, SampleRow, SeqStep, MAX_CHAINED};

/// The chain's device buffers: the per-step log of summaries and sampled ids, and the sampling parameters and draws
/// of every step, uploaded once.
pub(crate) struct ChainScratch {
    /// `[steps, seqs, SUMMARY_WORDS]`.
    words: CudaSlice<u32>,
    /// `[steps, seqs]` sampled ids (−1 where the step did not sample).
    ids: CudaSlice<i32>,
    /// `[seqs, 4]` (temperature, top-k, top-p, min-p), as `ops::sample_rows` reads them.
    params: CudaSlice<f32>,
    /// `[steps, seqs]` draws.
    uniforms: CudaSlice<f32>,
    /// `[ranks, seqs, SUMMARY_WORDS]`: every rank's summaries of a step, gathered (tensor parallelism).
    gathered: CudaSlice<u32>,
}

impl ChainScratch {
    /// Bytes [`ChainScratch::new`] allocates for `max_seqs` sequences on a rank of `tp`.
    pub(crate) fn bytes(max_seqs: usize, tp: usize) -> usize {
        4 * (MAX_CHAINED + 1) * max_seqs * (SUMMARY_WORDS + 2) + 4 * 4 * max_seqs + 4 * tp * max_seqs * SUMMARY_WORDS
    }

    /// The buffers for `max_seqs` sequences on a rank of `tp`, allocated once with the rank's scratch.
    pub(crate) fn new(dev: &CudaDevice, max_seqs: usize, tp: usize) -> Result<Self> {
        let steps = MAX_CHAINED + 1;
        Ok(ChainScratch {
            words: dev.alloc_zeros(steps * max_seqs * SUMMARY_WORDS)?,
            ids: dev.alloc_zeros(steps * max_seqs)?,
            params: dev.alloc_zeros(4 * max_seqs)?,
            uniforms: dev.alloc_zeros(steps * max_seqs)?,
            gathered: dev.alloc_zeros(tp.max(1) * max_seqs * SUMMARY_WORDS)?,
        })
    }
}

impl<A: Act> GpuRank<A> {
    /// Runs a plan's decodes and its chained steps (the books have checked and recorded the plan); returns every
    /// step's rows, step-major.
    /// `seqs` holds each sequence as step 0's decode: the staging reads slots, positions and forms, which the steps
    /// share.
    pub(super) fn run_chain(&mut self, chain: &DecodeChain, seqs: &[&SeqStep]) -> Result<HeadOut> {
        let (b, steps) = (seqs.len(), chain.steps + 1);
        let _span = debug_span!("gpu_chain", batch = b, steps).entered();
        // The books checked the chain (`DecodeChain::check`).
        let sampling = seqs.iter().any(|s| s.sample.is_some());
        let world = self.info.tp;
        if world > 1 && self.inner.comm.is_none() {
            return Err(EngineError::Communicator(format!(
                "a chained step on rank {} of {world} without a communicator to merge the ranks' picks",
                self.info.rank
            )));
        }
        let dev = self.inner.dev.clone();
        // The rank's slice (the whole vocabulary at TP 1) and the model's vocabulary.
        let (v, vocab) = (self.info.vocab.len(), self.inner.config.vocab_size);
        if sampling {
            let rows: Vec<SampleRow> = seqs.iter().map(|s| s.sample.clone().unwrap_or_else(greedy)).collect();
            let params = sample_params(&rows);
            // Step-major draws: a sampling row carries one per step (`DecodeChain::check`); a greedy row's are
            // unused (temperature 0 is the argmax), so it draws 0.
            let uniforms: Vec<f32> = (0..steps)
                .flat_map(|k| {
                    chain
                        .seqs
                        .iter()
                        .map(move |s| s.sample.as_ref().map_or(0.0, |r| r.draws[k]))
                })
                .collect();
            let c = &mut self.scratch.chain;
            dev.stream()
                .memcpy_htod(&params, &mut c.params.slice_mut(..params.len()))
                .map_err(|e| EngineError::Gpu(format!("uploading a chain's sampling parameters: {e}")))?;
            dev.stream()
                .memcpy_htod(&uniforms, &mut c.uniforms.slice_mut(..uniforms.len()))
                .map_err(|e| EngineError::Gpu(format!("uploading a chain's draws: {e}")))?;
        }
        let tokens = to_i32(seqs.iter().map(|s| s.tokens[0] as usize));
        let words = SUMMARY_WORDS;
        for k in 0..steps {
            let staged = self.stage_decode(seqs, k, (k == 0).then_some(&tokens[..]))?;
            self.launch(staged.step, b, sampling, HeadSpec::Host(&[]), &[])?;
            let s = &mut self.scratch;
            if sampling {
                let (params, uniforms) = (&s.chain.params, &s.chain.uniforms);
                match s.whole_rows.as_mut() {
                    // Under tensor parallelism every rank samples the rows joined from every rank's slice.
                    Some(whole) => {
                        let comm = joining_comm(self.inner.comm.as_deref(), self.info.rank, world)?;
                        whole.sample_chunks(&dev, comm, &s.logits, 0, b, &mut s.argmax, |dev, rows, at, ids| {
                            let draws = k * b + at.start..k * b + at.end;
                            let params = params.slice(4 * at.start..4 * at.end);
                            Ok(ops::sample_rows(
                                dev,
                                rows,
                                at.len(),
                                vocab,
                                &params,
                                &uniforms.slice(draws),
                                ids,
                            )?)
                        })?;
                    }
                    None => ops::sample_rows(
                        &dev,
                        &s.logits.slice(..b * v),
                        b,
                        v,
                        &params.slice(..4 * b),
                        &uniforms.slice(k * b..(k + 1) * b),
                        &mut s.argmax.slice_mut(..b),
                    )?,
                }
            }
            // Under tensor parallelism every rank's summaries meet on every rank, which merge them alike.
            if let (Some(c), true) = (&self.inner.comm, world > 1) {
                c.all_gather_u32(
                    &s.head.out.slice(..b * words),
                    &mut s.chain.gathered.slice_mut(..world * b * words),
                )?;
            }
            let gathered = if world > 1 {
                s.chain.gathered.slice(..world * b * words)
            } else {
                s.head.out.slice(..b * words)
            };
            ops::chain_pick(
                &dev,
                &s.head.out.slice(..b * words),
                &gathered,
                world,
                words,
                &s.argmax.slice(..b),
                sampling,
                vocab,
                &mut s.tokens.slice_mut(..b),
                &mut s.chain.words.slice_mut(k * b * words..(k + 1) * b * words),
                &mut s.chain.ids.slice_mut(k * b..(k + 1) * b),
            )?;
            self.after_decode(seqs, &staged)?;
            if k > 0 {
                self.steps += 1;
            }
        }
        // The one read-back of the chain: it waits for every step.
        let c = &self.scratch.chain;
        let logged = dev.download(&c.words.slice(..steps * b * words))?;
        let ids = dev.download(&c.ids.slice(..steps * b))?;
        let mut rows: Vec<RowSummary> = ops::decode_summaries(&logged, &vec![false; steps * b])
            .into_iter()
            .map(RowSummary::from)
            .collect();
        for (i, row) in rows.iter_mut().enumerate() {
            if seqs[i % b].sample.is_some() {
                mark_sampled(row, ids[i]);
            }
        }
        Ok(HeadOut {
            rows,
            logits: None,
            hidden: None,
        })
    }
}
