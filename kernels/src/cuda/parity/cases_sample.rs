//! Cases for token selection on the device (argmax, repetition penalty, logit bias, token mask, filtered sampling)
//! against the CPU twins.
//! Shapes are the real vocabularies (131072 / 248320 / 262144, 1 and 64 rows) plus odd ones.

use super::cases_glue::verdict;
use super::{rounded, Case, Check, Ctx, Rng};
use crate::cpu;
use crate::cuda::ops;
use crate::cuda::{bf16, Result};

/// Registers the token-selection cases.
pub(super) fn register(cases: &mut Vec<Case>) {
    for (rows, vocab, what) in [
        (64, 131072, "Nemotron-H vocab, 64 rows"),
        (1, 248320, "Qwen3.5 vocab, 1 row"),
        (64, 262144, "262144, 64 rows"),
        (3, 1000, "odd"),
    ] {
        cases.push(Case::new(
            "argmax_rows",
            "f32",
            format!("[{rows}, {vocab}] {what}"),
            move |cx, rng| argmax_rows(cx, rng, rows, vocab),
        ));
    }
    for (rows, vocab, per_row, what) in [(64, 131072, 300, "Nemotron-H vocab"), (3, 1000, 40, "odd")] {
        let shape = format!("[{rows}, {vocab}], {per_row} tokens a row, {what}");
        cases.push(Case::new("repetition_penalty", "f32", shape, move |cx, rng| {
            repetition_penalty(cx, rng, rows, vocab, per_row)
        }));
    }
    for (rows, vocab, per_row, what) in [(64, 131072, 300, "Nemotron-H vocab"), (3, 1000, 40, "odd")] {
        let shape = format!("[{rows}, {vocab}], {per_row} tokens a row, {what}");
        cases.push(Case::new("logit_bias", "f32", shape.clone(), move |cx, rng| {
            logit_bias(cx, rng, rows, vocab, per_row)
        }));
    }
    for (rows, vocab, what) in [(64, 131072, "Nemotron-H vocab"), (5, 1000, "odd")] {
        let shape = format!("[{rows}, {vocab}] constrained and free rows, {what}");
        cases.push(Case::new("token_mask", "f32", shape, move |cx, rng| {
            token_mask(cx, rng, rows, vocab)
        }));
    }
    for (rows, vocab, what) in [
        (64, 131072, "Nemotron-H vocab"),
        (64, 248320, "Qwen3.5 vocab"),
        (1, 262144, "262144, 1 row"),
        (512, 3000, "many rows, small vocab"),
    ] {
        let shape = format!("[{rows}, {vocab}] mixed parameters, {what}");
        cases.push(Case::new("sample_rows", "f32", shape, move |cx, rng| {
            sample_rows(cx, rng, rows, vocab)
        }));
    }
    for (rows, from_sampled, world) in [
        (1, false, 1),
        (64, true, 1),
        (300, false, 1),
        (513, true, 1),
        (64, false, 2),
        (257, false, 4),
    ] {
        let what = if from_sampled { "sampled ids" } else { "argmax words" };
        let shape = format!("{rows} rows, {what}, {world} rank(s)");
        cases.push(Case::new("chain_pick", "-", shape, move |cx, rng| {
            chain_pick(cx, rng, rows, from_sampled, world)
        }));
    }
    // dtype "-": the check is a statistical score, not an f32 rounding error (keeps the selftest's worst f32 honest).
    cases.push(Case::new(
        "sample_rows",
        "-",
        "vocab 7, 200000 draws: frequencies",
        sample_frequencies,
    ));
}

