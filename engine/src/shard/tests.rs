//! Plan tests: splits cover everything once, and for every preset at TP 1..=8 every element of a split tensor is owned
//! by exactly one rank, shared pieces are held at least twice, and replicated tensors are marked.

use std::collections::HashMap;

use super::plan::{even_split, Cut, GroupedSplit, RankPlan, ShardKind};
use crate::model::config::{BlockKind, ModelConfig};
use crate::presets::{preset_config, PRESETS};

#[test]
fn even_split_covers_every_item_once_with_the_remainder_first() {
    for n in 1..40 {
        for tp in 1..=8 {
            let ranges: Vec<_> = (0..tp).map(|r| even_split(n, tp, r)).collect();
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[tp - 1].end, n);
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert!(w[0].len() >= w[1].len() && w[0].len() - w[1].len() <= 1);
            }
        }
    }
}

#[test]
fn grouped_split_maps_every_head_to_its_group() {
    for (heads, groups) in [(8, 2), (9, 3), (6, 1), (128, 8), (12, 12), (64, 16), (40, 4)] {
        let hpg = heads / groups;
        for tp in 1..=8.min(heads) {
            let mut spans = false;
            for r in 0..tp {
                let s = GroupedSplit::new(heads, groups, tp, r);
                assert_eq!(s.heads, even_split(heads, tp, r));
                assert_eq!(s.virtual_groups.len() * s.heads_per_virtual, s.heads.len());
                for (j, h) in s.heads.clone().enumerate() {
                    let g = s.groups[s.virtual_groups[j / s.heads_per_virtual]];
                    assert_eq!(g, h / hpg, "heads {heads} groups {groups} tp {tp} rank {r} head {h}");
                }
                spans |= s.shared.iter().any(|x| *x);
                let aligned = groups.is_multiple_of(tp) && heads.is_multiple_of(tp);
                if aligned {
                    assert!(s.is_identity() && s.shared.iter().all(|x| !x));
                }
            }
            assert_eq!(spans, GroupedSplit::any_group_spans_ranks(heads, groups, tp));
        }
    }
}

/// Per checkpoint tensor, over all ranks: how often each index along the cut axis is held as split / shared.
#[derive(Default)]
struct Coverage {
    axis_len: usize,
    split: Vec<usize>,
    shared: Vec<usize>,
    replicated: usize,
    first_rank_owners: usize,
    first_rank: usize,
}

fn check_ownership(name: &str, tp: usize, plans: &[RankPlan]) {
    let mut cov: HashMap<String, Coverage> = HashMap::new();
    for plan in plans {
        for t in plan.tensors() {
            let c = cov.entry(t.source.clone()).or_default();
            match &t.cut {
                Cut::Replicated => c.replicated += 1,
                Cut::FirstRank { owner } => {
                    c.first_rank += 1;
                    c.first_rank_owners += usize::from(*owner);
                }
                Cut::Pieces { axis, pieces } => {
                    let len = t.source_shape[*axis];
                    if c.split.is_empty() {
                        c.axis_len = len;
                        c.split = vec![0; len];
                        c.shared = vec![0; len];
                    }
                    assert_eq!(c.axis_len, len, "{name} tp {tp}: {} cut along different axes", t.source);
                    for p in pieces {
                        assert!(
                            p.range.end <= len && !p.range.is_empty(),
                            "{name}: {} piece {p:?}",
                            t.source
                        );
                        let counts = if p.split { &mut c.split } else { &mut c.shared };
                        for i in p.range.clone() {
                            counts[i] += 1;
                        }
                    }
                }
            }
        }
    }
    for (source, c) in &cov {
        let kinds = usize::from(c.replicated > 0) + usize::from(c.first_rank > 0) + usize::from(!c.split.is_empty());
        assert_eq!(kinds, 1, "{name} tp {tp}: {source} is cut in more than one way");
        if c.replicated > 0 {
            assert_eq!(
                c.replicated, tp,
                "{name} tp {tp}: replicated {source} not on every rank"
            );
        }
        if c.first_rank > 0 {
            assert_eq!(
                (c.first_rank, c.first_rank_owners),
                (tp, 1),
                "{name} tp {tp}: bias {source}"
            );
        }
        for i in 0..c.axis_len {
            let (s, sh) = (c.split[i], c.shared[i]);
            assert!(
                (s == 1 && sh == 0) || (s == 0 && sh >= 2),
                "{name} tp {tp}: {source} index {i} held {s} times split and {sh} times shared"
            );
        }
    }
}

