//! The GPU model as the rest of rewind sees it: one rank per GPU, each in its own thread owning its device, weights,
//! pools and NCCL communicator; every call is broadcast to all ranks, which run the same step in lockstep (their
//! all-reduces meet inside NCCL), and the ranks' vocabulary slices of the logits are joined here.
//!
//! The coordinator keeps its own copy of the books (slots, lengths, KV blocks) and validates every request against it
//! before broadcasting, so a bad request fails here, identically for every rank, and never strands a rank inside a
//! collective.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use rewind_kernels::cuda::CudaDevice;
use tracing::info;

use half::bf16;

use super::options::{GpuDtype, GpuOptions};
use super::rank::{Capacity, LoadedRank, Pick, RankCtl, RankSlot, SampleRow, StepOut};
use super::state::{Books, PoolSizes, BLOCK_SIZE};
use super::DeviceComm;
use crate::error::{EngineError, Result};
use crate::model::config::ModelConfig;
use crate::model::hybrid::Logits;
use crate::shard::even_split;

/// What loading found, for logs and reports.
#[derive(Clone, Debug)]
pub struct GpuReport {
    /// Device names, per rank.
    pub devices: Vec<String>,
    pub sizes: PoolSizes,
    /// Per rank: bytes of weights (and runtime), state pools, activations; total device memory.
    pub weight_bytes: Vec<usize>,
    pub state_bytes: Vec<usize>,
    pub scratch_bytes: Vec<usize>,
    pub total_bytes: Vec<usize>,
}

type Job = Box<dyn FnOnce(&mut dyn RankCtl) -> Result<Reply> + Send>;

enum Reply {
    Unit,
    Capacity(Capacity, String),
    Slot(usize),
    Step(StepOut),
    Logits(Vec<f32>),
}

struct RankHandle {
    jobs: Sender<Job>,
    replies: Receiver<Result<Reply>>,
    thread: Option<JoinHandle<()>>,
}

/// The model on one or more GPUs.
pub struct GpuModel {
    ranks: Vec<RankHandle>,
    config: ModelConfig,
    vocab: Vec<Range<usize>>,
    books: Books,
    has_attention: bool,
    rows: usize,
    report: GpuReport,
}

fn dead(rank: usize) -> EngineError {
    EngineError::Gpu(format!("GPU rank {rank} has stopped"))
}

