//! Every replay form against [`mamba2_step`] run on the committed token history.

use super::*;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const TOL: f64 = 1e-5;

/// `‖got − want‖ / ‖want‖`, with `‖want‖` floored at `0.1·√len`. Outputs and states here are O(1) an element, but a
/// vector of one or two elements can cancel to nearly zero (e.g. `y = S·C + D·x` ≈ 0.004 from terms summing to 1.5 in
/// absolute value), and then any two f32 evaluation orders, the oracle's included, agree only to ~1e-7 absolute.
fn rel(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let diff: f64 = got.iter().zip(want).map(|(g, w)| ((g - w) as f64).powi(2)).sum();
    let norm: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
    (diff / norm.max(0.01 * want.len() as f64)).sqrt()
}

fn uniform(rng: &mut ChaCha8Rng, len: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(lo..hi)).collect()
}

/// `t` tokens of owned inputs.
struct Tokens {
    x: Vec<f32>,
    dt: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
}

impl Tokens {
    fn random(rng: &mut ChaCha8Rng, d: Mamba2Dims, t: usize) -> Self {
        Tokens {
            x: uniform(rng, t * d.heads * d.head_dim, -1.0, 1.0),
            // Some steps decay almost nothing, some almost everything.
            dt: (0..t * d.heads).map(|_| rng.random_range(-7.0f32..1.0).exp()).collect(),
            b: uniform(rng, t * d.groups * d.state_dim, -1.0, 1.0),
            c: uniform(rng, t * d.groups * d.state_dim, -1.0, 1.0),
        }
    }

    fn view(&self) -> Mamba2Tokens<'_> {
        Mamba2Tokens {
            x: &self.x,
            dt: &self.dt,
            b: &self.b,
            c: &self.c,
        }
    }
}

/// The recurrence from `state` over `tok`: every output `[t, heads, head_dim]` and the state after each token.
fn oracle(d: Mamba2Dims, state: &[f32], tok: &Tokens, a: &[f32], dsk: &[f32]) -> (Vec<f32>, Vec<Vec<f32>>) {
    let (hp, gn, h) = (d.heads * d.head_dim, d.groups * d.state_dim, d.heads);
    let t = tok.dt.len() / h;
    let mut s = state.to_vec();
    let mut y = vec![f32::NAN; t * hp];
    let mut states = Vec::with_capacity(t);
    for i in 0..t {
        mamba2_step(
            d,
            &mut s,
            &tok.x[i * hp..(i + 1) * hp],
            &tok.dt[i * h..(i + 1) * h],
            a,
            &tok.b[i * gn..(i + 1) * gn],
            &tok.c[i * gn..(i + 1) * gn],
            dsk,
            &mut y[i * hp..(i + 1) * hp],
        );
        states.push(s.clone());
    }
    (y, states)
}

/// One slot driven through random events, with the oracle's state after every committed token of its sequence.
struct Sim {
    dims: Mamba2Dims,
    window: usize,
    threshold: usize,
    rng: ChaCha8Rng,
    ring: Mamba2RingBuf,
    s0: Vec<f32>,
    kv_only: bool,
    a: Vec<f32>,
    d: Vec<f32>,
    /// `history[k]`: the state after `k` committed tokens (`history[0]` the sequence's initial state).
    history: Vec<Vec<f32>>,
    /// Committed tokens folded into `s0`.
    ckpt: usize,
}

impl Sim {
    fn new(dims: Mamba2Dims, capacity: usize, window: usize, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut ring = Mamba2RingBuf::new(dims, capacity);
        // A fresh ring holds NaN so that reading a row never written poisons the outputs.
        for v in ring.x.iter_mut().chain(ring.dt.iter_mut()).chain(ring.b.iter_mut()) {
            *v = f32::NAN;
        }
        ring.index.start = rng.random_range(0..capacity);
        let a = uniform(&mut rng, dims.heads, -4.0, -0.05);
        let d = uniform(&mut rng, dims.heads, -1.0, 1.0);
        let mut sim = Sim {
            dims,
            window,
            threshold: 0,
            rng,
            ring,
            s0: vec![f32::NAN; state_len(dims)],
            kv_only: true,
            a,
            d,
            history: Vec::new(),
            ckpt: 0,
        };
        sim.new_sequence();
        sim
    }

