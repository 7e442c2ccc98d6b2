//! Input-replay decode for Gated DeltaNet (ReplaySSM appendix A, Algorithms 6–8; KVBuffer §3): instead of writing the
//! recurrent state back every token, keep a checkpoint `S0` and a ring of the inputs since it, rebuild the state when a
//! step needs it, and write the checkpoint only at a flush.
//!
//! The ring caches `(u, k, g)` per token, where `u = β(v − S k)` is the *corrected* value computed against the state
//! before that token (decayed by its own gate). Caching the raw `v` would make a replay need every intermediate state
//! again; with `u` the update is `S_t = e^{g_t} S_{t−1} + u_t k_tᵀ`, so with `h` entries since the checkpoint
//! `S_h = (Π_j e^{g_j}) S0 + Σ_j (Π_{i>j} e^{g_i}) u_j k_jᵀ`.
//!
//! Shapes follow [`super::gdn`]: per value head the state is `[v_dim, k_dim]`, a whole layer's state
//! `[v_heads, v_dim, k_dim]`, and value head `h` reads key head `h / (v_heads / k_heads)`. q and k arrive L2-normalised,
//! q scaled by `1/√k_dim`; every `g` is a log-decay ≤ 0. Every exponential here is of a sum of gates over a span (never a
//! difference of two long cumulative sums), so it is of a non-positive number and at most 1.
//!
//! Each op returns the [`Traffic`] a GPU kernel doing the same work moves (see [`super::traffic`]): fp32 states, bf16
//! vectors (ring `u` and `k`, step inputs q, k, v, outputs y), fp32 per-head scalars (ring `g`, step `g` and `β`).
//! A ring entry costs `v_heads·(2·v_dim + 4) + k_heads·2·k_dim` bytes: per value head `2·v_dim` for `u`, 4 for `g`,
//! and `2·k_dim / (v_heads / k_heads)` for its share of the key it reads with the other heads of its group.

use rayon::prelude::*;

use super::gdn::GdnDims;
use super::gemm::{matmul_nn, matmul_nt, matmul_tn};
use super::traffic::Traffic;

mod ring;

pub use super::ring::RingIndex;
pub use ring::{GdnEntry, GdnRing, GdnRingBuf};

/// The step inputs of `t` consecutive tokens of one sequence (one for a decode, the drafts for a verify):
/// `q`, `k` `[t, k_heads, k_dim]` (L2-normalised, q scaled), `v` `[t, v_heads, v_dim]`, `g` (≤ 0), `beta` `[t, v_heads]`.
#[derive(Clone, Copy, Debug)]
pub struct GdnTokens<'a> {
    /// Queries.
    pub q: &'a [f32],
    /// Keys.
    pub k: &'a [f32],
    /// Values.
    pub v: &'a [f32],
    /// Log-decays.
    pub g: &'a [f32],
    /// Write strengths.
    pub beta: &'a [f32],
}

impl GdnTokens<'_> {
    /// Checks the shapes against `dims` and returns the token count.
    fn count(&self, dims: GdnDims, op: &str) -> usize {
        let t = self.g.len() / dims.v_heads.max(1);
        assert_eq!(self.g.len(), t * dims.v_heads, "{op}: g");
        assert_eq!(self.beta.len(), t * dims.v_heads, "{op}: beta");
        assert_eq!(self.q.len(), t * dims.k_heads * dims.k_dim, "{op}: q");
        assert_eq!(self.k.len(), t * dims.k_heads * dims.k_dim, "{op}: k");
        assert_eq!(self.v.len(), t * dims.v_heads * dims.v_dim, "{op}: v");
        t
    }
}

/// `h + 2T > L`: a step that starts with `h` committed entries and verifies `T` drafts (`T = 1` for plain decode) must
/// flush, so that after it at least `T` free rows remain for the next window (ReplaySSM §5.3; flushing at `h + T > L`
/// could truncate the next window). For `T = 1` this is Alg. 6's "buffer full". Requires `capacity ≥ 2T`.
pub fn needs_flush(h: usize, t: usize, capacity: usize) -> bool {
    h + 2 * t > capacity
}

