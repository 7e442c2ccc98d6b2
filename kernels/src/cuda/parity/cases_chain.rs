//! Cases for the device's speculative chain ([`crate::cuda::ops::chain_advance`], [`crate::cuda::ops::chain_draft`])
//! against their CPU twins [`crate::cpu::chain::advance_in`] and [`crate::cpu::chain::propose`], every output
//! buffer compared exactly. Advance: replay rows near the flush boundary (both sides) and with wrapping ring starts,
//! kv-only rows below and at the threshold, recurrent rows, conv rings of no rows and of some, a fault of every
//! kind, a sticky fault set before the launch, and sentinels in every output so a faulted sequence that wrote
//! anything fails. Draft: histories of 0 … 3000 tokens over small alphabets (many repeats), large ones (long scans
//! that find nothing), repeating runs, lengths outside the row (clamped), faulted sequences (skipped), n-grams of
//! (1, 3) and (2, 4) tokens, and tables with −1 holes that end before some histories do.

use cudarc::driver::CudaSlice;

use super::cases_glue::verdict;
use super::{Case, Check, Ctx, Rng};
use crate::cpu::chain::{
    advance_in, propose, ChainParams, ChainSeq, DraftMode, CHAIN_STATE_WORDS, FAULT_FOLD, FAULT_HISTORY, FAULT_RING,
    FAULT_VERDICT, FORM_KV_ONLY, FORM_RECURRENT, FORM_REPLAY,
};
use crate::cuda::ops::{self, REPLAY_META};
use crate::cuda::Result;

/// Token ids of the cases.
const VOCAB: usize = 50_000;
/// History row stride of the draft cases.
const DRAFT_HIST_CAP: usize = 3072;
/// Sentinels of the outputs a launch may leave alone.
const UNTOUCHED: [i32; 4] = [-77, -55, -66, -44];

/// Registers the chain cases.
pub(super) fn register(cases: &mut Vec<Case>) {
    for (seqs, t, conv_cap) in [(1, 2, 7), (1, 5, 0), (37, 2, 6), (37, 5, 0), (256, 1, 4), (256, 5, 9)] {
        let shape = format!("{seqs} sequences, t {t}, conv ring {conv_cap}");
        cases.push(Case::new("chain_advance", "-", shape, move |cx, rng| {
            chain_advance(cx, rng, seqs, t, conv_cap)
        }));
    }
    let ngram = |min_n, max_n| DraftMode::Ngram { min_n, max_n };
    let table = DraftMode::Table { table_cap: 2000 };
    for (seqs, t, mode) in [
        (1, 5, ngram(1, 3)),
        (37, 1, ngram(1, 3)),
        (37, 2, ngram(2, 4)),
        (256, 5, ngram(1, 3)),
        (256, 5, ngram(2, 4)),
        (1, 2, table),
        (37, 5, table),
        (256, 2, table),
    ] {
        let shape = format!("{seqs} sequences, t {t}, {mode:?}");
        cases.push(Case::new("chain_draft", "-", shape, move |cx, rng| {
            chain_draft(cx, rng, seqs, t, mode)
        }));
    }
}

/// An upload of `v`, or of one element when `v` is empty (use `.slice(..v.len())`).
fn upload(cx: &Ctx, v: &[i32]) -> Result<CudaSlice<i32>> {
    cx.dev.upload(if v.is_empty() { &[0][..] } else { v })
}

/// The inputs of an advance case.
struct AdvanceInputs {
    p: ChainParams,
    /// Length of `lens`.
    slots: usize,
    /// `[seqs, 2]`.
    verdict: Vec<i32>,
    /// `[seqs, t − 1]`.
    drafts: Vec<i32>,
    state: Vec<ChainSeq>,
    /// `[seqs, hist_cap]`: each row's history, then sentinels.
    hist: Vec<i32>,
    fault: Vec<i32>,
}

/// The scenarios of the advance cases, one per sequence in turn (sequence `q` gets `q % SCENARIOS`, a lone one a
/// random scenario).
const SCENARIOS: usize = 13;

