//! One tensor-parallel rank on one GPU behind the [`Rank`] interface: its weights, pools, books, slot counters and
//! scratch. The step's orchestration (commits, each sequence's form and flush, prompt chunks, the decode batch, the
//! verify batches) is `gpu/steps.rs`; this file holds the rank, its forward-and-head pass and the interface. The LM
//! head reports each row's best id and logit in the rank's vocabulary slice (and samples on the device when the rank
//! holds the whole vocabulary).

use rewind_kernels::cuda::ops;
use rewind_kernels::cuda::{CudaDevice, CudaSlice};
use tracing::info;

use super::forward::{self, Cx, Step};
use super::layers::GpuMixer;
use super::loaded::LoadedRank;
use super::scratch::{widths, Scratch, Widths};
use super::state::{alloc_pools, LayerPool, PoolSizes, ReplaySettings, BLOCK_SIZE};
use super::Act;
use crate::decode::FormChoice;
use crate::error::{EngineError, Result};
use crate::rank::{Books, Rank, RankHealth, RankInfo, RowSummary, SampleRow, SlotSnapshot, StepOut, StepPlan};
use crate::state::kv::NO_BLOCK;
use crate::state::SlotCounters;
use rewind_kernels::cuda::ops::ReplayRow;

impl<A: Act> LoadedRank<A> {
    /// Allocates the pools and scratch; the rank then serves steps.
    pub(crate) fn allocate(self, sizes: PoolSizes, rows: usize, replay: ReplaySettings) -> Result<GpuRank<A>> {
        let conv_window = self.conv_window()?;
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
            max_verify: replay.max_verify,
            max_batch: Some(rows),
            kv_blocks: if self.has_attention() { sizes.num_blocks } else { 0 },
            kv_block_size: BLOCK_SIZE,
            chunked_prefill: true,
            forms: FormChoice::ALL.to_vec(),
            snapshots: true,
            hidden_states: false,
            spec_summaries: false,
        };
        let books = Books::new(std::slice::from_ref(&info), self.config.vocab_size)?;
        let counters = SlotCounters::new(sizes.max_seqs, replay.buffer_len, conv_window, replay.max_verify)
            .with_kv_only_capacity(replay.threshold + replay.max_verify);
        debug_assert_eq!(counters.ring_rows(), sizes.rows.ring);
        Ok(GpuRank {
            books,
            info,
            sizes,
            pools,
            scratch,
            counters,
            replay,
            choice: vec![FormChoice::Auto; sizes.max_seqs],
            inner: self,
            table_dirty: true,
            steps: 0,
        })
    }

    /// `K − 1` of the SSM layers, which must agree: one conv head per slot serves every layer.
    fn conv_window(&self) -> Result<usize> {
        let mut ks = self.blocks.iter().filter_map(|b| match &b.mixer {
            GpuMixer::Mamba2(m) => Some(m.spec.conv_kernel),
            GpuMixer::Gdn(m) => Some(m.spec.conv_kernel),
            _ => None,
        });
        let first = ks.next().unwrap_or(1);
        if let Some(other) = ks.find(|&k| k != first) {
            return Err(EngineError::NotSupported(format!(
                "SSM layers with different conv widths ({first} and {other}) on the GPU rank"
            )));
        }
        Ok(first.saturating_sub(1))
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
    pub(super) scratch: Scratch<A>,
    /// Per slot: ring start, length and capacity, conv head, form and flush flag (`state/counters.rs`).
    pub(super) counters: SlotCounters,
    pub(super) replay: ReplaySettings,
    /// Per slot: the form its sequence asked for.
    pub(super) choice: Vec<FormChoice>,
    /// The block tables changed since they were last uploaded.
    pub(super) table_dirty: bool,
    pub(super) steps: u64,
}

/// What the LM head hands back for a step's reported rows.
pub(super) struct HeadOut {
    pub(super) rows: Vec<RowSummary>,
    pub(super) logits: Option<Vec<f32>>,
}

/// Copies `data` into the front of `buf`.
pub(super) fn put(dev: &CudaDevice, buf: &mut CudaSlice<i32>, data: &[i32], what: &str) -> Result<()> {
    dev.stream()
        .memcpy_htod(data, &mut buf.slice_mut(..data.len()))
        .map_err(|e| EngineError::Gpu(format!("uploading {what}: {e}")))
}

pub(super) fn to_i32(v: impl IntoIterator<Item = usize>) -> Vec<i32> {
    v.into_iter().map(|x| x as i32).collect()
}

impl<A: Act> GpuRank<A> {
    /// Zeroes a new sequence's conv and SSM state (a fresh sequence starts from zero state).
    pub(super) fn clear_slot(&mut self, slot: usize) -> Result<()> {
        let n = self.sizes.max_seqs;
        for pool in &mut self.pools {
            if let LayerPool::Ssm { conv, ssm, .. } = pool {
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
    pub(super) fn lens(&self, over: Option<(usize, usize)>) -> Vec<i32> {
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

    /// Uploads the step's per-row metadata, its replay rows, the lengths and (when they changed) the block tables.
    pub(super) fn upload_step(
        &mut self,
        tokens: &[i32],
        row_slots: &[i32],
        row_pos: &[i32],
        seq_slots: &[i32],
        lens: &[i32],
        replay_rows: &[ReplayRow],
    ) -> Result<()> {
        let (dev, s) = (&*self.inner.dev, &mut self.scratch);
        put(dev, &mut s.meta, &ReplayRow::encode_all(replay_rows), "replay rows")?;
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
    pub(super) fn run(
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
                spec: None,
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
}

impl<A: Act> Rank for GpuRank<A> {
    fn info(&self) -> RankInfo {
        self.info.clone()
    }

    fn step(&mut self, plan: &StepPlan) -> Result<StepOut> {
        self.run_plan(plan)
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
pub(super) fn sample_on_device(
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
