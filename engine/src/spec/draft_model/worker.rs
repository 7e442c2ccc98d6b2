//! The draft model's thread: the [`Decoder`] and, per slot, the book of what the slot holds. Every operation of every
//! session runs here, one at a time (see the parent module for why a thread and not a mutex).

use rewind_kernels::cpu::sample::kept_weights;
use tracing::warn;

use super::DraftSampling;
use crate::decode::{Decoder, FormChoice};
use crate::error::{EngineError, Result};
use crate::rank::Rows;
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

/// The decoder and its sessions' books; owned by the draft model's thread.
pub(super) struct Worker {
    decoder: Decoder,
    books: Vec<Option<Book>>,
}

impl Worker {
    pub(super) fn new(decoder: Decoder) -> Self {
        let books = (0..decoder.config().slots).map(|_| None).collect();
        Worker { decoder, books }
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
        if let Some(book) = self.books.get_mut(slot) {
            *book = None;
        }
        if let Err(e) = self.decoder.release(slot) {
            warn!(slot, "releasing a draft-model slot: {e}");
        }
    }

    /// Up to `max` drafts to follow `tokens` from the session in `slot`. On an error the slot is restarted empty, so
    /// that the book never disagrees with the decoder (the next proposal then prefills the stream again).
    pub(super) fn propose(&mut self, slot: usize, tokens: &[u32], max: usize) -> Result<Draft> {
        let mut book = self
            .books
            .get_mut(slot)
            .and_then(Option::take)
            .ok_or_else(|| EngineError::InvalidInput(format!("draft-model slot {slot} has no session")))?;
        let out = self.propose_with(slot, &mut book, tokens, max);
        if out.is_err() {
            self.restart(slot, &mut book);
        }
        self.books[slot] = Some(book);
        out
    }

    fn propose_with(&mut self, slot: usize, book: &mut Book, tokens: &[u32], max: usize) -> Result<Draft> {
        let n = tokens.len();
        if n == 0 || max == 0 {
            return Ok(Draft::default());
        }
        self.sync(slot, book, tokens)?;
        let (t, context) = (self.decoder.config().max_verify, self.decoder.config().max_context);
        // The last draft step verifies up to position n + k − 2, so k ≤ context + 1 − n: fewer drafts near the limit,
        // none past it. Its window holds the stream's uncommitted tokens (at least the last one) and k − 1 drafts,
        // so k ≤ T; the catch-up makes room for the rest.
        let k = max.min(t).min((context + 1).saturating_sub(n));
        if k == 0 {
            return Ok(Draft::default());
        }
        let mut first = self.catch_up(slot, book, tokens, k)?;
        // `window` is what the next draft step verifies: the uncommitted tail of the stream, then the drafts so far.
        let mut window = tokens[book.committed.len()..].to_vec();
        let mut drafts = Vec::with_capacity(k);
        let mut probs = Vec::with_capacity(k);
        for _ in 0..k {
            let row = match first.take() {
                Some(row) => row,
                None => self.verify_last(slot, book, &window)?,
            };
            let (token, q) = pick(&row, &book.sampling, &mut book.draws);
            drafts.push(token);
            probs.extend(q);
            window.push(token);
        }
        Ok(Draft {
            probs: (book.sampling.temperature > 0.0).then_some(probs),
            tokens: drafts,
        })
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

    /// Ends the pending verify with nothing accepted, verifies `window` and returns its last row of logits (the
    /// prediction after the window's last token).
    fn verify_last(&mut self, slot: usize, book: &mut Book, window: &[u32]) -> Result<Vec<f32>> {
        if !book.pending.is_empty() {
            self.decoder.commit(slot, 0)?;
            book.pending.clear();
        }
        let mut logits = self.decoder.verify(slot, window)?;
        book.pending.extend_from_slice(window);
        let vocab = logits.len() / window.len();
        Ok(logits.split_off(logits.len() - vocab))
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
