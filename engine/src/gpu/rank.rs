//! One tensor-parallel rank on one GPU: its weights, pools, books and scratch, and the two steps the coordinator asks
//! for — a prompt (in chunks of the scratch's rows) and a decode step over a batch of sequences.

use std::ops::Range;
use std::sync::Arc;

use rewind_kernels::cuda::ops;
use rewind_kernels::cuda::{Blas, CudaDevice, CudaSlice};
use tracing::{debug_span, info};

use super::forward::{self, Cx, PrefillOf, Step};
use super::layers::{GpuBlock, GpuMixer};
use super::scratch::{widths, Scratch, Widths};
use super::state::{alloc_pools, state_bytes, Books, LayerPool, PoolSizes};
use super::weights::stored;
use super::{Act, DeviceComm};
use crate::error::{EngineError, Result};
use crate::model::config::ModelConfig;
use crate::model::hybrid::Logits;
use crate::shard::ShardedModel;

const GIB: f64 = (1u64 << 30) as f64;

/// A rank whose weights are on the device, before its pools are sized.
pub(crate) struct LoadedRank<A: Act> {
    dev: Arc<CudaDevice>,
    blas: Blas,
    comm: Option<Box<dyn DeviceComm>>,
    config: ModelConfig,
    vocab: Range<usize>,
    embed: CudaSlice<A>,
    lm_head: Option<CudaSlice<A>>,
    final_norm: CudaSlice<A>,
    blocks: Vec<GpuBlock<A>>,
    weight_bytes: usize,
}

/// What a rank can hold, reported before the pools are allocated (ranks then agree on the smallest).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Capacity {
    /// KV blocks that fit in the budget after weights, scratch and SSM state.
    pub(crate) kv_blocks: usize,
    pub(crate) weight_bytes: usize,
    pub(crate) state_bytes: usize,
    pub(crate) scratch_bytes: usize,
    pub(crate) total_bytes: usize,
}

impl<A: Act> LoadedRank<A> {
    /// Loads rank `rank` of `tp` from the checkpoint in `dir` onto `dev`.
    pub(crate) fn load(
        dev: Arc<CudaDevice>,
        comm: Option<Box<dyn DeviceComm>>,
        dir: &std::path::Path,
        tp: usize,
        rank: usize,
    ) -> Result<Self> {
        let _span = debug_span!("gpu_load", rank, tp).entered();
        let blas = Blas::new(&dev)?;
        let config = crate::model::ModelConfig::from_dir(dir)?;
        let mut src = crate::checkpoint::SafetensorsSource::open(dir)?;
        let mut blocks = Vec::with_capacity(config.num_blocks());
        // Each block is uploaded and dropped as soon as it is read: host memory holds one block at a time.
        let parts = ShardedModel::load_streaming(config, tp, rank, &mut src, |b| {
            blocks.push(GpuBlock::upload(&dev, &b.norm, &b.mixer, &b.shard)?);
            Ok(())
        })?;
        let embed = stored(&dev, &parts.embed)?;
        let lm_head = parts.lm_head.as_deref().map(|h| stored(&dev, h)).transpose()?;
        let final_norm = super::weights::act_of(&dev, &parts.final_norm)?;
        dev.synchronize()?;
        let (free, total) = dev.memory()?;
        Ok(LoadedRank {
            dev,
            blas,
            comm,
            vocab: parts.plan.vocab.clone(),
            config: parts.config,
            embed,
            lm_head,
            final_norm,
            blocks,
            weight_bytes: total - free,
        })
    }

    fn has_attention(&self) -> bool {
        self.blocks.iter().any(|b| matches!(b.mixer, GpuMixer::Attention(_)))
    }

