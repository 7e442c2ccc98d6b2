//! A speculative decode chain on the device: several verify steps back to back with no host round trip. The CPU
//! twins of `chain_advance` and `chain_draft` (`kernels/src/cuda/kernels/spec_chain.cu`).
//!
//! Each verify step feeds, per sequence, `t = T + 1` rows: the input token, then `T` drafts. After the step
//! `spec_accept` ([`super::accept::judge`]) gives each sequence a verdict `(a, y)`: `a` drafts accepted, `y` the
//! next token (−1: the verify failed). Then
//!
//! - [`advance`] moves the sequence's counters by the rules of the engine's `SlotCounters` (`after_step(Verify)`,
//!   `commit`, `decide(Verify)`), appends the committed tokens to its history and builds the next step's replay row
//!   (`ReplayRow::encode`'s 8 words), input token, row positions and KV length;
//! - [`propose`] proposes the next step's `T` drafts from the history: an n-gram lookup ([`ngram_lookup`], the one
//!   rule the engine's `NgramDrafter` runs too) or a table of known continuations ([`table_proposal`]), padded to
//!   `T` tokens ([`chain_drafts`]).
//!
//! Nothing the device cannot handle is left to chance: a sequence whose step cannot be advanced gets a sticky fault
//! bit and is left alone by every later link of the chain (nothing of it is written), and the host fails it after
//! reading the faults back.

/// `i32` words per sequence of the chain's state ([`ChainSeq::encode`]).
pub const CHAIN_STATE_WORDS: usize = 8;

/// The verdict failed the verify (`y < 0`), or accepted a count outside `0 ..= t − 1`.
pub const FAULT_VERDICT: i32 = 1;
/// The committed tokens do not fit the input ring (or a flush met a ring of no rows).
pub const FAULT_RING: i32 = 2;
/// The committed tokens do not fit the history row.
pub const FAULT_HISTORY: i32 = 4;
/// The next step would fold a kv-only ring (its committed context reached the threshold): the host's to do.
pub const FAULT_FOLD: i32 = 8;
/// The sequence's slot is outside the `lens` array (see [`advance_in`]).
pub const FAULT_SLOT: i32 = 16;

/// Form codes, as the engine's `DecodeForm`.
pub const FORM_RECURRENT: i32 = 0;
/// Checkpoint plus input ring.
pub const FORM_REPLAY: i32 = 1;
/// The ring alone (no state yet).
pub const FORM_KV_ONLY: i32 = 2;

/// One sequence's chain state, as stored in `i32 × CHAIN_STATE_WORDS`:
/// `[slot, position, ring_start, ring_len, ring_cap, conv_head, form, hist_len]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChainSeq {
    /// State, ring, conv and KV slot.
    pub slot: i32,
    /// Stream position of the step's row 0 (its input token).
    pub position: i32,
    /// Physical ring row of logical entry 0.
    pub ring_start: i32,
    /// Committed ring entries `h`.
    pub ring_len: i32,
    /// The slot's logical ring capacity.
    pub ring_cap: i32,
    /// Physical row of the oldest conv history row.
    pub conv_head: i32,
    /// [`FORM_RECURRENT`], [`FORM_REPLAY`] or [`FORM_KV_ONLY`].
    pub form: i32,
    /// Tokens in the sequence's history row: the stream so far, the step's input token included.
    pub hist_len: i32,
}

impl ChainSeq {
    /// The words the kernels read.
    pub fn encode(&self) -> [i32; CHAIN_STATE_WORDS] {
        [
            self.slot,
            self.position,
            self.ring_start,
            self.ring_len,
            self.ring_cap,
            self.conv_head,
            self.form,
            self.hist_len,
        ]
    }

    /// The state from its words (the first [`CHAIN_STATE_WORDS`] of `w`).
    pub fn decode(w: &[i32]) -> Self {
        ChainSeq {
            slot: w[0],
            position: w[1],
            ring_start: w[2],
            ring_len: w[3],
            ring_cap: w[4],
            conv_head: w[5],
            form: w[6],
            hist_len: w[7],
        }
    }
}

/// The chain's scalars, the same for every sequence of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainParams {
    /// Rows per sequence of a verify step (`T + 1`, at least 1).
    pub t: usize,
    /// The replay ring capacity `L`.
    pub ring_capacity: usize,
    /// The rank's largest verify window (`T` of `SlotCounters::decide`).
    pub window: usize,
    /// The kv-only threshold.
    pub threshold: usize,
    /// The conv ring's capacity (`K − 1 + T`; 0: no conv history).
    pub conv_cap: usize,
    /// The history row's stride (its capacity in tokens).
    pub hist_cap: usize,
}

