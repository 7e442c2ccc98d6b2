//! Property tests of the scheduler over random arrivals, cancellations, stops and configurations, against a model of
//! what the ranks hold: no slot or KV block is leaked or used twice, every step stays within its token budget and
//! feeds each slot the next position of its sequence, and every admitted request finishes.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

#[derive(Clone, Debug)]
enum Op {
    Submit {
        prompt: usize,
        max_tokens: usize,
        priority: i32,
    },
    Cancel(usize),
    Step {
        stops: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..40, 1usize..16, -1i32..2).prop_map(|(prompt, max_tokens, priority)| Op::Submit { prompt, max_tokens, priority }),
        1 => (0usize..64).prop_map(Op::Cancel),
        6 => any::<u64>().prop_map(|stops| Op::Step { stops }),
    ]
}

fn config() -> impl Strategy<Value = SchedConfig> {
    (1usize..6, 1usize..9, 8usize..64, 1usize..48).prop_map(|(slots, block, blocks, budget)| SchedConfig {
        slots,
        kv_blocks: blocks,
        kv_block_size: block,
        max_batch_tokens: budget,
        max_context: 64,
    })
}

/// What the ranks would hold: per slot, the request in it and how many tokens its state holds.
#[derive(Default)]
struct Ranks {
    slots: HashMap<usize, (u64, usize)>,
}

impl Ranks {
    fn run(&mut self, step: &Step, budget: usize) {
        assert!(
            step.tokens() <= budget,
            "the step runs {} tokens, budget {budget}",
            step.tokens()
        );
        for (id, slot) in &step.preempted {
            let held = self.slots.remove(slot);
            assert!(
                held.is_none_or(|(h, _)| h == *id),
                "slot {slot} released for {id}, held {held:?}"
            );
            assert!(step.work.iter().all(|p| p.id != *id), "preempted {id} still planned");
        }
        let mut seen = std::collections::HashSet::new();
        for p in &step.work {
            assert!(seen.insert(p.slot), "slot {} planned twice", p.slot);
            if p.fresh {
                assert!(
                    self.slots.get(&p.slot).is_none_or(|(id, _)| *id == p.id),
                    "slot {} taken afresh while another request holds it",
                    p.slot
                );
                self.slots.insert(p.slot, (p.id, 0));
            }
            let (id, len) = self.slots.get_mut(&p.slot).expect("a planned slot holds a sequence");
            assert_eq!(*id, p.id, "slot {} holds another request", p.slot);
            match &p.work {
                StepWork::Prefill { position, tokens, .. } => {
                    assert_eq!(*position, *len, "prompt chunk of {} at the wrong position", p.id);
                    *len += tokens.len();
                }
                StepWork::Decode { position, .. } => {
                    assert_eq!(*position, *len, "decode of {} at the wrong position", p.id);
                    *len += 1;
                }
            }
        }
    }
}

