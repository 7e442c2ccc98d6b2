//! Structured outputs in the coordinator: each constrained request's grammar state (`Live::grammar`), its token mask
//! before each step that samples it (computed on rayon's threads, in parallel over the step's constrained rows), and
//! its advance by each delivered token. Constrained requests do not chain (`SamplingParams::adjusts_logits`).
//!
//! Masks are computed ahead, on a blocking thread, while the coordinator does other work ([`MasksAhead`]): while
//! the ranks run a step, the masks of the constrained requests that do not sample in it (waiting, or prefilling a
//! chunk before their last); and from the moment a step's tokens are delivered until the next step's masks are
//! needed (the rest of the delivery: session saves, forks, releases on the ranks; other messages; the next step's
//! drafting and scheduling), those of the constrained requests that do not speculate. A speculating one's masks come
//! from its drafts' check, which needs its drafts first. What is left is computed when the step is planned.
//!
//! Speculation stays exact for greedy constrained requests ([`masked_greedy`]): before the verify, each draft is
//! checked against the mask its position would get, and the drafts are cut at the first token the mask refuses
//! ([`CoordinatorState::cut_drafts`]); the masks of the verify's rows are kept. The verify is judged from the rows'
//! argmax as an unconstrained greedy one, and the token after the accepted drafts is taken only when its row's mask
//! allows it (a row's argmax that the mask allows is the masked argmax too). When the mask refuses it, the verify
//! yields no token there: the slot keeps the accepted drafts but the last, whose position the next step decodes with
//! the mask (`Scheduler::verified_unresolved`). So the output is token for token the non-speculative constrained run.
//! A sampled constrained request does not speculate: its verify would be judged from one-pass summaries over the
//! unmasked vocabulary.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::task::JoinHandle;
use tracing::warn;

use rewind_engine::grammar::{self, GrammarState};
use rewind_engine::sample::SamplingParams;
use rewind_engine::sched::{Step, StepWork};
use rewind_engine::spec::Draft;

use super::CoordinatorState;
use crate::metrics::Metrics;

/// A request's place in its grammar, and the mask of its next position when it was computed ahead.
pub(super) struct LiveGrammar {
    /// `None` while a host thread computes its mask ahead ([`MasksAhead`]).
    state: Option<GrammarState>,
    /// The mask of the position after `.0` tokens of the sequence.
    ahead: Option<(usize, Arc<[u32]>)>,
}

impl LiveGrammar {
    pub(super) fn new(state: GrammarState) -> Self {
        LiveGrammar {
            state: Some(state),
            ahead: None,
        }
    }

    /// Advances the grammar by a delivered token.
    pub(super) fn accept(&mut self, token: u32) -> rewind_engine::Result<()> {
        self.state.as_mut().ok_or_else(lost)?.accept(token)
    }

    /// The mask computed ahead for a sequence of `tokens` tokens, if any.
    fn take_ahead(&mut self, tokens: usize) -> Option<Arc<[u32]>> {
        self.ahead.take().filter(|(n, _)| *n == tokens).map(|(_, m)| m)
    }
}

fn lost() -> rewind_engine::EngineError {
    rewind_engine::EngineError::InvalidInput(
        "the output's grammar state was lost (the thread computing its mask failed)".into(),
    )
}

/// Masks being computed ahead on a blocking thread: the requests' ids, and the job that hands their grammar states
/// back with the masks (of the position after the given number of tokens).
pub(super) struct MasksAhead {
    ids: Vec<u64>,
    job: JoinHandle<Vec<Ahead>>,
}

/// A mask computed ahead: the request, the sequence length it is for, the request's grammar state, and the mask.
type Ahead = (u64, usize, GrammarState, rewind_engine::Result<Vec<u32>>);

/// A step's token masks by request, and the requests whose grammar failed to give one (with why): those run the
/// step unmasked and are failed instead of delivered.
#[derive(Default)]
pub(super) struct StepMasks {
    pub(super) masks: HashMap<u64, Arc<[u32]>>,
    pub(super) failed: Vec<(u64, String)>,
}

