//! Log-probabilities from the one-pass row summaries: every reported row's top entries and target logit, turned into
//! `logit − lse`, equal a full softmax of the step's whole logits within 1e-4, on one rank and merged over tensor-
//! parallel CPU ranks (whose slices' entries the coordinator merges); a sampled row reports its sampled token's logit.

use super::*;
use crate::decode::{DecoderConfig, FormChoice};
use crate::init::tiny_checkpoint;
use crate::model::Family;

const PROMPT: [u32; 7] = [3, 14, 15, 92, 65, 35, 89];

fn group(dir: &std::path::Path, tp: usize) -> RankGroup {
    cpu_group(
        dir,
        &CpuOptions {
            tp,
            decoder: DecoderConfig::new(2, 64),
        },
    )
    .expect("group")
}

/// A prompt reporting every row, each asking for `top` entries and the next prompt token's logit; the last row samples
/// (temperature 0.9) and asks about its pick.
fn prefill(slot: usize, top: usize) -> SeqStep {
    let mut targets: Vec<Option<u32>> = PROMPT[1..].iter().map(|&t| Some(t)).collect();
    targets.push(None);
    SeqStep {
        slot,
        kind: SeqKind::Prefill,
        position: 0,
        tokens: PROMPT.to_vec(),
        form: FormChoice::Recurrent,
        rows: Rows::All,
        sample: Some(SampleRow {
            temperature: 0.9,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            history: Vec::new(),
            bias: Vec::new(),
            mask: None,
            uniform: 0.37,
        }),
        spec: None,
        logprobs: Some(LogprobRows { top, targets }),
    }
}

/// The log-softmax of a whole row.
fn log_softmax(row: &[f32]) -> Vec<f32> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f32>().ln();
    row.iter().map(|v| v - lse).collect()
}

#[test]
fn logprobs_equal_a_full_softmax_on_one_rank_and_over_tensor_parallel_ranks() {
    for family in [Family::NemotronH, Family::Qwen35] {
        let dir = tiny_checkpoint(family, 11);
        // The oracle: the same step's whole logits (the `rewind logits` path), one rank.
        let mut g = group(dir.path(), 1);
        let vocab = g.vocab_size();
        let s = g.open(FormChoice::Recurrent).expect("open");
        let whole = g
            .step(StepPlan::batch(vec![prefill(s, 5)]).with_logits(true))
            .expect("whole logits");
        let logits = whole.logits.expect("asked");
        let want: Vec<Vec<f32>> = logits.chunks_exact(vocab).map(log_softmax).collect();
        for tp in [1, 2, 3] {
            let mut g = group(dir.path(), tp);
            let s = g.open(FormChoice::Recurrent).expect("open");
            let out = g.step(StepPlan::batch(vec![prefill(s, 5)])).expect("summaries");
            assert!(out.logits.is_none(), "no whole rows were asked for");
            let sampled = out.sampled[PROMPT.len() - 1].expect("the last row samples");
            assert_eq!(Some(sampled), whole.sampled[PROMPT.len() - 1], "tp {tp}: the same draw");
            for (r, (row, w)) in out.rows.iter().zip(&want).enumerate() {
                let lp = row.logprob.expect("every row asked");
                // The top entries: the five largest of the softmax, best first, ties to the lower id.
                let mut order: Vec<u32> = (0..vocab as u32).collect();
                order.sort_by(|&a, &b| w[b as usize].total_cmp(&w[a as usize]).then(a.cmp(&b)));
                let top: Vec<(u32, f32)> = lp.top.entries().collect();
                assert_eq!(top.len(), 5);
                for (k, &(id, logit)) in top.iter().enumerate() {
                    assert_eq!(id, order[k], "family {family:?} tp {tp} row {r} entry {k}");
                    let got = logit - row.lse;
                    assert!(
                        (got - w[id as usize]).abs() < 1e-4,
                        "tp {tp} row {r}: {got} vs {}",
                        w[id as usize]
                    );
                }
                // The target: the next prompt token, or the sampled token on the last row.
                let target = PROMPT.get(r + 1).copied().unwrap_or(sampled);
                let (id, logit) = lp.target.expect("the target's logit");
                assert_eq!(id, target);
                assert_eq!(row.logit_of(target), Some(logit));
                let got = logit - row.lse;
                assert!(
                    (got - w[id as usize]).abs() < 1e-4,
                    "tp {tp} row {r} target: {got} vs {}",
                    w[id as usize]
                );
            }
        }
    }
}

#[test]
fn bad_logprob_requests_are_refused_before_any_rank_computes() {
    let dir = tiny_checkpoint(Family::NemotronH, 11);
    let mut g = group(dir.path(), 2);
    let vocab = g.vocab_size() as u32;
    let s = g.open(FormChoice::Recurrent).expect("open");
    let mut too_many = prefill(s, MAX_TOP + 1);
    too_many.sample = None;
    let mut short = prefill(s, 2);
    short.logprobs.as_mut().expect("asked").targets.pop();
    let mut outside = prefill(s, 2);
    outside.logprobs.as_mut().expect("asked").targets[0] = Some(vocab);
    for (seq, want) in [
        (too_many, "at most 20"),
        (short, "targets for 7"),
        (outside, "out of range"),
    ] {
        let e = g.step(StepPlan::batch(vec![seq])).expect_err(want).to_string();
        assert!(e.contains(want), "{e}");
    }
    g.step(StepPlan::batch(vec![prefill(s, MAX_TOP)]))
        .expect("the largest request");
}
