//! One-pass LM-head summaries (FlashSpec): the head's logits are produced a vocabulary tile at a time and folded into
//! a per-row summary — the argmax and its logit, the log-sum-exp, and for a speculative row the drafted token's
//! scaled logit and a Gumbel-max candidate — so nothing of the vocabulary's size is ever written per row. The partial
//! summaries of tiles (and of tensor-parallel ranks' vocabulary slices) merge with [`RowPass::merge`], which is
//! associative, so a vocabulary split any way gives the same tokens.
//!
//! The Gumbel noise is a pure function of `(seed, index, token id)` ([`gumbel`]), so a device kernel, a rank holding
//! any slice, and a re-run after a fault all draw the same candidate.

use rayon::prelude::*;

use super::gemm::matmul_nt;

/// Vocabulary ids per tile: small enough that a tile's logits for a verify's rows stay in cache.
pub const TILE: usize = 512;

/// What a speculative row asks of the pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpecRequest {
    /// The token drafted for this row's position (`None` for the bonus row, which has no draft).
    pub draft: Option<u32>,
    /// Sampling temperature (> 0): scores are `logit / temperature`.
    pub temperature: f32,
    /// The request's seed and this row's token index in its output stream: the Gumbel noise's key.
    pub seed: u64,
    pub index: u64,
}

/// The speculative part of a row's summary, over the ids the pass saw.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SpecSummary {
    /// `log Σ exp(logit / temperature)`.
    pub lse: f32,
    /// `logit(draft) / temperature`, when the ids seen hold the draft.
    pub drafted: Option<f32>,
    /// The Gumbel-max candidate among the ids seen except the draft: `argmax logit / temperature + gumbel`, the
    /// lowest id on ties; `score` is −∞ when no id qualified.
    pub candidate: u32,
    pub score: f32,
}

/// A row's summary over the ids a pass saw: what every backend reports per row (over its vocabulary slice), and,
/// merged over the slices, the whole vocabulary's answer the coordinator reads. The one row summary of the project.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RowPass {
    /// The lowest id among the largest logits, and that logit (NaN when the row held a NaN).
    pub argmax: u32,
    pub max: f32,
    /// `log Σ exp(logit)`.
    pub lse: f32,
    pub spec: Option<SpecSummary>,
    /// The log-probability part, when the row asked for it ([`LogprobRequest`]).
    pub logprob: Option<LogprobSummary>,
}

/// The most top entries a row may ask for (OpenAI's `top_logprobs` limit).
pub const MAX_TOP: usize = 20;

/// What a row asks of the pass for log-probabilities: its `top` largest logits (0 ..= [`MAX_TOP`]) and the logit of
/// `target` (the next prompt token of a prompt row; `None` for a generated row, whose pick the sampler or the argmax
/// gives).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogprobRequest {
    pub top: usize,
    pub target: Option<u32>,
}

/// The `k` largest logits of the ids seen, largest first, ties to the lower id; NaNs are never entries (a NaN row is
/// poisoned anyway). Inline and `Copy`, so a row summary stays a plain value.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TopK {
    k: u8,
    len: u8,
    ids: [u32; MAX_TOP],
    logits: [f32; MAX_TOP],
}

impl TopK {
    /// An empty list keeping the `k` best (`k` is capped at [`MAX_TOP`]).
    pub fn new(k: usize) -> Self {
        TopK {
            k: k.min(MAX_TOP) as u8,
            len: 0,
            ids: [0; MAX_TOP],
            logits: [f32::NEG_INFINITY; MAX_TOP],
        }
    }

    /// How many entries the list keeps at most.
    pub fn k(&self) -> usize {
        usize::from(self.k)
    }

    /// The entries, best first: `(id, logit)`.
    pub fn entries(&self) -> impl Iterator<Item = (u32, f32)> + '_ {
        let n = usize::from(self.len);
        self.ids[..n].iter().copied().zip(self.logits[..n].iter().copied())
    }

    /// Whether `(id, logit)` ranks before entry `i`.
    fn beats(&self, id: u32, logit: f32, i: usize) -> bool {
        logit > self.logits[i] || (logit == self.logits[i] && id < self.ids[i])
    }

    /// Offers one id; kept when it is among the `k` best seen.
    pub fn push(&mut self, id: u32, logit: f32) {
        let (k, len) = (usize::from(self.k), usize::from(self.len));
        if logit.is_nan() || k == 0 || (len == k && !self.beats(id, logit, len - 1)) {
            return;
        }
        let mut at = len.min(k - 1);
        while at > 0 && self.beats(id, logit, at - 1) {
            self.ids[at] = self.ids[at - 1];
            self.logits[at] = self.logits[at - 1];
            at -= 1;
        }
        self.ids[at] = id;
        self.logits[at] = logit;
        self.len = (len + 1).min(k) as u8;
    }

    /// The best of two lists over disjoint id sets (keeping the larger `k`).
    pub fn merge(self, o: TopK) -> TopK {
        let mut out = TopK::new(self.k().max(o.k()));
        for (id, logit) in self.entries().chain(o.entries()) {
            out.push(id, logit);
        }
        out
    }
}

