//! Sampled rows under tensor parallelism. A rank's LM head holds a slice of the vocabulary, but the sampler's filters
//! (top-k, top-p, min-p), the repetition penalty and the draw need whole rows. Every rank sends its slices of the
//! sampled rows to every other (one NCCL all-gather), joins them into whole rows and samples those with the kernel a
//! whole-vocabulary rank uses (`ops::sample_rows`). Every rank then holds the same rows and the same draws, so every
//! rank picks the same ids, and no logits reach the host: the picks can feed the next step on the device (chained
//! decodes, `gpu/chain.rs`) as at TP 1.
//!
//! The rows go in chunks of at most [`WHOLE_FLOATS`] joined floats, which bounds the buffers whatever the batch.

use std::ops::Range;

use rewind_kernels::cuda::ops;
use rewind_kernels::cuda::{CudaDevice, CudaSlice, CudaViewMut};

use super::DeviceComm;
use crate::error::{EngineError, Result};
use crate::shard::plan::even_split;

/// Joined floats per chunk (64 MiB): at 248 K ids, 67 rows a chunk.
pub(crate) const WHOLE_FLOATS: usize = 1 << 24;

/// The buffers and the layout of a tensor-parallel rank's whole-row sampling.
pub(crate) struct WholeRows {
    /// Every rank's vocabulary slice, in rank order (`shard::plan::even_split`, as the checkpoint was cut).
    slices: Vec<Range<usize>>,
    rank: usize,
    vocab: usize,
    /// The widest slice: every rank sends its rows padded to it, since a gather sends equal counts.
    widest: usize,
    /// Rows per chunk.
    chunk: usize,
    /// `[chunk, widest]`: this rank's rows padded, when its slice is narrower than the widest (else it sends its
    /// logit rows as they are).
    send: Option<CudaSlice<f32>>,
    /// `[ranks, chunk, widest]`.
    gathered: CudaSlice<f32>,
    /// `[chunk, vocab]`.
    whole: CudaSlice<f32>,
}

/// Rows per chunk and the widest slice for `vocab` ids over `tp` ranks and up to `max_seqs` sampled rows.
fn shape(vocab: usize, tp: usize, max_seqs: usize) -> (usize, usize) {
    let chunk = (WHOLE_FLOATS / vocab.max(1)).clamp(1, max_seqs.max(1));
    (chunk, vocab.div_ceil(tp.max(1)))
}

/// The communicator rank `rank` of `tp` joins its sampled rows over; an error when it has none.
pub(crate) fn joining_comm(comm: Option<&dyn DeviceComm>, rank: usize, tp: usize) -> Result<&dyn DeviceComm> {
    comm.ok_or_else(|| {
        EngineError::Communicator(format!(
            "sampling on rank {rank} of {tp} without a communicator to join the rows"
        ))
    })
}

impl WholeRows {
    /// Bytes [`WholeRows::new`] allocates on any rank of `tp` (none at TP 1).
    pub(crate) fn bytes(vocab: usize, tp: usize, max_seqs: usize) -> usize {
        if tp < 2 {
            return 0;
        }
        let (chunk, widest) = shape(vocab, tp, max_seqs);
        let send = if vocab.is_multiple_of(tp) { 0 } else { chunk * widest };
        4 * (send + tp * chunk * widest + chunk * vocab)
    }

    /// The buffers of rank `rank` of `tp` for a model of `vocab` ids and up to `max_seqs` sampled rows a step;
    /// `None` at TP 1, where the rank samples its own whole rows.
    pub(crate) fn new(dev: &CudaDevice, vocab: usize, tp: usize, rank: usize, max_seqs: usize) -> Result<Option<Self>> {
        if tp < 2 {
            return Ok(None);
        }
        let (chunk, widest) = shape(vocab, tp, max_seqs);
        let slices: Vec<Range<usize>> = (0..tp).map(|r| even_split(vocab, tp, r)).collect();
        let narrow = slices.get(rank).map(Range::len) != Some(widest);
        Ok(Some(WholeRows {
            rank,
            vocab,
            widest,
            chunk,
            send: if narrow {
                Some(dev.alloc_zeros(chunk * widest)?)
            } else {
                None
            },
            gathered: dev.alloc_zeros(tp * chunk * widest)?,
            whole: dev.alloc_zeros(chunk * vocab)?,
            slices,
        }))
    }

    /// Joins rows `first..first + n` of this rank's logit slices (`logits`, rows as wide as the rank's slice) with
    /// every other rank's, a chunk at a time, and runs `sample(dev, whole, rows, ids)` on each chunk: `whole` holds
    /// the chunk's whole rows, `rows` their indices in `0..n`, and `ids` the chunk's share of `ids[..n]`. Every rank
    /// must call this for the same rows in the same order (the gathers pair up).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn sample_chunks(
        &mut self,
        dev: &CudaDevice,
        comm: &dyn DeviceComm,
        logits: &CudaSlice<f32>,
        first: usize,
        n: usize,
        ids: &mut CudaSlice<i32>,
        mut sample: impl FnMut(
            &CudaDevice,
            &mut CudaViewMut<'_, f32>,
            Range<usize>,
            &mut CudaViewMut<'_, i32>,
        ) -> Result<()>,
    ) -> Result<()> {
        let (tp, width, widest, vocab) = (self.slices.len(), self.slices[self.rank].len(), self.widest, self.vocab);
        if logits.len() < (first + n) * width || ids.len() < n {
            return Err(EngineError::Gpu(format!(
                "sampling rows {first}..{} of {width}-wide logit slices: the buffers hold {} logits and {} ids",
                first + n,
                logits.len(),
                ids.len()
            )));
        }
        for lo in (0..n).step_by(self.chunk) {
            let m = self.chunk.min(n - lo);
            let count = m * widest;
            let rows = logits.slice((first + lo) * width..(first + lo + m) * width);
            {
                let mut gathered = self.gathered.slice_mut(..tp * count);
                match &mut self.send {
                    Some(send) => {
                        ops::copy_block(dev, &rows, m, width, 0, width, &mut send.slice_mut(..count), widest, 0)?;
                        comm.all_gather_f32(&send.slice(..count), &mut gathered)?;
                    }
                    None => comm.all_gather_f32(&rows, &mut gathered)?,
                }
            }
            let mut whole = self.whole.slice_mut(..m * vocab);
            for (r, s) in self.slices.iter().enumerate() {
                let part = self.gathered.slice(r * count..(r + 1) * count);
                ops::copy_block(dev, &part, m, widest, 0, s.len(), &mut whole, vocab, s.start)?;
            }
            sample(dev, &mut whole, lo..lo + m, &mut ids.slice_mut(lo..lo + m))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_bound_the_buffers_and_pad_only_uneven_splits() {
        // Qwen3.5-4B's 248 320 ids over 2 ranks: even slices, no padded copy, 67 rows a chunk.
        assert_eq!(shape(248_320, 2, 256), (67, 124_160));
        assert_eq!(WholeRows::bytes(248_320, 2, 256), 4 * (2 * 67 * 124_160 + 67 * 248_320));
        // An odd vocabulary pads the narrower rank's rows to the widest.
        assert_eq!(shape(101, 2, 4), (4, 51));
        assert_eq!(WholeRows::bytes(101, 2, 4), 4 * (4 * 51 + 2 * 4 * 51 + 4 * 101));
        // A few slots: a chunk never holds more rows than a step samples; TP 1 allocates nothing.
        assert_eq!(shape(1000, 4, 3).0, 3);
        assert_eq!(WholeRows::bytes(248_320, 1, 256), 0);
    }
}