/// Random rows with planted ties on the maximum (an earlier and a later copy), −0/+0 ties, a row of equal values and,
/// when there are at least three rows, a row holding a NaN (→ −1).
fn argmax_rows(cx: &Ctx, rng: &mut Rng, rows: usize, vocab: usize) -> Result<Vec<Check>> {
    let mut logits = rng.uniform_vec(rows * vocab, 10.0);
    for r in 0..rows {
        let row = &mut logits[r * vocab..(r + 1) * vocab];
        let m = cpu::sample::argmax(row) as usize;
        let (a, b) = (rng.below(0, vocab), rng.below(0, vocab));
        row[a] = row[m];
        row[b] = row[m];
        match r % 4 {
            1 => row.fill(-3.5),
            2 => {
                row.iter_mut().for_each(|v| *v = -v.abs());
                row[b] = -0.0;
                row[a] = 0.0;
            }
            _ => {}
        }
    }
    if rows >= 3 {
        let at = rng.below(0, vocab);
        logits[2 * vocab + at] = f32::NAN;
    }
    let dl = cx.dev.upload(&logits)?;
    let mut out = cx.dev.upload(&vec![-7i32; rows])?;
    ops::argmax_rows(cx.dev, &dl, rows, &mut out)?;
    let want: Vec<i32> = logits
        .chunks_exact(vocab)
        .map(|row| {
            if row.iter().any(|v| v.is_nan()) {
                -1
            } else {
                cpu::sample::argmax(row) as i32
            }
        })
        .collect();
    Ok(vec![verdict("ids", cx.dev.download(&out)? == want)])
}

fn repetition_penalty(cx: &Ctx, rng: &mut Rng, rows: usize, vocab: usize, per_row: usize) -> Result<Vec<Check>> {
    let logits = rng.uniform_vec(rows * vocab, 8.0);
    let penalty: Vec<f32> = (0..rows).map(|_| rng.uniform(0.5, 2.0)).collect();
    let (mut rows_of, mut tokens) = (Vec::new(), Vec::new());
    for r in 0..rows {
        for t in rng.distinct(per_row, vocab) {
            rows_of.push(r as i32);
            tokens.push(t as i32);
        }
    }
    let mut dl = cx.dev.upload(&logits)?;
    let (dr, dt, dp) = (
        cx.dev.upload(&rows_of)?,
        cx.dev.upload(&tokens)?,
        cx.dev.upload(&penalty)?,
    );
    ops::repetition_penalty(cx.dev, &mut dl, vocab, &dr, &dt, &dp)?;
    // The engine Sampler's rule, per distinct previous token.
    let mut want = logits;
    for (&r, &t) in rows_of.iter().zip(&tokens) {
        let p = penalty[r as usize];
        let s = &mut want[r as usize * vocab + t as usize];
        *s = if *s > 0.0 { *s / p } else { *s * p };
    }
    Ok(vec![Check::new("logits", &cx.dev.download(&dl)?, &want, 0.0)])
}

/// Biases as the engine sends them (presence / frequency penalties, `logit_bias` ±100, the `min_tokens` mask
/// `f32::MIN`) on distinct tokens a row: the biased logits must be the CPU sum exactly, and `sample_rows` over them (a
/// greedy row, a +100 row, sampling rows) must pick the CPU Sampler's ids: never a masked token, always a +100 one
/// on a greedy row.
fn logit_bias(cx: &Ctx, rng: &mut Rng, rows: usize, vocab: usize, per_row: usize) -> Result<Vec<Check>> {
    let logits = rng.uniform_vec(rows * vocab, 8.0);
    let kinds = [f32::MIN, 100.0, -100.0, -0.5, -2.0, 1.5, -3.75];
    let (mut rows_of, mut tokens, mut bias) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rows {
        for t in rng.distinct(per_row, vocab) {
            rows_of.push(r as i32);
            tokens.push(t as i32);
            bias.push(kinds[rng.below(0, kinds.len())]);
        }
    }
    let mut dl = cx.dev.upload(&logits)?;
    let (dr, dt, db) = (cx.dev.upload(&rows_of)?, cx.dev.upload(&tokens)?, cx.dev.upload(&bias)?);
    ops::logit_bias(cx.dev, &mut dl, rows, vocab, &dr, &dt, &db)?;
    let mut want = logits;
    for ((&r, &t), &b) in rows_of.iter().zip(&tokens).zip(&bias) {
        want[r as usize * vocab + t as usize] += b;
    }
    let got = cx.dev.download(&dl)?;
    let temps = [0.0f32, 1.0, 0.7, 0.0];
    let params: Vec<f32> = (0..rows)
        .flat_map(|r| [temps[r % temps.len()], 0.0, 1.0, 0.0])
        .collect();
    let uniforms: Vec<f32> = (0..rows).map(|_| rng.unit()).collect();
    let (dp, du) = (cx.dev.upload(&params)?, cx.dev.upload(&uniforms)?);
    let mut out = cx.dev.upload(&vec![-7i32; rows])?;
    ops::sample_rows(cx.dev, &dl, rows, vocab, &dp, &du, &mut out)?;
    let ids = cx.dev.download(&out)?;
    let mismatches = (0..rows)
        .filter(|&r| {
            let row = &want[r * vocab..(r + 1) * vocab];
            let id = ids[r];
            let masked = usize::try_from(id).map_or(true, |i| i >= vocab || row[i] == f32::MIN);
            id != sample_want(row, &params[r * 4..r * 4 + 4], uniforms[r]) || masked
        })
        .count();
    Ok(vec![
        Check::new("logits", &got, &want, 0.0),
        Check {
            output: "ids (mismatched rows / rows)",
            rel_err: mismatches as f64 / rows as f64,
            threshold: 0.0,
        },
    ])
}