/// The log-probability part of a row's summary over the ids seen: the top entries and, when the ids seen held the
/// requested target, its logit.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LogprobSummary {
    pub top: TopK,
    pub target: Option<(u32, f32)>,
}

impl LogprobSummary {
    fn empty(r: &LogprobRequest) -> Self {
        LogprobSummary {
            top: TopK::new(r.top),
            target: None,
        }
    }

    /// Merges the summaries of two disjoint id sets.
    pub fn merge(self, o: LogprobSummary) -> LogprobSummary {
        LogprobSummary {
            top: self.top.merge(o.top),
            target: self.target.or(o.target),
        }
    }
}

fn lse_merge(a: f32, b: f32) -> f32 {
    if a == f32::NEG_INFINITY {
        return b;
    }
    if b == f32::NEG_INFINITY {
        return a;
    }
    let m = a.max(b);
    if !m.is_finite() {
        return m;
    }
    m + ((a - m).exp() + (b - m).exp()).ln()
}

impl SpecSummary {
    fn empty() -> Self {
        SpecSummary {
            lse: f32::NEG_INFINITY,
            drafted: None,
            candidate: 0,
            score: f32::NEG_INFINITY,
        }
    }

    /// Merges the summaries of two disjoint id sets.
    pub fn merge(self, o: SpecSummary) -> SpecSummary {
        let take_o = o.score > self.score || (o.score == self.score && o.candidate < self.candidate);
        SpecSummary {
            lse: lse_merge(self.lse, o.lse),
            drafted: self.drafted.or(o.drafted),
            candidate: if take_o { o.candidate } else { self.candidate },
            score: if take_o { o.score } else { self.score },
        }
    }
}

impl RowPass {
    fn empty(spec: bool, logprob: Option<&LogprobRequest>) -> Self {
        RowPass {
            argmax: 0,
            max: f32::NEG_INFINITY,
            lse: f32::NEG_INFINITY,
            spec: spec.then(SpecSummary::empty),
            logprob: logprob.map(LogprobSummary::empty),
        }
    }

    /// The raw logit of `id` as far as this (whole-vocabulary) summary knows it: the target's, the argmax's or a top
    /// entry's; `None` when the summary holds no value for `id`.
    pub fn logit_of(&self, id: u32) -> Option<f32> {
        let lp = self.logprob.as_ref();
        lp.and_then(|l| l.target)
            .filter(|&(t, _)| t == id)
            .map(|(_, v)| v)
            .or_else(|| (id == self.argmax && !self.max.is_nan()).then_some(self.max))
            .or_else(|| lp.and_then(|l| l.top.entries().find(|&(t, _)| t == id)).map(|(_, v)| v))
    }

    /// Whether the row held a NaN (or an infinity) among the ids seen.
    pub fn poisoned(&self) -> bool {
        !self.max.is_finite()
    }

    /// Merges the summaries of two disjoint id sets (a NaN in either stays a NaN maximum).
    pub fn merge(self, o: RowPass) -> RowPass {
        let nan = self.max.is_nan() || o.max.is_nan();
        let take_o = o.max > self.max || (o.max == self.max && o.argmax < self.argmax) || self.max.is_nan();
        let (argmax, max) = if take_o {
            (o.argmax, o.max)
        } else {
            (self.argmax, self.max)
        };
        RowPass {
            argmax,
            max: if nan { f32::NAN } else { max },
            lse: if nan { f32::NAN } else { lse_merge(self.lse, o.lse) },
            spec: match (self.spec, o.spec) {
                (Some(a), Some(b)) => Some(a.merge(b)),
                (a, b) => a.or(b),
            },
            logprob: match (self.logprob, o.logprob) {
                (Some(a), Some(b)) => Some(a.merge(b)),
                (a, b) => a.or(b),
            },
        }
    }

