//! The CPU rank: [`Decoder`] (one shard of the model, its pools and an in-process communicator) behind the
//! [`Rank`] interface, and [`cpu_group`], which loads `tp` of them, each on its own thread.

use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::group::RankGroup;
use super::launch::{Abort, Launch, Launcher, RankLoader};
use rewind_kernels::cpu::lm_head::{self, SpecRequest};

use super::executor::{self, SingleSteps};
use super::plan::{
    Batch, Commit, Program, RankHealth, RankInfo, RowSummary, Rows, SeqKind, SeqStep, SlotSnapshot, StepOut, StepPlan,
};
use super::vocab::{merge_rows, summarise_row};
use super::Rank;
use super::RowPass;
use crate::decode::{Decoder, DecoderConfig, FormChoice, Item, Phase};
use crate::error::{EngineError, Result};
use crate::shard::{LocalComm, ShardedModel, TcpAbort, TcpComm, TcpRendezvous};

/// How to build a group of CPU ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuOptions {
    /// Tensor-parallel ranks (threads).
    pub tp: usize,
    /// Every rank's decoder sizes.
    pub decoder: DecoderConfig,
}

/// Loads the checkpoint in `dir` as `opts.tp` CPU ranks, each on its own thread with its shard, pools and
/// communicator.
pub fn cpu_group(dir: &Path, opts: &CpuOptions) -> Result<RankGroup> {
    RankGroup::start(&CpuLauncher::new(dir, opts.clone())?)
}

/// Starts generations of CPU ranks: each launch makes a fresh in-process communicator group, and each rank loads
/// its shard from the checkpoint on its own thread.
#[derive(Clone, Debug)]
pub struct CpuLauncher {
    dir: PathBuf,
    opts: CpuOptions,
    /// Load the checkpoint's MTP layer on every rank, to draft with it there ([`super::mtp`]).
    mtp: bool,
}

impl CpuLauncher {
    /// A launcher of `opts.tp` ranks of the checkpoint in `dir`.
    pub fn new(dir: &Path, opts: CpuOptions) -> Result<Self> {
        if opts.tp == 0 {
            return Err(EngineError::InvalidInput("--tp must be at least 1".into()));
        }
        Ok(CpuLauncher {
            dir: dir.to_path_buf(),
            opts,
            mtp: false,
        })
    }

    /// This launcher with every rank loading its share of the checkpoint's MTP layer, so that plans may ask the
    /// ranks for MTP drafts ([`super::Batch::mtp`]); a checkpoint without one fails the launch with a clear error.
    pub fn with_mtp(mut self, mtp: bool) -> Self {
        self.mtp = mtp;
        self
    }
}

impl Launcher for CpuLauncher {
    fn tp(&self) -> usize {
        self.opts.tp
    }

    fn name(&self) -> &str {
        "cpu-rank"
    }

    fn launch(&self) -> Result<Launch> {
        let comms = LocalComm::group(self.opts.tp);
        let abort = Abort::new();
        abort.on_abort(comms[0].abort_handle());
        let handles = Arc::new(Mutex::new(comms.into_iter().map(Some).collect::<Vec<_>>()));
        let this = self.clone();
        let load: RankLoader = Arc::new(move |rank| {
            let comm = handles
                .lock()
                .map_err(|_| EngineError::Communicator("the communicator handles were poisoned".into()))?
                .get_mut(rank)
                .and_then(Option::take)
                .ok_or_else(|| EngineError::Communicator(format!("no communicator handle for rank {rank}")))?;
            this.load_rank(rank, Box::new(comm))
        });
        Ok(Launch {
            load,
            abort,
            settle: super::launch::settled,
        })
    }
}

/// How a rank in a worker process of its own meets the other ranks of its generation ([`CpuLauncher::launch_process`]).
pub enum Meet {
    /// Rank 0 hosts the rendezvous it opened (its address was handed to the other ranks).
    Host(TcpRendezvous),
    /// Another rank joins the rendezvous at this address.
    Join(SocketAddr),
}

