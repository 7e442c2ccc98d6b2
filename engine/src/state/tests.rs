//! Tests of [`StatePools`] as a whole: views, errors, and a model-based property test of random
//! alloc / free / grow / truncate / commit / flush sequences.

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::kv::NO_BLOCK;
use super::*;
use crate::model::{Family, ModelConfig};
use crate::presets::preset_config;

fn tiny(family: Family) -> ModelConfig {
    ModelConfig::from_json(&preset_config(family, "tiny", None, 512, 1, 2).expect("preset")).expect("parse")
}

fn pools(slots: usize, t: usize, l: usize, kv_blocks: Option<usize>) -> StatePools {
    let mut cfg = PoolConfig::new(slots, 40);
    cfg.spec_window = t;
    cfg.buffer_len = l;
    cfg.kv_block_size = 4;
    cfg.kv_blocks = kv_blocks;
    StatePools::new(&tiny(Family::NemotronH), cfg).expect("pools")
}

#[test]
fn layout_follows_the_model() {
    // Nemotron tiny is `M*-M-E`: Mamba-2 layers 0 and 1, one attention layer.
    let mut p = pools(3, 2, 8, None);
    assert_eq!((p.num_ssm_layers(), p.num_attention_layers()), (2, 1));
    assert_eq!(
        &p.block_refs()[..3],
        &[StateRef::Ssm(0), StateRef::Attention(0), StateRef::None]
    );
    let slot = p.alloc().expect("alloc");
    let v = p.mamba2_slot_mut(1, slot).expect("view");
    // tiny: 4 heads × 16, state 16, 2 groups, K 4 → conv_dim 64 + 64.
    assert_eq!(v.state.len(), 4 * 16 * 16);
    assert_eq!((v.x.len(), v.dt.len(), v.b.len()), (8 * 64, 8 * 4, 8 * 32));
    assert_eq!(v.conv.len(), (3 + 2) * 128);
    assert_eq!((v.ring.capacity, v.conv_ring.capacity, v.conv_ring.len), (8, 5, 3));
    assert!(matches!(
        p.gdn_slot_mut(0, slot),
        Err(PoolError::Layer { layer: 0, .. })
    ));
    assert!(matches!(
        p.ssm_slot_mut(2, slot),
        Err(PoolError::Layer { layer: 2, .. })
    ));
    assert!(matches!(p.kv_slot_mut(0, 2), Err(PoolError::NotAllocated { slot: 2 })));
    assert!(matches!(
        p.ring_commit(7, 1),
        Err(PoolError::SlotOutOfRange { slot: 7, .. })
    ));

    let mut cfg = PoolConfig::new(2, 40);
    cfg.spec_window = 4;
    cfg.buffer_len = 16;
    let mut q = StatePools::new(&tiny(Family::Qwen35), cfg).expect("qwen pools");
    let slot = q.alloc().expect("alloc");
    let v = q.gdn_slot_mut(0, slot).expect("gdn view");
    // tiny: 2 key heads × 16, 4 value heads × 24, K 4 → conv_dim 2·32 + 96.
    assert_eq!(v.state.len(), 4 * 24 * 16);
    assert_eq!((v.u.len(), v.k.len(), v.g.len()), (16 * 96, 16 * 32, 16 * 4));
    assert_eq!(v.conv.len(), 7 * 160);
}

#[test]
fn kv_only_slots_use_a_longer_ring_in_shared_rows() {
    let mut cfg = PoolConfig::new(3, 40);
    cfg.spec_window = 2;
    cfg.buffer_len = 4;
    cfg.kv_only_ring = Some(10);
    cfg.kv_block_size = 4;
    let mut p = StatePools::new(&tiny(Family::NemotronH), cfg).expect("pools");
    let plain = pools(3, 2, 4, None);
    let widths: usize = (0..p.num_ssm_layers())
        .map(|i| p.ssm_layer(i).expect("layer").dims().entry_len())
        .sum();
    assert_eq!(p.ssm_layer(0).expect("layer").ring_rows(), 10);
    assert_eq!(
        p.storage_values() - plain.storage_values(),
        3 * 6 * widths,
        "three slots, six more rows each in every SSM layer"
    );
    let (a, b) = (p.alloc().expect("alloc"), p.alloc().expect("alloc"));
    p.set_form(b, DecodeForm::KvOnly).expect("kv-only on an empty ring");
    let v = p.mamba2_slot_mut(0, b).expect("view");
    assert_eq!((v.ring.capacity, v.x.len()), (10, 10 * 64));
    v.x.fill(1.0);
    let v = p.mamba2_slot_mut(0, a).expect("view");
    assert_eq!((v.ring.capacity, v.x.len()), (4, 4 * 64));
    assert!(v.x.iter().all(|&x| x == 0.0), "slots do not overlap");
    p.ring_commit(b, 9).expect("commit");
    assert!(p.set_form(b, DecodeForm::Replay).is_err(), "resize under entries");
    p.ring_flush(b, 9).expect("flush");
    p.set_form(b, DecodeForm::Replay).expect("resize when empty");
    assert_eq!(p.counters().ring(b).capacity, 4);
    p.free(b).expect("free");
    assert_eq!(p.counters().ring_cap()[b], 4, "a free slot has the default form's ring");
}

