//! The Mamba-2 selective scan (SSD): the one-token recurrence and the chunked prefill scan.
//!
//! Per head `h` (reading B/C group `h / (heads / groups)`) and token `t`, with `dA = exp(dt·A)`:
//! `S = dA·S + dt·x ⊗ B` (`S` is `[head_dim, state_dim]`) and `y = S·C + D·x`.
//! [`mamba2_recurrent`] runs that literally and is the oracle; [`mamba2_chunked`] computes the same thing chunk by chunk
//! with matrix products (Mamba-2 paper §6, the `torch_forward` prefill path of transformers' Mamba-2 mixers).

use rayon::prelude::*;

use super::gemm::{matmul_nn, matmul_nt, matmul_tn};

/// Head and state sizes of one Mamba-2 layer (or of one tensor-parallel shard of it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mamba2Dims {
    /// SSM heads.
    pub heads: usize,
    /// Channels per head (`P`).
    pub head_dim: usize,
    /// State size (`N`).
    pub state_dim: usize,
    /// B/C groups; `heads` must be a multiple of it.
    pub groups: usize,
}

impl Mamba2Dims {
    fn heads_per_group(&self) -> usize {
        assert!(
            self.groups > 0 && self.heads.is_multiple_of(self.groups),
            "mamba2: heads ({}) must be a multiple of groups ({})",
            self.heads,
            self.groups
        );
        self.heads / self.groups
    }

    fn state_len(&self) -> usize {
        self.heads * self.head_dim * self.state_dim
    }
}

/// Checks every operand against `dims` for `seq` tokens.
#[allow(clippy::too_many_arguments)]
fn check_shapes(
    dims: Mamba2Dims,
    seq: usize,
    state: &[f32],
    x: &[f32],
    dt: &[f32],
    a: &[f32],
    b: &[f32],
    c: &[f32],
    d_skip: &[f32],
    y: &[f32],
) {
    dims.heads_per_group();
    assert!(dims.head_dim > 0 && dims.state_dim > 0, "mamba2: empty head or state");
    let (h, p, n, g) = (dims.heads, dims.head_dim, dims.state_dim, dims.groups);
    assert_eq!(state.len(), dims.state_len(), "mamba2: state");
    assert_eq!(x.len(), seq * h * p, "mamba2: x");
    assert_eq!(y.len(), seq * h * p, "mamba2: y");
    assert_eq!(dt.len(), seq * h, "mamba2: dt");
    assert_eq!(a.len(), h, "mamba2: A");
    assert_eq!(d_skip.len(), h, "mamba2: D");
    assert_eq!(b.len(), seq * g * n, "mamba2: B");
    assert_eq!(c.len(), seq * g * n, "mamba2: C");
}

/// One token: updates `state` in place and writes `y` (`[heads, head_dim]`, including the `D·x` skip).
///
/// `x` is `[heads, head_dim]`, `dt` `[heads]` (already softplus'd and clamped), `a` `[heads]` (negative),
/// `b` and `c` `[groups, state_dim]`, `d_skip` `[heads]`, `state` `[heads, head_dim, state_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn mamba2_step(
    dims: Mamba2Dims,
    state: &mut [f32],
    x: &[f32],
    dt: &[f32],
    a: &[f32],
    b: &[f32],
    c: &[f32],
    d_skip: &[f32],
    y: &mut [f32],
) {
    check_shapes(dims, 1, state, x, dt, a, b, c, d_skip, y);
    let hpg = dims.heads_per_group();
    let (p, n) = (dims.head_dim, dims.state_dim);
    for h in 0..dims.heads {
        let g = h / hpg;
        let (bg, cg) = (&b[g * n..(g + 1) * n], &c[g * n..(g + 1) * n]);
        let da = (dt[h] * a[h]).exp();
        let s_head = &mut state[h * p * n..(h + 1) * p * n];
        for (i, row) in s_head.chunks_exact_mut(n).enumerate() {
            let xi = x[h * p + i];
            let dtx = dt[h] * xi;
            let mut acc = 0.0f32;
            for ((s, bv), cv) in row.iter_mut().zip(bg).zip(cg) {
                *s = da * *s + dtx * bv;
                acc += *s * cv;
            }
            y[h * p + i] = acc + d_skip[h] * xi;
        }
    }
}

