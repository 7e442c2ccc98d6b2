//! The gated delta rule (Gated DeltaNet, as in Qwen3-Next and Qwen3.5): a per-token step, the recurrent loop built
//! from it (the oracle), and the chunked WY / UT form used for prefill.
//!
//! The recurrent state of a value head is `S [v_dim, k_dim]` (the transpose of transformers' `[k_dim, v_dim]`), so
//! `S k` and `S q` read contiguous rows. One step, for every value head:
//! `S ← exp(g)·S;  u = β·(v − S k);  S ← S + u kᵀ;  o = S q`.
//! Value head `h` reads key head `h / (v_heads / k_heads)`, as transformers' `repeat_interleave` on the head axis does.
//!
//! q and k arrive already L2-normalised and q already scaled by `1/√k_dim`: the caller does it, once per token.

use rayon::prelude::*;

use super::gemm::{matmul_nn, matmul_nt, matmul_tn};

/// Head counts and head widths of a Gated DeltaNet layer.
#[derive(Clone, Copy, Debug)]
pub struct GdnDims {
    /// Key (and query) heads.
    pub k_heads: usize,
    /// Value heads, a multiple of `k_heads`.
    pub v_heads: usize,
    /// Channels per key head.
    pub k_dim: usize,
    /// Channels per value head.
    pub v_dim: usize,
}

impl GdnDims {
    /// Elements of one sequence's recurrent state: `v_heads · v_dim · k_dim`.
    pub fn state_len(&self) -> usize {
        self.v_heads * self.v_dim * self.k_dim
    }

    /// Value heads that share one key head.
    fn ratio(&self) -> usize {
        self.v_heads / self.k_heads
    }

    #[allow(clippy::too_many_arguments)]
    fn check(&self, op: &str, seq: usize, state: &[f32], q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32]) {
        assert!(
            self.k_heads > 0 && self.v_heads.is_multiple_of(self.k_heads),
            "{op}: v_heads must be a non-zero multiple of k_heads"
        );
        assert_eq!(state.len(), self.state_len(), "{op}: state");
        assert_eq!(q.len(), seq * self.k_heads * self.k_dim, "{op}: q");
        assert_eq!(k.len(), seq * self.k_heads * self.k_dim, "{op}: k");
        assert_eq!(v.len(), seq * self.v_heads * self.v_dim, "{op}: v");
        assert_eq!(g.len(), seq * self.v_heads, "{op}: g");
        assert_eq!(beta.len(), seq * self.v_heads, "{op}: beta");
    }
}

/// A dot product with eight independent partial sums, so the compiler can keep them in vector lanes (a single running
/// sum is a serial chain it may not reorder).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// One token of the gated delta rule for every value head, updating `state` in place.
///
/// `q`, `k` are `[k_heads, k_dim]`, `v` is `[v_heads, v_dim]`, `g` (log-decay, ≤ 0) and `beta` are `[v_heads]`,
/// `state` is `[v_heads, v_dim, k_dim]` and `out` `[v_heads, v_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn gdn_step(
    dims: GdnDims,
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    out: &mut [f32],
) {
    dims.check("gdn_step", 1, state, q, k, v, g, beta);
    assert_eq!(out.len(), dims.v_heads * dims.v_dim, "gdn_step: out");
    let GdnDims { k_dim, v_dim, .. } = dims;
    let ratio = dims.ratio();
    for (h, (s, o)) in state
        .chunks_exact_mut(v_dim * k_dim)
        .zip(out.chunks_exact_mut(v_dim))
        .enumerate()
    {
        let kh = h / ratio;
        let (qh, kk) = (&q[kh * k_dim..(kh + 1) * k_dim], &k[kh * k_dim..(kh + 1) * k_dim]);
        let vh = &v[h * v_dim..(h + 1) * v_dim];
        let (decay, b) = (g[h].exp(), beta[h]);
        // Each row of S only ever meets its own channel of v, so the whole step runs row by row in one pass.
        for ((row, &vr), or) in s.chunks_exact_mut(k_dim).zip(vh).zip(o.iter_mut()) {
            for x in row.iter_mut() {
                *x *= decay;
            }
            let u = b * (vr - dot(row, kk));
            for (x, kv) in row.iter_mut().zip(kk) {
                *x += u * kv;
            }
            *or = dot(row, qh);
        }
    }
}

