//! One tensor-parallel rank on one GPU behind the [`Rank`] interface: its weights, pools, books and scratch. A step
//! runs its prompt chunks one sequence at a time (in chunks of the scratch's rows) and its decodes as one batch; the
//! LM head reports each row's best id and logit in the rank's vocabulary slice (and samples on the device when the
//! rank holds the whole vocabulary).

use rewind_kernels::cuda::ops;
use rewind_kernels::cuda::{CudaDevice, CudaSlice};
use tracing::{debug_span, info};

use super::forward::{self, Cx, PrefillOf, Step};
use super::loaded::LoadedRank;
use super::scratch::{widths, Scratch, Widths};
use super::state::{alloc_pools, LayerPool, PoolSizes, BLOCK_SIZE};
use super::Act;
use crate::decode::FormChoice;
use crate::error::{EngineError, Result};
use crate::rank::{
    Books, Rank, RankHealth, RankInfo, RowSummary, Rows, SampleRow, SeqKind, SeqStep, SlotSnapshot, StepOut, StepPlan,
};
use crate::state::kv::NO_BLOCK;

impl<A: Act> LoadedRank<A> {
    /// Allocates the pools and scratch; the rank then serves steps.
    pub(crate) fn allocate(self, sizes: PoolSizes, rows: usize) -> Result<GpuRank<A>> {
        let hidden = self.config.hidden_size;
        let w: Widths = widths(&self.blocks, hidden, rows);
        let pools = alloc_pools(&self.dev, &self.blocks, sizes)?;
        let scratch = Scratch::new(&self.dev, &w, rows, hidden, self.vocab.len(), sizes)?;
        self.dev.synchronize()?;
        info!(
            gpu = self.dev.ordinal(),
            max_seqs = sizes.max_seqs,
            kv_blocks = sizes.num_blocks,
            rows,
            "GPU pools allocated"
        );
        let info = RankInfo {
            rank: self.rank,
            tp: self.tp,
            device: self.dev.name().to_string(),
            vocab: self.vocab.clone(),
            slots: sizes.max_seqs,
            max_context: sizes.max_len,
            max_verify: 0,
            max_batch: Some(rows),
            kv_blocks: if self.has_attention() { sizes.num_blocks } else { 0 },
            kv_block_size: BLOCK_SIZE,
            chunked_prefill: true,
            forms: vec![FormChoice::Recurrent],
            snapshots: true,
        };
        let books = Books::new(std::slice::from_ref(&info), self.config.vocab_size)?;
        Ok(GpuRank {
            books,
            info,
            sizes,
            pools,
            scratch,
            inner: self,
            table_dirty: true,
            steps: 0,
        })
    }
}

/// A rank ready to run steps: its weights, pools, scratch and its copy of the books (for the block tables and
/// lengths the kernels read).
pub(crate) struct GpuRank<A: Act> {
    pub(super) inner: LoadedRank<A>,
    pub(super) pools: Vec<LayerPool<A>>,
    pub(super) books: Books,
    pub(super) info: RankInfo,
    pub(super) sizes: PoolSizes,
    scratch: Scratch<A>,
    /// The block tables changed since they were last uploaded.
    pub(super) table_dirty: bool,
    steps: u64,
}

/// What the LM head hands back for a step's reported rows.
struct HeadOut {
    rows: Vec<RowSummary>,
    logits: Option<Vec<f32>>,
}

/// Copies `data` into the front of `buf`.
fn put(dev: &CudaDevice, buf: &mut CudaSlice<i32>, data: &[i32], what: &str) -> Result<()> {
    dev.stream()
        .memcpy_htod(data, &mut buf.slice_mut(..data.len()))
        .map_err(|e| EngineError::Gpu(format!("uploading {what}: {e}")))
}

fn to_i32(v: impl IntoIterator<Item = usize>) -> Vec<i32> {
    v.into_iter().map(|x| x as i32).collect()
}

