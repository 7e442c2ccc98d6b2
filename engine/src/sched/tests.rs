//! Property tests of the scheduler over random arrivals, cancellations, stops, faults and configurations, against a
//! model of what the ranks hold: no slot or KV block is leaked or used twice, every step stays within its token budget
//! and feeds each slot the next tokens of its sequence (prompt, then every sampled token, chained steps feeding their
//! own), the KV blocks held cover every token in the ranks' state, a fault frees everything and each requeued sequence
//! is re-prefilled afresh with its prompt and generated tokens, and every admitted request finishes. Random drafts make
//! sequences verify, one step at a time or in chains of verifies (`Step::spec_chain`): each commit keeps the input
//! token and the accepted drafts (or, for a verify that yields no token after them, all but the last, which is fed
//! again), each chained step verifies the window after the committed tokens, and the blocks held cover the windows
//! in flight.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::tests_ranks::{check_books, Ranks};
use super::*;

#[derive(Clone, Debug)]
enum Op {
    Submit {
        prompt: usize,
        max_tokens: usize,
        priority: i32,
        /// Leading prompt tokens restored from a saved state (a session's turn), reduced below the prompt's length.
        restored: usize,
        chain: Chain,
    },
    Cancel(usize),
    Step {
        /// Bit `(5k + j) % 64` stops the `k`th planned sequence at its `j`th sampled token (of a chained step).
        stops: u64,
        /// Where the planned sequences verify: bits `(7k + 3i) % 62 ..` give the `k`th sequence's accepted drafts
        /// at its `i`th verify.
        accept: u64,
    },
    /// Every sequence ready for a draft gets `k` drafts (equal windows let verifies chain).
    Draft {
        k: usize,
    },
    /// A rank fault: every running sequence goes back to the queue and the ranks restart empty.
    Fault,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..40, 1usize..16, -1i32..2, prop_oneof![2 => Just(0usize), 1 => 0usize..40], prop_oneof![Just(Chain::None), Just(Chain::All)])
            .prop_map(|(prompt, max_tokens, priority, restored, chain)| Op::Submit { prompt, max_tokens, priority, restored: restored % prompt, chain }),
        1 => (0usize..64).prop_map(Op::Cancel),
        // Each bit set with probability 1/16: a sampled token stops now and then, within a chained step too.
        6 => (any::<[u64; 4]>(), any::<u64>()).prop_map(|([a, b, c, d], accept)| Op::Step { stops: a & b & c & d, accept }),
        2 => (1usize..4).prop_map(|k| Op::Draft { k }),
        1 => Just(Op::Fault),
    ]
}

fn config() -> impl Strategy<Value = SchedConfig> {
    // Contexts as short as 16 make the context, not max_tokens, end some chains.
    (1usize..6, 1usize..9, 8usize..64, 1usize..48, 1usize..5, 16usize..65).prop_map(
        |(slots, block, blocks, budget, steps, context)| SchedConfig {
            slots,
            kv_blocks: blocks,
            kv_block_size: block,
            max_batch_tokens: budget,
            max_context: context,
            decode_steps: steps,
        },
    )
}

/// One random run: the scheduler, the ranks' model, and every request's record.
struct Sim {
    c: SchedConfig,
    s: Scheduler,
    ranks: Ranks,
    /// Prompt, then every token sampled, per accepted request.
    streams: HashMap<u64, Vec<u32>>,
    prompt_len: HashMap<u64, usize>,
    max_tokens: HashMap<u64, usize>,
    chain: HashMap<u64, Chain>,
    accepted: Vec<u64>,
    cancelled: HashSet<u64>,
    /// Requeued by a fault and not planned since.
    restarted: HashSet<u64>,
    next_id: u64,
    next_token: u32,
}

impl Sim {
    fn new(c: SchedConfig) -> Self {
        Sim {
            c,
            s: Scheduler::new(c).expect("scheduler"),
            ranks: Ranks::default(),
            streams: HashMap::new(),
            prompt_len: HashMap::new(),
            max_tokens: HashMap::new(),
            chain: HashMap::new(),
            accepted: Vec::new(),
            cancelled: HashSet::new(),
            restarted: HashSet::new(),
            next_id: 0,
            next_token: 1_000_000,
        }
    }

