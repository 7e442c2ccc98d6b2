//! The draft model's thread: the [`Decoder`] and, per slot, the book of what the slot holds. Every operation of every
//! session runs here, one at a time (see the parent module for why a thread and not a mutex).

use rewind_kernels::cpu::sample::kept_weights;
use tracing::warn;

use super::DraftSampling;
use crate::decode::Rows;
use crate::decode::{Decoder, FormChoice, Item, Phase};
use crate::error::{EngineError, Result};
use crate::sample::{argmax, Sampler};
use crate::spec::Draft;
use crate::state::PoolError;

/// What one session's slot holds, as the decoder sees it.
#[derive(Debug)]
struct Book {
    /// The tokens the slot has committed, positions `0..committed.len()`.
    committed: Vec<u32>,
    /// The tokens of the slot's verify awaiting its commit (empty: none).
    pending: Vec<u32>,
    sampling: DraftSampling,
    /// Uniform draws taken so far: the index of the next one in the seed's stream.
    draws: u64,
}

/// A proposal asked of a slot: up to `max` drafts after `tokens`.
#[derive(Debug, PartialEq)]
pub(super) struct Queued {
    slot: usize,
    tokens: Vec<u32>,
    max: usize,
}

/// One slot's proposal in progress.
struct Run {
    /// Its index among the proposals run together.
    job: usize,
    book: Book,
    /// The drafts it takes.
    k: usize,
    /// The logits after the stream, when the catch-up computed them.
    first: Option<Vec<f32>>,
    drafts: Vec<u32>,
    /// The drafts' distributions, one after another (sampled drafts only).
    probs: Vec<Vec<f32>>,
}

impl Run {
    /// Takes the draft after a row of logits.
    fn pick(&mut self, row: &[f32]) {
        let (token, q) = pick(row, &self.book.sampling, &mut self.book.draws);
        self.drafts.push(token);
        self.probs.extend(q);
    }
}

/// The decoder and its sessions' books; owned by the draft model's thread.
pub(super) struct Worker {
    decoder: Decoder,
    books: Vec<Option<Book>>,
    /// Proposals queued to run together, and the results of those run but not yet asked for.
    queued: Vec<Queued>,
    ready: Vec<(Queued, Result<Draft>)>,
}

impl Worker {
    pub(super) fn new(decoder: Decoder) -> Self {
        let books = (0..decoder.config().slots).map(|_| None).collect();
        Worker {
            decoder,
            books,
            queued: Vec::new(),
            ready: Vec::new(),
        }
    }

    /// Takes a free slot for a new session.
    pub(super) fn open(&mut self, sampling: DraftSampling) -> Result<usize> {
        let slot = self.decoder.start(FormChoice::Replay).map_err(|e| match e {
            EngineError::Pool(PoolError::SlotsFull { capacity }) => EngineError::InvalidInput(format!(
                "all {capacity} sequence slots of the draft model are in use (one per running request); \
                 give the draft model more slots or run fewer requests at once"
            )),
            e => e,
        })?;
        self.books[slot] = Some(Book {
            committed: Vec::new(),
            pending: Vec::new(),
            sampling,
            draws: 0,
        });
        Ok(slot)
    }

    /// Ends a session and frees its slot. Runs from a `Drop`, so failures are logged, not returned.
    pub(super) fn close(&mut self, slot: usize) {
        self.forget(slot);
        if let Some(book) = self.books.get_mut(slot) {
            *book = None;
        }
        if let Err(e) = self.decoder.release(slot) {
            warn!(slot, "releasing a draft-model slot: {e}");
        }
    }

