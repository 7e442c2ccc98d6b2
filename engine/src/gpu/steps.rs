//! A GPU rank's step: the commits (pointer moves of the slot counters), each sequence's form and flush decided from its
//! counters by the rules every engine shares ([`SlotCounters::decide`]), the folds some sequences need first, then
//! the prompt chunks one sequence at a time, every decode as one batch and the verifies in batches of equal window.
//! Forms and flushes are data in the replay rows, so one launch per layer serves a batch that mixes them.
//!
//! After the device work the counters move by the rules the CPU decoder applies too (`SlotCounters::after_step` and
//! `commit`): a decode commits its entry (and a flush drops the folded ones), a verify's drafts wait for the commit, a
//! kv-only prompt keeps its entries. A verify of recurrent sequences runs the speculative baseline instead (ReplaySSM Alg. 3 / 7: one state
//! snapshot per draft in the rank's snapshot pools), and its commit copies snapshot `accepted − 1` into the state.
//!
//! [`SlotCounters::decide`]: crate::state::SlotCounters::decide

use rewind_kernels::cpu::lm_head::{LogprobRequest, SpecRequest};
use rewind_kernels::cuda::ops::{ReplayRow, REPLAY_MAX_T};
use tracing::debug_span;

use super::forward::{SsmRun, Step};
use super::rank::{put, to_i32, GpuRank, HeadOut};
use super::whole_rows::joining_comm;
use super::Act;
use crate::error::{EngineError, Result};
use crate::rank::{
    Batch, ChainLog, ChainedVerify, Commit, Program, Rows, SampleRow, SeqKind, SeqStep, StepOut, StepPlan,
};
use crate::state::{DecodeForm, StepDecision, StepPhase};

/// A decode or verify step staged on the host ([`GpuRank::stage_decode`], [`GpuRank::stage_verify`]): what its
/// counter moves need afterwards.
pub(super) struct Staged {
    pub(super) decisions: Vec<StepDecision>,
    pub(super) replay_rows: Vec<ReplayRow>,
    pub(super) step: Step,
}

/// A greedy pick for rows that did not ask to sample (temperature 0 is the argmax).
pub(super) fn greedy() -> SampleRow {
    SampleRow {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        bias: Vec::new(),
        history: Vec::new(),
        mask: None,
        uniform: 0.0,
    }
}

/// Keeps the rows a sequence asked to report out of its `t` rows of `all` (`v` logits each).
fn keep_rows(all: &HeadOut, first: usize, t: usize, rows: Rows, v: usize, hid: usize) -> HeadOut {
    let range = match rows {
        Rows::All => first..first + t,
        Rows::Last => first + t - 1..first + t,
        Rows::None => first..first,
    };
    HeadOut {
        rows: all.rows[range.clone()].to_vec(),
        logits: all.logits.as_ref().map(|l| l[range.start * v..range.end * v].to_vec()),
        hidden: all
            .hidden
            .as_ref()
            .map(|h| h[range.start * hid..range.end * hid].to_vec()),
    }
}

/// The log-probability requests of a launch over `seqs`, `t` head rows each: each sequence's reported rows (the
/// last `row_count` of its `t`) ask what it asked; empty when none asks.
fn head_logprobs(seqs: &[&SeqStep], t: usize) -> Vec<Option<LogprobRequest>> {
    if seqs.iter().all(|s| s.logprobs.is_none()) {
        return Vec::new();
    }
    seqs.iter()
        .flat_map(|s| {
            let asked = s.logprob_requests().collect::<Vec<_>>();
            let silent = t.saturating_sub(asked.len());
            std::iter::repeat_n(None, silent).chain(asked)
        })
        .collect()
}

impl<A: Act> GpuRank<A> {
    /// The form a plan's sequence runs in before this step's decisions: its slot's, or its first form when the
    /// slot is new.
    pub(super) fn form_before(&self, s: &SeqStep) -> DecodeForm {
        if self.books.started(s.slot) {
            self.counters.form_of(s.slot)
        } else {
            s.form.initial()
        }
    }