/// The context length at which a KV-only sequence compresses into a checkpoint by default: the key head dim, where the
/// ring (`≈ 2·(v_dim + k_dim)` bytes a token and head) starts to cost more than the state (`4·v_dim·k_dim`) it avoids
/// (KVBuffer §3.4). A KV-only ring needs `capacity ≥ threshold + T`.
pub fn default_compress_threshold(dims: GdnDims) -> usize {
    dims.k_dim
}

/// `S_h`: the state after every committed entry, rebuilt from the checkpoint (`None`: a zero checkpoint, the KV-only
/// form) and the ring, into `state` (`[v_heads, v_dim, k_dim]`). For tests and for materialising a state on demand.
pub fn reconstruct(checkpoint: Option<&[f32]>, ring: &GdnRing, state: &mut [f32]) {
    let dims = ring.dims;
    let per = dims.v_dim * dims.k_dim;
    assert_eq!(state.len(), dims.state_len(), "reconstruct: state");
    if let Some(c) = checkpoint {
        assert_eq!(c.len(), dims.state_len(), "reconstruct: checkpoint");
    }
    for (h, s) in state.chunks_exact_mut(per).enumerate() {
        ring.history(h, ring.len())
            .fold(dims, checkpoint.map(|c| &c[h * per..(h + 1) * per]), s);
    }
}

/// One decode step (Alg. 6, the state-and-output route): rebuild `S_h` from the checkpoint and the `h` committed
/// entries (in scratch, never written back), `u = β(v − α S_h k)`, `y = α S_h q + u (k·q)` into `out`
/// (`[v_heads, v_dim]`), and append `(u, k, g)` as a committed entry.
///
/// `checkpoint` is `[v_heads, v_dim, k_dim]`, or `None` for the KV-only form (a zero checkpoint, neither read nor
/// counted; `S_h q`, `S_h k` then come from the ring alone as `Σ_j w_j u_j (k_j·x)`). `flush` is the per-sequence flag
/// (data, not a host branch; [`needs_flush`]`(h, T, L)` with the sequence's window, `T = 1` being Alg. 6's "buffer
/// full"): the step then writes the state after this token, `α S_h + u kᵀ`, to the checkpoint and empties the ring,
/// since a decode step's own entry is committed. Requires `h < L`, no pending drafts, and a checkpoint to flush into.
pub fn replay_decode(
    checkpoint: Option<&mut [f32]>,
    ring: &mut GdnRing,
    x: GdnTokens,
    out: &mut [f32],
    flush: bool,
) -> Traffic {
    let dims = ring.dims;
    assert_eq!(x.count(dims, "replay_decode"), 1, "replay_decode: one token");
    let len = ring.len();
    let has_state = checkpoint.is_some();
    assert!(
        !flush || has_state,
        "replay_decode: a KV-only ring compresses, it does not flush"
    );
    ring.index.stage(1);
    let fold = if flush { Fold::All } else { Fold::Keep };
    let heads = run_heads(checkpoint, ring, &x, 1, out, fold);
    append(ring, len, &x, 1, &heads);
    ring.index.commit(1);
    if flush {
        ring.index.fold(len + 1);
    }
    step_traffic(dims, len, 1, has_state, flush)
}

/// Speculative verification of `T` drafts (Alg. 8): rebuild `S_h` once, read it at every draft query and key (one
/// GEMM), then with cumulative gates `G_s = g_0 + … + g_s` (s = 0 .. T, 0-based), the strictly lower triangular
/// `A[s, s'] = β_s e^{G_s − G_s'} (k_s·k_s')` and `R_s = β_s (v_s − e^{G_s} S_h k_s)`, solve `(I + A) U = R` by forward
/// substitution and write `y_s = e^{G_s} S_h q_s + Σ_{s' ≤ s} e^{G_s − G_s'} (k_s'·q_s) U_s'` to `out`
/// (`[T, v_heads, v_dim]`). The `T` entries `(U_s, k_s, g_s)` are appended as pending; [`commit_replay`] keeps the
/// accepted prefix. `U_s` is exactly the recurrent form's `u` for draft `s` given drafts `0 .. s` accepted.
///
/// `checkpoint`: as in [`replay_decode`]. `flush` (the flag [`needs_flush`]`(h, T, L)`) writes `S_h`, the committed
/// history only, to the checkpoint and moves `start` past it; the drafts stay in the ring as entries `0 .. T`, so a
/// rejected draft never reaches a checkpoint. Requires `T ≥ 1`, `h + T ≤ L` and no pending drafts.
pub fn verify_replay(
    checkpoint: Option<&mut [f32]>,
    ring: &mut GdnRing,
    drafts: GdnTokens,
    out: &mut [f32],
    flush: bool,
) -> Traffic {
    let dims = ring.dims;
    let t = drafts.count(dims, "verify_replay");
    let len = ring.len();
    assert!(t >= 1, "verify_replay: no drafts");
    let has_state = checkpoint.is_some();
    assert!(
        !flush || has_state,
        "verify_replay: a KV-only ring compresses, it does not flush"
    );
    ring.index.stage(t);
    let fold = if flush { Fold::History } else { Fold::Keep };
    let heads = run_heads(checkpoint, ring, &drafts, t, out, fold);
    append(ring, len, &drafts, t, &heads);
    if flush {
        ring.index.fold(len);
    }
    step_traffic(dims, len, t, has_state, flush)
}

