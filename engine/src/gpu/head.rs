//! The LM head of a GPU rank: the final norm, then one-pass summaries of the reported rows over the rank's
//! vocabulary slice (`kernels/src/cuda/kernels/lm_head.cu`; CPU twin `kernels/src/cpu/lm_head.rs`): each row's
//! argmax and logit, its log-sum-exp and, for a speculative row, the LSE of `logit / τ`, the drafted token's scaled
//! logit and a Gumbel-max candidate. Ids are global, so tensor-parallel ranks' summaries merge exactly like tiles
//! (`rank/vocab.rs`).
//!
//! Rows nobody reads whole go through the head a bounded chunk of the vocabulary at a time ([`CHUNK_FLOATS`] logits
//! at most, whatever the vocabulary or batch), so no `[rows, vocab]` tensor is written on the greedy and speculative
//! paths. Whole rows are produced only where they are read: `--full-logits` callers and the filtered sampler.

use rewind_kernels::cpu::lm_head::{LogprobRequest, SpecRequest};
use rewind_kernels::cuda::ops::{self, PART_WIDTH, SPEC_WORDS, SUMMARY_WORDS, TOPK_WORDS};
use rewind_kernels::cuda::{CudaDevice, CudaSlice, CudaView, CudaViewMut, DevicePtr};

use super::loaded::LoadedRank;
use super::rank::{GpuRank, HeadOut};
use super::scratch::StepRows;
use super::whole_rows::joining_comm;
use super::Act;
use crate::error::{EngineError, Result};
use crate::rank::{RowSummary, SampleRow};

/// Logits one chunk of the head may hold (16 MiB of f32): small enough to stay in L2 between the GEMM that writes it
/// and the summary kernel that reads it.
pub(super) const CHUNK_FLOATS: usize = 4 << 20;

/// Partial summaries a row may need: those of the whole slice, plus one per chunk edge that does not fall on a part
/// boundary.
pub(super) fn max_parts(vocab_local: usize) -> usize {
    ops::parts_for(vocab_local) + vocab_local.div_ceil(PART_WIDTH).min(64) + 1
}

/// Logits the scratch holds: `step.whole` whole rows, and for every row a chunk of [`chunk_ids`].
pub(crate) fn logits_len(step: StepRows, vocab_local: usize) -> usize {
    let chunked = step.rows * chunk_ids(step.rows, vocab_local);
    (step.whole * vocab_local).max(chunked)
}

/// Vocabulary ids per chunk for `rows` rows: a multiple of the part width, at least one part.
fn chunk_ids(rows: usize, vocab_local: usize) -> usize {
    let per_row = (CHUNK_FLOATS / rows.max(1)) / PART_WIDTH * PART_WIDTH;
    per_row.max(PART_WIDTH).min(vocab_local)
}

/// Device buffers of the log-probability rows' top lists (`ops::head_topk_parts` / `head_topk_merge`). After every
/// vocabulary chunk the chunk's parts are merged with the running list in each row's slot 0, so the parts hold one
/// chunk's lists, not a whole row's: bounded whatever the vocabulary (a prompt chunk may ask about every row).
struct TopScratch {
    /// The asking rows' indices among the head rows.
    rows: CudaSlice<i32>,
    /// `[asking, 2]` requests (`ops::encode_logprob_requests`).
    req: CudaSlice<i32>,
    /// `[asking, slots, TOPK_WORDS]`, `slots` = 1 + the parts of one chunk.
    parts: CudaSlice<u32>,
    /// `[asking, TOPK_WORDS]` merged lists.
    out: CudaSlice<u32>,
    /// This step's asking rows (head row, request), uploaded by [`GpuRank::prepare_head`].
    asking: Vec<(usize, LogprobRequest)>,
}

impl TopScratch {
    /// Words of `parts` for a head of at most `rows` rows: a launch of `h` head rows folds chunks of
    /// `chunk_ids(h, v)` ids, `h × (1 + parts)` slots, which is at most `2h` plus the parts of one full chunk.
    fn parts_words(rows: usize) -> usize {
        (3 * rows + CHUNK_FLOATS / PART_WIDTH) * TOPK_WORDS
    }