/// How long a rank in a worker process waits for its peers to reach the rendezvous.
const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(120);

impl CpuLauncher {
    /// Loads one rank with `comm` (the one loader of threads and processes alike).
    fn load_rank(&self, rank: usize, comm: Box<dyn crate::shard::Communicator>) -> Result<Box<dyn Rank>> {
        let model = ShardedModel::from_dir_with(&self.dir, self.opts.tp, rank, self.mtp)?;
        let decoder = Decoder::new(Arc::new(model), comm, self.opts.decoder.clone())?;
        Ok(Box::new(super::mtp_cpu::CpuRank {
            decoder,
            mtp: Default::default(),
        }))
    }

    /// One generation's launch of rank `rank` alone, in a worker process of its own: its loader meets the other
    /// ranks' processes over TCP ([`TcpComm`]) as `meet` says, and the abort closes its links.
    pub fn launch_process(&self, rank: usize, meet: Meet) -> Result<Launch> {
        let tp = self.opts.tp;
        if rank >= tp {
            return Err(EngineError::InvalidInput(format!(
                "rank {rank} does not exist (tp {tp})"
            )));
        }
        let links = TcpAbort::new();
        let abort = Abort::new();
        let hook = links.clone();
        abort.on_abort(move |why| hook.abort(why));
        let meet = Arc::new(Mutex::new(Some(meet)));
        let this = self.clone();
        let load: RankLoader = Arc::new(move |r| {
            if r != rank {
                return Err(EngineError::InvalidInput(format!(
                    "this worker process loads rank {rank}, not rank {r}"
                )));
            }
            let meet = meet
                .lock()
                .map_err(|_| EngineError::Communicator("the rendezvous was poisoned".into()))?
                .take()
                .ok_or_else(|| EngineError::Communicator(format!("rank {rank} was loaded twice")))?;
            let comm = match meet {
                _ if tp == 1 => TcpComm::single(),
                Meet::Host(rv) => rv.accept(tp, &links, RENDEZVOUS_TIMEOUT)?,
                Meet::Join(addr) => TcpComm::connect(addr, rank, tp, &links, RENDEZVOUS_TIMEOUT)?,
            };
            this.load_rank(rank, Box::new(comm))
        });
        Ok(Launch {
            load,
            abort,
            settle: super::launch::settled,
        })
    }
}

impl Decoder {
    /// Checks a plan against this rank's slots before anything changes (the coordinator's books check it first;
    /// this keeps a rank that is driven directly just as safe).
    fn check_plan(&self, commits: &[Commit], seqs: &[SeqStep]) -> Result<()> {
        for (i, c) in commits.iter().enumerate() {
            if commits[..i].iter().any(|o| o.slot == c.slot) {
                return Err(EngineError::InvalidInput(format!("slot {} is committed twice", c.slot)));
            }
            self.check_commit(c.slot, c.accepted)?;
        }
        for s in seqs {
            let allocated = self.pools().slots().is_allocated(s.slot);
            if allocated {
                let pos = self.position(s.slot)?;
                let committed = commits.iter().find(|c| c.slot == s.slot).map(|c| c.accepted);
                let pending = self.pending(s.slot)?;
                if pending > 0 && committed.is_none() {
                    return Err(EngineError::InvalidInput(format!(
                        "slot {} has {pending} verified tokens awaiting commit",
                        s.slot
                    )));
                }
                if s.position != pos + committed.unwrap_or(0) {
                    return Err(EngineError::InvalidInput(format!(
                        "slot {} is at position {}, the plan says {}",
                        s.slot,
                        pos + committed.unwrap_or(0),
                        s.position
                    )));
                }
                if self.form_choice(s.slot)? != s.form {
                    return Err(EngineError::InvalidInput(format!(
                        "slot {} decodes in the {} form, the plan says {}",
                        s.slot,
                        self.form_choice(s.slot)?,
                        s.form
                    )));
                }
            } else if s.position != 0 {
                return Err(EngineError::InvalidInput(format!(
                    "slot {} holds no sequence, so its first step must start at position 0, not {}",
                    s.slot, s.position
                )));
            } else if s.slot >= self.config().slots {
                return Err(EngineError::InvalidInput(format!(
                    "slot {} is out of range ({} slots)",
                    s.slot,
                    self.config().slots
                )));
            }
            if let Some(sample) = &s.sample {
                if s.rows == Rows::None {
                    return Err(EngineError::InvalidInput(format!(
                        "slot {}: sampling needs a reported row",
                        s.slot
                    )));
                }
                sample.validate(self.model().config().vocab_size)?;
            }
        }
        Ok(())
    }
}