impl ChainParams {
    /// Whether a step of `t` rows in `form` over `h` committed entries flushes (`SlotCounters::decide(Verify)`,
    /// one window early): `form` replay and `h + t + max(window, t) > L`.
    pub fn flushes(&self, form: i32, h: i64) -> bool {
        let t = self.t as i64;
        form == FORM_REPLAY && h + t + (self.window as i64).max(t) > self.ring_capacity as i64
    }
}

/// What [`advance`] gives the next step of a sequence; its row positions are `position + i` for `i` in `0 .. t`
/// (the advanced [`ChainSeq::position`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Next {
    /// The next step's replay row (`ReplayRow::encode`'s words):
    /// `[slot, ring_start, h, ring_cap, fold (h when it flushes, else 0), read_state (form ≠ kv-only), conv_head, 0]`.
    pub meta: [i32; 8],
    /// The next step's input token (the verdict's `y`).
    pub token: i32,
    /// The slot's KV length after the next step's rows: `position + t`.
    pub lens: i32,
}

/// [`advance`] with the kernel's first check: a slot outside `0 .. slots` (the length of the `lens` array) sets
/// [`FAULT_SLOT`]. This is the whole rule `chain_advance` applies per sequence.
pub fn advance_in(
    slots: usize,
    seq: &mut ChainSeq,
    fault: &mut i32,
    verdict: (i32, i32),
    drafts: &[i32],
    hist: &mut [i32],
    p: &ChainParams,
) -> Option<Next> {
    if *fault != 0 {
        return None;
    }
    if seq.slot < 0 || seq.slot as i64 >= slots as i64 {
        *fault |= FAULT_SLOT;
        return None;
    }
    advance(seq, fault, verdict, drafts, hist, p)
}

/// Advances one sequence past its verify step, whose verdict is `(a, y)` and whose drafts were `drafts`
/// (`t − 1` of them); `hist` is the sequence's history row (`hist_cap` tokens). Nothing happens when `fault` is
/// already set. Otherwise, in order (each failing check sets its bit in `fault` and changes nothing else):
///
/// 1. `y < 0`, or `a` outside `0 ..= t − 1`: [`FAULT_VERDICT`].
/// 2. The step's own flush (the rule the host built it with, [`ChainParams::flushes`]) folded the `h` committed
///    entries: `ring_start = (ring_start + h) % ring_cap`, `ring_len = 0` (a ring of no rows: [`FAULT_RING`]).
/// 3. `n = a + 1` tokens are committed: a replay or kv-only ring keeps them (past `ring_cap`: [`FAULT_RING`]); the
///    conv head moves by `n` modulo `conv_cap` (unchanged when it is 0).
/// 4. The history gets `d_1 … d_a`, then `y` (past `hist_cap`: [`FAULT_HISTORY`]); the position moves by `n`.
/// 5. The next step would compress a kv-only ring (`ring_len ≥ threshold`): [`FAULT_FOLD`], the host's to plan.
///
/// Then the state and history are written and the next step's inputs returned.
pub fn advance(
    seq: &mut ChainSeq,
    fault: &mut i32,
    verdict: (i32, i32),
    drafts: &[i32],
    hist: &mut [i32],
    p: &ChainParams,
) -> Option<Next> {
    if *fault != 0 {
        return None;
    }
    let (a, y) = verdict;
    let t = p.t as i64;
    if y < 0 || a < 0 || a as i64 > t - 1 {
        *fault |= FAULT_VERDICT;
        return None;
    }
    let mut s = *seq;
    let (mut ring_start, mut ring_len) = (s.ring_start as i64, s.ring_len as i64);
    let ring_cap = s.ring_cap as i64;
    if p.flushes(s.form, ring_len) {
        if ring_cap <= 0 {
            *fault |= FAULT_RING;
            return None;
        }
        ring_start = (ring_start + ring_len) % ring_cap;
        ring_len = 0;
    }
    let n = a as i64 + 1;
    if s.form != FORM_RECURRENT {
        if ring_len + n > ring_cap {
            *fault |= FAULT_RING;
            return None;
        }
        ring_len += n;
    }
    let conv_cap = p.conv_cap as i64;
    let conv_head = if conv_cap > 0 {
        (s.conv_head as i64 + n) % conv_cap
    } else {
        s.conv_head as i64
    };
    let hist_len = s.hist_len as i64;
    if hist_len < 0 || hist_len + n > p.hist_cap as i64 {
        *fault |= FAULT_HISTORY;
        return None;
    }
    if s.form == FORM_KV_ONLY && ring_len >= p.threshold as i64 {
        *fault |= FAULT_FOLD;
        return None;
    }
    // Every check passed: write.
    let at = hist_len as usize;
    hist[at..at + a as usize].copy_from_slice(&drafts[..a as usize]);
    hist[at + a as usize] = y;
    s.ring_start = ring_start as i32;
    s.ring_len = ring_len as i32;
    s.conv_head = conv_head as i32;
    s.hist_len = (hist_len + n) as i32;
    s.position = s.position.wrapping_add(n as i32);
    *seq = s;
    let fold = if p.flushes(s.form, ring_len) { s.ring_len } else { 0 };
    Some(Next {
        meta: [
            s.slot,
            s.ring_start,
            s.ring_len,
            s.ring_cap,
            fold,
            (s.form != FORM_KV_ONLY) as i32,
            s.conv_head,
            0,
        ],
        token: y,
        lens: s.position.wrapping_add(p.t as i32),
    })
}