    fn bytes(rows: usize) -> usize {
        4 * (3 * rows + Self::parts_words(rows) + rows * TOPK_WORDS)
    }

    fn new(dev: &CudaDevice, rows: usize) -> Result<Self> {
        Ok(TopScratch {
            rows: dev.alloc_zeros(rows)?,
            req: dev.alloc_zeros(rows * 2)?,
            parts: dev.alloc_zeros(Self::parts_words(rows))?,
            out: dev.alloc_zeros(rows * TOPK_WORDS)?,
            asking: Vec::new(),
        })
    }

    /// Folds one chunk of `len` logit columns (row stride `ld`, ids from `first_id`) of the head's `head_rows` rows
    /// into the asking rows' lists; `slots` per row, `first`: no running list yet. The merged lists land in `out`,
    /// and (unless `last`) back in slot 0 for the next chunk.
    #[allow(clippy::too_many_arguments)]
    fn fold_chunk(
        &mut self,
        dev: &CudaDevice,
        logits: &impl DevicePtr<f32>,
        ld: usize,
        head_rows: usize,
        len: usize,
        first_id: u32,
        slots: usize,
        first: bool,
        last: bool,
    ) -> Result<()> {
        let a = self.asking.len();
        let (rows, req) = (self.rows.slice(..a), self.req.slice(..2 * a));
        let parts = &mut self.parts.slice_mut(..a * slots * TOPK_WORDS);
        let offset = usize::from(!first);
        ops::head_topk_parts(
            dev, logits, ld, head_rows, len, first_id, &rows, &req, parts, slots, offset,
        )?;
        let out = &mut self.out.slice_mut(..a * TOPK_WORDS);
        ops::head_topk_merge(dev, parts, a, slots, offset + ops::parts_for(len), &req, out)?;
        if !last {
            // SAFETY: u32 and f32 have one size and alignment, and the copy moves bits (no arithmetic on them).
            let (src, mut dst) = unsafe {
                (
                    out.transmute::<f32>(a * TOPK_WORDS),
                    parts.transmute_mut::<f32>(parts.len()),
                )
            };
            let (src, dst) = (
                src.ok_or_else(|| EngineError::Gpu("viewing the merged top lists".into()))?,
                dst.as_mut()
                    .ok_or_else(|| EngineError::Gpu("viewing the top-list parts".into()))?,
            );
            ops::copy_block(dev, &src, a, TOPK_WORDS, 0, TOPK_WORDS, dst, slots * TOPK_WORDS, 0)?;
        }
        Ok(())
    }
}

/// Device buffers of the head's summaries.
pub(crate) struct HeadScratch {
    /// `[rows, 6]` speculative requests.
    spec: CudaSlice<u32>,
    /// The words last uploaded into `spec` (cleared when a kernel writes it, [`HeadScratch::spec_on_device`]): steady
    /// steps, and every step of a greedy chain, ask the same and upload nothing.
    spec_uploaded: Vec<u32>,
    /// `[rows, max_parts, 8]` partial summaries.
    parts: CudaSlice<u32>,
    /// `[rows, 8]` summaries.
    pub(super) out: CudaSlice<u32>,
    max_parts: usize,
    /// The log-probability rows' top lists.
    top: TopScratch,
}

impl HeadScratch {
    /// Bytes [`HeadScratch::new`] allocates.
    pub(crate) fn bytes(rows: usize, vocab_local: usize) -> usize {
        4 * rows * (SPEC_WORDS + (max_parts(vocab_local) + 1) * SUMMARY_WORDS) + TopScratch::bytes(rows)
    }

    pub(crate) fn new(dev: &CudaDevice, rows: usize, vocab_local: usize) -> Result<Self> {
        let max_parts = max_parts(vocab_local);
        Ok(HeadScratch {
            spec: dev.alloc_zeros(rows * SPEC_WORDS)?,
            spec_uploaded: Vec::new(),
            parts: dev.alloc_zeros(rows * max_parts * SUMMARY_WORDS)?,
            out: dev.alloc_zeros(rows * SUMMARY_WORDS)?,
            max_parts,
            top: TopScratch::new(dev, rows)?,
        })
    }
}

