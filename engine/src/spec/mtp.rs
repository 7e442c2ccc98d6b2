//! The MTP drafter: the checkpoint's own multi-token-prediction layer ([`crate::model::mtp`]) drafts greedily from
//! the target's hidden states.
//!
//! The target's hidden rows reach the drafter as they are committed: [`Drafter::observe`] takes each prompt chunk's
//! rows (every prompt position, as vLLM and SGLang run the MTP layer over the prompt) and each step's committed rows,
//! with the token that followed each; a proposal may also bring the rows not yet observed. With rows of positions
//! `p .. p + n` (row `i`'s next token is `tokens[p + i + 1]`):
//!
//! 1. the MTP layer's KV is truncated to position `p`, dropping the previous proposal's draft steps (and any entries
//!    of positions the target rolled back);
//! 2. the `n` rows go through the MTP layer in one forward, each with its next token, and their KV entries stay;
//! 3. at a proposal, the output of the row before the last token gives draft 1 (greedy); draft `j > 1` runs the MTP
//!    layer on draft `j − 1` with the previous step's output as its hidden input. These steps' KV entries are kept
//!    only until the next rows or proposal.
//!
//! The KV starts at the first position the drafter is handed: 0 when the ranks return every prompt row (the CPU
//! rank), the last prompt row when they return only the sampled rows (the GPU rank so far), or a session turn's
//! first new position. RoPE positions count from that start; the MTP layer attends only over its own KV and RoPE
//! scores depend only on position differences, so this equals absolute positions. Rows that do not continue the KV
//! (they start past its end, or before its start) restart it at their position.
//!
//! Greedy picks run the LM head one vocabulary tile at a time ([`tiled_argmax`]), so no vocabulary-sized logits
//! vector is ever built.

use std::path::Path;
use std::sync::Arc;

use rayon::prelude::*;
use rewind_kernels::cpu::gemm::matmul_nt;

use super::{Draft, DraftInput, Drafter, HiddenRows};
use crate::error::{EngineError, Result};
use crate::model::mixers::attention::KvCache;
pub use weights::MtpWeights;

/// Vocabulary ids per tile of [`tiled_argmax`]: one tile's logits fit on the stack.
pub const ARGMAX_TILE: usize = 256;

/// The greedy token of `x` (`[hidden]`, already normed) under the LM head `weight` (`[vocab, hidden]`): the lowest id
/// among the largest logits, computed a tile of [`ARGMAX_TILE`] ids at a time (tiles in parallel) so that no logits
/// vector of the vocabulary's size exists. NaN logits are skipped; `None` when every logit is NaN (or the vocabulary
/// is empty).
pub fn tiled_argmax(x: &[f32], weight: &[f32], hidden: usize) -> Option<u32> {
    assert!(
        hidden > 0 && x.len() == hidden && weight.len().is_multiple_of(hidden),
        "tiled_argmax: x must be one row of the head's width"
    );
    let vocab = weight.len() / hidden;
    (0..vocab.div_ceil(ARGMAX_TILE))
        .into_par_iter()
        .map(|tile| {
            let (lo, hi) = (tile * ARGMAX_TILE, ((tile + 1) * ARGMAX_TILE).min(vocab));
            let mut logits = [0.0f32; ARGMAX_TILE];
            let logits = &mut logits[..hi - lo];
            matmul_nt(x, &weight[lo * hidden..hi * hidden], logits, 1, hidden, hi - lo);
            let mut best: Option<(u32, f32)> = None;
            for (i, &v) in logits.iter().enumerate() {
                // Strictly greater keeps the lowest id on ties; NaN never compares greater.
                if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
                    best = Some(((lo + i) as u32, v));
                }
            }
            best
        })
        .reduce(|| None, pick)
        .map(|(id, _)| id)
}

/// The larger of two `(id, logit)` candidates, the lower id on ties: associative and commutative, so the parallel
/// reduction gives the same id however the tiles are grouped.
fn pick(a: Option<(u32, f32)>, b: Option<(u32, f32)>) -> Option<(u32, f32)> {
    match (a, b) {
        (Some(x), Some(y)) => Some(if y.1 > x.1 || (y.1 == x.1 && y.0 < x.0) { y } else { x }),
        (x, None) => x,
        (None, y) => y,
    }
}

/// One request's MTP drafter: the shared weights and this sequence's KV of the MTP layer.
///
/// Make one per request with [`MtpDrafter::new`] from weights loaded once ([`MtpWeights::load`]); it is cheap.
pub struct MtpDrafter {
    weights: Arc<MtpWeights>,
    cache: KvCache,
    /// Absolute position of the cache's first entry.
    base: usize,
    /// Cache entries of committed positions (`base .. base + committed`); entries past them are draft steps.
    committed: usize,
    /// The output of the last committed row: its absolute position and the row (`[hidden]`), for a proposal that
    /// brings no new rows.
    last: Option<(usize, Vec<f32>)>,
}

impl MtpDrafter {
    /// A drafter with an empty KV over `weights`.
    pub fn new(weights: Arc<MtpWeights>) -> Self {
        let cache = weights.new_cache();
        MtpDrafter {
            weights,
            cache,
            base: 0,
            committed: 0,
            last: None,
        }
    }

    /// Loads the MTP weights of the checkpoint in `dir` and makes a drafter of them (to share the weights between
    /// requests, load them once with [`MtpWeights::load`] and use [`MtpDrafter::new`]).
    pub fn load(dir: &Path) -> Result<Self> {
        Ok(Self::new(MtpWeights::load(dir)?))
    }

