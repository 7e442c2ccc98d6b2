//! Input-replay decoding for Mamba-2: a checkpoint state plus a ring of the inputs since it (ReplaySSM Alg. 2 and 4),
//! the serial speculative baseline it is measured against (Alg. 3), and the state-free KV-only form (KVBuffer §3.4).
//!
//! Notation (paper → here): `v = x` (per head, `[head_dim]`), `k = B` and `q = C` (per group, `[state_dim]`), `Δ = dt`
//! (per head), `a = exp(dt·A)`. Per head, with the checkpoint `S0` (`[head_dim, state_dim]`) and logical ring entries
//! `0..=p` (`p` the query's own position), `α_i = dt_i·A ≤ 0` and `seg(i, p) = Σ_{i<r≤p} α_r`:
//! `y_p = exp(seg(−1, p))·(S0·C_p) + Σ_{i≤p} dt_i·exp(seg(i, p))·(B_i·C_p)·x_i + D·x_p`,
//! which is exactly what [`mamba2_step`] produces after replaying those entries from `S0`. Every `seg` is accumulated
//! backward from the query, so only non-positive numbers are exponentiated and no prefix sums are subtracted (which
//! would lose the low bits of short segments behind long ones).
//!
//! Memory traffic ([`Traffic`], the GPU layout of `traffic.rs`): the state is fp32; a ring entry is `x` (bf16,
//! `heads·head_dim`), `dt` (fp32, `heads`) and `B` (bf16, `groups·state_dim`); fresh token inputs are `x`, `B`, `C`
//! bf16 and `dt` fp32; outputs `y` are bf16; `A` and `D` (fp32, `heads` each) count as inputs. The readout kernel is
//! modelled as one program per B/C group that computes the group's `B_j·C` products once on chip (the §5.4 precompute,
//! without an HBM scratch round trip) and shares them with the group's heads, so each ring `B` is read once per group,
//! and each step's own entries are taken from the inputs, never re-read from the ring they are appended to.

use super::gemm::{matmul_nn, matmul_nt, matmul_tn};
use super::mamba2::{mamba2_step, Mamba2Dims};
use super::traffic::Traffic;

mod ring;

pub use super::ring::RingIndex;
pub use ring::{Mamba2Entry, Mamba2Ring, Mamba2RingBuf};

fn heads_per_group(d: Mamba2Dims) -> usize {
    assert!(
        d.groups > 0 && d.heads.is_multiple_of(d.groups),
        "replay_mamba2: heads ({}) must be a multiple of groups ({})",
        d.heads,
        d.groups
    );
    assert!(d.head_dim > 0 && d.state_dim > 0, "replay_mamba2: empty head or state");
    d.heads / d.groups
}

fn state_len(d: Mamba2Dims) -> usize {
    d.heads * d.head_dim * d.state_dim
}

/// Bytes of one fp32 state `[heads, head_dim, state_dim]`.
fn state_bytes(d: Mamba2Dims) -> u64 {
    Traffic::f32s(state_len(d))
}

/// Bytes of one ring entry: `x` and `B` bf16, `dt` fp32.
fn entry_bytes(d: Mamba2Dims) -> u64 {
    Traffic::bf16s(d.heads * d.head_dim) + Traffic::f32s(d.heads) + Traffic::bf16s(d.groups * d.state_dim)
}

/// Bytes of `t` tokens' fresh inputs (`x`, `B`, `C` bf16, `dt` fp32) plus the `A` and `D` parameters (fp32).
fn token_input_bytes(d: Mamba2Dims, t: usize) -> u64 {
    t as u64
        * (Traffic::bf16s(d.heads * d.head_dim) + Traffic::f32s(d.heads) + Traffic::bf16s(2 * d.groups * d.state_dim))
        + Traffic::f32s(2 * d.heads)
}

