//! MTP drafting on the ranks (issue 41): the checkpoint's MTP layer runs inside the step, on the rank that holds
//! the target's hidden rows, so no hidden state leaves the rank and no drafter runs on the host.
//!
//! A sequence the plan names in [`Batch::mtp`](super::Batch::mtp) feeds its MTP layer every step. At the end of
//! the step the rank judges the step's rows exactly as the coordinator will (the verify's acceptance, or the
//! decode's sampled / greedy token), runs the MTP layer over the rows that are now committed — each with the token
//! after it — and drafts the next window greedily from the last one. It answers [`MtpProposal`]s: the drafts for the
//! verify the coordinator will run next, at the position and with the token the rank assumed. The coordinator uses
//! them only when its own verdict agrees (it can cut a verify short: a stop string, a token limit, a grammar); the
//! rank then repairs its KV at the next step, rerunning the row whose next token it guessed wrong.
//!
//! [`MtpBook`] holds this bookkeeping for every slot, for both backends; a backend stores the rows
//! ([`MtpJob::rows`] name them) and runs the layer.
//!
//! Row `q` of the target (input token `x_q`) gives the hidden row `h_q`; the MTP layer's row `q` takes `h_q` and the
//! embedding of `x_{q+1}` and predicts `x_{q+2}`. Its KV entry for position `q` lies at index `q − start`: RoPE
//! scores depend only on position differences, so a KV started late (a restored session) equals absolute positions.

use super::plan::{SeqKind, SeqStep};
use super::RowPass;
use crate::error::{EngineError, Result};
use crate::spec::accept::accept_summaries;

pub use crate::spec::rank_drafter::{MtpProposal, MtpRequest};

/// Where a row of an [`MtpJob`] comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MtpRow {
    /// Row `i` of the sequence's rows in this step (its tokens, in order; the hidden row before the final norm).
    Step(usize),
    /// The row of position `q` that the backend saved at the end of the slot's previous step ([`MtpBook::saved`]).
    Saved(usize),
}

/// One sequence's MTP work at the end of a step: run `rows` (each with its next token) into the KV from index
/// `kv_index`, then propose `drafts` tokens from the last row's output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MtpJob {
    pub slot: usize,
    pub kv_index: usize,
    pub rows: Vec<MtpRow>,
    pub tokens: Vec<u32>,
    pub drafts: usize,
    /// Which of the step's rows to save for the next step's repair, and the position of the first.
    pub save: (usize, std::ops::Range<usize>),
    /// The proposal's position and token, when the rank could judge the step.
    pub next: Option<(usize, u32)>,
}

/// The bookkeeping of one slot's MTP KV.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Slot {
    /// Position of KV index 0.
    start: usize,
    /// KV entries that hold rows of positions `start .. start + len`.
    len: usize,
    /// The next token each of the last run's rows was run with, from position `ran_at`: a later step checks the
    /// guessed one against its own first token.
    ran_at: usize,
    ran: Vec<u32>,
    /// Positions of the rows the backend saved at the end of the last step.
    saved: std::ops::Range<usize>,
}

/// Every slot's MTP KV bookkeeping on a rank.
#[derive(Debug, Default)]
pub struct MtpBook {
    slots: Vec<Option<Slot>>,
    /// Per sequence of the current step (after [`MtpBook::prepare`]): the repair row and the KV index it starts at.
    prepared: Vec<(usize, Option<usize>, usize)>,
}

