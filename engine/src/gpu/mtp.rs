//! MTP drafting on a GPU rank (issue 41), the device twin of the CPU rank's (`rank/mtp_cpu.rs`, the reference):
//! the bookkeeping is the backends' shared [`MtpBook`]; this file keeps the rows and runs the layer, with the host
//! half of its launches (what each uploads and copies, the layer's block table) in `gpu/mtp_plan.rs`.
//!
//! During the step's launches the final residual rows of every MTP sequence are copied out of the scratch into
//! [`MtpScratch::rows`] (all of the step's rows: a prompt chunk's too, whose head may not run). After the step each
//! reported row's summary is merged over the tensor-parallel ranks (a gather on the device communicator), the book
//! judges every sequence as the coordinator will and names its [`MtpJob`], and the jobs run on the device:
//!
//! - the catch-up: each job's rows (this step's rows, and a saved row of the slot's last step for a repair) gathered
//!   into one buffer, under the final norm, with the embeddings of the tokens after them, through the layer
//!   ([`GpuMtpLayer`]: input projection, the attention block reading and writing the layer's KV at the job's KV
//!   indices, the FFN block, the output norm). Jobs of equal row counts run as one batch; a long prompt's rows in
//!   pieces of a prompt chunk.
//! - the drafts: batched over the jobs, one row each per draft step; each pick is the argmax of the LM head over the
//!   layer's output (the one-pass head kernels, `gpu/head.rs`, with no final norm between), merged over the ranks'
//!   vocabulary slices on the device (`chain_pick`, as a chain of decodes merges its picks), and fed to the next step
//!   with no host round trip. The host reads the picks once.
//! - the rows each job names for the next step's repair are saved per slot ([`MtpScratch::saved`]).
//!
//! With CUDA graphs on, the draft loop is captured whole (keyed by how many jobs draft at each step) and so is each
//! catch-up launch of equal-length jobs (keyed by its shape), in the rank's one graph cache (`gpu/graphs.rs`): their
//! inputs (row pairs padded to the launch's shape, every draft step's slots, KV indices and lengths) are uploaded
//! into fixed buffers first, so a steady step costs a few uploads and graph launches. A prompt's catch-up in pieces
//! runs eagerly. The layer's block table stays on the device, updated where it changed (`gpu/table_sync.rs`).

use rewind_kernels::cuda::ops::{self, PagedKv, SUMMARY_WORDS};
use rewind_kernels::cuda::timing::StageMarks;
use rewind_kernels::cuda::{CudaDevice, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, Elem, ValidAsZeroBits};
use tracing::debug_span;

use super::forward::{self, lin, Cx, SsmRun, Step};
use super::graphs::{GraphKey, StepGraphs};
use super::head::{head_pass, HeadSpec};
use super::loaded::LoadedRank;
use super::mtp_layer::{extra_blocks, GpuMtpLayer};
use super::mtp_plan::{draft_meta, mtp_table, plan_catch_up, META_WORDS};
use super::rank::{put, GpuRank};
use super::scratch::{Scratch, StepRows};
use super::state::{LayerPool, PoolSizes};
use super::table_sync::TableMirror;
use super::Act;
use crate::error::{EngineError, Result};
use crate::rank::mtp::MtpJob;
use crate::rank::vocab::merge_rows;
use crate::rank::{Batch, MtpBook, MtpProposal, RowPass, RowSummary, MTP_DRAFT_STAGE};

/// The MTP layer's device buffers on a rank.
pub(crate) struct MtpScratch<A: Act> {
    /// `[slots · keep, hidden]` f32: each slot's rows saved at the end of its last step ([`MtpBook::saved`] names
    /// their positions), slot `s`'s from row `s · keep`.
    saved: CudaSlice<f32>,
    /// Saved rows per slot: the most a step saves (a verify's accepted rows and its bonus row).
    keep: usize,
    /// `[rows, hidden]` f32: this step's final residual rows of the MTP sequences (each from its `first_row`).
    rows: CudaSlice<f32>,
    /// `[pairs, 2]` (source, destination) rows of the next eager `copy_rows`.
    pairs: CudaSlice<i32>,
    /// A catch-up launch's row pairs, padded to its shape (`LaunchInputs::pair_words`): never reallocated, as a
    /// captured launch reads it.
    launch: CudaSlice<i32>,
    /// Every draft step's slots, KV indices and lengths (`draft_meta`), read by the captured draft loop.
    meta: CudaSlice<i32>,
    /// `[slots, hidden]`: each drafting job's last output, the head's input and the next draft step's hidden row.
    last: CudaSlice<A>,
    /// `[steps, slots]`: the merged picks of every draft step (the drafts), step-major.
    picks: CudaSlice<i32>,
    /// `[steps, slots, SUMMARY_WORDS]`: each draft step's summaries over this rank's slice, read for NaNs.
    words: CudaSlice<u32>,
    /// `[slots]`: the sampled ids `chain_pick` logs (none here).
    ids: CudaSlice<i32>,
    /// `[ranks, slots, SUMMARY_WORDS]`: a draft step's summaries of every rank (tensor parallelism).
    gathered: CudaSlice<u32>,
    /// The step's reported rows' summaries, sent and gathered over the ranks (tensor parallelism).
    send: CudaSlice<u32>,
    recv: CudaSlice<u32>,
}