    /// The KV blocks that fit in `fraction` of the device's memory with `max_seqs` sequences of up to `max_len`
    /// tokens and steps of `rows` tokens; a clear error with the numbers when not even one full-length sequence fits.
    pub(crate) fn capacity(&self, fraction: f64, max_seqs: usize, max_len: usize, rows: usize) -> Result<Capacity> {
        let (free, total) = self.dev.memory()?;
        let used = total - free;
        let hidden = self.config.hidden_size;
        let probe = PoolSizes {
            max_seqs,
            max_len,
            num_blocks: 0,
        };
        let w = widths(&self.blocks, hidden, rows);
        let scratch = Scratch::<A>::bytes(&w, rows, hidden, self.vocab.len(), probe);
        let (per_seq, per_block) = state_bytes(&self.blocks);
        let ssm = per_seq * max_seqs;
        let budget = (fraction * total as f64) as usize;
        let fixed = used + scratch + ssm;
        let one_seq_blocks = if self.has_attention() {
            probe.blocks_per_seq()
        } else {
            0
        };
        let kv_min = one_seq_blocks * per_block;
        if fixed + kv_min > budget {
            return Err(EngineError::Gpu(format!(
                "the model does not fit on GPU {}: weights and runtime {:.2} GiB + activations {:.2} GiB + SSM state for \
                 {max_seqs} sequences {:.2} GiB + KV cache for one {max_len}-token sequence {:.2} GiB = {:.2} GiB exceed \
                 --gpu-memory-fraction {fraction} × {:.2} GiB = {:.2} GiB (lower --max-seqs or --max-model-len, raise \
                 the fraction, or use more GPUs with --tp)",
                self.dev.ordinal(),
                used as f64 / GIB,
                scratch as f64 / GIB,
                ssm as f64 / GIB,
                kv_min as f64 / GIB,
                (fixed + kv_min) as f64 / GIB,
                total as f64 / GIB,
                budget as f64 / GIB
            )));
        }
        let kv_blocks = match per_block {
            0 => 0,
            b => ((budget - fixed) / b).min(max_seqs * probe.blocks_per_seq()),
        };
        Ok(Capacity {
            kv_blocks,
            weight_bytes: self.weight_bytes,
            state_bytes: ssm + kv_blocks * per_block,
            scratch_bytes: scratch,
            total_bytes: total,
        })
    }

    /// Allocates the pools and scratch.
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
        Ok(GpuRank {
            books: Books::new(sizes)?,
            pools,
            scratch,
            inner: self,
        })
    }
}

/// A rank ready to run steps.
pub(crate) struct GpuRank<A: Act> {
    inner: LoadedRank<A>,
    pools: Vec<LayerPool<A>>,
    books: Books,
    scratch: Scratch<A>,
}

/// One row's sampling on the device: the engine Sampler's filters (see `rewind_kernels::cpu::sample::sample_row`),
/// the repetition penalty over `history`, and the draw `uniform`.
#[derive(Clone, Debug)]
pub struct SampleRow {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    /// The context the penalty applies to (ignored when the penalty is 1).
    pub history: Vec<u32>,
    /// Uniform in `[0, 1)`.
    pub uniform: f32,
}

/// What the step hands back.
#[derive(Clone, Debug)]
pub(crate) enum Pick {
    /// The logits.
    Logits,
    /// The greedy token per row, on the device.
    Argmax,
    /// A sampled token per row, on the device.
    Sample(Vec<SampleRow>),
}

/// What a step returns.
pub(crate) enum StepOut {
    /// The rank's logits, `[rows, vocab slice]`.
    Logits(Vec<f32>),
    /// The chosen token per row (single rank only).
    Ids(Vec<u32>),
    /// A tensor-parallel rank's best vocabulary id (global, −1 for a row with NaN) and its logit, per row.
    Best(Vec<i64>, Vec<f32>),
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

impl<A: Act> GpuRank<A> {
    pub(crate) fn open(&mut self) -> Result<usize> {
        let slot = self.books.open()?;
        // A fresh sequence starts from zero conv and SSM state.
        for pool in &mut self.pools {
            if let LayerPool::Ssm { conv, ssm } = pool {
                let (cl, sl) = (
                    conv.len() / self.books.sizes.max_seqs,
                    ssm.len() / self.books.sizes.max_seqs,
                );
                let stream = self.inner.dev.stream().clone();
                stream
                    .memset_zeros(&mut conv.slice_mut(slot * cl..(slot + 1) * cl))
                    .map_err(|e| EngineError::Gpu(format!("clearing a conv state: {e}")))?;
                stream
                    .memset_zeros(&mut ssm.slice_mut(slot * sl..(slot + 1) * sl))
                    .map_err(|e| EngineError::Gpu(format!("clearing an SSM state: {e}")))?;
            }
        }
        Ok(slot)
    }

    pub(crate) fn close(&mut self, slot: usize) -> Result<()> {
        self.books.close(slot)
    }