/// `seq` tokens through [`mamba2_step`], one at a time: the reference the chunked scan is tested against.
///
/// Shapes as in [`mamba2_chunked`].
#[allow(clippy::too_many_arguments)]
pub fn mamba2_recurrent(
    dims: Mamba2Dims,
    seq: usize,
    state: &mut [f32],
    x: &[f32],
    dt: &[f32],
    a: &[f32],
    b: &[f32],
    c: &[f32],
    d_skip: &[f32],
    y: &mut [f32],
) {
    check_shapes(dims, seq, state, x, dt, a, b, c, d_skip, y);
    let (hp, gn, h) = (dims.heads * dims.head_dim, dims.groups * dims.state_dim, dims.heads);
    for t in 0..seq {
        mamba2_step(
            dims,
            state,
            &x[t * hp..(t + 1) * hp],
            &dt[t * h..(t + 1) * h],
            a,
            &b[t * gn..(t + 1) * gn],
            &c[t * gn..(t + 1) * gn],
            d_skip,
            &mut y[t * hp..(t + 1) * hp],
        );
    }
}

/// Reorders `[seq, outer, inner]` into `[outer, seq, inner]`, so each head's or group's rows are contiguous.
fn to_outer_major(src: &[f32], seq: usize, outer: usize, inner: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; src.len()];
    for (t, row) in src.chunks_exact(outer * inner).enumerate() {
        for (o, v) in row.chunks_exact(inner).enumerate() {
            out[(o * seq + t) * inner..(o * seq + t + 1) * inner].copy_from_slice(v);
        }
    }
    out
}

/// Scratch buffers of one head's walk over the chunks, sized for the longest chunk.
struct HeadScratch {
    /// `seg[t·len + s] = Σ_{s < r ≤ t} dt_r·A` for `s ≤ t`: the decay from token `s` to token `t` inside a chunk.
    seg: Vec<f32>,
    /// The masked, decayed `C·Bᵀ` of the chunk, times `dt_s`: `[len, len]`.
    m: Vec<f32>,
    /// Product outputs `[len, head_dim]`.
    y_diag: Vec<f32>,
    y_off: Vec<f32>,
    /// `x_s·dt_s·exp(decay from s to the chunk end)`, `[len, head_dim]`.
    xw: Vec<f32>,
    /// The chunk's own contribution to the outgoing state, `[head_dim, state_dim]`.
    ds: Vec<f32>,
}

impl HeadScratch {
    fn new(chunk: usize, dims: Mamba2Dims) -> Self {
        let (p, n) = (dims.head_dim, dims.state_dim);
        HeadScratch {
            seg: vec![0.0; chunk * chunk],
            m: vec![0.0; chunk * chunk],
            y_diag: vec![0.0; chunk * p],
            y_off: vec![0.0; chunk * p],
            xw: vec![0.0; chunk * p],
            ds: vec![0.0; p * n],
        }
    }
}