#[test]
fn every_preset_splits_at_every_tp_up_to_8() {
    for p in PRESETS {
        let json = preset_config(p.family, p.name, None, 4096, 1, 2).expect("preset");
        let config = ModelConfig::from_json(&json).expect("config");
        let real = !matches!(p.name, "tiny" | "tiny-latent" | "small");
        for tp in 1..=8 {
            let plans: Result<Vec<RankPlan>, _> = (0..tp).map(|r| RankPlan::new(&config, tp, r, &|_| false)).collect();
            let plans = match plans {
                Ok(plans) => plans,
                // Test-size presets may have fewer heads than ranks; real models must split at every tp up to 8.
                Err(e) => {
                    assert!(!real, "{} {} tp {tp}: {e}", p.family.name(), p.name);
                    assert!(e.to_string().contains("exceeds"), "{e}");
                    continue;
                }
            };
            let label = format!("{} {}", p.family.name(), p.name);
            check_ownership(&label, tp, &plans);
            // Local specs add up to the whole layer.
            for b in 0..plans[0].blocks.len() {
                let heads: usize = plans
                    .iter()
                    .map(|pl| match &pl.blocks[b].kind {
                        BlockKind::Mamba2(s) => s.heads,
                        BlockKind::Gdn(s) => s.v_heads,
                        BlockKind::Attention(s) => s.heads,
                        BlockKind::Mlp(s) => s.intermediate,
                        BlockKind::Moe(s) => s.expert_intermediate,
                    })
                    .sum();
                let want = match &config.layers.iter().flatten().nth(b).expect("block").kind {
                    BlockKind::Mamba2(s) => s.heads,
                    BlockKind::Gdn(s) => s.v_heads,
                    BlockKind::Attention(s) => s.heads,
                    BlockKind::Mlp(s) => s.intermediate,
                    BlockKind::Moe(s) => s.expert_intermediate,
                };
                assert_eq!(heads, want, "{label} tp {tp} block {b}");
            }
        }
    }
}

#[test]
fn nemotron_h_8b_norm_groups_span_ranks_exactly_when_tp_does_not_divide_them() {
    let json = preset_config(crate::model::Family::NemotronH, "nemotron-h-8b", None, 4096, 1, 2).expect("preset");
    let config = ModelConfig::from_json(&json).expect("config");
    for tp in 1..=8 {
        let plan = RankPlan::new(&config, tp, tp - 1, &|_| false).expect("plan");
        let (groups, spans) = plan
            .blocks
            .iter()
            .find_map(|b| match (&b.kind, &b.shard) {
                (
                    BlockKind::Mamba2(_),
                    ShardKind::Mamba2 {
                        norm_groups,
                        all_reduce_norm,
                        ..
                    },
                ) => Some((*norm_groups, *all_reduce_norm)),
                _ => None,
            })
            .expect("a Mamba-2 block");
        assert_eq!(groups, 8);
        assert_eq!(spans, !8usize.is_multiple_of(tp), "tp {tp}");
    }
}

/// Handing a whole tensor back without a copy changes nothing: for the small presets at TP 1..=3, `apply_owned` gives
/// what `apply` gives on distinct data, and `is_whole` holds exactly when the cut is the identity (at TP 1 all but the
/// tensors whose heads are regrouped, such as GDN's fused q/k/v).
#[test]
fn apply_owned_matches_apply_and_tp1_is_whole() {
    for p in PRESETS
        .iter()
        .filter(|p| matches!(p.name, "tiny" | "tiny-latent" | "small"))
    {
        let json = preset_config(p.family, p.name, None, 4096, 1, 2).expect("preset");
        let config = ModelConfig::from_json(&json).expect("config");
        let mut whole_at_tp1 = 0;
        for tp in 1..=3 {
            for r in 0..tp {
                let Ok(plan) = RankPlan::new(&config, tp, r, &|_| false) else {
                    continue;
                };
                for t in plan.tensors() {
                    let n: usize = t.source_shape.iter().product();
                    let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
                    let cut = t.apply(&data);
                    assert_eq!(
                        t.is_whole(),
                        cut == data,
                        "{} {} tp {tp} rank {r}: {:?}",
                        p.name,
                        t.name,
                        t.cut
                    );
                    assert_eq!(t.apply_owned(data), cut, "{} {} tp {tp} rank {r}", p.name, t.name);
                    whole_at_tp1 += usize::from(tp == 1 && t.is_whole());
                }
            }
        }
        assert!(whole_at_tp1 > 0, "{}: nothing whole at TP 1", p.name);
    }
}