    /// Folds logits `row` of ids `first_id..` into this summary.
    fn fold(&mut self, row: &[f32], first_id: u32, spec: Option<&SpecRequest>, logprob: Option<&LogprobRequest>) {
        let mut max = f32::NEG_INFINITY;
        let mut arg = 0usize;
        let mut nan = false;
        for (i, &v) in row.iter().enumerate() {
            nan |= v.is_nan();
            if v > max {
                (max, arg) = (v, i);
            }
        }
        let lse = if nan {
            f32::NAN
        } else if max.is_finite() {
            max + row.iter().map(|v| (v - max).exp()).sum::<f32>().ln()
        } else {
            max
        };
        let mut part = RowPass {
            argmax: first_id + arg as u32,
            max: if nan { f32::NAN } else { max },
            lse,
            spec: None,
            logprob: None,
        };
        if let Some(r) = logprob {
            let mut l = LogprobSummary::empty(r);
            for (i, &v) in row.iter().enumerate() {
                l.top.push(first_id + i as u32, v);
            }
            l.target = r
                .target
                .and_then(|t| t.checked_sub(first_id))
                .and_then(|i| row.get(i as usize).map(|&v| (first_id + i, v)));
            part.logprob = Some(l);
        }
        if let Some(r) = spec {
            let inv = 1.0 / r.temperature;
            let smax = max * inv;
            let mut s = SpecSummary::empty();
            s.lse = if smax.is_finite() {
                smax + row.iter().map(|v| (v * inv - smax).exp()).sum::<f32>().ln()
            } else {
                smax
            };
            for (i, &v) in row.iter().enumerate() {
                let id = first_id + i as u32;
                if Some(id) == r.draft {
                    s.drafted = Some(v * inv);
                    continue;
                }
                let score = v * inv + gumbel(r.seed, r.index, id);
                if score > s.score {
                    (s.candidate, s.score) = (id, score);
                }
            }
            part.spec = Some(s);
        }
        *self = self.merge(part);
    }
}

/// The summary of one whole logit row (ids `first_id ..`): the reference the device kernels are checked against.
pub fn summarise_logits(row: &[f32], first_id: u32, spec: Option<&SpecRequest>) -> RowPass {
    summarise_logits_with(row, first_id, spec, None)
}

/// [`summarise_logits`] with the log-probability part `logprob` asks for.
pub fn summarise_logits_with(
    row: &[f32],
    first_id: u32,
    spec: Option<&SpecRequest>,
    logprob: Option<&LogprobRequest>,
) -> RowPass {
    let mut out = RowPass::empty(spec.is_some(), logprob);
    out.fold(row, first_id, spec, logprob);
    out
}

/// SplitMix64's finaliser: a bijective 64-bit mix (the device kernel computes the same integer ops).
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A uniform in the open interval (0, 1), a pure function of `(seed, index, id)`.
pub fn uniform_at(seed: u64, index: u64, id: u32) -> f32 {
    uniform_of_bits(mix64(
        mix64(seed ^ mix64(index.wrapping_add(0x9e37_79b9_7f4a_7c15))) ^ u64::from(id),
    ))
}

/// The uniform a hash's top 23 bits give, centred in their cell: every value `(k + ½) / 2²³` is exact in f32, so
/// neither 0 nor 1 can come out (with 24 bits the top cell's centre rounds up to 1, and `−ln(−ln 1)` is +∞).
pub fn uniform_of_bits(h: u64) -> f32 {
    ((h >> 41) as f32 + 0.5) * (1.0 / 8_388_608.0)
}

/// Standard Gumbel noise `−ln(−ln u)` for `(seed, index, id)`.
pub fn gumbel(seed: u64, index: u64, id: u32) -> f32 {
    -(-uniform_at(seed, index, id).ln()).ln()
}

/// Bytes a device kernel writes per row summary: argmax, max and LSE, plus for a speculative row its LSE, drafted
/// logit, candidate and score (4 bytes each).
pub const SUMMARY_BYTES: u64 = 12;
pub const SPEC_SUMMARY_BYTES: u64 = 16;