/// `t` tokens' inputs: `x` `[t, heads, head_dim]`, `dt` `[t, heads]` (softplus'd and clamped), `b` and `c`
/// `[t, groups, state_dim]`.
#[derive(Clone, Copy, Debug)]
pub struct Mamba2Tokens<'a> {
    /// Values `[t, heads, head_dim]`.
    pub x: &'a [f32],
    /// Step sizes `[t, heads]`.
    pub dt: &'a [f32],
    /// Keys `[t, groups, state_dim]`.
    pub b: &'a [f32],
    /// Queries `[t, groups, state_dim]`.
    pub c: &'a [f32],
}

impl Mamba2Tokens<'_> {
    /// The token count, after checking every operand's shape against it.
    fn count(&self, d: Mamba2Dims) -> usize {
        let t = self.dt.len() / d.heads;
        assert_eq!(self.dt.len(), t * d.heads, "replay_mamba2: dt");
        assert_eq!(self.x.len(), t * d.heads * d.head_dim, "replay_mamba2: x");
        assert_eq!(self.b.len(), t * d.groups * d.state_dim, "replay_mamba2: B");
        assert_eq!(self.c.len(), t * d.groups * d.state_dim, "replay_mamba2: C");
        t
    }
}

/// Whether the committed entries must be folded into the checkpoint before a step that appends a window of `t` entries
/// to a ring holding `h` committed ones: `h + 2t > capacity`. Flushing one window early (ReplaySSM §5.3) leaves room
/// for a full window on the step after an all-accepted one; plain decode is `t = 1`.
pub fn needs_flush(h: usize, t: usize, capacity: usize) -> bool {
    h + 2 * t > capacity
}

/// Whether a KV-only sequence must [`compress`] before a step that appends `t` entries: its context would pass
/// `threshold` (KVBuffer: about the head dim), or the ring could not hold the next window ([`needs_flush`]).
pub fn needs_compress(h: usize, t: usize, threshold: usize, capacity: usize) -> bool {
    h + t > threshold || needs_flush(h, t, capacity)
}

/// Output-only replay decode of one committed token (Alg. 2, lines 1–3): appends `tok` at logical `h = len`, writes
/// `out` (`[heads, head_dim]`, with `D·x`) from the checkpoint and entries `0..=h` without materialising a state,
/// then `len = h + 1`. Requires `h < capacity` (see [`needs_flush`]) and no pending drafts.
///
/// `checkpoint` is `[heads, head_dim, state_dim]`, or `None` in the KV-only form (a zero state that is neither read nor
/// counted). `a` and `d_skip` are `[heads]`. `flush` (the per-sequence flag, [`needs_flush`]`(h, T, L)`; Alg. 2 line 5)
/// then folds every committed entry, the step's own included, into the checkpoint and empties the ring; it needs a
/// checkpoint (a KV-only ring [`compress`]es instead).
///
/// Traffic, exactly: `state_read = 4·heads·d·n` (0 without a checkpoint); `ring_read = h·(heads·(2d + 4) +
/// groups·2n)`, i.e. `2·h·(d + n/heads_per_group + 2)` bytes per head (the model's `+1` is our fp32 `dt`);
/// `ring_written` one entry (`heads·(2d + 4) + groups·2n`); `inputs = heads·(2d + 4) + groups·4n + 8·heads`;
/// `outputs = 2·heads·d`; with `flush`, `state_written = 4·heads·d·n` (the fold reads what the step already read).
pub fn replay_decode(
    checkpoint: Option<&mut [f32]>,
    ring: &mut Mamba2Ring<'_>,
    tok: Mamba2Tokens<'_>,
    a: &[f32],
    d_skip: &[f32],
    out: &mut [f32],
    flush: bool,
) -> Traffic {
    assert_eq!(tok.count(ring.dims), 1, "replay_mamba2: replay_decode takes one token");
    refuse_kv_only_flush(checkpoint.is_some(), flush);
    let mut traffic = step(checkpoint.as_deref(), ring, tok, a, d_skip, out);
    ring.index.commit(1);
    if let (true, Some(c)) = (flush, checkpoint) {
        let all = ring.len();
        traffic.state_written += fold_committed(c, ring, all, a).state_written;
    }
    traffic
}