fn not_supported(what: &str) -> EngineError {
    EngineError::NotSupported(format!(
        "{what} on the GPU rank (the GPU replay and speculation kernels come next)"
    ))
}

impl<A: Act> GpuRank<A> {
    /// Zeroes a new sequence's conv and SSM state (a fresh sequence starts from zero state).
    fn clear_slot(&mut self, slot: usize) -> Result<()> {
        let n = self.sizes.max_seqs;
        for pool in &mut self.pools {
            if let LayerPool::Ssm { conv, ssm } = pool {
                let (cl, sl) = (conv.len() / n, ssm.len() / n);
                let stream = self.inner.dev.stream().clone();
                stream
                    .memset_zeros(&mut conv.slice_mut(slot * cl..(slot + 1) * cl))
                    .map_err(|e| EngineError::Gpu(format!("clearing a conv state: {e}")))?;
                stream
                    .memset_zeros(&mut ssm.slice_mut(slot * sl..(slot + 1) * sl))
                    .map_err(|e| EngineError::Gpu(format!("clearing an SSM state: {e}")))?;
            }
        }
        Ok(())
    }

    /// Every slot's length as the kernels read it, with `over` = `(slot, length)` replacing one (a prompt chunk
    /// sees its own end, not the whole prompt's).
    fn lens(&self, over: Option<(usize, usize)>) -> Vec<i32> {
        (0..self.sizes.max_seqs)
            .map(|s| match over {
                Some((slot, len)) if slot == s => len as i32,
                _ => self
                    .books
                    .len(s)
                    .map_or(0, |l| (l + self.books.pending(s).unwrap_or(0)) as i32),
            })
            .collect()
    }

    /// Uploads the step's per-row metadata, the lengths and (when they changed) the block tables.
    fn upload_step(
        &mut self,
        tokens: &[i32],
        row_slots: &[i32],
        row_pos: &[i32],
        seq_slots: &[i32],
        lens: &[i32],
    ) -> Result<()> {
        let (dev, s) = (&*self.inner.dev, &mut self.scratch);
        put(dev, &mut s.tokens, tokens, "tokens")?;
        put(dev, &mut s.row_slots, row_slots, "row slots")?;
        put(dev, &mut s.row_pos, row_pos, "positions")?;
        put(dev, &mut s.seq_slots, seq_slots, "sequence slots")?;
        if self.table_dirty {
            let per = self.sizes.blocks_per_seq();
            let table: Vec<i32> = match self.books.kv() {
                Some(kv) => kv
                    .tables()
                    .iter()
                    .map(|&b| if b == NO_BLOCK { -1 } else { b as i32 })
                    .collect(),
                None => vec![-1; self.sizes.max_seqs * per],
            };
            put(dev, &mut s.table, &table, "block tables")?;
            self.table_dirty = false;
        }
        put(dev, &mut s.lens, lens, "lengths")
    }