impl HeadScratch {
    /// The first `rows` rows of the speculative requests, to read.
    pub(super) fn spec_words(&self, rows: usize) -> CudaView<'_, u32> {
        self.spec.slice(..rows * SPEC_WORDS)
    }

    /// The first `rows` rows of the speculative requests, for a kernel that writes them on the device (a chain's
    /// `chain_spec`, `gpu/spec_chain.rs`); the next host upload then copies whatever it asks.
    pub(super) fn spec_on_device(&mut self, rows: usize) -> CudaViewMut<'_, u32> {
        self.spec_uploaded.clear();
        self.spec.slice_mut(..rows * SPEC_WORDS)
    }

    /// Whether this step's head folds log-probability top lists: its launches then depend on which rows ask, and
    /// the step runs eagerly rather than as a captured graph.
    pub(super) fn asks_logprobs(&self) -> bool {
        !self.top.asking.is_empty()
    }
}

/// Where a step's speculative requests come from.
#[derive(Clone, Copy, Debug)]
pub(super) enum HeadSpec<'a> {
    /// Uploaded from the host: empty (plain rows), or one entry per head row.
    Host(&'a [Option<SpecRequest>]),
    /// Already written on the device ([`HeadScratch::spec_on_device`]).
    Device,
}

impl<A: Act> GpuRank<A> {
    /// Checks a head over `head_rows` rows and uploads its speculative and log-probability requests (`logprob`:
    /// empty, or one per head row), before the step's device work: a captured step reads them from the scratch.
    pub(super) fn prepare_head(
        &mut self,
        head_rows: usize,
        whole: bool,
        spec_from: HeadSpec<'_>,
        logprob: &[Option<LogprobRequest>],
    ) -> Result<()> {
        self.prepare_logprobs(head_rows, logprob)?;
        let spec = match spec_from {
            HeadSpec::Host(spec) => spec,
            HeadSpec::Device => &[],
        };
        if !spec.is_empty() && spec.len() != head_rows {
            return Err(EngineError::InvalidInput(format!(
                "{} speculative requests for {head_rows} head rows",
                spec.len()
            )));
        }
        let s = &mut self.scratch;
        if whole && head_rows > s.whole {
            return Err(EngineError::InvalidInput(format!(
                "a step asking for {head_rows} whole logit rows: this rank holds {} (the larger of the prompt chunk \
                 and --max-seqs)",
                s.whole
            )));
        }
        if matches!(spec_from, HeadSpec::Device) {
            return Ok(());
        }
        let words: Vec<u32> = (0..head_rows)
            .flat_map(|i| ops::encode_spec(spec.get(i).and_then(Option::as_ref)))
            .collect();
        if s.head.spec_uploaded.get(..words.len()) == Some(&words[..]) {
            return Ok(());
        }
        self.inner
            .dev
            .stream()
            .memcpy_htod(&words, &mut s.head.spec.slice_mut(..words.len()))
            .map_err(|e| EngineError::Gpu(format!("uploading speculative requests: {e}")))?;
        if s.head.spec_uploaded.len() < words.len() {
            s.head.spec_uploaded.resize(words.len(), 0);
        }
        s.head.spec_uploaded[..words.len()].copy_from_slice(&words);
        Ok(())
    }