/// Up to `max` tokens that followed the latest earlier occurrence of `tokens`' last n-gram (prompt lookup): the
/// longest `n` first, from `min(max_n, len − 1)` down to `min_n` (at least 1); for each, the latest start `< len − n`
/// whose `n` tokens equal the tail (a match may overlap the tail: a repeating run); the continuation is
/// `tokens[start + n .. min(start + n + max, len)]`. Empty when no n-gram recurs.
pub fn ngram_lookup(tokens: &[u32], min_n: usize, max_n: usize, max: usize) -> Vec<u32> {
    let len = tokens.len();
    for n in (min_n.max(1)..=max_n.min(len.saturating_sub(1))).rev() {
        let tail = &tokens[len - n..];
        if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == tail) {
            let from = start + n;
            return tokens[from..(from + max).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// The table's proposal for a sequence whose history holds `hist_len` tokens: `table_row[hist_len + i]` for `i` in
/// `0 .. max`, up to the row's end and stopping at the first negative entry (−1: unknown).
pub fn table_proposal(table_row: &[i32], hist_len: usize, max: usize) -> Vec<u32> {
    table_row
        .iter()
        .skip(hist_len)
        .take(max)
        .take_while(|&&v| v >= 0)
        .map(|&v| v as u32)
        .collect()
}

/// Exactly `count` drafts from a proposal: its first `count` tokens, padded with the last token of
/// `stream ++ proposed` (0 when both are empty).
pub fn chain_drafts(stream: &[u32], mut proposed: Vec<u32>, count: usize) -> Vec<u32> {
    proposed.truncate(count);
    let pad = proposed.last().or(stream.last()).copied().unwrap_or(0);
    proposed.resize(count, pad);
    proposed
}

/// Where a chain's drafts come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftMode {
    /// Prompt lookup over the history ([`ngram_lookup`]) with matches of `min_n ..= max_n` tokens.
    Ngram { min_n: usize, max_n: usize },
    /// A table of known continuations, `[seqs, table_cap]` indexed by stream position ([`table_proposal`]).
    Table { table_cap: usize },
}

/// The `t − 1` drafts `chain_draft` proposes for a sequence with history row `hist` (its first `hist_len` tokens
/// are the stream; a length outside `0 ..= hist.len()` is clamped into it) and, in table mode, table row
/// `table_row`.
pub fn propose(hist: &[i32], hist_len: i32, mode: DraftMode, table_row: &[i32], t: usize) -> Vec<u32> {
    let count = t.saturating_sub(1);
    let len = hist_len.clamp(0, hist.len().min(i32::MAX as usize) as i32) as usize;
    let stream: Vec<u32> = hist[..len].iter().map(|&v| v as u32).collect();
    let proposed = match mode {
        DraftMode::Ngram { min_n, max_n } => ngram_lookup(&stream, min_n, max_n, count),
        DraftMode::Table { .. } => table_proposal(table_row, len, count),
    };
    chain_drafts(&stream, proposed, count)
}

/// `u32` words per sequence of a chain's sampling parameters ([`ChainSample::encode`]).
pub const CHAIN_SAMPLE_WORDS: usize = 6;

/// A sequence's sampled judging in a chain: the temperature and noise key of its verifies' one-pass summaries
/// ([`super::lm_head::SpecRequest`]). The output index of the token a step's row 0 predicts moves with the stream:
/// it is `offset + position` (wrapping), `position` that of the step's input token, so the device derives every
/// later step's key from the chain state alone.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChainSample {
    /// > 0 and finite.
    pub temperature: f32,
    pub seed: u64,
    pub offset: u64,
}

impl ChainSample {
    /// The sampling of a chain whose first step has its input token at `position` and row 0 predicting output
    /// index `index`.
    pub fn at(temperature: f32, seed: u64, index: u64, position: usize) -> Self {
        ChainSample {
            temperature,
            seed,
            offset: index.wrapping_sub(position as u64),
        }
    }

    /// The words `chain_spec` reads (`None`: a greedy sequence):
    /// `[sampled, bits of 1 / temperature, seed lo, seed hi, offset lo, offset hi]`.
    pub fn encode(s: Option<&ChainSample>) -> [u32; CHAIN_SAMPLE_WORDS] {
        match s {
            None => [0; CHAIN_SAMPLE_WORDS],
            Some(s) => [
                1,
                (1.0 / s.temperature).to_bits(),
                s.seed as u32,
                (s.seed >> 32) as u32,
                s.offset as u32,
                (s.offset >> 32) as u32,
            ],
        }
    }
}

/// The twin of `chain_spec`: the one-pass requests of a sequence's next step, whose chain state holds `position`
/// and whose rows hold `tokens` (`t` of them, input token first), and its judging key `(seed, index of row 0)`.
/// Row `i` asks about draft `tokens[i + 1]` (none for the last row, nor for a negative token) at output index
/// `offset + position + i`. A greedy sequence (`None`) asks nothing and is judged greedily.
#[allow(clippy::type_complexity)]
pub fn spec_requests(
    sample: Option<&ChainSample>,
    position: i32,
    tokens: &[i32],
) -> (Vec<Option<super::lm_head::SpecRequest>>, Option<(u64, u64)>) {
    let Some(s) = sample else {
        return (vec![None; tokens.len()], None);
    };
    let first = s.offset.wrapping_add(u64::from(position as u32));
    let rows = (0..tokens.len())
        .map(|i| {
            Some(super::lm_head::SpecRequest {
                draft: tokens.get(i + 1).and_then(|&d| u32::try_from(d).ok()),
                temperature: s.temperature,
                seed: s.seed,
                index: first.wrapping_add(i as u64),
            })
        })
        .collect();
    (rows, Some((s.seed, first)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: usize) -> ChainParams {
        ChainParams {
            t,
            ring_capacity: 16,
            window: 4,
            threshold: 6,
            conv_cap: 7,
            hist_cap: 12,
        }
    }

    fn seq(form: i32, ring_start: i32, ring_len: i32, ring_cap: i32, hist_len: i32) -> ChainSeq {
        ChainSeq {
            slot: 3,
            position: 40,
            ring_start,
            ring_len,
            ring_cap,
            conv_head: 5,
            form,
            hist_len,
        }
    }

    #[test]
    fn state_words_round_trip() {
        let s = seq(FORM_KV_ONLY, 1, 2, 3, 4);
        assert_eq!(ChainSeq::decode(&s.encode()), s);
        assert_eq!(s.encode(), [3, 40, 1, 2, 3, 5, 2, 4]);
    }

    #[test]
    fn replay_flushes_wraps_and_builds_the_next_row() {
        // L = 16, window 4, t = 5: h = 7 flushes (7 + 5 + 5 > 16), h = 6 does not.
        let p = params(5);
        let mut hist = vec![-1; 12];
        hist[..3].copy_from_slice(&[10, 11, 12]);
        let (mut s, mut fault) = (seq(FORM_REPLAY, 13, 7, 16, 3), 0);
        let next = advance(&mut s, &mut fault, (2, 99), &[20, 21, 22, 23], &mut hist, &p).expect("advances");
        // Flush: start (13 + 7) % 16 = 4, then 3 committed; conv (5 + 3) % 7 = 1.
        assert_eq!(
            (s.ring_start, s.ring_len, s.conv_head, s.position, s.hist_len),
            (4, 3, 1, 43, 6)
        );
        assert_eq!(&hist[..7], &[10, 11, 12, 20, 21, 99, -1]);
        assert_eq!(fault, 0);
        assert_eq!(next.meta, [3, 4, 3, 16, 0, 1, 1, 0], "3 + 5 + 5 ≤ 16: no flush next");
        assert_eq!((next.token, next.lens), (99, 48));
        // Without the step's flush, the next step's own: 6 + 5 = 11 committed.
        let (mut s, mut hist) = (seq(FORM_REPLAY, 2, 6, 16, 0), vec![0; 12]);
        let next = advance(&mut s, &mut fault, (4, 7), &[1, 2, 3, 4], &mut hist, &p).expect("advances");
        assert_eq!((s.ring_start, s.ring_len), (2, 11));
        assert_eq!(next.meta[4], 11, "11 + 5 + 5 > 16: the next step folds all 11");
        assert_eq!(&hist[..5], &[1, 2, 3, 4, 7]);
    }

    #[test]
    fn kv_only_recurrent_and_no_conv() {
        let p = ChainParams {
            conv_cap: 0,
            ..params(3)
        };
        let mut hist = vec![0; 12];
        // Kv-only: the ring keeps the tokens and never flushes; read_state 0.
        let (mut s, mut fault) = (seq(FORM_KV_ONLY, 0, 2, 8, 1), 0);
        let next = advance(&mut s, &mut fault, (1, 5), &[4, 6], &mut hist, &p).expect("advances");
        assert_eq!((s.ring_len, s.conv_head, next.meta[4], next.meta[5]), (4, 5, 0, 0));
        // Reaching the threshold faults: the chain cannot fold.
        let next = advance(&mut s, &mut fault, (1, 5), &[4, 6], &mut hist, &p);
        assert_eq!((next, fault, s.ring_len), (None, FAULT_FOLD, 4), "state untouched");
        assert_eq!(&hist[1..6], &[4, 5, 0, 0, 0], "history untouched");
        // Sticky: nothing more happens.
        assert_eq!(advance(&mut s, &mut fault, (0, 1), &[4, 6], &mut hist, &p), None);
        assert_eq!(fault, FAULT_FOLD);
        // Recurrent: the ring stays as it is, even far past L.
        let (mut s, mut fault) = (seq(FORM_RECURRENT, 3, 40, 16, 0), 0);
        let next = advance(&mut s, &mut fault, (2, 8), &[1, 2], &mut hist, &p).expect("advances");
        assert_eq!((s.ring_start, s.ring_len, next.meta[4], next.meta[5]), (3, 40, 0, 1));
    }

    #[test]
    fn every_fault_leaves_the_sequence_alone() {
        let p = params(3);
        let cases: [(ChainSeq, (i32, i32), usize, i32); 7] = [
            (seq(FORM_REPLAY, 0, 0, 16, 0), (1, -1), 8, FAULT_VERDICT),
            (seq(FORM_REPLAY, 0, 0, 16, 0), (3, 1), 8, FAULT_VERDICT),
            (seq(FORM_REPLAY, 0, 0, 16, 0), (-1, 1), 8, FAULT_VERDICT),
            (seq(FORM_KV_ONLY, 0, 4, 5, 0), (1, 1), 8, FAULT_RING),
            (seq(FORM_REPLAY, 0, 12, 0, 0), (1, 1), 8, FAULT_RING),
            (seq(FORM_RECURRENT, 0, 0, 16, 11), (1, 1), 8, FAULT_HISTORY),
            (seq(FORM_RECURRENT, 0, 0, 16, 0), (1, 1), 3, FAULT_SLOT),
        ];
        for (s0, verdict, slots, bit) in cases {
            let (mut s, mut fault, mut hist) = (s0, 0, vec![-5; 12]);
            assert_eq!(
                advance_in(slots, &mut s, &mut fault, verdict, &[1, 2], &mut hist, &p),
                None
            );
            assert_eq!((fault, s), (bit, s0), "{s0:?} {verdict:?}");
            assert!(hist.iter().all(|&v| v == -5));
        }
        let (mut s, mut fault, mut hist) = (seq(FORM_REPLAY, 0, 0, 16, 0), FAULT_HISTORY, vec![0; 12]);
        assert_eq!(advance_in(8, &mut s, &mut fault, (1, 1), &[1, 2], &mut hist, &p), None);
        assert_eq!(fault, FAULT_HISTORY, "a set fault is sticky");
    }

    #[test]
    fn ngram_lookup_takes_the_latest_longest_match() {
        let s = [1, 2, 3, 4, 5, 3, 9, 7, 1, 2, 3];
        assert_eq!(
            ngram_lookup(&s, 1, 3, 2),
            [4, 5],
            "the 3-gram match wins over the later 1-gram"
        );
        assert_eq!(
            ngram_lookup(&s, 1, 3, 10),
            [4, 5, 3, 9, 7, 1, 2, 3],
            "bounded by the stream"
        );
        assert_eq!(ngram_lookup(&s, 1, 1, 2), [9, 7], "the latest 1-gram match");
        assert!(ngram_lookup(&[1, 2, 3], 1, 3, 4).is_empty());
        assert!(ngram_lookup(&[5], 1, 3, 4).is_empty());
        assert!(ngram_lookup(&[], 1, 3, 4).is_empty());
        assert_eq!(
            ngram_lookup(&[7, 7, 7], 2, 2, 3),
            [7],
            "a repeating run overlaps its tail"
        );
        assert_eq!(
            ngram_lookup(&[7, 7, 7, 7], 1, 1, 3),
            [7],
            "the latest start's continuation"
        );
        assert!(ngram_lookup(&s, 4, 6, 2).is_empty(), "no 4-gram recurs");
        assert_eq!(ngram_lookup(&s, 0, 1, 1), [9], "min_n 0 is 1");
    }

    #[test]
    fn drafts_pad_with_the_last_token_and_tables_stop_at_holes() {
        assert_eq!(chain_drafts(&[1, 2], vec![5], 3), [5, 5, 5]);
        assert_eq!(chain_drafts(&[1, 2], vec![], 2), [2, 2]);
        assert_eq!(chain_drafts(&[], vec![], 2), [0, 0]);
        assert_eq!(chain_drafts(&[1], vec![4, 5, 6], 2), [4, 5]);
        assert!(chain_drafts(&[1], vec![4], 0).is_empty());
        let table = [9, 9, 30, 31, -1, 33];
        assert_eq!(table_proposal(&table, 2, 4), [30, 31]);
        assert_eq!(table_proposal(&table, 2, 1), [30]);
        assert_eq!(table_proposal(&table, 5, 4), [33], "the row's end");
        assert!(table_proposal(&table, 9, 4).is_empty());
        let hist = [1, 2, 3, 1, 2, -7];
        let ngram = DraftMode::Ngram { min_n: 1, max_n: 3 };
        assert_eq!(propose(&hist, 5, ngram, &[], 4), [3, 1, 2]);
        assert_eq!(propose(&hist, 3, ngram, &[], 4), [3, 3, 3], "no match: the last token");
        assert_eq!(propose(&hist, 0, ngram, &[], 3), [0, 0]);
        assert_eq!(propose(&hist, 5, ngram, &[], 1), Vec::<u32>::new());
        let tab = DraftMode::Table { table_cap: 6 };
        assert_eq!(propose(&hist, 2, tab, &table, 4), [30, 31, 31]);
        assert_eq!(
            propose(&hist, 4, tab, &table, 3),
            [1, 1],
            "a hole first: the stream's last"
        );
        assert_eq!(
            propose(&hist, 60, ngram, &[], 2),
            [-7i32 as u32],
            "the length is clamped to the row"
        );
    }

    #[test]
    fn a_sampled_chain_keys_its_rows_by_position() {
        let s = ChainSample::at(0.5, 9, 30, 100);
        let (rows, key) = spec_requests(Some(&s), 104, &[5, 6, -1, 8]);
        assert_eq!(key, Some((9, 34)), "four tokens later, four indices later");
        let got: Vec<(Option<u32>, u64)> = rows
            .iter()
            .map(|r| r.map_or((None, 0), |r| (r.draft, r.index)))
            .collect();
        assert_eq!(got, [(Some(6), 34), (None, 35), (Some(8), 36), (None, 37)]);
        assert!(rows
            .iter()
            .all(|r| r.is_some_and(|r| r.temperature == 0.5 && r.seed == 9)));
        let wraps = ChainSample::at(1.0, 1, 0, 5);
        assert_eq!(
            spec_requests(Some(&wraps), 5, &[1]).1,
            Some((1, 0)),
            "offsets wrap back"
        );
        assert_eq!(spec_requests(None, 3, &[1, 2]), (vec![None, None], None), "greedy");
        assert_eq!(ChainSample::encode(None), [0; CHAIN_SAMPLE_WORDS]);
        assert_eq!(ChainSample::encode(Some(&s))[..2], [1, 2.0f32.to_bits()]);
    }
}