impl GpuModel {
    /// Loads the checkpoint in `dir` onto `opts.devices` (one tensor-parallel rank each) and sizes the pools.
    pub fn load(dir: &Path, opts: &GpuOptions) -> Result<Self> {
        let tp = opts.devices.len();
        if tp == 0 {
            return Err(EngineError::InvalidInput("no GPU given".into()));
        }
        if !(opts.gpu_memory_fraction > 0.0 && opts.gpu_memory_fraction <= 1.0) {
            return Err(EngineError::InvalidInput(format!(
                "--gpu-memory-fraction {} is outside (0, 1]",
                opts.gpu_memory_fraction
            )));
        }
        if opts.max_seqs == 0 || opts.prefill_chunk == 0 {
            return Err(EngineError::InvalidInput(
                "--max-seqs and the prefill chunk must be positive".into(),
            ));
        }
        let config = ModelConfig::from_dir(dir)?;
        if let Some(n) = opts.max_model_len {
            if n == 0 || n > config.max_position_embeddings {
                return Err(EngineError::InvalidInput(format!(
                    "--max-model-len {n} is outside 1..={} (the model's max_position_embeddings)",
                    config.max_position_embeddings
                )));
            }
        }
        let visible = rewind_kernels::cuda::device_count()?;
        if let Some(&bad) = opts.devices.iter().find(|&&d| d >= visible) {
            return Err(EngineError::Gpu(format!(
                "GPU {bad} requested, {visible} visible{}",
                if tp > 1 {
                    format!(" (--tp {tp} needs {tp} GPUs)")
                } else {
                    String::new()
                }
            )));
        }
        let max_len = opts
            .max_model_len
            .unwrap_or(config.max_position_embeddings.min(32_768))
            .min(config.max_position_embeddings)
            .next_multiple_of(BLOCK_SIZE);
        let rows = opts.prefill_chunk.max(opts.max_seqs);
        let dtype = opts.dtype;
        let nccl_id = if tp > 1 {
            rewind_kernels::cuda::nccl::disable_nvls_unless_set();
            Some(rewind_kernels::cuda::nccl::NcclId::new()?)
        } else {
            None
        };
        let mut ranks = Vec::with_capacity(tp);
        for (rank, &ordinal) in opts.devices.iter().enumerate() {
            let (jobs_tx, jobs_rx) = channel::<Job>();
            let (reply_tx, reply_rx) = channel::<Result<Reply>>();
            let dir: PathBuf = dir.to_path_buf();
            let id = nccl_id;
            let thread = std::thread::Builder::new()
                .name(format!("gpu-rank-{rank}"))
                .spawn(move || match dtype {
                    GpuDtype::Bf16 => rank_main::<bf16>(ordinal, rank, tp, id, &dir, jobs_rx, reply_tx),
                    GpuDtype::F32 => rank_main::<f32>(ordinal, rank, tp, id, &dir, jobs_rx, reply_tx),
                })
                .map_err(|e| EngineError::Gpu(format!("starting the thread of rank {rank}: {e}")))?;
            ranks.push(RankHandle {
                jobs: jobs_tx,
                replies: reply_rx,
                thread: Some(thread),
            });
        }
        let mut devices = Vec::with_capacity(tp);
        let mut first_err = None;
        for (rank, h) in ranks.iter().enumerate() {
            match h.replies.recv().map_err(|_| dead(rank)).and_then(|r| r) {
                Ok(Reply::Capacity(_, name)) => devices.push(name),
                Ok(_) => first_err = first_err.or(Some(EngineError::Gpu("unexpected reply while loading".into()))),
                Err(e) => first_err = first_err.or(Some(e)),
            }
        }
        let vocab = (0..tp).map(|r| even_split(config.vocab_size, tp, r)).collect();
        let mut model = GpuModel {
            ranks,
            has_attention: config
                .layers
                .iter()
                .flatten()
                .any(|b| matches!(b.kind, crate::model::config::BlockKind::Attention(_))),
            config,
            vocab,
            books: Books::new(PoolSizes {
                max_seqs: 1,
                max_len: BLOCK_SIZE,
                num_blocks: 0,
            })?,
            rows,
            report: GpuReport {
                devices,
                sizes: PoolSizes {
                    max_seqs: 0,
                    max_len: 0,
                    num_blocks: 0,
                },
                weight_bytes: vec![],
                state_bytes: vec![],
                scratch_bytes: vec![],
                total_bytes: vec![],
            },
        };
        if let Some(e) = first_err {
            return Err(e);
        }
        let (fraction, max_seqs) = (opts.gpu_memory_fraction, opts.max_seqs);
        let caps: Vec<Capacity> = model
            .broadcast(move |r| {
                Ok(Reply::Capacity(
                    r.capacity(fraction, max_seqs, max_len, rows)?,
                    String::new(),
                ))
            })?
            .into_iter()
            .map(|r| match r {
                Reply::Capacity(c, _) => Ok(c),
                _ => Err(EngineError::Gpu("unexpected reply while sizing".into())),
            })
            .collect::<Result<_>>()?;
        let sizes = PoolSizes {
            max_seqs,
            max_len,
            num_blocks: caps.iter().map(|c| c.kv_blocks).min().unwrap_or(0),
        };
        model.broadcast(move |r| {
            r.allocate(sizes, rows)?;
            Ok(Reply::Unit)
        })?;
        model.books = Books::new(sizes)?;
        model.report.sizes = sizes;
        model.report.weight_bytes = caps.iter().map(|c| c.weight_bytes).collect();
        model.report.state_bytes = caps.iter().map(|c| c.state_bytes).collect();
        model.report.scratch_bytes = caps.iter().map(|c| c.scratch_bytes).collect();
        model.report.total_bytes = caps.iter().map(|c| c.total_bytes).collect();
        info!(?sizes, tp, "GPU model loaded");
        Ok(model)
    }

