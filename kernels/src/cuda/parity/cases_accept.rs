//! Cases for the device's judge of speculative verifies ([`crate::cuda::ops::spec_accept`]) against its CPU twin
//! [`crate::cpu::accept::judge`], on the same stored summaries: greedy and sampled sequences, 0 … 6 drafts, drafts
//! that match the argmax or not, acceptance probabilities spread over (0, 1] and rows whose draft no rank saw
//! (p = 0), rows with nothing left to resample, equal maxima across ranks (the lowest id wins), a verify holding a
//! NaN (token −1), and the summaries of 1, 2 or 4 tensor-parallel ranks merged on the device.

use super::cases_glue::verdict;
use super::{Case, Check, Ctx, Rng};
use crate::cpu::accept::{accept_uniform, judge, JudgeError, JudgedRow};
use crate::cpu::lm_head::{RowPass, SpecSummary};
use crate::cuda::ops::{self, JUDGE_WORDS, SUMMARY_WORDS};
use crate::cuda::Result;

/// Registers the judge cases.
pub(super) fn register(cases: &mut Vec<Case>) {
    for (seqs, t, world, vocab) in [
        (64, 5, 1, 131072),
        (37, 2, 1, 1000),
        (16, 1, 2, 1000),
        (256, 7, 2, 248320),
        (33, 4, 4, 4096),
    ] {
        let shape = format!("{seqs} verifies of {} drafts, {world} rank(s), vocab {vocab}", t - 1);
        cases.push(Case::new("spec_accept", "f32", shape, move |cx, rng| {
            spec_accept(cx, rng, seqs, t, world, vocab)
        }));
    }
}

/// A summary as the head kernels store it (`head_sum_store` in lm_head.cu).
fn encode(p: &RowPass) -> [u32; SUMMARY_WORDS] {
    let s = p.spec.unwrap_or(SpecSummary {
        lse: f32::NEG_INFINITY,
        drafted: None,
        candidate: 0,
        score: f32::NEG_INFINITY,
    });
    [
        p.argmax,
        p.max.to_bits(),
        p.lse.to_bits(),
        s.lse.to_bits(),
        s.drafted.unwrap_or(0.0).to_bits(),
        u32::from(s.drafted.is_some()),
        s.candidate,
        s.score.to_bits(),
    ]
}

/// A case's verifies: every rank's stored summaries, their merge, the drafts and each sequence's judging.
struct Inputs {
    t: usize,
    /// `[world][seqs · t]`.
    parts: Vec<Vec<RowPass>>,
    merged: Vec<RowPass>,
    /// `[seqs, t − 1]`.
    drafts: Vec<u32>,
    sampled: Vec<Option<(u64, u64)>>,
    /// The sequence whose verify holds a NaN.
    nan_seq: Option<usize>,
}

fn inputs(rng: &mut Rng, seqs: usize, t: usize, world: usize, vocab: usize) -> Inputs {
    let rows = seqs * t;
    let slice = vocab / world;
    // Every other sequence samples; every rank summarises its slice of every row.
    let sampled: Vec<Option<(u64, u64)>> = (0..seqs)
        .map(|q| (q % 2 == 1).then(|| (rng.next_u64(), rng.below(0, 1 << 30) as u64)))
        .collect();
    let mut parts = vec![Vec::with_capacity(rows); world];
    for r in 0..rows {
        let q = r / t;
        // The draft's rank (none for one row in ten: p = 0), and the target acceptance probability of the row's
        // draft (a few rows at 1).
        let draft_rank = if rng.unit() < 0.1 { world } else { rng.below(0, world) };
        // One row in seven has the same maximum on every rank: the lowest id must win.
        let tie = world > 1 && rng.unit() < 0.15;
        let tied_max = rng.uniform(-5.0, 10.0);
        let target = if rng.unit() < 0.1 { 1.0 } else { rng.uniform(0.02, 1.0) };
        // One row in 17 of a sampled verify has nothing left to resample on any rank.
        let empty = sampled[q].is_some() && r % 17 == 5;
        for (k, part) in parts.iter_mut().enumerate() {
            let lse = rng.uniform(-2.0, 8.0);
            let max = if tie { tied_max } else { rng.uniform(-5.0, 10.0) };
            part.push(RowPass {
                argmax: (k * slice + rng.below(0, slice)) as u32,
                max,
                lse: max + rng.uniform(0.0, 3.0),
                spec: Some(SpecSummary {
                    lse,
                    drafted: (k == draft_rank).then_some(0.0),
                    candidate: (k * slice + rng.below(0, slice)) as u32,
                    score: if empty {
                        f32::NEG_INFINITY
                    } else {
                        rng.uniform(-5.0, 20.0)
                    },
                }),
                logprob: None,
            });
        }
        // The drafted logit set against the merged LSE, so the acceptance probabilities spread as intended.
        let merged = parts.iter().map(|p| p[r]).reduce(RowPass::merge).expect("ranks");
        let lse = merged.spec.expect("spec").lse;
        if let Some(s) = parts.get_mut(draft_rank).and_then(|p| p[r].spec.as_mut()) {
            s.drafted = Some(lse + target.ln());
        }
    }
    // Sequence 3's last row holds a NaN on one rank: the device fails that verify whatever it accepted.
    let nan_seq = (seqs > 3).then_some(3);
    if let Some(q) = nan_seq {
        parts[world - 1][q * t + t - 1].max = f32::NAN;
    }
    let merged: Vec<RowPass> = (0..rows)
        .map(|r| parts.iter().map(|p| p[r]).reduce(RowPass::merge).expect("ranks"))
        .collect();
    // Greedy drafts take the merged argmax three times in four; a sampled verify's drafts are in its summaries.
    let drafts: Vec<u32> = (0..seqs)
        .flat_map(|q| (0..t - 1).map(move |i| (q, i)))
        .map(|(q, i)| {
            let argmax = merged[q * t + i].argmax;
            if rng.unit() < 0.75 {
                argmax
            } else {
                rng.below(0, vocab) as u32
            }
        })
        .collect();
    Inputs {
        t,
        parts,
        merged,
        drafts,
        sampled,
        nan_seq,
    }
}

