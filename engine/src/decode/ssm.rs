//! The SSM blocks of a step in every form, on one tensor-parallel rank: the mixer's projection, conv and gated output
//! around the scan the form and phase ask for, over one slot's checkpoint, input ring and conv ring. The rank's B/C
//! (Mamba-2) or q/k (GDN) are expanded from the groups it holds to its virtual groups before any kernel reads them,
//! so the rings cache them per virtual group (see `ShardedModel::layer_states`).
//!
//! The conv ring holds `K − 1 + T` pre-conv rows from the slot's conv head: the `K − 1` committed ones the mixer's
//! conv reads, then room for a step's new rows. Decode and verify write their rows after the window and leave the
//! head for the commit to move (by the accepted count); a prefill rewrites the window in place.

use rewind_kernels::cpu::act::silu;
use rewind_kernels::cpu::gdn::{gdn_chunked, gdn_step, GdnDims};
use rewind_kernels::cpu::mamba2::{mamba2_chunked, mamba2_step, Mamba2Dims};
use rewind_kernels::cpu::norm::{gated_rms_norm, GateOrder};
use rewind_kernels::cpu::replay_gdn::{self, GdnRing, GdnTokens};
use rewind_kernels::cpu::replay_mamba2::{self, Mamba2Ring, Mamba2Tokens};
use rewind_kernels::cpu::traffic::Traffic;

use super::step::Phase;
use crate::error::{EngineError, Result};
use crate::model::mixers::gdn::GdnMixer;
use crate::model::mixers::mamba2::Mamba2Mixer;
use crate::shard::model::expand;
use crate::shard::{Communicator, ShardKind};
use crate::state::{DecodeForm, GdnSlotMut, Mamba2SlotMut, RingIndex};

/// What one sequence's step asks of an SSM block.
#[derive(Clone, Copy, Debug)]
pub(super) struct Step {
    pub phase: Phase,
    pub form: DecodeForm,
    pub flush: bool,
}

/// The `K − 1` committed conv rows, oldest first, contiguous.
fn gather_window(conv: &[f32], idx: RingIndex, width: usize) -> Vec<f32> {
    let mut w = Vec::with_capacity(idx.len * width);
    for j in 0..idx.len {
        let r = idx.physical(j);
        w.extend_from_slice(&conv[r * width..(r + 1) * width]);
    }
    w
}

/// Writes `rows` (`[n, width]`) at logical conv positions `from..from + n`.
fn write_rows(conv: &mut [f32], idx: RingIndex, width: usize, from: usize, rows: &[f32]) {
    for (s, row) in rows.chunks_exact(width).enumerate() {
        let r = idx.physical(from + s);
        conv[r * width..(r + 1) * width].copy_from_slice(row);
    }
}

fn wrong_shard(kind: &str) -> EngineError {
    EngineError::InvalidInput(format!("the tensor-parallel plan does not describe a {kind} layer"))
}

/// The kernels' view of a Mamba-2 shard: its heads, with B/C per virtual group.
pub(super) fn mamba2_dims(m: &Mamba2Mixer, shard: &ShardKind) -> Result<Mamba2Dims> {
    let ShardKind::Mamba2 { split, .. } = shard else {
        return Err(wrong_shard("Mamba-2"));
    };
    Ok(Mamba2Dims {
        groups: split.virtual_groups.len(),
        ..m.dims()
    })
}

/// The kernels' view of a GDN shard: its value heads, with keys per virtual group.
pub(super) fn gdn_dims(m: &GdnMixer, shard: &ShardKind) -> Result<GdnDims> {
    let ShardKind::Gdn(split) = shard else {
        return Err(wrong_shard("Gated DeltaNet"));
    };
    Ok(GdnDims {
        k_heads: split.virtual_groups.len(),
        ..m.dims()
    })
}

