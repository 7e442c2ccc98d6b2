//! Cases for [`crate::cuda::ops::chain_spec`] against its CPU twin [`crate::cpu::chain::spec_requests`], every
//! output word compared exactly: greedy and sampled sequences mixed, positions near `u32` wrap-around and offsets
//! that wrap `u64` (an index key must be the same on both sides whatever the numbers), negative tokens (no draft),
//! windows of one row (the bonus alone), faulted sequences (skipped: their sentinels stay), and launches of 1 … 300
//! sequences.

use super::cases_glue::verdict;
use super::{Case, Check, Ctx, Rng};
use crate::cpu::chain::{spec_requests, ChainSample, ChainSeq, CHAIN_SAMPLE_WORDS};
use crate::cuda::ops::{self, encode_judge, encode_spec, JUDGE_WORDS, SPEC_WORDS};
use crate::cuda::Result;

/// A sentinel in every output word a launch may leave alone.
const UNTOUCHED: u32 = 0xdead_beef;

/// Registers the cases.
pub(super) fn register(cases: &mut Vec<Case>) {
    for (seqs, t) in [(1, 1), (1, 5), (37, 2), (37, 5), (300, 4)] {
        cases.push(Case::new(
            "chain_spec",
            "-",
            format!("{seqs} sequences, t {t}"),
            move |cx, rng| chain_spec(cx, rng, seqs, t),
        ));
    }
}

/// The inputs of a case.
struct Inputs {
    t: usize,
    samples: Vec<Option<ChainSample>>,
    state: Vec<ChainSeq>,
    tokens: Vec<i32>,
    fault: Vec<i32>,
}

fn inputs(rng: &mut Rng, seqs: usize, t: usize) -> Inputs {
    let samples = (0..seqs)
        .map(|q| {
            (q % 3 != 1).then(|| ChainSample {
                temperature: rng.uniform(0.05, 2.0),
                seed: rng.next_u64(),
                // Offsets that wrap with the position, and small ones.
                offset: if q % 4 == 0 {
                    u64::MAX - rng.below(0, 1000) as u64
                } else {
                    rng.below(0, 1 << 20) as u64
                },
            })
        })
        .collect();
    let state = (0..seqs)
        .map(|q| ChainSeq {
            slot: q as i32,
            position: if q % 5 == 2 {
                i32::MAX - rng.below(0, 8) as i32
            } else {
                rng.below(0, 100_000) as i32
            },
            ..ChainSeq::default()
        })
        .collect();
    let tokens = (0..seqs * t)
        .map(|r| if r % 7 == 3 { -1 } else { rng.below(0, 150_000) as i32 })
        .collect();
    let fault = (0..seqs).map(|q| i32::from(q % 6 == 5)).collect();
    Inputs {
        t,
        samples,
        state,
        tokens,
        fault,
    }
}

/// The twin's words over sentinel-filled outputs.
fn expected(x: &Inputs) -> (Vec<u32>, Vec<u32>) {
    let (t, seqs) = (x.t, x.state.len());
    let mut spec = vec![UNTOUCHED; seqs * t * SPEC_WORDS];
    let mut judge = vec![UNTOUCHED; seqs * JUDGE_WORDS];
    for q in (0..seqs).filter(|&q| x.fault[q] == 0) {
        let (rows, key) = spec_requests(
            x.samples[q].as_ref(),
            x.state[q].position,
            &x.tokens[q * t..(q + 1) * t],
        );
        for (i, r) in rows.iter().enumerate() {
            let at = (q * t + i) * SPEC_WORDS;
            spec[at..at + SPEC_WORDS].copy_from_slice(&encode_spec(r.as_ref()));
        }
        judge[q * JUDGE_WORDS..(q + 1) * JUDGE_WORDS].copy_from_slice(&encode_judge(key));
    }
    (spec, judge)
}

fn chain_spec(cx: &Ctx, rng: &mut Rng, seqs: usize, t: usize) -> Result<Vec<Check>> {
    let x = inputs(rng, seqs, t);
    let state: Vec<i32> = x.state.iter().flat_map(ChainSeq::encode).collect();
    let sample: Vec<u32> = x.samples.iter().flat_map(|s| ChainSample::encode(s.as_ref())).collect();
    debug_assert_eq!(sample.len(), seqs * CHAIN_SAMPLE_WORDS);
    let (ds, df, da, dt) = (
        cx.dev.upload(&state)?,
        cx.dev.upload(&x.fault)?,
        cx.dev.upload(&sample)?,
        cx.dev.upload(&x.tokens)?,
    );
    let mut dspec = cx.dev.upload(&vec![UNTOUCHED; seqs * t * SPEC_WORDS])?;
    let mut djudge = cx.dev.upload(&vec![UNTOUCHED; seqs * JUDGE_WORDS])?;
    ops::chain_spec(cx.dev, &ds, &df, &da, &dt, t, &mut dspec, &mut djudge, seqs)?;
    let (want_spec, want_judge) = expected(&x);
    Ok(vec![
        verdict("spec", cx.dev.download(&dspec)? == want_spec),
        verdict("judge", cx.dev.download(&djudge)? == want_judge),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cases reach what they say on the host side: greedy and sampled rows, skipped sequences, rows with no
    /// draft, and index keys that wrap.
    #[test]
    fn the_inputs_reach_every_kind_of_row() {
        let x = inputs(&mut Rng::new(3), 300, 4);
        let (spec, judge) = expected(&x);
        let words: Vec<&[u32]> = spec.chunks_exact(SPEC_WORDS).collect();
        assert!(words.iter().any(|w| w[0] == (-2i32) as u32), "greedy rows");
        assert!(
            words.iter().any(|w| w[0] == u32::MAX && w[1] != 0),
            "sampled rows without a draft"
        );
        assert!(words.iter().any(|w| (w[0] as i32) >= 0), "drafted rows");
        assert!(words.iter().any(|w| w[0] == UNTOUCHED), "skipped sequences");
        let wrapped = x
            .samples
            .iter()
            .zip(&x.state)
            .any(|(s, st)| s.is_some_and(|s| s.offset.checked_add(u64::from(st.position as u32)).is_none()));
        assert!(wrapped, "an index key that wraps");
        assert!(judge.chunks_exact(JUDGE_WORDS).any(|w| w[0] == 1), "sampled judging");
        assert!(
            judge.chunks_exact(JUDGE_WORDS).any(|w| w == [0; JUDGE_WORDS]),
            "greedy judging"
        );
    }
}