/// The gated delta rule over `seq` tokens, one [`gdn_step`] at a time: the oracle for [`gdn_chunked`].
///
/// `q`, `k` are `[seq, k_heads, k_dim]`, `v` `[seq, v_heads, v_dim]`, `g`, `beta` `[seq, v_heads]`, `out`
/// `[seq, v_heads, v_dim]`; `state` (`[v_heads, v_dim, k_dim]`) holds the incoming state and receives the final one.
#[allow(clippy::too_many_arguments)]
pub fn gdn_recurrent(
    dims: GdnDims,
    seq: usize,
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    out: &mut [f32],
) {
    dims.check("gdn_recurrent", seq, state, q, k, v, g, beta);
    let (qk, vw, hw) = (dims.k_heads * dims.k_dim, dims.v_heads * dims.v_dim, dims.v_heads);
    assert_eq!(out.len(), seq * vw, "gdn_recurrent: out");
    for t in 0..seq {
        gdn_step(
            dims,
            state,
            &q[t * qk..(t + 1) * qk],
            &k[t * qk..(t + 1) * qk],
            &v[t * vw..(t + 1) * vw],
            &g[t * hw..(t + 1) * hw],
            &beta[t * hw..(t + 1) * hw],
            &mut out[t * vw..(t + 1) * vw],
        );
    }
}

/// The gated delta rule over `seq` tokens in chunks of `chunk_size`, in the WY / UT form of transformers'
/// `torch_chunk_gated_delta_rule` (and fla's chunk kernels). Same arguments and results as [`gdn_recurrent`].
///
/// Per chunk of `C` tokens and value head, with chunk-local decays `Γ[i, j] = exp(g_{j+1} + … + g_i)` for `j ≤ i`
/// and `γ_i = exp(g_0 + … + g_i)`: invert `I + tril(diag(β) K Kᵀ ⊙ Γ, −1)` by forward substitution and apply it
/// (GEMMs) to `diag(β) V` and `diag(β γ) K`, giving the corrected values `U` and the decayed keys `W`; then, with the
/// incoming state `S`, `V' = U − W Sᵀ`, `O = diag(γ) Q Sᵀ + (Q Kᵀ ⊙ tril(Γ)) V'` and
/// `S ← γ_{C−1} S + V'ᵀ diag(Γ[C−1, ·]) K`. Each decay is the exp of a running sum of `g` over a span inside the chunk
/// (not a difference of two long cumulative sums), so it is at most 1 and as precise as the span is short.
#[allow(clippy::too_many_arguments)]
pub fn gdn_chunked(
    dims: GdnDims,
    seq: usize,
    chunk_size: usize,
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    out: &mut [f32],
) {
    dims.check("gdn_chunked", seq, state, q, k, v, g, beta);
    assert!(chunk_size > 0, "gdn_chunked: chunk_size is 0");
    let GdnDims { k_dim, v_dim, .. } = dims;
    assert_eq!(out.len(), seq * dims.v_heads * v_dim, "gdn_chunked: out");
    if seq == 0 {
        return;
    }
    let inputs = Inputs { dims, q, k, v, g, beta };
    let per_head = |(h, s): (usize, &mut [f32])| -> Vec<f32> {
        let mut o = vec![0.0f32; seq * v_dim];
        HeadScan::new(dims, seq.min(chunk_size)).run(&inputs, h, s, &mut o);
        o
    };
    // Value heads are independent; threading them only pays once a head holds a few chunks' work.
    let heads: Vec<Vec<f32>> = if seq * k_dim * v_dim * dims.v_heads >= 1 << 20 {
        state
            .par_chunks_exact_mut(v_dim * k_dim)
            .enumerate()
            .map(per_head)
            .collect()
    } else {
        state
            .chunks_exact_mut(v_dim * k_dim)
            .enumerate()
            .map(per_head)
            .collect()
    };
    for (h, o) in heads.iter().enumerate() {
        for (t, row) in o.chunks_exact(v_dim).enumerate() {
            let at = (t * dims.v_heads + h) * v_dim;
            out[at..at + v_dim].copy_from_slice(row);
        }
    }
}