/// The chunked (SSD) scan over `seq` tokens, starting from `state` and leaving the final state in it.
///
/// `x` is `[seq, heads, head_dim]`, `dt` `[seq, heads]` (already softplus'd and clamped), `a` `[heads]` (negative),
/// `b` and `c` `[seq, groups, state_dim]`, `d_skip` `[heads]`, `state` `[heads, head_dim, state_dim]`; `y`
/// (`[seq, heads, head_dim]`) receives the output including the `D·x` skip. `seq` need not be a multiple of
/// `chunk_size`; the last chunk is just shorter.
///
/// Inside a chunk of length `L` (per head, `a_t = dt_t·A ≤ 0`, `seg(t, s) = Σ_{s<r≤t} a_r`):
/// `y_t = Σ_{s≤t} exp(seg(t,s))·(C_t·B_s)·dt_s·x_s + exp(seg(t,−1))·S_in·C_t`, and
/// `S_out = exp(seg(L−1,−1))·S_in + Σ_s exp(seg(L−1,s))·dt_s·x_s ⊗ B_s`. Every exponent is a sum of non-positive terms,
/// accumulated directly rather than as a difference of prefix sums, so nothing cancels or overflows.
#[allow(clippy::too_many_arguments)]
pub fn mamba2_chunked(
    dims: Mamba2Dims,
    seq: usize,
    chunk_size: usize,
    state: &mut [f32],
    x: &[f32],
    dt: &[f32],
    a: &[f32],
    b: &[f32],
    c: &[f32],
    d_skip: &[f32],
    y: &mut [f32],
) {
    check_shapes(dims, seq, state, x, dt, a, b, c, d_skip, y);
    assert!(chunk_size > 0, "mamba2: chunk_size must be positive");
    if seq == 0 {
        return;
    }
    let hpg = dims.heads_per_group();
    let (heads, p, n, groups) = (dims.heads, dims.head_dim, dims.state_dim, dims.groups);
    let chunk = chunk_size.min(seq);
    let chunks: Vec<(usize, usize)> = (0..seq).step_by(chunk).map(|s| (s, (seq - s).min(chunk))).collect();

    let b_g = to_outer_major(b, seq, groups, n);
    let c_g = to_outer_major(c, seq, groups, n);
    let x_h = to_outer_major(x, seq, heads, p);
    let dt_h = to_outer_major(dt, seq, heads, 1);

    // C·Bᵀ of each chunk is shared by all heads of a group: compute it once, [groups][chunk][len, len].
    let cb: Vec<Vec<Vec<f32>>> = (0..groups)
        .into_par_iter()
        .map(|g| {
            chunks
                .iter()
                .map(|&(start, len)| {
                    let rows = (g * seq + start) * n..(g * seq + start + len) * n;
                    let mut out = vec![0.0f32; len * len];
                    matmul_nt(&c_g[rows.clone()], &b_g[rows], &mut out, len, n, len);
                    out
                })
                .collect()
        })
        .collect();

    let mut y_h = vec![0.0f32; seq * heads * p];
    state
        .par_chunks_mut(p * n)
        .zip(y_h.par_chunks_mut(seq * p))
        .enumerate()
        .for_each(|(h, (s_head, y_head))| {
            let g = h / hpg;
            let mut scratch = HeadScratch::new(chunk, dims);
            for (ci, &(start, len)) in chunks.iter().enumerate() {
                let rows = |w: usize, base: usize| (base + start) * w..(base + start + len) * w;
                let chunk_scan = ChunkInput {
                    len,
                    dims,
                    a: a[h],
                    dt: &dt_h[rows(1, h * seq)],
                    x: &x_h[rows(p, h * seq)],
                    b: &b_g[rows(n, g * seq)],
                    c: &c_g[rows(n, g * seq)],
                    cb: &cb[g][ci],
                };
                chunk_scan.run(&mut scratch, s_head, &mut y_head[start * p..(start + len) * p]);
            }
        });

    // Back to [seq, heads, head_dim], adding the D·x skip.
    for (t, (y_row, x_row)) in y.chunks_exact_mut(heads * p).zip(x.chunks_exact(heads * p)).enumerate() {
        for h in 0..heads {
            let src = &y_h[(h * seq + t) * p..(h * seq + t + 1) * p];
            let dst = &mut y_row[h * p..(h + 1) * p];
            for ((o, v), xv) in dst.iter_mut().zip(src).zip(&x_row[h * p..(h + 1) * p]) {
                *o = v + d_skip[h] * xv;
            }
        }
    }
}

/// One head's inputs over one chunk, all row-major and contiguous.
struct ChunkInput<'a> {
    len: usize,
    dims: Mamba2Dims,
    a: f32,
    /// `[len]`.
    dt: &'a [f32],
    /// `[len, head_dim]`.
    x: &'a [f32],
    /// `[len, state_dim]` (the head's group).
    b: &'a [f32],
    c: &'a [f32],
    /// `C·Bᵀ`, `[len, len]`.
    cb: &'a [f32],
}