    /// Uploads which head rows ask for log-probabilities and what; a head that asks none folds no top lists.
    fn prepare_logprobs(&mut self, head_rows: usize, logprob: &[Option<LogprobRequest>]) -> Result<()> {
        if !logprob.is_empty() && logprob.len() != head_rows {
            return Err(EngineError::InvalidInput(format!(
                "{} log-probability requests for {head_rows} head rows",
                logprob.len()
            )));
        }
        let top = &mut self.scratch.head.top;
        top.asking = logprob
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.map(|r| (i, r)))
            .collect();
        if top.asking.is_empty() {
            return Ok(());
        }
        let rows: Vec<i32> = top.asking.iter().map(|&(i, _)| i as i32).collect();
        let reqs: Vec<LogprobRequest> = top.asking.iter().map(|&(_, r)| r).collect();
        let stream = self.inner.dev.stream();
        stream
            .memcpy_htod(&rows, &mut top.rows.slice_mut(..rows.len()))
            .and_then(|()| {
                let req = ops::encode_logprob_requests(&reqs);
                stream.memcpy_htod(&req, &mut top.req.slice_mut(..req.len()))
            })
            .map_err(|e| EngineError::Gpu(format!("uploading log-probability requests: {e}")))
    }

    /// The head's device work over the last `head_rows` of the step's `rows` rows (their blocks' outputs in the
    /// scratch): the final norm, then [`head_pass`]. Only device work, so a step's graph captures it.
    pub(super) fn head_device(&mut self, rows: usize, head_rows: usize, whole: bool) -> Result<()> {
        let r = &self.inner;
        let (dev, hid) = (&*r.dev, r.config.hidden_size);
        let s = &mut self.scratch;
        ops::add_rms_norm(
            dev,
            &mut s.x.slice_mut(..rows * hid),
            Some(&s.y.slice(..rows * hid)),
            &r.final_norm,
            r.config.norm_eps,
            r.config.norm_offset,
            &mut s.h.slice_mut(..rows * hid),
        )?;
        let x = s.h.slice((rows - head_rows) * hid..rows * hid);
        head_pass(r, &mut s.logits, &mut s.head, &x, head_rows, whole)
    }

    /// Reads back what [`GpuRank::head_device`] left: the summaries always (with their top lists where asked); the
    /// logits when `want_logits`; the final hidden rows when the plan asked; and draws `samples` (the last rows) on
    /// the device, from the head's whole rows when it wrote them (`whole`), else from whole rows of theirs computed
    /// here.
    pub(super) fn read_head(
        &mut self,
        rows: usize,
        head_rows: usize,
        whole: bool,
        want_logits: bool,
        samples: Option<&[SampleRow]>,
        spec: &[Option<SpecRequest>],
    ) -> Result<HeadOut> {
        let r = &self.inner;
        let (dev, hid, v) = (&*r.dev, r.config.hidden_size, r.vocab.len());
        let s = &mut self.scratch;
        let logits = if want_logits {
            Some(dev.download(&s.logits.slice(..head_rows * v))?)
        } else {
            None
        };
        // The final norm added the last block's output into `x`: it holds the final residual rows.
        let hidden = if self.want_hidden {
            Some(dev.download(&s.x.slice((rows - head_rows) * hid..rows * hid))?)
        } else {
            None
        };
        let flags: Vec<bool> = (0..head_rows)
            .map(|i| spec.get(i).is_some_and(Option::is_some))
            .collect();
        let passes = ops::decode_summaries(&dev.download(&s.head.out.slice(..head_rows * SUMMARY_WORDS))?, &flags);
        let mut summaries: Vec<RowSummary> = passes.into_iter().map(RowSummary::from).collect();
        let top = &s.head.top;
        if !top.asking.is_empty() {
            let words = dev.download(&top.out.slice(..top.asking.len() * TOPK_WORDS))?;
            let reqs: Vec<LogprobRequest> = top.asking.iter().map(|&(_, q)| q).collect();
            for (&(i, _), lp) in top.asking.iter().zip(ops::decode_topk(&words, &reqs)) {
                summaries[i].pass.logprob = Some(lp);
            }
        }
        if let Some(samples) = samples {
            let start = head_rows - samples.len();
            // Where the sampled rows' whole logits are: the head's rows, or (a head that wrote none) computed now
            // into the front of the scratch.
            let first = if whole {
                start
            } else {
                let head = r.lm_head.as_ref().unwrap_or(&r.embed);
                let x = s.h.slice((rows - samples.len()) * hid..rows * hid);
                let out = &mut s.logits.slice_mut(..samples.len() * v);
                A::gemm(dev, &r.blas, &x, &head.slice(..), out, samples.len(), hid, v)?;
                0
            };
            // Sampling rewrites the logits in place (the penalty), so it runs after the summaries.
            match s.whole_rows.as_mut() {
                // A tensor-parallel rank samples the rows joined from every rank's slice, as every rank does.
                Some(joined) => {
                    let comm = joining_comm(r.comm.as_deref(), self.info.rank, self.info.tp)?;
                    let vocab = r.config.vocab_size;
                    joined.sample_chunks(
                        dev,
                        comm,
                        &s.logits,
                        first,
                        samples.len(),
                        &mut s.argmax,
                        |dev, rows, at, ids| sample_on_device(dev, rows, vocab, &samples[at], ids),
                    )?;
                }
                None => sample_on_device(
                    dev,
                    &mut s.logits.slice_mut(first * v..(first + samples.len()) * v),
                    v,
                    samples,
                    &mut s.argmax.slice_mut(..samples.len()),
                )?,
            }
            let picked = dev.download(&s.argmax.slice(..samples.len()))?;
            for (row, id) in summaries[start..].iter_mut().zip(&picked) {
                mark_sampled(row, *id);
            }
            self.note_sampled_logits(rows, head_rows, &mut summaries[start..])?;
        }
        Ok(HeadOut {
            rows: summaries,
            logits,
            hidden,
        })
    }

    /// Records, in each sampled row of the last `sampled.len()` head rows that asked for log-probabilities, the raw logit of the token sampled from it (its log-probability target), as the CPU rank does. The
    /// sampler rewrote the logits, so the value comes from the row's top list when the token is in it, else from
    /// the head's product of that row with the token's weights. A token outside this rank's vocabulary slice is
    /// left to the rank that holds it (the merge takes whichever rank saw it).
    fn note_sampled_logits(&mut self, rows: usize, head_rows: usize, sampled: &mut [RowSummary]) -> Result<()> {
        let r = &self.inner;
        let (dev, hid, vocab) = (&*r.dev, r.config.hidden_size, r.vocab.clone());
        let first_row = rows - head_rows + (head_rows - sampled.len());
        let mut products = Vec::new();
        for (k, row) in sampled.iter_mut().enumerate() {
            let Some(id) = row.sampled.filter(|_| row.pass.logprob.is_some()) else {
                continue;
            };
            let known = row.pass.logit_of(id);
            let Some(lp) = row.pass.logprob.as_mut() else {
                continue;
            };
            match known {
                Some(v) => lp.target = Some((id, v)),
                None if vocab.contains(&(id as usize)) => products.push((k, id)),
                None => lp.target = None,
            }
        }
        if products.is_empty() {
            return Ok(());
        }
        let s = &mut self.scratch;
        let head = r.lm_head.as_ref().unwrap_or(&r.embed);
        for (j, &(k, id)) in products.iter().enumerate() {
            let local = id as usize - vocab.start;
            let x = s.h.slice((first_row + k) * hid..(first_row + k + 1) * hid);
            let w = head.slice(local * hid..(local + 1) * hid);
            A::gemm(dev, &r.blas, &x, &w, &mut s.logits.slice_mut(j..j + 1), 1, hid, 1)?;
        }
        let values = dev.download(&s.logits.slice(..products.len()))?;
        for (&(k, id), v) in products.iter().zip(values) {
            if let Some(lp) = sampled[k].pass.logprob.as_mut() {
                lp.target = Some((id, v));
            }
        }
        Ok(())
    }
}

