//! Acceptance exactness: whatever the drafts, the first token a verify emits is distributed as the target's own
//! row 0 (greedy: is its argmax).

use rewind_kernels::cpu::lm_head::{head_pass, SpecRequest};

use super::accept::{accept_rows, accept_summaries, RowSampling};
use crate::sample::SamplingParams;
use rewind_kernels::cpu::lm_head::RowPass;

/// Pearson's chi-square statistic of `counts` against probabilities `p` (bins with p = 0 must be empty).
pub(crate) fn chi_square(counts: &[usize], p: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(p)
        .map(|(&c, &p)| {
            if p == 0.0 {
                assert_eq!(c, 0, "a token of probability 0 came out");
                0.0
            } else {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            }
        })
        .sum()
}

/// The chi-square critical value at p = 0.001 for `dof` degrees of freedom (Wilson–Hilferty).
pub(crate) fn chi_square_critical(dof: usize) -> f64 {
    let k = dof as f64;
    let z = 3.090; // the standard normal's 0.999 quantile
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

fn softmax(l: &[f32], t: f32) -> Vec<f64> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f64> = l.iter().map(|v| f64::from(((v - m) / t).exp())).collect();
    let s: f64 = w.iter().sum();
    w.iter().map(|v| v / s).collect()
}

/// Summaries of logit rows through an identity head (hidden = vocab), as a rank would compute them.
fn summaries(rows: &[Vec<f32>], drafts: &[u32], t: f32, seed: u64, index: u64) -> Vec<RowPass> {
    let v = rows[0].len();
    let mut eye = vec![0.0f32; v * v];
    for i in 0..v {
        eye[i * v + i] = 1.0;
    }
    let x: Vec<f32> = rows.concat();
    let spec: Vec<Option<SpecRequest>> = (0..rows.len())
        .map(|i| {
            Some(SpecRequest {
                draft: drafts.get(i).copied(),
                temperature: t,
                seed,
                index: index + i as u64,
            })
        })
        .collect();
    head_pass(&x, &eye, v, 0, &spec)
}

#[test]
fn greedy_acceptance_follows_the_argmax_chain() {
    let rows = vec![vec![0.0, 2.0, 1.0], vec![3.0, 0.0, 1.0], vec![0.0, 0.0, 5.0]];
    let s = summaries(&rows, &[1, 0], 1.0, 0, 0);
    let all = accept_summaries(&s, &[1, 0], None).expect("accept");
    assert_eq!(
        (all.accepted, all.token),
        (2, 2),
        "both accepted, bonus = row 2's argmax"
    );
    let first = accept_summaries(&s, &[2, 0], None).expect("accept");
    assert_eq!(
        (first.accepted, first.token),
        (0, 1),
        "rejected at once, corrected to row 0's argmax"
    );
    assert!(accept_summaries(&s[..2], &[1, 0], None).is_err(), "a row short");
}

#[test]
fn one_pass_sampling_emits_the_target_distribution() {
    // Row 0's distribution must come out whatever is drafted: a likely draft, an unlikely one, or none.
    let rows = vec![vec![1.0, 0.2, -0.5, 0.8, 0.0], vec![0.0, 1.0, 0.0, 0.0, 0.5]];
    let t = 0.9;
    let p = softmax(&rows[0], t);
    for draft in [0u32, 2] {
        let mut counts = [0usize; 5];
        for seed in 0..20_000u64 {
            let s = summaries(&rows, &[draft], t, seed, 7);
            let a = accept_summaries(&s, &[draft], Some((seed, 7))).expect("accept");
            let first = if a.accepted >= 1 { draft } else { a.token };
            counts[first as usize] += 1;
        }
        let chi = chi_square(&counts, &p);
        assert!(
            chi < chi_square_critical(4),
            "draft {draft}: chi-square {chi} ({counts:?} vs {p:?})"
        );
    }
}