/// Commits a verify: the first `accepted` (0 ..= T) pending drafts become history, the rest are dropped
/// ([`RingIndex::commit`]). A pointer move, run on the device in the engine; it moves no tensor bytes.
pub fn commit_replay(ring: &mut GdnRing, accepted: usize) {
    ring.index.commit(accepted);
}

/// Folds the first `n` committed entries into the checkpoint (`S0 ← S_n`) and advances `start` past them. Pending
/// drafts keep their rows (they become logical entries `len − n ..`). A standalone flush; steps flush through their
/// `flush` flag instead.
pub fn flush(checkpoint: &mut [f32], ring: &mut GdnRing, n: usize) -> Traffic {
    let dims = ring.dims;
    assert_eq!(checkpoint.len(), dims.state_len(), "flush: checkpoint");
    assert!(n <= ring.len(), "flush: {n} entries of {} committed", ring.len());
    if n == 0 {
        return Traffic::default();
    }
    fold_checkpoint(checkpoint, ring, n, true);
    ring.index.fold(n);
    Traffic {
        state_read: Traffic::f32s(dims.state_len()),
        state_written: Traffic::f32s(dims.state_len()),
        ring_read: n as u64 * entry_bytes(dims),
        ..Traffic::default()
    }
}

/// Ends the KV-only form (KVBuffer §3.4): builds the checkpoint from every committed entry and a zero state (the old
/// contents of `checkpoint` are ignored and not read), empties the ring, and the sequence continues in replay. Call
/// at a step boundary (no pending drafts), e.g. once `len ≥` [`default_compress_threshold`]. With the ring empty the
/// engine may re-view the storage with another capacity (from a fresh [`RingIndex::new`]).
pub fn compress(checkpoint: &mut [f32], ring: &mut GdnRing) -> Traffic {
    let dims = ring.dims;
    assert_eq!(checkpoint.len(), dims.state_len(), "compress: checkpoint");
    assert_eq!(ring.index.pending, 0, "compress: commit the last verify first");
    let len = ring.len();
    fold_checkpoint(checkpoint, ring, len, false);
    ring.index.fold(len);
    Traffic {
        state_written: Traffic::f32s(dims.state_len()),
        ring_read: len as u64 * entry_bytes(dims),
        ..Traffic::default()
    }
}