impl Rank for Decoder {
    fn info(&self) -> RankInfo {
        let plan = self.model().plan();
        RankInfo {
            rank: plan.rank,
            tp: plan.tp,
            device: "cpu".into(),
            vocab: plan.vocab.clone(),
            slots: self.config().slots,
            max_context: self.config().max_context,
            max_verify: self.config().max_verify,
            max_batch: None,
            kv_blocks: self.pools().kv_blocks().total(),
            kv_block_size: self.pools().kv_blocks().block_size(),
            chunked_prefill: true,
            forms: FormChoice::ALL.to_vec(),
            snapshots: true,
            spec_summaries: true,
            logprobs: true,
            max_chained: crate::rank::MAX_CHAINED,
            hidden_states: true,
            mtp: false,
        }
    }

    fn step(&mut self, plan: &StepPlan) -> Result<StepOut> {
        let _span =
            tracing::debug_span!("cpu_rank_step", seqs = plan.seq_count(), commits = plan.commits.len()).entered();
        match &plan.program {
            Program::Batch(b) => self.single(&plan.commits, b),
            // The CPU reads every pick anyway: its chains are the executor's host loops of single steps, the twins
            // the GPU's device-resident chains are checked against.
            Program::DecodeChain(c) => {
                c.check(crate::rank::MAX_CHAINED)?;
                executor::decode_chain(self, &plan.commits, c)
            }
            Program::VerifyChain(c) => {
                c.check(self.model().config().vocab_size)?;
                executor::verify_chain(self, &plan.commits, c)
            }
        }
    }

    fn release(&mut self, slot: usize) -> Result<()> {
        Decoder::release(self, slot)
    }

    fn snapshot(&mut self, slot: usize) -> Result<SlotSnapshot> {
        Decoder::snapshot(self, slot)
    }

    fn restore(&mut self, slot: usize, snapshot: &SlotSnapshot) -> Result<()> {
        Decoder::restore(self, slot, snapshot)
    }

    fn store(&mut self, slot: usize, id: u64) -> Result<Option<u64>> {
        Decoder::store(self, slot, id).map(Some)
    }

    fn restore_stored(&mut self, slot: usize, id: u64) -> Result<()> {
        Decoder::restore_stored(self, slot, id)
    }

    fn drop_stored(&mut self, ids: &[u64]) -> Result<()> {
        Decoder::drop_stored(self, ids);
        Ok(())
    }

    fn health(&mut self) -> Result<RankHealth> {
        let plan = self.model().plan();
        Ok(RankHealth {
            rank: plan.rank,
            tp: plan.tp,
            device: "cpu".into(),
            slots_in_use: self.pools().slots().used_count(),
            steps: self.steps(),
            graphs: None,
            stages: None,
        })
    }
}

impl SingleSteps for Decoder {
    fn single(&mut self, commits: &[Commit], b: &Batch) -> Result<StepOut> {
        if self.comm().size() > 1 && b.seqs.iter().any(|s| s.sample.is_some()) {
            return self.step_joined(commits, b);
        }
        self.step_batch(commits, b)
    }

    fn merged(&self, rows: &[RowSummary]) -> Result<Vec<RowPass>> {
        Decoder::merged(self, rows)
    }
}

