//! Chained verify steps on the GPU ([`Program::VerifyChain`](crate::rank::Program::VerifyChain), `rank/spec_chain.rs`): `1 + c` verifies back to back
//! with no host round trip between them — issue 10's device-side commit. Sequences are judged greedily or sampled
//! from their rows' one-pass summaries; for the sampled ones `chain_spec` writes each later step's requests and
//! judging key on the device.
//!
//! The first step is staged on the host like any verify (`gpu/steps.rs`, `stage_verify`). After each step, on the
//! device:
//! - `spec_accept` judges every sequence's window from its rows' summaries (merged over the ranks under tensor
//!   parallelism) into the drafts accepted and the next token;
//! - `chain_advance` moves each sequence's counters as the host rules do (`SlotCounters::after_step` and `commit`:
//!   the flush folded the committed history, the input token and the accepted drafts are committed), appends them to
//!   the sequence's stream, decides the next step's flush and writes the next step's replay row, input token,
//!   positions and attention length into the buffers the step's CUDA graph reads;
//! - `chain_draft` proposes the next window from the stream (n-gram lookup, or a table by position);
//! - `chain_spec`, when sequences sample, writes the next step's one-pass requests (drafts, temperature, noise key
//!   at the output index the position gives) and each sequence's judging key.
//!
//! The counters live on the device for the chain (one record per sequence, uploaded from the host's at its start).
//! The host reads the chain's log once at the end — every step's summaries, drafts and verdicts — and moves its own
//! counters and books by the same rules from the same verdicts, so the two copies cannot diverge. The CPU rank's loop
//! of single steps (`rank/executor.rs`, `verify_chain`) is the twin; `rewind selftest` checks a chain against single
//! steps on the GPU (`rank/spec_chain_check.rs`).
//!

use rewind_kernels::cpu::chain::{
    spec_requests, ChainParams, ChainSample, ChainSeq, CHAIN_SAMPLE_WORDS, CHAIN_STATE_WORDS, FAULT_FOLD,
    FAULT_HISTORY, FAULT_RING, FAULT_SLOT,
};
use rewind_kernels::cpu::lm_head::SpecRequest;
use rewind_kernels::cuda::ops::{self, DraftMode, JUDGE_WORDS, REPLAY_META, SPEC_WORDS, SUMMARY_WORDS};
use rewind_kernels::cuda::{CudaDevice, CudaSlice};
use tracing::debug_span;

use super::head::HeadSpec;
use super::rank::{GpuRank, HeadOut};
use super::Act;
use crate::error::{EngineError, Result};
use crate::rank::{ChainDrafter, ChainLog, RowSummary, SeqStep, VerifyChain};
use crate::state::{DecodeForm, StepPhase};

/// The chain's device buffers, grown to the largest chain seen.
pub(crate) struct SpecChainScratch {
    /// `[steps, rows, SUMMARY_WORDS]`: every step's rows' summaries.
    words: CudaSlice<u32>,
    /// `[steps, seqs, 2]`: accepted drafts and next token per step.
    verdicts: CudaSlice<i32>,
    /// `[steps, seqs, T]`: the drafts each step verified.
    drafts: CudaSlice<i32>,
    /// `[seqs, CHAIN_STATE_WORDS]`.
    state: CudaSlice<i32>,
    /// `[seqs]` fault bits.
    fault: CudaSlice<i32>,
    /// `[seqs, JUDGE_WORDS]`: each sequence's judging (greedy, or sampled with the step's output index).
    judge: CudaSlice<u32>,
    /// `[seqs, CHAIN_SAMPLE_WORDS]`: the sampled sequences' temperature and noise key (`chain_spec`).
    sample: CudaSlice<u32>,
    /// `[ranks, rows, SUMMARY_WORDS]`: every rank's summaries of a step (tensor parallelism).
    gathered: CudaSlice<u32>,
    /// `[seqs, hist_cap]` streams.
    hist: CudaSlice<i32>,
    /// `[seqs, table_cap]` draft tables (one element when unused).
    table: CudaSlice<i32>,
}