fn advance_inputs(rng: &mut Rng, seqs: usize, t: usize, conv_cap: usize) -> AdvanceInputs {
    let window = (t - 1 + rng.below(0, 3)).max(1);
    let reach = window.max(t);
    let p = ChainParams {
        t,
        ring_capacity: 2 * (t + reach) + rng.below(0, 8),
        window,
        threshold: rng.below(t + 1, t + 12),
        conv_cap,
        hist_cap: 48 + rng.below(0, 32),
    };
    let (l, hc) = (p.ring_capacity, p.hist_cap);
    let slots = seqs + 5;
    let slot_of = rng.distinct(seqs, slots);
    let mut x = AdvanceInputs {
        p,
        slots,
        verdict: Vec::with_capacity(2 * seqs),
        drafts: (0..seqs * (t - 1)).map(|_| rng.below(0, VOCAB) as i32).collect(),
        state: Vec::with_capacity(seqs),
        hist: vec![-33; seqs * hc],
        fault: vec![0; seqs],
    };
    for (q, &slot) in slot_of.iter().enumerate() {
        let scenario = if seqs < SCENARIOS {
            rng.below(0, SCENARIOS)
        } else {
            q % SCENARIOS
        };
        let mut a = rng.below(0, t) as i32;
        let mut y = rng.below(0, VOCAB) as i32;
        let kv_cap = (p.threshold + window) as i32;
        let mut s = ChainSeq {
            slot: slot as i32,
            position: rng.below(0, 100_000) as i32,
            ring_start: rng.below(0, l) as i32,
            ring_len: rng.below(0, l + 1) as i32,
            ring_cap: l as i32,
            conv_head: rng.below(0, conv_cap.max(3)) as i32,
            form: FORM_REPLAY,
            hist_len: rng.below(0, hc - t) as i32,
        };
        match scenario {
            // Replay at the flush boundary: h + t + reach = L, no flush (the next step's: h grew).
            0 => s.ring_len = (l - t - reach) as i32,
            // Past it (the step's flush), its new start wrapping past the ring's end.
            1 => {
                s.ring_start = (l - 1 - rng.below(0, 3)) as i32;
                s.ring_len = (l - t - reach + 1 + rng.below(0, t + reach - 1)) as i32;
            }
            // Kv-only below the threshold (the next step folds or not), and at its edge (it must).
            2 | 3 => {
                s.form = FORM_KV_ONLY;
                s.ring_cap = kv_cap;
                s.ring_start = rng.below(0, kv_cap as usize) as i32;
                s.ring_len = if scenario == 2 {
                    rng.below(0, p.threshold) as i32
                } else {
                    p.threshold as i32 - 1
                };
            }
            4 => s.form = FORM_RECURRENT,
            // A failed or malformed verdict.
            5 => match rng.below(0, 3) {
                0 => y = -1,
                1 => a = t as i32,
                _ => a = -1,
            },
            // A ring too short for the commit, or one of no rows met by a flush.
            6 => {
                s.form = FORM_KV_ONLY;
                s.ring_len = rng.below(0, p.threshold) as i32;
                s.ring_cap = s.ring_len + a - rng.below(0, a as usize + 1) as i32;
            }
            7 => {
                s.ring_len = l as i32;
                s.ring_cap = 0;
            }
            // A history too short (or a negative length), and one that is exactly filled.
            8 if rng.unit() < 0.2 => s.hist_len = -1,
            8 => s.hist_len = (hc - rng.below(0, a as usize + 1)) as i32,
            9 => s.hist_len = (hc - a as usize - 1) as i32,
            // A slot outside `lens`.
            10 => {
                s.slot = if rng.unit() < 0.5 {
                    -1
                } else {
                    (slots + rng.below(0, 3)) as i32
                }
            }
            // A sticky fault from an earlier link.
            11 => x.fault[q] = [FAULT_VERDICT, FAULT_HISTORY, FAULT_RING | FAULT_FOLD][rng.below(0, 3)],
            // Everything accepted.
            _ => a = t as i32 - 1,
        }
        let row = &mut x.hist[q * hc..(q + 1) * hc];
        for v in row.iter_mut().take(s.hist_len.max(0) as usize) {
            *v = rng.below(0, VOCAB) as i32;
        }
        x.verdict.extend([a, y]);
        x.state.push(s);
    }
    x
}

/// The advance outputs: state, hist, fault, meta, tokens, row_pos, lens.
type AdvanceOutputs = [Vec<i32>; 7];