    /// Up to `max` drafts to follow `tokens` from the session in `slot`: the proposal [`Worker::queue`]d for it, run
    /// with every other queued one when it is still waiting, or a proposal of its own.
    pub(super) fn propose(&mut self, slot: usize, tokens: &[u32], max: usize) -> Result<Draft> {
        if self.queued.iter().any(|q| q.slot == slot) {
            let jobs = std::mem::take(&mut self.queued);
            let results = self.propose_all(&jobs);
            for (q, r) in jobs.into_iter().zip(results) {
                self.ready.push((q, r));
            }
        }
        if let Some(i) = self.ready.iter().position(|(q, _)| q.slot == slot) {
            let (q, r) = self.ready.swap_remove(i);
            if q.tokens == tokens && q.max == max {
                return r;
            }
        }
        let job = Queued {
            slot,
            tokens: tokens.to_vec(),
            max,
        };
        self.propose_all(std::slice::from_ref(&job))
            .pop()
            .unwrap_or_else(|| Ok(Draft::default()))
    }

    /// Queues a proposal, to be run with the others queued before the first of them is asked for
    /// ([`Worker::propose`]): one batched verify per draft step for all their slots.
    pub(super) fn queue(&mut self, slot: usize, tokens: Vec<u32>, max: usize) {
        self.forget(slot);
        self.queued.push(Queued { slot, tokens, max });
    }

    /// Drops whatever was queued or computed for `slot` and not asked for.
    fn forget(&mut self, slot: usize) {
        self.queued.retain(|q| q.slot != slot);
        self.ready.retain(|(q, _)| q.slot != slot);
    }