/// Grows `buf` to hold at least `len` elements (contents not kept).
fn ensure_len<T: rewind_kernels::cuda::DeviceRepr + rewind_kernels::cuda::ValidAsZeroBits>(
    dev: &CudaDevice,
    buf: &mut CudaSlice<T>,
    len: usize,
) -> Result<()> {
    if buf.len() < len {
        *buf = dev.alloc_zeros(len.max(1))?;
    }
    Ok(())
}

impl SpecChainScratch {
    fn new(dev: &CudaDevice) -> Result<Self> {
        Ok(SpecChainScratch {
            words: dev.alloc_zeros(1)?,
            verdicts: dev.alloc_zeros(1)?,
            drafts: dev.alloc_zeros(1)?,
            state: dev.alloc_zeros(1)?,
            fault: dev.alloc_zeros(1)?,
            judge: dev.alloc_zeros(1)?,
            sample: dev.alloc_zeros(1)?,
            gathered: dev.alloc_zeros(1)?,
            hist: dev.alloc_zeros(1)?,
            table: dev.alloc_zeros(1)?,
        })
    }
}

/// Puts `data` at the start of `buf`.
fn upload<T: rewind_kernels::cuda::DeviceRepr>(
    dev: &CudaDevice,
    buf: &mut CudaSlice<T>,
    data: &[T],
    what: &str,
) -> Result<()> {
    dev.stream()
        .memcpy_htod(data, &mut buf.slice_mut(..data.len()))
        .map_err(|e| EngineError::Gpu(format!("uploading a chain's {what}: {e}")))
}

/// What one chain of verifies runs with, fixed at its start ([`GpuRank::upload_chain`]).
struct ChainRun {
    /// Sequences, verify window, rows per step (`b × t`) and steps.
    b: usize,
    t: usize,
    rows: usize,
    steps: usize,
    hist_cap: usize,
    table_cap: usize,
    params: ChainParams,
    mode: DraftMode,
    /// Per sequence, its one-pass sampling (`None`: judged greedily).
    samples: Vec<Option<ChainSample>>,
    /// The first step's one-pass requests, from the host (later steps' come from `chain_spec` when any samples).
    first_spec: Vec<Option<SpecRequest>>,
}

impl ChainRun {
    fn sampled(&self) -> bool {
        self.samples.iter().any(Option::is_some)
    }
}

impl<A: Act> GpuRank<A> {
    /// Runs a plan of chained verifies (the books have checked and recorded it); returns every step's rows,
    /// step-major, and the chain's log.
    /// `seqs` holds each sequence's first verify ([`ChainedVerify::step`](crate::rank::ChainedVerify::step)).
    pub(super) fn run_spec_chain(&mut self, chain: &VerifyChain, seqs: &[&SeqStep]) -> Result<(HeadOut, ChainLog)> {
        let t = seqs.first().map_or(0, |s| s.tokens.len());
        let _span = debug_span!("gpu_spec_chain", batch = seqs.len(), steps = chain.steps + 1, t).entered();
        let world = self.info.tp;
        if world > 1 && self.inner.comm.is_none() {
            return Err(EngineError::Communicator(format!(
                "a chain of verifies on rank {} of {world} without a communicator to merge the ranks' summaries",
                self.info.rank
            )));
        }
        let steps = self.chain_steps(seqs, chain.steps + 1, t)?;
        let staged = self.stage_verify(seqs, t, false)?;
        let run = self.upload_chain(chain, seqs, &staged, steps, t)?;
        // The debug check: after each step, the device's metadata for the next one against the host's rules.
        let check = std::env::var_os("REWIND_CHAIN_CHECK").is_some_and(|v| v == "1");
        let mut streams: Vec<Vec<u32>> = chain.seqs.iter().map(|s| s.stream.clone()).collect();
        for k in 0..steps {
            // Every step has the shape of the first, whose ring bound (the rows' capacity, `stage_verify`) covers
            // any later step's rows.
            self.chain_step(&run, staged.step, k)?;
            if check && k + 1 < steps {
                self.check_step(seqs, chain, &run, &staged, k, &mut streams)?;
            }
        }
        let (logged, log) = self.read_chain(seqs, &run)?;
        // The host's copy of the counters follows the device's, by the same rules and verdicts (already, step by
        // step, under the debug check).
        let (b, first) = (run.b, if check { steps - 1 } else { 0 });
        for k in first..steps {
            self.mirror_step(seqs, &staged, k, t, &log.accepted[k * b..(k + 1) * b], k + 1 < steps)?;
        }
        self.books.settle_chain(chain, &log)?;
        self.steps += steps as u64 - 1;
        let spec_rows: Vec<bool> = (0..steps)
            .flat_map(|_| run.samples.iter().flat_map(|x| std::iter::repeat_n(x.is_some(), t)))
            .collect();
        let rows: Vec<RowSummary> = ops::decode_summaries(&logged, &spec_rows)
            .into_iter()
            .map(RowSummary::from)
            .collect();
        Ok((
            HeadOut {
                rows,
                logits: None,
                hidden: None,
            },
            log,
        ))
    }

