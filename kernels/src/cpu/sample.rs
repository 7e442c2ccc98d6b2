//! CPU twins of the device token-selection kernels: [`argmax`] (greedy), [`sample_row`] (filtered sampling, HF's
//! filter order) and [`apply_token_mask`] (a constrained row's token mask), which the engine's CPU ranks sample with.

/// Index of the largest value, the lowest index on ties (−0 and +0 are equal).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in values.iter().enumerate().skip(1) {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// Sets every logit whose bit is clear in `mask` (one bit a token id, LSB first in `u32` words; ids past the mask's
/// words are clear) to `f32::MIN`: the token mask of a constrained row (structured outputs), applied after the
/// additive bias so that no bias lifts a token the grammar forbids. `f32::MIN` rather than −∞ keeps the row finite
/// (the samplers refuse non-finite rows) while its weight is exactly 0 and it is never the argmax beside an allowed
/// token. The CPU twin of the device kernel `token_mask`.
pub fn apply_token_mask(logits: &mut [f32], mask: &[u32]) {
    for (i, l) in logits.iter_mut().enumerate() {
        let word = mask.get(i / 32).copied().unwrap_or(0);
        if (word >> (i % 32)) & 1 == 0 {
            *l = f32::MIN;
        }
    }
}

/// The tokens the sampling filters keep, in ascending id order, with their weights `exp((l − max) / t)` (f32).
///
/// Order: sort by logit descending (total order, so −0 below +0), ties by lower id; keep the first
/// `top_k` (0 or ≥ vocab: off); with `top_p < 1`, keep the shortest prefix of those whose weight mass (f64, in sorted
/// order) reaches `top_p` × their mass (at least one token); with `min_p > 0`, keep the weights ≥ `min_p` (the top
/// token's weight is 1). `temperature` must be > 0 and the logits finite.
pub fn kept_weights(logits: &[f32], temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> Vec<(u32, f32)> {
    assert!(
        !logits.is_empty() && temperature > 0.0,
        "kept_weights: empty row or temperature ≤ 0"
    );
    let by_score = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then_with(|| a.cmp(b))
    };
    let n = logits.len();
    let k = if top_k > 0 && top_k < n { top_k } else { n };
    // Sorting the whole vocabulary costs O(V log V) a row (16 ms at 248 K ids, bench/results/cpu-kept-weights-*). The
    // order above is total, so the k best are one set, which a selection finds in O(V); only top-p needs its
    // candidates in score order.
    let mut order: Vec<u32> = (0..n as u32).collect();
    if k < n {
        order.select_nth_unstable_by(k - 1, by_score);
        order.truncate(k);
    }
    if top_p < 1.0 {
        order.sort_unstable_by(by_score);
    }
    let mut kept = weigh(logits, &order, temperature, top_p, min_p);
    // Unfiltered candidates are still in id order.
    if k < n || top_p < 1.0 {
        kept.sort_unstable_by_key(|&(i, _)| i);
    }
    kept
}

/// The weights `exp((l − max) / t)` of the candidates `order` (in score order when `top_p < 1`), cut to the shortest
/// prefix reaching `top_p` of their mass and to those ≥ `min_p`; in `order`'s order.
fn weigh(logits: &[f32], order: &[u32], temperature: f32, top_p: f32, min_p: f32) -> Vec<(u32, f32)> {
    let max = order
        .iter()
        .map(|&i| logits[i as usize])
        .fold(f32::NEG_INFINITY, f32::max);
    let mut kept: Vec<(u32, f32)> = order
        .iter()
        .map(|&i| (i, ((logits[i as usize] - max) / temperature).exp()))
        .collect();
    if top_p < 1.0 {
        let total: f64 = kept.iter().map(|&(_, w)| f64::from(w)).sum();
        let target = f64::from(top_p) * total;
        let (mut cum, mut keep) = (0.0f64, 0);
        for &(_, w) in &kept {
            if keep > 0 && cum >= target {
                break;
            }
            cum += f64::from(w);
            keep += 1;
        }
        kept.truncate(keep);
    }
    if min_p > 0.0 {
        kept.retain(|&(_, w)| w >= min_p);
    }
    kept
}

/// Samples one id from a row of finite logits with uniform `u` in `[0, 1)`: greedy ([`argmax`]) when `temperature` is
/// 0, else the first id of [`kept_weights`] (ascending id order) whose cumulative weight (f64) exceeds `u · total`,
/// or the last kept id when rounding leaves none.
pub fn sample_row(logits: &[f32], temperature: f32, top_k: usize, top_p: f32, min_p: f32, u: f32) -> u32 {
    if temperature <= 0.0 {
        return argmax(logits);
    }
    let kept = kept_weights(logits, temperature, top_k, top_p, min_p);
    let total: f64 = kept.iter().map(|&(_, w)| f64::from(w)).sum();
    let x = f64::from(u) * total;
    let mut cum = 0.0f64;
    for &(id, w) in &kept {
        cum += f64::from(w);
        if x < cum {
            return id;
        }
    }
    kept.last().expect("the top token always survives filtering").0
}

