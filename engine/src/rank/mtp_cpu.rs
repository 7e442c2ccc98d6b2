//! The CPU rank's MTP drafting ([`super::mtp`]): the rank's share of the MTP layer (loaded with the model,
//! [`ShardedModel::mtp`](crate::shard::ShardedModel::mtp)), each slot's MTP KV, and the rows saved for a repair.
//! Under tensor parallelism every rank runs the same jobs: the layer's row-parallel outputs and the embedding are
//! all-reduced, and each draft is the argmax merged over every rank's vocabulary slice, so every rank drafts alike.

use rewind_kernels::cpu::gemm;

use super::mtp::{MtpBook, MtpJob, MtpProposal, MtpRow};
use super::plan::{Batch, Commit, SeqStep, StepOut};
use super::vocab::summarise_row;
use super::{Rank, RowSummary};
use crate::decode::Decoder;
use crate::error::{EngineError, Result};
use crate::model::mixers::attention::KvCache;
use crate::model::mtp::MtpHead;

/// Per slot: the MTP layer's KV and the target rows saved at the end of the slot's last step (before the final
/// norm, `[rows, hidden]`, positions [`MtpBook::saved`]).
#[derive(Default)]
pub(crate) struct CpuMtp {
    book: MtpBook,
    caches: Vec<Option<KvCache>>,
    saved: Vec<Vec<f32>>,
}

impl CpuMtp {
    /// Forgets `slot`'s MTP state (released or restored).
    pub(crate) fn forget(&mut self, slot: usize) {
        self.book.forget(slot);
        if let Some(c) = self.caches.get_mut(slot) {
            *c = None;
        }
        if let Some(s) = self.saved.get_mut(slot) {
            s.clear();
        }
    }

    /// Runs one batch whose [`Batch::mtp`] is not empty: the step (asking for the hidden rows), then every
    /// request's MTP work; the proposals go into the answer, the hidden rows only when the plan asked for them.
    pub(crate) fn step(&mut self, d: &mut Decoder, commits: &[Commit], b: &Batch) -> Result<StepOut> {
        let head = d.model().mtp().ok_or_else(|| {
            EngineError::InvalidInput(
                "the plan asks for MTP drafts, but this rank loaded no MTP layer (start it with the MTP drafter)"
                    .into(),
            )
        })?;
        let _ = head;
        check_requests(b)?;
        let asked_hidden = b.hidden;
        let mut with_hidden = b.clone();
        with_hidden.hidden = true;
        with_hidden.mtp.clear();
        self.book.prepare(&b.mtp, &b.seqs)?;
        let mut out = super::executor::SingleSteps::single(d, commits, &with_hidden)?;
        let merged = super::executor::SingleSteps::merged(d, &out.rows)?;
        let sampled: Vec<Option<u32>> = out.rows.iter().map(|r| r.sampled).collect();
        let jobs = self.book.jobs(&b.mtp, &b.seqs, &merged, &sampled)?;
        let hidden = out
            .hidden
            .take()
            .ok_or_else(|| EngineError::InvalidInput("the step returned no hidden rows".into()))?;
        let width = d.model().config().hidden_size;
        // Where each sequence's hidden rows start in the answer (every prompt row, the reported rows otherwise).
        let mut first = Vec::with_capacity(b.seqs.len());
        let mut at = 0;
        for s in &b.seqs {
            first.push(at);
            at += s.hidden_row_count();
        }
        let mut proposals = Vec::with_capacity(jobs.len());
        for job in &jobs {
            let i = b.seqs.iter().position(|s| s.slot == job.slot).unwrap_or(0);
            let s = &b.seqs[i];
            let rows = &hidden[first[i] * width..(first[i] + s.hidden_row_count()) * width];
            // The hidden rows start at the step's first token only when every row came back (a prompt chunk, or a
            // decode / verify reporting all of its rows); MTP sequences report all of their rows.
            if s.hidden_row_count() != s.tokens.len() {
                return Err(EngineError::InvalidInput(format!(
                    "slot {}: an MTP sequence must report every row of its step ({} of {})",
                    s.slot,
                    s.hidden_row_count(),
                    s.tokens.len()
                )));
            }
            let drafts = self.run_job(d, job, rows, width)?;
            if let Some((position, token)) = job.next {
                proposals.push(MtpProposal {
                    slot: job.slot,
                    position,
                    token,
                    drafts,
                });
            }
            let saved = &mut self.saved[job.slot];
            saved.clear();
            saved.extend_from_slice(&rows[job.save.1.start * width..job.save.1.end * width]);
        }
        self.book.ran(&jobs);
        out.mtp = proposals;
        if asked_hidden {
            out.hidden = Some(hidden);
        }
        Ok(out)
    }