    /// A new sequence in this slot: the counters reset, the ring keeps its stale rows. It starts either KV-only (no
    /// checkpoint; `s0` holds NaN that must never be read) or in replay from a random checkpoint (as after a prefill).
    fn new_sequence(&mut self) {
        self.ring.index.reset();
        self.kv_only = self.rng.random_bool(0.5);
        self.threshold = self.rng.random_range(0..=self.ring.index.capacity);
        let initial = if self.kv_only {
            self.s0.fill(f32::NAN);
            vec![0.0; state_len(self.dims)]
        } else {
            self.s0 = uniform(&mut self.rng, state_len(self.dims), -1.0, 1.0);
            self.s0.clone()
        };
        self.history = vec![initial];
        self.ckpt = 0;
    }

    fn committed(&self) -> usize {
        self.history.len() - 1
    }

    fn check_invariants(&self, what: &str) {
        assert_eq!(self.ring.index.len, self.committed() - self.ckpt, "{what}: ring length");
        if !self.kv_only {
            let e = rel(&self.s0, &self.history[self.ckpt]);
            assert!(e < TOL, "{what}: checkpoint after {} tokens: {e:e}", self.ckpt);
        }
    }

    fn flush(&mut self, count: usize) {
        flush(&mut self.s0, &mut self.ring.view(), count, &self.a);
        self.ckpt += count;
        self.check_invariants("flush");
    }

    fn compress(&mut self) {
        let count = self.ring.index.len;
        compress(&mut self.s0, &mut self.ring.view(), &self.a);
        self.kv_only = false;
        self.ckpt += count;
        self.check_invariants("compress");
    }

    /// The policy before a step appending `t` entries.
    fn prepare(&mut self, t: usize) {
        let (h, cap) = (self.ring.index.len, self.ring.index.capacity);
        if self.kv_only {
            if needs_compress(h, t, self.threshold, cap) {
                self.compress();
            }
        } else if needs_flush(h, t, cap) {
            self.flush(h);
        }
    }

    fn decode(&mut self) {
        self.prepare(1);
        // Sometimes the step folds everything itself (the fused flush), whether or not the policy asked for one.
        let fused = !self.kv_only && self.rng.random_bool(0.3);
        let h = self.ring.index.len;
        let tok = Tokens::random(&mut self.rng, self.dims, 1);
        let mut y = vec![f32::NAN; self.dims.heads * self.dims.head_dim];
        let s0 = (!self.kv_only).then_some(&mut self.s0[..]);
        let traffic = replay_decode(s0, &mut self.ring.view(), tok.view(), &self.a, &self.d, &mut y, fused);
        assert_eq!(traffic.state_written > 0, fused, "decode at h = {h}");
        let (want, states) = oracle(self.dims, self.history.last().unwrap(), &tok, &self.a, &self.d);
        let e = rel(&y, &want);
        assert!(e < TOL, "decode at h = {h}: {e:e}");
        self.history.extend(states);
        if fused {
            self.ckpt = self.committed();
        }
        self.check_invariants("decode");
    }

