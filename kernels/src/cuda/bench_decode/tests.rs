//! The sweep, the row forms, the byte model (against the CPU twins' own traffic) and the markdown, all on the CPU.

use super::bytes::{baseline_row, gdn_row, launch_bytes, mamba2_row, row_forms, RowForm};
use super::render::{cell, markdown};
use super::*;
use crate::cpu::replay_gdn::{self, GdnRingBuf, GdnTokens};
use crate::cpu::replay_mamba2::{self, Mamba2RingBuf, Mamba2Tokens};
use crate::cuda::parity::Rng;

#[test]
fn default_sweep_covers_the_issue() {
    let s = Sweep::default();
    assert_eq!(s.validate(), Ok(()));
    assert_eq!(s.batches, [1, 8, 32, 64, 128, 256, 512]);
    let k = s.kernels();
    // 2 recurrent forms, 4 replay and 4 flush steps, 3 verify windows plain and flushing, the baseline's verify per
    // window and its commit per accepted count 0 ..= 6.
    assert_eq!(k.len(), 2 + 4 + 4 + 3 + 3 + 3 + 7);
    assert_eq!(k.last(), Some(&Kernel::BaselineCommit { accepted: 6 }));
    assert_eq!(k[0], Kernel::RecurrentStep);
    assert!(k.contains(&Kernel::Verify { l: 16, t: 6 }));
    assert_eq!(s.ring_rows(), 32);
    assert_eq!(s.max_t(), 6);
    assert_eq!(s.cases().len(), 2 * k.len() * 7);
}

#[test]
fn bad_sweeps_are_refused() {
    let bad = |f: fn(&mut Sweep)| {
        let mut s = Sweep::default();
        f(&mut s);
        s.validate().expect_err("accepted a bad sweep")
    };
    assert!(bad(|s| s.batches = vec![0]).contains("batch"));
    assert!(bad(|s| s.batches.clear()).contains("batch"));
    assert!(bad(|s| s.repeats = 0).contains("repeats"));
    assert!(bad(|s| s.ring_lens = vec![1]).contains("L = 1"));
    assert!(bad(|s| s.windows = vec![9]).contains("2T = 18"));
    assert!(bad(|s| s.windows = vec![0]).contains("T = 0"));
    assert!(bad(|s| s.families.clear()).contains("family"));
    assert_eq!(Family::parse_list("all"), Ok(Family::ALL.to_vec()));
    assert_eq!(Family::parse_list("gdn"), Ok(vec![Family::Gdn]));
    assert!(Family::parse_list("mamba3").is_err());
}

/// The engine's flush rule.
fn flushes(r: RowForm, l: usize) -> bool {
    replay_mamba2::needs_flush(r.fill, r.t, l)
}

#[test]
fn row_forms_follow_the_flush_rule() {
    for batch in [1, 3, 8, 64, 512] {
        for l in [4, 8, 16, 32] {
            let plain = row_forms(Kernel::Replay { l }, batch);
            assert!(plain.iter().all(|r| !flushes(*r, l) && r.fold == 0 && r.t == 1));
            let flush = row_forms(Kernel::ReplayFlush { l }, batch);
            assert!(flush.iter().all(|r| flushes(*r, l) && r.fold == l && r.fill + r.t <= l));
            if batch >= l - 1 {
                // Every fill the rule allows shows up.
                let mut fills: Vec<usize> = plain.iter().map(|r| r.fill).collect();
                fills.dedup();
                assert_eq!(fills, (0..=l - 2).collect::<Vec<_>>(), "L = {l}, batch {batch}");
            }
        }
        for t in [2, 4, 6] {
            let l = 16;
            let v = row_forms(Kernel::Verify { l, t }, batch);
            assert!(v.iter().all(|r| !flushes(*r, l) && r.fold == 0 && r.t == t));
            let vf = row_forms(Kernel::VerifyFlush { l, t }, batch);
            assert!(vf
                .iter()
                .all(|r| flushes(*r, l) && r.fold == r.fill && r.fill + t <= l && r.t == t));
        }
    }
    // A single row sits mid-ring, not at an empty one.
    assert_eq!(row_forms(Kernel::Replay { l: 16 }, 1)[0].fill, 7);
    assert_eq!(
        row_forms(Kernel::RecurrentReplay, 2),
        vec![RowForm { fill: 0, t: 1, fold: 1 }; 2]
    );
}