    /// Embedding and blocks for a step whose metadata is uploaded; then, when `head_rows > 0`, the final norm and the
    /// LM head over the last `head_rows` rows, reported as `want_logits` and `samples` ask.
    fn run(
        &mut self,
        step: Step,
        head_rows: usize,
        want_logits: bool,
        samples: Option<&[SampleRow]>,
    ) -> Result<HeadOut> {
        let r = &mut self.inner;
        let (dev, hid, rows) = (&*r.dev, r.config.hidden_size, step.rows);
        let s = &mut self.scratch;
        ops::embed_rows_f32(
            dev,
            &r.embed,
            &s.tokens.slice(..rows),
            hid,
            r.vocab.start,
            &mut s.x.slice_mut(..rows * hid),
        )?;
        if let Some(c) = &r.comm {
            c.all_reduce_f32(&mut s.x.slice_mut(..rows * hid))?;
        }
        let mut cx = Cx {
            dev,
            blas: &r.blas,
            s,
            comm: r.comm.as_deref(),
            hidden: hid,
            max_seqs: self.sizes.max_seqs,
            eps: r.config.norm_eps,
            offset: r.config.norm_offset,
        };
        forward::blocks(&mut cx, &r.blocks, &mut self.pools, step)?;
        if head_rows == 0 {
            return Ok(HeadOut {
                rows: Vec::new(),
                logits: want_logits.then(Vec::new),
            });
        }
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
        let v = r.vocab.len();
        let head = r.lm_head.as_ref().unwrap_or(&r.embed);
        let first = rows - head_rows;
        A::gemm(
            &r.blas,
            &s.h.slice(first * hid..rows * hid),
            head,
            &mut s.logits.slice_mut(..head_rows * v),
            head_rows,
            hid,
            v,
        )?;
        let logits = if want_logits {
            Some(dev.download(&s.logits.slice(..head_rows * v))?)
        } else {
            None
        };
        // Each row's best id in the rank's slice (−1 for a row holding NaN). A single rank's greedy pick needs only
        // the id; under tensor parallelism the coordinator compares the ranks' best logits, read from the device.
        let mut out = s.argmax.slice_mut(..head_rows);
        ops::argmax_rows(dev, &s.logits.slice(..head_rows * v), head_rows, &mut out)?;
        let ids = dev.download(&s.argmax.slice(..head_rows))?;
        let vals = if r.comm.is_some() {
            let at: Vec<i32> = ids
                .iter()
                .enumerate()
                .map(|(row, &id)| (row * v) as i32 + id.max(0))
                .collect();
            dev.stream()
                .memcpy_htod(&at, &mut s.best_at.slice_mut(..head_rows))
                .map_err(|e| EngineError::Gpu(format!("uploading argmax indices: {e}")))?;
            let mut vals = s.best_val.slice_mut(..head_rows);
            ops::gather_cols(
                dev,
                &s.logits.slice(..head_rows * v),
                1,
                head_rows * v,
                &s.best_at.slice(..head_rows),
                &mut vals,
            )?;
            Some(dev.download(&s.best_val.slice(..head_rows))?)
        } else {
            None
        };
        let mut summaries: Vec<RowSummary> = ids
            .iter()
            .enumerate()
            .map(|(row, &id)| RowSummary {
                argmax: (id.max(0) as usize + r.vocab.start) as u32,
                max_logit: if id < 0 {
                    Some(f32::NAN)
                } else {
                    vals.as_ref().map(|v| v[row])
                },
                log_sum_exp: None,
                sampled: None,
            })
            .collect();
        if let Some(samples) = samples {
            // Sampling rewrites the logits in place (the penalty), so it runs after the summaries.
            let start = head_rows - samples.len();
            sample_on_device(
                dev,
                &mut s.logits.slice_mut(start * v..head_rows * v),
                v,
                samples,
                &mut s.argmax,
            )?;
            let picked = dev.download(&s.argmax.slice(..samples.len()))?;
            for (row, id) in summaries[start..].iter_mut().zip(picked) {
                row.sampled = Some(id as u32);
            }
        }
        Ok(HeadOut {
            rows: summaries,
            logits,
        })
    }