fn check_books(s: &Scheduler, c: &SchedConfig) {
    let (free_slots, free_blocks) = s.free();
    let running = s.running_slots();
    let mut sorted = running.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), running.len(), "a slot is used twice: {running:?}");
    assert_eq!(free_slots + running.len(), c.slots, "slots leaked");
    assert_eq!(free_blocks + s.held_blocks(), c.kv_blocks, "KV blocks leaked");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, .. ProptestConfig::default() })]

    #[test]
    fn no_leaks_budget_holds_positions_follow_and_everything_finishes(c in config(), ops in prop::collection::vec(op(), 1..80)) {
        let mut s = Scheduler::new(c).expect("scheduler");
        let mut ranks = Ranks::default();
        let mut next_id = 0u64;
        let mut accepted: Vec<u64> = Vec::new();
        let mut done: HashMap<u64, usize> = HashMap::new();
        let mut cancelled = std::collections::HashSet::new();
        let mut max_tokens: HashMap<u64, usize> = HashMap::new();
        let step_once = |s: &mut Scheduler, ranks: &mut Ranks, stops: u64, done: &mut HashMap<u64, usize>| {
            let step = s.schedule();
            ranks.run(&step, c.max_batch_tokens);
            for (k, p) in step.work.iter().enumerate() {
                if p.samples() {
                    let stop = stops >> (k % 64) & 1 == 1 && stops.count_ones() > 60;
                    *done.entry(p.id).or_default() += 1;
                    if let Some(slot) = s.sampled(p.id, 7, stop).expect("sampled") {
                        ranks.slots.remove(&slot);
                    }
                }
            }
        };
        for o in ops {
            match o {
                Op::Submit { prompt, max_tokens: m, priority } => {
                    let r = Request { id: next_id, prompt: vec![1; prompt], max_tokens: m, priority };
                    if s.submit(r).is_ok() {
                        accepted.push(next_id);
                        max_tokens.insert(next_id, m);
                    }
                    next_id += 1;
                }
                Op::Cancel(k) => {
                    if let Some(&id) = accepted.get(k) {
                        if s.contains(id) {
                            if let Some(slot) = s.cancel(id) {
                                ranks.slots.remove(&slot);
                            }
                            cancelled.insert(id);
                        }
                    }
                }
                Op::Step { stops } => step_once(&mut s, &mut ranks, stops, &mut done),
            }
            check_books(&s, &c);
        }
        // Drain: with no more arrivals every request finishes within a bounded number of steps.
        let bound = 10_000;
        let mut steps = 0;
        while s.counts() != (0, 0) {
            step_once(&mut s, &mut ranks, 0, &mut done);
            check_books(&s, &c);
            steps += 1;
            prop_assert!(steps < bound, "no progress: {:?} waiting/running", s.counts());
        }
        prop_assert_eq!(s.free(), (c.slots, c.kv_blocks));
        for id in accepted {
            if !cancelled.contains(&id) {
                // Without stops a request ends exactly at max_tokens; a stop ends it earlier, never later.
                let n = done.get(&id).copied().unwrap_or(0);
                prop_assert!(n >= 1 && n <= max_tokens[&id], "request {} sampled {} tokens of {}", id, n, max_tokens[&id]);
            }
        }
    }
}

#[test]
fn requests_that_can_never_run_are_refused() {
    let c = SchedConfig {
        slots: 2,
        kv_blocks: 4,
        kv_block_size: 4,
        max_batch_tokens: 8,
        max_context: 32,
    };
    let mut s = Scheduler::new(c).expect("scheduler");
    let req = |id, n, m| Request {
        id,
        prompt: vec![1; n],
        max_tokens: m,
        priority: 0,
    };
    assert_eq!(s.submit(req(1, 0, 1)), Err(SchedError::EmptyPrompt { id: 1 }));
    assert_eq!(s.submit(req(2, 4, 0)), Err(SchedError::NoTokens { id: 2 }));
    assert!(matches!(s.submit(req(3, 30, 8)), Err(SchedError::TooLong { .. })));
    assert!(matches!(
        s.submit(req(4, 16, 4)),
        Err(SchedError::TooBig { need: 5, .. })
    ));
    s.submit(req(5, 8, 8)).expect("fits");
    assert_eq!(s.submit(req(5, 8, 8)), Err(SchedError::Duplicate { id: 5 }));
    assert!(Scheduler::new(SchedConfig { slots: 0, ..c }).is_err());
}

#[test]
fn decodes_come_first_then_chunks_fill_the_budget_and_priority_wins() {
    let c = SchedConfig {
        slots: 3,
        kv_blocks: 64,
        kv_block_size: 4,
        max_batch_tokens: 6,
        max_context: 64,
    };
    let mut s = Scheduler::new(c).expect("scheduler");
    let req = |id, n, p| Request {
        id,
        prompt: vec![1; n],
        max_tokens: 4,
        priority: p,
    };
    s.submit(req(1, 4, 0)).expect("submit");
    let step = s.schedule();
    assert_eq!(step.tokens(), 4);
    s.sampled(1, 9, false).expect("sampled");
    s.submit(req(2, 10, 0)).expect("submit");
    s.submit(req(3, 10, 5)).expect("submit");
    let step = s.schedule();
    // Request 1 decodes its sampled token, then the higher-priority request 3 takes the rest of the budget.
    assert_eq!(step.work[0].work, StepWork::Decode { position: 4, token: 9 });
    assert_eq!(step.work[1].id, 3);
    assert_eq!(step.tokens(), 6);
}