fn random(rng: &mut Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.uniform(lo, hi)).collect()
}

/// Mamba-2 tokens from owned x, dt, B, C.
fn m2([x, dt, b, c]: &[Vec<f32>; 4]) -> Mamba2Tokens<'_> {
    Mamba2Tokens { x, dt, b, c }
}

/// GDN tokens from owned q, k, v, g, β.
fn gd([q, k, v, g, beta]: &[Vec<f32>; 5]) -> GdnTokens<'_> {
    GdnTokens { q, k, v, g, beta }
}

#[test]
fn mamba2_bytes_match_the_cpu_twins() {
    let d = crate::cpu::mamba2::Mamba2Dims {
        heads: 4,
        head_dim: 3,
        state_dim: 5,
        groups: 2,
    };
    let rng = &mut Rng::new(5);
    let (cap, t) = (16, 3);
    let mut s0 = random(rng, d.heads * d.head_dim * d.state_dim, -1.0, 1.0);
    let a = random(rng, d.heads, -2.0, -0.1);
    let dsk = random(rng, d.heads, -1.0, 1.0);
    // x, dt, B, C of `t` tokens.
    let tokens = |rng: &mut Rng, t: usize| {
        [
            random(rng, t * d.heads * d.head_dim, -1.0, 1.0),
            random(rng, t * d.heads, 0.01, 0.5),
            random(rng, t * d.groups * d.state_dim, -1.0, 1.0),
            random(rng, t * d.groups * d.state_dim, -1.0, 1.0),
        ]
    };
    let mut ring = Mamba2RingBuf::new(d, cap);
    for h in 0..6 {
        let drafts = tokens(rng, t);
        let mut y = vec![0.0; t * d.heads * d.head_dim];
        let got = replay_mamba2::verify_replay(Some(&mut s0), &mut ring.view(), m2(&drafts), &a, &dsk, &mut y, false);
        assert_eq!(got, mamba2_row(d, RowForm { fill: h, t, fold: 0 }), "verify at h = {h}");
        replay_mamba2::commit_replay(&mut ring.view(), 0);
        let tok = tokens(rng, 1);
        let mut y = vec![0.0; d.heads * d.head_dim];
        let got = replay_mamba2::replay_decode(Some(&mut s0), &mut ring.view(), m2(&tok), &a, &dsk, &mut y, false);
        assert_eq!(
            got,
            mamba2_row(d, RowForm { fill: h, t: 1, fold: 0 }),
            "decode at h = {h}"
        );
    }
    // A flushing decode at h = 6 folds all 7 entries: one state written more.
    let tok = tokens(rng, 1);
    let mut y = vec![0.0; d.heads * d.head_dim];
    let got = replay_mamba2::replay_decode(Some(&mut s0), &mut ring.view(), m2(&tok), &a, &dsk, &mut y, true);
    assert_eq!(got, mamba2_row(d, RowForm { fill: 6, t: 1, fold: 7 }));
    // The serial baseline from the state after those 7 entries (any state: traffic does not depend on it).
    let drafts = tokens(rng, t);
    let mut snaps = vec![0.0; t * s0.len()];
    let mut y = vec![0.0; t * d.heads * d.head_dim];
    let got = replay_mamba2::verify_baseline(d, &s0, m2(&drafts), &a, &dsk, &mut snaps, &mut y);
    let model = |k| baseline_row(k, |r| mamba2_row(d, r));
    assert_eq!(got, model(Kernel::BaselineVerify { t }));
    for accepted in 0..=t {
        let got = replay_mamba2::commit_baseline(d, &mut s0, &snaps, accepted);
        assert_eq!(got, model(Kernel::BaselineCommit { accepted }), "{accepted} accepted");
    }
    assert_eq!(
        replay_mamba2::recurrent_step_traffic(d).total(),
        mamba2_row(d, RowForm { fill: 0, t: 1, fold: 1 }).total()
            - mamba2_row(d, RowForm { fill: 1, t: 0, fold: 0 }).ring_read,
        "a recurrent step is a folding replay row that appends no ring entry"
    );
}