/// The token-major inputs of [`gdn_chunked`].
struct Inputs<'a> {
    dims: GdnDims,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
}

impl Inputs<'_> {
    /// Copies rows `t0 .. t0 + n` of head `head` of `src` (`[seq, heads, width]`) into `dst` as `[n, width]`.
    fn gather(dst: &mut [f32], src: &[f32], heads: usize, head: usize, width: usize, t0: usize, n: usize) {
        for (i, row) in dst[..n * width].chunks_exact_mut(width).enumerate() {
            let at = ((t0 + i) * heads + head) * width;
            row.copy_from_slice(&src[at..at + width]);
        }
    }
}

/// The scratch of one value head's chunked scan, sized for a full chunk and sliced down for a shorter last one.
struct HeadScan {
    chunk: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    /// Rows 0..C: `K Kᵀ`, then `A = diag(β) K Kᵀ ⊙ Γ`; rows C..2C: `Q Kᵀ`, then `Q Kᵀ ⊙ Γ`.
    scores: Vec<f32>,
    t_inv: Vec<f32>,
    rhs_v: Vec<f32>,
    rhs_k: Vec<f32>,
    u: Vec<f32>,
    /// Rows 0..C: `W`; rows C..2C: the queries decayed from the chunk start. Both read the state in one product.
    wq: Vec<f32>,
    read: Vec<f32>,
    k_end: Vec<f32>,
    ds: Vec<f32>,
    from_start: Vec<f32>,
    to_end: Vec<f32>,
}

impl HeadScan {
    fn new(dims: GdnDims, chunk: usize) -> Self {
        let (dk, dv, c) = (dims.k_dim, dims.v_dim, chunk);
        HeadScan {
            chunk,
            q: vec![0.0; c * dk],
            k: vec![0.0; c * dk],
            v: vec![0.0; c * dv],
            g: vec![0.0; c],
            beta: vec![0.0; c],
            scores: vec![0.0; 2 * c * c],
            t_inv: vec![0.0; c * c],
            rhs_v: vec![0.0; c * dv],
            rhs_k: vec![0.0; c * dk],
            u: vec![0.0; c * dv],
            wq: vec![0.0; 2 * c * dk],
            read: vec![0.0; 2 * c * dv],
            k_end: vec![0.0; c * dk],
            ds: vec![0.0; dv * dk],
            from_start: vec![0.0; c],
            to_end: vec![0.0; c],
        }
    }

    /// Scans every chunk of value head `h`, updating its state `s` (`[v_dim, k_dim]`) and writing `out` (`[seq, v_dim]`).
    fn run(&mut self, x: &Inputs, h: usize, s: &mut [f32], out: &mut [f32]) {
        let GdnDims {
            k_heads,
            v_heads,
            k_dim: dk,
            v_dim: dv,
        } = x.dims;
        let kh = h / x.dims.ratio();
        let seq = x.g.len() / v_heads;
        let mut c0 = 0;
        while c0 < seq {
            let c = self.chunk.min(seq - c0);
            Inputs::gather(&mut self.q, x.q, k_heads, kh, dk, c0, c);
            Inputs::gather(&mut self.k, x.k, k_heads, kh, dk, c0, c);
            Inputs::gather(&mut self.v, x.v, v_heads, h, dv, c0, c);
            Inputs::gather(&mut self.g, x.g, v_heads, h, 1, c0, c);
            Inputs::gather(&mut self.beta, x.beta, v_heads, h, 1, c0, c);
            self.scan_chunk(c, dk, dv, s, &mut out[c0 * dv..(c0 + c) * dv]);
            c0 += c;
        }
    }