/// Speculative verify of `t` drafts, output-only (Alg. 4, lines 1–5): writes the drafts at logical `h..h + t`
/// (`h = len`) as pending, to be kept or dropped by [`commit_replay`], and `out` `[t, heads, head_dim]` (with `D·x`),
/// every draft reading the same checkpoint and ring under a causal mask (draft `s` sees entries `0..=h + s`).
/// Requires `h + t ≤ capacity` and no pending drafts. `checkpoint`, `a`, `d_skip` as in [`replay_decode`].
///
/// `flush` (Alg. 4 line 7) first folds the committed history, never a draft, into the checkpoint and moves `start`
/// past it; the drafts then land at logical `0..t`. The outputs are the same either way.
///
/// Per group, `M = C·Bᵀ` (`[t, h + t]`) and the checkpoint readout `C·S0ᵀ` (`[t, heads_per_group·d]`) are products; per
/// head, the decay-weighted, masked `M` times the ring values (`[h + t, d]`) is another.
///
/// Traffic: one state read (none without a checkpoint), `h` ring entries read, `t` entries written, `t` tokens' inputs
/// (plus `A`, `D`), `t` outputs; with `flush`, one state written (its entries are the ones the verify reads anyway).
pub fn verify_replay(
    mut checkpoint: Option<&mut [f32]>,
    ring: &mut Mamba2Ring<'_>,
    drafts: Mamba2Tokens<'_>,
    a: &[f32],
    d_skip: &[f32],
    out: &mut [f32],
    flush: bool,
) -> Traffic {
    refuse_kv_only_flush(checkpoint.is_some(), flush);
    let mut traffic = Traffic::default();
    if let (true, Some(c)) = (flush, checkpoint.as_deref_mut()) {
        let h = ring.len();
        let f = fold_committed(c, ring, h, a);
        traffic.state_written += f.state_written;
        traffic.ring_read += f.ring_read;
    }
    traffic + step(checkpoint.as_deref(), ring, drafts, a, d_skip, out)
}

/// Keeps the first `accepted` drafts of the last [`verify_replay`] as history and drops the rest
/// ([`RingIndex::commit`]): a pointer move, valid after a [`flush`] between verify and commit too.
pub fn commit_replay(ring: &mut Mamba2Ring<'_>, accepted: usize) {
    ring.index.commit(accepted);
}

fn refuse_kv_only_flush(has_checkpoint: bool, flush: bool) {
    assert!(
        !flush || has_checkpoint,
        "replay_mamba2: a KV-only ring compresses, it does not flush"
    );
}

/// Writes `tok` as pending entries after the committed ones and reads their outputs; no state is written.
fn step(
    checkpoint: Option<&[f32]>,
    ring: &mut Mamba2Ring<'_>,
    tok: Mamba2Tokens<'_>,
    a: &[f32],
    d_skip: &[f32],
    out: &mut [f32],
) -> Traffic {
    let d = ring.dims;
    let t = tok.count(d);
    assert!(a.len() == d.heads && d_skip.len() == d.heads, "replay_mamba2: A / D");
    assert_eq!(out.len(), t * d.heads * d.head_dim, "replay_mamba2: out");
    if let Some(s) = checkpoint {
        assert_eq!(s.len(), state_len(d), "replay_mamba2: checkpoint");
    }
    let h = ring.len();
    ring.index.stage(t);
    ring.write(h, t, tok.x, tok.dt, tok.b);
    readout(ring, checkpoint, h, tok, a, d_skip, out);
    Traffic {
        state_read: if checkpoint.is_some() { state_bytes(d) } else { 0 },
        ring_read: h as u64 * entry_bytes(d),
        ring_written: t as u64 * entry_bytes(d),
        inputs: token_input_bytes(d, t),
        outputs: Traffic::bf16s(t * d.heads * d.head_dim),
        ..Traffic::default()
    }
}

