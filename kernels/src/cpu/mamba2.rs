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
///
/// The heads of one group share `B` and `C`, and their states are contiguous, so the incoming-state output and the state
/// update are one product per group and chunk (`[L, N]·[heads_per_group·P, N]ᵀ` and its transpose); only the masked
/// intra-chunk product is per head. Groups run in parallel, and so do the heads inside a group.
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
    let (heads, p, n) = (dims.heads, dims.head_dim, dims.state_dim);
    let width = hpg * p;
    let input = ScanInput {
        dims,
        seq,
        chunk: chunk_size.min(seq),
        x,
        dt,
        a,
        b,
        c,
    };
    // Each group writes its own [seq, heads_per_group·P] block; y interleaves groups within a row.
    let mut y_groups = vec![0.0f32; seq * heads * p];
    state
        .par_chunks_mut(width * n)
        .zip(y_groups.par_chunks_mut(seq * width))
        .enumerate()
        .for_each(|(g, (s_group, y_group))| input.scan_group(g, s_group, y_group));

    y.par_chunks_mut(heads * p)
        .zip(x.par_chunks(heads * p))
        .enumerate()
        .for_each(|(t, (y_row, x_row))| {
            for (h, (y_head, x_head)) in y_row.chunks_exact_mut(p).zip(x_row.chunks_exact(p)).enumerate() {
                let (g, j) = (h / hpg, h % hpg);
                let src = &y_groups[(g * seq + t) * width + j * p..(g * seq + t) * width + (j + 1) * p];
                for ((o, v), xv) in y_head.iter_mut().zip(src).zip(x_head) {
                    *o = v + d_skip[h] * xv;
                }
            }
        });
}

/// The operands of [`mamba2_chunked`], in their caller's layout.
struct ScanInput<'a> {
    dims: Mamba2Dims,
    seq: usize,
    /// Chunk length (the last chunk may be shorter).
    chunk: usize,
    x: &'a [f32],
    dt: &'a [f32],
    a: &'a [f32],
    b: &'a [f32],
    c: &'a [f32],
}

/// One head's share of one chunk: its intra-chunk output, its decay-weighted inputs for the state update, and its decays.
struct HeadChunk {
    /// `Σ_{s≤t} exp(seg(t,s))·(C_t·B_s)·dt_s·x_s`, `[len, P]`.
    y_diag: Vec<f32>,
    /// `x_s·dt_s·exp(seg(L−1, s))`, `[len, P]`.
    x_weighted: Vec<f32>,
    /// `exp(seg(t, −1))`: the decay of the incoming state up to token `t`, `[len]`.
    from_start: Vec<f32>,
}

impl ScanInput<'_> {
    /// Runs every chunk for group `g`: `s_group` is its heads' states `[heads_per_group·P, N]`, `y_group` receives
    /// `[seq, heads_per_group·P]` (without the skip).
    fn scan_group(&self, g: usize, s_group: &mut [f32], y_group: &mut [f32]) {
        let d = self.dims;
        let hpg = d.heads / d.groups;
        let (p, n, width) = (d.head_dim, d.state_dim, hpg * d.head_dim);
        let mut xg = vec![0.0f32; self.chunk * width];
        let mut dtg = vec![0.0f32; self.chunk * hpg];
        let mut bc = vec![0.0f32; self.chunk * n];
        let mut cc = vec![0.0f32; self.chunk * n];
        let mut cb = vec![0.0f32; self.chunk * self.chunk];
        let mut y_off = vec![0.0f32; self.chunk * width];
        let mut xw = vec![0.0f32; self.chunk * width];
        let mut ds = vec![0.0f32; width * n];
        for start in (0..self.seq).step_by(self.chunk) {
            let len = (self.seq - start).min(self.chunk);
            // Gather this group's rows into contiguous [len, ·] operands.
            for t in 0..len {
                let row = start + t;
                let xo = (row * d.heads + g * hpg) * p;
                xg[t * width..(t + 1) * width].copy_from_slice(&self.x[xo..xo + width]);
                let dto = row * d.heads + g * hpg;
                dtg[t * hpg..(t + 1) * hpg].copy_from_slice(&self.dt[dto..dto + hpg]);
                let bo = (row * d.groups + g) * n;
                bc[t * n..(t + 1) * n].copy_from_slice(&self.b[bo..bo + n]);
                cc[t * n..(t + 1) * n].copy_from_slice(&self.c[bo..bo + n]);
            }
            let (xg, dtg, bc, cc) = (&xg[..len * width], &dtg[..len * hpg], &bc[..len * n], &cc[..len * n]);
            let cb = &mut cb[..len * len];
            matmul_nt(cc, bc, cb, len, n, len);
            let y_off = &mut y_off[..len * width];
            matmul_nt(cc, s_group, y_off, len, n, width);

            let parts: Vec<HeadChunk> = (0..hpg)
                .into_par_iter()
                .map(|j| head_chunk(len, p, hpg, j, self.a[g * hpg + j], dtg, xg, cb))
                .collect();

            let xw = &mut xw[..len * width];
            for (j, part) in parts.iter().enumerate() {
                let cols = j * p..(j + 1) * p;
                for t in 0..len {
                    let out = &mut y_group[(start + t) * width..(start + t + 1) * width][cols.clone()];
                    let decay = part.from_start[t];
                    for ((o, dg), off) in out
                        .iter_mut()
                        .zip(&part.y_diag[t * p..(t + 1) * p])
                        .zip(&y_off[t * width..(t + 1) * width][cols.clone()])
                    {
                        *o = dg + decay * off;
                    }
                    xw[t * width..(t + 1) * width][cols.clone()].copy_from_slice(&part.x_weighted[t * p..(t + 1) * p]);
                }
            }
            matmul_tn(xw, bc, &mut ds, width, len, n);
            for (j, part) in parts.iter().enumerate() {
                let total = part.from_start[len - 1];
                let rows = j * p * n..(j + 1) * p * n;
                for (s, dv) in s_group[rows.clone()].iter_mut().zip(&ds[rows]) {
                    *s = total * *s + dv;
                }
            }
        }
    }
}