impl MtpBook {
    /// Forgets a slot's MTP KV (released, restored or restarted): its next step starts the KV afresh.
    pub fn forget(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot) {
            *s = None;
        }
    }

    /// The positions of the rows saved for `slot` at the end of its last step.
    pub fn saved(&self, slot: usize) -> std::ops::Range<usize> {
        self.slots
            .get(slot)
            .and_then(Option::as_ref)
            .map_or(0..0, |s| s.saved.clone())
    }

    /// Before a step: for each MTP sequence of `seqs` (`requests` name them; `seqs` after the plan's commits), cut
    /// its KV back to the entries whose next token is now known to be right, and note the row to rerun first when
    /// the last entry was run with a token other than the step's first (or the KV restarts when that row is gone).
    pub fn prepare(&mut self, requests: &[MtpRequest], seqs: &[SeqStep]) -> Result<()> {
        self.prepared.clear();
        for r in requests {
            let s = seqs.iter().find(|s| s.slot == r.slot).ok_or_else(|| {
                EngineError::InvalidInput(format!(
                    "an MTP request names slot {}, which the batch does not step",
                    r.slot
                ))
            })?;
            if self.slots.len() <= r.slot {
                self.slots.resize(r.slot + 1, None);
            }
            let p = s.position;
            let first = *s
                .tokens
                .first()
                .ok_or_else(|| EngineError::InvalidInput(format!("slot {}: an MTP step of no tokens", r.slot)))?;
            let slot = self.slots[r.slot].get_or_insert_with(|| Slot {
                start: p,
                ..Slot::default()
            });
            // Entries below `p − 1` hold committed rows with committed next tokens (the coordinator commits at most
            // what the rank accepted); entry `p − 1` holds the right row only if its next token was `first`.
            let guessed = p
                .checked_sub(1)
                .and_then(|q| q.checked_sub(slot.ran_at))
                .and_then(|i| slot.ran.get(i));
            let (repair, kv_index) = if p == slot.start {
                slot.len = 0;
                (None, 0)
            } else if p > slot.start && p <= slot.start + slot.len && guessed == Some(&first) {
                slot.len = p - slot.start;
                (None, slot.len)
            } else if p > slot.start && p - 1 <= slot.start + slot.len && slot.saved.contains(&(p - 1)) {
                slot.len = p - 1 - slot.start;
                (Some(p - 1), slot.len)
            } else {
                // The row before the step is gone (a restored or preempted sequence): the KV restarts here.
                *slot = Slot {
                    start: p,
                    ..Slot::default()
                };
                (None, 0)
            };
            self.prepared.push((r.slot, repair, kv_index));
        }
        Ok(())
    }

    /// After the step's forward: the MTP work of each request, judged from `merged` (each reported row's summary over
    /// the whole vocabulary, in plan order; sampled rows carry their token) as the coordinator judges it.
    pub fn jobs(
        &self,
        requests: &[MtpRequest],
        seqs: &[SeqStep],
        merged: &[RowPass],
        sampled: &[Option<u32>],
    ) -> Result<Vec<MtpJob>> {
        let mut first_row = Vec::with_capacity(seqs.len());
        let mut at = 0;
        for s in seqs {
            first_row.push(at);
            at += s.row_count();
        }
        if merged.len() != at || sampled.len() != at {
            return Err(EngineError::InvalidInput(format!(
                "MTP drafting: {} merged rows and {} sampled for {at} reported rows",
                merged.len(),
                sampled.len()
            )));
        }
        let mut jobs = Vec::with_capacity(requests.len());
        for (r, &(slot, repair, kv_index)) in requests.iter().zip(&self.prepared) {
            debug_assert_eq!(r.slot, slot);
            let (i, s) = seqs
                .iter()
                .enumerate()
                .find(|(_, s)| s.slot == r.slot)
                .ok_or_else(|| EngineError::InvalidInput(format!("no step of MTP slot {}", r.slot)))?;
            let rows_of = &merged[first_row[i]..first_row[i] + s.row_count()];
            let picks = &sampled[first_row[i]..first_row[i] + s.row_count()];
            let n = s.tokens.len();
            // How many of the step's rows run now, the token after the last of them (when the rank can tell), and
            // which rows to keep for the next step's repair (the row before its first token is one of them).
            let (run, next, save) = match (s.kind, s.row_count()) {
                // A prompt chunk that reports no row is not the last: its last row waits for the next chunk's token.
                (_, 0) => (n - 1, None, n - 1..n),
                (SeqKind::Verify, rows) if rows == n => {
                    let v = accept_summaries(rows_of, &s.tokens[1..], s.spec.map(|sp| (sp.seed, sp.index)))?;
                    (v.accepted + 1, Some(v.token), 0..v.accepted + 1)
                }
                _ => {
                    let last = rows_of.len() - 1;
                    (n, Some(picks[last].unwrap_or(rows_of[last].argmax)), n - 1..n)
                }
            };
            let mut rows: Vec<MtpRow> = repair.map(MtpRow::Saved).into_iter().collect();
            let mut tokens: Vec<u32> = repair.map(|_| s.tokens[0]).into_iter().collect();
            rows.extend((0..run).map(MtpRow::Step));
            match next {
                Some(y) => {
                    tokens.extend_from_slice(&s.tokens[1..run]);
                    tokens.push(y);
                }
                None => tokens.extend_from_slice(&s.tokens[1..=run]),
            }
            jobs.push(MtpJob {
                slot,
                kv_index,
                rows,
                tokens,
                drafts: if next.is_some() { r.window } else { 0 },
                save: (s.position, save),
                next: next.map(|y| (s.position + run, y)),
            });
        }
        Ok(jobs)
    }

    /// Records what the backend ran for `jobs` (the KV now holds their rows) and which rows it saved.
    pub fn ran(&mut self, jobs: &[MtpJob]) {
        for j in jobs {
            let Some(Some(slot)) = self.slots.get_mut(j.slot) else {
                continue;
            };
            let first = slot.start + j.kv_index;
            slot.len = j.kv_index + j.rows.len();
            slot.ran_at = first;
            slot.ran = j.tokens.clone();
            let (position, range) = &j.save;
            slot.saved = position + range.start..position + range.end;
        }
    }
}