/// The outputs of the `t` queries at logical `h..h + t`, whose entries are already in the ring.
fn readout(
    ring: &Mamba2Ring<'_>,
    s0: Option<&[f32]>,
    h: usize,
    tok: Mamba2Tokens<'_>,
    a: &[f32],
    d_skip: &[f32],
    y: &mut [f32],
) {
    let d = ring.dims;
    let (heads, p, n, hpg) = (d.heads, d.head_dim, d.state_dim, heads_per_group(d));
    let t = tok.dt.len() / heads;
    let (m, width) = (h + t, hpg * p);
    let phys: Vec<usize> = (0..m).map(|j| ring.physical(j)).collect();
    let mut keys = vec![0.0f32; m * n];
    let mut queries = vec![0.0f32; t * n];
    let mut kq = vec![0.0f32; t * m];
    let mut from_ckpt = vec![0.0f32; t * width];
    let mut w = vec![0.0f32; t * m];
    let mut decay = vec![0.0f32; t];
    let mut values = vec![0.0f32; m * p];
    let mut y_ring = vec![0.0f32; t * p];
    for g in 0..d.groups {
        for (j, &r) in phys.iter().enumerate() {
            keys[j * n..(j + 1) * n].copy_from_slice(&ring.b[(r * d.groups + g) * n..(r * d.groups + g + 1) * n]);
        }
        for s in 0..t {
            queries[s * n..(s + 1) * n].copy_from_slice(&tok.c[(s * d.groups + g) * n..(s * d.groups + g + 1) * n]);
        }
        // The §5.4 precompute: B_j·C_s once per group, shared by its heads.
        matmul_nt(&queries, &keys, &mut kq, t, n, m);
        if let Some(s0) = s0 {
            matmul_nt(
                &queries,
                &s0[g * width * n..(g + 1) * width * n],
                &mut from_ckpt,
                t,
                n,
                width,
            );
        }
        for j in 0..hpg {
            let head = g * hpg + j;
            for s in 0..t {
                let pos = h + s;
                let row = &mut w[s * m..(s + 1) * m];
                row[pos + 1..].fill(0.0);
                let mut seg = 0.0f32;
                for i in (0..=pos).rev() {
                    let dt = ring.dt[phys[i] * heads + head];
                    row[i] = kq[s * m + i] * dt * seg.exp();
                    seg += dt * a[head];
                }
                decay[s] = seg.exp();
            }
            for (i, &r) in phys.iter().enumerate() {
                values[i * p..(i + 1) * p].copy_from_slice(&ring.x[(r * heads + head) * p..(r * heads + head + 1) * p]);
            }
            matmul_nn(&w, &values, &mut y_ring, t, m, p);
            for s in 0..t {
                let o = (s * heads + head) * p;
                for i in 0..p {
                    let ckpt = if s0.is_some() {
                        decay[s] * from_ckpt[s * width + j * p + i]
                    } else {
                        0.0
                    };
                    y[o + i] = y_ring[s * p + i] + ckpt + d_skip[head] * tok.x[o + i];
                }
            }
        }
    }
}