    /// Runs `job` on every rank and collects their replies in rank order (the first error wins, after every rank
    /// has answered, so no rank is left mid-step).
    fn broadcast(
        &self,
        job: impl Fn(&mut dyn RankCtl) -> Result<Reply> + Send + Sync + Clone + 'static,
    ) -> Result<Vec<Reply>> {
        for (rank, h) in self.ranks.iter().enumerate() {
            let j = job.clone();
            h.jobs.send(Box::new(move |r| j(r))).map_err(|_| dead(rank))?;
        }
        let mut out = Vec::with_capacity(self.ranks.len());
        let mut err = None;
        for (rank, h) in self.ranks.iter().enumerate() {
            match h.replies.recv().map_err(|_| dead(rank)).and_then(|r| r) {
                Ok(r) => out.push(r),
                Err(e) => err = err.or(Some(e)),
            }
        }
        match err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// The model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// What loading found.
    pub fn report(&self) -> &GpuReport {
        &self.report
    }

    /// Tensor-parallel ranks.
    pub fn tp(&self) -> usize {
        self.ranks.len()
    }

    /// Opens a new sequence; returns its id.
    pub fn open(&mut self) -> Result<usize> {
        let slot = self.books.open()?;
        let replies = self.broadcast(|r| Ok(Reply::Slot(r.open()?)));
        match replies {
            Ok(rs) if rs.iter().all(|r| matches!(r, Reply::Slot(s) if *s == slot)) => Ok(slot),
            Ok(_) => Err(EngineError::Gpu("ranks disagree on a new sequence's slot".into())),
            Err(e) => Err(e),
        }
    }

    /// Releases sequence `seq` and its KV blocks.
    pub fn release(&mut self, seq: usize) -> Result<()> {
        self.books.close(seq)?;
        self.broadcast(move |r| {
            r.close(seq)?;
            Ok(Reply::Unit)
        })?;
        Ok(())
    }

    fn check_tokens(&self, tokens: impl IntoIterator<Item = u32>) -> Result<()> {
        let vocab = self.config.vocab_size;
        match tokens.into_iter().find(|&t| t as usize >= vocab) {
            Some(t) => Err(EngineError::InvalidInput(format!(
                "token id {t} is out of range (vocab size {vocab})"
            ))),
            None => Ok(()),
        }
    }

    /// Joins the ranks' `[rows, slice]` logits into `[rows, vocab]`; non-finite logits are an error.
    fn join(&self, parts: Vec<Vec<f32>>, first_position: usize) -> Result<Vec<f32>> {
        let vocab = self.config.vocab_size;
        let rows = parts.first().map_or(0, |p| p.len() / self.vocab[0].len().max(1));
        let mut out = vec![0.0f32; rows * vocab];
        for (part, range) in parts.iter().zip(&self.vocab) {
            let w = range.len();
            if part.len() != rows * w {
                return Err(EngineError::Gpu("ranks returned logits of different shapes".into()));
            }
            for (r, src) in part.chunks_exact(w).enumerate() {
                out[r * vocab + range.start..r * vocab + range.end].copy_from_slice(src);
            }
        }
        if let Some(i) = out.iter().position(|v| !v.is_finite()) {
            return Err(EngineError::NonFinite {
                position: first_position + i / vocab,
            });
        }
        Ok(out)
    }

    fn logits_of(replies: Vec<Reply>) -> Result<Vec<Vec<f32>>> {
        replies
            .into_iter()
            .map(|r| match r {
                Reply::Logits(l) | Reply::Step(StepOut::Logits(l)) => Ok(l),
                _ => Err(EngineError::Gpu("unexpected reply to a step".into())),
            })
            .collect()
    }

    /// Appends `tokens` to sequence `seq` (a prompt, or the next part of one); returns `[t, vocab]` logits with
    /// `Logits::All`, `[vocab]` with `Logits::Last`.
    pub fn prefill(&mut self, seq: usize, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(EngineError::InvalidInput("no tokens to process".into()));
        }
        self.check_tokens(tokens.iter().copied())?;
        let first = self.books.lens.get(seq).copied().unwrap_or(0) as usize;
        self.books.check_growth(&[(seq, tokens.len())], self.has_attention)?;
        let toks: Arc<Vec<u32>> = Arc::new(tokens.to_vec());
        let replies = self.broadcast(move |r| Ok(Reply::Logits(r.prefill(seq, &toks, which)?)))?;
        self.books.grow(seq, tokens.len(), self.has_attention)?;
        let rows = match which {
            Logits::All => tokens.len(),
            Logits::Last => 1,
        };
        self.join(Self::logits_of(replies)?, first + tokens.len() - rows)
    }

