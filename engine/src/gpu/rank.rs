//! One tensor-parallel rank on one GPU behind the [`Rank`] interface: its weights, pools, books, slot counters and
//! scratch. The step's orchestration (commits, each sequence's form and flush, prompt chunks, the decode batch, the
//! verify batches) is `gpu/steps.rs`; the LM head is `gpu/head.rs`; this file holds the rank, its forward pass and the
//! interface.

use rewind_kernels::cuda::ops;
use rewind_kernels::cuda::{CudaDevice, CudaSlice};
use tracing::info;

use super::forward::{self, Cx, Step};
use super::graphs::{bucket_ring, GraphKey, StepGraphs};
use super::head::HeadSpec;
use super::layers::GpuMixer;
use super::loaded::LoadedRank;
use super::mtp::GpuMtp;
use super::scratch::{Scratch, StepRows, Widths};
use super::state::{alloc_pools, alloc_snapshots, LayerPool, PoolSizes, ReplaySettings, BLOCK_SIZE};
use super::store::DeviceStore;
use super::table_sync::TableMirror;
use super::Act;
use crate::decode::FormChoice;
use crate::error::{EngineError, Result};
use crate::rank::{
    Books, Rank, RankHealth, RankInfo, RowSummary, SampleRow, SlotSnapshot, StageTimes, StepOut, StepPlan,
};
use crate::state::kv::NO_BLOCK;
use crate::state::SlotCounters;
use rewind_kernels::cpu::lm_head::{LogprobRequest, SpecRequest};
use rewind_kernels::cuda::ops::ReplayRow;
use rewind_kernels::cuda::timing::StageMarks;

/// How an allocated rank runs its steps, and what it sets aside beside its pools.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RunOptions {
    /// Capture decode and verify steps as CUDA graphs (`gpu/graphs.rs`).
    pub graphs: bool,
    /// What to time on the device.
    pub profile: Profiling,
    /// Bytes for stored states (`GpuOptions::prefix_store`, `gpu/store.rs`).
    pub store: u64,
}

/// What a rank times on the device with CUDA events.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Profiling {
    /// Every stage of every step (`GpuOptions::stage_profile`).
    pub(crate) stages: bool,
    /// The MTP layer's work of each step (`GpuOptions::time_mtp`).
    pub(crate) mtp: bool,
}