    /// One chunk of `c` tokens whose inputs are in the scratch rows.
    fn scan_chunk(&mut self, c: usize, dk: usize, dv: usize, s: &mut [f32], out: &mut [f32]) {
        let (qc, kc, vc) = (&self.q[..c * dk], &self.k[..c * dk], &self.v[..c * dv]);
        let (gc, bc) = (&self.g[..c], &self.beta[..c]);
        let (from_start, to_end) = (&mut self.from_start[..c], &mut self.to_end[..c]);

        // Log-decays from the chunk start through token i, and from after token i to the chunk end.
        let mut acc = 0.0f32;
        for (f, gi) in from_start.iter_mut().zip(gc) {
            acc += gi;
            *f = acc;
        }
        acc = 0.0;
        for (e, gi) in to_end.iter_mut().zip(gc).rev() {
            *e = acc;
            acc += gi;
        }
        let chunk_decay = from_start[c - 1].exp();

        // [K; Q] Kᵀ in one product.
        let qk_rows = &mut self.wq[..2 * c * dk];
        qk_rows[..c * dk].copy_from_slice(kc);
        qk_rows[c * dk..].copy_from_slice(qc);
        let scores = &mut self.scores[..2 * c * c];
        matmul_nt(qk_rows, kc, scores, 2 * c, dk, c);
        let (kk, qk) = scores.split_at_mut(c * c);
        // Γ[i, j] for j ≤ i as a running sum down from the diagonal; the strictly upper triangle is masked.
        for i in 0..c {
            let mut span = 0.0f32;
            for j in (0..=i).rev() {
                let decay = span.exp();
                kk[i * c + j] *= bc[i] * decay;
                qk[i * c + j] *= decay;
                span += gc[j];
            }
            kk[i * c + i + 1..(i + 1) * c].fill(0.0);
            qk[i * c + i + 1..(i + 1) * c].fill(0.0);
        }
        // T = (I + A)⁻¹ with A = kk strictly below the diagonal, by forward substitution: row i of T is
        // e_i − Σ_{j<i} A[i, j] T[j], and only the first j + 1 columns of row j are non-zero.
        let t_inv = &mut self.t_inv[..c * c];
        t_inv.fill(0.0);
        for i in 0..c {
            let (done, row) = t_inv.split_at_mut(i * c);
            row[i] = 1.0;
            for (j, &a) in kk[i * c..i * c + i].iter().enumerate() {
                if a != 0.0 {
                    for (x, y) in row[..=j].iter_mut().zip(&done[j * c..j * c + j + 1]) {
                        *x -= a * y;
                    }
                }
            }
        }
        let (rhs_v, rhs_k, k_end) = (
            &mut self.rhs_v[..c * dv],
            &mut self.rhs_k[..c * dk],
            &mut self.k_end[..c * dk],
        );
        let (w, qd) = self.wq[..2 * c * dk].split_at_mut(c * dk);
        for i in 0..c {
            let (b, f, e) = (bc[i], from_start[i].exp(), to_end[i].exp());
            for (r, x) in rhs_v[i * dv..(i + 1) * dv].iter_mut().zip(&vc[i * dv..(i + 1) * dv]) {
                *r = b * x;
            }
            let kr = &kc[i * dk..(i + 1) * dk];
            for (((rk, ke), qr), (kx, qx)) in rhs_k[i * dk..(i + 1) * dk]
                .iter_mut()
                .zip(&mut k_end[i * dk..(i + 1) * dk])
                .zip(&mut qd[i * dk..(i + 1) * dk])
                .zip(kr.iter().zip(&qc[i * dk..(i + 1) * dk]))
            {
                *rk = b * f * kx;
                *ke = e * kx;
                *qr = f * qx;
            }
        }
        let u = &mut self.u[..c * dv];
        matmul_nn(t_inv, rhs_v, u, c, c, dv);
        matmul_nn(t_inv, rhs_k, w, c, c, dk);

        // [W; Q_dec] Sᵀ: what the incoming state predicts for each key, and each query's read of it.
        let read = &mut self.read[..2 * c * dv];
        matmul_nt(&self.wq[..2 * c * dk], s, read, 2 * c, dk, dv);
        for (x, p) in u.iter_mut().zip(&read[..c * dv]) {
            *x -= p;
        }
        matmul_nn(qk, u, out, c, c, dv);
        for (o, p) in out.iter_mut().zip(&read[c * dv..]) {
            *o += p;
        }
        matmul_tn(u, k_end, &mut self.ds, dv, c, dk);
        for (x, d) in s.iter_mut().zip(&self.ds) {
            *x = chunk_decay * *x + d;
        }
    }
}

#[cfg(test)]
mod tests;