/// The masks of a constrained request's next rows, computed when its drafts were checked: row 0's (the next token's)
/// and one per valid draft after it, for the sequence of `tokens` tokens they were computed at.
pub(super) struct RowMasks {
    pub(super) tokens: usize,
    pub(super) masks: Vec<Arc<[u32]>>,
}

/// Whether a request's only logit adjustment is its grammar's mask and it decodes greedily: the constrained requests
/// that speculate (see the module docs).
pub(super) fn masked_greedy(p: &SamplingParams) -> bool {
    p.constraint.is_some()
        && p.temperature == 0.0
        && !SamplingParams {
            constraint: None,
            ..p.clone()
        }
        .adjusts_logits()
}

/// Whether a request's speculation can be exact: an unconstrained one, or a greedy one masked by its grammar only.
pub(super) fn may_speculate(p: &SamplingParams) -> bool {
    p.constraint.is_none() || masked_greedy(p)
}

impl CoordinatorState {
    /// The masks of the constrained requests that sample in `planned`: those computed ahead or by their drafts'
    /// check (a request that drafted nothing its grammar allows decodes), the others computed now.
    pub(super) async fn grammar_masks(&mut self, planned: &Step) -> StepMasks {
        self.join_masks_ahead().await;
        let sampled: Vec<u64> = planned
            .work
            .iter()
            .filter(|p| p.samples() && !matches!(p.work, StepWork::Verify { .. }))
            .map(|p| p.id)
            .collect();
        let mut out = StepMasks::default();
        let (mut ids, mut states): (Vec<u64>, Vec<&mut GrammarState>) = (Vec::new(), Vec::new());
        let (mut ahead, mut computed) = (0u64, 0u64);
        for (id, l) in self.live.iter_mut() {
            let Some(g) = l.grammar.as_mut().filter(|_| sampled.contains(id)) else {
                continue;
            };
            let tokens = l.history.len();
            let checked = l.spec.as_mut().and_then(|s| s.row_masks.take());
            let known = checked
                .filter(|m| m.tokens == tokens)
                .and_then(|m| m.masks.into_iter().next())
                .or_else(|| g.take_ahead(tokens));
            match (known, g.state.as_mut()) {
                (Some(m), _) => {
                    ahead += 1;
                    out.masks.insert(*id, m);
                }
                (None, Some(state)) => {
                    computed += 1;
                    ids.push(*id);
                    states.push(state);
                }
                (None, None) => out.failed.push((*id, lost().to_string())),
            }
        }
        tracing::debug!(ahead, computed, "grammar masks of the step");
        Metrics::add(&self.metrics.grammar_masks, ahead + computed);
        Metrics::add(&self.metrics.grammar_masks_ahead, ahead);
        if states.is_empty() {
            return out;
        }
        for (id, mask) in ids.into_iter().zip(grammar::masks(&mut states, self.info.vocab)) {
            match mask {
                Ok(m) => {
                    out.masks.insert(id, m.into());
                }
                Err(e) => out.failed.push((id, e.to_string())),
            }
        }
        out
    }