/// The head over `head_rows` rows `x` (`[head_rows, hidden]`, already normed) into the head scratch `hs`: the GEMM
/// against the rank's slice of the LM head (whole rows into `logits_buf` when `whole`, else a chunk of the vocabulary
/// at a time) and the one-pass summaries, for the speculative and log-probability requests
/// [`GpuRank::prepare_head`] uploaded. The target's rows come through [`GpuRank::head_device`]; the MTP layer's
/// drafts come here directly (`gpu/mtp.rs`: its output norm is the head's input, with no final norm between).
pub(super) fn head_pass<A: Act>(
    r: &LoadedRank<A>,
    logits_buf: &mut CudaSlice<f32>,
    hs: &mut HeadScratch,
    x: &CudaView<'_, A>,
    head_rows: usize,
    whole: bool,
) -> Result<()> {
    let (dev, hid) = (&*r.dev, r.config.hidden_size);
    let (v, first_id) = (r.vocab.len(), r.vocab.start as u32);
    let spec_words = hs.spec.slice(..head_rows * SPEC_WORDS);
    let head = r.lm_head.as_ref().unwrap_or(&r.embed);
    let (total, parts) = (
        hs.max_parts,
        &mut hs.parts.slice_mut(..head_rows * hs.max_parts * SUMMARY_WORDS),
    );
    // The chunk width of the head pass, and of the top-list folds over whole rows: never more than the scratch
    // holds (a chunk never shrinks below one part: the scratch is sized for it).
    let chunk = chunk_ids(head_rows, v)
        .min((logits_buf.len() / head_rows) / PART_WIDTH * PART_WIDTH)
        .max(PART_WIDTH.min(v));
    let slots = 1 + ops::parts_for(chunk);
    let asks = !hs.top.asking.is_empty();
    let seen = if whole {
        // Whole rows: someone reads them. The summaries come from the same logits.
        let logits = &mut logits_buf.slice_mut(..head_rows * v);
        A::gemm(dev, &r.blas, x, &head.slice(..), logits, head_rows, hid, v)?;
        ops::head_summary_parts(dev, logits, v, head_rows, v, first_id, &spec_words, parts, total, 0)?;
        if asks {
            for lo in (0..v).step_by(chunk) {
                let len = chunk.min(v - lo);
                let cols = logits.slice(lo..);
                hs.top.fold_chunk(
                    dev,
                    &cols,
                    v,
                    head_rows,
                    len,
                    first_id + lo as u32,
                    slots,
                    lo == 0,
                    lo + len == v,
                )?;
            }
        }
        ops::parts_for(v)
    } else {
        let mut seen = 0;
        for lo in (0..v).step_by(chunk) {
            let len = chunk.min(v - lo);
            let logits = &mut logits_buf.slice_mut(..head_rows * len);
            let w = head.slice(lo * hid..(lo + len) * hid);
            A::gemm(dev, &r.blas, x, &w, logits, head_rows, hid, len)?;
            ops::head_summary_parts(
                dev,
                logits,
                len,
                head_rows,
                len,
                first_id + lo as u32,
                &spec_words,
                parts,
                total,
                seen,
            )?;
            if asks {
                hs.top.fold_chunk(
                    dev,
                    logits,
                    len,
                    head_rows,
                    len,
                    first_id + lo as u32,
                    slots,
                    lo == 0,
                    lo + len == v,
                )?;
            }
            seen += ops::parts_for(len);
        }
        seen
    };
    let out = &mut hs.out.slice_mut(..head_rows * SUMMARY_WORDS);
    ops::head_summary_merge(dev, parts, head_rows, total, seen, out)?;
    Ok(())
}

