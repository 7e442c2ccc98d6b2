//! Structured outputs in the coordinator: each constrained request's grammar state (`Live::grammar`), its token mask
//! before each step that samples it (computed on rayon's threads, in parallel over the step's constrained rows), and
//! its advance by each delivered token. Constrained requests neither speculate nor chain (`admit_sequence`,
//! `SamplingParams::adjusts_logits`), so every token of theirs is sampled from a row masked here.

use std::collections::HashMap;
use std::sync::Arc;

use rewind_engine::grammar::{self, GrammarState};
use rewind_engine::sched::{Step, StepWork};

use super::CoordinatorState;

/// A step's token masks by request, and the requests whose grammar failed to give one (with why): those run the
/// step unmasked and are failed instead of delivered.
#[derive(Default)]
pub(super) struct StepMasks {
    pub(super) masks: HashMap<u64, Arc<[u32]>>,
    pub(super) failed: Vec<(u64, String)>,
}

impl CoordinatorState {
    /// The masks of the constrained requests that sample in `planned`.
    pub(super) fn grammar_masks(&mut self, planned: &Step) -> StepMasks {
        let sampled: Vec<u64> = planned
            .work
            .iter()
            .filter(|p| p.samples() && !matches!(p.work, StepWork::Verify { .. }))
            .map(|p| p.id)
            .collect();
        let (mut ids, mut states): (Vec<u64>, Vec<&mut GrammarState>) = (Vec::new(), Vec::new());
        for (id, l) in self.live.iter_mut() {
            if let Some(g) = l.grammar.as_mut().filter(|_| sampled.contains(id)) {
                ids.push(*id);
                states.push(g);
            }
        }
        let mut out = StepMasks::default();
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
}