#[test]
fn bad_configs_are_clear_errors() {
    let m = tiny(Family::NemotronH);
    let mut c = PoolConfig::new(2, 16);
    c.spec_window = 16;
    let e = StatePools::new(&m, c).unwrap_err().to_string();
    assert!(e.contains("buffer length 16") && e.contains("17 tokens"), "{e}");
    let e = StatePools::new(&m, PoolConfig::new(0, 16)).unwrap_err().to_string();
    assert!(e.contains("slot count must be in 1..="), "{e}");
    let e = StatePools::new(&m, PoolConfig::new(MAX_SLOTS + 1, 16))
        .unwrap_err()
        .to_string();
    assert!(e.contains("slot count"), "{e}");
    let mut c = PoolConfig::new(MAX_SLOTS, 16);
    c.buffer_len = 1 << 31;
    assert!(StatePools::new(&m, c).unwrap_err().to_string().contains("would need"));
    let mut c = PoolConfig::new(2, 16);
    c.kv_blocks = Some(1 << 31);
    let e = StatePools::new(&m, c).unwrap_err().to_string();
    assert!(e.contains("could not allocate") && e.contains("TiB"), "{e}");
    let mut c = PoolConfig::new(2, 16);
    c.kv_blocks = Some(u32::MAX as usize);
    assert!(StatePools::new(&m, c).unwrap_err().to_string().contains("fewer than"));
    let mut c = PoolConfig::new(2, 16);
    c.kv_block_size = 0;
    assert!(StatePools::new(&m, c).unwrap_err().to_string().contains("block size"));
}

#[test]
fn ring_entries_survive_commit_flush_and_rollback() {
    let mut p = pools(1, 2, 6, None);
    let s = p.alloc().expect("alloc");
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut logical: Vec<f32> = Vec::new(); // dt[head 0] of every committed entry, oldest first
    for step in 0..40 {
        let h = p.counters().ring_len()[s] as usize;
        if counters::needs_flush(h, 3, 6) {
            p.ring_flush(s, h).expect("flush");
            logical.clear();
        }
        // A verify step writes T + 1 = 3 entries after the cached ones, then accepts a random prefix.
        let drafts: Vec<f32> = (0..3).map(|_| rng.random_range(1.0..2.0f32)).collect();
        {
            let v = p.mamba2_slot_mut(0, s).expect("view");
            for (j, d) in drafts.iter().enumerate() {
                v.dt[v.ring.physical(v.ring.len + j) * 4] = *d;
            }
        }
        let accepted = rng.random_range(1..=3usize);
        p.ring_commit(s, accepted).expect("commit");
        p.conv_advance(s, accepted).expect("conv");
        logical.extend_from_slice(&drafts[..accepted]);
        let v = p.mamba2_slot_mut(0, s).expect("view");
        let read: Vec<f32> = (0..v.ring.len).map(|j| v.dt[v.ring.physical(j) * 4]).collect();
        assert_eq!(read, logical, "step {step}");
    }
}

