//! Unit tests of chained decode steps (`scheduler/chain.rs`): a steady decode batch chains, within the context and
//! the free blocks (and max_tokens while a request waits), and never beside other work or a request that could
//! start. The property tests in
//! `tests.rs` cover chains in random runs.

use super::*;

/// The chain tests' limits: 2 slots, 32 blocks of 4 tokens, a budget of 16, a context of 64, chains of up to 4 steps.
const BASE: SchedConfig = SchedConfig {
    slots: 2,
    kv_blocks: 32,
    kv_block_size: 4,
    max_batch_tokens: 16,
    max_context: 64,
    decode_steps: 4,
};

fn sched(c: SchedConfig) -> Scheduler {
    Scheduler::new(c).expect("scheduler")
}

/// A scheduler of `slots` slots and `kv_blocks` blocks of 4 tokens (budget 16, context 64) chaining up to
/// `decode_steps`.
fn chaining(slots: usize, kv_blocks: usize, decode_steps: usize) -> Scheduler {
    sched(SchedConfig {
        slots,
        kv_blocks,
        decode_steps,
        ..BASE
    })
}

fn chain_req(id: u64, prompt: usize, max_tokens: usize, chain: bool) -> Request {
    let chain = if chain { Chain::All } else { Chain::None };
    Request {
        id,
        prompt: vec![7; prompt],
        max_tokens,
        priority: 0,
        restored: 0,
        chain,
    }
}

/// Runs one step, sampling `token + j` for each sequence's `j`th token (all of a chained step's until one finishes
/// it); returns the step.
fn run_step(s: &mut Scheduler, token: u32) -> Step {
    let step = s.schedule();
    for p in step.work.iter().filter(|p| p.samples()) {
        for j in 0..=step.chained {
            if s.sampled(p.id, token + j as u32, false).expect("sampled").is_some() {
                break;
            }
        }
    }
    step
}

fn decode(position: usize, token: u32) -> StepWork {
    StepWork::Decode {
        position,
        token,
        sample: true,
    }
}

#[test]
fn a_steady_decode_batch_chains_its_decode_steps() {
    let mut s = chaining(2, 32, 4);
    s.submit(chain_req(1, 4, 12, true)).expect("submit");
    s.submit(chain_req(2, 4, 12, true)).expect("submit");
    // The prompts run alone; then both decode, 1 + 3 tokens each.
    assert_eq!(run_step(&mut s, 10).chained, 0);
    let step = run_step(&mut s, 20);
    assert_eq!(step.chained, 3);
    assert_eq!(
        step.work.iter().map(|p| p.work.clone()).collect::<Vec<_>>(),
        vec![decode(4, 10), decode(4, 10)]
    );
    // Each slot holds its 4 prompt tokens and 4 decodes (2 blocks); the next step feeds the last of the 4 sampled.
    assert_eq!(s.held_blocks(), 4);
    let step = run_step(&mut s, 30);
    assert_eq!(step.chained, 3);
    assert_eq!(step.work[0].work, decode(8, 23));
    // 9 tokens generated of 12: 1 + 2 more.
    let step = run_step(&mut s, 40);
    assert_eq!((step.chained, step.work[0].work.clone()), (2, decode(12, 33)));
    assert_eq!(s.counts(), (0, 0));
    assert_eq!(s.free(), (2, 32));
}

#[test]
fn chaining_stops_at_max_tokens_and_the_context() {
    // Prompt and max_tokens fill the context exactly (submit's limit): the chain ends at max_tokens, which also
    // keeps the slot within the context.
    let mut s = sched(SchedConfig {
        slots: 1,
        kv_blocks: 8,
        max_context: 8,
        decode_steps: 8,
        ..BASE
    });
    s.submit(chain_req(1, 5, 3, true)).expect("submit");
    run_step(&mut s, 10);
    let step = s.schedule();
    // One token generated, 2 to go: this step's and one chained, at positions 5 and 6 (< 8).
    assert_eq!((step.chained, step.work[0].work.clone()), (1, decode(5, 10)));
    assert_eq!(s.sampled(1, 11, false), Ok(None));
    assert_eq!(s.sampled(1, 12, false), Ok(Some(0)));
    assert_eq!(s.free(), (1, 8));
}