/// What the twin makes of the inputs, from sentinel-filled outputs.
fn advance_expected(x: &AdvanceInputs) -> AdvanceOutputs {
    let (p, seqs) = (&x.p, x.state.len());
    let (t, hc) = (p.t, p.hist_cap);
    let (mut state, mut hist, mut fault) = (Vec::new(), x.hist.clone(), x.fault.clone());
    let mut meta = vec![UNTOUCHED[0]; seqs * REPLAY_META];
    let mut tokens = vec![UNTOUCHED[1]; seqs * t];
    let mut row_pos = vec![UNTOUCHED[2]; seqs * t];
    let mut lens = vec![UNTOUCHED[3]; x.slots];
    for q in 0..seqs {
        let mut s = x.state[q];
        let verdict = (x.verdict[2 * q], x.verdict[2 * q + 1]);
        let drafts = &x.drafts[q * (t - 1)..(q + 1) * (t - 1)];
        let row = &mut hist[q * hc..(q + 1) * hc];
        if let Some(next) = advance_in(x.slots, &mut s, &mut fault[q], verdict, drafts, row, p) {
            meta[q * REPLAY_META..(q + 1) * REPLAY_META].copy_from_slice(&next.meta);
            tokens[q * t] = next.token;
            for (i, r) in row_pos[q * t..(q + 1) * t].iter_mut().enumerate() {
                *r = s.position.wrapping_add(i as i32);
            }
            lens[s.slot as usize] = next.lens;
        }
        state.extend(s.encode());
    }
    [state, hist, fault, meta, tokens, row_pos, lens]
}

fn chain_advance(cx: &Ctx, rng: &mut Rng, seqs: usize, t: usize, conv_cap: usize) -> Result<Vec<Check>> {
    let x = advance_inputs(rng, seqs, t, conv_cap);
    let state: Vec<i32> = x.state.iter().flat_map(ChainSeq::encode).collect();
    debug_assert_eq!(state.len(), seqs * CHAIN_STATE_WORDS);
    let (dv, dd) = (cx.dev.upload(&x.verdict)?, upload(cx, &x.drafts)?);
    let (mut ds, mut dh, mut df) = (
        cx.dev.upload(&state)?,
        cx.dev.upload(&x.hist)?,
        cx.dev.upload(&x.fault)?,
    );
    let mut dm = cx.dev.upload(&vec![UNTOUCHED[0]; seqs * REPLAY_META])?;
    let mut dt = cx.dev.upload(&vec![UNTOUCHED[1]; seqs * t])?;
    let mut dr = cx.dev.upload(&vec![UNTOUCHED[2]; seqs * t])?;
    let mut dl = cx.dev.upload(&vec![UNTOUCHED[3]; x.slots])?;
    ops::chain_advance(
        cx.dev,
        &dv,
        &dd.slice(..x.drafts.len()),
        &mut ds,
        &mut dh,
        &mut df,
        &mut dm,
        &mut dt,
        &mut dr,
        &mut dl,
        &x.p,
        seqs,
    )?;
    let want = advance_expected(&x);
    let names = ["state", "hist", "fault", "meta", "tokens", "row_pos", "lens"];
    let got = [&ds, &dh, &df, &dm, &dt, &dr, &dl];
    names
        .into_iter()
        .zip(got)
        .zip(&want)
        .map(|((name, d), w)| Ok(verdict(name, &cx.dev.download(d)? == w)))
        .collect()
}

/// The inputs of a draft case.
struct DraftInputs {
    mode: DraftMode,
    t: usize,
    /// `[seqs, DRAFT_HIST_CAP]`.
    hist: Vec<i32>,
    state: Vec<ChainSeq>,
    fault: Vec<i32>,
    /// `[seqs, table_cap]` in table mode, else one element.
    table: Vec<i32>,
}