    fn submit(&mut self, prompt: usize, max_tokens: usize, priority: i32, restored: usize, chain: Chain) {
        let id = self.next_id;
        self.next_id += 1;
        // Tokens distinct across requests and positions, so a chunk fed from the wrong place shows.
        let prompt: Vec<u32> = (0..prompt as u32).map(|i| id as u32 * 100 + i).collect();
        let r = Request {
            id,
            prompt: prompt.clone(),
            max_tokens,
            priority,
            restored,
            chain,
        };
        if self.s.submit(r).is_ok() {
            self.accepted.push(id);
            self.prompt_len.insert(id, prompt.len());
            self.max_tokens.insert(id, max_tokens);
            self.chain.insert(id, chain);
            self.streams.insert(id, prompt);
        }
    }

    fn cancel(&mut self, k: usize) {
        let Some(&id) = self.accepted.get(k) else {
            return;
        };
        if self.s.contains(id) {
            if let Some(slot) = self.s.cancel(id) {
                self.ranks.slots.remove(&slot);
            }
            self.cancelled.insert(id);
            self.restarted.remove(&id);
        }
    }

    /// Gives every sequence ready for a draft `k` new draft tokens.
    fn draft(&mut self, k: usize) {
        for id in self.s.draft_ready() {
            let drafts = (0..k as u32).map(|i| self.next_token + i).collect();
            self.next_token += k as u32;
            self.s.propose(id, drafts).expect("propose");
        }
    }

    fn step(&mut self, stops: u64, accept: u64) {
        let step = self.s.schedule();
        self.ranks.run(&step, &self.c, &self.streams, &mut self.restarted);
        // Nothing is admitted beside a chain, so the requests waiting now waited when it was planned.
        let waiting = self.s.counts().0;
        if step.spec_chain {
            assert_eq!(waiting, 0, "verifies chained while a request waits");
            self.verifies(&step, stops, accept);
            return;
        }
        if step.chained > 0 {
            // Some sequence may take every token of the chain.
            let longest = step
                .work
                .iter()
                .map(|p| self.max_tokens[&p.id] - (self.streams[&p.id].len() - self.prompt_len[&p.id]))
                .max()
                .unwrap_or(0);
            assert!(
                step.chained < longest,
                "a chain of {} past every sequence's end",
                step.chained
            );
            assert!(
                !self.s.could_admit(),
                "chained while a waiting request could start: {:?} waiting / running, {:?} free slots / blocks",
                self.s.counts(),
                self.s.free()
            );
        }
        for (k, p) in step.work.iter().enumerate() {
            if !p.samples() {
                continue;
            }
            if let StepWork::Verify { tokens, .. } = &p.work {
                // One verify: the accepted drafts, then a new token.
                let a = (accept >> ((7 * k) % 62) & 3) as usize % tokens.len();
                // Or, for a sequence that does not chain (a constrained one), no token after them: the last accepted
                // token (or the input) is fed again.
                if self.chain[&p.id] == Chain::None && accept >> (62 + k % 2) & 1 == 1 {
                    self.s.verified_unresolved(p.id, a).expect("verified");
                    self.sample_all(p.slot, p.id, &tokens[1..=a], stops, k);
                    continue;
                }
                self.s.verified(p.id, a).expect("verified");
                let mut out = tokens[1..=a].to_vec();
                out.push(self.new_token());
                self.sample_all(p.slot, p.id, &out, stops, k);
                continue;
            }
            if step.chained > 0 {
                // Every chained decode, kept or dropped after the sequence's end, stays inside the context.
                if let StepWork::Decode { position, .. } = p.work {
                    assert!(
                        position + 1 + step.chained <= self.c.max_context,
                        "{} chains to position {} past the context",
                        p.id,
                        position + step.chained
                    );
                }
                let generated = self.streams[&p.id].len() - self.prompt_len[&p.id];
                assert!(
                    self.chain[&p.id].chains(),
                    "{} chained its decodes although it may not",
                    p.id
                );
                // A chain runs past a sequence's last token only when no request waits for its slot.
                assert!(
                    waiting == 0 || generated + 1 + step.chained <= self.max_tokens[&p.id],
                    "{} chains past its max_tokens while a request waits",
                    p.id
                );
            }
            // Each of a chained step's tokens is sampled in order and fed to the next; a stop or the limit ends the
            // sequence there, and the ranks' later tokens go with its slot.
            for j in 0..=step.chained {
                let stop = stops >> ((5 * k + j) % 64) & 1 == 1;
                let token = self.next_token;
                self.next_token += 1;
                let stream = self.streams.get_mut(&p.id).expect("stream");
                stream.push(token);
                if let Some(slot) = self.s.sampled(p.id, token, stop).expect("sampled") {
                    self.ranks.slots.remove(&slot);
                    break;
                }
                if j < step.chained {
                    self.ranks.feed(p.slot, p.id, token, stream, self.c.max_context);
                }
            }
        }
    }