impl Decoder {
    /// A single step of `b` after `commits`, sampling on this rank (whole rows: TP 1, or rows joined by
    /// [`Decoder::step_joined`]).
    fn step_batch(&mut self, commits: &[Commit], b: &Batch) -> Result<StepOut> {
        self.check_plan(commits, &b.seqs)?;
        for c in commits {
            self.commit(c.slot, c.accepted)?;
        }
        let vocab = self.model().plan().vocab.clone();
        if b.seqs.is_empty() {
            return Ok(StepOut {
                vocab,
                rows: Vec::new(),
                logits: b.full_logits.then(Vec::new),
                hidden: b.hidden.then(Vec::new),
                chain: None,
                mtp: Vec::new(),
            });
        }
        let mut claimed = Vec::new();
        for s in &b.seqs {
            if !self.pools().slots().is_allocated(s.slot) {
                self.start_at(s.slot, s.form)?;
                claimed.push(s.slot);
            }
        }
        let items: Vec<Item> = b
            .seqs
            .iter()
            .map(|s| Item {
                slot: s.slot,
                phase: match s.kind {
                    SeqKind::Prefill => Phase::Prefill,
                    SeqKind::Decode => Phase::Decode,
                    SeqKind::Verify => Phase::Verify,
                },
                tokens: &s.tokens,
            })
            .collect();
        let x = match self.advance(&items) {
            Ok(x) => x,
            Err(e) => {
                for slot in claimed {
                    self.release(slot)?;
                }
                return Err(e);
            }
        };
        let hidden = self.model().config().hidden_size;
        let mut picked = Vec::with_capacity(b.seqs.iter().map(SeqStep::row_count).sum::<usize>() * hidden);
        let mut at = 0;
        for s in &b.seqs {
            let t = s.tokens.len();
            let first = at + t - s.row_count();
            picked.extend_from_slice(&x[first * hidden..(at + t) * hidden]);
            at += t;
        }
        // Hidden rows for a drafter: a prefill chunk's every row (an MTP layer's KV covers the prompt), the
        // reported rows otherwise; copied from the residual stream, past the head.
        let hidden_rows = b.hidden.then(|| {
            let mut out = Vec::with_capacity(b.seqs.iter().map(SeqStep::hidden_row_count).sum::<usize>() * hidden);
            let mut at = 0;
            for s in &b.seqs {
                let t = s.tokens.len();
                out.extend_from_slice(&x[(at + t - s.hidden_row_count()) * hidden..(at + t) * hidden]);
                at += t;
            }
            out
        });
        let spec = spec_requests(&b.seqs);
        let logprob: Vec<_> = b.seqs.iter().flat_map(SeqStep::logprob_requests).collect();
        let asks_logprobs = logprob.iter().any(Option::is_some);
        let sampling = b.seqs.iter().any(|s| s.sample.is_some());
        let width = vocab.len().max(1);
        // Whole logit rows only where someone reads them (the caller, or the sampler's filters); every other row
        // is summarised in one pass over the head, writing nothing of the vocabulary's size. A step asking for
        // log-probabilities (its prompt rows may be many) writes whole rows for its sampled rows alone.
        let whole = b.full_logits || (sampling && !asks_logprobs);
        let n_rows = b.seqs.iter().map(SeqStep::row_count).sum::<usize>();
        let spec_rows = spec.iter().filter(|s| s.is_some()).count();
        self.head_traffic = if whole {
            lm_head::head_logits_traffic(n_rows, hidden, vocab.len())
        } else {
            lm_head::head_pass_traffic(n_rows, hidden, vocab.len(), spec_rows)
        };
        let (mut rows, logits) = if whole {
            let logits = self.model().head(&picked);
            let mut rows: Vec<_> = logits
                .chunks_exact(width)
                .map(|r| summarise_row(r, vocab.start))
                .collect();
            if spec.iter().any(Option::is_some) || asks_logprobs {
                for (row, pass) in rows.iter_mut().zip(self.model().head_pass(&picked, &spec, &logprob)) {
                    row.pass.spec = pass.spec;
                    row.pass.logprob = pass.logprob;
                }
            }
            (rows, Some(logits))
        } else {
            let rows = self
                .model()
                .head_pass(&picked, &spec, &logprob)
                .into_iter()
                .map(RowSummary::from)
                .collect();
            (rows, None)
        };
        let mut row = 0;
        for s in &b.seqs {
            row += s.row_count();
            if let Some(sample) = &s.sample {
                let last = row - 1;
                let own;
                let logits = match &logits {
                    Some(l) => &l[last * width..(last + 1) * width],
                    None => {
                        own = self.model().head(&picked[last * hidden..(last + 1) * hidden]);
                        &own[..]
                    }
                };
                let id = sample.sample(logits);
                rows[last].sampled = Some(id);
                note_sampled_logit(&mut rows[last], id, logits, vocab.start);
            }
        }
        Ok(StepOut {
            vocab,
            rows,
            logits: if b.full_logits { logits } else { None },
            hidden: hidden_rows,
            chain: None,
            mtp: Vec::new(),
        })
    }
}