    /// How many of `steps` verifies of `t` tokens the chain runs; refuses what the device cannot do in a chain: the
    /// recurrent form's baseline (its commit copies a snapshot chosen by the verdict). The compress of a kv-only ring
    /// reaching its threshold is a fold launch of its own, so a kv-only sequence below its threshold ends the chain
    /// before the step that could reach it (every step commits at most `t` entries): the log tells the caller how
    /// many steps ran.
    fn chain_steps(&self, seqs: &[&SeqStep], steps: usize, t: usize) -> Result<usize> {
        let mut steps = steps;
        for s in seqs {
            let form = self.form_before(s);
            if form == DecodeForm::Recurrent {
                return Err(EngineError::NotSupported(format!(
                    "a chain of verifies for slot {} in the recurrent form on this GPU rank (its baseline commit \
                     copies the snapshot a verdict chooses): plan single verify steps, or use --decode replay, \
                     kv-only or auto",
                    s.slot
                )));
            }
            let h = if self.books.started(s.slot) {
                self.counters.ring(s.slot).len
            } else {
                0
            };
            if form == DecodeForm::KvOnly && h < self.replay.threshold {
                steps = steps.min(1 + (self.replay.threshold - 1 - h) / t);
            }
        }
        Ok(steps)
    }

    /// Sizes the chain's buffers and uploads what its kernels start from: the sequences' counters and streams, the
    /// draft tables, the judging and sampling parameters and the first step's drafts.
    fn upload_chain(
        &mut self,
        chain: &VerifyChain,
        seqs: &[&SeqStep],
        staged: &super::steps::Staged,
        steps: usize,
        t: usize,
    ) -> Result<ChainRun> {
        let (b, world, words) = (seqs.len(), self.info.tp, SUMMARY_WORDS);
        let rows = b * t;
        let streams = chain.seqs.iter().map(|s| &s.stream);
        let hist_cap = (streams.clone().map(Vec::len).max().unwrap_or(0) + steps * t).next_multiple_of(256);
        let table_cap = chain.seqs.iter().map(|s| s.table.len()).max().unwrap_or(0).max(1);
        let states: Vec<i32> = seqs
            .iter()
            .zip(&staged.decisions)
            .zip(streams.clone())
            .flat_map(|((s, d), stream)| {
                let r = self.counters.ring(s.slot);
                ChainSeq {
                    slot: s.slot as i32,
                    position: s.position as i32,
                    ring_start: r.start as i32,
                    ring_len: r.len as i32,
                    ring_cap: r.capacity as i32,
                    conv_head: self.counters.conv(s.slot).start as i32,
                    form: d.form as u8 as i32,
                    hist_len: stream.len() as i32,
                }
                .encode()
            })
            .collect();
        debug_assert_eq!(states.len(), b * CHAIN_STATE_WORDS);
        let params = ChainParams {
            t,
            ring_capacity: self.counters.ring_capacity(),
            window: self.replay.max_verify,
            threshold: self.replay.threshold,
            conv_cap: self.counters.conv_capacity(),
            hist_cap,
        };
        let mode = match chain.drafter {
            ChainDrafter::Ngram { min_n, max_n } => DraftMode::Ngram { min_n, max_n },
            ChainDrafter::Table => DraftMode::Table { table_cap },
        };
        // Sampled sequences (one-pass judging): the first step's requests come from the host, later ones from
        // `chain_spec`, keyed by the position the device tracks.
        let samples: Vec<Option<ChainSample>> = seqs
            .iter()
            .map(|s| {
                s.spec
                    .map(|sp| ChainSample::at(sp.temperature, sp.seed, sp.index, s.position))
            })
            .collect();
        let sampled = samples.iter().any(Option::is_some);
        let first_spec: Vec<Option<SpecRequest>> = if sampled {
            seqs.iter().flat_map(|s| s.spec_requests()).collect()
        } else {
            Vec::new()
        };
        let dev = self.inner.dev.clone();
        if self.spec_chain.is_none() {
            self.spec_chain = Some(SpecChainScratch::new(&dev)?);
        }
        let c = self.spec_chain.as_mut().expect("allocated above");
        ensure_len(&dev, &mut c.words, steps * rows * words)?;
        ensure_len(&dev, &mut c.verdicts, steps * b * 2)?;
        ensure_len(&dev, &mut c.drafts, steps * b * (t - 1))?;
        ensure_len(&dev, &mut c.state, b * CHAIN_STATE_WORDS)?;
        ensure_len(&dev, &mut c.fault, b)?;
        ensure_len(&dev, &mut c.judge, b * JUDGE_WORDS)?;
        ensure_len(&dev, &mut c.gathered, world * rows * words)?;
        ensure_len(&dev, &mut c.hist, b * hist_cap)?;
        ensure_len(&dev, &mut c.table, b * table_cap)?;
        let mut hist = vec![0i32; b * hist_cap];
        for (q, stream) in streams.enumerate() {
            for (j, &x) in stream.iter().enumerate() {
                hist[q * hist_cap + j] = x as i32;
            }
        }
        upload(&dev, &mut c.hist, &hist, "streams")?;
        if let ChainDrafter::Table = chain.drafter {
            let mut table = vec![-1i32; b * table_cap];
            for (q, row) in chain.seqs.iter().map(|s| &s.table).enumerate() {
                table[q * table_cap..q * table_cap + row.len()].copy_from_slice(row);
            }
            upload(&dev, &mut c.table, &table, "draft tables")?;
        }
        upload(&dev, &mut c.state, &states, "counters")?;
        upload(&dev, &mut c.fault, &vec![0; b], "fault flags")?;
        let judge: Vec<u32> = seqs
            .iter()
            .flat_map(|s| ops::encode_judge(s.spec.map(|sp| (sp.seed, sp.index))))
            .collect();
        upload(&dev, &mut c.judge, &judge, "judging parameters")?;
        if sampled {
            ensure_len(&dev, &mut c.sample, b * CHAIN_SAMPLE_WORDS)?;
            let words: Vec<u32> = samples.iter().flat_map(|x| ChainSample::encode(x.as_ref())).collect();
            upload(&dev, &mut c.sample, &words, "sampling parameters")?;
        }
        let first: Vec<i32> = seqs
            .iter()
            .flat_map(|s| s.tokens[1..].iter().map(|&x| x as i32))
            .collect();
        upload(&dev, &mut c.drafts, &first, "first drafts")?;
        Ok(ChainRun {
            b,
            t,
            rows,
            steps,
            hist_cap,
            table_cap,
            params,
            mode,
            samples,
            first_spec,
        })
    }