    fn new_token(&mut self) -> u32 {
        self.next_token += 1;
        self.next_token
    }

    /// Samples `tokens` for `id` in order until one finishes it (stop bits `(5k + j) % 64`); returns whether it
    /// finished.
    fn sample_all(&mut self, slot: usize, id: u64, tokens: &[u32], stops: u64, k: usize) -> bool {
        for (j, &token) in tokens.iter().enumerate() {
            let stop = stops >> ((5 * k + j) % 64) & 1 == 1;
            self.streams.get_mut(&id).expect("stream").push(token);
            if let Some(slot) = self.s.sampled(id, token, stop).expect("sampled") {
                self.ranks.slots.remove(&slot);
                self.ranks.pending.remove(&slot);
                return true;
            }
        }
        let _ = slot;
        false
    }

    /// A chain of verifies: each sequence's steps accept drafts as `accept` says; between the steps the ranks commit
    /// and verify a new window of the same size (drafts the ranks made up: new tokens here).
    fn verifies(&mut self, step: &Step, stops: u64, accept: u64) {
        for (k, p) in step.work.iter().enumerate() {
            let StepWork::Verify { position, tokens } = &p.work else {
                panic!("a chain of verifies holds {p:?}");
            };
            let t = tokens.len();
            assert!(
                position + t * (1 + step.chained) <= self.c.max_context,
                "{} chains verifies past the context",
                p.id
            );
            assert!(
                self.chain[&p.id].chains(),
                "{} chained its verifies although it may not",
                p.id
            );
            let accepted: Vec<usize> = (0..=step.chained)
                .map(|i| (accept >> ((7 * k + 3 * i) % 62) & 3) as usize % t)
                .collect();
            self.s.chain_verified(p.id, &accepted).expect("chain verified");
            let mut window = tokens.clone();
            for (i, &a) in accepted.iter().enumerate() {
                let mut out = window[1..=a].to_vec();
                out.push(self.new_token());
                if self.sample_all(p.slot, p.id, &out, stops, k + i) {
                    break;
                }
                if i < step.chained {
                    window = std::iter::once(out[a])
                        .chain((1..t).map(|_| self.new_token()))
                        .collect();
                    let stream = self.streams[&p.id].clone();
                    self.ranks
                        .chain_verify(p.slot, a + 1, &window, &stream[..stream.len() - 1], self.c.max_context);
                }
            }
        }
    }

