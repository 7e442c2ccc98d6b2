//! Cases for the one-pass LM-head summaries ([`crate::cuda::ops::head_summaries`]) against the CPU twin
//! [`crate::cpu::lm_head::summarise_logits`]: plain and speculative rows (with and without a draft, several
//! temperatures), whole rows and rows folded in chunks that do not fall on part boundaries, and vocabulary slices
//! that start at a tensor-parallel rank's first id.

use super::cases_glue::verdict;
use super::{Case, Check, Ctx, Rng};
use crate::cpu::lm_head::{
    gumbel, summarise_logits, summarise_logits_with, LogprobRequest, RowPass, SpecRequest, MAX_TOP,
};
use crate::cuda::ops::{self, SPEC_WORDS, SUMMARY_WORDS, TOPK_WORDS};
use crate::cuda::Result;

/// Registers the head-summary cases.
pub(super) fn register(cases: &mut Vec<Case>) {
    for (rows, vocab, first_id, chunks, what) in [
        (64, 131072, 0, 1, "Nemotron-H vocab, decode rows"),
        (20, 248320, 0, 1, "Qwen3.5 vocab, 4 verifies of T = 4 + bonus"),
        (20, 248320, 0, 3, "Qwen3.5 vocab in 3 uneven chunks"),
        (5, 65536, 65536, 2, "second TP slice of Nemotron-H's vocab"),
        (3, 1000, 7, 1, "odd"),
    ] {
        let shape = format!("[{rows}, {vocab}] from id {first_id}, {chunks} chunk(s), {what}");
        cases.push(Case::new("head_summaries", "f32", shape, move |cx, rng| {
            head_summaries(cx, rng, rows, vocab, first_id, chunks)
        }));
    }
    for (rows, vocab, first_id, chunks, what) in [
        (16, 131072, 0, 1, "Nemotron-H vocab, every other row asking"),
        (12, 248320, 0, 3, "Qwen3.5 vocab in 3 uneven chunks"),
        (6, 65536, 65536, 2, "second TP slice of Nemotron-H's vocab"),
        (5, 1000, 7, 1, "odd, coarse values (ties)"),
    ] {
        let shape = format!("[{rows}, {vocab}] from id {first_id}, {chunks} chunk(s), {what}");
        cases.push(Case::new("head_logprobs", "f32", shape, move |cx, rng| {
            head_logprobs(cx, rng, rows, vocab, first_id, chunks)
        }));
    }
}

/// Chunk edges at odd places, as the engine's chunked head puts them.
fn chunk_edges(vocab: usize, chunks: usize) -> Vec<usize> {
    (0..=chunks)
        .map(|c| ((c * vocab / chunks) | usize::from(c % 2 == 1)).min(vocab))
        .collect()
}

/// The log-probability rows' top lists and target logits ([`ops::head_topk_parts`], [`ops::head_topk_merge`])
/// against the CPU twin's ([`summarise_logits_with`]): every other row asks (k 0, 1, 5 or 20, a target in or out of
/// the slice), one asking row holds NaNs, and a vocabulary of coarse values has many ties (the lower id first).
fn head_logprobs(
    cx: &Ctx,
    rng: &mut Rng,
    rows: usize,
    vocab: usize,
    first_id: u32,
    chunks: usize,
) -> Result<Vec<Check>> {
    let mut logits = rng.uniform_vec(rows * vocab, 12.0);
    if vocab <= 1000 {
        for v in &mut logits {
            *v = (*v * 2.0).round() * 0.5;
        }
    }
    logits[vocab + 3] = f32::NAN;
    let asking: Vec<usize> = (0..rows).filter(|r| r % 2 == 1).collect();
    let requests: Vec<LogprobRequest> = asking
        .iter()
        .enumerate()
        .map(|(j, _)| LogprobRequest {
            top: [0, 1, 5, MAX_TOP][j % 4],
            target: match j % 3 {
                0 => None,
                1 => Some(first_id + rng.below(0, vocab) as u32),
                _ => Some(first_id + vocab as u32 + 1),
            },
        })
        .collect();
    let rows_i: Vec<i32> = asking.iter().map(|&r| r as i32).collect();
    let req = ops::encode_logprob_requests(&requests);
    let (dl, drows, dreq) = (cx.dev.upload(&logits)?, cx.dev.upload(&rows_i)?, cx.dev.upload(&req)?);
    let edges = chunk_edges(vocab, chunks);
    let total: usize = edges.windows(2).map(|w| ops::parts_for(w[1] - w[0])).sum();
    let mut parts = cx.dev.alloc::<u32>(asking.len() * total * TOPK_WORDS)?;
    let mut out = cx.dev.alloc::<u32>(asking.len() * TOPK_WORDS)?;
    let mut offset = 0;
    for w in edges.windows(2) {
        let (lo, len) = (w[0], w[1] - w[0]);
        let view = dl.slice(lo..);
        ops::head_topk_parts(
            cx.dev,
            &view,
            vocab,
            rows,
            len,
            first_id + lo as u32,
            &drows,
            &dreq,
            &mut parts,
            total,
            offset,
        )?;
        offset += ops::parts_for(len);
    }
    ops::head_topk_merge(cx.dev, &parts, asking.len(), total, offset, &dreq, &mut out)?;
    let got = ops::decode_topk(&cx.dev.download(&out)?, &requests);
    // The entries are logits read, not computed: ids and values must match exactly (NaN targets by their bits).
    let same = |a: Option<(u32, f32)>, b: Option<(u32, f32)>| match (a, b) {
        (Some((i, x)), Some((j, y))) => i == j && x.to_bits() == y.to_bits(),
        (None, None) => true,
        _ => false,
    };
    let (mut tops_ok, mut targets_ok) = (true, true);
    for ((&r, req), g) in asking.iter().zip(&requests).zip(&got) {
        let row = &logits[r * vocab..(r + 1) * vocab];
        let w = summarise_logits_with(row, first_id, None, Some(req))
            .logprob
            .expect("asked");
        let ok = g.top.entries().collect::<Vec<_>>() == w.top.entries().collect::<Vec<_>>();
        if !ok {
            eprintln!(
                "head_logprobs row {r} (k {}): device {:?}, CPU {:?}",
                req.top,
                g.top.entries().collect::<Vec<_>>(),
                w.top.entries().collect::<Vec<_>>()
            );
        }
        tops_ok &= ok;
        targets_ok &= same(g.target, w.target);
    }
    Ok(vec![
        verdict("top entries", tops_ok),
        verdict("target logit", targets_ok),
    ])
}