/// One link of a chain of decode steps (the device kernel `chain_pick`'s twin). Per row of this rank's `local`
/// summaries (`words` u32 each: word 0 the argmax, word 1 the max logit's bits), the next step's input token and the
/// logged sampled id (−1 when the step did not sample). The token is `sampled[r]` when `from_sampled`; else the
/// argmax over the ranks' summaries `gathered` (`[world, rows, words]`, rank order): the largest max logit, the
/// first rank on ties (its slice holds the lower ids), as `merge_rows` in the engine. An id outside `0 .. vocab` (a
/// NaN anywhere, a sampled −1) feeds 0.
#[allow(clippy::too_many_arguments)]
pub fn chain_pick(
    local: &[u32],
    gathered: &[u32],
    world: usize,
    words: usize,
    sampled: &[i32],
    from_sampled: bool,
    vocab: usize,
) -> (Vec<i32>, Vec<i32>) {
    let rows = local.len() / words.max(1);
    (0..rows)
        .map(|r| {
            let id = if from_sampled {
                i64::from(sampled[r])
            } else {
                let mut best: Option<(f32, u32)> = None;
                let mut nan = false;
                for k in 0..world {
                    let g = &gathered[(k * rows + r) * words..(k * rows + r + 1) * words];
                    let v = f32::from_bits(g[1]);
                    if v.is_nan() {
                        nan = true;
                    } else if best.is_none_or(|(b, _)| v > b) {
                        best = Some((v, g[0]));
                    }
                }
                match best {
                    Some((_, id)) if !nan => i64::from(id),
                    _ => -1,
                }
            };
            let token = if (0..vocab as i64).contains(&id) { id as i32 } else { 0 };
            (token, if from_sampled { sampled[r] } else { -1 })
        })
        .unzip()
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;

    /// The filters as first written, on a fully sorted vocabulary: the reference the selection must equal.
    fn kept_by_full_sort(logits: &[f32], t: f32, top_k: usize, top_p: f32, min_p: f32) -> Vec<(u32, f32)> {
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        order.sort_unstable_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then_with(|| a.cmp(&b))
        });
        if top_k > 0 && top_k < order.len() {
            order.truncate(top_k);
        }
        let mut kept = weigh(logits, &order, t, top_p, min_p);
        kept.sort_unstable_by_key(|&(i, _)| i);
        kept
    }

    #[test]
    fn selection_keeps_exactly_what_a_full_sort_keeps() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for case in 0..400 {
            let n = rng.random_range(1..300);
            // Few distinct values (many ties, ±0 among them) or continuous ones.
            let row: Vec<f32> = (0..n)
                .map(|_| {
                    if case % 2 == 0 {
                        [-0.0, 0.0, 1.5, -2.0, 3.0][rng.random_range(0..5)]
                    } else {
                        rng.random_range(-8.0..8.0)
                    }
                })
                .collect();
            let t = [0.05, 0.7, 1.0, 3.0][case % 4];
            let top_k = [0, 1, 2, 17, n, n + 3][rng.random_range(0..6)];
            let top_p = [1.0, 0.9, 0.3][rng.random_range(0..3)];
            let min_p = [0.0, 0.05][rng.random_range(0..2)];
            let got = kept_weights(&row, t, top_k, top_p, min_p);
            let want = kept_by_full_sort(&row, t, top_k, top_p, min_p);
            let bits = |v: &[(u32, f32)]| v.iter().map(|&(i, w)| (i, w.to_bits())).collect::<Vec<_>>();
            assert_eq!(
                bits(&got),
                bits(&want),
                "case {case}: k {top_k}, p {top_p}, min_p {min_p}"
            );
        }
    }

    fn ids(kept: &[(u32, f32)]) -> Vec<u32> {
        kept.iter().map(|&(i, _)| i).collect()
    }

    #[test]
    fn top_k_breaks_ties_by_lower_id_and_total_order() {
        let l = [1.0, 3.0, 2.0, 3.0, 2.0, 0.0, -0.0];
        assert_eq!(ids(&kept_weights(&l, 1.0, 1, 1.0, 0.0)), [1]);
        assert_eq!(ids(&kept_weights(&l, 1.0, 3, 1.0, 0.0)), [1, 2, 3]);
        assert_eq!(ids(&kept_weights(&l, 1.0, 4, 1.0, 0.0)), [1, 2, 3, 4]);
        // +0 sorts above −0.
        let z = [-0.0, 0.0, -1.0];
        assert_eq!(ids(&kept_weights(&z, 1.0, 1, 1.0, 0.0)), [1]);
        assert_eq!(ids(&kept_weights(&l, 1.0, 0, 1.0, 0.0)).len(), l.len());
        assert_eq!(ids(&kept_weights(&l, 1.0, 99, 1.0, 0.0)).len(), l.len());
    }

    #[test]
    fn top_p_keeps_the_shortest_reaching_prefix_and_min_p_filters() {
        // Weights 1, 1/2, 1/4, 1/8 (t = 1/ln 2): mass 1.875.
        let t = 1.0 / std::f32::consts::LN_2;
        let l = [-2.0, 0.0, -3.0, -1.0];
        // 0.5 × 1.875 = 0.9375 ≤ 1: the top token alone.
        assert_eq!(ids(&kept_weights(&l, t, 0, 0.5, 0.0)), [1]);
        // 0.6 × 1.875 = 1.125: the top two.
        assert_eq!(ids(&kept_weights(&l, t, 0, 0.6, 0.0)), [1, 3]);
        // Never empty, even for a tiny top_p.
        assert_eq!(ids(&kept_weights(&l, t, 0, 1e-6, 0.0)), [1]);
        // min_p 0.3 keeps weights 1 and 1/2; with top_k 3 first.
        assert_eq!(ids(&kept_weights(&l, t, 3, 1.0, 0.3)), [1, 3]);
        let w = kept_weights(&l, t, 0, 1.0, 0.0);
        assert!((w[0].1 - 0.25).abs() < 1e-6 && w[1].1 == 1.0);
    }

    #[test]
    fn draw_is_inverse_cdf_in_id_order() {
        let t = 1.0 / std::f32::consts::LN_2;
        let l = [-2.0, 0.0, -3.0, -1.0]; // weights 1/4, 1, 1/8, 1/2 in id order, total 1.875
        let at = |u: f32| sample_row(&l, t, 0, 1.0, 0.0, u);
        assert_eq!(at(0.0), 0);
        assert_eq!(at(0.25 / 1.875 - 1e-4), 0);
        assert_eq!(at(0.25 / 1.875 + 1e-4), 1);
        assert_eq!(at(1.25 / 1.875 + 1e-4), 2);
        assert_eq!(at(1.375 / 1.875 + 1e-4), 3);
        assert_eq!(at(0.999_999_9), 3);
        assert_eq!(sample_row(&l, 0.0, 0, 1.0, 0.0, 0.7), 1);
    }

    #[test]
    fn frequencies_follow_the_kept_weights() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let l: Vec<f32> = (0..12).map(|_| rng.random_range(-3.0..3.0)).collect();
        let kept = kept_weights(&l, 0.8, 8, 0.9, 0.05);
        let total: f64 = kept.iter().map(|&(_, w)| f64::from(w)).sum();
        let n = 200_000;
        let mut counts = vec![0usize; l.len()];
        for _ in 0..n {
            counts[sample_row(&l, 0.8, 8, 0.9, 0.05, rng.random::<f32>()) as usize] += 1;
        }
        for (i, &c) in counts.iter().enumerate() {
            let p = kept
                .iter()
                .find(|&&(k, _)| k as usize == i)
                .map_or(0.0, |&(_, w)| f64::from(w) / total);
            let f = c as f64 / n as f64;
            assert!(
                (f - p).abs() < 5.0 * (p * (1.0 - p) / n as f64).sqrt() + 1e-9,
                "id {i}: {f} vs {p}"
            );
        }
    }

    #[test]
    fn argmax_takes_the_lowest_index_of_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, -1e30]), 1);
    }

    #[test]
    fn chain_pick_feeds_the_pick_and_guards_the_embedding() {
        // Two rows of 3 words (argmax, max bits, pad): argmax 5 and 99 (past a vocabulary of 10).
        let one = [5, 2f32.to_bits(), 0, 99, 1f32.to_bits(), 0];
        assert_eq!(
            chain_pick(&one, &one, 1, 3, &[7, -1], false, 10),
            (vec![5, 0], vec![-1, -1])
        );
        assert_eq!(
            chain_pick(&one, &one, 1, 3, &[7, -1], true, 10),
            (vec![7, 0], vec![7, -1])
        );
        // Two ranks: the larger max wins, the first rank on a tie; a NaN anywhere feeds 0.
        let other = [8, 2f32.to_bits(), 0, 6, 3f32.to_bits(), 0];
        let both: Vec<u32> = one.iter().chain(&other).copied().collect();
        assert_eq!(chain_pick(&one, &both, 2, 3, &[0, 0], false, 10).0, vec![5, 6]);
        let poisoned = [8, f32::NAN.to_bits(), 0, 6, 3f32.to_bits(), 0];
        let both: Vec<u32> = one.iter().chain(&poisoned).copied().collect();
        assert_eq!(chain_pick(&one, &both, 2, 3, &[0, 0], false, 10).0, vec![0, 6]);
    }
}