/// The bytes a head pass over `rows` rows moves on a device: the head slice `[n, hidden]` (bf16) and the rows
/// (bf16) read once, and per row only its summary written — nothing proportional to `n`.
pub fn head_pass_traffic(rows: usize, hidden: usize, n: usize, spec_rows: usize) -> super::traffic::Traffic {
    use super::traffic::Traffic;
    Traffic {
        inputs: Traffic::bf16s(n * hidden) + Traffic::bf16s(rows * hidden),
        outputs: rows as u64 * SUMMARY_BYTES + spec_rows as u64 * SPEC_SUMMARY_BYTES,
        ..Traffic::default()
    }
}

/// The bytes the plain head moves for `rows` rows: the same reads, and every logit written (f32).
pub fn head_logits_traffic(rows: usize, hidden: usize, n: usize) -> super::traffic::Traffic {
    use super::traffic::Traffic;
    Traffic {
        inputs: Traffic::bf16s(n * hidden) + Traffic::bf16s(rows * hidden),
        outputs: Traffic::f32s(rows * n),
        ..Traffic::default()
    }
}

/// Summaries of `rows` rows of `x` `[rows, hidden]` (already normed) through a head slice `weight` `[n, hidden]`
/// whose first id is `first_id`, one vocabulary tile at a time (tiles in parallel, merged in id order); `spec[r]`
/// asks for row `r`'s speculative summary. Nothing of size `n` is kept per row.
pub fn head_pass(
    x: &[f32],
    weight: &[f32],
    hidden: usize,
    first_id: u32,
    spec: &[Option<SpecRequest>],
) -> Vec<RowPass> {
    head_pass_with(x, weight, hidden, first_id, spec, &[])
}