fn draft_inputs(rng: &mut Rng, seqs: usize, t: usize, mode: DraftMode) -> DraftInputs {
    let hc = DRAFT_HIST_CAP;
    let table_cap = match mode {
        DraftMode::Table { table_cap } => table_cap,
        DraftMode::Ngram { .. } => 0,
    };
    // Everything past a row's length is noise the kernel must not read.
    let mut hist: Vec<i32> = (0..seqs * hc).map(|_| rng.below(0, VOCAB) as i32).collect();
    let (mut state, mut fault) = (Vec::with_capacity(seqs), vec![0; seqs]);
    for q in 0..seqs {
        let kind = if seqs < 8 { rng.below(0, 8) } else { q % 8 };
        let (len, alphabet) = match kind {
            0 => (0, 1),
            1 => (rng.below(1, 4), 2),
            2 => (rng.below(4, 3001), rng.below(2, 5)),
            3 => (rng.below(1000, 3001), 1000),
            4 => (rng.below(2, 40), 1),
            5 => (rng.below(4, 3001), VOCAB),
            6 => {
                fault[q] = FAULT_HISTORY;
                (rng.below(4, 100), 3)
            }
            _ => (rng.below(4, 3001), rng.below(3, 8)),
        };
        let row = &mut hist[q * hc..(q + 1) * hc];
        if alphabet == VOCAB {
            // Distinct tokens: no n-gram recurs, every n scans the whole row.
            row[..len].iter_mut().enumerate().for_each(|(i, v)| *v = i as i32);
        } else {
            let base = rng.below(0, VOCAB - alphabet);
            row[..len]
                .iter_mut()
                .for_each(|v| *v = (base + rng.below(0, alphabet)) as i32);
        }
        // Kind 7 half the time: a length outside the row (clamped by both).
        let hist_len = match kind {
            7 if rng.unit() < 0.25 => -2,
            7 if rng.unit() < 0.5 => (hc + 5) as i32,
            _ => len as i32,
        };
        state.push(ChainSeq {
            slot: q as i32,
            position: rng.below(0, 100_000) as i32,
            hist_len,
            ..ChainSeq::default()
        });
    }
    let table = if table_cap == 0 {
        vec![0]
    } else {
        (0..seqs * table_cap)
            .map(|_| {
                if rng.unit() < 0.1 {
                    -1
                } else {
                    rng.below(0, VOCAB) as i32
                }
            })
            .collect()
    };
    DraftInputs {
        mode,
        t,
        hist,
        state,
        fault,
        table,
    }
}

/// The twin's drafts and tokens, from sentinel-filled outputs.
fn draft_expected(x: &DraftInputs) -> (Vec<i32>, Vec<i32>) {
    let (t, seqs, hc) = (x.t, x.state.len(), DRAFT_HIST_CAP);
    let table_cap = x.table.len() / seqs;
    let mut drafts = vec![UNTOUCHED[0]; seqs * (t - 1)];
    let mut tokens = input_tokens(seqs, t);
    for q in (0..seqs).filter(|&q| x.fault[q] == 0) {
        let table_row = &x.table[q * table_cap..(q + 1) * table_cap];
        let d = propose(&x.hist[q * hc..(q + 1) * hc], x.state[q].hist_len, x.mode, table_row, t);
        for (i, &v) in d.iter().enumerate() {
            drafts[q * (t - 1) + i] = v as i32;
            tokens[q * t + 1 + i] = v as i32;
        }
    }
    (drafts, tokens)
}

/// The tokens buffer before a draft launch: each sequence's input token in row 0 (left alone), sentinels after it.
fn input_tokens(seqs: usize, t: usize) -> Vec<i32> {
    (0..seqs * t)
        .map(|r| if r % t == 0 { (r / t) as i32 } else { UNTOUCHED[1] })
        .collect()
}