/// Records the sampler's pick `id` in `row`. The sampler gives −1 for a row holding a non-finite logit, which need
/// not be its max (what the summary shows): the row is then marked poisoned, so the step fails with the row's position
/// (`rank::finish`) instead of answering an id that does not exist.
pub(super) fn mark_sampled(row: &mut RowSummary, id: i32) {
    match u32::try_from(id) {
        Ok(id) => row.sampled = Some(id),
        Err(_) => row.pass.max = f32::NAN,
    }
}

/// `[rows, 4]` (temperature, top-k, top-p, min-p), as `ops::sample_rows` reads them.
pub(super) fn sample_params(rows: &[SampleRow]) -> Vec<f32> {
    rows.iter()
        .flat_map(|r| [r.temperature, r.top_k as f32, r.top_p, r.min_p])
        .collect()
}

/// The repetition penalty, the bias, the token mask and the draw for `rows` (whole rows of `vocab` logits) on the device; the ids land in
/// `ids` (one a row).
pub(super) fn sample_on_device(
    dev: &CudaDevice,
    logits: &mut rewind_kernels::cuda::CudaViewMut<'_, f32>,
    vocab: usize,
    rows: &[SampleRow],
    ids: &mut rewind_kernels::cuda::CudaViewMut<'_, i32>,
) -> Result<()> {
    let b = rows.len();
    if rows
        .iter()
        .any(|r| r.repetition_penalty != 1.0 && !r.history.is_empty())
    {
        let (mut rows_of, mut tokens, mut seen) = (Vec::new(), Vec::new(), Vec::new());
        for (i, r) in rows.iter().enumerate() {
            if r.repetition_penalty == 1.0 {
                continue;
            }
            crate::sample::distinct_ids(&r.history, &mut seen);
            for &t in &seen {
                rows_of.push(i as i32);
                tokens.push(t as i32);
            }
        }
        let penalty: Vec<f32> = rows.iter().map(|r| r.repetition_penalty).collect();
        let (rows_of, tokens, penalty) = (dev.upload(&rows_of)?, dev.upload(&tokens)?, dev.upload(&penalty)?);
        ops::repetition_penalty(dev, logits, vocab, &rows_of, &tokens, &penalty)?;
    }
    if rows.iter().any(|r| !r.bias.is_empty()) {
        let (mut rows_of, mut tokens, mut bias) = (Vec::new(), Vec::new(), Vec::new());
        for (i, r) in rows.iter().enumerate() {
            for &(t, b) in &r.bias {
                rows_of.push(i as i32);
                tokens.push(t as i32);
                bias.push(b);
            }
        }
        let (rows_of, tokens, bias) = (dev.upload(&rows_of)?, dev.upload(&tokens)?, dev.upload(&bias)?);
        ops::logit_bias(dev, logits, b, vocab, &rows_of, &tokens, &bias)?;
    }
    if rows.iter().any(|r| r.mask.is_some()) {
        // Constrained rows (structured outputs): their masks, back to back, and each row's place among them.
        let words = vocab.div_ceil(32);
        let (mut masks, mut mask_row) = (Vec::new(), Vec::with_capacity(b));
        for r in rows {
            match r.mask.as_deref() {
                Some(m) => {
                    mask_row.push((masks.len() / words) as i32);
                    masks.extend((0..words).map(|w| m.get(w).copied().unwrap_or(0)));
                }
                None => mask_row.push(-1),
            }
        }
        let (masks, mask_row) = (dev.upload(&masks)?, dev.upload(&mask_row)?);
        ops::token_mask(dev, logits, b, vocab, &masks, words, &mask_row)?;
    }
    let params = sample_params(rows);
    let uniforms: Vec<f32> = rows.iter().map(|r| r.uniform).collect();
    let (params, uniforms) = (dev.upload(&params)?, dev.upload(&uniforms)?);
    ops::sample_rows(dev, logits, b, vocab, &params, &uniforms, ids)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sampled_minus_one_poisons_the_row() {
        let mut row = RowSummary::from(rewind_kernels::cpu::lm_head::RowPass {
            argmax: 3,
            max: 1.5,
            lse: 2.0,
            spec: None,
            logprob: None,
        });
        mark_sampled(&mut row, 7);
        assert_eq!((row.sampled, row.pass.max), (Some(7), 1.5));
        let mut bad = RowSummary { sampled: None, ..row };
        mark_sampled(&mut bad, -1);
        assert_eq!(bad.sampled, None);
        assert!(bad.pass.poisoned(), "the step fails on this row");
    }

    #[test]
    fn chunks_are_bounded_whole_parts_and_cover_small_vocabularies() {
        for rows in [1, 5, 64, 256, 2048] {
            for v in [1000, 131_072, 248_320] {
                let c = chunk_ids(rows, v);
                assert!(c >= 1 && c <= v);
                assert!(c == v || c.is_multiple_of(PART_WIDTH), "{rows} {v} {c}");
                assert!(rows * c <= CHUNK_FLOATS || c == PART_WIDTH.min(v));
                // Every chunk but the last falls on a part boundary, so a row's parts fit max_parts.
                let parts: usize = (0..v).step_by(c).map(|lo| ops::parts_for(c.min(v - lo))).sum();
                assert!(parts <= max_parts(v), "{rows} {v}");
            }
        }
        assert_eq!(chunk_ids(1, 131_072), 131_072);
        // The scratch holds whole rows for prompt chunks / decodes and a chunk for every row of a verify of every slot.
        let step = StepRows::new(512, 256, 5);
        assert_eq!((step.rows, step.whole), (1280, 512));
        let len = logits_len(step, 131_072);
        assert!(len >= 512 * 131_072 && len >= 1280 * chunk_ids(1280, 131_072));
    }
}