    /// Uploads the step's per-row metadata and the books (the block tables only when they changed).
    fn upload_step(&mut self, tokens: &[i32], row_slots: &[i32], row_pos: &[i32], seq_slots: &[i32]) -> Result<()> {
        let (dev, s) = (&*self.inner.dev, &mut self.scratch);
        put(dev, &mut s.tokens, tokens, "tokens")?;
        put(dev, &mut s.row_slots, row_slots, "row slots")?;
        put(dev, &mut s.row_pos, row_pos, "positions")?;
        put(dev, &mut s.seq_slots, seq_slots, "sequence slots")?;
        if self.books.table_dirty {
            put(dev, &mut s.table, &self.books.table_i32(), "block tables")?;
            self.books.table_dirty = false;
        }
        put(dev, &mut s.lens, &self.books.lens, "lengths")
    }

    /// Embedding, blocks, final norm and LM head for a step whose metadata is uploaded; the head runs on the last
    /// `head_rows` rows.
    fn run(&mut self, step: Step, head_rows: usize, pick: &Pick) -> Result<Option<StepOut>> {
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
            max_seqs: self.books.sizes.max_seqs,
            eps: r.config.norm_eps,
            offset: r.config.norm_offset,
        };
        forward::blocks(&mut cx, &r.blocks, &mut self.pools, step)?;
        if head_rows == 0 {
            return Ok(None);
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
        match pick {
            Pick::Logits => Ok(Some(StepOut::Logits(dev.download(&s.logits.slice(..head_rows * v))?))),
            Pick::Argmax => {
                let mut out = s.argmax.slice_mut(..head_rows);
                ops::argmax_rows(dev, &s.logits.slice(..head_rows * v), head_rows, &mut out)?;
                let ids = dev.download(&s.argmax.slice(..head_rows))?;
                if r.comm.is_none() {
                    return Ok(Some(StepOut::Ids(ids.into_iter().map(|i| i as u32).collect())));
                }
                // A tensor-parallel rank reports its slice's best (id, logit) per row; the coordinator picks across
                // ranks. A row with NaN keeps id −1.
                let idx: Vec<i32> = ids
                    .iter()
                    .enumerate()
                    .map(|(row, &id)| (row * v) as i32 + id.max(0))
                    .collect();
                let idx = dev.upload(&idx)?;
                let mut vals = dev.alloc_zeros::<f32>(head_rows)?;
                ops::gather_cols(dev, &s.logits.slice(..head_rows * v), 1, head_rows * v, &idx, &mut vals)?;
                let vals = dev.download(&vals)?;
                let start = r.vocab.start as i64;
                let ids = ids.iter().map(|&i| if i < 0 { -1 } else { i as i64 + start }).collect();
                Ok(Some(StepOut::Best(ids, vals)))
            }
            Pick::Sample(rows) => {
                sample_on_device(dev, &mut s.logits.slice_mut(..head_rows * v), v, rows, &mut s.argmax)?;
                let ids = dev.download(&s.argmax.slice(..head_rows))?;
                Ok(Some(StepOut::Ids(ids.into_iter().map(|i| i as u32).collect())))
            }
        }
    }

    /// Runs a prompt for `slot` in chunks; returns the rank's logits for every token (`Logits::All`) or the last.
    pub(crate) fn prefill(&mut self, slot: usize, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        let _span = debug_span!("gpu_prefill", slot, tokens = tokens.len()).entered();
        self.books
            .check_growth(&[(slot, tokens.len())], self.inner.has_attention())?;
        let clamp = tokens.len() > 1;
        let chunk = self.scratch.rows;
        let with_kv = self.inner.has_attention();
        let mut out = Vec::new();
        let n_chunks = tokens.len().div_ceil(chunk);
        for (ci, part) in tokens.chunks(chunk).enumerate() {
            let t = part.len();
            let pos = self.books.lens[slot] as usize;
            self.books.grow(slot, t, with_kv)?;
            self.upload_step(
                &to_i32(part.iter().map(|&x| x as usize)),
                &vec![slot as i32; t],
                &to_i32(pos..pos + t),
                &[slot as i32],
            )?;
            let step = Step {
                rows: t,
                seqs: 1,
                t,
                prefill: Some(PrefillOf { slot, clamp }),
            };
            let head_rows = match which {
                Logits::All => t,
                Logits::Last if ci + 1 == n_chunks => 1,
                Logits::Last => 0,
            };
            if let Some(StepOut::Logits(l)) = self.run(step, head_rows, &Pick::Logits)? {
                out.extend(l);
            }
        }
        Ok(out)
    }