    fn verify(&mut self) {
        let t = self.window;
        self.prepare(t);
        let h = self.ring.index.len;
        // Sometimes the verify folds the committed history itself (the fused flush); the drafts never reach it.
        let fused = !self.kv_only && self.rng.random_bool(0.3);
        let tok = Tokens::random(&mut self.rng, self.dims, t);
        let mut y = vec![f32::NAN; t * self.dims.heads * self.dims.head_dim];
        let s0 = (!self.kv_only).then_some(&mut self.s0[..]);
        let traffic = verify_replay(s0, &mut self.ring.view(), tok.view(), &self.a, &self.d, &mut y, fused);
        assert_eq!(traffic.state_written > 0, fused && h > 0, "verify of {t} at h = {h}");
        let (want, states) = oracle(self.dims, self.history.last().unwrap(), &tok, &self.a, &self.d);
        let e = rel(&y, &want);
        assert!(e < TOL, "verify of {t} at h = {h}: {e:e}");
        if fused {
            self.ckpt = self.committed();
            self.check_invariants("fused flush");
        }
        // Sometimes a flush of committed entries lands between verify and commit (the fused-flush order).
        if !self.kv_only && self.rng.random_bool(0.3) {
            let count = self.rng.random_range(0..=self.ring.index.len);
            self.flush(count);
        }
        let accepted = self.rng.random_range(0..=t);
        commit_replay(&mut self.ring.view(), accepted);
        self.history.extend(states.into_iter().take(accepted));
        self.check_invariants("commit");
    }