/// [`head_pass`] with per-row log-probability requests: `logprob[r]` (absent past its end: none) asks row `r` for
/// its top entries and a target's logit. Rows that ask for none pay nothing for it.
pub fn head_pass_with(
    x: &[f32],
    weight: &[f32],
    hidden: usize,
    first_id: u32,
    spec: &[Option<SpecRequest>],
    logprob: &[Option<LogprobRequest>],
) -> Vec<RowPass> {
    let rows = spec.len();
    assert_eq!(x.len(), rows * hidden, "head_pass: x");
    assert!(hidden > 0 && weight.len().is_multiple_of(hidden), "head_pass: weight");
    let n = weight.len() / hidden;
    let lp = |r: usize| logprob.get(r).and_then(Option::as_ref);
    let empty = || {
        spec.iter()
            .enumerate()
            .map(|(r, s)| RowPass::empty(s.is_some(), lp(r)))
            .collect::<Vec<_>>()
    };
    if rows == 0 {
        return Vec::new();
    }
    let tiles: Vec<Vec<RowPass>> = (0..n.div_ceil(TILE))
        .into_par_iter()
        .map(|t| {
            let (lo, hi) = (t * TILE, ((t + 1) * TILE).min(n));
            let mut logits = vec![0.0f32; rows * (hi - lo)];
            matmul_nt(x, &weight[lo * hidden..hi * hidden], &mut logits, rows, hidden, hi - lo);
            let mut out = empty();
            for (r, row) in logits.chunks_exact(hi - lo).enumerate() {
                out[r].fold(row, first_id + lo as u32, spec[r].as_ref(), lp(r));
            }
            out
        })
        .collect();
    tiles.into_iter().fold(empty(), |acc, t| {
        acc.into_iter().zip(t).map(|(a, b)| a.merge(b)).collect()
    })
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;

    fn random(n: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// The summary computed from whole logit rows, the straightforward way.
    fn reference(logits: &[f32], spec: Option<&SpecRequest>) -> RowPass {
        let argmax = super::super::sample::argmax(logits);
        let max = logits[argmax as usize];
        let lse = max + logits.iter().map(|v| (v - max).exp()).sum::<f32>().ln();
        let spec = spec.map(|r| {
            let s: Vec<f32> = logits.iter().map(|v| v / r.temperature).collect();
            let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut best = (0u32, f32::NEG_INFINITY);
            for (i, v) in s.iter().enumerate() {
                let id = i as u32;
                if Some(id) != r.draft {
                    let g = v + gumbel(r.seed, r.index, id);
                    if g > best.1 {
                        best = (id, g);
                    }
                }
            }
            SpecSummary {
                lse: m + s.iter().map(|v| (v - m).exp()).sum::<f32>().ln(),
                drafted: r.draft.map(|d| s[d as usize]),
                candidate: best.0,
                score: best.1,
            }
        });
        RowPass {
            argmax,
            max,
            lse,
            spec,
            logprob: None,
        }
    }

    #[test]
    fn tiled_pass_matches_whole_rows_and_splits_merge() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let (rows, hidden, n) = (3, 24, 2 * TILE + 77);
        let x = random(rows * hidden, &mut rng);
        let w = random(n * hidden, &mut rng);
        let spec = [
            Some(SpecRequest {
                draft: Some(5),
                temperature: 0.7,
                seed: 11,
                index: 3,
            }),
            None,
            Some(SpecRequest {
                draft: None,
                temperature: 1.3,
                seed: 11,
                index: 4,
            }),
        ];
        let got = head_pass(&x, &w, hidden, 0, &spec);
        let mut logits = vec![0.0; rows * n];
        matmul_nt(&x, &w, &mut logits, rows, hidden, n);
        // Two slices, as two tensor-parallel ranks would see them.
        let cut = 600;
        let a = head_pass(&x, &w[..cut * hidden], hidden, 0, &spec);
        let b = head_pass(&x, &w[cut * hidden..], hidden, cut as u32, &spec);
        for r in 0..rows {
            let want = reference(&logits[r * n..(r + 1) * n], spec[r].as_ref());
            for p in [got[r], a[r].merge(b[r])] {
                assert_eq!(p.argmax, want.argmax);
                assert!((p.lse - want.lse).abs() < 1e-4, "{} {}", p.lse, want.lse);
                match (p.spec, want.spec) {
                    (Some(s), Some(t)) => {
                        assert_eq!(s.candidate, t.candidate);
                        assert!((s.lse - t.lse).abs() < 1e-4);
                        assert_eq!(s.drafted.is_some(), t.drafted.is_some());
                        if let (Some(u), Some(v)) = (s.drafted, t.drafted) {
                            assert!((u - v).abs() < 1e-5);
                        }
                    }
                    (None, None) => {}
                    other => panic!("spec summaries differ: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn gumbel_max_samples_the_softmax() {
        // Over many indices the candidate of a 4-id row must follow softmax(l / t).
        let l = [0.5f32, -0.2, 1.1, 0.0];
        let t = 0.8;
        let mut counts = [0usize; 4];
        let draws = 40_000;
        for index in 0..draws {
            let mut p = RowPass::empty(true, None);
            p.fold(
                &l,
                0,
                Some(&SpecRequest {
                    draft: None,
                    temperature: t,
                    seed: 99,
                    index,
                }),
                None,
            );
            counts[p.spec.expect("spec").candidate as usize] += 1;
        }
        let z: f32 = l.iter().map(|v| (v / t).exp()).sum();
        for (i, &c) in counts.iter().enumerate() {
            let want = (l[i] / t).exp() / z;
            let got = c as f32 / draws as f32;
            assert!((got - want).abs() < 0.01, "id {i}: {got} vs {want}");
        }
    }

    #[test]
    fn uniforms_stay_inside_the_open_interval() {
        for i in 0..10_000u32 {
            let u = uniform_at(u64::MAX, u64::from(i), i);
            assert!(u > 0.0 && u < 1.0);
        }
        // The extreme hashes: the largest and smallest cells stay inside, so every Gumbel value is finite.
        for h in [u64::MAX, u64::MAX - (1 << 41), 0, 1 << 41] {
            let u = uniform_of_bits(h);
            assert!(u > 0.0 && u < 1.0, "{h:#x} -> {u}");
            assert!((-(-u.ln()).ln()).is_finite());
        }
        assert_ne!(uniform_at(1, 2, 3), uniform_at(1, 3, 2));
    }

    #[test]
    fn a_nan_poisons_the_merged_row() {
        let mut p = RowPass::empty(false, None);
        p.fold(&[1.0, f32::NAN, 0.5], 0, None, None);
        let mut q = RowPass::empty(false, None);
        q.fold(&[3.0], 3, None, None);
        assert!(p.merge(q).max.is_nan());
        assert!(q.merge(p).max.is_nan());
    }

    /// The top entries the straightforward way: every id sorted by logit (descending), ties to the lower id.
    fn sorted_top(row: &[f32], first_id: u32, k: usize) -> Vec<(u32, f32)> {
        let mut all: Vec<(u32, f32)> = row
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| (first_id + i as u32, v))
            .collect();
        all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        all.truncate(k);
        all
    }

    #[test]
    fn top_entries_match_a_sort_and_merge_across_splits_with_ties_to_the_lower_id() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        // Coarse values so many ties occur, across the split points too.
        let row: Vec<f32> = (0..700).map(|_| f32::from(rng.random_range(0u8..12)) * 0.5).collect();
        for k in [0, 1, 5, MAX_TOP] {
            let want = sorted_top(&row, 0, k);
            let r = LogprobRequest {
                top: k,
                target: Some(650),
            };
            let whole = summarise_logits_with(&row, 0, None, Some(&r)).logprob.expect("asked");
            assert_eq!(whole.top.entries().collect::<Vec<_>>(), want, "k {k}");
            assert_eq!(whole.target, Some((650, row[650])));
            for cut in [1, 13, 350, 699] {
                let a = summarise_logits_with(&row[..cut], 0, None, Some(&r));
                let b = summarise_logits_with(&row[cut..], cut as u32, None, Some(&r));
                for m in [a.merge(b), b.merge(a)] {
                    let l = m.logprob.expect("merged");
                    assert_eq!(l.top.entries().collect::<Vec<_>>(), want, "k {k} cut {cut}");
                    assert_eq!(l.target, Some((650, row[650])), "cut {cut}");
                }
            }
        }
        // Exact ties: the lower ids come first, whichever side of a merge they came from.
        let mut a = TopK::new(3);
        for (id, v) in [(9, 1.0), (4, 1.0), (7, 2.0)] {
            a.push(id, v);
        }
        let mut b = TopK::new(3);
        for (id, v) in [(2, 1.0), (1, 0.5)] {
            b.push(id, v);
        }
        let want = vec![(7, 2.0), (2, 1.0), (4, 1.0)];
        assert_eq!(a.merge(b).entries().collect::<Vec<_>>(), want);
        assert_eq!(b.merge(a).entries().collect::<Vec<_>>(), want);
    }

    #[test]
    fn nan_logits_are_never_top_entries_and_the_row_stays_poisoned() {
        let row = [0.5, f32::NAN, 2.0, f32::NAN, 1.0];
        let r = LogprobRequest {
            top: 4,
            target: Some(1),
        };
        let p = summarise_logits_with(&row, 10, None, Some(&r));
        assert!(p.poisoned());
        let l = p.logprob.expect("asked");
        assert_eq!(
            l.top.entries().collect::<Vec<_>>(),
            vec![(12, 2.0), (14, 1.0), (10, 0.5)]
        );
        // The target is out of this slice (ids 10..15): the slice has no value for it.
        assert_eq!(l.target, None);
        let r = LogprobRequest {
            top: 0,
            target: Some(11),
        };
        let l = summarise_logits_with(&row, 10, None, Some(&r)).logprob.expect("asked");
        assert!(l.target.is_some_and(|(id, v)| id == 11 && v.is_nan()));
        assert_eq!(l.top.entries().count(), 0);
    }

    #[test]
    fn the_pass_answers_logprob_rows_only_and_matches_whole_rows() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let (rows, hidden, n) = (3, 16, TILE + 300);
        let x = random(rows * hidden, &mut rng);
        let w = random(n * hidden, &mut rng);
        let mut logits = vec![0.0; rows * n];
        matmul_nt(&x, &w, &mut logits, rows, hidden, n);
        let lp = [
            Some(LogprobRequest {
                top: 5,
                target: Some(17),
            }),
            None,
            Some(LogprobRequest { top: 0, target: None }),
        ];
        let got = head_pass_with(&x, &w, hidden, 0, &[None; 3], &lp);
        assert!(got[1].logprob.is_none(), "a row that asked nothing gets nothing");
        let l0 = got[0].logprob.expect("row 0 asked");
        let want = sorted_top(&logits[..n], 0, 5);
        let top: Vec<(u32, f32)> = l0.top.entries().collect();
        assert_eq!(
            top.iter().map(|e| e.0).collect::<Vec<_>>(),
            want.iter().map(|e| e.0).collect::<Vec<_>>()
        );
        for (g, w) in top.iter().zip(&want) {
            assert!((g.1 - w.1).abs() < 1e-5);
        }
        let (id, v) = l0.target.expect("target seen");
        assert_eq!(id, 17);
        assert!((v - logits[17]).abs() < 1e-5);
        assert_eq!(got[0].logit_of(17), Some(v));
        assert_eq!(got[2].logit_of(got[2].argmax), Some(got[2].max));
        assert_eq!(got[2].logprob.expect("asked").top.entries().count(), 0);
    }
}