fn chain_draft(cx: &Ctx, rng: &mut Rng, seqs: usize, t: usize, mode: DraftMode) -> Result<Vec<Check>> {
    let x = draft_inputs(rng, seqs, t, mode);
    let state: Vec<i32> = x.state.iter().flat_map(ChainSeq::encode).collect();
    let (dh, ds, df) = (
        cx.dev.upload(&x.hist)?,
        cx.dev.upload(&state)?,
        cx.dev.upload(&x.fault)?,
    );
    let db = cx.dev.upload(&x.table)?;
    let n = seqs * (t - 1);
    let mut dd = upload(cx, &vec![UNTOUCHED[0]; n])?;
    let mut dt = cx.dev.upload(&input_tokens(seqs, t))?;
    ops::chain_draft(
        cx.dev,
        &dh,
        &ds,
        &df,
        mode,
        &db,
        t,
        &mut dd.slice_mut(..n),
        &mut dt,
        seqs,
    )?;
    let (want_drafts, want_tokens) = draft_expected(&x);
    Ok(vec![
        verdict("drafts", cx.dev.download(&dd)?[..n] == want_drafts[..]),
        verdict("tokens", cx.dev.download(&dt)? == want_tokens),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::chain::{ngram_lookup, table_proposal, FAULT_SLOT};

    /// The advance cases reach what they say on the host side already: every fault bit, sequences that advance,
    /// a sticky fault left alone, and both outcomes of the step's flush and of the next step's.
    #[test]
    fn the_advance_inputs_reach_every_fault_and_both_flushes() {
        for seed in 1..6 {
            for (seqs, t, conv_cap) in [(37, 2, 6), (37, 5, 0), (256, 1, 4), (256, 5, 9)] {
                let x = advance_inputs(&mut Rng::new(seed), seqs, t, conv_cap);
                let [_, _, fault, meta, ..] = advance_expected(&x);
                let (mut bits, mut advanced, mut flush, mut next_flush) = (0, 0, [false; 2], [false; 2]);
                for q in 0..seqs {
                    if x.fault[q] != 0 {
                        assert_eq!(fault[q], x.fault[q], "a sticky fault stays as it was");
                        continue;
                    }
                    bits |= fault[q];
                    if fault[q] == 0 {
                        advanced += 1;
                        flush[x.p.flushes(x.state[q].form, x.state[q].ring_len as i64) as usize] = true;
                        next_flush[(meta[q * REPLAY_META + 4] != 0) as usize] = true;
                    }
                }
                let all = FAULT_VERDICT | FAULT_RING | FAULT_HISTORY | FAULT_FOLD | FAULT_SLOT;
                assert_eq!(bits, all, "seed {seed}, {seqs} × {t}: fault bits {bits:b}");
                assert!(advanced >= seqs / 4, "seed {seed}, {seqs} × {t}: {advanced} advanced");
                assert_eq!((flush, next_flush), ([true; 2], [true; 2]), "seed {seed}, {seqs} × {t}");
                assert!(x.fault.iter().any(|&f| f != 0));
            }
        }
    }

    /// The draft cases reach full n-gram proposals, short ones that need padding, histories with no recurring
    /// n-gram, skipped sequences, and tables that stop at a hole and at their end.
    #[test]
    fn the_draft_inputs_reach_every_outcome() {
        for seed in 1..6 {
            let mode = DraftMode::Ngram { min_n: 2, max_n: 4 };
            let x = draft_inputs(&mut Rng::new(seed), 256, 5, mode);
            let (mut full, mut short, mut none) = (0, 0, 0);
            for q in (0..256).filter(|&q| x.fault[q] == 0) {
                let len = x.state[q].hist_len.clamp(0, DRAFT_HIST_CAP as i32) as usize;
                let stream: Vec<u32> = x.hist[q * DRAFT_HIST_CAP..][..len].iter().map(|&v| v as u32).collect();
                match ngram_lookup(&stream, 2, 4, 4).len() {
                    4 => full += 1,
                    0 if len >= 3 => none += 1,
                    _ => short += 1,
                }
            }
            assert!(full > 0 && short > 0 && none > 0, "seed {seed}: {full} {short} {none}");
            assert!(x.fault.iter().any(|&f| f != 0));
            let (drafts, tokens) = draft_expected(&x);
            assert!(drafts.iter().all(|&d| d >= 0 || d == UNTOUCHED[0]));
            assert_eq!(tokens.len(), 256 * 5);

            let x = draft_inputs(&mut Rng::new(seed), 256, 5, DraftMode::Table { table_cap: 2000 });
            let (mut hole, mut end, mut whole) = (0, 0, 0);
            for q in (0..256).filter(|&q| x.fault[q] == 0) {
                let len = x.state[q].hist_len.clamp(0, DRAFT_HIST_CAP as i32) as usize;
                let row = &x.table[q * 2000..(q + 1) * 2000];
                match table_proposal(row, len, 4).len() {
                    4 => whole += 1,
                    k if len + k < 2000 => hole += 1,
                    _ => end += 1,
                }
            }
            assert!(hole > 0 && end > 0 && whole > 0, "seed {seed}: {hole} {end} {whole}");
        }
    }
}