#[test]
fn gdn_bytes_match_the_cpu_twins() {
    let d = crate::cpu::gdn::GdnDims {
        k_heads: 2,
        v_heads: 4,
        k_dim: 4,
        v_dim: 3,
    };
    let rng = &mut Rng::new(6);
    let (cap, t) = (16, 3);
    let mut s0 = random(rng, d.state_len(), -1.0, 1.0);
    // q, k, v, g, β of `t` tokens.
    let tokens = |rng: &mut Rng, t: usize| {
        [
            random(rng, t * d.k_heads * d.k_dim, -0.5, 0.5),
            random(rng, t * d.k_heads * d.k_dim, -0.5, 0.5),
            random(rng, t * d.v_heads * d.v_dim, -1.0, 1.0),
            random(rng, t * d.v_heads, -0.5, -0.01),
            random(rng, t * d.v_heads, 0.1, 0.9),
        ]
    };
    let mut ring = GdnRingBuf::new(d, cap);
    for h in 0..6 {
        let flush = h == 5;
        let drafts = tokens(rng, t);
        let mut out = vec![0.0; t * d.v_heads * d.v_dim];
        let got = replay_gdn::verify_replay(Some(&mut s0), &mut ring.view(), gd(&drafts), &mut out, flush);
        let fold = if flush { h } else { 0 };
        assert_eq!(got, gdn_row(d, RowForm { fill: h, t, fold }), "verify at h = {h}");
        replay_gdn::commit_replay(&mut ring.view(), 0);
        if flush {
            break;
        }
        let tok = tokens(rng, 1);
        let mut out = vec![0.0; d.v_heads * d.v_dim];
        let got = replay_gdn::replay_decode(Some(&mut s0), &mut ring.view(), gd(&tok), &mut out, false);
        assert_eq!(got, gdn_row(d, RowForm { fill: h, t: 1, fold: 0 }), "decode at h = {h}");
    }
    let drafts = tokens(rng, t);
    let mut snaps = vec![0.0; t * s0.len()];
    let mut out = vec![0.0; t * d.v_heads * d.v_dim];
    let got = replay_gdn::verify_baseline(d, &s0, gd(&drafts), &mut snaps, &mut out);
    let model = |k| baseline_row(k, |r| gdn_row(d, r));
    assert_eq!(got, model(Kernel::BaselineVerify { t }));
    for accepted in 0..=t {
        let got = replay_gdn::commit_baseline(d, &mut s0, &snaps, accepted);
        assert_eq!(got, model(Kernel::BaselineCommit { accepted }), "{accepted} accepted");
    }
}

#[test]
fn launch_bytes_sum_rows_at_real_shapes() {
    let rows = row_forms(Kernel::RecurrentStep, 4);
    let rec = replay_gdn::recurrent_step_traffic(Family::gdn_dims()).total();
    assert_eq!(launch_bytes(Family::Gdn, Kernel::RecurrentStep, &rows), 4 * rec);
    // Nemotron-H-8B: one state is 4 MiB; a replay row at fill 7 reads it once and 8 ring entries' worth more.
    let r = RowForm { fill: 7, t: 1, fold: 0 };
    let m = mamba2_row(Family::mamba2_dims(), r);
    assert_eq!(m.state_read, 4 << 20);
    assert_eq!(m.ring_read, 7 * (128 * (2 * 64 + 4) + 8 * 2 * 128));
    assert_eq!(
        launch_bytes(Family::Mamba2, Kernel::Replay { l: 16 }, &[r, r]),
        2 * m.total()
    );
}