/// Token masks as structured outputs send them: free rows (no mask), dense and sparse masks, a mask allowing one
/// token (a forced EOS), and masks shorter than the vocabulary (ids past them are forbidden). The masked logits must
/// be the CPU twin's exactly, and `sample_rows` over them (greedy and sampling rows) must pick the CPU Sampler's ids,
/// never a forbidden one.
fn token_mask(cx: &Ctx, rng: &mut Rng, rows: usize, vocab: usize) -> Result<Vec<Check>> {
    let logits = rng.uniform_vec(rows * vocab, 8.0);
    let words = vocab.div_ceil(32);
    let (mut masks, mut mask_row) = (Vec::new(), Vec::new());
    for r in 0..rows {
        if r % 4 == 3 {
            mask_row.push(-1i32);
            continue;
        }
        mask_row.push((masks.len() / words) as i32);
        let mut mask = vec![0u32; words];
        let allowed = match r % 4 {
            0 => vec![rng.below(0, vocab)],
            1 => rng.distinct(vocab / 50 + 1, vocab),
            _ => rng.distinct(vocab / 2, vocab),
        };
        // The tokenizer's vocabulary below the model's: the ids past it are never allowed.
        let limit = if r % 8 == 2 { vocab / 2 } else { vocab };
        for t in allowed.into_iter().filter(|&t| t < limit) {
            mask[t / 32] |= 1 << (t % 32);
        }
        if mask.iter().all(|&w| w == 0) {
            mask[0] = 1;
        }
        masks.extend(mask);
    }
    let mut dl = cx.dev.upload(&logits)?;
    let (dm, dr) = (cx.dev.upload(&masks)?, cx.dev.upload(&mask_row)?);
    ops::token_mask(cx.dev, &mut dl, rows, vocab, &dm, words, &dr)?;
    let mut want = logits;
    for (r, &at) in mask_row.iter().enumerate() {
        if let Ok(at) = usize::try_from(at) {
            cpu::sample::apply_token_mask(
                &mut want[r * vocab..(r + 1) * vocab],
                &masks[at * words..(at + 1) * words],
            );
        }
    }
    let got = cx.dev.download(&dl)?;
    let temps = [0.0f32, 1.0, 0.7, 0.0, 1.3];
    let params: Vec<f32> = (0..rows)
        .flat_map(|r| [temps[r % temps.len()], 0.0, 1.0, 0.0])
        .collect();
    let uniforms: Vec<f32> = (0..rows).map(|_| rng.unit()).collect();
    let (dp, du) = (cx.dev.upload(&params)?, cx.dev.upload(&uniforms)?);
    let mut out = cx.dev.upload(&vec![-7i32; rows])?;
    ops::sample_rows(cx.dev, &dl, rows, vocab, &dp, &du, &mut out)?;
    let ids = cx.dev.download(&out)?;
    let mismatches = (0..rows)
        .filter(|&r| {
            let row = &want[r * vocab..(r + 1) * vocab];
            let id = ids[r];
            let forbidden = usize::try_from(id).map_or(true, |i| i >= vocab || row[i] == f32::MIN);
            id != sample_want(row, &params[r * 4..r * 4 + 4], uniforms[r]) || forbidden
        })
        .count();
    Ok(vec![
        Check::new("logits", &got, &want, 0.0),
        Check {
            output: "ids (mismatched rows / rows)",
            rel_err: mismatches as f64 / rows as f64,
            threshold: 0.0,
        },
    ])
}

