//! The Gated DeltaNet ops: the recurrent step against a transcription of the reference, chunked == recurrent, split
//! sequences == whole, strong decay, and the chunked form's speed on a long prompt.
use super::*;
use crate::cpu::act::{sigmoid, softplus};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn normal(rng: &mut ChaCha8Rng) -> f32 {
    // Box–Muller; rand 0.9 has no normal distribution without rand_distr.
    let u1: f32 = rng.random_range(1e-7..1.0);
    let u2: f32 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

fn normals(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| normal(rng)).collect()
}

/// Random inputs as the layer would produce them: unit q, k (q scaled), β ∈ (0, 1), g = −exp(N)·softplus(N).
struct Case {
    dims: GdnDims,
    seq: usize,
    state: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

impl Case {
    fn random(rng: &mut ChaCha8Rng, dims: GdnDims, seq: usize) -> Self {
        let unit = |rng: &mut ChaCha8Rng, scale: f32| -> Vec<f32> {
            let mut x = normals(rng, seq * dims.k_heads * dims.k_dim);
            for row in x.chunks_exact_mut(dims.k_dim) {
                let n = row.iter().map(|v| v * v).sum::<f32>().sqrt();
                row.iter_mut().for_each(|v| *v *= scale / n);
            }
            x
        };
        let q = unit(rng, 1.0 / (dims.k_dim as f32).sqrt());
        let k = unit(rng, 1.0);
        let n = seq * dims.v_heads;
        Case {
            dims,
            seq,
            state: normals(rng, dims.state_len()),
            q,
            k,
            v: normals(rng, seq * dims.v_heads * dims.v_dim),
            g: (0..n).map(|_| -normal(rng).exp() * softplus(normal(rng))).collect(),
            beta: (0..n).map(|_| sigmoid(normal(rng))).collect(),
        }
    }

    fn out_len(&self) -> usize {
        self.seq * self.dims.v_heads * self.dims.v_dim
    }

    fn recurrent(&self) -> (Vec<f32>, Vec<f32>) {
        let (mut s, mut o) = (self.state.clone(), vec![f32::NAN; self.out_len()]);
        let Case { q, k, v, g, beta, .. } = self;
        gdn_recurrent(self.dims, self.seq, &mut s, q, k, v, g, beta, &mut o);
        (o, s)
    }

    fn chunked(&self, chunk: usize) -> (Vec<f32>, Vec<f32>) {
        let (mut s, mut o) = (self.state.clone(), vec![f32::NAN; self.out_len()]);
        let Case { q, k, v, g, beta, .. } = self;
        gdn_chunked(self.dims, self.seq, chunk, &mut s, q, k, v, g, beta, &mut o);
        (o, s)
    }
}

fn rel(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let d: f64 = got.iter().zip(want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let n: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (d.sqrt() / n.sqrt().max(1e-30)) as f32
}

fn random_dims(rng: &mut ChaCha8Rng) -> GdnDims {
    let k_heads = rng.random_range(1..=3);
    let k_dim = 2 * rng.random_range(1..=9) + 1;
    let mut v_dim = 2 * rng.random_range(1..=10) + 1;
    if v_dim == k_dim {
        v_dim += 2;
    }
    GdnDims {
        k_heads,
        v_heads: k_heads * rng.random_range(1..=3),
        k_dim,
        v_dim,
    }
}

/// transformers' `torch_recurrent_gated_delta_rule` transcribed literally in f64: q, k repeated to the value heads
/// with `repeat_interleave`, state `[v_heads, k_dim, v_dim]`.
fn hf_recurrent(x: &Case) -> (Vec<f32>, Vec<f32>) {
    let GdnDims {
        k_heads,
        v_heads,
        k_dim,
        v_dim,
    } = x.dims;
    let rep = |src: &[f32], t: usize, h: usize, i: usize| {
        // repeat_interleave(r, dim=heads): head h of the repeated tensor is head h / r of the source.
        src[(t * k_heads + h / (v_heads / k_heads)) * k_dim + i] as f64
    };
    let mut s = vec![0.0f64; v_heads * k_dim * v_dim];
    for h in 0..v_heads {
        for i in 0..k_dim {
            for j in 0..v_dim {
                s[(h * k_dim + i) * v_dim + j] = x.state[(h * v_dim + j) * k_dim + i] as f64;
            }
        }
    }
    let mut out = vec![0.0f32; x.out_len()];
    for t in 0..x.seq {
        for h in 0..v_heads {
            let sh = &mut s[h * k_dim * v_dim..(h + 1) * k_dim * v_dim];
            let decay = (x.g[t * v_heads + h] as f64).exp();
            sh.iter_mut().for_each(|e| *e *= decay);
            for j in 0..v_dim {
                let kv_mem: f64 = (0..k_dim).map(|i| sh[i * v_dim + j] * rep(&x.k, t, h, i)).sum();
                let delta = (x.v[(t * v_heads + h) * v_dim + j] as f64 - kv_mem) * x.beta[t * v_heads + h] as f64;
                for i in 0..k_dim {
                    sh[i * v_dim + j] += rep(&x.k, t, h, i) * delta;
                }
            }
            for j in 0..v_dim {
                let o: f64 = (0..k_dim).map(|i| sh[i * v_dim + j] * rep(&x.q, t, h, i)).sum();
                out[(t * v_heads + h) * v_dim + j] = o as f32;
            }
        }
    }
    let mut state = vec![0.0f32; x.dims.state_len()];
    for h in 0..v_heads {
        for i in 0..k_dim {
            for j in 0..v_dim {
                state[(h * v_dim + j) * k_dim + i] = s[(h * k_dim + i) * v_dim + j] as f32;
            }
        }
    }
    (out, state)
}

#[test]
fn recurrent_matches_transformers_transcription() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for _ in 0..20 {
        let dims = random_dims(&mut rng);
        let seq = rng.random_range(1..=40);
        let x = Case::random(&mut rng, dims, seq);
        let (o, s) = x.recurrent();
        let (ro, rs) = hf_recurrent(&x);
        assert!(rel(&o, &ro) < 1e-5, "{dims:?} seq {seq}: out {}", rel(&o, &ro));
        assert!(rel(&s, &rs) < 1e-5, "{dims:?} seq {seq}: state {}", rel(&s, &rs));
    }
}

#[test]
fn chunked_matches_recurrent() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let mut worst = (0.0f32, 0.0f32);
    for case in 0..150 {
        let dims = random_dims(&mut rng);
        let seq = rng.random_range(1..=100);
        let chunk = rng.random_range(1..=64);
        let x = Case::random(&mut rng, dims, seq);
        let (ro, rs) = x.recurrent();
        let (co, cs) = x.chunked(chunk);
        let (eo, es) = (rel(&co, &ro), rel(&cs, &rs));
        worst = (worst.0.max(eo), worst.1.max(es));
        assert!(eo < 1e-5, "case {case} {dims:?} seq {seq} chunk {chunk}: out {eo}");
        assert!(es < 1e-5, "case {case} {dims:?} seq {seq} chunk {chunk}: state {es}");
    }
    eprintln!(
        "chunked vs recurrent, worst relative error: out {:e}, state {:e}",
        worst.0, worst.1
    );
}