    /// Chain step `k`'s device work: the verify (`step`'s shape), its summaries logged (and gathered from every
    /// rank), the verdicts; then, unless it is the last, the next step's counters, drafts and one-pass requests.
    fn chain_step(&mut self, run: &ChainRun, step: super::forward::Step, k: usize) -> Result<()> {
        let (b, t, rows, words, world) = (run.b, run.t, run.rows, SUMMARY_WORDS, self.info.tp);
        let dev = self.inner.dev.clone();
        let spec = if k > 0 && run.sampled() {
            HeadSpec::Device
        } else {
            HeadSpec::Host(&run.first_spec)
        };
        self.launch(step, rows, false, spec, &[])?;
        let (s, c) = (
            &mut self.scratch,
            self.spec_chain.as_mut().expect("allocated by upload_chain"),
        );
        dev.stream()
            .memcpy_dtod(
                &s.head.out.slice(..rows * words),
                &mut c.words.slice_mut(k * rows * words..(k + 1) * rows * words),
            )
            .map_err(|e| EngineError::Gpu(format!("logging a chain step's summaries: {e}")))?;
        if let (Some(comm), true) = (&self.inner.comm, world > 1) {
            comm.all_gather_u32(
                &s.head.out.slice(..rows * words),
                &mut c.gathered.slice_mut(..world * rows * words),
            )?;
        }
        let gathered = if world > 1 {
            c.gathered.slice(..world * rows * words)
        } else {
            c.words.slice(k * rows * words..(k + 1) * rows * words)
        };
        let dk = k * b * (t - 1)..(k + 1) * b * (t - 1);
        ops::spec_accept(
            &dev,
            &gathered,
            world,
            b,
            t,
            &c.drafts.slice(dk.clone()),
            &c.judge.slice(..b * JUDGE_WORDS),
            &mut c.verdicts.slice_mut(k * b * 2..(k + 1) * b * 2),
        )?;
        if k + 1 == run.steps {
            return Ok(());
        }
        let (hist_cap, table_cap) = (run.hist_cap, run.table_cap);
        ops::chain_advance(
            &dev,
            &c.verdicts.slice(k * b * 2..(k + 1) * b * 2),
            &c.drafts.slice(dk),
            &mut c.state.slice_mut(..b * CHAIN_STATE_WORDS),
            &mut c.hist.slice_mut(..b * hist_cap),
            &mut c.fault.slice_mut(..b),
            &mut s.meta.slice_mut(..b * REPLAY_META),
            &mut s.tokens.slice_mut(..rows),
            &mut s.row_pos.slice_mut(..rows),
            &mut s.lens.slice_mut(..self.sizes.max_seqs),
            &run.params,
            b,
        )?;
        ops::chain_draft(
            &dev,
            &c.hist.slice(..b * hist_cap),
            &c.state.slice(..b * CHAIN_STATE_WORDS),
            &c.fault.slice(..b),
            run.mode,
            &c.table.slice(..b * table_cap),
            t,
            &mut c.drafts.slice_mut((k + 1) * b * (t - 1)..(k + 2) * b * (t - 1)),
            &mut s.tokens.slice_mut(..rows),
            b,
        )?;
        if run.sampled() {
            ops::chain_spec(
                &dev,
                &c.state.slice(..b * CHAIN_STATE_WORDS),
                &c.fault.slice(..b),
                &c.sample.slice(..b * CHAIN_SAMPLE_WORDS),
                &s.tokens.slice(..rows),
                t,
                &mut s.head.spec_on_device(rows),
                &mut c.judge.slice_mut(..b * JUDGE_WORDS),
                b,
            )?;
        }
        Ok(())
    }