    /// A prompt chunk sequence: its tokens in chunks of the scratch's rows; reports its rows as `seq.rows` asks.
    fn prefill(&mut self, seq: &SeqStep, want_logits: bool) -> Result<HeadOut> {
        let _span = debug_span!("gpu_prefill", slot = seq.slot, tokens = seq.tokens.len()).entered();
        let slot = seq.slot;
        // The reference clamps `dt` on its multi-token path: prompt steps of more than one token (as the CPU does).
        let clamp = seq.tokens.len() > 1;
        let chunk = self.scratch.rows;
        let n_chunks = seq.tokens.len().div_ceil(chunk);
        let mut out = HeadOut {
            rows: Vec::new(),
            logits: want_logits.then(Vec::new),
        };
        for (ci, part) in seq.tokens.chunks(chunk).enumerate() {
            let t = part.len();
            let pos = seq.position + ci * chunk;
            let lens = self.lens(Some((slot, pos + t)));
            self.upload_step(
                &to_i32(part.iter().map(|&x| x as usize)),
                &vec![slot as i32; t],
                &to_i32(pos..pos + t),
                &[slot as i32],
                &lens,
            )?;
            let step = Step {
                rows: t,
                seqs: 1,
                t,
                prefill: Some(PrefillOf { slot, clamp }),
            };
            let last = ci + 1 == n_chunks;
            let head_rows = match seq.rows {
                Rows::All => t,
                Rows::Last if last => 1,
                Rows::Last | Rows::None => 0,
            };
            let sample = if last {
                seq.sample.as_ref().map(std::slice::from_ref)
            } else {
                None
            };
            let h = self.run(step, head_rows, want_logits, sample)?;
            out.rows.extend(h.rows);
            if let (Some(all), Some(l)) = (&mut out.logits, h.logits) {
                all.extend(l);
            }
        }
        Ok(out)
    }

    /// One decode step over `seqs` (distinct slots, one token each).
    fn decode(&mut self, seqs: &[&SeqStep], want_logits: bool) -> Result<HeadOut> {
        let _span = debug_span!("gpu_decode", batch = seqs.len()).entered();
        let b = seqs.len();
        let slots = to_i32(seqs.iter().map(|s| s.slot));
        let lens = self.lens(None);
        self.upload_step(
            &to_i32(seqs.iter().map(|s| s.tokens[0] as usize)),
            &slots,
            &to_i32(seqs.iter().map(|s| s.position)),
            &slots,
            &lens,
        )?;
        let step = Step {
            rows: b,
            seqs: b,
            t: 1,
            prefill: None,
        };
        let samples: Option<Vec<SampleRow>> = seqs.iter().any(|s| s.sample.is_some()).then(|| {
            // Rows that did not ask to sample take the greedy pick (temperature 0 is the argmax).
            seqs.iter()
                .map(|s| {
                    s.sample.clone().unwrap_or(SampleRow {
                        temperature: 0.0,
                        top_k: 0,
                        top_p: 1.0,
                        min_p: 0.0,
                        repetition_penalty: 1.0,
                        history: Vec::new(),
                        uniform: 0.0,
                    })
                })
                .collect()
        });
        let mut out = self.run(step, b, want_logits, samples.as_deref())?;
        for (row, s) in out.rows.iter_mut().zip(seqs) {
            if s.sample.is_none() || s.rows == Rows::None {
                row.sampled = None;
            }
        }
        Ok(out)
    }
}

impl<A: Act> Rank for GpuRank<A> {
    fn info(&self) -> RankInfo {
        self.info.clone()
    }