impl Decoder {
    /// A step of `plan`, whose sequences sample, on a tensor-parallel rank: it runs without the sampling, asking for
    /// the logit slices of every row, then gathers each sampled sequence's (last) row whole from every rank's slice
    /// and samples it with its draw, so every rank reaches the token a whole-vocabulary rank would draw. The slices
    /// are dropped unless the plan asked for them.
    fn step_joined(&mut self, commits: &[Commit], b: &Batch) -> Result<StepOut> {
        self.check_plan(commits, &b.seqs)?;
        let mut bare = b.clone();
        for s in &mut bare.seqs {
            s.sample = None;
        }
        bare.full_logits = true;
        let mut out = self.step_batch(commits, &bare)?;
        self.sample_gathered(&mut out, &b.seqs)?;
        if !b.full_logits {
            out.logits = None;
        }
        Ok(out)
    }

    /// Samples the sampled sequences' rows of `out` (the answer to `plan` run with its logit slices) from the whole
    /// rows gathered from every rank.
    fn sample_gathered(&self, out: &mut StepOut, seqs: &[SeqStep]) -> Result<()> {
        let comm = self.comm();
        let logits = out
            .logits
            .as_deref()
            .ok_or_else(|| EngineError::InvalidInput("a step asked for its logit slices returned none".into()))?;
        let width = out.vocab.len();
        let vocab = self.model().config().vocab_size;
        // Every rank's slice, as the checkpoint was cut (`shard::even_split`, which the GPU ranks' join uses too): the
        // widths may differ, so each rank sends its rows padded to the widest.
        let ranges: Vec<Range<usize>> = (0..comm.size())
            .map(|r| crate::shard::even_split(vocab, comm.size(), r))
            .collect();
        if ranges.get(comm.rank()) != Some(&out.vocab) {
            return Err(EngineError::Communicator(format!(
                "rank {} holds vocabulary ids {:?}, not its even share of {vocab} over {} ranks",
                comm.rank(),
                out.vocab,
                comm.size()
            )));
        }
        let widest = ranges.iter().map(Range::len).max().unwrap_or(0);
        // The sampled sequences' reported (last) rows, with the draw of this step.
        let mut wanted = Vec::new();
        let mut row = 0;
        for s in seqs {
            row += s.row_count();
            if let Some(sample) = &s.sample {
                wanted.push((row - 1, sample));
            }
        }
        let mut send = vec![f32::NEG_INFINITY; wanted.len() * widest];
        for (i, (r, _)) in wanted.iter().enumerate() {
            send[i * widest..i * widest + width].copy_from_slice(&logits[r * width..(r + 1) * width]);
        }
        let mut all = vec![0.0f32; send.len() * comm.size()];
        comm.all_gather(&send, &mut all)?;
        // Each rank's rows without their padding, joined into whole rows as the coordinator joins slices (which
        // also checks that the slices tile the vocabulary in rank order).
        let parts: Vec<Vec<f32>> = ranges
            .iter()
            .zip(all.chunks_exact(send.len().max(1)))
            .map(|(slice, rank)| {
                rank.chunks_exact(widest.max(1))
                    .flat_map(|r| &r[..slice.len()])
                    .copied()
                    .collect()
            })
            .collect();
        let part_refs: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
        let whole = super::vocab::join_slices(&part_refs, &ranges, wanted.len(), vocab)?;
        for ((r, sample), row) in wanted.iter().zip(whole.chunks_exact(vocab.max(1))) {
            let id = sample.sample(row);
            out.rows[*r].sampled = Some(id);
            note_sampled_logit(&mut out.rows[*r], id, row, 0);
        }
        Ok(())
    }