    /// The debug check after chain step `k` (not the last): reads its verdicts, extends `streams`, moves the host's
    /// counters over the step and checks the device's metadata for step `k + 1` ([`GpuRank::check_next`]).
    fn check_step(
        &mut self,
        seqs: &[&SeqStep],
        chain: &VerifyChain,
        run: &ChainRun,
        staged: &super::steps::Staged,
        k: usize,
        streams: &mut [Vec<u32>],
    ) -> Result<()> {
        let (b, t) = (run.b, run.t);
        let dev = self.inner.dev.clone();
        let c = self.spec_chain.as_ref().expect("allocated by upload_chain");
        let verdicts = dev.download(&c.verdicts.slice(k * b * 2..(k + 1) * b * 2))?;
        let verified = dev.download(&c.drafts.slice(k * b * (t - 1)..(k + 1) * b * (t - 1)))?;
        let accepted: Vec<usize> = verdicts.chunks_exact(2).map(|v| v[0].max(0) as usize).collect();
        for q in 0..b {
            let a = accepted[q];
            let d = &verified[q * (t - 1)..q * (t - 1) + a];
            streams[q].extend(d.iter().map(|&x| x as u32));
            streams[q].push(verdicts[2 * q + 1].max(0) as u32);
        }
        self.mirror_step(seqs, staged, k, t, &accepted, true)?;
        self.check_next(seqs, k + 1, t, &verdicts, streams, chain, &run.samples)
    }