#[test]
fn kv_views_follow_growth_and_rollback() {
    let mut p = pools(2, 0, 4, Some(6));
    let a = p.alloc().expect("a");
    let b = p.alloc().expect("b");
    p.kv_grow(a, 5).expect("a: 2 blocks");
    p.kv_grow(b, 9).expect("b: 3 blocks");
    assert!(matches!(
        p.kv_grow(a, 13),
        Err(PoolError::KvBlocksFull { needed: 2, free: 1, .. })
    ));
    assert_eq!(p.counters().kv_len()[a], 5, "failed growth leaves the length");
    let row = |pos: usize| -> Vec<f32> { (0..32).map(|c| (pos * 32 + c) as f32 + 0.5).collect() };
    {
        let mut v = p.kv_slot_mut(0, a).expect("view");
        for pos in 0..5 {
            v.write(pos, &row(pos), &row(pos + 100));
        }
    }
    p.kv_truncate(a, 3).expect("rollback two drafts");
    assert_eq!(p.kv_blocks().held(a), 1, "the second block is returned");
    assert!(matches!(
        p.kv_truncate(a, 4),
        Err(PoolError::KvLength { op: "truncate", .. })
    ));
    assert!(matches!(p.kv_grow(a, 2), Err(PoolError::KvLength { op: "grow", .. })));
    let v = p.kv_slot_mut(0, a).expect("view");
    assert_eq!(v.len, 3);
    for pos in 0..3 {
        assert_eq!(v.key(pos), &row(pos)[..]);
        assert_eq!(v.value(pos), &row(pos + 100)[..]);
    }
    p.free(b).expect("free b");
    assert_eq!(p.free(b), Err(PoolError::DoubleFree { slot: b }));
    assert_eq!(p.kv_blocks().free_count(), 5);
}

/// One step of the property test; slot arguments may be out of range or free.
#[derive(Clone, Debug)]
enum Op {
    Alloc,
    Free(usize),
    Grow(usize, usize),
    Truncate(usize, usize),
    Commit(usize, usize),
    Flush(usize, usize),
    Conv(usize, usize),
    Scribble(usize, u64),
}

fn op() -> impl Strategy<Value = Op> {
    let slot = 0..5usize;
    prop_oneof![
        3 => Just(Op::Alloc),
        2 => slot.clone().prop_map(Op::Free),
        3 => (slot.clone(), 0..50usize).prop_map(|(s, n)| Op::Grow(s, n)),
        2 => (slot.clone(), 0..50usize).prop_map(|(s, n)| Op::Truncate(s, n)),
        2 => (slot.clone(), 0..5usize).prop_map(|(s, n)| Op::Commit(s, n)),
        2 => (slot.clone(), 0..5usize).prop_map(|(s, n)| Op::Flush(s, n)),
        1 => (slot.clone(), 0..5usize).prop_map(|(s, n)| Op::Conv(s, n)),
        1 => (slot, any::<u64>()).prop_map(|(s, seed)| Op::Scribble(s, seed)),
    ]
}

/// What a slot's counters should be.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Model {
    kv: usize,
    start: usize,
    h: usize,
    conv: usize,
}

const SLOTS: usize = 4;
const L: usize = 6;
const T: usize = 2;
const BLOCK: usize = 4;
const BLOCKS: usize = 20;