    /// Validates a decode batch against the books (changing nothing); [`GpuModel::advance`] records it once the ranks
    /// have run it.
    fn check_batch(&self, rows: &[(usize, u32)]) -> Result<()> {
        if rows.is_empty() {
            return Err(EngineError::InvalidInput("an empty decode batch".into()));
        }
        if rows.len() > self.rows {
            return Err(EngineError::InvalidInput(format!(
                "a decode batch of {} exceeds --max-seqs {}",
                rows.len(),
                self.rows
            )));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some((s, _)) = rows.iter().find(|(s, _)| !seen.insert(*s)) {
            return Err(EngineError::InvalidInput(format!(
                "sequence {s} appears twice in one decode batch"
            )));
        }
        self.check_tokens(rows.iter().map(|r| r.1))?;
        let growth: Vec<(usize, usize)> = rows.iter().map(|&(s, _)| (s, 1)).collect();
        self.books.check_growth(&growth, self.has_attention)
    }

    /// Records one decoded token for every sequence of a checked batch.
    fn advance(&mut self, rows: &[(usize, u32)]) -> Result<()> {
        for &(s, _) in rows {
            self.books.grow(s, 1, self.has_attention)?;
        }
        Ok(())
    }

    /// One decode step over a batch of distinct sequences (`(sequence, token)`); returns `[batch, vocab]` logits.
    pub fn decode(&mut self, rows: &[(usize, u32)]) -> Result<Vec<f32>> {
        self.check_batch(rows)?;
        let batch: Arc<Vec<(usize, u32)>> = Arc::new(rows.to_vec());
        let replies = self.broadcast(move |r| Ok(Reply::Step(r.decode(&batch, &Pick::Logits)?)))?;
        let first = self.books.lens[rows[0].0] as usize;
        self.advance(rows)?;
        self.join(Self::logits_of(replies)?, first)
    }

    /// One decode step returning each row's greedy token. The argmax runs on the device: with one GPU only the ids
    /// come back; with tensor parallelism each rank reports its slice's best id and logit, and the best of those wins
    /// (the lowest id on ties, as ranks hold ascending slices).
    pub fn decode_greedy(&mut self, rows: &[(usize, u32)]) -> Result<Vec<u32>> {
        if self.ranks.len() == 1 {
            return self.decode_pick(rows, Pick::Argmax);
        }
        self.check_batch(rows)?;
        let batch: Arc<Vec<(usize, u32)>> = Arc::new(rows.to_vec());
        let replies = self.broadcast(move |r| Ok(Reply::Step(r.decode(&batch, &Pick::Argmax)?)))?;
        self.advance(rows)?;
        let mut best: Vec<(i64, f32)> = vec![(-1, f32::NEG_INFINITY); rows.len()];
        let mut poisoned = vec![false; rows.len()];
        for reply in replies {
            let Reply::Step(StepOut::Best(ids, vals)) = reply else {
                return Err(EngineError::Gpu("unexpected reply to a greedy step".into()));
            };
            for (i, (&id, &val)) in ids.iter().zip(&vals).enumerate() {
                if id < 0 {
                    poisoned[i] = true;
                } else if best[i].0 < 0 || val > best[i].1 {
                    best[i] = (id, val);
                }
            }
        }
        if let Some(i) = poisoned.iter().position(|&p| p) {
            return Err(EngineError::NonFinite {
                position: self.books.lens[rows[i].0] as usize - 1,
            });
        }
        Ok(best.into_iter().map(|(id, _)| id as u32).collect())
    }

    /// One decode step that samples each row's next token as `sampling[i]` says: on the device with one GPU (only
    /// the ids come back); with tensor parallelism the joined logits are sampled here by the device kernel's CPU twin
    /// (same filters, same draw).
    pub fn decode_sampled(&mut self, rows: &[(usize, u32)], sampling: &[SampleRow]) -> Result<Vec<u32>> {
        if sampling.len() != rows.len() {
            return Err(EngineError::InvalidInput(format!(
                "{} sampling rows for a batch of {}",
                sampling.len(),
                rows.len()
            )));
        }
        let vocab = self.config.vocab_size;
        for s in sampling {
            if !(0.0..1.0).contains(&s.uniform) {
                return Err(EngineError::InvalidInput(format!(
                    "uniform {} is outside [0, 1)",
                    s.uniform
                )));
            }
            if let Some(&t) = s.history.iter().find(|&&t| t as usize >= vocab) {
                return Err(EngineError::InvalidInput(format!(
                    "previous token id {t} is out of range (vocab size {vocab})"
                )));
            }
        }
        if self.ranks.len() > 1 {
            let logits = self.decode(rows)?;
            return Ok(logits
                .chunks_exact(vocab)
                .zip(sampling)
                .map(|(row, s)| {
                    let mut row = row.to_vec();
                    if s.repetition_penalty != 1.0 {
                        let mut seen = Vec::new();
                        crate::sample::distinct_ids(&s.history, &mut seen);
                        crate::sample::apply_repetition_penalty(&mut row, &seen, s.repetition_penalty);
                    }
                    rewind_kernels::cpu::sample::sample_row(&row, s.temperature, s.top_k, s.top_p, s.min_p, s.uniform)
                })
                .collect());
        }
        self.decode_pick(rows, Pick::Sample(sampling.to_vec()))
    }

    fn decode_pick(&mut self, rows: &[(usize, u32)], pick: Pick) -> Result<Vec<u32>> {
        self.check_batch(rows)?;
        let batch: Arc<Vec<(usize, u32)>> = Arc::new(rows.to_vec());
        let pick = Arc::new(pick);
        let mut replies = self.broadcast(move |r| Ok(Reply::Step(r.decode(&batch, &pick)?)))?;
        self.advance(rows)?;
        match replies.pop() {
            Some(Reply::Step(StepOut::Ids(ids))) => {
                if let Some(i) = ids.iter().position(|&t| t as usize >= self.config.vocab_size) {
                    return Err(EngineError::NonFinite {
                        position: self.books.lens[rows[i].0] as usize - 1,
                    });
                }
                Ok(ids)
            }
            _ => Err(EngineError::Gpu("unexpected reply to a decode step".into())),
        }
    }

    /// Waits for every rank's queued work (for timing).
    pub fn synchronize(&self) -> Result<()> {
        self.broadcast(|r| {
            r.synchronize()?;
            Ok(Reply::Unit)
        })?;
        Ok(())
    }
}

impl Drop for GpuModel {
    fn drop(&mut self) {
        // Closing the job channels ends the rank threads.
        let handles: Vec<_> = self.ranks.iter_mut().filter_map(|h| h.thread.take()).collect();
        self.ranks.clear();
        for h in handles {
            let _ = h.join();
        }
    }
}

/// A rank's thread: opens its GPU, joins the NCCL group, loads its shard, then serves jobs until the coordinator goes.
fn rank_main<A: super::Act>(
    ordinal: usize,
    rank: usize,
    tp: usize,
    id: Option<rewind_kernels::cuda::nccl::NcclId>,
    dir: &Path,
    jobs: Receiver<Job>,
    replies: Sender<Result<Reply>>,
) {
    let loaded = (|| -> Result<(LoadedRank<A>, String)> {
        let dev = Arc::new(CudaDevice::open(ordinal)?);
        let name = dev.name().to_string();
        let comm: Option<Box<dyn DeviceComm>> = match &id {
            Some(id) => Some(Box::new(rewind_kernels::cuda::nccl::NcclComm::init(
                &dev, rank, tp, id,
            )?)),
            None => None,
        };
        Ok((LoadedRank::load(dev, comm, dir, tp, rank)?, name))
    })();
    let mut slot = match loaded {
        Ok((r, name)) => {
            let empty = Capacity {
                kv_blocks: 0,
                weight_bytes: 0,
                state_bytes: 0,
                scratch_bytes: 0,
                total_bytes: 0,
            };
            let _ = replies.send(Ok(Reply::Capacity(empty, name)));
            RankSlot::Loaded(Some(Box::new(r)))
        }
        Err(e) => {
            let _ = replies.send(Err(e));
            return;
        }
    };
    while let Ok(job) = jobs.recv() {
        if replies.send(job(&mut slot)).is_err() {
            break;
        }
    }
}