    /// The one read-back of the chain (it waits for every step): every step's logged summaries and the chain's log,
    /// or the first sequence's fault.
    fn read_chain(&self, seqs: &[&SeqStep], run: &ChainRun) -> Result<(Vec<u32>, ChainLog)> {
        let (b, t, steps) = (run.b, run.t, run.steps);
        let dev = &self.inner.dev;
        let c = self.spec_chain.as_ref().expect("allocated by upload_chain");
        let logged = dev.download(&c.words.slice(..steps * run.rows * SUMMARY_WORDS))?;
        let verdicts = dev.download(&c.verdicts.slice(..steps * b * 2))?;
        let drafts = dev.download(&c.drafts.slice(..steps * b * (t - 1)))?;
        let faults = dev.download(&c.fault.slice(..b))?;
        if let Some((q, &f)) = faults.iter().enumerate().find(|(_, &f)| f != 0) {
            let why = if f & FAULT_RING != 0 {
                "its input ring overflowed"
            } else if f & FAULT_HISTORY != 0 {
                "its stream outgrew the chain's buffer"
            } else if f & FAULT_FOLD != 0 {
                "its kv-only ring reached the threshold"
            } else if f & FAULT_SLOT != 0 {
                "its slot is outside the rank's lengths"
            } else {
                "its verify could not be judged (a NaN row, or nothing left to resample)"
            };
            return Err(EngineError::Gpu(format!(
                "a chain of verifies failed for slot {}: {why} (fault bits {f:#x})",
                seqs[q].slot
            )));
        }
        if verdicts.chunks_exact(2).any(|v| v[1] < 0 || v[0] as usize >= t) {
            return Err(EngineError::Gpu(
                "the last verify of a chain could not be judged (a NaN row, or nothing left to resample)".into(),
            ));
        }
        let log = ChainLog {
            drafts: drafts.iter().map(|&d| d as u32).collect(),
            accepted: verdicts.chunks_exact(2).map(|v| v[0] as usize).collect(),
            tokens: verdicts.chunks_exact(2).map(|v| v[1].max(0) as u32).collect(),
        };
        Ok((logged, log))
    }

    /// Moves the host's counters over chain step `k` as the device did: the step's flush (decided now for `k > 0`),
    /// and, when `commit`, the input token and the `accepted` drafts of each sequence.
    fn mirror_step(
        &mut self,
        seqs: &[&SeqStep],
        staged: &super::steps::Staged,
        k: usize,
        t: usize,
        accepted: &[usize],
        commit: bool,
    ) -> Result<()> {
        for (q, s) in seqs.iter().enumerate() {
            let (form, flush, h) = if k == 0 {
                (
                    staged.decisions[q].form,
                    staged.decisions[q].flush,
                    staged.replay_rows[q].ring_len,
                )
            } else {
                let d = self.decide(s.slot, StepPhase::Verify, t);
                self.counters.set_flush(s.slot, d.flush);
                (d.form, d.flush, self.counters.ring(s.slot).len)
            };
            self.counters.after_step(s.slot, StepPhase::Verify, form, flush, h, t)?;
            if commit {
                self.counters.commit(s.slot, accepted[q] + 1)?;
            }
        }
        Ok(())
    }