fn check(p: &StatePools, model: &[Option<Model>]) -> Result<(), TestCaseError> {
    let kv = p.kv_blocks();
    let mut owned = [false; BLOCKS];
    for &b in kv.free_blocks() {
        prop_assert!(!owned[b as usize], "block {} twice on the free list", b);
        owned[b as usize] = true;
    }
    for (s, m) in model.iter().enumerate() {
        prop_assert_eq!(p.slots().is_allocated(s), m.is_some());
        let m = m.unwrap_or_default();
        for &b in kv.table(s) {
            prop_assert!(!owned[b as usize], "block {} owned twice", b);
            owned[b as usize] = true;
        }
        let row = &kv.tables()[s * kv.blocks_per_slot()..(s + 1) * kv.blocks_per_slot()];
        prop_assert!(row[kv.held(s)..].iter().all(|&b| b == NO_BLOCK));
        prop_assert_eq!(kv.held(s), m.kv.div_ceil(BLOCK));
        let c = p.counters();
        prop_assert_eq!(
            (
                c.kv_len()[s] as usize,
                c.ring_start()[s] as usize,
                c.ring_len()[s] as usize
            ),
            (m.kv, m.start, m.h)
        );
        prop_assert_eq!(c.conv_head()[s] as usize, m.conv);
    }
    prop_assert!(owned.iter().all(|&o| o), "a block is neither free nor owned");
    prop_assert_eq!(kv.free_count() + kv.used_count(), BLOCKS);
    prop_assert_eq!(p.slots().free_count() + p.slots().used_count(), SLOTS);
    Ok(())
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut p = pools(SLOTS, T, L, Some(BLOCKS));
    let mut model: Vec<Option<Model>> = vec![None; SLOTS];
    let max_kv = 40usize.div_ceil(BLOCK) * BLOCK;
    for op in ops {
        let live = |s: usize| model.get(s).copied().flatten();
        match op {
            Op::Alloc => match p.alloc() {
                Ok(s) => {
                    prop_assert!(model[s].is_none(), "slot {} handed out twice", s);
                    model[s] = Some(Model::default());
                    // A reused slot starts from zero state, whatever the previous sequence left.
                    for layer in 0..p.num_ssm_layers() {
                        let v = p.ssm_slot_mut(layer, s).expect("view");
                        prop_assert!(v.state.iter().chain(v.conv.iter()).all(|&x| x == 0.0));
                    }
                    prop_assert_eq!(p.counters().form_of(s), DecodeForm::Replay);
                    prop_assert_eq!(p.counters().flush()[s], 0);
                }
                Err(e) => {
                    prop_assert_eq!(e, PoolError::SlotsFull { capacity: SLOTS });
                    prop_assert!(model.iter().all(Option::is_some));
                }
            },
            Op::Free(s) => {
                let r = p.free(s);
                prop_assert_eq!(r.is_ok(), live(s).is_some(), "{:?}", r);
                if let Some(m) = model.get_mut(s) {
                    *m = None;
                }
            }
            Op::Grow(s, n) => {
                let free_before = p.kv_blocks().free_count();
                let r = p.kv_grow(s, n);
                match live(s) {
                    Some(m) => {
                        let extra = n.div_ceil(BLOCK).saturating_sub(m.kv.div_ceil(BLOCK));
                        let ok = n >= m.kv && n <= max_kv && extra <= free_before;
                        prop_assert_eq!(r.is_ok(), ok, "{:?} {:?}", r, m);
                        if ok {
                            model[s] = Some(Model { kv: n, ..m });
                        }
                    }
                    None => prop_assert!(r.is_err()),
                }
            }
            Op::Truncate(s, n) => {
                let r = p.kv_truncate(s, n);
                match live(s) {
                    Some(m) => {
                        prop_assert_eq!(r.is_ok(), n <= m.kv);
                        if n <= m.kv {
                            model[s] = Some(Model { kv: n, ..m });
                        }
                    }
                    None => prop_assert!(r.is_err()),
                }
            }
            Op::Commit(s, n) => {
                let r = p.ring_commit(s, n);
                match live(s) {
                    Some(m) => {
                        prop_assert_eq!(r.is_ok(), m.h + n <= L);
                        if m.h + n <= L {
                            model[s] = Some(Model { h: m.h + n, ..m });
                        }
                    }
                    None => prop_assert!(r.is_err()),
                }
            }
            Op::Flush(s, n) => {
                let r = p.ring_flush(s, n);
                match live(s) {
                    Some(m) => {
                        prop_assert_eq!(r.is_ok(), n <= m.h);
                        if n <= m.h {
                            model[s] = Some(Model {
                                h: m.h - n,
                                start: (m.start + n) % L,
                                ..m
                            });
                        }
                    }
                    None => prop_assert!(r.is_err()),
                }
            }
            Op::Conv(s, n) => {
                let r = p.conv_advance(s, n);
                match live(s) {
                    Some(m) => {
                        prop_assert_eq!(r.is_ok(), n <= T + 1);
                        if n <= T + 1 {
                            model[s] = Some(Model {
                                conv: (m.conv + n) % (3 + T),
                                ..m
                            });
                        }
                    }
                    None => prop_assert!(r.is_err()),
                }
            }
            Op::Scribble(s, seed) => {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                if live(s).is_some() {
                    for layer in 0..p.num_ssm_layers() {
                        let v = p.ssm_slot_mut(layer, s).expect("view");
                        v.state.iter_mut().for_each(|x| *x = rng.random_range(-1.0..1.0));
                        v.conv.iter_mut().for_each(|x| *x = rng.random_range(-1.0..1.0));
                    }
                    p.set_form(s, DecodeForm::KvOnly).expect("form");
                    p.set_flush(s, true).expect("flush flag");
                } else {
                    prop_assert!(p.ssm_slot_mut(0, s).is_err());
                }
            }
        }
        check(&p, &model)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn random_sequences_keep_invariants(ops in prop::collection::vec(op(), 1..120)) {
        run(ops)?;
    }
}