#[test]
fn a_sequence_at_its_last_tokens_ends_inside_a_chain_unless_a_request_waits() {
    let mut s = chaining(2, 32, 4);
    s.submit(chain_req(1, 4, 12, true)).expect("submit");
    s.submit(chain_req(2, 4, 3, true)).expect("submit");
    run_step(&mut s, 10);
    // Request 2 may take this step's token and one more; nothing waits, so the batch chains as far as request 1
    // allows, and request 2 finishes inside the chain (its later tokens dropped).
    let step = s.schedule();
    assert_eq!(step.chained, 3);
    assert_eq!(s.sampled(2, 20, false), Ok(None));
    assert_eq!(s.sampled(2, 21, false), Ok(Some(1)));
    for j in 0..4 {
        assert_eq!(s.sampled(1, 20 + j, false), Ok(None));
    }
    assert_eq!(s.counts(), (0, 1));
    // Its slot and blocks are free again: request 1 holds its 4 prompt tokens and the chain's 4 (2 blocks).
    assert_eq!(s.free(), (1, 30));
    // With a request waiting for the slot, the chain ends at the first sequence's last token instead.
    let mut s = chaining(2, 32, 4);
    s.submit(chain_req(1, 4, 12, true)).expect("submit");
    s.submit(chain_req(2, 4, 3, true)).expect("submit");
    run_step(&mut s, 10);
    s.submit(chain_req(3, 4, 4, true)).expect("submit");
    let step = run_step(&mut s, 20);
    assert_eq!((step.chained, s.counts()), (1, (1, 1)));
    // Request 3 starts in the next step, alone with request 1 (no chain beside its prompt).
    let step = run_step(&mut s, 30);
    assert_eq!((step.work.len(), step.chained), (2, 0));
}

#[test]
fn a_chain_past_a_sequences_last_token_stays_inside_its_context() {
    // A (5 + 3 tokens) fills the context of 8; B (1 + 7) has room to spare. Past A's last token the chain may run
    // only as far as A's context: its decode at 5 and two chained steps, at 6 and 7.
    let mut s = sched(SchedConfig { max_context: 8, ..BASE });
    s.submit(chain_req(1, 5, 3, true)).expect("submit");
    s.submit(chain_req(2, 1, 7, true)).expect("submit");
    run_step(&mut s, 10);
    let step = s.schedule();
    assert_eq!(step.chained, 2);
    assert_eq!(step.work[0].work, decode(5, 10));
    assert_eq!(s.sampled(1, 20, false), Ok(None));
    assert_eq!(s.sampled(1, 21, false), Ok(Some(0)));
    for j in 0..3 {
        assert_eq!(s.sampled(2, 30 + j, false), Ok(None));
    }
    assert_eq!(s.counts(), (0, 1));
}

#[test]
fn chaining_takes_only_the_free_blocks_and_preempts_no_one() {
    // Blocks of 2: after the prompts (2 blocks each) and the decode at 4 (a third each), one block is free; 2 more
    // tokens each would need 2.
    let mut s = sched(SchedConfig {
        kv_blocks: 7,
        kv_block_size: 2,
        ..BASE
    });
    s.submit(chain_req(1, 4, 8, true)).expect("submit");
    s.submit(chain_req(2, 4, 8, true)).expect("submit");
    run_step(&mut s, 10);
    let step = run_step(&mut s, 20);
    assert_eq!((step.chained, step.preempted.len()), (1, 0));
    assert_eq!(s.free(), (0, 1));
    // The decodes at 6 need a fourth block each: request 1 takes the free one and request 2 is preempted for its
    // decode, as without chaining.
    let step = run_step(&mut s, 30);
    assert_eq!((step.chained, step.preempted.clone()), (0, vec![(2, 1)]));
}