/// The Mamba-2 block of one sequence on this rank: returns the rank's partial `[t, hidden]` (the caller
/// all-reduces it).
#[allow(clippy::too_many_arguments)]
pub(super) fn mamba2(
    m: &Mamba2Mixer,
    shard: &ShardKind,
    view: Mamba2SlotMut<'_>,
    x: &[f32],
    t: usize,
    step: Step,
    snapshots: &mut Vec<f32>,
    traffic: &mut Traffic,
    comm: &dyn Communicator,
) -> Result<Vec<f32>> {
    let ShardKind::Mamba2 { split, .. } = shard else {
        return Err(wrong_shard("Mamba-2"));
    };
    let dims = mamba2_dims(m, shard)?;
    let (a, d_skip, state_dim) = (m.a(), m.d_skip(), m.spec().state_dim);
    let chunk = m.spec().chunk_size;
    let Mamba2SlotMut {
        state,
        x: rx,
        dt: rdt,
        b: rb,
        ring,
        conv,
        conv_ring,
    } = view;
    let width = conv.len() / conv_ring.capacity;
    let mut window = gather_window(conv, conv_ring, width);
    // The kernels move this copy; the caller moves the slot's counters by the same rules after the step.
    let mut index = ring;
    let (phase, form, flush) = (step.phase, step.form, step.flush);
    // The reference clamps dt on its multi-token path only: prefills of more than one token.
    let prefill_numerics = phase == Phase::Prefill && t > 1;
    let (y, z) = m.scan_outputs(x, t, prefill_numerics, &mut window, |inp, y| {
        let (b, c) = (expand(&inp.b, state_dim, split), expand(&inp.c, state_dim, split));
        let tok = Mamba2Tokens {
            x: &inp.x,
            dt: &inp.dt,
            b: &b,
            c: &c,
        };
        let full_scan = |state: &mut [f32], y: &mut [f32]| {
            if t == 1 {
                mamba2_step(dims, state, &inp.x, &inp.dt, a, &b, &c, d_skip, y);
            } else {
                mamba2_chunked(dims, t, chunk, state, &inp.x, &inp.dt, a, &b, &c, d_skip, y);
            }
        };
        let mut ring = Mamba2Ring::new(dims, rx, rdt, rb, &mut index);
        *traffic += match (phase, form) {
            (Phase::Prefill, DecodeForm::KvOnly) => {
                // The prompt's outputs from the chunked scan; its history kept as ring entries only (the scan's
                // final state in the unused checkpoint is never read: a compress overwrites it).
                full_scan(state, y);
                ring.push(&inp.x, &inp.dt, &b)
            }
            (Phase::Prefill, _) => {
                full_scan(state, y);
                Traffic::default()
            }
            (Phase::Decode, DecodeForm::Recurrent) => {
                full_scan(state, y);
                replay_mamba2::recurrent_step_traffic(dims)
            }
            (Phase::Decode, DecodeForm::Replay) => {
                replay_mamba2::replay_decode(Some(&mut *state), &mut ring, tok, a, d_skip, y, flush)
            }
            (Phase::Decode, DecodeForm::KvOnly) => {
                replay_mamba2::replay_decode(None, &mut ring, tok, a, d_skip, y, false)
            }
            (Phase::Verify, DecodeForm::Recurrent) => {
                let need = t * state.len();
                if snapshots.len() < need {
                    snapshots.resize(need, 0.0);
                }
                replay_mamba2::verify_baseline(dims, state, tok, a, d_skip, snapshots, y)
            }
            (Phase::Verify, DecodeForm::Replay) => {
                replay_mamba2::verify_replay(Some(&mut *state), &mut ring, tok, a, d_skip, y, flush)
            }
            (Phase::Verify, DecodeForm::KvOnly) => {
                replay_mamba2::verify_replay(None, &mut ring, tok, a, d_skip, y, false)
            }
        };
        if phase != Phase::Prefill {
            write_rows(conv, conv_ring, width, conv_ring.len, &inp.conv_in);
        }
    });
    if phase == Phase::Prefill {
        write_rows(conv, conv_ring, width, 0, &window);
    }
    let normed = gated_norm(m, shard, &y, &z, t, comm)?;
    Ok(m.project_out(&normed, t))
}

/// The Mamba-2 gated norm `rms_norm(y · silu(z))` over the global norm groups: the reference op when the rank holds
/// whole groups; otherwise each rank sums the squares of its channels per group, and the sums are all-reduced when a
/// group spans ranks.
fn gated_norm(
    m: &Mamba2Mixer,
    shard: &ShardKind,
    y: &[f32],
    z: &[f32],
    t: usize,
    comm: &dyn Communicator,
) -> Result<Vec<f32>> {
    let ShardKind::Mamba2 {
        split,
        norm_group_size,
        norm_groups,
        all_reduce_norm,
    } = shard
    else {
        return Err(wrong_shard("Mamba-2"));
    };
    let s = m.spec();
    let di = s.heads * s.head_dim;
    let first = split.heads.start * s.head_dim;
    if !*all_reduce_norm && first.is_multiple_of(*norm_group_size) && di.is_multiple_of(*norm_group_size) {
        // The rank holds whole norm groups: the reference op over them.
        let mut normed = vec![0.0f32; y.len()];
        gated_rms_norm(
            y,
            z,
            m.norm_weight(),
            *norm_group_size,
            s.norm_eps,
            GateOrder::BeforeNorm,
            &mut normed,
        );
        return Ok(normed);
    }
    let gated: Vec<f32> = y.iter().zip(z).map(|(y, z)| y * silu(*z)).collect();
    let mut sums = vec![0.0f32; t * norm_groups];
    for (row, sum) in gated.chunks_exact(di).zip(sums.chunks_exact_mut(*norm_groups)) {
        for (c, v) in row.iter().enumerate() {
            sum[(first + c) / norm_group_size] += v * v;
        }
    }
    if *all_reduce_norm {
        comm.all_reduce_sum(&mut sums)?;
    }
    let w = m.norm_weight();
    let mut normed = Vec::with_capacity(gated.len());
    for (row, sum) in gated.chunks_exact(di).zip(sums.chunks_exact(*norm_groups)) {
        for (c, v) in row.iter().enumerate() {
            let ms = sum[(first + c) / norm_group_size] / *norm_group_size as f32;
            normed.push(v * (1.0 / (ms + s.norm_eps).sqrt()) * w[c]);
        }
    }
    Ok(normed)
}

