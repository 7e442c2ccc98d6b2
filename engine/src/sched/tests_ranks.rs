//! The property tests' model of the ranks (`tests.rs`): what every slot's state holds after each step the scheduler
//! plans, checked against each request's token stream, and the books check that ties the scheduler's slots and KV
//! blocks to it.

use std::collections::{HashMap, HashSet};

use super::*;

/// What the ranks would hold: per slot, the request in it and the tokens its state holds.
#[derive(Default)]
pub(super) struct Ranks {
    pub(super) slots: HashMap<usize, (u64, Vec<u32>)>,
    /// Per slot: the tokens of its last verify, held until a commit keeps some of them.
    pub(super) pending: HashMap<usize, usize>,
}

impl Ranks {
    /// Runs `step`'s first decode step against every request's token stream (its prompt, then every token sampled
    /// for it); a request in `restarted` (requeued by a fault) must come back afresh with a prefill from position 0.
    /// A chained step's further tokens follow through [`Ranks::feed`].
    pub(super) fn run(
        &mut self,
        step: &Step,
        c: &SchedConfig,
        streams: &HashMap<u64, Vec<u32>>,
        restarted: &mut HashSet<u64>,
    ) {
        assert!(
            step.tokens() <= c.max_batch_tokens,
            "the step runs {} tokens, budget {}",
            step.tokens(),
            c.max_batch_tokens
        );
        for &(slot, n) in &step.commits {
            let p = self
                .pending
                .remove(&slot)
                .expect("a commit of a slot with a verify pending");
            let (id, held) = self.slots.get_mut(&slot).expect("a committed slot holds a sequence");
            // 0: a verify that yielded no token (`Scheduler::verified_unresolved`) keeps not even its input.
            assert!(n <= p, "slot {slot} commits {n} of {p} verified tokens");
            held.truncate(held.len() - p + n);
            assert!(
                streams[id].starts_with(held),
                "slot {slot} commits tokens off its stream"
            );
        }
        if step.spec_chain {
            assert!(step.chained > 0 && step.chained < c.decode_steps, "{step:?}");
            assert!(step.preempted.is_empty(), "a chain of verifies preempts: {step:?}");
            let t = step.work.first().map(|p| match &p.work {
                StepWork::Verify { tokens, .. } => tokens.len(),
                _ => 0,
            });
            assert!(
                step.work
                    .iter()
                    .all(|p| !p.fresh && matches!(&p.work, StepWork::Verify { tokens, .. } if Some(tokens.len()) == t)),
                "a chain of verifies runs more than verifies of one window: {step:?}"
            );
        } else if step.chained > 0 {
            assert!(
                step.chained < c.decode_steps,
                "{} chained steps of {}",
                step.chained,
                c.decode_steps
            );
            assert!(
                step.commits.is_empty() && step.preempted.is_empty(),
                "a chained step commits or preempts: {step:?}"
            );
            assert!(
                step.work
                    .iter()
                    .all(|p| !p.fresh && matches!(p.work, StepWork::Decode { sample: true, .. })),
                "a chained step runs more than sampled decodes: {step:?}"
            );
        }
        for (id, slot) in &step.preempted {
            let held = self.slots.remove(slot);
            assert!(
                held.as_ref().is_none_or(|(h, _)| h == id),
                "slot {slot} released for {id}, held {held:?}"
            );
            assert!(step.work.iter().all(|p| p.id != *id), "preempted {id} still planned");
        }
        let mut seen = HashSet::new();
        for p in &step.work {
            assert!(seen.insert(p.slot), "slot {} planned twice", p.slot);
            if restarted.remove(&p.id) {
                assert!(
                    p.fresh && matches!(p.work, StepWork::Prefill { position, .. } if position == p.restored),
                    "request {} resumes after a fault without a fresh prefill from its restored state: {p:?}",
                    p.id
                );
            }
            if p.fresh {
                self.pending.remove(&p.slot);
                assert!(
                    self.slots.get(&p.slot).is_none_or(|(id, _)| *id == p.id),
                    "slot {} taken afresh while another request holds it",
                    p.slot
                );
                // A restored sequence's slot starts holding its saved tokens.
                self.slots.insert(p.slot, (p.id, streams[&p.id][..p.restored].to_vec()));
            }
            let (id, held) = self.slots.get_mut(&p.slot).expect("a planned slot holds a sequence");
            assert_eq!(*id, p.id, "slot {} holds another request", p.slot);
            let stream = &streams[&p.id];
            match &p.work {
                StepWork::Prefill { position, tokens, last } => {
                    assert_eq!(*position, held.len(), "prompt chunk of {} at the wrong position", p.id);
                    held.extend_from_slice(tokens);
                    assert!(stream.starts_with(held), "prompt chunk of {} is not its stream", p.id);
                    if *last {
                        assert_eq!(
                            held, stream,
                            "{}'s prefill ends before its prompt and generated tokens",
                            p.id
                        );
                    }
                }
                StepWork::Decode {
                    position,
                    token,
                    sample,
                } => {
                    assert_eq!(*position, held.len(), "decode of {} at the wrong position", p.id);
                    held.push(*token);
                    assert!(stream.starts_with(held), "decode of {} is not its stream", p.id);
                    if *sample {
                        assert_eq!(held, stream, "decode of {} does not feed its last sampled token", p.id);
                    } else {
                        assert!(held.len() < stream.len(), "{} replays past its stream", p.id);
                    }
                }
                StepWork::Verify { position, tokens } => {
                    assert_eq!(*position, held.len(), "verify of {} at the wrong position", p.id);
                    assert_eq!(
                        held.len() + 1,
                        stream.len(),
                        "{}'s verify does not follow its stream",
                        p.id
                    );
                    assert_eq!(
                        tokens[0], stream[*position],
                        "{}'s verify does not feed its last token",
                        p.id
                    );
                    held.extend_from_slice(tokens);
                    self.pending.insert(p.slot, tokens.len());
                }
            }
        }
    }