    /// Cuts each constrained request's proposal in `proposed` at the first draft token its grammar's mask refuses
    /// (the requests' walks in parallel), keeping the masks of the verify's rows with the request. A grammar that
    /// fails is returned with why, for its request to fail.
    pub(super) fn cut_drafts(&mut self, proposed: &mut [(u64, Draft)]) -> Vec<(u64, String)> {
        let drafts: HashMap<u64, &[u32]> = proposed.iter().map(|(id, d)| (*id, d.tokens.as_slice())).collect();
        let (mut ids, mut items): (Vec<u64>, Vec<(&mut GrammarState, &[u32])>) = (Vec::new(), Vec::new());
        // A speculating request's mask is never computed ahead, so its state is here.
        for (id, l) in self.live.iter_mut() {
            if let (Some(g), Some(&d)) = (l.grammar.as_mut().and_then(|g| g.state.as_mut()), drafts.get(id)) {
                ids.push(*id);
                items.push((g, d));
            }
        }
        if items.is_empty() {
            return Vec::new();
        }
        let walked: HashMap<u64, _> = ids
            .into_iter()
            .zip(grammar::draft_masks(&mut items, self.info.vocab))
            .collect();
        let mut failed = Vec::new();
        for (id, d) in proposed.iter_mut() {
            let Some(walk) = walked.get(id) else { continue };
            let masks = match walk {
                Ok(m) => m,
                Err(e) => {
                    failed.push((*id, e.to_string()));
                    d.tokens.clear();
                    continue;
                }
            };
            let valid = masks.len() - 1;
            Metrics::add(
                &self.metrics.spec_grammar_cut,
                d.tokens.len().saturating_sub(valid) as u64,
            );
            d.tokens.truncate(valid);
            if let Some(l) = self.live.get_mut(id) {
                let tokens = l.history.len();
                if let Some(s) = l.spec.as_mut() {
                    s.row_masks = Some(RowMasks {
                        tokens,
                        masks: masks.iter().map(|m| Arc::from(m.as_slice())).collect(),
                    });
                }
            }
        }
        failed
    }

    /// Starts computing ahead the masks of the constrained requests `pick` chooses (given each request) that have no
    /// mask for their next position yet, on a blocking thread; does nothing while a job is in flight.
    pub(super) fn start_masks_ahead(&mut self, pick: impl Fn(u64, &super::Live) -> bool) {
        if self.masks_ahead.is_some() {
            return;
        }
        let mut taken = Vec::new();
        for (&id, l) in self.live.iter_mut() {
            let tokens = l.history.len();
            let wanted = l
                .grammar
                .as_ref()
                .is_some_and(|g| g.state.is_some() && g.ahead.as_ref().is_none_or(|(n, _)| *n != tokens));
            if !wanted || !pick(id, l) {
                continue;
            }
            if let Some(state) = l.grammar.as_mut().and_then(|g| g.state.take()) {
                taken.push((id, tokens, state));
            }
        }
        if taken.is_empty() {
            return;
        }
        let vocab = self.info.vocab;
        let ids = taken.iter().map(|(id, ..)| *id).collect();
        let job = tokio::task::spawn_blocking(move || {
            let mut states: Vec<GrammarState> = Vec::with_capacity(taken.len());
            let mut keys = Vec::with_capacity(taken.len());
            for (id, tokens, state) in taken {
                keys.push((id, tokens));
                states.push(state);
            }
            let masks = {
                let mut refs: Vec<&mut GrammarState> = states.iter_mut().collect();
                grammar::masks(&mut refs, vocab)
            };
            keys.into_iter()
                .zip(states)
                .zip(masks)
                .map(|(((id, tokens), state), mask)| (id, tokens, state, mask))
                .collect()
        });
        self.masks_ahead = Some(MasksAhead { ids, job });
    }

    /// Waits for the masks computed ahead and hands their grammar states back to their requests (a request that
    /// ended meanwhile drops its own). A mask that failed is computed again when needed, and fails its request then.
    pub(super) async fn join_masks_ahead(&mut self) {
        let Some(MasksAhead { ids, job }) = self.masks_ahead.take() else {
            return;
        };
        let done = match job.await {
            Ok(done) => done,
            Err(e) => {
                // Their states are lost: each request fails when its mask is next asked for.
                warn!(requests = ?ids, %e, "computing grammar masks ahead failed");
                return;
            }
        };
        for (id, tokens, state, mask) in done {
            let Some(g) = self.live.get_mut(&id).and_then(|l| l.grammar.as_mut()) else {
                continue;
            };
            g.state = Some(state);
            g.ahead = mask.ok().map(|m| (tokens, Arc::from(m)));
        }
    }
}