    fn step(&mut self, plan: &StepPlan) -> Result<StepOut> {
        if !plan.commits.is_empty() || plan.seqs.iter().any(|s| s.kind == SeqKind::Verify) {
            return Err(not_supported("speculative verification"));
        }
        if plan.seqs.iter().any(|s| s.sample.is_some()) && self.info.tp > 1 {
            return Err(EngineError::InvalidInput(
                "a tensor-parallel rank holds a slice of the vocabulary and cannot sample".into(),
            ));
        }
        // Slots the coordinator opened since the last step: the rank's books take them too.
        let mut claimed = Vec::new();
        for s in &plan.seqs {
            if s.position == 0 && !self.books.started(s.slot) && self.books.len(s.slot).is_err() {
                if let Err(e) = self.books.open_at(s.slot, s.form) {
                    for c in claimed {
                        self.books.close(c)?;
                    }
                    return Err(e);
                }
                claimed.push(s.slot);
            }
        }
        if let Err(e) = self.books.validate(plan) {
            for c in claimed {
                self.books.close(c)?;
            }
            return Err(e);
        }
        for &c in &claimed {
            self.clear_slot(c)?;
        }
        let held =
            |b: &Books| -> Vec<usize> { plan.seqs.iter().map(|s| b.kv().map_or(0, |k| k.held(s.slot))).collect() };
        let before = held(&self.books);
        self.books.apply(plan)?;
        self.table_dirty |= held(&self.books) != before;
        self.steps += 1;
        let _span = debug_span!("gpu_rank_step", seqs = plan.seqs.len()).entered();
        // Prompt chunks one sequence at a time, then every decode as one batch; rows go back in plan order.
        let mut per_seq: Vec<Option<HeadOut>> = plan.seqs.iter().map(|_| None).collect();
        for (i, s) in plan.seqs.iter().enumerate() {
            if s.kind == SeqKind::Prefill {
                per_seq[i] = Some(self.prefill(s, plan.full_logits)?);
            }
        }
        let decodes: Vec<(usize, &SeqStep)> = plan
            .seqs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.kind == SeqKind::Decode)
            .collect();
        if !decodes.is_empty() {
            let batch: Vec<&SeqStep> = decodes.iter().map(|(_, s)| *s).collect();
            let out = self.decode(&batch, plan.full_logits)?;
            let v = self.info.vocab.len();
            for (k, (i, s)) in decodes.iter().enumerate() {
                let keep = s.row_count() > 0;
                per_seq[*i] = Some(HeadOut {
                    rows: if keep { vec![out.rows[k]] } else { Vec::new() },
                    logits: out.logits.as_ref().map(|l| {
                        if keep {
                            l[k * v..(k + 1) * v].to_vec()
                        } else {
                            Vec::new()
                        }
                    }),
                });
            }
        }
        let mut rows = Vec::with_capacity(plan.row_count());
        let mut logits = plan.full_logits.then(Vec::new);
        for h in per_seq.into_iter().flatten() {
            rows.extend(h.rows);
            if let (Some(all), Some(l)) = (&mut logits, h.logits) {
                all.extend(l);
            }
        }
        Ok(StepOut {
            vocab: self.info.vocab.clone(),
            rows,
            logits,
        })
    }

    fn release(&mut self, slot: usize) -> Result<()> {
        let held = self.books.kv().map_or(0, |k| k.held(slot));
        self.books.close(slot)?;
        self.table_dirty |= held > 0;
        Ok(())
    }

    fn snapshot(&mut self, slot: usize) -> Result<SlotSnapshot> {
        self.snapshot_slot(slot)
    }

    fn restore(&mut self, slot: usize, snapshot: &SlotSnapshot) -> Result<()> {
        self.restore_slot(slot, snapshot)
    }

    fn health(&mut self) -> Result<RankHealth> {
        // A device that has failed reports it here rather than at the next step.
        self.inner.dev.synchronize()?;
        Ok(RankHealth {
            rank: self.info.rank,
            tp: self.info.tp,
            device: self.info.device.clone(),
            slots_in_use: self.books.slots_in_use(),
            steps: self.steps,
        })
    }

    fn synchronize(&mut self) -> Result<()> {
        Ok(self.inner.dev.synchronize()?)
    }
}

/// The repetition penalty and the draw for `rows` on the device; the ids land in `ids`.
fn sample_on_device(
    dev: &CudaDevice,
    logits: &mut rewind_kernels::cuda::CudaViewMut<'_, f32>,
    vocab: usize,
    rows: &[SampleRow],
    ids: &mut CudaSlice<i32>,
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
    let params: Vec<f32> = rows
        .iter()
        .flat_map(|r| [r.temperature, r.top_k as f32, r.top_p, r.min_p])
        .collect();
    let uniforms: Vec<f32> = rows.iter().map(|r| r.uniform).collect();
    let (params, uniforms) = (dev.upload(&params)?, dev.upload(&uniforms)?);
    let mut out = ids.slice_mut(..b);
    ops::sample_rows(dev, logits, b, vocab, &params, &uniforms, &mut out)?;
    Ok(())
}