    /// Each row's summary over the whole vocabulary, one-pass speculative part included: under tensor parallelism
    /// every rank's slice summaries are gathered (as words, so ids and values come through exactly) and merged in
    /// rank order as the coordinator merges them, so every rank reaches the same picks and verdicts.
    fn merged(&self, rows: &[RowSummary]) -> Result<Vec<RowPass>> {
        let comm = self.comm();
        if comm.size() == 1 {
            return rows.iter().map(|r| merge_rows(std::slice::from_ref(r))).collect();
        }
        // Per row: max logit, argmax, log-sum-exp, then the speculative summary (with its flag, and its drafted
        // logit's).
        const WORDS: usize = 9;
        let send: Vec<f32> = rows
            .iter()
            .flat_map(|r| {
                let p = r.pass;
                let sp = p.spec;
                let drafted = sp.and_then(|x| x.drafted);
                let words: [u32; WORDS] = [
                    p.max.to_bits(),
                    p.argmax,
                    p.lse.to_bits(),
                    u32::from(sp.is_some()),
                    sp.map_or(0, |x| x.lse.to_bits()),
                    u32::from(drafted.is_some()),
                    drafted.unwrap_or(0.0).to_bits(),
                    sp.map_or(0, |x| x.candidate),
                    sp.map_or(0, |x| x.score.to_bits()),
                ];
                words.map(f32::from_bits)
            })
            .collect();
        let mut all = vec![0.0f32; send.len() * comm.size()];
        comm.all_gather(&send, &mut all)?;
        (0..rows.len())
            .map(|i| {
                let parts: Vec<RowSummary> = all
                    .chunks_exact(send.len())
                    .map(|rank| {
                        let w: Vec<u32> = rank[i * WORDS..(i + 1) * WORDS].iter().map(|v| v.to_bits()).collect();
                        RowSummary::from(RowPass {
                            max: f32::from_bits(w[0]),
                            argmax: w[1],
                            lse: f32::from_bits(w[2]),
                            spec: (w[3] != 0).then(|| lm_head::SpecSummary {
                                lse: f32::from_bits(w[4]),
                                drafted: (w[5] != 0).then(|| f32::from_bits(w[6])),
                                candidate: w[7],
                                score: f32::from_bits(w[8]),
                            }),
                            // Chains (the only readers of this gather) carry no log-probability requests.
                            logprob: None,
                        })
                    })
                    .collect();
                merge_rows(&parts)
            })
            .collect()
    }
}

/// Records, in a row that asked for log-probabilities, the raw logit of the token sampled from it (`row`: the logits of
/// ids `first_id ..` the sampler saw, which hold it): the sampled token is the row's log-probability target.
fn note_sampled_logit(summary: &mut RowSummary, id: u32, row: &[f32], first_id: usize) {
    if let Some(l) = summary.pass.logprob.as_mut() {
        l.target = (id as usize)
            .checked_sub(first_id)
            .and_then(|i| row.get(i))
            .map(|&v| (id, v));
    }
}

/// Per reported row of `seqs`, the one-pass speculative request of a verify that asked for one: row `i`'s draft is
/// the sequence's token `i + 1` (the last row, the bonus position, has none).
pub(crate) fn spec_requests(seqs: &[SeqStep]) -> Vec<Option<SpecRequest>> {
    seqs.iter().flat_map(SeqStep::spec_requests).collect()
}