/// The baseline verify (Alg. 7, what vLLM does): from `state`, the state after the last accepted token, scan the `T`
/// drafts one delta-rule step at a time, writing `y_s` to `out` (`[T, v_heads, v_dim]`) and the state after each draft
/// to `snapshots` (`[T, v_heads, v_dim, k_dim]`, snapshot `s` after draft `s`, 0-based). Its traffic is one state read
/// plus `T` full state writes.
pub fn verify_baseline(
    dims: GdnDims,
    state: &[f32],
    drafts: GdnTokens,
    snapshots: &mut [f32],
    out: &mut [f32],
) -> Traffic {
    let t = drafts.count(dims, "verify_baseline");
    let (sl, qk, vw, hw) = (
        dims.state_len(),
        dims.k_heads * dims.k_dim,
        dims.v_heads * dims.v_dim,
        dims.v_heads,
    );
    assert_eq!(state.len(), sl, "verify_baseline: state");
    assert_eq!(snapshots.len(), t * sl, "verify_baseline: snapshots");
    assert_eq!(out.len(), t * vw, "verify_baseline: out");
    for s in 0..t {
        let (done, rest) = snapshots.split_at_mut(s * sl);
        let snap = &mut rest[..sl];
        snap.copy_from_slice(if s == 0 { state } else { &done[(s - 1) * sl..] });
        super::gdn::gdn_step(
            dims,
            snap,
            &drafts.q[s * qk..(s + 1) * qk],
            &drafts.k[s * qk..(s + 1) * qk],
            &drafts.v[s * vw..(s + 1) * vw],
            &drafts.g[s * hw..(s + 1) * hw],
            &drafts.beta[s * hw..(s + 1) * hw],
            &mut out[s * vw..(s + 1) * vw],
        );
    }
    Traffic {
        state_read: Traffic::f32s(sl),
        state_written: t as u64 * Traffic::f32s(sl),
        inputs: t as u64 * token_bytes(dims),
        outputs: t as u64 * out_bytes(dims),
        ..Traffic::default()
    }
}

/// The baseline commit: `state ← snapshot accepted − 1`; `accepted = 0` keeps the old state. This copies (one state
/// read and written); an engine that instead swaps which pool slot is current pays nothing here.
pub fn commit_baseline(dims: GdnDims, state: &mut [f32], snapshots: &[f32], accepted: usize) -> Traffic {
    let sl = dims.state_len();
    assert_eq!(state.len(), sl, "commit_baseline: state");
    assert!(
        accepted * sl <= snapshots.len(),
        "commit_baseline: {accepted} accepted, too few snapshots"
    );
    if accepted == 0 {
        return Traffic::default();
    }
    state.copy_from_slice(&snapshots[(accepted - 1) * sl..accepted * sl]);
    Traffic {
        state_read: Traffic::f32s(sl),
        state_written: Traffic::f32s(sl),
        ..Traffic::default()
    }
}

/// The byte model of one recurrent decode step (Alg. 5): read and write the state, read the token, write the output.
pub fn recurrent_step_traffic(dims: GdnDims) -> Traffic {
    Traffic {
        state_read: Traffic::f32s(dims.state_len()),
        state_written: Traffic::f32s(dims.state_len()),
        inputs: token_bytes(dims),
        outputs: out_bytes(dims),
        ..Traffic::default()
    }
}

/// Bytes of one ring entry: bf16 `u` per value head and `k` per key head, fp32 `g` per value head.
fn entry_bytes(dims: GdnDims) -> u64 {
    Traffic::bf16s(dims.v_heads * dims.v_dim + dims.k_heads * dims.k_dim) + Traffic::f32s(dims.v_heads)
}

/// Bytes of one token's step inputs: bf16 q, k, v; fp32 g, β.
fn token_bytes(dims: GdnDims) -> u64 {
    Traffic::bf16s(2 * dims.k_heads * dims.k_dim + dims.v_heads * dims.v_dim) + Traffic::f32s(2 * dims.v_heads)
}

/// Bytes of one token's output (bf16).
fn out_bytes(dims: GdnDims) -> u64 {
    Traffic::bf16s(dims.v_heads * dims.v_dim)
}

/// A replay step over `t` tokens with `h` cached entries: the checkpoint read once (unless KV-only), the ring read
/// once, `t` entries appended, and one checkpoint write when it flushes.
fn step_traffic(dims: GdnDims, h: usize, t: usize, reads_state: bool, writes_state: bool) -> Traffic {
    let state = Traffic::f32s(dims.state_len());
    Traffic {
        state_read: if reads_state { state } else { 0 },
        state_written: if writes_state { state } else { 0 },
        ring_read: h as u64 * entry_bytes(dims),
        ring_written: t as u64 * entry_bytes(dims),
        inputs: t as u64 * token_bytes(dims),
        outputs: t as u64 * out_bytes(dims),
    }
}