/// The Gated DeltaNet block of one sequence on this rank: returns the rank's partial `[t, hidden]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn gdn(
    m: &GdnMixer,
    shard: &ShardKind,
    view: GdnSlotMut<'_>,
    x: &[f32],
    t: usize,
    step: Step,
    snapshots: &mut Vec<f32>,
    traffic: &mut Traffic,
) -> Result<Vec<f32>> {
    let ShardKind::Gdn(split) = shard else {
        return Err(wrong_shard("Gated DeltaNet"));
    };
    let k_dim = m.spec().k_head_dim;
    let dims = gdn_dims(m, shard)?;
    let chunk = m.spec().chunk_size;
    let GdnSlotMut {
        state,
        u,
        k: ring_k,
        g,
        ring,
        conv,
        conv_ring,
    } = view;
    let width = conv.len() / conv_ring.capacity;
    let mut window = gather_window(conv, conv_ring, width);
    // The kernels move this copy; the caller moves the slot's counters by the same rules after the step.
    let mut index = ring;
    let (phase, form, flush) = (step.phase, step.form, step.flush);
    let out = m.forward_with(x, t, &mut window, |inp, out| {
        let (q, k) = (expand(&inp.q, k_dim, split), expand(&inp.k, k_dim, split));
        let tok = GdnTokens {
            q: &q,
            k: &k,
            v: &inp.v,
            g: &inp.g,
            beta: &inp.beta,
        };
        let full_scan = |state: &mut [f32], out: &mut [f32]| {
            if t == 1 {
                gdn_step(dims, state, &q, &k, &inp.v, &inp.g, &inp.beta, out);
            } else {
                gdn_chunked(dims, t, chunk, state, &q, &k, &inp.v, &inp.g, &inp.beta, out);
            }
        };
        let mut ring = GdnRing::new(dims, u, ring_k, g, &mut index);
        *traffic += match (phase, form) {
            (Phase::Prefill, DecodeForm::KvOnly) => {
                // KV-only prefill: the prompt verified against an empty history and committed as ring entries
                // (the corrected values `u` need each token's state, which this pass computes).
                let tr = replay_gdn::verify_replay(None, &mut ring, tok, out, false);
                replay_gdn::commit_replay(&mut ring, t);
                tr
            }
            (Phase::Prefill, _) => {
                full_scan(state, out);
                Traffic::default()
            }
            (Phase::Decode, DecodeForm::Recurrent) => {
                full_scan(state, out);
                replay_gdn::recurrent_step_traffic(dims)
            }
            (Phase::Decode, DecodeForm::Replay) => {
                replay_gdn::replay_decode(Some(&mut *state), &mut ring, tok, out, flush)
            }
            (Phase::Decode, DecodeForm::KvOnly) => replay_gdn::replay_decode(None, &mut ring, tok, out, false),
            (Phase::Verify, DecodeForm::Recurrent) => {
                let need = t * dims.state_len();
                if snapshots.len() < need {
                    snapshots.resize(need, 0.0);
                }
                replay_gdn::verify_baseline(dims, state, tok, &mut snapshots[..need], out)
            }
            (Phase::Verify, DecodeForm::Replay) => {
                replay_gdn::verify_replay(Some(&mut *state), &mut ring, tok, out, flush)
            }
            (Phase::Verify, DecodeForm::KvOnly) => replay_gdn::verify_replay(None, &mut ring, tok, out, false),
        };
        if phase != Phase::Prefill {
            write_rows(conv, conv_ring, width, conv_ring.len, &inp.conv_in);
        }
    });
    if phase == Phase::Prefill {
        write_rows(conv, conv_ring, width, 0, &window);
    }
    Ok(out)
}