    /// A fault: every running sequence is requeued and the ranks restart with every slot empty.
    fn fault(&mut self) {
        let (waiting, running) = self.s.counts();
        let mut was_running: Vec<u64> = self.ranks.slots.values().map(|(id, _)| *id).collect();
        was_running.sort_unstable();
        let mut requeued = self.s.requeue_all();
        requeued.sort_unstable();
        assert_eq!(
            requeued, was_running,
            "requeue_all must return every running sequence once"
        );
        self.ranks.slots.clear();
        self.ranks.pending.clear();
        assert_eq!(
            self.s.free(),
            (self.c.slots, self.c.kv_blocks),
            "a fault must free every slot and block"
        );
        assert_eq!(
            self.s.counts(),
            (waiting + running, 0),
            "a fault must requeue, not drop"
        );
        assert!(requeued.iter().all(|&id| self.s.contains(id)));
        self.restarted.extend(requeued);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, .. ProptestConfig::default() })]

    #[test]
    fn no_leaks_budget_holds_streams_follow_faults_recover_and_everything_finishes(c in config(), ops in prop::collection::vec(op(), 1..80)) {
        let mut sim = Sim::new(c);
        for o in ops {
            match o {
                Op::Submit {
                    prompt,
                    max_tokens,
                    priority,
                    restored,
                    chain,
                } => sim.submit(prompt, max_tokens, priority, restored, chain),
                Op::Cancel(k) => sim.cancel(k),
                Op::Step { stops, accept } => sim.step(stops, accept),
                Op::Draft { k } => sim.draft(k),
                Op::Fault => sim.fault(),
            }
            check_books(&sim.s, &c, &sim.ranks);
        }
        // Run out: with no more arrivals every request finishes within a bounded number of steps.
        let bound = 10_000;
        let mut steps = 0;
        while sim.s.counts() != (0, 0) {
            // Drafts at two steps of three (windows of 1 or 2), so the run-out verifies, and chains its verifies.
            if steps % 3 != 2 {
                sim.draft(1 + steps % 3);
            }
            sim.step(0, (steps as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            check_books(&sim.s, &c, &sim.ranks);
            steps += 1;
            prop_assert!(steps < bound, "no progress: {:?} waiting/running", sim.s.counts());
        }
        prop_assert_eq!(sim.s.free(), (c.slots, c.kv_blocks));
        prop_assert!(sim.restarted.is_empty(), "requeued but never resumed: {:?}", sim.restarted);
        prop_assert!(sim.s.drain().is_empty());
        for id in &sim.accepted {
            if !sim.cancelled.contains(id) {
                // Without stops a request ends exactly at max_tokens; a stop ends it earlier, never later. A fault
                // keeps what was sampled, so it changes neither.
                let n = sim.streams[id].len() - sim.prompt_len[id];
                prop_assert!(n >= 1 && n <= sim.max_tokens[id], "request {} sampled {} tokens of {}", id, n, sim.max_tokens[id]);
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
        decode_steps: 1,
    };
    let mut s = Scheduler::new(c).expect("scheduler");
    let req = |id, n, m| Request {
        id,
        prompt: vec![1; n],
        max_tokens: m,
        priority: 0,
        restored: 0,
        chain: Chain::None,
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
        decode_steps: 1,
    };
    let mut s = Scheduler::new(c).expect("scheduler");
    let req = |id, n, p| Request {
        id,
        prompt: vec![1; n],
        max_tokens: 4,
        priority: p,
        restored: 0,
        chain: Chain::None,
    };
    s.submit(req(1, 4, 0)).expect("submit");
    let step = s.schedule();
    assert_eq!(step.tokens(), 4);
    s.sampled(1, 9, false).expect("sampled");
    s.submit(req(2, 10, 0)).expect("submit");
    s.submit(req(3, 10, 5)).expect("submit");
    let step = s.schedule();
    // Request 1 decodes its sampled token, then the higher-priority request 3 takes the rest of the budget.
    assert_eq!(
        step.work[0].work,
        StepWork::Decode {
            position: 4,
            token: 9,
            sample: true
        }
    );
    assert_eq!(step.work[1].id, 3);
    assert_eq!(step.tokens(), 6);
}

#[test]
fn after_a_fault_a_sequence_is_re_prefilled_with_its_prompt_and_generated_tokens() {
    let c = SchedConfig {
        slots: 1,
        kv_blocks: 16,
        kv_block_size: 4,
        max_batch_tokens: 16,
        max_context: 32,
        decode_steps: 1,
    };
    let mut s = Scheduler::new(c).expect("scheduler");
    s.submit(Request {
        id: 1,
        prompt: vec![10, 11, 12],
        max_tokens: 4,
        priority: 0,
        restored: 0,
        chain: Chain::None,
    })
    .expect("submit");
    assert_eq!(s.schedule().tokens(), 3);
    assert_eq!(s.sampled(1, 20, false), Ok(None));
    let decode = |position, token, sample| StepWork::Decode {
        position,
        token,
        sample,
    };
    assert_eq!(s.schedule().work[0].work, decode(3, 20, true));
    assert_eq!(s.sampled(1, 21, false), Ok(None));
    assert_eq!(s.requeue_all(), vec![1]);
    assert_eq!((s.free(), s.counts()), ((1, 16), (1, 0)));
    let step = s.schedule();
    assert_eq!(
        step.work,
        vec![Planned {
            id: 1,
            slot: 0,
            fresh: true,
            restored: 0,
            work: StepWork::Prefill {
                position: 0,
                tokens: vec![10, 11, 12],
                last: false
            },
        }]
    );
    // The generated tokens are fed again one step each, as they were first computed; the last one samples.
    assert_eq!(s.schedule().work[0].work, decode(3, 20, false));
    assert_eq!(s.schedule().work[0].work, decode(4, 21, true));
    assert_eq!(s.sampled(1, 22, false), Ok(None));
    assert_eq!(s.schedule().work[0].work, decode(5, 22, true));
    // The tokens sampled before the fault count: the fourth ends the request.
    assert_eq!(s.sampled(1, 23, false), Ok(Some(0)));
    assert_eq!((s.free(), s.counts()), ((1, 16), (0, 0)));
}

#[test]
fn a_lost_restored_state_is_prefilled_first_in_budget_sized_chunks() {
    let c = SchedConfig {
        slots: 1,
        kv_blocks: 16,
        kv_block_size: 4,
        max_batch_tokens: 4,
        max_context: 32,
        decode_steps: 1,
    };
    let mut s = Scheduler::new(c).expect("scheduler");
    s.submit(Request {
        id: 1,
        prompt: (10..20).collect(),
        max_tokens: 4,
        priority: 0,
        restored: 7,
        chain: Chain::None,
    })
    .expect("submit");
    // The first run restores 7 tokens and prefills the other 3 in one chunk.
    let first = s.schedule();
    assert_eq!((first.work[0].restored, first.tokens()), (7, 3));
    assert_eq!(s.sampled(1, 30, false), Ok(None));
    s.requeue_all();
    assert!(s.unrestore(1), "it was waiting with a restored state");
    assert!(!s.unrestore(1), "nothing is restored any more");
    assert!(!s.unrestore(2), "no such request");
    // The lost 7 tokens come first, in chunks of at most the budget, then the earlier run's chunk, then its token.
    let mut prefills = Vec::new();
    loop {
        let step = s.schedule();
        match &step.work[0].work {
            StepWork::Prefill { position, tokens, .. } => {
                assert_eq!(step.work[0].restored, 0);
                prefills.push((*position, tokens.len()));
            }
            StepWork::Decode { position, token, .. } => {
                assert_eq!((*position, *token), (10, 30));
                break;
            }
            w => panic!("unexpected work {w:?}"),
        }
    }
    assert_eq!(prefills, vec![(0, 4), (4, 3), (7, 3)]);
}

#[test]
fn a_cut_ends_a_prompt_chunk_where_it_asks_and_survives_a_requeue() {
    let c = SchedConfig {
        slots: 1,
        kv_blocks: 16,
        kv_block_size: 4,
        max_batch_tokens: 8,
        max_context: 32,
        decode_steps: 1,
    };
    let mut s = Scheduler::new(c).expect("scheduler");
    s.submit(Request {
        id: 1,
        prompt: (10..22).collect(),
        max_tokens: 2,
        priority: 0,
        restored: 2,
        chain: Chain::None,
    })
    .expect("submit");
    assert!(!s.cut_at(1, 2), "not at or before the restored tokens");
    assert!(!s.cut_at(1, 12), "not at the prompt's end");
    assert!(!s.cut_at(7, 5), "no such request");
    assert!(s.cut_at(1, 5));
    let chunk = |s: &mut Scheduler| match &s.schedule().work[0].work {
        StepWork::Prefill { position, tokens, .. } => (*position, tokens.len()),
        w => panic!("unexpected work {w:?}"),
    };
    assert_eq!(chunk(&mut s), (2, 3), "ends at the cut");
    assert_eq!(chunk(&mut s), (5, 7), "the rest within the budget");
    assert!(!s.cut_at(1, 6), "only a waiting request takes a cut");
    assert_eq!(s.sampled(1, 40, false), Ok(None));
    s.requeue_all();
    // The re-prefill repeats the first run's chunks, cut included.
    assert_eq!(chunk(&mut s), (2, 3));
    assert_eq!(chunk(&mut s), (5, 7));
}

#[test]
fn drain_removes_every_request_and_frees_every_slot_and_block() {
    let c = SchedConfig {
        slots: 2,
        kv_blocks: 8,
        kv_block_size: 4,
        max_batch_tokens: 8,
        max_context: 32,
        decode_steps: 1,
    };
    let mut s = Scheduler::new(c).expect("scheduler");
    let req = |id, m, p| Request {
        id,
        prompt: vec![1; 4],
        max_tokens: m,
        priority: p,
        restored: 0,
        chain: Chain::None,
    };
    assert!(s.drain().is_empty());
    for (id, m, p) in [(9, 4, 0), (3, 4, 0), (5, 4, 1), (7, 1, 2), (1, 4, -1)] {
        s.submit(req(id, m, p)).expect("submit");
    }
    // Step 1 admits 7 (which finishes at its one token) and 5; step 2 decodes 5 and admits 9.
    for _ in 0..2 {
        for p in s.schedule().work {
            s.sampled(p.id, 2, false).expect("sampled");
        }
    }
    assert_eq!(s.counts(), (2, 2));
    assert_eq!(s.drain(), vec![1, 3, 5, 9]);
    assert_eq!(s.counts(), (0, 0));
    assert_eq!(s.free(), (c.slots, c.kv_blocks));
    assert!(s.running_slots().is_empty());
    assert_eq!(s.held_blocks(), 0);
    assert!([1, 3, 5, 7, 9].iter().all(|&id| !s.contains(id)));
    assert_eq!(s.schedule(), Step::default());
    assert!(s.drain().is_empty());
    // The ids are free again.
    s.submit(req(5, 4, 0)).expect("resubmit");
    assert_eq!(s.schedule().tokens(), 4);
}