/// The state-and-output route's state half: folds the first `count` committed entries into the checkpoint,
/// `S0 ← exp(seg(−1, count−1))·S0 + Σ_{i<count} dt_i·exp(seg(i, count−1))·x_i B_iᵀ` per head (zero initial state when
/// `from_zero`: `s0` is then only written), as one `[hpg·d, count]·[count, n]` product per group.
fn fold(ring: &Mamba2Ring<'_>, s0: &mut [f32], count: usize, a: &[f32], from_zero: bool) {
    let d = ring.dims;
    let (heads, p, n, hpg) = (d.heads, d.head_dim, d.state_dim, heads_per_group(d));
    assert_eq!(s0.len(), state_len(d), "replay_mamba2: checkpoint");
    assert_eq!(a.len(), heads, "replay_mamba2: A");
    let width = hpg * p;
    let phys: Vec<usize> = (0..count).map(|j| ring.physical(j)).collect();
    let mut keys = vec![0.0f32; count * n];
    let mut weighted = vec![0.0f32; count * width];
    let mut update = vec![0.0f32; width * n];
    let mut total = vec![0.0f32; hpg];
    for g in 0..d.groups {
        for (j, &r) in phys.iter().enumerate() {
            keys[j * n..(j + 1) * n].copy_from_slice(&ring.b[(r * d.groups + g) * n..(r * d.groups + g + 1) * n]);
        }
        for (j, tot) in total.iter_mut().enumerate() {
            let head = g * hpg + j;
            let mut seg = 0.0f32;
            for i in (0..count).rev() {
                let r = phys[i];
                let dt = ring.dt[r * heads + head];
                let wgt = dt * seg.exp();
                let src = &ring.x[(r * heads + head) * p..(r * heads + head + 1) * p];
                for (o, v) in weighted[i * width + j * p..i * width + (j + 1) * p].iter_mut().zip(src) {
                    *o = wgt * v;
                }
                seg += dt * a[head];
            }
            *tot = seg.exp();
        }
        matmul_tn(&weighted, &keys, &mut update, width, count, n);
        let s_group = &mut s0[g * width * n..(g + 1) * width * n];
        for (j, tot) in total.iter().enumerate() {
            let rows = j * p * n..(j + 1) * p * n;
            for (s, u) in s_group[rows.clone()].iter_mut().zip(&update[rows]) {
                *s = if from_zero { *u } else { tot * *s + u };
            }
        }
    }
}

/// Flush: folds the first `count` logical entries (committed ones only: `count ≤ len`, never pending drafts) into the
/// checkpoint (`[heads, head_dim, state_dim]`), then `start += count`, `len −= count` ([`RingIndex::fold`]). Drafts
/// written past `len` keep their rows and stay valid for a later [`commit_replay`]. `count = 0` does nothing. A
/// standalone flush; steps flush through their `flush` flag instead.
///
/// Traffic: state read and written, `count` entries read, `A`.
pub fn flush(checkpoint: &mut [f32], ring: &mut Mamba2Ring<'_>, count: usize, a: &[f32]) -> Traffic {
    fold_committed(checkpoint, ring, count, a)
}

fn fold_committed(checkpoint: &mut [f32], ring: &mut Mamba2Ring<'_>, count: usize, a: &[f32]) -> Traffic {
    assert!(
        count <= ring.len(),
        "replay_mamba2: flush of {count} > {} committed entries",
        ring.len()
    );
    if count == 0 {
        return Traffic::default();
    }
    fold(ring, checkpoint, count, a, false);
    ring.index.fold(count);
    let d = ring.dims;
    Traffic {
        state_read: state_bytes(d),
        state_written: state_bytes(d),
        ring_read: count as u64 * entry_bytes(d),
        inputs: Traffic::f32s(d.heads),
        ..Traffic::default()
    }
}

/// Leaves the KV-only form: initialises the checkpoint (whatever it held is neither read nor kept) from all committed
/// entries, as if they had been replayed from a zero state, and empties the ring (`start += len`, `len = 0`); the
/// sequence continues in the replay form. Call at a step boundary (no pending drafts). With the ring empty the engine
/// may re-view the storage with another capacity (from a fresh [`RingIndex::new`]).
///
/// Traffic: the state written, `len` entries read, `A`.
pub fn compress(checkpoint: &mut [f32], ring: &mut Mamba2Ring<'_>, a: &[f32]) -> Traffic {
    assert_eq!(
        ring.index.pending, 0,
        "replay_mamba2: compress: commit the last verify first"
    );
    let count = ring.len();
    fold(ring, checkpoint, count, a, true);
    ring.index.fold(count);
    let d = ring.dims;
    Traffic {
        state_written: state_bytes(d),
        ring_read: count as u64 * entry_bytes(d),
        inputs: Traffic::f32s(d.heads),
        ..Traffic::default()
    }
}