/// Every other row speculative, a third of those without a draft (the bonus row), temperatures 0.3 … 1.7.
fn requests(rng: &mut Rng, rows: usize, vocab: usize, first_id: u32) -> Vec<Option<SpecRequest>> {
    (0..rows)
        .map(|r| {
            (r % 2 == 1).then(|| SpecRequest {
                draft: (r % 3 != 0).then(|| first_id + rng.below(0, vocab) as u32),
                temperature: rng.uniform(0.3, 1.7),
                seed: rng.next_u64(),
                index: rng.below(0, 1 << 20) as u64,
            })
        })
        .collect()
}

/// The score the CPU gives candidate `id` of row `row` (ids from `first_id`).
fn cpu_score(row: &[f32], first_id: u32, id: u32, r: &SpecRequest) -> f32 {
    row[(id - first_id) as usize] / r.temperature + gumbel(r.seed, r.index, id)
}

fn head_summaries(
    cx: &Ctx,
    rng: &mut Rng,
    rows: usize,
    vocab: usize,
    first_id: u32,
    chunks: usize,
) -> Result<Vec<Check>> {
    let logits = rng.uniform_vec(rows * vocab, 12.0);
    let spec = requests(rng, rows, vocab, first_id);
    let words: Vec<u32> = spec.iter().flat_map(|s| ops::encode_spec(s.as_ref())).collect();
    debug_assert_eq!(words.len(), rows * SPEC_WORDS);
    let (dl, ds) = (cx.dev.upload(&logits)?, cx.dev.upload(&words)?);
    // Each chunk's parts follow the last one's.
    let edges = chunk_edges(vocab, chunks);
    let total: usize = edges.windows(2).map(|w| ops::parts_for(w[1] - w[0])).sum();
    let mut parts = cx.dev.alloc::<u32>(rows * total * SUMMARY_WORDS)?;
    let mut out = cx.dev.alloc::<u32>(rows * SUMMARY_WORDS)?;
    let mut offset = 0;
    for w in edges.windows(2) {
        let (lo, len) = (w[0], w[1] - w[0]);
        let view = dl.slice(lo..);
        ops::head_summary_parts(
            cx.dev,
            &view,
            vocab,
            rows,
            len,
            first_id + lo as u32,
            &ds,
            &mut parts,
            total,
            offset,
        )?;
        offset += ops::parts_for(len);
    }
    ops::head_summary_merge(cx.dev, &parts, rows, total, offset, &mut out)?;
    let flags: Vec<bool> = spec.iter().map(Option::is_some).collect();
    let got = ops::decode_summaries(&cx.dev.download(&out)?, &flags);
    let want: Vec<RowPass> = logits
        .chunks_exact(vocab)
        .zip(&spec)
        .map(|(row, s)| summarise_logits(row, first_id, s.as_ref()))
        .collect();
    let mut ids_ok = true;
    let mut cands_ok = true;
    let (mut g_lse, mut w_lse) = (Vec::new(), Vec::new());
    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
        ids_ok &= g.argmax == w.argmax && g.max == w.max;
        g_lse.push(g.lse);
        w_lse.push(w.lse);
        match (g.spec, w.spec, &spec[r]) {
            (Some(gs), Some(ws), Some(req)) => {
                g_lse.extend([gs.lse, gs.drafted.unwrap_or(0.0)]);
                w_lse.extend([ws.lse, ws.drafted.unwrap_or(0.0)]);
                ids_ok &= gs.drafted.is_some() == ws.drafted.is_some();
                // The device's logs may differ from the CPU's in the last place: a different candidate passes only
                // when the CPU scores it within rounding of its own best.
                let row = &logits[r * vocab..(r + 1) * vocab];
                let same = gs.candidate == ws.candidate
                    || (req.draft != Some(gs.candidate)
                        && (cpu_score(row, first_id, gs.candidate, req) - ws.score).abs() <= 1e-5 * ws.score.abs());
                let ok = same && (gs.score - ws.score).abs() <= 1e-5 * ws.score.abs().max(1.0);
                if !ok {
                    // The numbers a reader needs to tell a near-tie from a defect.
                    eprintln!(
                        "head_summaries row {r}: device candidate {} score {}, CPU candidate {} score {}, CPU score of \
                         the device's candidate {}, draft {:?}, temperature {}",
                        gs.candidate,
                        gs.score,
                        ws.candidate,
                        ws.score,
                        cpu_score(row, first_id, gs.candidate, req),
                        req.draft,
                        req.temperature
                    );
                }
                cands_ok &= ok;
            }
            (None, None, None) => {}
            _ => ids_ok = false,
        }
    }
    Ok(vec![
        verdict("argmax", ids_ok),
        verdict("candidate", cands_ok),
        Check::new("lse", &g_lse, &w_lse, 1e-5),
    ])
}