    /// One decode step: token `rows[i].1` appended to sequence `rows[i].0`, distinct sequences.
    pub(crate) fn decode(&mut self, rows: &[(usize, u32)], pick: &Pick) -> Result<StepOut> {
        let _span = debug_span!("gpu_decode", batch = rows.len()).entered();
        let b = rows.len();
        let with_kv = self.inner.has_attention();
        let growth: Vec<(usize, usize)> = rows.iter().map(|&(s, _)| (s, 1)).collect();
        self.books.check_growth(&growth, with_kv)?;
        let positions: Vec<usize> = rows.iter().map(|&(s, _)| self.books.lens[s] as usize).collect();
        for &(slot, _) in rows {
            self.books.grow(slot, 1, with_kv)?;
        }
        let slots = to_i32(rows.iter().map(|&(s, _)| s));
        self.upload_step(
            &to_i32(rows.iter().map(|&(_, t)| t as usize)),
            &slots,
            &to_i32(positions),
            &slots,
        )?;
        let step = Step {
            rows: b,
            seqs: b,
            t: 1,
            prefill: None,
        };
        self.run(step, b, pick)?
            .ok_or_else(|| EngineError::Gpu("a decode step produced no logits".into()))
    }

    /// The device (for synchronisation and timing).
    pub(crate) fn device(&self) -> &Arc<CudaDevice> {
        &self.inner.dev
    }
}

/// A rank's thread-side state, whatever its activation type: loaded, then allocated.
pub(crate) enum RankSlot<A: Act> {
    Loaded(Option<Box<LoadedRank<A>>>),
    Ready(Box<GpuRank<A>>),
}

/// What the coordinator asks of a rank (object-safe, so one thread type serves every activation type).
pub(crate) trait RankCtl {
    fn capacity(&self, fraction: f64, max_seqs: usize, max_len: usize, rows: usize) -> Result<Capacity>;
    fn allocate(&mut self, sizes: PoolSizes, rows: usize) -> Result<()>;
    fn open(&mut self) -> Result<usize>;
    fn close(&mut self, slot: usize) -> Result<()>;
    fn prefill(&mut self, slot: usize, tokens: &[u32], which: Logits) -> Result<Vec<f32>>;
    fn decode(&mut self, rows: &[(usize, u32)], pick: &Pick) -> Result<StepOut>;
    fn synchronize(&self) -> Result<()>;
}

fn not_ready() -> EngineError {
    EngineError::Gpu("rank used before its pools were allocated".into())
}

impl<A: Act> RankSlot<A> {
    fn ready(&mut self) -> Result<&mut GpuRank<A>> {
        match self {
            RankSlot::Ready(r) => Ok(r),
            RankSlot::Loaded(_) => Err(not_ready()),
        }
    }
}

impl<A: Act> RankCtl for RankSlot<A> {
    fn capacity(&self, fraction: f64, max_seqs: usize, max_len: usize, rows: usize) -> Result<Capacity> {
        match self {
            RankSlot::Loaded(Some(l)) => l.capacity(fraction, max_seqs, max_len, rows),
            _ => Err(EngineError::Gpu("rank is not in its loading state".into())),
        }
    }

    fn allocate(&mut self, sizes: PoolSizes, rows: usize) -> Result<()> {
        match self {
            RankSlot::Loaded(l) => {
                let loaded = l
                    .take()
                    .ok_or_else(|| EngineError::Gpu("rank already allocated".into()))?;
                *self = RankSlot::Ready(Box::new(loaded.allocate(sizes, rows)?));
                Ok(())
            }
            RankSlot::Ready(_) => Err(EngineError::Gpu("rank already allocated".into())),
        }
    }

    fn open(&mut self) -> Result<usize> {
        self.ready()?.open()
    }

    fn close(&mut self, slot: usize) -> Result<()> {
        self.ready()?.close(slot)
    }

    fn prefill(&mut self, slot: usize, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        self.ready()?.prefill(slot, tokens, which)
    }

    fn decode(&mut self, rows: &[(usize, u32)], pick: &Pick) -> Result<StepOut> {
        self.ready()?.decode(rows, pick)
    }

    fn synchronize(&self) -> Result<()> {
        match self {
            RankSlot::Ready(r) => Ok(r.device().synchronize()?),
            RankSlot::Loaded(_) => Err(not_ready()),
        }
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