/// Speculative baseline (Alg. 3): the serial scan of `t` drafts from `state` (the last accepted state,
/// `[heads, head_dim, state_dim]`, only read), storing the state after draft `s` as snapshot `s` of `snapshots`
/// (`[≥ t, heads, head_dim, state_dim]`; rows past `t` untouched) and its output in `out` `[t, heads, head_dim]`.
///
/// Traffic: one state read, `t` full states written, `t` tokens' inputs (plus `A`, `D`), `t` outputs.
pub fn verify_baseline(
    dims: Mamba2Dims,
    state: &[f32],
    drafts: Mamba2Tokens<'_>,
    a: &[f32],
    d_skip: &[f32],
    snapshots: &mut [f32],
    out: &mut [f32],
) -> Traffic {
    heads_per_group(dims);
    let t = drafts.count(dims);
    let (sl, hp, gn, h) = (
        state_len(dims),
        dims.heads * dims.head_dim,
        dims.groups * dims.state_dim,
        dims.heads,
    );
    assert_eq!(state.len(), sl, "replay_mamba2: baseline state");
    assert!(snapshots.len() >= t * sl, "replay_mamba2: {t} snapshots");
    assert_eq!(out.len(), t * hp, "replay_mamba2: out");
    for s in 0..t {
        let (done, rest) = snapshots.split_at_mut(s * sl);
        let snap = &mut rest[..sl];
        snap.copy_from_slice(if s == 0 { state } else { &done[(s - 1) * sl..] });
        mamba2_step(
            dims,
            snap,
            &drafts.x[s * hp..(s + 1) * hp],
            &drafts.dt[s * h..(s + 1) * h],
            a,
            &drafts.b[s * gn..(s + 1) * gn],
            &drafts.c[s * gn..(s + 1) * gn],
            d_skip,
            &mut out[s * hp..(s + 1) * hp],
        );
    }
    Traffic {
        state_read: state_bytes(dims),
        state_written: t as u64 * state_bytes(dims),
        inputs: token_input_bytes(dims, t),
        outputs: Traffic::bf16s(t * hp),
        ..Traffic::default()
    }
}

/// The baseline's commit: with `accepted` drafts accepted, the state becomes snapshot `accepted − 1` (the state after
/// the last accepted draft); `accepted = 0` keeps it. Traffic: this copy (one state read and written) when
/// `accepted > 0`; an engine that re-points the slot at the snapshot instead moves nothing.
pub fn commit_baseline(dims: Mamba2Dims, state: &mut [f32], snapshots: &[f32], accepted: usize) -> Traffic {
    let sl = state_len(dims);
    assert_eq!(state.len(), sl, "replay_mamba2: baseline state");
    if accepted == 0 {
        return Traffic::default();
    }
    assert!(
        snapshots.len() >= accepted * sl,
        "replay_mamba2: snapshot {accepted} missing"
    );
    state.copy_from_slice(&snapshots[(accepted - 1) * sl..accepted * sl]);
    Traffic {
        state_read: state_bytes(dims),
        state_written: state_bytes(dims),
        ..Traffic::default()
    }
}

/// Traffic of one recurrent decode step ([`mamba2_step`], Alg. 1), for comparison: the state read and written
/// (`8·heads·d·n`), one token's inputs (plus `A`, `D`), one output.
pub fn recurrent_step_traffic(dims: Mamba2Dims) -> Traffic {
    Traffic {
        state_read: state_bytes(dims),
        state_written: state_bytes(dims),
        inputs: token_input_bytes(dims, 1),
        outputs: Traffic::bf16s(dims.heads * dims.head_dim),
        ..Traffic::default()
    }
}

#[cfg(test)]
mod tests;