#[test]
fn no_chaining_beside_other_work_or_for_a_request_that_may_not_chain() {
    // A prefill in the step: request 2 arrives while 1 decodes.
    let mut s = chaining(2, 32, 4);
    s.submit(chain_req(1, 4, 8, true)).expect("submit");
    run_step(&mut s, 10);
    s.submit(chain_req(2, 4, 8, true)).expect("submit");
    let step = run_step(&mut s, 20);
    assert_eq!((step.work.len(), step.chained), (2, 0));
    // Both decode now.
    assert_eq!(run_step(&mut s, 30).chained, 3);

    // One of the batch may not chain.
    let mut s = chaining(2, 32, 4);
    s.submit(chain_req(1, 4, 8, true)).expect("submit");
    s.submit(chain_req(2, 4, 8, false)).expect("submit");
    run_step(&mut s, 10);
    assert_eq!(run_step(&mut s, 20).chained, 0);
    s.cancel(2);
    assert_eq!(run_step(&mut s, 30).chained, 3);

    // decode_steps = 1 never chains.
    let mut s = chaining(1, 32, 1);
    s.submit(chain_req(1, 4, 8, true)).expect("submit");
    run_step(&mut s, 10);
    assert_eq!(run_step(&mut s, 20).chained, 0);
    assert_eq!(
        Scheduler::new(SchedConfig {
            decode_steps: 0,
            slots: 1,
            kv_blocks: 1,
            kv_block_size: 1,
            max_batch_tokens: 1,
            max_context: 1,
        })
        .err(),
        Some(SchedError::NoDecodeSteps)
    );
}

#[test]
fn no_chaining_while_a_request_waits_for_a_free_slot() {
    // A budget of 2: two decodes spend it and request 3 cannot start, though a slot is free.
    let mut s = sched(SchedConfig {
        slots: 3,
        max_batch_tokens: 2,
        ..BASE
    });
    s.submit(chain_req(1, 1, 8, true)).expect("submit");
    s.submit(chain_req(2, 1, 8, true)).expect("submit");
    run_step(&mut s, 10);
    s.submit(chain_req(3, 4, 8, true)).expect("submit");
    let step = run_step(&mut s, 20);
    assert_eq!((step.work.len(), s.counts(), s.free().0), (2, (1, 2), 1));
    assert_eq!(step.chained, 0);
    // With nothing waiting the same batch chains.
    s.cancel(3);
    assert_eq!(run_step(&mut s, 30).chained, 3);
}

#[test]
fn a_request_waiting_for_blocks_does_not_stop_a_chain() {
    // 8 blocks of 4 tokens: two 8-token prompts take 2 blocks each (their decodes a third); request 3's 20-token
    // prompt needs 5 blocks, so it waits for blocks although a slot is free.
    let mut s = sched(SchedConfig {
        slots: 3,
        kv_blocks: 8,
        max_batch_tokens: 64,
        max_context: 32,
        ..BASE
    });
    s.submit(chain_req(1, 8, 12, true)).expect("submit");
    s.submit(chain_req(2, 8, 12, true)).expect("submit");
    run_step(&mut s, 10);
    s.submit(chain_req(3, 20, 4, true)).expect("submit");
    assert!(!s.could_admit(), "{:?} free", s.free());
    let step = run_step(&mut s, 20);
    assert_eq!((step.work.len(), s.counts().0), (2, 1));
    assert!(step.chained > 0, "a request that cannot start does not hold the batch");
}

#[test]
fn a_requeued_sequence_keeps_its_chain_flag_and_replays_unchained() {
    let mut s = chaining(2, 32, 4);
    s.submit(chain_req(1, 4, 12, true)).expect("submit");
    run_step(&mut s, 10);
    assert_eq!(run_step(&mut s, 20).chained, 3);
    s.requeue_all();
    // The re-prefill, then each generated token fed again one unsampled decode at a time, as first computed.
    assert_eq!(run_step(&mut s, 30).chained, 0);
    for (position, token) in [(4, 10), (5, 20), (6, 21), (7, 22)] {
        let step = run_step(&mut s, 30);
        assert_eq!(
            (step.work[0].work.clone(), step.chained),
            (
                StepWork::Decode {
                    position,
                    token,
                    sample: false
                },
                0
            )
        );
    }
    let step = run_step(&mut s, 40);
    assert_eq!((step.work[0].work.clone(), step.chained), (decode(8, 23), 3));

    // A request that may not chain still may not after a fault, though the batch could.
    let mut s = chaining(2, 32, 4);
    s.submit(chain_req(1, 4, 12, true)).expect("submit");
    s.submit(chain_req(2, 4, 12, false)).expect("submit");
    run_step(&mut s, 10);
    s.requeue_all();
    run_step(&mut s, 20);
    let step = run_step(&mut s, 30);
    assert!(step.work.iter().all(|p| p.work == decode(4, 10)));
    assert_eq!(step.chained, 0);
    s.cancel(2);
    assert_eq!(run_step(&mut s, 40).chained, 3);
}