    /// The debug check (`REWIND_CHAIN_CHECK=1`, a read-back per step): the replay rows, input tokens, positions and
    /// lengths the device wrote for chain step `k` against those the host's counters give.
    #[allow(clippy::too_many_arguments)]
    fn check_next(
        &self,
        seqs: &[&SeqStep],
        k: usize,
        t: usize,
        verdicts: &[i32],
        streams: &[Vec<u32>],
        chain: &VerifyChain,
        samples: &[Option<ChainSample>],
    ) -> Result<()> {
        let dev = &self.inner.dev;
        let s = &self.scratch;
        let b = seqs.len();
        let meta = dev.download(&s.meta.slice(..b * REPLAY_META))?;
        let tokens = dev.download(&s.tokens.slice(..b * t))?;
        let pos = dev.download(&s.row_pos.slice(..b * t))?;
        let lens = dev.download(&s.lens.slice(..self.sizes.max_seqs))?;
        let sampled = samples.iter().any(Option::is_some);
        let words = if sampled {
            dev.download(&s.head.spec_words(b * t))?
        } else {
            Vec::new()
        };
        let judge = match &self.spec_chain {
            Some(c) if sampled => dev.download(&c.judge.slice(..b * JUDGE_WORDS))?,
            _ => Vec::new(),
        };
        for (q, sq) in seqs.iter().enumerate() {
            let d = self.decide(sq.slot, StepPhase::Verify, t);
            let h = self.counters.ring(sq.slot).len;
            let want = self.replay_row(sq.slot, d.form, if d.flush { h } else { 0 }).encode();
            let got = &meta[q * REPLAY_META..(q + 1) * REPLAY_META];
            let (row_pos, len) = (&pos[q * t..(q + 1) * t], lens[sq.slot]);
            let position = streams[q].len() - 1;
            let want_pos: Vec<i32> = (position..position + t).map(|p| p as i32).collect();
            let mut want_tokens = vec![streams[q][position] as i32];
            want_tokens.extend(chain.draft(q, &streams[q], t - 1).into_iter().map(|x| x as i32));
            let got_tokens = &tokens[q * t..(q + 1) * t];
            if got != want || got_tokens != want_tokens || row_pos != want_pos || len != (position + t) as i32 {
                return Err(EngineError::Gpu(format!(
                    "chain step {k}, slot {}: the device wrote replay row {got:?}, tokens {got_tokens:?}, positions \
                     {row_pos:?}, length {len}; the host's rules give {want:?}, {want_tokens:?}, {want_pos:?}, {} \
                     (verdict {:?})",
                    sq.slot,
                    position + t,
                    &verdicts[2 * q..2 * q + 2]
                )));
            }
            if sampled {
                let (reqs, key) = spec_requests(samples[q].as_ref(), position as i32, &want_tokens);
                let want_words: Vec<u32> = reqs.iter().flat_map(|r| ops::encode_spec(r.as_ref())).collect();
                let got_words = &words[q * t * SPEC_WORDS..(q + 1) * t * SPEC_WORDS];
                let got_judge = &judge[q * JUDGE_WORDS..(q + 1) * JUDGE_WORDS];
                if got_words != want_words || got_judge != ops::encode_judge(key) {
                    return Err(EngineError::Gpu(format!(
                        "chain step {k}, slot {}: the device wrote one-pass requests {got_words:?} and judging \
                         {got_judge:?}; the host's rules give {want_words:?} and {:?}",
                        sq.slot,
                        ops::encode_judge(key)
                    )));
                }
            }
        }
        Ok(())
    }
}