impl<A: Act> MtpScratch<A> {
    /// Bytes [`MtpScratch::new`] allocates for pools of `sizes`, steps of `rows` and `tp` ranks: what the capacity
    /// counts (a step whose MTP sequences hold more rows than the step buffers, a long prompt, grows them).
    pub(crate) fn bytes(sizes: PoolSizes, rows: StepRows, hidden: usize, tp: usize) -> usize {
        let (n, t, e) = (sizes.max_seqs, rows.max_verify, std::mem::size_of::<A>());
        let table = n * (sizes.blocks_per_seq() + extra_blocks(t));
        4 * n * t * hidden
            + 4 * rows.rows * hidden
            + 4 * 2 * rows.rows
            + 4 * 2 * (2 * rows.rows + n)
            + 4 * t * META_WORDS * n
            + e * n * hidden
            + 4 * t * n * (1 + SUMMARY_WORDS)
            + 4 * n
            + 4 * tp * n * SUMMARY_WORDS
            + 4 * rows.rows * SUMMARY_WORDS * (1 + tp)
            + 4 * table
    }

    fn new(dev: &CudaDevice, sizes: PoolSizes, rows: StepRows, hidden: usize, tp: usize) -> Result<Self> {
        let (n, t) = (sizes.max_seqs, rows.max_verify);
        Ok(MtpScratch {
            saved: dev.alloc_zeros(n * t * hidden)?,
            keep: t,
            rows: dev.alloc_zeros(rows.rows * hidden)?,
            pairs: dev.alloc_zeros(2 * rows.rows)?,
            launch: dev.alloc_zeros(2 * (2 * rows.rows + n))?,
            meta: dev.alloc_zeros(t * META_WORDS * n)?,
            last: dev.alloc_zeros(n * hidden)?,
            picks: dev.alloc_zeros(t * n)?,
            words: dev.alloc_zeros(t * n * SUMMARY_WORDS)?,
            ids: dev.alloc_zeros(n)?,
            gathered: dev.alloc_zeros(tp * n * SUMMARY_WORDS)?,
            send: dev.alloc_zeros(rows.rows * SUMMARY_WORDS)?,
            recv: dev.alloc_zeros(tp * rows.rows * SUMMARY_WORDS)?,
        })
    }
}

/// `buf` with room for `len` values: reallocated (contents dropped) when it holds fewer; says whether it was.
fn room<T: DeviceRepr + ValidAsZeroBits>(dev: &CudaDevice, buf: &mut CudaSlice<T>, len: usize) -> Result<bool> {
    if buf.len() < len {
        *buf = dev.alloc_zeros(len)?;
        return Ok(true);
    }
    Ok(false)
}

/// A rank's MTP drafting state: the book, the layer's KV pool and block table, and the buffers.
pub(crate) struct GpuMtp<A: Act> {
    book: MtpBook,
    /// The layer's pools, in its blocks' order: the attention block's KV, none for the FFN block.
    pools: Vec<LayerPool<A>>,
    /// No snapshots (the layer has no SSM block): what `forward::blocks` zips with the pools.
    snapshots: Vec<Option<CudaSlice<f32>>>,
    layout: PagedKv,
    /// `[slots, blocks_per_slot]` of `layout`: each slot's target blocks, then its own ([`extra_blocks`]).
    table: CudaSlice<i32>,
    /// The books' table change count when `table` was built.
    table_changes: Option<u64>,
    /// What `table` holds, so that a rebuild uploads only what changed.
    mirror: TableMirror,
    /// With MTP timing on (`GpuOptions::time_mtp`): events around each step's MTP device work.
    timing: Option<StageMarks>,
    buf: MtpScratch<A>,
    /// Per slot, during a step: its first row in [`MtpScratch::rows`] when the step runs it through the layer.
    first_row: Vec<Option<usize>>,
    /// The most rows of one sequence a catch-up launch batches with others' (a verify's rows and a repaired one),
    /// and the longest piece of a longer one's (a prompt chunk): the shapes the attention workspace was sized for.
    batched: usize,
    piece: usize,
}