/// Replaces the checkpoint by the state after its first `n` ring entries, read from it (`from_checkpoint`) or from zero.
fn fold_checkpoint(checkpoint: &mut [f32], ring: &GdnRing, n: usize, from_checkpoint: bool) {
    let dims = ring.dims;
    let per = dims.v_dim * dims.k_dim;
    let mut scratch = vec![0.0f32; per];
    for (h, c) in checkpoint.chunks_exact_mut(per).enumerate() {
        ring.history(h, n)
            .fold(dims, from_checkpoint.then_some(&*c), &mut scratch);
        c.copy_from_slice(&scratch);
    }
}

/// What a step writes to the checkpoint.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fold {
    /// Nothing.
    Keep,
    /// `S_h`, the committed history (a verify's flush).
    History,
    /// The state after every token of the step (a decode's flush).
    All,
}

/// Appends the step's tokens with every head's corrected values as entries `at ..`.
fn append(ring: &mut GdnRing, at: usize, x: &GdnTokens, t: usize, heads: &[HeadOut]) {
    let u: Vec<&[f32]> = heads.iter().map(|h| h.u.as_slice()).collect();
    ring.append(at, t, x.k, x.g, &u);
}

/// One value head's results: outputs and corrected values, both `[t, v_dim]`.
struct HeadOut {
    y: Vec<f32>,
    u: Vec<f32>,
}

/// Runs every value head of a step over `t` tokens and scatters the outputs into `out` (`[t, v_heads, v_dim]`).
fn run_heads(
    checkpoint: Option<&mut [f32]>,
    ring: &GdnRing,
    x: &GdnTokens,
    t: usize,
    out: &mut [f32],
    fold: Fold,
) -> Vec<HeadOut> {
    let dims = ring.dims;
    let (per, dv) = (dims.v_dim * dims.k_dim, dims.v_dim);
    assert_eq!(out.len(), t * dims.v_heads * dv, "replay_gdn: out");
    let head = |(h, c): (usize, Option<&mut [f32]>)| head_step(ring, h, x, t, c, fold);
    // Threading heads pays only once each head rebuilds a sizeable state.
    let parallel = dims.state_len() * (ring.len() + 2 * t) >= 1 << 20;
    let heads: Vec<HeadOut> = match (checkpoint, parallel) {
        (Some(c), true) => {
            assert_eq!(c.len(), dims.state_len(), "replay_gdn: checkpoint");
            c.par_chunks_exact_mut(per).map(Some).enumerate().map(head).collect()
        }
        (Some(c), false) => {
            assert_eq!(c.len(), dims.state_len(), "replay_gdn: checkpoint");
            c.chunks_exact_mut(per).map(Some).enumerate().map(head).collect()
        }
        (None, true) => (0..dims.v_heads).into_par_iter().map(|h| head((h, None))).collect(),
        (None, false) => (0..dims.v_heads).map(|h| head((h, None))).collect(),
    };
    for (h, ho) in heads.iter().enumerate() {
        for (s, row) in ho.y.chunks_exact(dv).enumerate() {
            let at = (s * dims.v_heads + h) * dv;
            out[at..at + dv].copy_from_slice(row);
        }
    }
    heads
}