/// Sequences that drafted windows of one size chain their verifies ([`Step::spec_chain`]): the chain reserves a
/// window of blocks per chained step, and [`Scheduler::chain_verified`] keeps the committed tokens and the last window
/// and returns the rest; different windows, a sequence that may not chain or a waiting request keep single steps.
#[test]
fn drafted_windows_of_one_size_chain_their_verifies() {
    let mut s = chaining(2, 32, 4);
    s.submit(chain_req(1, 4, 40, true)).expect("submit");
    s.submit(chain_req(2, 4, 40, true)).expect("submit");
    assert_eq!(run_step(&mut s, 10).chained, 0, "the prompts");
    // Windows of different sizes: one verify step.
    s.propose(1, vec![1, 2]).expect("propose");
    s.propose(2, vec![1]).expect("propose");
    let step = s.schedule();
    assert!((step.chained, step.spec_chain) == (0, false), "{step:?}");
    s.verified(1, 0).expect("verified");
    s.verified(2, 0).expect("verified");
    for id in [1, 2] {
        s.sampled(id, 11, false).expect("sampled");
    }
    // Windows of 2 drafts (3 tokens): 1 + 3 verifies; the context allows (64 − 8) / 3 more, the blocks more still.
    s.propose(1, vec![1, 2]).expect("propose");
    s.propose(2, vec![3, 4]).expect("propose");
    let free = s.free().1;
    let step = s.schedule();
    assert_eq!((step.chained, step.spec_chain), (3, true), "{step:?}");
    assert_eq!(step.commits.len(), 2, "the single verifies' commits ride along");
    // Each slot's verify at 5 reaches 8 tokens (the 2 blocks it holds); 3 chained windows reach 17 (5 blocks).
    assert_eq!(free - s.free().1, 2 * (17usize.div_ceil(4) - 2));
    // Slot 1 accepted 2, 0, 1, 2 drafts: 3 + 1 + 2 committed on the ranks, the last 3 pending.
    s.chain_verified(1, &[2, 0, 1, 2]).expect("chain verified");
    s.chain_verified(2, &[0, 0, 0, 0]).expect("chain verified");
    for (id, n) in [(1, 3 + 1 + 2 + 3), (2, 4)] {
        for j in 0..n {
            s.sampled(id, 20 + j, false).expect("sampled");
        }
    }
    let step = s.schedule();
    assert_eq!(step.commits, vec![(step.work[0].slot, 3), (step.work[1].slot, 1)]);
    let positions: Vec<StepWork> = step.work.iter().map(|p| p.work.clone()).collect();
    assert_eq!(
        positions,
        vec![decode(5 + 9, 28), decode(5 + 4, 23)],
        "each feeds its last token"
    );
    // Blocks: slot 1 keeps 5 + 6 committed + its last window (14 tokens), slot 2 5 + 3 + 3, which hold each
    // one's next decode too.
    assert_eq!(s.held_blocks(), 14usize.div_ceil(4) + 11usize.div_ceil(4));
    assert!(s.chain_verified(1, &[1]).is_err(), "no verify in flight");
    // A sequence that may not chain, or a waiting request, keeps single steps.
    for id in [1, 2] {
        s.sampled(id, 30, false).expect("sampled");
    }
    s.submit(chain_req(3, 4, 8, true)).expect("submit");
    s.propose(1, vec![1, 2]).expect("propose");
    s.propose(2, vec![3, 4]).expect("propose");
    let step = s.schedule();
    assert!(!step.spec_chain, "a request waits: {step:?}");
}

/// A chain of verifies is no longer than whole windows need to reach every sequence's last token.
#[test]
fn a_chain_of_verifies_stops_where_whole_windows_end_every_sequence() {
    let mut s = chaining(2, 32, 4);
    s.submit(chain_req(1, 4, 6, true)).expect("submit");
    s.submit(chain_req(2, 4, 4, true)).expect("submit");
    assert_eq!(run_step(&mut s, 10).chained, 0, "the prompts");
    s.propose(1, vec![1, 2]).expect("propose");
    s.propose(2, vec![3, 4]).expect("propose");
    // Request 1 may still generate 5 tokens: two windows of 3 reach it, so one step chains after the first.
    let step = s.schedule();
    assert_eq!((step.chained, step.spec_chain), (1, true), "{step:?}");
}