fn report() -> Report {
    let sweep = Sweep {
        families: vec![Family::Mamba2],
        batches: vec![64, 256],
        ring_lens: vec![16],
        windows: vec![4],
        verify_ring: 16,
        warmup: 1,
        repeats: 3,
    };
    let copy = 3000.0;
    let mut rows = Vec::new();
    for (f, k, b) in sweep.cases() {
        // Made-up times: the recurrent step 1 ms per 256 rows, replay half that, flush and verify slower.
        let per = match k {
            Kernel::RecurrentStep | Kernel::RecurrentReplay => 1.0,
            Kernel::Replay { .. } => 0.5,
            Kernel::ReplayFlush { .. } => 1.2,
            _ => 0.6,
        } * b as f64
            / 256.0;
        rows.push(Row::new(f, k, b, &[per * 0.9, per, per * 1.1], 1.2e9 * per, copy));
    }
    let mut r = Report {
        device: "Test GPU".into(),
        arch: (9, 0),
        sm_count: 132,
        copy_gbs: copy,
        read_gbs: 1.1 * copy,
        sweep,
        rows,
    };
    r.relate();
    r
}

#[test]
fn rows_carry_the_median_spread_and_roofline() {
    let r = report();
    let row = r.find(Family::Mamba2, Kernel::Replay { l: 16 }, 256).expect("row");
    assert_eq!((row.ms, row.ms_min, row.ms_max), (0.5, 0.45, 0.55));
    assert!((row.gbs - 1200.0).abs() < 1e-9 && (row.frac_copy - 0.4).abs() < 1e-12);
    assert_eq!(row.vs_recurrent, Some(0.5));
    assert_eq!(row.commit, None);
    let v = r
        .find(Family::Mamba2, Kernel::Verify { l: 16, t: 4 }, 64)
        .expect("verify row");
    assert_eq!((v.commit, v.accepted), (Some(REPLAY_COMMIT), None));
    let v = r
        .find(Family::Mamba2, Kernel::BaselineVerify { t: 4 }, 64)
        .expect("baseline row");
    assert_eq!((v.commit, v.accepted), (Some(BASELINE_COMMIT), None));
    let c = r
        .find(Family::Mamba2, Kernel::BaselineCommit { accepted: 3 }, 64)
        .expect("commit row");
    assert_eq!((c.commit, c.accepted), (None, Some(3)));
    assert_eq!(cell(Some(row)), "0.500 ms · 0.40");
    assert_eq!(cell(None), "-");
}

#[test]
fn markdown_has_a_table_per_family_and_the_targets() {
    let md = markdown(
        &report(),
        &[("commit", "abc1234".into()), ("date", "2026-11-26".into())],
    );
    assert!(md.starts_with("# SSM decode kernels, one layer (Test GPU)"));
    assert!(md.contains("- commit: abc1234\n- date: 2026-11-26\n"));
    assert!(md.contains("copy bandwidth 3000 GB/s"));
    assert!(md.contains("| kernel | batch 64 | batch 256 |\n|---|---|---|\n"));
    assert!(md.contains("| replay L=16 | 0.125 ms · 0.40 | 0.500 ms · 0.40 |"));
    assert!(md.contains("| verify T=4 (L=16) |"));
    assert!(md.contains("| baseline verify T=4 (snapshots) |"));
    assert!(md.contains("| baseline commit, 4 accepted |"));
    // Baseline verify + commit (0.6 + 0.6) over replay verify (0.6), at every batch.
    assert!(md.contains("Baseline (verify + commit) over replay verify (L=16), mamba2:"));
    assert!(md.contains("| T=4, 0 accepted | 2.00× | 2.00× |\n| T=4, 4 accepted | 2.00× | 2.00× |"));
    assert!(!md.contains("Gated DeltaNet"), "only the measured family");
    // Replay at 0.4 of copy misses the roofline; 2× over the recurrent step plainly, (15·0.5 + 1.2)/16 with flushes.
    assert!(md.contains("| mamba2 | replay L=16 ≥ 0.95 of its byte roofline | 256 | 0.40 | **no** |"));
    assert!(md.contains("| 2.00× (1.84× with the flush step every 16) | yes |"));
    assert!(md.contains("verify T=4 ≤ 1.3× one replay L=16 step"));
    assert!(md.contains("| 64 | 1.20× | yes |"));
}
