//! Chains of verifies over CPU ranks (`rank/spec_chain.rs`): a chain drafts, judges and commits what single verify
//! steps would, in every form and under tensor parallelism; the books settle its commits; bad chains are refused
//! before any rank computes.

use super::*;
use crate::decode::{DecoderConfig, FormChoice};
use crate::model::Family;

fn group(family: Family, tp: usize) -> (tempfile::TempDir, RankGroup) {
    let dir = crate::init::tiny_checkpoint(family, 11);
    let g = cpu_group(
        dir.path(),
        &CpuOptions {
            tp,
            decoder: DecoderConfig {
                buffer_len: 12,
                max_verify: 4,
                ..DecoderConfig::new(3, 160)
            },
        },
    )
    .expect("group");
    (dir, g)
}

const PROMPTS: [&[u32]; 2] = [&[3, 14, 15, 92, 65, 35, 89, 3, 14], &[7, 7, 1, 2, 7, 7, 1]];

fn prompts() -> Vec<Vec<u32>> {
    PROMPTS.iter().map(|p| p.to_vec()).collect()
}

#[test]
fn a_chain_of_verifies_equals_single_verify_steps_in_every_form() {
    for (family, tp) in [(Family::NemotronH, 1), (Family::Qwen35, 2)] {
        let (_dir, mut g) = group(family, tp);
        for form in [FormChoice::Replay, FormChoice::KvOnly, FormChoice::Recurrent] {
            for temperature in [None, Some(0.02)] {
                let r = spec_chain_check(&mut g, &prompts(), form, 3, 3, 3, temperature, 0.0).expect("check");
                assert!(r.pass, "{family:?} tp {tp} {} {temperature:?}: {r:?}", form.name());
                assert!(
                    r.accepted > 0,
                    "the table drafter's windows are accepted in part: {r:?}"
                );
            }
        }
    }
}

#[test]
fn bad_chains_of_verifies_are_refused_and_a_chain_settles_the_books() {
    let (_dir, mut g) = group(Family::NemotronH, 1);
    let f = FormChoice::Replay;
    let a = g.open(f).expect("open");
    let prompt = PROMPTS[0].to_vec();
    let first = g
        .step(StepPlan::batch(vec![SeqStep {
            slot: a,
            kind: SeqKind::Prefill,
            position: 0,
            tokens: prompt.clone(),
            form: f,
            rows: Rows::Last,
            sample: None,
            spec: None,
            logprobs: None,
        }]))
        .expect("prefill")
        .rows[0]
        .argmax;
    let mut stream = prompt.clone();
    stream.push(first);
    let chain_of = |stream: &Vec<u32>, tokens: Vec<u32>, chained: usize| VerifyChain {
        seqs: vec![ChainedVerify {
            slot: a,
            position: stream.len() - 1,
            tokens,
            form: f,
            spec: None,
            stream: stream.clone(),
            table: Vec::new(),
        }],
        steps: chained,
        drafter: ChainDrafter::Ngram { min_n: 1, max_n: 2 },
    };
    let chain =
        |stream: &Vec<u32>, tokens: Vec<u32>, chained: usize| StepPlan::verify_chain(chain_of(stream, tokens, chained));
    let tokens = vec![first, 1, 2, 3];
    // Refusals happen in the books, before any rank computes (the group keeps serving).
    let mut refused: Vec<(StepPlan, &str)> = vec![
        (chain(&stream, tokens.clone(), 0), "needs chained steps"),
        (chain(&stream[..3].to_vec(), tokens.clone(), 2), "stream"),
    ];
    refused.push((chain(&stream, vec![first], 2), "at least one draft"));
    let mut bad_n = chain_of(&stream, tokens.clone(), 2);
    bad_n.drafter = ChainDrafter::Ngram { min_n: 0, max_n: 2 };
    refused.push((StepPlan::verify_chain(bad_n), "n-gram sizes"));
    let mut tables = chain_of(&stream, tokens.clone(), 2);
    tables.seqs[0].table = vec![-1; stream.len()];
    refused.push((StepPlan::verify_chain(tables), "draft tables"));
    let mut hot = chain_of(&stream, tokens.clone(), 2);
    hot.seqs[0].spec = Some(SpecSample {
        temperature: f32::NAN,
        seed: 1,
        index: 0,
    });
    refused.push((StepPlan::verify_chain(hot), "temperature"));
    refused.push((chain(&stream, tokens.clone(), MAX_CHAINED + 1), "chains at most"));
    for (p, what) in refused {
        let e = g.step(p).expect_err(what).to_string();
        assert!(e.contains(what), "{what}: {e}");
    }
    // A chain of 3 verifies commits its first two steps' tokens; the third waits for the next plan's commit.
    let out = g.step(chain(&stream, tokens.clone(), 2)).expect("chain");
    let log = out.chain.expect("log");
    assert_eq!((log.accepted.len(), log.drafts.len(), out.rows.len()), (3, 9, 12));
    let committed: usize = log.accepted[..2].iter().map(|a| a + 1).sum();
    let position = stream.len() - 1 + committed;
    let next = StepPlan::batch(vec![SeqStep {
        slot: a,
        kind: SeqKind::Decode,
        position: position + log.accepted[2] + 1,
        tokens: vec![log.tokens[2]],
        form: f,
        rows: Rows::Last,
        sample: None,
        spec: None,
        logprobs: None,
    }])
    .with_commits(vec![Commit {
        slot: a,
        accepted: log.accepted[2] + 1,
    }]);
    g.step(next).expect("the books hold the chain's commits");
}