    fn event(&mut self) {
        match self.rng.random_range(0..20) {
            0..=6 => self.decode(),
            7..=15 => self.verify(),
            16..=17 if self.kv_only => self.compress(),
            16..=17 => {
                let count = self.rng.random_range(0..=self.ring.index.len);
                self.flush(count);
            }
            18 => {
                // A prompt's inputs pushed as committed entries, where they fit without a flush.
                let room = self.ring.index.free();
                let t = self.rng.random_range(0..=room.min(3));
                let tok = Tokens::random(&mut self.rng, self.dims, t);
                self.ring.view().push(&tok.x, &tok.dt, &tok.b);
                let (_, states) = oracle(self.dims, self.history.last().unwrap(), &tok, &self.a, &self.d);
                self.history.extend(states);
                self.check_invariants("push");
            }
            _ => self.new_sequence(),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]

    #[test]
    fn every_form_matches_the_recurrence(
        groups in 1usize..=5,
        heads_per_group in 1usize..=3,
        head_dim in 1usize..=7,
        state_dim in 1usize..=9,
        capacity in 2usize..=32,
        window in 1usize..=6,
        seed in any::<u64>(),
        events in 10usize..=120,
    ) {
        let dims = Mamba2Dims { heads: groups * heads_per_group, head_dim, state_dim, groups };
        let mut sim = Sim::new(dims, capacity, window.min(capacity), seed);
        for _ in 0..events {
            sim.event();
        }
        // Whatever the last event left, folding everything committed reproduces the oracle's state.
        if sim.kv_only {
            sim.compress();
        } else {
            let h = sim.ring.index.len;
            sim.flush(h);
        }
        prop_assert_eq!(sim.ckpt, sim.committed());
    }
}

#[test]
fn rejected_drafts_never_reach_the_flushed_state() {
    let dims = Mamba2Dims {
        heads: 6,
        head_dim: 5,
        state_dim: 7,
        groups: 3,
    };
    let (cap, t) = (12, 4);
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let a = uniform(&mut rng, dims.heads, -2.0, -0.1);
    let d = uniform(&mut rng, dims.heads, -1.0, 1.0);
    let init = uniform(&mut rng, state_len(dims), -1.0, 1.0);
    let committed = Tokens::random(&mut rng, dims, 5);
    let drafts = Tokens::random(&mut rng, dims, t);
    for accepted in 0..t {
        let mut flushed = Vec::new();
        for variant in 0..2 {
            // The second variant changes every rejected draft; the accepted ones stay.
            let mut tok = Tokens {
                x: drafts.x.clone(),
                dt: drafts.dt.clone(),
                b: drafts.b.clone(),
                c: drafts.c.clone(),
            };
            if variant == 1 {
                let other = Tokens::random(&mut rng, dims, t);
                let (hp, gn, h) = (dims.heads * dims.head_dim, dims.groups * dims.state_dim, dims.heads);
                tok.x[accepted * hp..].copy_from_slice(&other.x[accepted * hp..]);
                tok.dt[accepted * h..].copy_from_slice(&other.dt[accepted * h..]);
                tok.b[accepted * gn..].copy_from_slice(&other.b[accepted * gn..]);
                tok.c[accepted * gn..].copy_from_slice(&other.c[accepted * gn..]);
            }
            let mut ring = Mamba2RingBuf::new(dims, cap);
            ring.index.start = 9;
            let mut s0 = init.clone();
            ring.view().push(&committed.x, &committed.dt, &committed.b);
            let mut y = vec![0.0; t * dims.heads * dims.head_dim];
            verify_replay(Some(&mut s0), &mut ring.view(), tok.view(), &a, &d, &mut y, false);
            commit_replay(&mut ring.view(), accepted);
            let h = ring.index.len;
            flush(&mut s0, &mut ring.view(), h, &a);
            flushed.push(s0);
        }
        assert_eq!(
            flushed[0], flushed[1],
            "accepted {accepted}: a rejected draft changed the state"
        );
        let mut history = committed.x.clone();
        history.extend_from_slice(&drafts.x[..accepted * dims.heads * dims.head_dim]);
        let n_tok = 5 + accepted;
        let all = Tokens {
            x: history,
            dt: [&committed.dt[..], &drafts.dt[..accepted * dims.heads]].concat(),
            b: [&committed.b[..], &drafts.b[..accepted * dims.groups * dims.state_dim]].concat(),
            c: vec![0.0; n_tok * dims.groups * dims.state_dim],
        };
        let (_, states) = oracle(dims, &init, &all, &a, &d);
        assert!(rel(&flushed[0], &states[n_tok - 1]) < TOL, "accepted {accepted}");
    }
}

/// Nemotron-H-8B's Mamba-2 layer: 128 heads × 64, state 128, 8 groups (16 heads a group), ring of 16.
fn nemotron() -> (Mamba2Dims, usize) {
    (
        Mamba2Dims {
            heads: 128,
            head_dim: 64,
            state_dim: 128,
            groups: 8,
        },
        16,
    )
}

#[test]
fn replay_decode_traffic_follows_the_byte_model() {
    let (dims, cap) = nemotron();
    let (heads, d, n, g) = (
        dims.heads as u64,
        dims.head_dim as u64,
        dims.state_dim as u64,
        dims.groups as u64,
    );
    let hpg = heads / g;
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let mut s0 = uniform(&mut rng, state_len(dims), -1.0, 1.0);
    let a = uniform(&mut rng, dims.heads, -4.0, -0.05);
    let dsk = uniform(&mut rng, dims.heads, -1.0, 1.0);
    let mut ring = Mamba2RingBuf::new(dims, cap);
    let mut y = vec![0.0; dims.heads * dims.head_dim];
    let recurrent = recurrent_step_traffic(dims);
    assert_eq!(recurrent.state_read + recurrent.state_written, heads * 8 * d * n);
    for h in 0..16u64 {
        // h = 15 is where the policy would flush first (needs_flush(15, 1, 16)); the kernel itself still fits it.
        let tok = Tokens::random(&mut rng, dims, 1);
        let tr = replay_decode(Some(&mut s0), &mut ring.view(), tok.view(), &a, &dsk, &mut y, false);
        // Per head: the state 4·d·n; the ring 2·h·(d + n/hpg + 2) (bf16 x, bf16 B shared by the group, fp32 dt);
        // one entry appended; inputs x, dt, B, C (shared by the group), A, D; one bf16 output row.
        assert_eq!(tr.state_read, heads * 4 * d * n, "h = {h}");
        assert_eq!(tr.state_written, 0);
        assert_eq!(tr.ring_read, heads * 2 * h * (d + n / hpg + 2), "h = {h}");
        assert_eq!(tr.ring_written, heads * 2 * (d + n / hpg + 2));
        assert_eq!(tr.inputs, heads * (2 * d + 4 + 4 * n / hpg + 8));
        assert_eq!(tr.outputs, heads * 2 * d);
        if h == 8 {
            let flush_write = heads * 4 * d * n / cap as u64;
            println!(
                "Nemotron-H-8B layer, h = 8, L = 16: replay {} B/step \
                 ({} B/head; state {} ring {} append {} in {} out {}), \
                 + amortised flush write {} B (state_written/L); recurrent {} B/step ({} B/head); ratio {:.3} \
                 (state+ring only: {:.3})",
                tr.total(),
                tr.total() / heads,
                tr.state_read / heads,
                tr.ring_read / heads,
                tr.ring_written / heads,
                tr.inputs / heads,
                tr.outputs / heads,
                flush_write,
                recurrent.total(),
                recurrent.total() / heads,
                recurrent.total() as f64 / (tr.total() + flush_write) as f64,
                (recurrent.state_read + recurrent.state_written) as f64
                    / (tr.state_read + tr.ring_read + tr.ring_written + flush_write) as f64
            );
        }
    }
    assert_eq!(ring.index.len, 16);
}

#[test]
fn verify_traffic_baseline_writes_every_snapshot() {
    let (dims, cap) = nemotron();
    let sb = 4 * (dims.heads * dims.head_dim * dims.state_dim) as u64;
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let mut s0 = uniform(&mut rng, state_len(dims), -1.0, 1.0);
    let a = uniform(&mut rng, dims.heads, -4.0, -0.05);
    let dsk = uniform(&mut rng, dims.heads, -1.0, 1.0);
    let t = 4;
    let tok = Tokens::random(&mut rng, dims, t);
    let mut ring = Mamba2RingBuf::new(dims, cap);
    let pre = Tokens::random(&mut rng, dims, 3);
    ring.view().push(&pre.x, &pre.dt, &pre.b);
    let mut y = vec![0.0; t * dims.heads * dims.head_dim];
    let replay = verify_replay(Some(&mut s0), &mut ring.view(), tok.view(), &a, &dsk, &mut y, false);
    let mut snaps = vec![0.0; t * state_len(dims)];
    let mut y_base = vec![0.0; y.len()];
    // The baseline starts from the state after the three cached entries.
    let (_, pre_states) = oracle(dims, &s0, &pre, &a, &dsk);
    let base = verify_baseline(dims, &pre_states[2], tok.view(), &a, &dsk, &mut snaps, &mut y_base);
    assert_eq!((base.state_read, base.state_written), (sb, t as u64 * sb));
    assert_eq!((replay.state_read, replay.state_written), (sb, 0));
    assert_eq!(replay.ring_read, 3 * entry_bytes(dims));
    assert_eq!(replay.inputs, base.inputs);
    assert!(rel(&y, &y_base) < TOL, "replay and baseline outputs differ");
    let mut state = pre_states[2].clone();
    assert_eq!(commit_baseline(dims, &mut state, &snaps, 0), Traffic::default());
    assert_eq!(state, pre_states[2]);
    assert_eq!(commit_baseline(dims, &mut state, &snaps, 2).state_written, sb);
    assert_eq!(&state[..], &snaps[state_len(dims)..2 * state_len(dims)]);
}

#[test]
fn kv_only_reads_no_state() {
    let dims = Mamba2Dims {
        heads: 4,
        head_dim: 3,
        state_dim: 5,
        groups: 2,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let a = uniform(&mut rng, dims.heads, -1.0, -0.1);
    let dsk = uniform(&mut rng, dims.heads, -1.0, 1.0);
    let mut ring = Mamba2RingBuf::new(dims, 8);
    let mut y = vec![0.0; dims.heads * dims.head_dim];
    let tok = Tokens::random(&mut rng, dims, 1);
    let tr = replay_decode(None, &mut ring.view(), tok.view(), &a, &dsk, &mut y, false);
    assert_eq!((tr.state_read, tr.state_written), (0, 0));
    let mut s0 = vec![f32::NAN; state_len(dims)];
    let tr = compress(&mut s0, &mut ring.view(), &a);
    assert_eq!((tr.state_read, tr.state_written), (0, 4 * state_len(dims) as u64));
    let (_, states) = oracle(dims, &vec![0.0; state_len(dims)], &tok, &a, &dsk);
    assert!(rel(&s0, &states[0]) < TOL);
    assert_eq!(
        ring.index,
        RingIndex {
            start: 1,
            len: 0,
            pending: 0,
            capacity: 8
        }
    );
}