impl<A: Act> LoadedRank<A> {
    /// Allocates the pools and scratch; the rank then serves steps.
    /// `attention_ws`: the split-KV workspace's floats (`scratch::attention_workspace`, as the capacity computed it).
    pub(crate) fn allocate(
        self,
        sizes: PoolSizes,
        rows: StepRows,
        replay: ReplaySettings,
        attention_ws: usize,
        run: RunOptions,
    ) -> Result<GpuRank<A>> {
        let RunOptions { graphs, profile, store } = run;
        let conv_window = self.conv_window()?;
        let hidden = self.config.hidden_size;
        let w: Widths = self.widths(rows.rows);
        let pools = alloc_pools(&self.dev, &self.blocks, sizes)?;
        let mtp = match &self.mtp {
            Some(layer) => Some(GpuMtp::new(
                &self.dev,
                layer,
                sizes,
                rows,
                hidden,
                self.tp,
                profile.mtp,
            )?),
            None => None,
        };
        let snapshots = alloc_snapshots(&self.dev, &self.blocks, sizes)?;
        let scratch = Scratch::new(
            &self.dev,
            &w,
            rows,
            hidden,
            self.vocab.len(),
            sizes,
            attention_ws,
            (self.tp, self.rank, self.config.vocab_size),
        )?;
        self.dev.synchronize()?;
        info!(
            gpu = self.dev.ordinal(),
            max_seqs = sizes.max_seqs,
            kv_blocks = sizes.num_blocks,
            rows = rows.rows,
            cuda_graphs = graphs,
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
            max_batch: Some(rows.rows),
            kv_blocks: if self.has_attention() { sizes.num_blocks } else { 0 },
            kv_block_size: BLOCK_SIZE,
            chunked_prefill: true,
            forms: FormChoice::ALL.to_vec(),
            snapshots: true,
            hidden_states: true,
            mtp: mtp.is_some(),
            spec_summaries: true,
            // Top lists folded in the head pass (`gpu/head.rs`).
            logprobs: true,
            max_chained: crate::rank::MAX_CHAINED,
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
            snapshots,
            scratch,
            counters,
            replay,
            choice: vec![FormChoice::Auto; sizes.max_seqs],
            inner: self,
            table_dirty: true,
            table_changes: None,
            table_mirror: TableMirror::default(),
            steps: 0,
            want_hidden: false,
            graphs: StepGraphs::new(graphs),
            marks: profile.stages.then(StageMarks::default),
            stage_times: StageTimes::default(),
            spec_chain: None,
            mtp,
            store: DeviceStore::new(store),
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
    /// Per layer: the recurrent form's baseline snapshots `[slots, T, state]` (SSM layers of a rank started with a
    /// verify window), written by a recurrent verify and read by its commit.
    pub(super) snapshots: Vec<Option<CudaSlice<f32>>>,
    pub(super) books: Books,
    pub(super) info: RankInfo,
    pub(super) sizes: PoolSizes,
    pub(super) scratch: Scratch<A>,
    /// Per slot: ring start, length and capacity, conv head, form and flush flag (`state/counters.rs`).
    pub(super) counters: SlotCounters,
    pub(super) replay: ReplaySettings,
    /// Per slot: the form its sequence asked for.
    pub(super) choice: Vec<FormChoice>,
    /// Upload the block tables at the next step whatever their change count (a restored slot, a fresh rank).
    pub(super) table_dirty: bool,
    /// The books' table change count ([`crate::state::KvBlocks::changes`]) when the tables were last uploaded.
    pub(super) table_changes: Option<u64>,
    /// What the device's block tables hold, so that an upload sends only what changed.
    pub(super) table_mirror: TableMirror,
    pub(super) steps: u64,
    /// Whether the plan being run asked for final hidden states (`Batch::hidden`).
    pub(super) want_hidden: bool,
    /// Captured decode and verify steps.
    pub(super) graphs: StepGraphs,
    /// With the stage profile on: the events of the step being run, and every stage's device time so far.
    pub(super) marks: Option<StageMarks>,
    pub(super) stage_times: StageTimes,
    /// A chain of verifies' device buffers (`gpu/spec_chain.rs`), allocated at the first such chain.
    pub(super) spec_chain: Option<super::spec_chain::SpecChainScratch>,
    /// MTP drafting's KV, bookkeeping and buffers (`gpu/mtp.rs`), when the rank loaded the MTP layer.
    pub(super) mtp: Option<GpuMtp<A>>,
    /// States stored for later restores (the prefix cache's entries, `gpu/store.rs`).
    pub(super) store: DeviceStore<A>,
}

impl<A: Act> Drop for GpuRank<A> {
    /// The captured graphs go before the rest of the rank (fields drop in declaration order, `inner` with its NCCL
    /// communicator first): NCCL's clean-up of a tensor-parallel group waits until every graph that captured the
    /// group's collectives is destroyed, so a communicator ended while this rank's graphs lived would wait forever.
    fn drop(&mut self) {
        self.graphs.clear();
    }
}

/// What the LM head hands back for a step's reported rows.
pub(super) struct HeadOut {
    pub(super) rows: Vec<RowSummary>,
    pub(super) logits: Option<Vec<f32>>,
    /// `[rows, hidden]` final residual rows (before the final norm), when the plan asked for them.
    pub(super) hidden: Option<Vec<f32>>,
}

impl HeadOut {
    /// Nothing yet, holding logits and hidden rows as the step asks.
    pub(super) fn empty(logits: bool, hidden: bool) -> Self {
        HeadOut {
            rows: Vec::new(),
            logits: logits.then(Vec::new),
            hidden: hidden.then(Vec::new),
        }
    }

    /// Appends `other`'s rows.
    pub(super) fn extend(&mut self, other: HeadOut) {
        self.rows.extend(other.rows);
        if let (Some(all), Some(l)) = (&mut self.logits, other.logits) {
            all.extend(l);
        }
        if let (Some(all), Some(h)) = (&mut self.hidden, other.hidden) {
            all.extend(h);
        }
    }
}

/// Copies `data` into the front of `buf`.
pub(super) fn put(dev: &CudaDevice, buf: &mut CudaSlice<i32>, data: &[i32], what: &str) -> Result<()> {
    if data.len() > buf.len() {
        return Err(EngineError::InvalidInput(format!(
            "{} {what} do not fit the rank's buffer of {}",
            data.len(),
            buf.len()
        )));
    }
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

    /// Every slot's length as the kernels read it, with each `(slot, length)` of `over` replacing the books' (a prompt
    /// chunk sees its own end, not the whole prompt's; a chained step its own position).
    pub(super) fn lens(&self, over: &[(usize, usize)]) -> Vec<i32> {
        let mut lens: Vec<i32> = (0..self.sizes.max_seqs)
            .map(|s| {
                self.books
                    .len(s)
                    .map_or(0, |l| (l + self.books.pending(s).unwrap_or(0)) as i32)
            })
            .collect();
        for &(slot, len) in over {
            if let Some(l) = lens.get_mut(slot) {
                *l = len as i32;
            }
        }
        lens
    }

    /// Uploads the step's per-row metadata, its replay rows, the lengths and (when they changed) the block tables.
    /// `tokens` is `None` when the device already holds the step's tokens (a chained step: `gpu/chain.rs`).
    pub(super) fn upload_step(
        &mut self,
        tokens: Option<&[i32]>,
        row_slots: &[i32],
        row_pos: &[i32],
        seq_slots: &[i32],
        lens: &[i32],
        replay_rows: &[ReplayRow],
    ) -> Result<()> {
        let (dev, s) = (&*self.inner.dev, &mut self.scratch);
        put(dev, &mut s.meta, &ReplayRow::encode_all(replay_rows), "replay rows")?;
        if let Some(tokens) = tokens {
            put(dev, &mut s.tokens, tokens, "tokens")?;
        }
        put(dev, &mut s.row_slots, row_slots, "row slots")?;
        put(dev, &mut s.row_pos, row_pos, "positions")?;
        put(dev, &mut s.seq_slots, seq_slots, "sequence slots")?;
        let changes = self.books.kv().map(|k| k.changes());
        if self.table_dirty || changes != self.table_changes {
            let per = self.sizes.blocks_per_seq();
            let table: Vec<i32> = match self.books.kv() {
                Some(kv) => kv
                    .tables()
                    .iter()
                    .map(|&b| if b == NO_BLOCK { -1 } else { b as i32 })
                    .collect(),
                None => vec![-1; self.sizes.max_seqs * per],
            };
            // Only the entries that changed since the last upload travel (`gpu/table_sync.rs`).
            self.table_mirror.sync(dev, &mut s.table, &table, "block tables")?;
            self.table_dirty = false;
            self.table_changes = changes;
        }
        put(dev, &mut s.lens, lens, "lengths")
    }

    /// Embedding and blocks for a step whose metadata is uploaded; then, when `head_rows > 0`, the final norm and the
    /// LM head over the last `head_rows` rows, reported as `want_logits` and `samples` ask. A decode or verify step's
    /// device work replays as a CUDA graph (`gpu/graphs.rs`).
    pub(super) fn run(
        &mut self,
        step: Step,
        head_rows: usize,
        want_logits: bool,
        samples: Option<&[SampleRow]>,
        spec: &[Option<SpecRequest>],
        logprob: &[Option<LogprobRequest>],
    ) -> Result<HeadOut> {
        // A step asking for log-probabilities (a prompt's rows may be many) folds top lists in the chunked pass and
        // computes whole rows for its sampled rows alone, as the CPU rank does.
        let asks = logprob.iter().any(Option::is_some);
        let whole = want_logits || (samples.is_some() && !asks);
        self.launch(step, head_rows, whole, HeadSpec::Host(spec), logprob)?;
        if head_rows == 0 {
            return Ok(HeadOut::empty(want_logits, self.want_hidden));
        }
        self.read_head(step.rows, head_rows, whole, want_logits, samples, spec)
    }

    /// Queues a step's device work ([`GpuRank::run`] without the read-back): the head's summaries (and whole logit
    /// rows when `whole`) are left in the scratch; `logprob` (empty, or one per head row) asks for top lists.
    pub(super) fn launch(
        &mut self,
        mut step: Step,
        head_rows: usize,
        whole: bool,
        spec: HeadSpec<'_>,
        logprob: &[Option<LogprobRequest>],
    ) -> Result<()> {
        if step.rows > self.scratch.rows || head_rows > step.rows {
            return Err(EngineError::InvalidInput(format!(
                "a step of {} token rows ({head_rows} reported): this rank's buffers hold {} (the larger of the prompt \
                 chunk and --max-seqs × the verify window)",
                step.rows, self.scratch.rows
            )));
        }
        if head_rows > 0 {
            self.prepare_head(head_rows, whole, spec, logprob)?;
        }
        if self.graphs.enabled() {
            bucket_ring(&mut step);
        }
        // Which rows fold top lists changes the head's launches: such a step (rare: log-probability requests
        // neither chain nor speculate) runs eagerly.
        let asks = head_rows > 0 && self.scratch.head.asks_logprobs();
        let key = GraphKey::of(&step, head_rows, whole).filter(|_| !asks);
        let stream = self.inner.dev.stream().clone();
        let mut graphs = std::mem::replace(&mut self.graphs, StepGraphs::new(false));
        let ran = graphs.run(key, &stream, || self.forward(step, head_rows, whole));
        self.graphs = graphs;
        ran?;
        self.record_stages()
    }

    /// With the stage profile on, waits for the marks of the work just queued and adds their times to the totals.
    pub(super) fn record_stages(&mut self) -> Result<()> {
        if let Some(marks) = self.marks.as_mut() {
            for (stage, ms) in marks.finish()? {
                self.stage_times.add(stage, ms);
            }
        }
        Ok(())
    }

    /// A step's device work: embedding, blocks and (when `head_rows > 0`) the head's device part. Queues device work
    /// only (no copies to or from the host), so that it can be captured.
    fn forward(&mut self, step: Step, head_rows: usize, whole: bool) -> Result<()> {
        let r = &mut self.inner;
        let (dev, hid, rows) = (&*r.dev, r.config.hidden_size, step.rows);
        let s = &mut self.scratch;
        if let Some(m) = self.marks.as_mut() {
            m.begin(dev)?;
        }
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
        if let Some(m) = self.marks.as_mut() {
            m.mark(dev, "embed")?;
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
            marks: self.marks.as_mut(),
            table: None,
        };
        forward::blocks(&mut cx, &r.blocks, &mut self.pools, &mut self.snapshots, step)?;
        if head_rows > 0 {
            self.head_device(rows, head_rows, whole)?;
            if let Some(m) = self.marks.as_mut() {
                m.mark(&self.inner.dev, "head")?;
            }
        }
        Ok(())
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
        if let Some(m) = self.mtp.as_mut() {
            m.forget(slot);
        }
        self.books.close(slot)?;
        Ok(())
    }

    fn snapshot(&mut self, slot: usize) -> Result<SlotSnapshot> {
        self.snapshot_slot(slot)
    }

    fn restore(&mut self, slot: usize, snapshot: &SlotSnapshot) -> Result<()> {
        // A snapshot holds no MTP KV: the slot's starts afresh at its next step, as on the CPU rank.
        if let Some(m) = self.mtp.as_mut() {
            m.restored(slot);
        }
        self.restore_slot(slot, snapshot)
    }

    fn store(&mut self, slot: usize, id: u64) -> Result<Option<u64>> {
        self.store_slot(slot, id)
    }

    fn restore_stored(&mut self, slot: usize, id: u64) -> Result<()> {
        // A stored state holds no MTP KV either (see `restore`).
        if let Some(m) = self.mtp.as_mut() {
            m.restored(slot);
        }
        self.restore_stored_slot(slot, id)
    }

    fn drop_stored(&mut self, ids: &[u64]) -> Result<()> {
        self.drop_stored_states(ids);
        Ok(())
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
            graphs: Some(self.graphs.stats()),
            stages: (self.marks.is_some() || self.mtp.as_ref().is_some_and(GpuMtp::timed))
                .then(|| self.stage_times.clone()),
        })
    }

    fn synchronize(&mut self) -> Result<()> {
        Ok(self.inner.dev.synchronize()?)
    }
}
