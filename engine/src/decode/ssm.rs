//! The SSM blocks of a step in every form: the mixer's projection, conv and gated output around the scan the form
//! and phase ask for, over one slot's checkpoint, input ring and conv ring.
//!
//! The conv ring holds `K − 1 + T` pre-conv rows from the slot's conv head: the `K − 1` committed ones the mixer's
//! conv reads, then room for a step's new rows. Decode and verify write their rows after the window and leave the
//! head for the commit to move (by the accepted count); a prefill rewrites the window in place.

use rewind_kernels::cpu::gdn::{gdn_chunked, gdn_step};
use rewind_kernels::cpu::mamba2::{mamba2_chunked, mamba2_step};
use rewind_kernels::cpu::replay_gdn::{self, GdnRing, GdnTokens};
use rewind_kernels::cpu::replay_mamba2::{self, Mamba2Ring, Mamba2Tokens};
use rewind_kernels::cpu::traffic::Traffic;

use super::step::Phase;
use crate::model::mixers::gdn::GdnMixer;
use crate::model::mixers::mamba2::Mamba2Mixer;
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

/// The Mamba-2 block of one sequence: returns `[t, hidden]`.
pub(super) fn mamba2(
    m: &Mamba2Mixer,
    view: Mamba2SlotMut<'_>,
    x: &[f32],
    t: usize,
    step: Step,
    snapshots: &mut Vec<f32>,
    traffic: &mut Traffic,
) -> Vec<f32> {
    let (dims, a, d_skip) = (m.dims(), m.a(), m.d_skip());
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
    let out = m.forward_with(x, t, prefill_numerics, &mut window, |inp, y| {
        let tok = Mamba2Tokens {
            x: &inp.x,
            dt: &inp.dt,
            b: &inp.b,
            c: &inp.c,
        };
        let full_scan = |state: &mut [f32], y: &mut [f32]| {
            if t == 1 {
                mamba2_step(dims, state, &inp.x, &inp.dt, a, &inp.b, &inp.c, d_skip, y);
            } else {
                mamba2_chunked(dims, t, chunk, state, &inp.x, &inp.dt, a, &inp.b, &inp.c, d_skip, y);
            }
        };
        let mut ring = Mamba2Ring::new(dims, rx, rdt, rb, &mut index);
        *traffic += match (phase, form) {
            (Phase::Prefill, DecodeForm::KvOnly) => {
                // The prompt's outputs from the chunked scan; its history kept as ring entries only (the scan's
                // final state in the unused checkpoint is never read: a compress overwrites it).
                full_scan(state, y);
                ring.push(&inp.x, &inp.dt, &inp.b)
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
    out
}

/// The Gated DeltaNet block of one sequence: returns `[t, hidden]`.
pub(super) fn gdn(
    m: &GdnMixer,
    view: GdnSlotMut<'_>,
    x: &[f32],
    t: usize,
    step: Step,
    snapshots: &mut Vec<f32>,
    traffic: &mut Traffic,
) -> Vec<f32> {
    let dims = m.dims();
    let chunk = m.spec().chunk_size;
    let GdnSlotMut {
        state,
        u,
        k,
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
        let tok = GdnTokens {
            q: &inp.q,
            k: &inp.k,
            v: &inp.v,
            g: &inp.g,
            beta: &inp.beta,
        };
        let full_scan = |state: &mut [f32], out: &mut [f32]| {
            if t == 1 {
                gdn_step(dims, state, &inp.q, &inp.k, &inp.v, &inp.g, &inp.beta, out);
            } else {
                gdn_chunked(dims, t, chunk, state, &inp.q, &inp.k, &inp.v, &inp.g, &inp.beta, out);
            }
        };
        let mut ring = GdnRing::new(dims, u, k, g, &mut index);
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
    out
}