    /// Runs the proposals `jobs` (distinct slots) together: each slot is synced and caught up on its own, then draft
    /// step `j` of every slot still drafting is one batched verify, whose last row per slot alone goes through the
    /// head. A slot whose proposal fails is restarted empty, so that its book never disagrees with the decoder (the
    /// next proposal then prefills the stream again); a failed batched step fails every slot in it.
    fn propose_all(&mut self, jobs: &[Queued]) -> Vec<Result<Draft>> {
        let mut runs: Vec<Run> = Vec::with_capacity(jobs.len());
        let mut out: Vec<Option<Result<Draft>>> = Vec::with_capacity(jobs.len());
        for (i, q) in jobs.iter().enumerate() {
            let Some(mut book) = self.books.get_mut(q.slot).and_then(Option::take) else {
                out.push(Some(Err(EngineError::InvalidInput(format!(
                    "draft-model slot {} has no session",
                    q.slot
                )))));
                continue;
            };
            match self.start_run(q, &mut book) {
                Ok(Some((k, first))) => runs.push(Run {
                    job: i,
                    book,
                    k,
                    first,
                    drafts: Vec::with_capacity(k),
                    probs: Vec::new(),
                }),
                Ok(None) => {
                    self.books[q.slot] = Some(book);
                    out.push(Some(Ok(Draft::default())));
                    continue;
                }
                Err(e) => {
                    self.restart(q.slot, &mut book);
                    self.books[q.slot] = Some(book);
                    out.push(Some(Err(e)));
                    continue;
                }
            }
            out.push(None);
        }
        if let Err(e) = self.draft_steps(jobs, &mut runs) {
            // The first run gets the error itself, the others its text (errors are not `Clone`).
            let text = e.to_string();
            let mut e = Some(e);
            for r in &mut runs {
                self.restart(jobs[r.job].slot, &mut r.book);
                out[r.job] = Some(Err(e.take().unwrap_or_else(|| {
                    EngineError::InvalidInput(format!("a draft step batched with this proposal failed: {text}"))
                })));
            }
        }
        for r in runs {
            let slot = jobs[r.job].slot;
            out[r.job].get_or_insert_with(|| {
                Ok(Draft {
                    probs: (r.book.sampling.temperature > 0.0).then_some(r.probs),
                    tokens: r.drafts,
                })
            });
            self.books[slot] = Some(r.book);
        }
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Ok(Draft::default())))
            .collect()
    }

    /// Syncs and catches up `q`'s slot; the drafts it can take (`None`: none) and the logits after the stream when
    /// the catch-up computed them.
    fn start_run(&mut self, q: &Queued, book: &mut Book) -> Result<Option<(usize, Option<Vec<f32>>)>> {
        let (slot, tokens, n) = (q.slot, &q.tokens[..], q.tokens.len());
        if n == 0 || q.max == 0 {
            return Ok(None);
        }
        self.sync(slot, book, tokens)?;
        let (t, context) = (self.decoder.config().max_verify, self.decoder.config().max_context);
        // The last draft step verifies up to position n + k − 2, so k ≤ context + 1 − n: fewer drafts near the limit,
        // none past it. Its window holds the stream's uncommitted tokens (at least the last one) and k − 1 drafts,
        // so k ≤ T; the catch-up makes room for the rest.
        let k = q.max.min(t).min((context + 1).saturating_sub(n));
        if k == 0 {
            return Ok(None);
        }
        let first = self.catch_up(slot, book, tokens, k)?;
        Ok(Some((k, first)))
    }

    /// Draft steps of every run until each has its `k` drafts. `window` is what a run's next step verifies: the
    /// uncommitted tail of its stream, then its drafts so far (kept as the stream's length; the drafts follow).
    fn draft_steps(&mut self, jobs: &[Queued], runs: &mut [Run]) -> Result<()> {
        loop {
            // A row the catch-up computed comes first.
            for r in runs.iter_mut() {
                if let Some(row) = r.first.take() {
                    r.pick(&row);
                }
            }
            let stepping: Vec<usize> = (0..runs.len()).filter(|&i| runs[i].drafts.len() < runs[i].k).collect();
            if stepping.is_empty() {
                return Ok(());
            }
            let windows: Vec<Vec<u32>> = stepping
                .iter()
                .map(|&i| {
                    let r = &runs[i];
                    let stream = &jobs[r.job].tokens;
                    [&stream[r.book.committed.len()..], &r.drafts[..]].concat()
                })
                .collect();
            for &i in &stepping {
                let r = &mut runs[i];
                if !r.book.pending.is_empty() {
                    self.decoder.commit(jobs[r.job].slot, 0)?;
                    r.book.pending.clear();
                }
            }
            let items: Vec<Item> = stepping
                .iter()
                .zip(&windows)
                .map(|(&i, w)| Item {
                    slot: jobs[runs[i].job].slot,
                    phase: Phase::Verify,
                    tokens: w,
                })
                .collect();
            let x = self.decoder.advance(&items)?;
            for (&i, w) in stepping.iter().zip(&windows) {
                runs[i].book.pending.extend_from_slice(w);
            }
            // Only each window's last row is read: the prediction after its last token.
            let hidden = self.decoder.model().config().hidden_size;
            let mut last = Vec::with_capacity(stepping.len() * hidden);
            let mut end = 0;
            for w in &windows {
                end += w.len();
                last.extend_from_slice(&x[(end - 1) * hidden..end * hidden]);
            }
            let logits = self.decoder.model().head(&last);
            let vocab = logits.len() / stepping.len();
            for ((&i, w), row) in stepping.iter().zip(&windows).zip(logits.chunks_exact(vocab)) {
                let r = &mut runs[i];
                if row.iter().any(|v| !v.is_finite()) {
                    return Err(EngineError::NonFinite {
                        position: r.book.committed.len() + w.len() - 1,
                    });
                }
                r.pick(row);
            }
        }
    }

    /// Brings the slot in line with the stream: commits the part of the pending verify that the stream kept (the
    /// accepted drafts; never the stream's last token, which the drafts must follow from logits), or restarts the
    /// slot when its committed tokens are not a proper prefix of the stream.
    fn sync(&mut self, slot: usize, book: &mut Book, tokens: &[u32]) -> Result<()> {
        let (n, c) = (tokens.len(), book.committed.len());
        // A coordinator only appends, so this fails only for a stream that was rewritten or did not grow.
        if c >= n || tokens[..c] != book.committed[..] {
            self.restart(slot, book);
            return Ok(());
        }
        if !book.pending.is_empty() {
            let m = common_prefix(&book.pending, &tokens[c..n - 1]);
            // A commit of 0 still ends the verify: rejected drafts go by this pointer move.
            self.decoder.commit(slot, m)?;
            book.committed.extend_from_slice(&book.pending[..m]);
            book.pending.clear();
        }
        Ok(())
    }

    /// Commits the stream's tokens that would not fit one verify beside `k` drafts (all but the last), or, for a
    /// fresh slot, prefills all but the last (the first chunk of a sequence must be a prefill at position 0).
    /// Returns the logits after the stream when a one-token fresh stream had to be prefilled whole.
    fn catch_up(&mut self, slot: usize, book: &mut Book, tokens: &[u32], k: usize) -> Result<Option<Vec<f32>>> {
        let (n, c, t) = (tokens.len(), book.committed.len(), self.decoder.config().max_verify);
        if c == 0 {
            if n == 1 {
                let row = self.decoder.prefill(slot, tokens, Rows::Last)?;
                book.committed.push(tokens[0]);
                return Ok(Some(row));
            }
            self.decoder.prefill(slot, &tokens[..n - 1], Rows::None)?;
            book.committed.extend_from_slice(&tokens[..n - 1]);
            return Ok(None);
        }
        // The last draft step verifies the n − c uncommitted tokens and k − 1 drafts.
        if n - c + k - 1 <= t {
            return Ok(None);
        }
        let gap = &tokens[c..n - 1];
        if gap.len() <= t {
            // A verify of the gap committed whole is a decode step's weight traffic and keeps the ring going;
            // a prefill would fold the ring into the checkpoint first.
            self.decoder.verify(slot, gap)?;
            self.decoder.commit(slot, gap.len())?;
        } else {
            self.decoder.prefill(slot, gap, Rows::None)?;
        }
        book.committed.extend_from_slice(gap);
        Ok(None)
    }

    /// Releases and retakes the slot, empty; the draw counter goes on, so later drafts do not reuse draws.
    fn restart(&mut self, slot: usize, book: &mut Book) {
        book.committed.clear();
        book.pending.clear();
        // A slot that is not allocated (an earlier restart failed halfway) is simply taken again.
        if let Err(e) = self.decoder.release(slot) {
            warn!(slot, "restarting a draft-model slot: {e}");
        }
        if let Err(e) = self.decoder.start_at(slot, FormChoice::Replay) {
            warn!(slot, "restarting a draft-model slot: {e}");
        }
    }
}