/// What the CPU twin says of sequence `q`: (accepted, token), token −1 for "nothing left to resample" at the row it
/// names, and (−2, −2) for any other refusal (the case's summaries are well formed, so that would be a defect).
fn expected(x: &Inputs, q: usize) -> (i32, i32) {
    let t = x.t;
    let rows: Vec<JudgedRow> = x.merged[q * t..(q + 1) * t]
        .iter()
        .map(|p| JudgedRow {
            argmax: p.argmax,
            spec: p.spec,
        })
        .collect();
    match judge(&rows, &x.drafts[q * (t - 1)..(q + 1) * (t - 1)], x.sampled[q]) {
        Ok(v) => (v.accepted as i32, v.token as i32),
        Err(JudgeError::NothingLeft { row }) => (row as i32, -1),
        Err(_) => (-2, -2),
    }
}

fn spec_accept(cx: &Ctx, rng: &mut Rng, seqs: usize, t: usize, world: usize, vocab: usize) -> Result<Vec<Check>> {
    let x = inputs(rng, seqs, t, world, vocab);
    let Inputs {
        parts,
        merged,
        drafts,
        sampled,
        nan_seq,
        ..
    } = &x;
    let nan_seq = *nan_seq;
    let words: Vec<u32> = parts.iter().flatten().flat_map(encode).collect();
    let params: Vec<u32> = sampled.iter().flat_map(|s| ops::encode_judge(*s)).collect();
    debug_assert_eq!(params.len(), seqs * JUDGE_WORDS);
    let ids: Vec<i32> = drafts.iter().map(|&d| d as i32).collect();
    let (dw, dp) = (cx.dev.upload(&words)?, cx.dev.upload(&params)?);
    let dd = cx.dev.upload(if ids.is_empty() { &[0][..] } else { &ids })?;
    let mut out = cx.dev.alloc_zeros::<i32>(2 * seqs)?;
    ops::spec_accept(cx.dev, &dw, world, seqs, t, &dd.slice(..ids.len()), &dp, &mut out)?;
    let got = cx.dev.download(&out)?;
    let (mut ok, mut near, mut accepted, mut sampled_accepted) = (true, 0, 0usize, 0usize);
    for q in 0..seqs {
        let (g_acc, g_tok) = (got[2 * q], got[2 * q + 1]);
        if Some(q) == nan_seq {
            ok &= g_tok == -1;
            continue;
        }
        // The device reports "nothing left to resample" as token −1 at the row the CPU names.
        let want = expected(&x, q);
        accepted += g_acc.max(0) as usize;
        if sampled[q].is_some() {
            sampled_accepted += g_acc.max(0) as usize;
        }
        if (g_acc, g_tok) == want {
            continue;
        }
        let cpu_acc = want.0;
        // The device's exp and the merged log-sum-exp may differ from the CPU's in the last place: a different
        // decision passes only at a near-tie of the uniform and the probability at the row where they part.
        let at = (g_acc.min(cpu_acc)).max(0) as usize;
        let tie = sampled[q]
            .zip(merged[q * t + at].spec)
            .is_some_and(|((seed, index), s)| {
                let p = s.drafted.map_or(0.0, |l| (l - s.lse).exp());
                (accept_uniform(seed, index + at as u64) - p).abs() <= 1e-5 * p.max(1e-3)
            });
        if tie {
            near += 1;
        } else {
            eprintln!(
                "spec_accept sequence {q}: device ({g_acc}, {g_tok}), CPU {want:?}, sampled {:?}",
                sampled[q]
            );
            ok = false;
        }
    }
    // Not a vacuous sweep: drafts were accepted, sampled ones too (when there are drafts), and few verifies were
    // near-ties.
    ok &= (t == 1 || accepted > 0 && sampled_accepted > 0) && near < seqs / 4 + 1;
    Ok(vec![verdict("verdicts", ok)])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cases test what they say on the host side already: the twin refuses nothing, sampled verifies accept
    /// drafts, the NaN verify is there, and some rows have nothing left to resample or no draft.
    #[test]
    fn the_cases_inputs_exercise_every_branch() {
        for seed in 1..6 {
            for (seqs, t, world, vocab) in [(64, 5, 1, 131072), (37, 2, 1, 1000), (16, 1, 2, 1000), (33, 4, 4, 4096)] {
                let x = inputs(&mut Rng::new(seed), seqs, t, world, vocab);
                let verdicts: Vec<(i32, i32)> = (0..seqs)
                    .filter(|&q| Some(q) != x.nan_seq)
                    .map(|q| expected(&x, q))
                    .collect();
                assert!(verdicts.iter().all(|v| v.0 >= 0), "{verdicts:?}");
                if t > 1 {
                    let sampled: i32 = (0..seqs)
                        .filter(|&q| x.sampled[q].is_some() && Some(q) != x.nan_seq)
                        .map(|q| expected(&x, q).0)
                        .sum();
                    assert!(sampled > 0, "seed {seed}, {seqs} × {t}: no sampled draft accepted");
                }
                assert_eq!(x.nan_seq.is_some(), seqs > 3);
                assert_eq!(x.parts.len(), world);
                assert_eq!(x.merged.len(), seqs * x.t);
            }
        }
    }
}