    /// A chained verify step on the ranks: the last verify commits `n` tokens, then `window` is verified.
    pub(super) fn chain_verify(&mut self, slot: usize, n: usize, window: &[u32], stream: &[u32], max_context: usize) {
        let p = self.pending.remove(&slot).expect("a chained slot has a verify pending");
        let (_, held) = self.slots.get_mut(&slot).expect("a chained slot holds a sequence");
        held.truncate(held.len() - p + n);
        assert_eq!(held, stream, "a chained verify does not follow the committed tokens");
        held.extend_from_slice(window);
        assert!(held.len() <= max_context, "a chain of verifies past the context");
        self.pending.insert(slot, window.len());
    }

    /// A chained step's next decode: the ranks feed `token`, just sampled for `id`, at the slot's next position.
    pub(super) fn feed(&mut self, slot: usize, id: u64, token: u32, stream: &[u32], max_context: usize) {
        let (held_id, held) = self.slots.get_mut(&slot).expect("a chained slot holds a sequence");
        assert_eq!(*held_id, id, "slot {slot} holds another request");
        held.push(token);
        assert_eq!(
            held, stream,
            "the chained decode of {id} does not feed its last sampled token"
        );
        assert!(held.len() <= max_context, "{id} chains past the context");
    }
}

pub(super) fn check_books(s: &Scheduler, c: &SchedConfig, ranks: &Ranks) {
    let (free_slots, free_blocks) = s.free();
    let mut running = s.running_slots();
    running.sort_unstable();
    let n = running.len();
    running.dedup();
    assert_eq!(running.len(), n, "a slot is used twice: {running:?}");
    assert_eq!(free_slots + running.len(), c.slots, "slots leaked");
    assert_eq!(free_blocks + s.held_blocks(), c.kv_blocks, "KV blocks leaked");
    let mut held: Vec<usize> = ranks.slots.keys().copied().collect();
    held.sort_unstable();
    assert_eq!(held, running, "the ranks' slots differ from the running sequences'");
    let need: usize = ranks
        .slots
        .values()
        .map(|(_, h)| h.len().div_ceil(c.kv_block_size))
        .sum();
    assert!(
        need <= s.held_blocks(),
        "the ranks hold tokens for {need} KV blocks, the scheduler reserved {}",
        s.held_blocks()
    );
}
