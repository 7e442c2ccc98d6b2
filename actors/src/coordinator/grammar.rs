//! Structured outputs in the coordinator: each constrained request's grammar state (`Live::grammar`), its token mask
//! before each step that samples it (computed on rayon's threads, in parallel over the step's constrained rows), and
//! its advance by each delivered token. Constrained requests do not chain (`SamplingParams::adjusts_logits`).
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

use rewind_engine::grammar::{self, GrammarState};
use rewind_engine::sample::SamplingParams;
use rewind_engine::sched::{Step, StepWork};
use rewind_engine::spec::Draft;

use super::CoordinatorState;
use crate::metrics::Metrics;

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
    /// The masks of the constrained requests that sample in `planned`: those their drafts' check computed already
    /// (a request that drafted nothing its grammar allows decodes), the others computed now.
    pub(super) fn grammar_masks(&mut self, planned: &Step) -> StepMasks {
        let sampled: Vec<u64> = planned
            .work
            .iter()
            .filter(|p| p.samples() && !matches!(p.work, StepWork::Verify { .. }))
            .map(|p| p.id)
            .collect();
        let mut out = StepMasks::default();
        let (mut ids, mut states): (Vec<u64>, Vec<&mut GrammarState>) = (Vec::new(), Vec::new());
        for (id, l) in self.live.iter_mut() {
            let Some(g) = l.grammar.as_mut().filter(|_| sampled.contains(id)) else {
                continue;
            };
            let known = l.spec.as_mut().and_then(|s| s.row_masks.take());
            match known.filter(|m| m.tokens == l.history.len()) {
                Some(m) if !m.masks.is_empty() => {
                    out.masks.insert(*id, m.masks[0].clone());
                }
                _ => {
                    ids.push(*id);
                    states.push(g);
                }
            }
        }
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
        for (id, l) in self.live.iter_mut() {
            if let (Some(g), Some(&d)) = (l.grammar.as_mut(), drafts.get(id)) {
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
}