/// The twin of one row of `sample_rows`: −1 for a NaN row (greedy) or any non-finite logit (sampling).
fn sample_want(row: &[f32], p: &[f32], u: f32) -> i32 {
    let (t, k, top_p, min_p) = (p[0], p[1] as usize, p[2], p[3]);
    if t <= 0.0 {
        return if row.iter().any(|v| v.is_nan()) {
            -1
        } else {
            cpu::sample::argmax(row) as i32
        };
    }
    if row.iter().any(|v| !v.is_finite()) {
        return -1;
    }
    cpu::sample::sample_row(row, t, k, top_p, min_p, u) as i32
}

/// Rows of logits rounded to bf16 (ties, as real logits have) on varied scales, each with its own parameters drawn
/// from sets that exercise every filter alone and together (greedy, top-k 1, tiny temperatures that zero most
/// weights, top-k past the vocabulary), plus a NaN row and an infinite row. The ids must be identical.
fn sample_rows(cx: &Ctx, rng: &mut Rng, rows: usize, vocab: usize) -> Result<Vec<Check>> {
    let mut logits = Vec::with_capacity(rows * vocab);
    for r in 0..rows {
        let scale = [2.0f32, 6.0, 15.0][r % 3];
        logits.extend(rounded::<bf16>(&rng.uniform_vec(vocab, scale)));
    }
    let temps = [0.0f32, 1.0, 0.7, 1.5, 0.3, 1e-4];
    let top_ks = [0usize, 1, 5, 40, 1000, vocab + 3];
    let top_ps = [1.0f32, 0.9, 0.5, 0.95, 0.2];
    let min_ps = [0.0f32, 0.05, 0.1, 0.0];
    let mut params = Vec::with_capacity(rows * 4);
    for _ in 0..rows {
        params.push(temps[rng.below(0, temps.len())]);
        params.push(top_ks[rng.below(0, top_ks.len())] as f32);
        params.push(top_ps[rng.below(0, top_ps.len())]);
        params.push(min_ps[rng.below(0, min_ps.len())]);
    }
    if rows >= 4 {
        logits[vocab + 17] = f32::NAN;
        logits[3 * vocab + 5] = f32::INFINITY;
        params[4] = 1.0;
        params[12] = 0.0;
    }
    let uniforms: Vec<f32> = (0..rows).map(|_| rng.unit()).collect();
    let (dl, dp, du) = (
        cx.dev.upload(&logits)?,
        cx.dev.upload(&params)?,
        cx.dev.upload(&uniforms)?,
    );
    let mut out = cx.dev.upload(&vec![-7i32; rows])?;
    ops::sample_rows(cx.dev, &dl, rows, vocab, &dp, &du, &mut out)?;
    let got = cx.dev.download(&out)?;
    let mismatches = (0..rows)
        .filter(|&r| {
            got[r]
                != sample_want(
                    &logits[r * vocab..(r + 1) * vocab],
                    &params[r * 4..r * 4 + 4],
                    uniforms[r],
                )
        })
        .count();
    Ok(vec![Check {
        output: "ids (mismatched rows / rows)",
        rel_err: mismatches as f64 / rows as f64,
        threshold: 0.0,
    }])
}