#[test]
fn whole_row_sampling_is_exact_with_filters_and_sampled_drafts() {
    let rows = [vec![1.0, 0.2, -0.5, 0.8, 0.0], vec![0.0, 1.0, 0.0, 0.0, 0.5]];
    let logits = rows.concat();
    let params = SamplingParams {
        temperature: 0.8,
        top_k: 3,
        ..SamplingParams::default()
    };
    // Top-3 of row 0 at t = 0.8: ids 0, 3, 1.
    let mut p = vec![0.0f64; 5];
    let kept = rewind_kernels::cpu::sample::kept_weights(&rows[0], 0.8, 3, 1.0, 0.0);
    let total: f64 = kept.iter().map(|&(_, w)| f64::from(w)).sum();
    for (id, w) in kept {
        p[id as usize] = f64::from(w) / total;
    }
    // A draft model's q over the vocabulary, and deterministic drafts.
    let q = [vec![0.1f32, 0.5, 0.1, 0.1, 0.2]];
    for sampled_drafts in [false, true] {
        let mut counts = [0usize; 5];
        for seed in 0..20_000u64 {
            let draft = if sampled_drafts {
                // Draw the draft from q with the seed, as a draft model would.
                let u = crate::sample::Sampler::draw_at(seed ^ 0xdead, 0);
                let mut cum = 0.0;
                q[0].iter()
                    .position(|&w| {
                        cum += w;
                        u < cum
                    })
                    .unwrap_or(4) as u32
            } else {
                3
            };
            let s = RowSampling {
                params: &params,
                history: &[],
                eos: &[],
                seed,
                index: 0,
            };
            let qs = sampled_drafts.then_some(&q[..]);
            let a = accept_rows(&logits, 5, &[draft], qs, &s).expect("accept");
            let first = if a.accepted >= 1 { draft } else { a.token };
            counts[first as usize] += 1;
        }
        let chi = chi_square(&counts, &p);
        assert!(
            chi < chi_square_critical(2),
            "sampled drafts {sampled_drafts}: chi {chi} ({counts:?} vs {p:?})"
        );
    }
}

#[test]
fn whole_row_greedy_applies_the_penalty_with_accepted_drafts() {
    // Row 1 would pick id 1, but the penalty on the accepted draft 1 makes id 2 win.
    let logits = [
        0.0, 3.0, 1.0, /* row 1 */ 0.0, 2.0, 1.9, /* row 2 */ 0.0, 0.0, 1.0,
    ];
    let params = SamplingParams {
        temperature: 0.0,
        repetition_penalty: 2.0,
        ..SamplingParams::default()
    };
    let s = RowSampling {
        params: &params,
        history: &[0],
        eos: &[],
        seed: 1,
        index: 0,
    };
    let a = accept_rows(&logits, 3, &[1, 1], None, &s).expect("accept");
    assert_eq!((a.accepted, a.token), (1, 2));
}

#[test]
fn whole_row_greedy_applies_the_additive_bias_with_accepted_drafts() {
    // Row 1 would pick id 1 again (2.0 > 1.7), but the frequency penalty counts the accepted draft 1 among the
    // generated tokens (the prompt's token 1 is not): 2.0 - 0.5 = 1.5 < 1.7.
    let logits = [
        0.0, 3.0, 1.0, /* row 1 */ 0.0, 2.0, 1.7, /* row 2 */ 0.0, 0.0, 1.0,
    ];
    let params = SamplingParams {
        temperature: 0.0,
        frequency_penalty: 0.5,
        ..SamplingParams::default()
    };
    let s = RowSampling {
        params: &params,
        history: &[1, 1],
        eos: &[],
        seed: 1,
        index: 0,
    };
    let a = accept_rows(&logits, 3, &[1, 1], None, &s).expect("accept");
    assert_eq!((a.accepted, a.token), (1, 2));
    // min_tokens masks EOS (id 1 here) on every row before the request has that many tokens: the drafted EOS is
    // rejected and the next best taken.
    let masked = SamplingParams {
        temperature: 0.0,
        min_tokens: 3,
        ..SamplingParams::default()
    };
    let s = RowSampling {
        params: &masked,
        eos: &[1],
        history: &[0],
        ..s
    };
    let a = accept_rows(&logits, 3, &[1, 1], None, &s).expect("accept");
    assert_eq!((a.accepted, a.token), (0, 2));
}