impl ChunkInput<'_> {
    /// Writes the chunk's SSM output (without the skip) to `y` (`[len, head_dim]`) and advances `state` past the chunk.
    fn run(&self, sc: &mut HeadScratch, state: &mut [f32], y: &mut [f32]) {
        let (len, p, n) = (self.len, self.dims.head_dim, self.dims.state_dim);
        let seg = &mut sc.seg[..len * len];
        for t in 0..len {
            let row = &mut seg[t * len..(t + 1) * len];
            let mut acc = 0.0f32;
            row[t] = 0.0;
            for s in (0..t).rev() {
                acc += self.dt[s + 1] * self.a;
                row[s] = acc;
            }
        }
        // Decay from the chunk's start (before token 0) to token t: seg(t, 0) + a_0.
        let from_start = |t: usize| seg[t * len] + self.dt[0] * self.a;

        // Intra-chunk (diagonal block): y_diag = (exp(seg) ∘ C·Bᵀ ∘ dt_s, lower triangle) · X.
        let m = &mut sc.m[..len * len];
        for t in 0..len {
            for s in 0..len {
                m[t * len + s] = if s <= t {
                    self.cb[t * len + s] * seg[t * len + s].exp() * self.dt[s]
                } else {
                    0.0
                };
            }
        }
        let y_diag = &mut sc.y_diag[..len * p];
        matmul_nn(m, self.x, y_diag, len, len, p);

        // Incoming state (off-diagonal block): y_off[t] = exp(decay to t) · S_in·C_t.
        let y_off = &mut sc.y_off[..len * p];
        matmul_nt(self.c, state, y_off, len, n, p);
        for t in 0..len {
            let decay = from_start(t).exp();
            for ((o, d), off) in y[t * p..(t + 1) * p]
                .iter_mut()
                .zip(&y_diag[t * p..(t + 1) * p])
                .zip(&y_off[t * p..(t + 1) * p])
            {
                *o = d + decay * off;
            }
        }

        // Outgoing state: S_out = exp(total decay)·S_in + Xwᵀ·B, with Xw[s] = x_s·dt_s·exp(seg(L−1, s)).
        let last = len - 1;
        let xw = &mut sc.xw[..len * p];
        for s in 0..len {
            let w = self.dt[s] * seg[last * len + s].exp();
            for (o, v) in xw[s * p..(s + 1) * p].iter_mut().zip(&self.x[s * p..(s + 1) * p]) {
                *o = v * w;
            }
        }
        matmul_tn(xw, self.b, &mut sc.ds, p, len, n);
        let total = from_start(last).exp();
        for (s, d) in state.iter_mut().zip(&sc.ds) {
            *s = total * *s + d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    struct Case {
        dims: Mamba2Dims,
        seq: usize,
        state: Vec<f32>,
        x: Vec<f32>,
        dt: Vec<f32>,
        a: Vec<f32>,
        b: Vec<f32>,
        c: Vec<f32>,
        d: Vec<f32>,
    }

    fn uniform(rng: &mut ChaCha8Rng, len: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(lo..hi)).collect()
    }

    fn random_case(rng: &mut ChaCha8Rng, seq: usize) -> Case {
        let groups = rng.random_range(1..=3);
        let dims = Mamba2Dims {
            heads: groups * rng.random_range(1..=3),
            head_dim: rng.random_range(1..=9),
            state_dim: rng.random_range(1..=12),
            groups,
        };
        let (h, p, n) = (dims.heads, dims.head_dim, dims.state_dim);
        Case {
            dims,
            seq,
            state: uniform(rng, h * p * n, -1.0, 1.0),
            x: uniform(rng, seq * h * p, -1.0, 1.0),
            // Some steps decay almost nothing, some almost everything.
            dt: (0..seq * h).map(|_| rng.random_range(-7.0f32..1.0).exp()).collect(),
            a: uniform(rng, h, -4.0, -0.05),
            b: uniform(rng, seq * groups * n, -1.0, 1.0),
            c: uniform(rng, seq * groups * n, -1.0, 1.0),
            d: uniform(rng, h, -1.0, 1.0),
        }
    }

    fn rel(got: &[f32], want: &[f32]) -> f64 {
        let diff: f64 = got.iter().zip(want).map(|(g, w)| ((g - w) as f64).powi(2)).sum();
        let norm: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum();
        (diff / norm.max(1e-30)).sqrt()
    }

    fn recurrent(k: &Case) -> (Vec<f32>, Vec<f32>) {
        let mut state = k.state.clone();
        let mut y = vec![f32::NAN; k.x.len()];
        mamba2_recurrent(k.dims, k.seq, &mut state, &k.x, &k.dt, &k.a, &k.b, &k.c, &k.d, &mut y);
        (y, state)
    }

    fn chunked(k: &Case, chunk: usize) -> (Vec<f32>, Vec<f32>) {
        let mut state = k.state.clone();
        let mut y = vec![f32::NAN; k.x.len()];
        mamba2_chunked(
            k.dims, k.seq, chunk, &mut state, &k.x, &k.dt, &k.a, &k.b, &k.c, &k.d, &mut y,
        );
        (y, state)
    }

    #[test]
    fn step_matches_hand_computation() {
        // One head, head_dim 1, state_dim 2: S = dA·S + dt·x·B, y = S·C + D·x.
        let dims = Mamba2Dims {
            heads: 1,
            head_dim: 1,
            state_dim: 2,
            groups: 1,
        };
        let mut state = [0.5f32, -1.0];
        let mut y = [0.0f32];
        mamba2_step(
            dims,
            &mut state,
            &[2.0],
            &[0.1],
            &[-3.0],
            &[1.0, 4.0],
            &[0.5, -2.0],
            &[0.25],
            &mut y,
        );
        let da = (-0.3f32).exp();
        let s = [da * 0.5 + 0.2, 0.8 - da];
        assert!((state[0] - s[0]).abs() < 1e-6 && (state[1] - s[1]).abs() < 1e-6);
        assert!((y[0] - (s[0] * 0.5 - s[1] * 2.0 + 0.5)).abs() < 1e-6);
    }

    #[test]
    fn heads_read_their_group() {
        // Two groups of two heads; only group 1's B/C are non-zero, so heads 0 and 1 see nothing but the skip.
        let dims = Mamba2Dims {
            heads: 4,
            head_dim: 1,
            state_dim: 1,
            groups: 2,
        };
        let mut state = [0.0f32; 4];
        let mut y = [0.0f32; 4];
        let x = [1.0, 2.0, 3.0, 4.0];
        mamba2_step(
            dims,
            &mut state,
            &x,
            &[1.0; 4],
            &[-1.0; 4],
            &[0.0, 1.0],
            &[0.0, 1.0],
            &[0.0; 4],
            &mut y,
        );
        assert_eq!(&state[..2], &[0.0, 0.0]);
        assert_eq!(&y, &[0.0, 0.0, 3.0, 4.0]);
    }

    #[test]
    fn chunked_matches_recurrent() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for case in 0..150 {
            let seq = rng.random_range(1..=100);
            let chunk = rng.random_range(1..=64);
            let k = random_case(&mut rng, seq);
            let (y_ref, s_ref) = recurrent(&k);
            let (y, s) = chunked(&k, chunk);
            let (ey, es) = (rel(&y, &y_ref), rel(&s, &s_ref));
            assert!(
                ey < 1e-5 && es < 1e-5,
                "case {case}: {:?} seq {seq} chunk {chunk}: y {ey:e}, state {es:e}",
                k.dims
            );
        }
    }

    #[test]
    fn split_chunked_calls_equal_one_call() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for case in 0..60 {
            let seq = rng.random_range(2..=100);
            let chunk = rng.random_range(1..=64);
            let k = random_case(&mut rng, seq);
            let (y_ref, s_ref) = chunked(&k, chunk);
            let cut = rng.random_range(1..seq);
            let (hp, gn, h) = (
                k.dims.heads * k.dims.head_dim,
                k.dims.groups * k.dims.state_dim,
                k.dims.heads,
            );
            let mut state = k.state.clone();
            let mut y = vec![f32::NAN; k.x.len()];
            for (lo, hi) in [(0, cut), (cut, seq)] {
                mamba2_chunked(
                    k.dims,
                    hi - lo,
                    chunk,
                    &mut state,
                    &k.x[lo * hp..hi * hp],
                    &k.dt[lo * h..hi * h],
                    &k.a,
                    &k.b[lo * gn..hi * gn],
                    &k.c[lo * gn..hi * gn],
                    &k.d,
                    &mut y[lo * hp..hi * hp],
                );
            }
            let (ey, es) = (rel(&y, &y_ref), rel(&state, &s_ref));
            assert!(
                ey < 1e-5 && es < 1e-5,
                "case {case}: cut {cut} of {seq}: y {ey:e}, state {es:e}"
            );
        }
    }

    #[test]
    fn strong_decay_stays_finite() {
        // dt·A down to about −1000 per token: exp of every exponent must underflow to 0, never overflow.
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut k = random_case(&mut rng, 90);
        for v in k.dt.iter_mut() {
            *v = rng.random_range(0.0f32..250.0);
        }
        let (y_ref, s_ref) = recurrent(&k);
        let (y, s) = chunked(&k, 32);
        assert!(y.iter().chain(&s).all(|v| v.is_finite()));
        assert!(rel(&y, &y_ref) < 1e-5 && rel(&s, &s_ref) < 1e-5);
    }

    #[test]
    fn empty_sequence_keeps_state() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let k = random_case(&mut rng, 0);
        let (y, s) = chunked(&k, 8);
        assert!(y.is_empty());
        assert_eq!(s, k.state);
    }
}