impl<A: Act> GpuMtp<A> {
    /// The state for `layer` on a rank of pools `sizes`, steps of `rows` and `tp` ranks.
    pub(crate) fn new(
        dev: &CudaDevice,
        layer: &GpuMtpLayer<A>,
        sizes: PoolSizes,
        rows: StepRows,
        hidden: usize,
        tp: usize,
        time: bool,
    ) -> Result<Self> {
        let layout = layer.kv_layout(sizes, rows.max_verify);
        let pools = layer
            .blocks
            .iter()
            .map(|b| match &b.mixer {
                super::layers::GpuMixer::Attention(_) => Ok(LayerPool::Kv {
                    k: dev.alloc(layout.pool_len())?,
                    v: dev.alloc(layout.pool_len())?,
                    layout,
                }),
                _ => Ok(LayerPool::None),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(GpuMtp {
            book: MtpBook::default(),
            snapshots: pools.iter().map(|_| None).collect(),
            pools,
            layout,
            table: dev.alloc_zeros(layout.num_slots * layout.blocks_per_slot)?,
            table_changes: None,
            mirror: TableMirror::default(),
            timing: time.then(StageMarks::default),
            buf: MtpScratch::new(dev, sizes, rows, hidden, tp)?,
            first_row: vec![None; sizes.max_seqs],
            batched: (rows.max_verify + 1).min(rows.rows),
            piece: rows.prefill_chunk.min(rows.rows).max(1),
        })
    }

    /// Forgets `slot`'s MTP KV (released or restored): its next step starts it afresh.
    pub(crate) fn forget(&mut self, slot: usize) {
        self.book.forget(slot);
    }

    /// A restored slot: forgotten, and the block table rebuilt at the next MTP step (as the target's is uploaded
    /// whatever the books' change count says).
    pub(crate) fn restored(&mut self, slot: usize) {
        self.forget(slot);
        self.table_changes = None;
    }

    /// Whether the rank times its MTP work (`GpuOptions::time_mtp`).
    pub(crate) fn timed(&self) -> bool {
        self.timing.is_some()
    }

    /// A step without MTP requests keeps no rows.
    pub(crate) fn idle(&mut self) {
        self.first_row.fill(None);
    }
}

/// The layer over `step.rows` rows whose tokens and metadata are uploaded: the hidden half of the input from the
/// target's residual rows in `s.y2` (`from_target`: under the final norm) or from the drafting jobs' last outputs;
/// the output (under the layer's norm) lands in `s.h`.
fn layer_forward<A: Act>(
    r: &LoadedRank<A>,
    layer: &GpuMtpLayer<A>,
    s: &mut Scratch<A>,
    st: &mut GpuMtp<A>,
    step: Step,
    from_target: bool,
) -> Result<()> {
    let (dev, hid, n) = (&*r.dev, r.config.hidden_size, step.rows);
    let (eps, offset) = (r.config.norm_eps, r.config.norm_offset);
    let m = n * hid;
    // The hidden half: the target's final norm then the layer's (vLLM feeds the normed target rows), or the layer's
    // norm of its own last outputs.
    if from_target {
        ops::add_rms_norm(
            dev,
            &mut s.y2.slice_mut(..m),
            None::<&CudaSlice<f32>>,
            &r.final_norm,
            eps,
            offset,
            &mut s.b.slice_mut(..m),
        )?;
        ops::rms_norm(
            dev,
            &s.b.slice(..m),
            &layer.norm_hidden,
            eps,
            offset,
            &mut s.c.slice_mut(..m),
        )?;
    } else {
        ops::rms_norm(
            dev,
            &st.buf.last.slice(..m),
            &layer.norm_hidden,
            eps,
            offset,
            &mut s.c.slice_mut(..m),
        )?;
    }
    // The embedding half: the tokens after the rows (summed over the ranks' vocabulary slices).
    ops::embed_rows_f32(
        dev,
        &r.embed,
        &s.tokens.slice(..n),
        hid,
        r.vocab.start,
        &mut s.x.slice_mut(..m),
    )?;
    if let Some(c) = &r.comm {
        c.all_reduce_f32(&mut s.x.slice_mut(..m))?;
    }
    ops::add_rms_norm(
        dev,
        &mut s.x.slice_mut(..m),
        None::<&CudaSlice<f32>>,
        &layer.norm_embedding,
        eps,
        offset,
        &mut s.a.slice_mut(..m),
    )?;
    // `[embedding | hidden]`, as vLLM concatenates them, through the input projection into the residual stream.
    let cat = &mut s.proj.slice_mut(..2 * m);
    ops::copy_block(dev, &s.a.slice(..m), n, hid, 0, hid, cat, 2 * hid, 0)?;
    ops::copy_block(dev, &s.c.slice(..m), n, hid, 0, hid, cat, 2 * hid, hid)?;
    lin(
        &r.blas,
        dev,
        &s.proj.slice(..2 * m),
        &layer.fc,
        &mut s.x.slice_mut(..m),
        n,
    )?;
    let mut cx = Cx {
        dev,
        blas: &r.blas,
        s: &mut *s,
        comm: r.comm.as_deref(),
        hidden: hid,
        max_seqs: st.layout.num_slots,
        eps,
        offset,
        marks: None,
        table: Some(&st.table),
    };
    forward::blocks(&mut cx, &layer.blocks, &mut st.pools, &mut st.snapshots, step)?;
    ops::add_rms_norm(
        dev,
        &mut s.x.slice_mut(..m),
        Some(&s.y.slice(..m)),
        &layer.norm,
        eps,
        offset,
        &mut s.h.slice_mut(..m),
    )?;
    Ok(())
}

/// Uploads `pairs` ((source, destination) rows) into `buf` and copies the rows of `src` into `dst`.
fn copy_pairs<T: Elem>(
    dev: &CudaDevice,
    buf: &mut CudaSlice<i32>,
    pairs: &[i32],
    src: &impl DevicePtr<T>,
    width: usize,
    dst: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    if pairs.is_empty() {
        return Ok(());
    }
    room(dev, buf, pairs.len())?;
    put(dev, buf, pairs, "MTP row pairs")?;
    Ok(ops::copy_rows(dev, src, &buf.slice(..pairs.len()), width, dst)?)
}

impl<A: Act> GpuRank<A> {
    /// Before a batch's launches: the book prepares every MTP sequence (its KV cut back, a repair noted) and each
    /// gets its place in the step's rows.
    pub(super) fn mtp_begin(&mut self, b: &Batch) -> Result<()> {
        let hid = self.inner.config.hidden_size;
        let dev = self.inner.dev.clone();
        let st = self.mtp.as_mut().ok_or_else(no_layer)?;
        st.book.prepare(&b.mtp, &b.seqs)?;
        st.first_row.iter_mut().for_each(|f| *f = None);
        let mut at = 0;
        for r in &b.mtp {
            let s = b.seqs.iter().find(|s| s.slot == r.slot).ok_or_else(|| {
                EngineError::InvalidInput(format!(
                    "an MTP request names slot {}, which the batch does not step",
                    r.slot
                ))
            })?;
            let first = st.first_row.get_mut(r.slot).ok_or_else(|| {
                EngineError::InvalidInput(format!("an MTP request names slot {}, past the rank's slots", r.slot))
            })?;
            *first = Some(at);
            at += s.tokens.len();
        }
        if room(&dev, &mut st.buf.rows, at * hid)? {
            // The captured catch-ups read the old buffer.
            self.graphs.clear_mtp();
        }
        Ok(())
    }

    /// After a launch of `rows` token rows: copies the final residual rows of the MTP sequences among `parts`
    /// (slot, first row within the sequence's step, first row of the launch, rows) into the step's rows. The head
    /// added the last block's output into the residual stream when it ran (`head_ran`); otherwise it is added here.
    pub(super) fn keep_mtp_rows(
        &mut self,
        parts: &[(usize, usize, usize, usize)],
        rows: usize,
        head_ran: bool,
    ) -> Result<()> {
        let Some(st) = self.mtp.as_mut() else {
            return Ok(());
        };
        let mut pairs = Vec::new();
        for &(slot, offset, launch_row, count) in parts {
            if let Some(first) = st.first_row.get(slot).copied().flatten() {
                for i in 0..count {
                    pairs.extend([(launch_row + i) as i32, (first + offset + i) as i32]);
                }
            }
        }
        if pairs.is_empty() {
            return Ok(());
        }
        let r = &self.inner;
        let (dev, hid) = (&*r.dev, r.config.hidden_size);
        let s = &mut self.scratch;
        if !head_ran {
            // What the head would have done first (`head_device`): the residual gets the last block's output.
            ops::add_rms_norm(
                dev,
                &mut s.x.slice_mut(..rows * hid),
                Some(&s.y.slice(..rows * hid)),
                &r.final_norm,
                r.config.norm_eps,
                r.config.norm_offset,
                &mut s.h.slice_mut(..rows * hid),
            )?;
        }
        copy_pairs(
            dev,
            &mut st.buf.pairs,
            &pairs,
            &s.x.slice(..rows * hid),
            hid,
            &mut st.buf.rows,
        )
    }

    /// After a batch's launches: judges each MTP sequence from the step's reported rows `rows` (this rank's
    /// summaries, plan order), runs the jobs on the device and answers the proposals (see the module docs).
    pub(super) fn mtp_end(&mut self, b: &Batch, rows: &[RowSummary]) -> Result<Vec<MtpProposal>> {
        let _span = debug_span!("gpu_mtp", seqs = b.mtp.len()).entered();
        let merged = self.merged_rows(rows)?;
        let sampled: Vec<Option<u32>> = rows.iter().map(|r| r.sampled).collect();
        let st = self.mtp.as_mut().ok_or_else(no_layer)?;
        let jobs = st.book.jobs(&b.mtp, &b.seqs, &merged, &sampled)?;
        if let Some(j) = jobs.iter().find(|j| j.save.1.len() > st.buf.keep) {
            return Err(EngineError::InvalidInput(format!(
                "slot {}: an MTP step saves {} rows, this rank keeps {} (its verify window)",
                j.slot,
                j.save.1.len(),
                st.buf.keep
            )));
        }
        self.mtp_table()?;
        // Drafting jobs, most drafts first: the jobs still drafting at every step are a prefix.
        let mut order: Vec<usize> = (0..jobs.len()).filter(|&i| jobs[i].drafts > 0).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(jobs[i].drafts));
        let dev = self.inner.dev.clone();
        if let Some(m) = st_timing(&mut self.mtp) {
            m.begin(&dev)?;
        }
        self.catch_up(&jobs, &order)?;
        let steps = self.draft(&jobs, &order)?;
        if let Some(m) = st_timing(&mut self.mtp) {
            m.mark(&dev, MTP_DRAFT_STAGE)?;
        }
        let picks = self.read_picks(&jobs, &order, steps)?;
        if let Some(m) = st_timing(&mut self.mtp) {
            for (stage, ms) in m.finish()? {
                self.stage_times.add(stage, ms);
            }
        }
        self.save_rows(&jobs)?;
        let st = self.mtp.as_mut().ok_or_else(no_layer)?;
        st.book.ran(&jobs);
        st.first_row.iter_mut().for_each(|f| *f = None);
        let j = order.len();
        let mut proposals = Vec::with_capacity(jobs.len());
        for (i, job) in jobs.iter().enumerate() {
            let Some((position, token)) = job.next else {
                continue;
            };
            let k = order.iter().position(|&o| o == i);
            let drafts = (0..job.drafts)
                .map(|d| k.map(|k| picks[d * j + k] as u32).unwrap_or_default())
                .collect();
            proposals.push(MtpProposal {
                slot: job.slot,
                position,
                token,
                drafts,
            });
        }
        Ok(proposals)
    }

    /// Each reported row's summary over the whole vocabulary: this rank's, merged with every other rank's gathered
    /// on the device communicator (as words, so ids and values come through exactly), in rank order as the
    /// coordinator merges them, so every rank judges alike.
    fn merged_rows(&mut self, rows: &[RowSummary]) -> Result<Vec<RowPass>> {
        let world = self.info.tp;
        if world == 1 || rows.is_empty() {
            return rows.iter().map(|r| merge_rows(std::slice::from_ref(r))).collect();
        }
        let comm = self.inner.comm.as_deref().ok_or_else(|| {
            EngineError::Communicator(format!(
                "rank {} of {world} has no communicator to merge the MTP sequences' rows",
                self.info.rank
            ))
        })?;
        let dev = &*self.inner.dev;
        let st = self.mtp.as_mut().ok_or_else(no_layer)?;
        let words: Vec<u32> = rows.iter().flat_map(|r| ops::encode_summary(&r.pass)).collect();
        let n = words.len();
        room(dev, &mut st.buf.send, n)?;
        room(dev, &mut st.buf.recv, world * n)?;
        dev.stream()
            .memcpy_htod(&words, &mut st.buf.send.slice_mut(..n))
            .map_err(|e| EngineError::Gpu(format!("uploading the step's summaries: {e}")))?;
        comm.all_gather_u32(&st.buf.send.slice(..n), &mut st.buf.recv.slice_mut(..world * n))?;
        let all = dev.download(&st.buf.recv.slice(..world * n))?;
        let flags: Vec<bool> = rows.iter().map(|r| r.pass.spec.is_some()).collect();
        let ranks: Vec<Vec<RowPass>> = all.chunks_exact(n).map(|w| ops::decode_summaries(w, &flags)).collect();
        (0..rows.len())
            .map(|i| {
                let parts: Vec<RowSummary> = ranks.iter().map(|p| RowSummary::from(p[i])).collect();
                merge_rows(&parts)
            })
            .collect()
    }

    /// Builds the layer's block table when the books' tables changed ([`mtp_table`]).
    fn mtp_table(&mut self) -> Result<()> {
        let kv = self.books.kv().ok_or_else(|| {
            EngineError::Gpu("the MTP layer's KV needs the rank's block tables, and this rank keeps none".into())
        })?;
        let st = self.mtp.as_mut().ok_or_else(no_layer)?;
        if st.table_changes == Some(kv.changes()) {
            return Ok(());
        }
        let table = mtp_table(kv, st.layout)?;
        st.mirror
            .sync(&self.inner.dev, &mut st.table, &table, "the MTP layer's block table")?;
        st.table_changes = Some(kv.changes());
        Ok(())
    }

    /// Runs every job's rows through the layer into its KV; the last output of each drafting job (`order`) lands
    /// in the drafts' input rows. A launch of equal-length jobs replays its captured graph (its pairs padded to its
    /// shape, so that the graph's copies are fixed); a prompt's pieces run eagerly.
    fn catch_up(&mut self, jobs: &[MtpJob], order: &[usize]) -> Result<()> {
        let st = self.mtp.as_ref().ok_or_else(no_layer)?;
        let batched = st.batched;
        let launches = plan_catch_up(jobs, batched, self.sizes.max_seqs, self.scratch.rows, st.piece);
        for launch in launches {
            let (t, seqs) = (launch.t(), launch.parts.len());
            let n = seqs * t;
            let st = self.mtp.as_ref().ok_or_else(no_layer)?;
            let x = launch.inputs(
                jobs,
                order,
                &st.first_row,
                |slot| st.book.saved(slot).start,
                st.buf.keep,
            )?;
            let words = x.pair_words(n, seqs)?;
            let dev = self.inner.dev.clone();
            {
                let st = self.mtp.as_mut().ok_or_else(no_layer)?;
                put(&dev, &mut st.buf.launch, &words, "MTP catch-up row pairs")?;
            }
            let mut lens = vec![0i32; self.sizes.max_seqs];
            for &(slot, len) in &x.lens {
                lens[slot] = len as i32;
            }
            self.upload_mtp_step(&x.tokens, &x.row_slots, &x.row_pos, &x.seq_slots, &lens)?;
            let step = self.step_shape(n, seqs, t, false, SsmRun::Recurrent);
            let key = (t <= batched).then_some(GraphKey::MtpCatchUp { rows: n, seqs, t });
            let stream = dev.stream().clone();
            let mut graphs = std::mem::replace(&mut self.graphs, StepGraphs::new(false));
            let ran = graphs.run(key, &stream, || self.catch_up_device(step, seqs));
            self.graphs = graphs;
            ran?;
        }
        Ok(())
    }

    /// A catch-up launch's device work over `step.rows` rows of `seqs` jobs, its inputs uploaded: the rows gathered
    /// (`MtpScratch::launch`: saved rows, then the step's, then where the drafting jobs' last outputs go), the layer,
    /// the last outputs handed on. Queues device work only, so that it can be captured.
    fn catch_up_device(&mut self, step: Step, seqs: usize) -> Result<()> {
        let (dev, hid) = (&*self.inner.dev, self.inner.config.hidden_size);
        let n = step.rows;
        let layer = self.inner.mtp.as_ref().ok_or_else(no_layer)?;
        let st = self.mtp.as_mut().ok_or_else(no_layer)?;
        {
            let y2 = &mut self.scratch.y2.slice_mut(..n * hid);
            let pairs = &st.buf.launch;
            ops::copy_rows(dev, &st.buf.saved, &pairs.slice(..2 * n), hid, y2)?;
            ops::copy_rows(dev, &st.buf.rows, &pairs.slice(2 * n..4 * n), hid, y2)?;
        }
        layer_forward(&self.inner, layer, &mut self.scratch, st, step, true)?;
        ops::copy_rows(
            dev,
            &self.scratch.h.slice(..n * hid),
            &st.buf.launch.slice(4 * n..4 * n + 2 * seqs),
            hid,
            &mut st.buf.last,
        )?;
        Ok(())
    }

    /// Queues the draft steps of the drafting jobs `order` (batched, the still-drafting ones a prefix): the head's
    /// pick over each job's last output, merged over the ranks, fed back through the layer; every step's metadata
    /// is uploaded first and the loop replays as one graph. Returns the draft steps (the picks are read by
    /// [`GpuRank::read_picks`]).
    fn draft(&mut self, jobs: &[MtpJob], order: &[usize]) -> Result<usize> {
        let j = order.len();
        let steps = order.first().map_or(0, |&i| jobs[i].drafts);
        if steps == 0 {
            return Ok(0);
        }
        let active: Vec<usize> = (0..steps)
            .map(|d| order.iter().take_while(|&&i| jobs[i].drafts > d).count())
            .collect();
        let max_seqs = self.sizes.max_seqs;
        let meta = draft_meta(jobs, order, max_seqs)?;
        let dev = self.inner.dev.clone();
        {
            let st = self.mtp.as_mut().ok_or_else(no_layer)?;
            if steps > st.buf.keep {
                return Err(EngineError::InvalidInput(format!(
                    "an MTP job drafts {steps} tokens, this rank drafts at most {} (its verify window)",
                    st.buf.keep
                )));
            }
            if !meta.is_empty() {
                put(&dev, &mut st.buf.meta, &meta, "MTP draft steps")?;
            }
        }
        // The head's requests (none) for every drafting row; each step reads a prefix of them.
        self.prepare_head(j, false, HeadSpec::Host(&[]), &[])?;
        let key = Some(GraphKey::MtpDraft { active: active.clone() });
        let stream = dev.stream().clone();
        let mut graphs = std::mem::replace(&mut self.graphs, StepGraphs::new(false));
        let ran = graphs.run(key, &stream, || self.draft_device(&active));
        self.graphs = graphs;
        ran?;
        Ok(steps)
    }

    /// The draft loop's device work (`active[d]` jobs draft at step `d`), its metadata uploaded. Queues device work
    /// only, so that it can be captured.
    fn draft_device(&mut self, active: &[usize]) -> Result<()> {
        let (hid, world, vocab) = (
            self.inner.config.hidden_size,
            self.info.tp,
            self.inner.config.vocab_size,
        );
        let (j, m) = (active.first().copied().unwrap_or(0), self.sizes.max_seqs);
        let dev = self.inner.dev.clone();
        let words = SUMMARY_WORDS;
        for (d, &act) in active.iter().enumerate() {
            {
                let st = self.mtp.as_mut().ok_or_else(no_layer)?;
                let s = &mut self.scratch;
                head_pass(
                    &self.inner,
                    &mut s.logits,
                    &mut s.head,
                    &st.buf.last.slice(..act * hid),
                    act,
                    false,
                )?;
                let local = s.head.out.slice(..act * words);
                if world > 1 {
                    let comm = self.inner.comm.as_deref().ok_or_else(|| {
                        EngineError::Communicator(format!(
                            "rank {} of {world} has no communicator to merge its MTP drafts",
                            self.info.rank
                        ))
                    })?;
                    comm.all_gather_u32(&local, &mut st.buf.gathered.slice_mut(..world * act * words))?;
                }
                let gathered = if world > 1 {
                    st.buf.gathered.slice(..world * act * words)
                } else {
                    s.head.out.slice(..act * words)
                };
                ops::chain_pick(
                    &dev,
                    &local,
                    &gathered,
                    world,
                    words,
                    &s.argmax.slice(..act),
                    false,
                    vocab,
                    &mut s.tokens.slice_mut(..act),
                    &mut st.buf.words.slice_mut(d * j * words..(d * j + act) * words),
                    &mut st.buf.ids.slice_mut(..act),
                )?;
                dev.stream()
                    .memcpy_dtod(&s.tokens.slice(..act), &mut st.buf.picks.slice_mut(d * j..d * j + act))
                    .map_err(|e| EngineError::Gpu(format!("logging the MTP drafts: {e}")))?;
            }
            // The jobs that draft again run their pick through the layer, at the KV index after their rows: the
            // step's slots, KV indices and lengths come from the metadata uploaded for the whole loop.
            let cont = active.get(d + 1).copied().unwrap_or(0);
            if cont == 0 {
                continue;
            }
            {
                let st = self.mtp.as_ref().ok_or_else(no_layer)?;
                let s = &mut self.scratch;
                let at = d * META_WORDS * m;
                let meta = &st.buf.meta;
                let stream = dev.stream();
                stream
                    .memcpy_dtod(&meta.slice(at..at + cont), &mut s.row_slots.slice_mut(..cont))
                    .and_then(|()| stream.memcpy_dtod(&meta.slice(at..at + cont), &mut s.seq_slots.slice_mut(..cont)))
                    .and_then(|()| {
                        stream.memcpy_dtod(&meta.slice(at + m..at + m + cont), &mut s.row_pos.slice_mut(..cont))
                    })
                    .and_then(|()| stream.memcpy_dtod(&meta.slice(at + 2 * m..at + 3 * m), &mut s.lens.slice_mut(..m)))
                    .map_err(|e| EngineError::Gpu(format!("setting an MTP draft step's metadata: {e}")))?;
            }
            let step = self.step_shape(cont, cont, 1, false, SsmRun::Recurrent);
            let layer = self.inner.mtp.as_ref().ok_or_else(no_layer)?;
            let st = self.mtp.as_mut().ok_or_else(no_layer)?;
            layer_forward(&self.inner, layer, &mut self.scratch, st, step, false)?;
            dev.stream()
                .memcpy_dtod(
                    &self.scratch.h.slice(..cont * hid),
                    &mut st.buf.last.slice_mut(..cont * hid),
                )
                .map_err(|e| EngineError::Gpu(format!("keeping the MTP outputs: {e}")))?;
        }
        Ok(())
    }

    /// The one read-back of the drafts (`steps` draft steps of the jobs `order`, step-major `[steps, order.len()]`):
    /// it waits for every step. A NaN summary fails the step.
    fn read_picks(&mut self, jobs: &[MtpJob], order: &[usize], steps: usize) -> Result<Vec<i32>> {
        if steps == 0 {
            return Ok(Vec::new());
        }
        let j = order.len();
        let dev = self.inner.dev.clone();
        let st = self.mtp.as_ref().ok_or_else(no_layer)?;
        let picks = dev.download(&st.buf.picks.slice(..steps * j))?;
        let words = dev.download(&st.buf.words.slice(..steps * j * SUMMARY_WORDS))?;
        for d in 0..steps {
            for (k, &i) in order.iter().enumerate().take_while(|(_, &i)| jobs[i].drafts > d) {
                let w = &words[(d * j + k) * SUMMARY_WORDS..(d * j + k + 1) * SUMMARY_WORDS];
                if f32::from_bits(w[1]).is_nan() {
                    return Err(EngineError::NonFinite {
                        position: jobs[i].next.map_or(0, |(p, _)| p + d),
                    });
                }
            }
        }
        Ok(picks)
    }

    /// Saves the rows each job names for the next step's repair into its slot's place.
    fn save_rows(&mut self, jobs: &[MtpJob]) -> Result<()> {
        let hid = self.inner.config.hidden_size;
        let dev = self.inner.dev.clone();
        let st = self.mtp.as_mut().ok_or_else(no_layer)?;
        let mut pairs = Vec::new();
        for job in jobs {
            let first = st.first_row[job.slot].ok_or_else(|| {
                EngineError::InvalidInput(format!(
                    "slot {}: an MTP job of a sequence the step did not run",
                    job.slot
                ))
            })?;
            for (k, i) in job.save.1.clone().enumerate() {
                pairs.extend([(first + i) as i32, (job.slot * st.buf.keep + k) as i32]);
            }
        }
        let GpuMtp { buf, .. } = st;
        copy_pairs(&dev, &mut buf.pairs, &pairs, &buf.rows, hid, &mut buf.saved)
    }

    /// Uploads a layer launch's tokens (unless empty: the device holds them), each row's slot and KV index, the
    /// sequences' slots and each slot's KV length.
    fn upload_mtp_step(
        &mut self,
        tokens: &[i32],
        row_slots: &[i32],
        row_pos: &[i32],
        seq_slots: &[i32],
        lens: &[i32],
    ) -> Result<()> {
        let (dev, s) = (&*self.inner.dev, &mut self.scratch);
        if !tokens.is_empty() {
            put(dev, &mut s.tokens, tokens, "MTP tokens")?;
        }
        put(dev, &mut s.row_slots, row_slots, "MTP row slots")?;
        put(dev, &mut s.row_pos, row_pos, "MTP KV indices")?;
        put(dev, &mut s.seq_slots, seq_slots, "MTP sequence slots")?;
        put(dev, &mut s.lens, lens, "MTP KV lengths")
    }
}

/// The MTP timing's events, when the rank has the layer and times it.
fn st_timing<A: Act>(mtp: &mut Option<GpuMtp<A>>) -> Option<&mut StageMarks> {
    mtp.as_mut().and_then(|m| m.timing.as_mut())
}

fn no_layer() -> EngineError {
    EngineError::InvalidInput(
        "the plan asks for MTP drafts, but this rank loaded no MTP layer (start it with the MTP drafter)".into(),
    )
}