    /// Runs `job`'s rows into its slot's MTP KV and drafts from the last output. `rows` are the sequence's hidden
    /// rows of this step.
    fn run_job(&mut self, d: &Decoder, job: &MtpJob, rows: &[f32], width: usize) -> Result<Vec<u32>> {
        let model = d.model();
        let head = model
            .mtp()
            .ok_or_else(|| EngineError::InvalidInput("no MTP layer on this rank".into()))?;
        if self.caches.len() <= job.slot {
            self.caches.resize_with(job.slot + 1, || None);
            self.saved.resize_with(job.slot + 1, Vec::new);
        }
        let saved_at = self.book.saved(job.slot).start;
        let mut input = Vec::with_capacity(job.rows.len() * width);
        for r in &job.rows {
            let row = match *r {
                MtpRow::Step(i) => &rows[i * width..(i + 1) * width],
                MtpRow::Saved(q) => {
                    let k = q - saved_at;
                    &self.saved[job.slot][k * width..(k + 1) * width]
                }
            };
            input.extend_from_slice(row);
        }
        let cache = self.caches[job.slot].get_or_insert_with(|| head.new_cache());
        cache.truncate(job.kv_index.min(cache.len()));
        if cache.len() != job.kv_index {
            return Err(EngineError::InvalidInput(format!(
                "slot {}: the MTP KV holds {} entries, the job starts at {}",
                job.slot,
                cache.len(),
                job.kv_index
            )));
        }
        let hidden = model.final_norm_rows(&input);
        let mut out = mtp_forward(d, head, &hidden, &job.tokens, cache)?;
        let mut drafts = Vec::with_capacity(job.drafts);
        while drafts.len() < job.drafts {
            let last = &out[out.len() - width..];
            let token = greedy(d, last)?;
            drafts.push(token);
            if drafts.len() < job.drafts {
                out = mtp_forward(d, head, last, &[token], cache)?;
            }
        }
        Ok(drafts)
    }
}

/// One MTP forward over `hidden` (`[t, hidden]`, already normed) with the tokens after each row, appending to `cache`.
fn mtp_forward(d: &Decoder, head: &MtpHead, hidden: &[f32], tokens: &[u32], cache: &mut KvCache) -> Result<Vec<f32>> {
    let model = d.model();
    let comm = d.comm();
    let emb = model.embed(tokens, comm)?;
    let tp = model.plan().tp;
    head.forward(&emb, hidden, tokens.len(), cache, &mut |y| {
        if tp > 1 {
            comm.all_reduce_sum(y)?;
        }
        Ok(())
    })
}

/// The greedy token of an MTP output row (already normed): the LM head over this rank's slice, merged over every
/// rank's slice (lowest id on ties).
fn greedy(d: &Decoder, row: &[f32]) -> Result<u32> {
    let model = d.model();
    let vocab = model.plan().vocab.clone();
    let logits = gemm::linear(row, model.lm_head_slice(), None, 1, row.len(), vocab.len());
    let summary: RowSummary = summarise_row(&logits, vocab.start);
    let merged = super::executor::SingleSteps::merged(d, std::slice::from_ref(&summary))?;
    let pick = merged
        .first()
        .ok_or_else(|| EngineError::InvalidInput("no merged MTP row".into()))?;
    if pick.max.is_nan() {
        return Err(EngineError::NonFinite { position: 0 });
    }
    Ok(pick.argmax)
}

/// The requests name distinct slots the batch steps, and each such sequence reports every row.
fn check_requests(b: &Batch) -> Result<()> {
    for (i, r) in b.mtp.iter().enumerate() {
        if b.mtp[..i].iter().any(|o| o.slot == r.slot) {
            return Err(EngineError::InvalidInput(format!(
                "slot {} asks for MTP drafts twice",
                r.slot
            )));
        }
        let s: &SeqStep = b.seqs.iter().find(|s| s.slot == r.slot).ok_or_else(|| {
            EngineError::InvalidInput(format!(
                "an MTP request names slot {}, which the batch does not step",
                r.slot
            ))
        })?;
        if s.hidden_row_count() != s.tokens.len() {
            return Err(EngineError::InvalidInput(format!(
                "slot {}: an MTP sequence's step must report every row (a decode or a verify with all rows)",
                r.slot
            )));
        }
    }
    Ok(())
}

/// A CPU rank with its MTP state.
pub struct CpuRank {
    pub(crate) decoder: Decoder,
    pub(crate) mtp: CpuMtp,
}

impl Rank for CpuRank {
    fn info(&self) -> super::RankInfo {
        let mut info = self.decoder.info();
        info.mtp = self.decoder.model().mtp().is_some();
        info
    }

    fn step(&mut self, plan: &super::StepPlan) -> Result<StepOut> {
        match &plan.program {
            super::Program::Batch(b) if !b.mtp.is_empty() => self.mtp.step(&mut self.decoder, &plan.commits, b),
            _ => self.decoder.step(plan),
        }
    }

    fn release(&mut self, slot: usize) -> Result<()> {
        self.mtp.forget(slot);
        self.decoder.release(slot)
    }

    fn snapshot(&mut self, slot: usize) -> Result<super::SlotSnapshot> {
        self.decoder.snapshot(slot)
    }

    fn restore(&mut self, slot: usize, snapshot: &super::SlotSnapshot) -> Result<()> {
        self.mtp.forget(slot);
        self.decoder.restore(slot, snapshot)
    }

    fn store(&mut self, slot: usize, id: u64) -> Result<Option<u64>> {
        self.decoder.store(slot, id).map(Some)
    }

    fn restore_stored(&mut self, slot: usize, id: u64) -> Result<()> {
        self.mtp.forget(slot);
        self.decoder.restore_stored(slot, id)
    }

    fn drop_stored(&mut self, ids: &[u64]) -> Result<()> {
        self.decoder.drop_stored(ids);
        Ok(())
    }

    fn health(&mut self) -> Result<super::RankHealth> {
        self.decoder.health()
    }
}