    /// The shared weights.
    pub fn weights(&self) -> &Arc<MtpWeights> {
        &self.weights
    }

    /// Number of positions in the MTP layer's KV (committed ones and the last proposal's draft steps).
    pub fn kv_len(&self) -> usize {
        self.cache.len()
    }

    /// The MTP output of the last committed row, which the first draft comes from.
    #[cfg(test)]
    fn last_output(&self) -> Option<&[f32]> {
        self.last.as_ref().map(|(_, row)| row.as_slice())
    }

    /// Checks `rows` against the model's hidden size; the number of rows.
    fn check_rows(&self, rows: &HiddenRows) -> Result<usize> {
        let h = self.weights.config().hidden_size;
        if rows.hidden != h || !rows.rows.len().is_multiple_of(h) {
            return Err(EngineError::InvalidInput(format!(
                "MTP drafter: hidden rows of width {} ({} values), but the model's hidden size is {h}",
                rows.hidden,
                rows.rows.len()
            )));
        }
        Ok(rows.rows.len() / h)
    }

    /// Runs the `n` committed `rows` through the MTP layer, each with the token after it (`tokens[position + i +
    /// 1]`, known), keeping their KV entries: the cache is first cut back to the rows' first position (dropping draft
    /// steps and anything the target rolled back), or restarted there when it does not reach it.
    fn commit_rows(&mut self, tokens: &[u32], rows: &HiddenRows, n: usize) -> Result<()> {
        let (p, h) = (rows.position, rows.hidden);
        self.truncate_to(p);
        if n > 0 {
            let hidden = self.weights.normalise_target(&rows.rows);
            let out = self
                .weights
                .forward(&hidden, &tokens[p + 1..p + 1 + n], &mut self.cache)?;
            self.committed += n;
            self.last = Some((p + n - 1, out[(n - 1) * h..].to_vec()));
        }
        Ok(())
    }

    /// Absolute position of the KV's first entry (where the drafter started seeing the target's rows).
    pub fn kv_start(&self) -> usize {
        self.base
    }

    /// Drops the draft steps' entries and every committed entry from position `position` on; restarts the KV at
    /// `position` when it does not reach that far back or has a gap before it.
    fn truncate_to(&mut self, position: usize) {
        if position < self.base || position > self.base + self.committed {
            self.cache = self.weights.new_cache();
            self.base = position;
            self.committed = 0;
            self.last = None;
        } else {
            self.committed = position - self.base;
            self.cache.truncate(self.committed);
            if self.last.as_ref().is_some_and(|(p, _)| *p >= position) {
                self.last = None;
            }
        }
    }
}

impl Drafter for MtpDrafter {
    fn name(&self) -> &'static str {
        "mtp"
    }

    fn wants_hidden(&self) -> bool {
        true
    }

    fn observe(&mut self, tokens: &[u32], rows: &HiddenRows) -> Result<()> {
        let n = self.check_rows(rows)?;
        // Every row's next token must be known: it is the row's token input.
        if rows.position + n >= tokens.len() {
            return Err(EngineError::InvalidInput(format!(
                "MTP drafter: hidden rows of positions {}..{} need the token after each, but only {} tokens are known",
                rows.position,
                rows.position + n,
                tokens.len()
            )));
        }
        self.commit_rows(tokens, rows, n)
    }

    fn propose(&mut self, input: &DraftInput<'_>) -> Result<Draft> {
        let len = input.tokens.len();
        match input.hidden {
            Some(rows) => {
                let (p, n) = (rows.position, self.check_rows(rows)?);
                // The last row must be the one whose next token is the last token: drafts continue after it.
                if len == 0 || p + n != len - 1 {
                    return Err(EngineError::InvalidInput(format!(
                        "MTP drafter: hidden rows of positions {p}..{} do not end just before the last of the {len} \
                         tokens",
                        p + n
                    )));
                }
                self.commit_rows(input.tokens, rows, n)?;
            }
            // Everything was observed already: drop the previous proposal's draft steps.
            None => self.truncate_to(self.base + self.committed),
        }
        let h = self.weights.config().hidden_size;
        let mut x = match &self.last {
            Some((q, row)) if q + 2 == len => row.clone(),
            None if input.hidden.is_none() => {
                return Err(EngineError::InvalidInput(
                    "the MTP drafter needs the target's hidden states, and none came with this proposal or before \
                     it (the ranks could not return them)"
                        .into(),
                ))
            }
            _ => {
                return Err(EngineError::InvalidInput(format!(
                    "MTP drafter: no hidden row of position {} (the one before the last token) came with this \
                     proposal or was observed before it",
                    len.saturating_sub(2)
                )))
            }
        };
        // `max` is a window size; the capacity is capped so that a huge one cannot abort on allocation.
        let mut tokens = Vec::with_capacity(input.max.min(64));
        while tokens.len() < input.max {
            let position = len - 1 + tokens.len();
            let d = tiled_argmax(&x, self.weights.lm_head(), h).ok_or(EngineError::NonFinite { position })?;
            tokens.push(d);
            if tokens.len() < input.max {
                x = self.weights.forward(&x, &[d], &mut self.cache)?;
            }
        }
        Ok(Draft { tokens, probs: None })
    }
}

#[cfg(test)]
mod tests;
mod weights;
