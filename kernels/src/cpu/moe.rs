//! Mixture-of-experts routing, and grouping of token rows by expert so each expert runs one GEMM.
//!
//! Both routers return `[tokens, top_k]` expert ids and weights. Within a token the picks are ordered by decreasing
//! selection score, ties broken towards the lower expert id (torch's `topk` leaves tie order unspecified; only the
//! order of the renormalisation sum depends on it).

/// Indices of the `k` largest values of `row`, largest first; equal values keep ascending index order.
fn top_k_indices(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    // A stable sort by descending value keeps lower indices first among equals.
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    idx.truncate(k);
    idx
}

/// Softmax routing (Qwen3-Next, Qwen3.5-MoE): `softmax(logits)` in f32, top-k, and with `norm_topk_prob` the picked
/// probabilities divided by their sum (no epsilon, as the reference).
pub fn route_softmax(
    logits: &[f32],
    tokens: usize,
    experts: usize,
    top_k: usize,
    norm_topk_prob: bool,
) -> (Vec<usize>, Vec<f32>) {
    assert_eq!(logits.len(), tokens * experts, "route_softmax: logits");
    assert!(top_k <= experts, "route_softmax: top_k exceeds the number of experts");
    let mut ids = Vec::with_capacity(tokens * top_k);
    let mut weights = Vec::with_capacity(tokens * top_k);
    let mut probs = vec![0.0f32; experts];
    for row in logits.chunks_exact(experts.max(1)).take(tokens) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for (p, &l) in probs.iter_mut().zip(row) {
            *p = (l - max).exp();
            sum += *p;
        }
        for p in probs.iter_mut() {
            *p /= sum;
        }
        let picked = top_k_indices(&probs, top_k);
        let mut w: Vec<f32> = picked.iter().map(|&e| probs[e]).collect();
        if norm_topk_prob {
            let total: f32 = w.iter().sum();
            for x in w.iter_mut() {
                *x /= total;
            }
        }
        ids.extend_from_slice(&picked);
        weights.extend_from_slice(&w);
    }
    (ids, weights)
}

/// Grouped sigmoid routing (Nemotron-H's `NemotronHTopkRouter`, DeepSeek-V3 style).
///
/// `scores = sigmoid(logits)`; experts are *chosen* by `scores + correction_bias`: each of the `n_group` groups of
/// consecutive experts is scored by the sum of its two best biased scores, the best `topk_group` groups are kept,
/// and the `top_k` best biased scores among their experts are picked. The *weights* are the unbiased `scores` of the
/// picks; with `norm_topk_prob` they are divided by `sum + 1e-20`, then multiplied by `routed_scaling_factor`.
#[allow(clippy::too_many_arguments)]
pub fn route_sigmoid_grouped(
    logits: &[f32],
    tokens: usize,
    experts: usize,
    correction_bias: &[f32],
    top_k: usize,
    n_group: usize,
    topk_group: usize,
    norm_topk_prob: bool,
    routed_scaling_factor: f32,
) -> (Vec<usize>, Vec<f32>) {
    assert_eq!(logits.len(), tokens * experts, "route_sigmoid_grouped: logits");
    assert_eq!(correction_bias.len(), experts, "route_sigmoid_grouped: correction_bias");
    assert!(
        n_group > 0 && experts.is_multiple_of(n_group),
        "route_sigmoid_grouped: n_group must divide the experts"
    );
    assert!(
        topk_group > 0 && topk_group <= n_group,
        "route_sigmoid_grouped: topk_group out of range"
    );
    let per_group = experts / n_group;
    assert!(
        top_k <= topk_group * per_group,
        "route_sigmoid_grouped: top_k exceeds the experts of the kept groups"
    );
    // The reference scores a group with `topk(2)`, which needs two experts per group; when every group is kept the
    // group scores cannot change anything, so that case is allowed with any group size.
    let masking = topk_group < n_group;
    assert!(
        !masking || per_group >= 2,
        "route_sigmoid_grouped: groups need at least two experts"
    );
    let mut ids = Vec::with_capacity(tokens * top_k);
    let mut weights = Vec::with_capacity(tokens * top_k);
    let mut scores = vec![0.0f32; experts];
    let mut choice = vec![0.0f32; experts];
    let mut group_scores = vec![0.0f32; n_group];
    for row in logits.chunks_exact(experts.max(1)).take(tokens) {
        for ((s, c), (&l, &b)) in scores
            .iter_mut()
            .zip(choice.iter_mut())
            .zip(row.iter().zip(correction_bias))
        {
            *s = 1.0 / (1.0 + (-l).exp());
            *c = *s + b;
        }
        if masking {
            for (g, gs) in group_scores.iter_mut().enumerate() {
                let best = top_k_indices(&choice[g * per_group..(g + 1) * per_group], 2);
                *gs = choice[g * per_group + best[0]] + choice[g * per_group + best[1]];
            }
            let kept = top_k_indices(&group_scores, topk_group);
            for g in 0..n_group {
                if !kept.contains(&g) {
                    choice[g * per_group..(g + 1) * per_group].fill(f32::NEG_INFINITY);
                }
            }
        }
        let picked = top_k_indices(&choice, top_k);
        let mut w: Vec<f32> = picked.iter().map(|&e| scores[e]).collect();
        if norm_topk_prob {
            let denominator = w.iter().sum::<f32>() + 1e-20;
            for x in w.iter_mut() {
                *x /= denominator;
            }
        }
        for x in w.iter_mut() {
            *x *= routed_scaling_factor;
        }
        ids.extend_from_slice(&picked);
        weights.extend_from_slice(&w);
    }
    (ids, weights)
}

