//! Oracle: `gdn_step` over the committed token history. Every output, every reconstructed state and every checkpoint
//! must match it within 1e-5 relative, whatever sequence of decode, verify / accept, flush and compress events runs.

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::cpu::gdn::gdn_step;

const TOL: f32 = 1e-5;

fn normal(rng: &mut ChaCha8Rng) -> f32 {
    // Box–Muller; the uniform is kept away from 0 so the log stays finite.
    let (a, b): (f32, f32) = (rng.random_range(1e-7..1.0), rng.random());
    (-2.0 * a.ln()).sqrt() * (std::f32::consts::TAU * b).cos()
}

fn normals(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| normal(rng)).collect()
}

fn rel(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let d: f64 = got.iter().zip(want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let n: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (d.sqrt() / n.sqrt().max(1e-30)) as f32
}

/// Step inputs of `t` tokens, owned.
#[derive(Clone)]
struct Tokens {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

impl Tokens {
    fn random(rng: &mut ChaCha8Rng, dims: GdnDims, t: usize) -> Self {
        let unit = |rng: &mut ChaCha8Rng, scale: f32| -> Vec<f32> {
            let mut x = normals(rng, t * dims.k_heads * dims.k_dim);
            for row in x.chunks_exact_mut(dims.k_dim) {
                let n = row.iter().map(|v| v * v).sum::<f32>().sqrt();
                row.iter_mut().for_each(|v| *v *= scale / n);
            }
            x
        };
        let n = t * dims.v_heads;
        let softplus = |x: f32| (1.0 + x.exp()).ln();
        Tokens {
            q: unit(rng, 1.0 / (dims.k_dim as f32).sqrt()),
            k: unit(rng, 1.0),
            v: normals(rng, t * dims.v_heads * dims.v_dim),
            // Mostly mild decays, now and then one that wipes most of the state.
            g: (0..n)
                .map(|_| {
                    let g = -normal(rng).exp() * softplus(normal(rng));
                    if rng.random_bool(0.05) {
                        30.0 * g
                    } else {
                        g
                    }
                })
                .collect(),
            beta: (0..n).map(|_| 1.0 / (1.0 + (-normal(rng)).exp())).collect(),
        }
    }

    fn view(&self) -> GdnTokens<'_> {
        GdnTokens {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            g: &self.g,
            beta: &self.beta,
        }
    }
}

/// The recurrent form from `state` over every token: outputs `[t, v_heads, v_dim]`, the corrected values `u` of each
/// token (`[t, v_heads, v_dim]`), and the state after each token.
fn oracle(dims: GdnDims, state: &[f32], x: &Tokens) -> (Vec<f32>, Vec<f32>, Vec<Vec<f32>>) {
    let t = x.g.len() / dims.v_heads;
    let (qk, vw, hw) = (dims.k_heads * dims.k_dim, dims.v_heads * dims.v_dim, dims.v_heads);
    let (mut out, mut us, mut states) = (vec![0.0f32; t * vw], vec![0.0f32; t * vw], Vec::new());
    let mut s = state.to_vec();
    for i in 0..t {
        // u = β (v − e^g S k), from the state before the token.
        for h in 0..dims.v_heads {
            let kh = h / (dims.v_heads / dims.k_heads);
            let kv = &x.k[i * qk + kh * dims.k_dim..i * qk + (kh + 1) * dims.k_dim];
            let (e, b) = (x.g[i * hw + h].exp(), x.beta[i * hw + h]);
            for r in 0..dims.v_dim {
                let row = &s[(h * dims.v_dim + r) * dims.k_dim..(h * dims.v_dim + r + 1) * dims.k_dim];
                let sk: f32 = row.iter().zip(kv).map(|(a, c)| a * c).sum();
                us[i * vw + h * dims.v_dim + r] = b * (x.v[i * vw + h * dims.v_dim + r] - e * sk);
            }
        }
        let r = |w: usize| i * w..(i + 1) * w;
        gdn_step(
            dims,
            &mut s,
            &x.q[r(qk)],
            &x.k[r(qk)],
            &x.v[r(vw)],
            &x.g[r(hw)],
            &x.beta[r(hw)],
            &mut out[r(vw)],
        );
        states.push(s.clone());
    }
    (out, us, states)
}

/// The scale of the rounding error of token `s`'s output in any f32 evaluation: `‖|S_s| |q_s|‖` over the value
/// heads. A readout whose terms cancel (`k·q ≈ 0` on an empty state) is ill-conditioned, so its error is judged
/// against this rather than against `‖y_s‖`; the plain `‖Δ‖/‖ref‖` is checked over each whole sequence instead.
fn readout_scale(dims: GdnDims, state: &[f32], x: &Tokens, s: usize) -> f32 {
    let (dk, dv) = (dims.k_dim, dims.v_dim);
    let mut sum = 0.0f64;
    for h in 0..dims.v_heads {
        let kh = h / (dims.v_heads / dims.k_heads);
        let q = &x.q[(s * dims.k_heads + kh) * dk..][..dk];
        for row in state[h * dv * dk..(h + 1) * dv * dk].chunks_exact(dk) {
            let m: f64 = row.iter().zip(q).map(|(a, b)| (a.abs() * b.abs()) as f64).sum();
            sum += m * m;
        }
    }
    sum.sqrt() as f32
}

/// Checks the outputs of `t` tokens against the oracle's token by token and records both for the sequence check.
fn check_outputs(
    dims: GdnDims,
    got: &[f32],
    want: &[f32],
    states: &[Vec<f32>],
    x: &Tokens,
    seen: &mut Outputs,
    what: &str,
) {
    let vw = dims.v_heads * dims.v_dim;
    for (s, state) in states.iter().enumerate() {
        let (g, w) = (&got[s * vw..(s + 1) * vw], &want[s * vw..(s + 1) * vw]);
        let d: f64 = g.iter().zip(w).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        let err = d.sqrt() as f32 / readout_scale(dims, state, x, s).max(1e-30);
        assert!(
            err < TOL,
            "{what}: token {s}/{} output error {err} (plain {})",
            states.len(),
            rel(g, w)
        );
    }
    seen.got.extend_from_slice(got);
    seen.want.extend_from_slice(want);
}

/// Every output of a sequence, for the plain relative check over all of them.
#[derive(Default)]
struct Outputs {
    got: Vec<f32>,
    want: Vec<f32>,
}

/// Rings and checkpoints of `slots` sequence slots, as the engine's pools hold them. Filled with NaN so that reading a
/// row no op should read (a stale or unwritten one, or a KV-only checkpoint) poisons the results.
struct Pool {
    dims: GdnDims,
    cap: usize,
    u: Vec<f32>,
    k: Vec<f32>,
    g: Vec<f32>,
    ckpt: Vec<f32>,
    index: Vec<RingIndex>,
}

impl Pool {
    fn new(dims: GdnDims, cap: usize, slots: usize) -> Self {
        let (lu, lk, lg) = GdnRing::storage_lens(dims, cap);
        Pool {
            dims,
            cap,
            u: vec![f32::NAN; slots * lu],
            k: vec![f32::NAN; slots * lk],
            g: vec![f32::NAN; slots * lg],
            ckpt: vec![f32::NAN; slots * dims.state_len()],
            index: vec![RingIndex::new(cap); slots],
        }
    }

    fn slot(&mut self, i: usize) -> (GdnRing<'_>, &mut [f32]) {
        let (lu, lk, lg) = GdnRing::storage_lens(self.dims, self.cap);
        let sl = self.dims.state_len();
        let ring = GdnRing::new(
            self.dims,
            &mut self.u[i * lu..(i + 1) * lu],
            &mut self.k[i * lk..(i + 1) * lk],
            &mut self.g[i * lg..(i + 1) * lg],
            &mut self.index[i],
        );
        (ring, &mut self.ckpt[i * sl..(i + 1) * sl])
    }
}

/// The byte model, per value head: ring entry `2·d_v + 2·d_k / heads-per-key + 4` (u, its share of k, g), token
/// `2·(2·d_k) / heads-per-key + 2·d_v + 8` (q, k shared, v, g and β), output `2·d_v`, state `4·d_v·d_k`. Returned for
/// the whole layer (times the value heads, the shared key terms as key heads × key bytes so odd sizes stay exact).
fn model_bytes(dims: GdnDims) -> (u64, u64, u64, u64) {
    let (kh, vh, dk, dv) = (
        dims.k_heads as u64,
        dims.v_heads as u64,
        dims.k_dim as u64,
        dims.v_dim as u64,
    );
    (
        vh * (2 * dv + 4) + kh * 2 * dk,
        kh * 4 * dk + vh * (2 * dv + 8),
        vh * 2 * dv,
        vh * 4 * dv * dk,
    )
}

/// One sequence in `slot`: a random event stream, every result checked against the oracle. `kv_only` starts it in the
/// KV-only form from a zero state; otherwise it starts from a random checkpoint (a prefilled prompt).
fn run_sequence(rng: &mut ChaCha8Rng, pool: &mut Pool, slot: usize, window: usize, kv_only: bool, events: usize) {
    let (dims, cap) = (pool.dims, pool.cap);
    let sl = dims.state_len();
    let mut kv = kv_only;
    // Compress once the ring reaches this; a KV-only ring must still fit a full window below it.
    let threshold = rng.random_range(1..=cap + 1 - window);
    let mut history = vec![if kv { vec![0.0f32; sl] } else { normals(rng, sl) }];
    {
        let (mut ring, ckpt) = pool.slot(slot);
        ring.reset();
        if kv {
            ckpt.fill(f32::NAN);
        } else {
            ckpt.copy_from_slice(&history[0]);
        }
    }
    let entry = model_bytes(dims).0;
    let mut seen = Outputs::default();
    for ev in 0..events {
        let (mut ring, ckpt) = pool.slot(slot);
        let h = ring.len();
        let last = history.last().unwrap().clone();
        let what = format!("{dims:?} L {cap} T {window} event {ev} h {h} kv {kv}");
        match rng.random_range(0..10) {
            0..=2 => {
                let x = Tokens::random(rng, dims, 1);
                let flag = !kv && (needs_flush(h, window, cap) || rng.random_bool(0.15));
                let mut out = vec![f32::NAN; dims.v_heads * dims.v_dim];
                let tr = replay_decode((!kv).then_some(ckpt), &mut ring, x.view(), &mut out, flag);
                let (want, wu, states) = oracle(dims, &last, &x);
                check_outputs(dims, &out, &want, &states, &x, &mut seen, &format!("{what} decode"));
                if !flag {
                    assert!(rel(ring.entry(h).u, &wu) < TOL, "{what} decode u");
                }
                assert_eq!(tr.ring_read, h as u64 * entry, "{what}");
                assert_eq!(tr.state_read == 0, kv, "{what}: the KV-only form reads no state");
                assert_eq!(tr.state_written > 0, flag, "{what}");
                history.extend(states);
            }
            3..=7 => {
                let t = rng.random_range(1..=window);
                let x = Tokens::random(rng, dims, t);
                let flag = !kv && (needs_flush(h, window, cap) || rng.random_bool(0.15));
                let mut out = vec![f32::NAN; t * dims.v_heads * dims.v_dim];
                let tr = verify_replay((!kv).then_some(ckpt), &mut ring, x.view(), &mut out, flag);
                let (want, wu, states) = oracle(dims, &last, &x);
                let vw = dims.v_heads * dims.v_dim;
                check_outputs(dims, &out, &want, &states, &x, &mut seen, &format!("{what} verify"));
                let base = ring.len();
                for s in 0..t {
                    let e = ring.entry(base + s);
                    assert!(rel(e.u, &wu[s * vw..(s + 1) * vw]) < TOL, "{what} draft {s} u");
                    let kw = dims.k_heads * dims.k_dim;
                    assert_eq!(
                        (e.k, e.g),
                        (&x.k[s * kw..(s + 1) * kw], &x.g[s * dims.v_heads..][..dims.v_heads])
                    );
                }
                assert_eq!(
                    (tr.ring_read, tr.ring_written),
                    (h as u64 * entry, t as u64 * entry),
                    "{what}"
                );
                assert_eq!(tr.state_written > 0, flag, "{what}");

                // The baseline from the same state: same outputs, a snapshot per draft, and its commit.
                let mut snaps = vec![f32::NAN; t * sl];
                let mut bout = vec![f32::NAN; t * vw];
                let bt = verify_baseline(dims, &last, x.view(), &mut snaps, &mut bout);
                assert!(rel(&bout, &want) < TOL, "{what} baseline out");
                assert_eq!(bt.state_written, t as u64 * Traffic::f32s(sl));
                let accepted = rng.random_range(0..=t);
                let mut committed = last.clone();
                commit_baseline(dims, &mut committed, &snaps, accepted);
                let expect = if accepted == 0 { &last } else { &states[accepted - 1] };
                assert!(rel(&committed, expect) < TOL, "{what} baseline commit {accepted}");

                commit_replay(&mut ring, accepted);
                assert_eq!(ring.len(), base + accepted, "{what}");
                history.extend(states.into_iter().take(accepted));
            }
            _ if !kv && h > 0 => {
                let n = rng.random_range(0..=h);
                let before: Vec<usize> = (n..h).map(|j| ring.physical(j)).collect();
                let tr = flush(ckpt, &mut ring, n);
                let after: Vec<usize> = (0..h - n).map(|j| ring.physical(j)).collect();
                assert_eq!(before, after, "{what}: a flush moves no entry");
                assert_eq!(tr.ring_read, n as u64 * entry, "{what}");
            }
            _ => {}
        }
        let (mut ring, ckpt) = pool.slot(slot);
        if kv && ring.len() >= threshold {
            let tr = compress(ckpt, &mut ring);
            assert_eq!((tr.state_read, tr.state_written), (0, Traffic::f32s(sl)));
            kv = false;
        }
        let committed = history.len() - 1;
        let mut rebuilt = vec![f32::NAN; sl];
        reconstruct((!kv).then_some(&*ckpt), &ring, &mut rebuilt);
        let what = format!("{dims:?} L {cap} T {window} after event {ev}, {:?}", ring.index());
        assert!(
            rel(&rebuilt, &history[committed]) < TOL,
            "{what} state {}",
            rel(&rebuilt, &history[committed])
        );
        if !kv {
            let at = committed - ring.len();
            assert!(
                rel(ckpt, &history[at]) < TOL,
                "{what} checkpoint at {at}: {}",
                rel(ckpt, &history[at])
            );
        }
        assert!(ring.len() + window <= cap, "{what}: the next window must fit");
    }
    let e = rel(&seen.got, &seen.want);
    assert!(
        e < TOL,
        "{dims:?} L {cap} T {window}: all outputs of the sequence, relative error {e}"
    );
}

fn dims_strategy() -> impl Strategy<Value = GdnDims> {
    (1usize..=3, 1usize..=3, 1usize..=9, 1usize..=10).prop_map(|(k_heads, ratio, kd, vd)| {
        let k_dim = 2 * kd + 1;
        let v_dim = if 2 * vd + 1 == k_dim { 2 * vd + 3 } else { 2 * vd + 1 };
        GdnDims {
            k_heads,
            v_heads: k_heads * ratio,
            k_dim,
            v_dim,
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Several sequences reuse two slots (stale rows, reset counters), replay and KV-only starts mixed.
    #[test]
    fn replay_matches_recurrent(dims in dims_strategy(), cap in 2usize..=32, t in 1usize..=6, seed in any::<u64>()) {
        let window = t.min(cap / 2);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut pool = Pool::new(dims, cap, 2);
        for _ in 0..3 {
            let slot = rng.random_range(0..2);
            let kv_only = rng.random_bool(0.4);
            let events = rng.random_range(5..=30);
            run_sequence(&mut rng, &mut pool, slot, window, kv_only, events);
        }
    }
}

#[test]
fn flush_rule() {
    // T = 1 is Alg. 6's "buffer full": the step that fills the last row flushes.
    for cap in 2..=32 {
        for h in 0..cap {
            assert_eq!(needs_flush(h, 1, cap), h + 1 == cap);
        }
    }
    // Without a flush a full window still fits next step, whatever was accepted.
    for cap in 2..=32 {
        for t in 1..=cap / 2 {
            for h in 0..=cap - t {
                if !needs_flush(h, t, cap) {
                    assert!(h + t + t <= cap);
                }
            }
        }
    }
}

/// Qwen3.5-4B's GDN layer (16 key / 32 value heads × 128), ring of 16: `replay_decode`'s bytes against the byte model
/// for h = 0 .. 16 over a whole flush cycle, with the outputs still checked (these sizes take the threaded path).
/// `cargo test -p rewind-kernels replay_gdn::tests::qwen -- --nocapture` prints the comparison with recurrent decode.
#[test]
fn qwen35_4b_decode_traffic() {
    let dims = GdnDims {
        k_heads: 16,
        v_heads: 32,
        k_dim: 128,
        v_dim: 128,
    };
    let cap = 16;
    let mut rng = ChaCha8Rng::seed_from_u64(35);
    let (entry, token, output, state) = model_bytes(dims);
    assert_eq!(
        (entry, token, output, state),
        (32 * 388, 32 * 520, 32 * 256, 32 * 65536)
    );
    let mut ring = GdnRingBuf::new(dims, cap);
    let mut ckpt = normals(&mut rng, dims.state_len());
    let mut reference = ckpt.clone();
    let mut cycle = Traffic::default();
    let mut at_8 = Traffic::default();
    for h in 0..cap {
        let x = Tokens::random(&mut rng, dims, 1);
        let mut out = vec![0.0f32; dims.v_heads * dims.v_dim];
        let flag = needs_flush(h, 1, cap);
        let mut view = ring.view();
        assert_eq!(view.len(), h);
        let tr = replay_decode(Some(&mut ckpt), &mut view, x.view(), &mut out, flag);
        let want = Traffic {
            state_read: state,
            state_written: if flag { state } else { 0 },
            ring_read: h as u64 * entry,
            ring_written: entry,
            inputs: token,
            outputs: output,
        };
        assert_eq!(tr, want, "h {h}");
        let (o, _, s) = oracle(dims, &reference, &x);
        reference = s[0].clone();
        assert!(rel(&out, &o) < TOL, "h {h}: out {}", rel(&out, &o));
        cycle += tr;
        if h == 8 {
            at_8 = tr;
        }
    }
    assert_eq!(ring.index.len, 0, "the cycle ends with a flush");
    assert!(
        rel(&ckpt, &reference) < TOL,
        "flushed checkpoint {}",
        rel(&ckpt, &reference)
    );
    assert_eq!(cycle.state_written, state, "one state write per cycle");

    let recurrent = recurrent_step_traffic(dims);
    assert_eq!(recurrent.total(), 2 * state + token + output);
    let amortised = at_8.total() + state / cap as u64;
    let per_step = cycle.total() / cap as u64;
    eprintln!(
        "Qwen3.5-4B GDN layer, L = {cap}: replay decode at h = 8 moves {} B + {} B amortised flush = {amortised} B \
         ({:.0} B/value head); recurrent {} B ({:.0} B/value head); ratio {:.2}×; mean over a flush cycle \
         {per_step} B ({:.2}×)",
        at_8.total(),
        state / cap as u64,
        amortised as f64 / 32.0,
        recurrent.total(),
        recurrent.total() as f64 / 32.0,
        recurrent.total() as f64 / amortised as f64,
        recurrent.total() as f64 / per_step as f64,
    );

    // Verify with T = 4 from h = 8, replay against the baseline's snapshots.
    let x = Tokens::random(&mut rng, dims, 4);
    for _ in 0..8 {
        let one = Tokens::random(&mut rng, dims, 1);
        let mut out = vec![0.0f32; dims.v_heads * dims.v_dim];
        replay_decode(Some(&mut ckpt), &mut ring.view(), one.view(), &mut out, false);
        reference = oracle(dims, &reference, &one).2.remove(0);
    }
    let mut out = vec![0.0f32; 4 * dims.v_heads * dims.v_dim];
    let replay = verify_replay(Some(&mut ckpt), &mut ring.view(), x.view(), &mut out, false);
    let (want, _, _) = oracle(dims, &reference, &x);
    assert!(rel(&out, &want) < TOL, "verify out {}", rel(&out, &want));
    let mut snaps = vec![0.0f32; 4 * dims.state_len()];
    let baseline = verify_baseline(dims, &reference, x.view(), &mut snaps, &mut out);
    eprintln!(
        "verify T = 4 at h = 8: replay {} B (no flush), baseline {} B ({:.2}×)",
        replay.total(),
        baseline.total(),
        baseline.total() as f64 / replay.total() as f64
    );
}

/// The KV-only form at Qwen sizes: outputs from the ring alone (threaded), then compress into a checkpoint.
#[test]
fn qwen35_kv_only_then_compress() {
    let dims = GdnDims {
        k_heads: 16,
        v_heads: 32,
        k_dim: 128,
        v_dim: 128,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let mut ring = GdnRingBuf::new(dims, 12);
    let mut reference = vec![0.0f32; dims.state_len()];
    for t in [3, 1, 4] {
        let x = Tokens::random(&mut rng, dims, t);
        let mut out = vec![0.0f32; t * dims.v_heads * dims.v_dim];
        let tr = verify_replay(None, &mut ring.view(), x.view(), &mut out, false);
        assert_eq!(tr.state_read + tr.state_written, 0);
        let (want, _, states) = oracle(dims, &reference, &x);
        assert!(rel(&out, &want) < TOL, "kv-only out {}", rel(&out, &want));
        commit_replay(&mut ring.view(), t);
        reference = states[t - 1].clone();
    }
    let mut ckpt = vec![f32::NAN; dims.state_len()];
    compress(&mut ckpt, &mut ring.view());
    assert!(rel(&ckpt, &reference) < TOL, "compressed {}", rel(&ckpt, &reference));
    assert!(ring.view().is_empty());
}