/// Value head `h` of a step over `t` tokens: history readouts, the `t × t` solve for the corrected values, outputs,
/// and the checkpoint write `fold` asks for.
fn head_step(ring: &GdnRing, h: usize, x: &GdnTokens, t: usize, checkpoint: Option<&mut [f32]>, fold: Fold) -> HeadOut {
    let GdnDims {
        k_heads,
        v_heads,
        k_dim: dk,
        v_dim: dv,
    } = ring.dims;
    let kh = h / (v_heads / k_heads);
    let past = ring.history(h, ring.len());

    // Rows 0..t: the draft queries; rows t..2t: the draft keys. Both read the history in one product.
    let mut xs = vec![0.0f32; 2 * t * dk];
    for s in 0..t {
        let at = (s * k_heads + kh) * dk;
        xs[s * dk..(s + 1) * dk].copy_from_slice(&x.q[at..at + dk]);
        xs[(t + s) * dk..(t + s + 1) * dk].copy_from_slice(&x.k[at..at + dk]);
    }
    let mut read = vec![0.0f32; 2 * t * dv];
    let rebuilt = match checkpoint {
        Some(c) => {
            let mut s_h = vec![0.0f32; dv * dk];
            past.fold(ring.dims, Some(c), &mut s_h);
            matmul_nt(&xs, &s_h, &mut read, 2 * t, dk, dv);
            Some((c, s_h))
        }
        None => {
            // KV-only: S_h x = Σ_j w_j u_j (k_j·x), the state never materialised.
            let mut scores = vec![0.0f32; 2 * t * past.n];
            matmul_nt(&xs, &past.k, &mut scores, 2 * t, dk, past.n);
            matmul_nn(&scores, &past.wu, &mut read, 2 * t, past.n, dv);
            None
        }
    };

    let g: Vec<f32> = (0..t).map(|s| x.g[s * v_heads + h]).collect();
    let beta: Vec<f32> = (0..t).map(|s| x.beta[s * v_heads + h]).collect();
    // Cumulative gates from the step start: G_s = g_0 + … + g_s.
    let from_start: Vec<f32> = g
        .iter()
        .scan(0.0f32, |acc, gi| {
            *acc += gi;
            Some(*acc)
        })
        .collect();

    // Rows 0..t: q_s·k_s' (then the masked, decayed output weights); rows t..2t: k_s·k_s' (then A).
    let mut dots = vec![0.0f32; 2 * t * t];
    matmul_nt(&xs, &xs[t * dk..], &mut dots, 2 * t, dk, t);
    let (qk, kk) = dots.split_at_mut(t * t);
    // e^{G_s − G_s'} as the exp of the span sum g_{s'+1} + … + g_s, grown down from the diagonal.
    let mut to_end = vec![0.0f32; t];
    for s in 0..t {
        let mut span = 0.0f32;
        for s2 in (0..=s).rev() {
            let decay = span.exp();
            qk[s * t + s2] *= decay;
            kk[s * t + s2] *= beta[s] * decay;
            if s == t - 1 {
                to_end[s2] = decay;
            }
            span += g[s2];
        }
        qk[s * t + s + 1..(s + 1) * t].fill(0.0);
        kk[s * t + s..(s + 1) * t].fill(0.0);
    }

    // U_s = R_s − Σ_{s'<s} A[s, s'] U_s': forward substitution through the unit lower triangular I + A.
    let mut u = vec![0.0f32; t * dv];
    for s in 0..t {
        let (done, rest) = u.split_at_mut(s * dv);
        let row = &mut rest[..dv];
        let (e, b) = (from_start[s].exp(), beta[s]);
        let hk = &read[(t + s) * dv..(t + s + 1) * dv];
        let v = &x.v[(s * v_heads + h) * dv..(s * v_heads + h + 1) * dv];
        for ((r, vi), hi) in row.iter_mut().zip(v).zip(hk) {
            *r = b * (vi - e * hi);
        }
        for (s2, prev) in done.chunks_exact(dv).enumerate() {
            let a = kk[s * t + s2];
            for (r, p) in row.iter_mut().zip(prev) {
                *r -= a * p;
            }
        }
    }

    let mut y = vec![0.0f32; t * dv];
    matmul_nn(qk, &u, &mut y, t, t, dv);
    for (s, row) in y.chunks_exact_mut(dv).enumerate() {
        let e = from_start[s].exp();
        for (o, hq) in row.iter_mut().zip(&read[s * dv..(s + 1) * dv]) {
            *o += e * hq;
        }
    }

    match (fold, rebuilt) {
        (Fold::Keep, _) => {}
        (Fold::History, Some((c, s_h))) => c.copy_from_slice(&s_h),
        (Fold::All, Some((c, s_h))) => {
            // S after the step: e^{G_{t−1}} S_h + Σ_s e^{G_{t−1} − G_s} U_s k_sᵀ.
            let mut wu = u.clone();
            for (row, w) in wu.chunks_exact_mut(dv).zip(&to_end) {
                row.iter_mut().for_each(|x| *x *= w);
            }
            matmul_tn(&wu, &xs[t * dk..], c, dv, t, dk);
            let e = from_start[t - 1].exp();
            for (ci, si) in c.iter_mut().zip(&s_h) {
                *ci += e * si;
            }
        }
        (_, None) => unreachable!("a checkpoint write without a checkpoint was refused above"),
    }
    HeadOut { y, u }
}

#[cfg(test)]
mod tests;