/// 200000 draws from one tiny row: each id's frequency must match the Sampler's probability (kept weight / kept mass)
/// within 5 standard deviations; the check reports the worst deviation in units of that bound.
fn sample_frequencies(cx: &Ctx, rng: &mut Rng) -> Result<Vec<Check>> {
    const DRAWS: usize = 200_000;
    let row = [0.3f32, -1.2, 2.0, 1.1, 2.0, -0.4, 0.9];
    let (t, k, top_p, min_p) = (0.9f32, 6usize, 0.93f32, 0.04f32);
    let vocab = row.len();
    let logits: Vec<f32> = (0..DRAWS).flat_map(|_| row.iter().copied()).collect();
    let params: Vec<f32> = (0..DRAWS).flat_map(|_| [t, k as f32, top_p, min_p]).collect();
    let uniforms: Vec<f32> = (0..DRAWS).map(|_| rng.unit()).collect();
    let (dl, dp, du) = (
        cx.dev.upload(&logits)?,
        cx.dev.upload(&params)?,
        cx.dev.upload(&uniforms)?,
    );
    let mut out = cx.dev.upload(&vec![-7i32; DRAWS])?;
    ops::sample_rows(cx.dev, &dl, DRAWS, vocab, &dp, &du, &mut out)?;
    let mut counts = vec![0usize; vocab];
    let mut bad = 0usize;
    for id in cx.dev.download(&out)? {
        match usize::try_from(id).ok().filter(|&i| i < vocab) {
            Some(i) => counts[i] += 1,
            None => bad += 1,
        }
    }
    let kept = cpu::sample::kept_weights(&row, t, k, top_p, min_p);
    let total: f64 = kept.iter().map(|&(_, w)| f64::from(w)).sum();
    let mut worst = if bad > 0 { f64::INFINITY } else { 0.0f64 };
    for (i, &c) in counts.iter().enumerate() {
        let p = kept
            .iter()
            .find(|&&(j, _)| j as usize == i)
            .map_or(0.0, |&(_, w)| f64::from(w) / total);
        let bound = 5.0 * (p * (1.0 - p) / DRAWS as f64).sqrt() + 1e-9;
        worst = worst.max((c as f64 / DRAWS as f64 - p).abs() / bound);
    }
    Ok(vec![Check {
        output: "frequency deviation / 5σ",
        rel_err: worst,
        threshold: 1.0,
    }])
}

/// Random summaries of `world` ranks (max logits on a coarse grid, so ranks tie), sampled ids, a NaN row's −1, an id
/// past the vocabulary and a NaN max planted, against the twin.
fn chain_pick(cx: &Ctx, rng: &mut Rng, rows: usize, from_sampled: bool, world: usize) -> Result<Vec<Check>> {
    let (vocab, words) = (131072usize, ops::SUMMARY_WORDS);
    let mut gathered: Vec<u32> = (0..world * rows * words).map(|_| rng.next_u64() as u32).collect();
    for k in 0..world * rows {
        gathered[k * words] = rng.below(0, vocab) as u32;
        gathered[k * words + 1] = (rng.below(0, 8) as f32 - 4.0).to_bits();
    }
    let mut sampled: Vec<i32> = (0..rows).map(|_| rng.below(0, vocab) as i32).collect();
    let bad = rng.below(0, rows);
    sampled[bad] = -1;
    gathered[bad * words] = vocab as u32 + 5;
    gathered[bad * words + 1] = 100f32.to_bits();
    let poisoned = ((world - 1) * rows + rng.below(0, rows)) * words;
    gathered[poisoned + 1] = f32::NAN.to_bits();
    let local = gathered[..rows * words].to_vec();
    let (dl, dg, di) = (
        cx.dev.upload(&local)?,
        cx.dev.upload(&gathered)?,
        cx.dev.upload(&sampled)?,
    );
    let mut tokens = cx.dev.upload(&vec![-9i32; rows])?;
    let mut log_words = cx.dev.upload(&vec![0u32; rows * words])?;
    let mut log_ids = cx.dev.upload(&vec![-9i32; rows])?;
    ops::chain_pick(
        cx.dev,
        &dl,
        &dg,
        world,
        words,
        &di,
        from_sampled,
        vocab,
        &mut tokens,
        &mut log_words,
        &mut log_ids,
    )?;
    let (want_tokens, want_ids) =
        cpu::sample::chain_pick(&local, &gathered, world, words, &sampled, from_sampled, vocab);
    Ok(vec![
        verdict("tokens", cx.dev.download(&tokens)? == want_tokens),
        verdict("log_words", cx.dev.download(&log_words)? == local),
        verdict("log_ids", cx.dev.download(&log_ids)? == want_ids),
    ])
}