/// Head `j` of a group over one chunk of `len` tokens. `dtg` is `[len, hpg]`, `xg` `[len, hpg·P]`, `cb = C·Bᵀ` `[len, len]`.
#[allow(clippy::too_many_arguments)]
fn head_chunk(len: usize, p: usize, hpg: usize, j: usize, a: f32, dtg: &[f32], xg: &[f32], cb: &[f32]) -> HeadChunk {
    let width = hpg * p;
    let dt: Vec<f32> = (0..len).map(|t| dtg[t * hpg + j]).collect();
    let a_dt: Vec<f32> = dt.iter().map(|d| d * a).collect();
    // m[t, s] = exp(seg(t, s))·cb[t, s]·dt_s on and below the diagonal, with seg accumulated from t downwards.
    let mut m = vec![0.0f32; len * len];
    let mut from_start = vec![0.0f32; len];
    let mut to_end = vec![0.0f32; len];
    for t in 0..len {
        let row = &mut m[t * len..(t + 1) * len];
        let mut seg = 0.0f32;
        row[t] = cb[t * len + t] * dt[t];
        for s in (0..t).rev() {
            seg += a_dt[s + 1];
            row[s] = cb[t * len + s] * seg.exp() * dt[s];
            if t == len - 1 {
                to_end[s] = seg;
            }
        }
        from_start[t] = (seg + a_dt[0]).exp();
    }
    let mut xh = vec![0.0f32; len * p];
    for t in 0..len {
        xh[t * p..(t + 1) * p].copy_from_slice(&xg[t * width + j * p..t * width + (j + 1) * p]);
    }
    let mut y_diag = vec![0.0f32; len * p];
    matmul_nn(&m, &xh, &mut y_diag, len, len, p);
    let mut x_weighted = xh;
    for (s, row) in x_weighted.chunks_exact_mut(p).enumerate() {
        let w = dt[s] * to_end[s].exp();
        for v in row {
            *v *= w;
        }
    }
    HeadChunk {
        y_diag,
        x_weighted,
        from_start,
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

    /// `cargo test -p rewind-kernels cpu::mamba2::tests::timing -- --ignored --nocapture` (the test profile is optimised).
    #[test]
    #[ignore = "timing on Nemotron-H-8B shapes, not a correctness check"]
    fn timing_1024_token_prompt() {
        let dims = Mamba2Dims {
            heads: 128,
            head_dim: 64,
            state_dim: 128,
            groups: 8,
        };
        let seq = 1024;
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let (h, p, n, g) = (dims.heads, dims.head_dim, dims.state_dim, dims.groups);
        let k = Case {
            dims,
            seq,
            state: uniform(&mut rng, h * p * n, -1.0, 1.0),
            x: uniform(&mut rng, seq * h * p, -1.0, 1.0),
            dt: uniform(&mut rng, seq * h, 0.001, 0.1),
            a: uniform(&mut rng, h, -8.0, -1.0),
            b: uniform(&mut rng, seq * g * n, -1.0, 1.0),
            c: uniform(&mut rng, seq * g * n, -1.0, 1.0),
            d: uniform(&mut rng, h, -1.0, 1.0),
        };
        let t0 = std::time::Instant::now();
        let (y_ref, s_ref) = recurrent(&k);
        let t_rec = t0.elapsed();
        let t0 = std::time::Instant::now();
        let (y, s) = chunked(&k, 128);
        let t_chunk = t0.elapsed();
        println!(
            "recurrent {t_rec:?}, chunked {t_chunk:?} ({:.1}x), threads {}; rel err y {:e} state {:e}",
            t_rec.as_secs_f64() / t_chunk.as_secs_f64(),
            rayon::current_num_threads(),
            rel(&y, &y_ref),
            rel(&s, &s_ref)
        );
    }
}