    /// Runs one plan; see the module docs.
    pub(super) fn run_plan(&mut self, plan: &StepPlan) -> Result<StepOut> {
        // The program's sequences as single steps (a chain's first step), for the checks and claims below and the
        // chain's staging; a batch's are borrowed, not copied.
        let chained: Vec<SeqStep> = match &plan.program {
            Program::Batch(_) => Vec::new(),
            Program::DecodeChain(c) => c.seqs.iter().map(|s| s.step(0, s.token)).collect(),
            Program::VerifyChain(c) => c.seqs.iter().map(ChainedVerify::step).collect(),
        };
        let firsts: Vec<&SeqStep> = match &plan.program {
            Program::Batch(b) => b.seqs.iter().collect(),
            Program::DecodeChain(_) | Program::VerifyChain(_) => chained.iter().collect(),
        };
        // A tensor-parallel rank samples rows it joins with the other ranks (`gpu/whole_rows.rs`): refuse before
        // anything moves when it cannot.
        if self.info.tp > 1 && firsts.iter().any(|s| s.sample.is_some()) {
            joining_comm(self.inner.comm.as_deref(), self.info.rank, self.info.tp)?;
        }
        for s in firsts.iter().filter(|s| s.kind == SeqKind::Verify) {
            let room = self.sizes.rows.snapshots;
            if self.form_before(s) == DecodeForm::Recurrent && s.tokens.len() > room {
                return Err(EngineError::NotSupported(format!(
                    "speculative verification of {} tokens of slot {} in the recurrent form on this GPU rank: the \
                     baseline keeps one state snapshot per verified token and this rank keeps {room} (it keeps them \
                     only when started for the recurrent form with a verify window of drafts; or use --decode \
                     replay, kv-only or auto)",
                    s.tokens.len(),
                    s.slot
                )));
            }
            if s.sample.is_some() {
                return Err(EngineError::NotSupported(
                    "sampling a verify row on the GPU rank: a verify's rows are judged from their summaries \
                     (SeqStep::spec) or from their logits (full_logits)"
                        .into(),
                ));
            }
        }
        // Slots the coordinator opened since the last step: the rank's books take them too.
        let mut claimed = Vec::new();
        for &s in &firsts {
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
        for s in firsts.iter().filter(|s| claimed.contains(&s.slot)) {
            self.clear_slot(s.slot)?;
            self.counters.reset(s.slot, s.form.initial());
            self.choice[s.slot] = s.form;
        }
        self.books.apply(plan)?;
        self.commit(&plan.commits)?;
        self.steps += 1;
        self.want_hidden = plan.hidden();
        let _span = debug_span!("gpu_rank_step", seqs = firsts.len()).entered();
        let b = match &plan.program {
            Program::Batch(b) => b,
            Program::DecodeChain(c) => {
                let out = self.run_chain(c, &firsts);
                return self.chain_out(out, None);
            }
            Program::VerifyChain(c) => {
                let (out, log) = self.run_spec_chain(c, &firsts)?;
                return self.chain_out(Ok(out), Some(log));
            }
        };
        self.run_batch(b)
    }

    /// A device-resident chain's answer (checked against an abort that overlapped it).
    fn chain_out(&self, out: Result<HeadOut>, chain: Option<ChainLog>) -> Result<StepOut> {
        let out = out?;
        self.check_not_aborted()?;
        Ok(StepOut {
            vocab: self.info.vocab.clone(),
            rows: out.rows,
            logits: None,
            hidden: None,
            chain,
            mtp: Vec::new(),
        })
    }

    /// A single step's launches: each prompt chunk, one decode batch, and verify batches of equal window; then the
    /// MTP layer's work for the sequences that ask for drafts (`gpu/mtp.rs`).
    fn run_batch(&mut self, plan: &Batch) -> Result<StepOut> {
        if !plan.mtp.is_empty() {
            self.mtp_begin(plan)?;
        } else if let Some(m) = self.mtp.as_mut() {
            m.idle();
        }
        let mut per_seq: Vec<Option<HeadOut>> = plan.seqs.iter().map(|_| None).collect();
        for (i, s) in plan.seqs.iter().enumerate() {
            if s.kind == SeqKind::Prefill {
                per_seq[i] = Some(self.prefill(s, plan.full_logits)?);
            }
        }
        let (v, hid) = (self.info.vocab.len(), self.inner.config.hidden_size);
        let decodes: Vec<usize> = (0..plan.seqs.len())
            .filter(|&i| plan.seqs[i].kind == SeqKind::Decode)
            .collect();
        if !decodes.is_empty() {
            let batch: Vec<&SeqStep> = decodes.iter().map(|&i| &plan.seqs[i]).collect();
            let out = self.decode(&batch, plan.full_logits)?;
            for (k, &i) in decodes.iter().enumerate() {
                per_seq[i] = Some(keep_rows(&out, k, 1, plan.seqs[i].rows, v, hid));
            }
        }
        // Verifies in batches of equal window, recurrent sequences (the baseline kernels) apart from the others (the
        // replay kernels).
        let mut windows: Vec<(usize, bool)> = plan
            .seqs
            .iter()
            .filter(|s| s.kind == SeqKind::Verify)
            .map(|s| (s.tokens.len(), self.form_before(s) == DecodeForm::Recurrent))
            .collect();
        windows.sort_unstable();
        windows.dedup();
        for (t, baseline) in windows {
            let group: Vec<usize> = (0..plan.seqs.len())
                .filter(|&i| {
                    let s = &plan.seqs[i];
                    s.kind == SeqKind::Verify
                        && s.tokens.len() == t
                        && (self.form_before(s) == DecodeForm::Recurrent) == baseline
                })
                .collect();
            let batch: Vec<&SeqStep> = group.iter().map(|&i| &plan.seqs[i]).collect();
            let out = self.verify(&batch, t, baseline, plan.full_logits)?;
            for (k, &i) in group.iter().enumerate() {
                per_seq[i] = Some(keep_rows(&out, k * t, t, plan.seqs[i].rows, v, hid));
            }
        }
        let mut all = HeadOut::empty(plan.full_logits, plan.hidden);
        for h in per_seq.into_iter().flatten() {
            all.extend(h);
        }
        let mtp = if plan.mtp.is_empty() {
            Vec::new()
        } else {
            self.mtp_end(plan, &all.rows)?
        };
        self.check_not_aborted()?;
        Ok(StepOut {
            vocab: self.info.vocab.clone(),
            rows: all.rows,
            logits: all.logits,
            hidden: all.hidden,
            chain: None,
            mtp,
        })
    }

    /// A replayed graph's all-reduces return without their sums once the communicator is aborted (the eager path
    /// fails at its next collective instead): a step that overlapped an abort is not an answer.
    fn check_not_aborted(&self) -> Result<()> {
        if self.inner.comm.as_ref().is_some_and(|c| c.is_aborted()) {
            return Err(EngineError::Communicator(
                "the step overlapped an abort of this rank's NCCL communicator (a rank of the group failed)".into(),
            ));
        }
        Ok(())
    }

    /// Keeps the first `accepted` drafts of each slot's verify, as the CPU decoder's commit: the conv head moves by
    /// `accepted` (the books moved the KV length); a replay or kv-only slot's ring length moves by `accepted` (a
    /// pointer move); a recurrent slot's state becomes its baseline snapshot `accepted − 1`, one copy per SSM layer,
    /// every such slot in one launch per layer (`accepted = 0` keeps the state and launches nothing).
    fn commit(&mut self, commits: &[Commit]) -> Result<()> {
        let mut baseline = Vec::new();
        for c in commits {
            if self.counters.form_of(c.slot) == DecodeForm::Recurrent && c.accepted > 0 {
                baseline.extend([c.slot as i32, c.accepted as i32]);
            }
            self.counters.commit(c.slot, c.accepted)?;
        }
        if !baseline.is_empty() {
            let _span = debug_span!("gpu_commit_baseline", seqs = baseline.len() / 2).entered();
            let dev = self.inner.dev.clone();
            put(&dev, &mut self.scratch.commits, &baseline, "baseline commits")?;
            super::ssm_layers::commit_baseline(
                &dev,
                &mut self.pools,
                &self.snapshots,
                &self.scratch,
                baseline.len() / 2,
                self.sizes.max_seqs,
            )?;
        }
        Ok(())
    }

    pub(super) fn decide(&self, slot: usize, phase: StepPhase, t: usize) -> StepDecision {
        self.counters
            .decide(slot, phase, t, self.replay.threshold, self.replay.max_verify)
    }

    /// Decides every sequence of a decode or verify batch and runs the folds the decisions ask for first.
    fn decide_batch(&mut self, seqs: &[&SeqStep], phase: StepPhase, t: usize) -> Result<Vec<StepDecision>> {
        let decisions: Vec<StepDecision> = seqs.iter().map(|s| self.decide(s.slot, phase, t)).collect();
        let folds: Vec<usize> = seqs
            .iter()
            .zip(&decisions)
            .filter(|(_, d)| d.fold_first)
            .map(|(s, _)| s.slot)
            .collect();
        self.fold_slots(&folds)?;
        Ok(decisions)
    }

    /// The replay row of `slot` for a step of `form` that folds `fold` entries.
    pub(super) fn replay_row(&self, slot: usize, form: DecodeForm, fold: usize) -> ReplayRow {
        let r = self.counters.ring(slot);
        ReplayRow {
            slot,
            ring_start: r.start,
            ring_len: r.len,
            ring_cap: r.capacity,
            fold,
            read_state: form != DecodeForm::KvOnly,
            conv_head: self.counters.conv(slot).start,
        }
    }

    /// Folds every committed entry of `slots` into their checkpoints (a kv-only ring compresses from a zero state and
    /// the slot moves to replay) and empties their rings.
    fn fold_slots(&mut self, slots: &[usize]) -> Result<()> {
        let rows: Vec<ReplayRow> = slots
            .iter()
            .filter(|&&s| self.counters.ring(s).len > 0)
            .map(|&s| {
                let h = self.counters.ring(s).len;
                self.replay_row(s, self.counters.form_of(s), h)
            })
            .collect();
        if !rows.is_empty() {
            let _span = debug_span!("gpu_fold", seqs = rows.len()).entered();
            let max_m = rows.iter().map(|r| r.ring_len).max().unwrap_or(1);
            let dev = self.inner.dev.clone();
            put(
                &dev,
                &mut self.scratch.meta,
                &ReplayRow::encode_all(&rows),
                "replay rows",
            )?;
            // The stage profile times the pass as its own stage: it runs outside the step's forward.
            if let Some(m) = self.marks.as_mut() {
                m.begin(&dev)?;
            }
            super::ssm_layers::fold(
                &dev,
                &self.inner.blocks,
                &mut self.pools,
                &mut self.scratch,
                rows.len(),
                max_m,
                self.sizes.rows.ring,
            )?;
            if let Some(m) = self.marks.as_mut() {
                m.mark(&dev, "fold")?;
            }
            self.record_stages()?;
        }
        for &s in slots {
            let h = self.counters.ring(s).len;
            self.counters.ring_flush(s, h)?;
            if self.counters.form_of(s) == DecodeForm::KvOnly {
                self.counters.set_form(s, DecodeForm::Replay)?;
            }
        }
        Ok(())
    }

    pub(super) fn step_shape(&self, rows: usize, seqs: usize, t: usize, clamp: bool, ssm: SsmRun) -> Step {
        Step {
            rows,
            seqs,
            t,
            clamp,
            ssm,
            ring_rows: self.sizes.rows.ring,
            conv_rows: self.counters.conv_capacity(),
        }
    }

    /// A prompt chunk sequence, in chunks of the scratch's rows: the chunked scan into the checkpoint, or for a kv-only
    /// sequence the replay kernels in pieces, keeping the prompt as ring entries. Reports its rows as `seq.rows` asks.
    fn prefill(&mut self, seq: &SeqStep, want_logits: bool) -> Result<HeadOut> {
        let _span = debug_span!("gpu_prefill", slot = seq.slot, tokens = seq.tokens.len()).entered();
        let slot = seq.slot;
        // The reference clamps `dt` on its multi-token path: prompt steps of more than one token (as the CPU does).
        let clamp = seq.tokens.len() > 1;
        let chunk = self.scratch.rows;
        let n_chunks = seq.tokens.len().div_ceil(chunk);
        let mut out = HeadOut::empty(want_logits, self.want_hidden);
        // One request per reported row of the whole prompt step; each chunk asks about the ones it reports.
        let asked: Vec<Option<LogprobRequest>> = seq.logprob_requests().collect();
        let mut reported = 0;
        for (ci, part) in seq.tokens.chunks(chunk).enumerate() {
            let t = part.len();
            let pos = seq.position + ci * chunk;
            let d = self.decide(slot, StepPhase::Prefill { position: pos }, t);
            if d.start_replay {
                self.counters.set_form(slot, DecodeForm::Replay)?;
            }
            if d.fold_first {
                self.fold_slots(&[slot])?;
            }
            self.counters.set_flush(slot, false);
            let (replay_rows, ssm) = if d.form == DecodeForm::KvOnly {
                let first = self.replay_row(slot, d.form, 0);
                let rows: Vec<ReplayRow> = (0..t.div_ceil(REPLAY_MAX_T))
                    .map(|p| ReplayRow {
                        ring_len: first.ring_len + p * REPLAY_MAX_T,
                        ..first
                    })
                    .collect();
                let ssm = SsmRun::Replay {
                    max_m: first.ring_len + t,
                    piece: REPLAY_MAX_T,
                    prompt: true,
                };
                (rows, ssm)
            } else {
                (vec![self.replay_row(slot, d.form, 0)], SsmRun::Chunked { slot })
            };
            let lens = self.lens(&[(slot, pos + t)]);
            self.upload_step(
                Some(&to_i32(part.iter().map(|&x| x as usize))),
                &vec![slot as i32; t],
                &to_i32(pos..pos + t),
                &[slot as i32],
                &lens,
                &replay_rows,
            )?;
            let step = self.step_shape(t, 1, t, clamp, ssm);
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
            let logprob = if seq.logprobs.is_some() {
                asked.get(reported..reported + head_rows).ok_or_else(|| {
                    EngineError::InvalidInput(format!(
                        "slot {slot}'s prompt step reports more rows than it has log-probability requests for"
                    ))
                })?
            } else {
                &[]
            };
            reported += head_rows;
            let h = self.run(step, head_rows, want_logits, sample, &[], logprob)?;
            self.keep_mtp_rows(&[(slot, ci * chunk, 0, t)], t, head_rows > 0)?;
            let ring = self.counters.ring(slot).len;
            self.counters
                .after_step(slot, StepPhase::Prefill { position: pos }, d.form, false, ring, t)?;
            out.extend(h);
        }
        Ok(out)
    }

    /// One decode step over `seqs` (distinct slots, one token each), every form in one launch per layer.
    fn decode(&mut self, seqs: &[&SeqStep], want_logits: bool) -> Result<HeadOut> {
        let _span = debug_span!("gpu_decode", batch = seqs.len()).entered();
        let b = seqs.len();
        let tokens = to_i32(seqs.iter().map(|s| s.tokens[0] as usize));
        let staged = self.stage_decode(seqs, 0, Some(&tokens))?;
        let samples: Option<Vec<SampleRow>> = seqs
            .iter()
            .any(|s| s.sample.is_some())
            .then(|| seqs.iter().map(|s| s.sample.clone().unwrap_or_else(greedy)).collect());
        let logprob = head_logprobs(seqs, 1);
        let mut out = self.run(staged.step, b, want_logits, samples.as_deref(), &[], &logprob)?;
        let parts: Vec<_> = seqs.iter().enumerate().map(|(k, s)| (s.slot, 0, k, 1)).collect();
        self.keep_mtp_rows(&parts, b, true)?;
        for (row, s) in out.rows.iter_mut().zip(seqs) {
            if s.sample.is_none() || s.rows == Rows::None {
                row.sampled = None;
            }
        }
        self.after_decode(seqs, &staged)?;
        Ok(out)
    }

    /// The host part of a decode step before its device work, for the step `k` tokens past each sequence's planned
    /// position (0 unless chained: `gpu/chain.rs`): each sequence's form and flush decided (its folds queued), its
    /// replay row, the uploads. `tokens`: `None` when the device already holds them.
    pub(super) fn stage_decode(&mut self, seqs: &[&SeqStep], k: usize, tokens: Option<&[i32]>) -> Result<Staged> {
        let b = seqs.len();
        let decisions = self.decide_batch(seqs, StepPhase::Decode, 1)?;
        let mut replay_rows = Vec::with_capacity(b);
        for (s, d) in seqs.iter().zip(&decisions) {
            self.counters.set_flush(s.slot, d.flush);
            let h = self.counters.ring(s.slot).len;
            // A recurrent row is a replay row with an empty ring that folds its own entry every step.
            let fold = match d.form {
                DecodeForm::Recurrent => 1,
                DecodeForm::Replay if d.flush => h + 1,
                DecodeForm::Replay | DecodeForm::KvOnly => 0,
            };
            replay_rows.push(self.replay_row(s.slot, d.form, fold));
        }
        let max_m = replay_rows.iter().map(|r| r.ring_len + 1).max().unwrap_or(1);
        let slots = to_i32(seqs.iter().map(|s| s.slot));
        // Each sequence's attention sees the length at its own step (for a chained plan the books already count
        // every chained token).
        let over: Vec<(usize, usize)> = seqs.iter().map(|s| (s.slot, s.position + k + 1)).collect();
        let lens = self.lens(&over);
        self.upload_step(
            tokens,
            &slots,
            &to_i32(seqs.iter().map(|s| s.position + k)),
            &slots,
            &lens,
            &replay_rows,
        )?;
        let ssm = if decisions.iter().all(|d| d.form == DecodeForm::Recurrent) {
            SsmRun::Recurrent
        } else {
            SsmRun::Replay {
                max_m,
                piece: 1,
                prompt: false,
            }
        };
        let step = self.step_shape(b, b, 1, false, ssm);
        Ok(Staged {
            decisions,
            replay_rows,
            step,
        })
    }

    /// Moves the counters after a decode step's device work was queued, as the CPU decoder's `decode/advance.rs`.
    pub(super) fn after_decode(&mut self, seqs: &[&SeqStep], staged: &Staged) -> Result<()> {
        for ((s, d), r) in seqs.iter().zip(&staged.decisions).zip(&staged.replay_rows) {
            self.counters
                .after_step(s.slot, StepPhase::Decode, d.form, d.flush, r.ring_len, 1)?;
        }
        Ok(())
    }

    /// One verify step over `seqs` (distinct slots, `t` drafts each): every row of every sequence reported. Replay
    /// and kv-only drafts wait in the rings for the commit; recurrent sequences (`baseline`, all of them) run the
    /// speculative baseline, which leaves the state as it was and writes one snapshot per draft for the commit. The
    /// conv rows are appended either way, as the CPU decoder does.
    fn verify(&mut self, seqs: &[&SeqStep], t: usize, baseline: bool, want_logits: bool) -> Result<HeadOut> {
        let _span = debug_span!("gpu_verify", batch = seqs.len(), t).entered();
        let staged = self.stage_verify(seqs, t, baseline)?;
        let spec: Vec<Option<SpecRequest>> = seqs.iter().flat_map(|s| s.spec_requests()).collect();
        let logprob = head_logprobs(seqs, t);
        let out = self.run(staged.step, seqs.len() * t, want_logits, None, &spec, &logprob)?;
        let parts: Vec<_> = seqs.iter().enumerate().map(|(k, s)| (s.slot, 0, k * t, t)).collect();
        self.keep_mtp_rows(&parts, seqs.len() * t, true)?;
        self.after_verify(seqs, &staged, t)?;
        Ok(out)
    }

    /// The host part of a verify step before its device work: each sequence's form and flush decided (its folds
    /// run), its replay row, the uploads.
    pub(super) fn stage_verify(&mut self, seqs: &[&SeqStep], t: usize, baseline: bool) -> Result<Staged> {
        let b = seqs.len();
        let decisions = self.decide_batch(seqs, StepPhase::Verify, t)?;
        let mut replay_rows = Vec::with_capacity(b);
        for (s, d) in seqs.iter().zip(&decisions) {
            self.counters.set_flush(s.slot, d.flush);
            let h = self.counters.ring(s.slot).len;
            // A verify's flush folds the committed history only, never a draft.
            let fold = if d.flush { h } else { 0 };
            replay_rows.push(self.replay_row(s.slot, d.form, fold));
        }
        // A verify's ring bound is its rows' capacity, the bound every step of a chain of verifies needs
        // (`gpu/spec_chain.rs`): single and chained verifies then run one graph and one kernel geometry.
        let max_m = replay_rows
            .iter()
            .map(|r| (r.ring_len + t).max(r.ring_cap.min(self.sizes.rows.ring)))
            .max()
            .unwrap_or(t);
        let tokens: Vec<i32> = seqs.iter().flat_map(|s| s.tokens.iter().map(|&x| x as i32)).collect();
        let row_slots: Vec<i32> = seqs
            .iter()
            .flat_map(|s| std::iter::repeat_n(s.slot as i32, t))
            .collect();
        let row_pos: Vec<i32> = seqs
            .iter()
            .flat_map(|s| (s.position..s.position + t).map(|p| p as i32))
            .collect();
        let lens = self.lens(&[]);
        self.upload_step(
            Some(&tokens),
            &row_slots,
            &row_pos,
            &to_i32(seqs.iter().map(|s| s.slot)),
            &lens,
            &replay_rows,
        )?;
        let ssm = if baseline {
            SsmRun::Baseline
        } else {
            SsmRun::Replay {
                max_m,
                piece: t,
                prompt: false,
            }
        };
        let step = self.step_shape(b * t, b, t, false, ssm);
        Ok(Staged {
            decisions,
            replay_rows,
            step,
        })
    }

    /// Moves the counters after a verify step's device work was queued: a flush folded the committed history, the
    /// drafts wait for the commit.
    pub(super) fn after_verify(&mut self, seqs: &[&SeqStep], staged: &Staged, t: usize) -> Result<()> {
        for ((s, d), r) in seqs.iter().zip(&staged.decisions).zip(&staged.replay_rows) {
            self.counters
                .after_step(s.slot, StepPhase::Verify, d.form, d.flush, r.ring_len, t)?;
        }
        Ok(())
    }
}