/// Routing assignments sorted by expert: the rows expert `e` processes are `tokens[offsets[e]..offsets[e + 1]]`
/// (ascending token order), with routing weights `weights[..]` at the same positions.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertGroups {
    /// `experts + 1` offsets into `tokens` / `weights`.
    pub offsets: Vec<usize>,
    /// Token (row) index of each assignment.
    pub tokens: Vec<usize>,
    /// Routing weight of each assignment.
    pub weights: Vec<f32>,
}

impl ExpertGroups {
    /// The token rows and weights routed to expert `e`.
    pub fn expert(&self, e: usize) -> (&[usize], &[f32]) {
        let r = self.offsets[e]..self.offsets[e + 1];
        (&self.tokens[r.clone()], &self.weights[r])
    }
}

/// Groups `[tokens, top_k]` routing results by expert (a counting sort), for one batched GEMM per expert.
pub fn group_by_expert(ids: &[usize], weights: &[f32], top_k: usize, experts: usize) -> ExpertGroups {
    assert_eq!(
        ids.len(),
        weights.len(),
        "group_by_expert: ids and weights differ in length"
    );
    assert!(
        top_k > 0 && ids.len().is_multiple_of(top_k),
        "group_by_expert: not a whole number of tokens"
    );
    let mut offsets = vec![0usize; experts + 1];
    for &e in ids {
        assert!(e < experts, "group_by_expert: expert id {e} out of range");
        offsets[e + 1] += 1;
    }
    for e in 0..experts {
        offsets[e + 1] += offsets[e];
    }
    let mut fill = offsets[..experts].to_vec();
    let mut tokens = vec![0usize; ids.len()];
    let mut grouped = vec![0.0f32; ids.len()];
    for (i, (&e, &w)) in ids.iter().zip(weights).enumerate() {
        tokens[fill[e]] = i / top_k;
        grouped[fill[e]] = w;
        fill[e] += 1;
    }
    ExpertGroups {
        offsets,
        tokens,
        weights: grouped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6)
    }

    #[test]
    fn softmax_router_known_values() {
        // Token 0: logits ln(1), ln(4), ln(2), ln(3) → probs 0.1, 0.4, 0.2, 0.3.
        // Token 1: a tie between experts 0 and 3 is broken towards expert 0.
        let logits = [0.0, 4f32.ln(), 2f32.ln(), 3f32.ln(), 1.0, -1.0, 0.5, 1.0];
        let (ids, w) = route_softmax(&logits, 2, 4, 2, false);
        assert_eq!(ids, vec![1, 3, 0, 3]);
        assert!(close(&w[..2], &[0.4, 0.3]));
        let z = 2.0 * 1f32.exp() + (-1f32).exp() + 0.5f32.exp();
        assert!(close(&w[2..], &[1f32.exp() / z, 1f32.exp() / z]));
        let (ids, w) = route_softmax(&logits, 2, 4, 2, true);
        assert_eq!(ids, vec![1, 3, 0, 3]);
        assert!(close(&w, &[4.0 / 7.0, 3.0 / 7.0, 0.5, 0.5]));
    }

    fn logit(p: f32) -> f32 {
        (p / (1.0 - p)).ln()
    }

    #[test]
    fn sigmoid_grouped_router_known_values() {
        // 8 experts in 4 groups of 2; scores chosen directly, mapped back through the inverse sigmoid.
        let scores = [0.9, 0.05, 0.6, 0.5, 0.7, 0.2, 0.35, 0.8];
        let logits: Vec<f32> = scores.iter().map(|&p| logit(p)).collect();
        let no_bias = [0.0; 8];
        // Group scores (sum of both): 0.95, 1.1, 0.9, 1.15 → keep groups 3 and 1 (topk_group 2), so expert 0 (0.9,
        // the best single score) is excluded; the picks are 7 (0.8) and 2 (0.6).
        let (ids, w) = route_sigmoid_grouped(&logits, 1, 8, &no_bias, 2, 4, 2, false, 1.0);
        assert_eq!(ids, vec![7, 2]);
        assert!(close(&w, &[0.8, 0.6]));
        // Renormalised and scaled: weights / (sum + 1e-20) · 2.5.
        let (_, w) = route_sigmoid_grouped(&logits, 1, 8, &no_bias, 2, 4, 2, true, 2.5);
        assert!(close(&w, &[0.8 / 1.4 * 2.5, 0.6 / 1.4 * 2.5]));
        // Without group masking (one group), expert 0 wins.
        let (ids, _) = route_sigmoid_grouped(&logits, 1, 8, &no_bias, 2, 1, 1, false, 1.0);
        assert_eq!(ids, vec![0, 7]);
        // The bias steers the choice, not the weights: +0.45 on expert 5 makes group 2 score 0.7 + 0.65 = 1.35, so
        // groups 2 and 3 are kept; the picks are 7 (0.8), 4 (0.7) and 5 (0.65 biased), weighted by the raw 0.2.
        let mut bias = [0.0; 8];
        bias[5] = 0.45;
        let (ids, w) = route_sigmoid_grouped(&logits, 1, 8, &bias, 3, 4, 2, false, 1.0);
        assert_eq!(ids, vec![7, 4, 5]);
        assert!(close(&w, &[0.8, 0.7, 0.2]));
        // Two tokens in one call route independently.
        let two: Vec<f32> = logits.iter().chain(logits.iter().rev()).copied().collect();
        let (ids, _) = route_sigmoid_grouped(&two, 2, 8, &no_bias, 2, 4, 2, false, 1.0);
        assert_eq!(ids, vec![7, 2, 0, 5]);
    }

    #[test]
    fn grouping_by_expert() {
        // 3 tokens, top-2, 4 experts.
        let ids = [2, 0, 0, 3, 2, 0];
        let w = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6];
        let g = group_by_expert(&ids, &w, 2, 4);
        assert_eq!(g.offsets, vec![0, 3, 3, 5, 6]);
        assert_eq!(g.expert(0), (&[0usize, 1, 2][..], &[0.2f32, 0.3, 0.6][..]));
        assert_eq!(g.expert(1).0.len(), 0);
        assert_eq!(g.expert(2), (&[0usize, 2][..], &[0.1f32, 0.5][..]));
        assert_eq!(g.expert(3), (&[1usize][..], &[0.4f32][..]));
    }
}