/// The length of the longest common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The draft after a row of logits: the argmax (lowest id on ties) when greedy; else a draw from the filtered
/// distribution, returned with it over the whole vocabulary (zero outside the kept set).
pub(super) fn pick(row: &[f32], s: &DraftSampling, draws: &mut u64) -> (u32, Option<Vec<f32>>) {
    if s.temperature == 0.0 {
        return (argmax(row), None);
    }
    let u = Sampler::draw_at(s.seed, *draws);
    *draws += 1;
    let mut kept = kept_weights(row, s.temperature, s.top_k, s.top_p, s.min_p);
    // A weight that underflowed to 0 can never be drawn; dropping it keeps the rounding fallback below on a token
    // with q > 0.
    kept.retain(|&(_, w)| w > 0.0);
    let total: f64 = kept.iter().map(|&(_, w)| f64::from(w)).sum();
    let mut q = vec![0.0f32; row.len()];
    // The top token's weight is exactly 1 and survives every filter, so `kept` is never empty; the argmax stands in
    // all the same rather than a panic.
    let Some(&(last, _)) = kept.last() else {
        let top = argmax(row);
        q[top as usize] = 1.0;
        return (top, Some(q));
    };
    let x = f64::from(u) * total;
    let mut cum = 0.0f64;
    let mut token = last;
    for &(id, w) in &kept {
        cum += f64::from(w);
        if x < cum {
            token = id;
            break;
        }
    }
    for &(id, w) in &kept {
        q[id as usize] = (f64::from(w) / total) as f32;
    }
    (token, Some(q))
}