#[test]
fn split_sequence_matches_whole() {
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    for _ in 0..30 {
        let dims = random_dims(&mut rng);
        let seq = rng.random_range(2..=100);
        let chunk = rng.random_range(1..=64);
        let x = Case::random(&mut rng, dims, seq);
        let (wo, ws) = x.chunked(chunk);
        let (qk, vw, hw) = (dims.k_heads * dims.k_dim, dims.v_heads * dims.v_dim, dims.v_heads);
        let mut s = x.state.clone();
        let mut o = vec![f32::NAN; x.out_len()];
        let mut t0 = 0;
        while t0 < seq {
            let n = rng.random_range(1..=seq - t0);
            let r = t0..t0 + n;
            let (q, k) = (&x.q[r.start * qk..r.end * qk], &x.k[r.start * qk..r.end * qk]);
            let (g, b) = (&x.g[r.start * hw..r.end * hw], &x.beta[r.start * hw..r.end * hw]);
            let (v, out) = (&x.v[r.start * vw..r.end * vw], &mut o[r.start * vw..r.end * vw]);
            if n == 1 {
                gdn_step(dims, &mut s, q, k, v, g, b, out);
            } else {
                gdn_chunked(dims, n, chunk, &mut s, q, k, v, g, b, out);
            }
            t0 += n;
        }
        assert!(rel(&o, &wo) < 1e-5, "{dims:?} seq {seq}: out {}", rel(&o, &wo));
        assert!(rel(&s, &ws) < 1e-5, "{dims:?} seq {seq}: state {}", rel(&s, &ws));
    }
}

#[test]
fn strong_decay_and_threaded_heads() {
    // Large |g| drives most decay factors to zero; 8 heads × 200 tokens × 32 × 48 takes the threaded path.
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let dims = GdnDims {
        k_heads: 2,
        v_heads: 8,
        k_dim: 32,
        v_dim: 48,
    };
    let mut x = Case::random(&mut rng, dims, 200);
    for (i, g) in x.g.iter_mut().enumerate() {
        if i.is_multiple_of(7) {
            *g *= 40.0;
        }
    }
    let (ro, rs) = x.recurrent();
    let (co, cs) = x.chunked(64);
    assert!(rel(&co, &ro) < 1e-5, "out {}", rel(&co, &ro));
    assert!(rel(&cs, &rs) < 1e-5, "state {}", rel(&cs, &rs));
}

/// Qwen3-Next sizes (one layer), a 1024-token prompt: `cargo test --release -p rewind-kernels gdn -- --ignored`.
#[test]
#[ignore]
fn chunked_is_faster_on_a_long_prompt() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let dims = GdnDims {
        k_heads: 16,
        v_heads: 32,
        k_dim: 128,
        v_dim: 128,
    };
    let x = Case::random(&mut rng, dims, 1024);
    let t = std::time::Instant::now();
    let (ro, rs) = x.recurrent();
    let recurrent = t.elapsed();
    let t = std::time::Instant::now();
    let (co, cs) = x.chunked(64);
    let chunked = t.elapsed();
    eprintln!("1024 tokens, 32 heads of 128×128: recurrent {recurrent:?}, chunked {chunked:?}");
    assert!(rel(&co, &ro) < 1e-5 && rel(&cs, &rs) < 1e-5);
    assert!(chunked * 2 < recurrent);
}
