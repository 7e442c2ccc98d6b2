//! The rows of each benchmark launch and the bytes the byte model says they move.
//!
//! The model is the CPU twins' [`Traffic`] (`cpu::replay_mamba2`, `cpu::replay_gdn`, GPU layout: fp32 states, bf16
//! vectors, fp32 per-head scalars) for one fused launch: the checkpoint read once, the row's `h` committed ring
//! entries read once, `t` entries appended, `t` tokens' inputs read and outputs written, and the checkpoint written
//! when the row folds. The one difference from the twins: a verify that flushes is one launch here, so its fold
//! re-reads nothing (the Mamba-2 twin also counts the standalone fold's ring read). The tests check this against the
//! twins' own numbers.

use super::{Family, Kernel};
use crate::cpu::gdn::GdnDims;
use crate::cpu::mamba2::Mamba2Dims;
use crate::cpu::traffic::Traffic;
use crate::cpu::{replay_gdn, replay_mamba2};

/// One row of a launch: where its ring stands and what the step does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowForm {
    /// Committed ring entries `h` before the step.
    pub fill: usize,
    /// Tokens the row appends.
    pub t: usize,
    /// Entries folded into the checkpoint after the readout (0: the checkpoint is not written).
    pub fold: usize,
}

/// The `b`-th of `batch` values spread evenly over `lo ..= hi` (their mean is the range's middle at any batch, so a
/// batch of 1 sits mid-ring rather than at an empty ring).
fn spread(lo: usize, hi: usize, b: usize, batch: usize) -> usize {
    lo + (2 * b + 1) * (hi - lo + 1) / (2 * batch)
}

/// The rows of a launch of `kernel` over `batch` sequences. Fills follow the engine's flush rule
/// (`needs_flush(h, t, L) = h + 2t > L`): non-flushing rows sit at every fill that rule allows, flushing rows at
/// the fills where it fires.
pub fn row_forms(kernel: Kernel, batch: usize) -> Vec<RowForm> {
    (0..batch)
        .map(|b| match kernel {
            Kernel::RecurrentStep | Kernel::RecurrentReplay => RowForm { fill: 0, t: 1, fold: 1 },
            Kernel::Replay { l } => RowForm {
                fill: spread(0, l - 2, b, batch),
                t: 1,
                fold: 0,
            },
            // A decode's flush folds every committed entry, its own included.
            Kernel::ReplayFlush { l } => RowForm {
                fill: l - 1,
                t: 1,
                fold: l,
            },
            Kernel::Verify { l, t } => RowForm {
                fill: spread(0, l - 2 * t, b, batch),
                t,
                fold: 0,
            },
            // A verify's flush folds the committed history only, never a draft.
            Kernel::VerifyFlush { l, t } => {
                let fill = spread(l - 2 * t + 1, l - t, b, batch);
                RowForm { fill, t, fold: fill }
            }
            // No ring: the baseline's verify writes its `t` snapshots, its commit folds `accepted` drafts in.
            Kernel::BaselineVerify { t } => RowForm { fill: 0, t, fold: 0 },
            Kernel::BaselineCommit { accepted } => RowForm {
                fill: 0,
                t: 0,
                fold: accepted,
            },
        })
        .collect()
}

/// The byte model's traffic of one replay-kernel row of the Mamba-2 layer `d`.
pub fn mamba2_row(d: Mamba2Dims, r: RowForm) -> Traffic {
    let state = Traffic::f32s(d.heads * d.head_dim * d.state_dim);
    // x and B bf16, dt fp32.
    let entry = Traffic::bf16s(d.heads * d.head_dim) + Traffic::f32s(d.heads) + Traffic::bf16s(d.groups * d.state_dim);
    // x, B, C bf16 and dt fp32 per token, plus A and D.
    let token = Traffic::bf16s(d.heads * d.head_dim + 2 * d.groups * d.state_dim) + Traffic::f32s(d.heads);
    row(
        state,
        entry,
        r,
        r.t as u64 * token + Traffic::f32s(2 * d.heads),
        Traffic::bf16s(r.t * d.heads * d.head_dim),
    )
}

/// The byte model's traffic of one replay-kernel row of the GDN layer `d`.
pub fn gdn_row(d: GdnDims, r: RowForm) -> Traffic {
    let state = Traffic::f32s(d.state_len());
    // u and k bf16, g fp32.
    let entry = Traffic::bf16s(d.v_heads * d.v_dim + d.k_heads * d.k_dim) + Traffic::f32s(d.v_heads);
    // q, k, v bf16, g and β fp32.
    let token = Traffic::bf16s(2 * d.k_heads * d.k_dim + d.v_heads * d.v_dim) + Traffic::f32s(2 * d.v_heads);
    row(
        state,
        entry,
        r,
        r.t as u64 * token,
        Traffic::bf16s(r.t * d.v_heads * d.v_dim),
    )
}

fn row(state: u64, entry: u64, r: RowForm, inputs: u64, outputs: u64) -> Traffic {
    Traffic {
        state_read: state,
        state_written: if r.fold > 0 { state } else { 0 },
        ring_read: r.fill as u64 * entry,
        ring_written: r.t as u64 * entry,
        inputs,
        outputs,
    }
}

/// The serial baseline's traffic for one row (CPU twins `verify_baseline` and `commit_baseline`): a verify reads the
/// state once and writes `t` snapshots beside its inputs and outputs; a commit of `accepted > 0` drafts copies one
/// snapshot to the state (read and written), of 0 moves nothing. `replay` is the family's replay row model, whose
/// state, input and output terms the baseline shares.
pub fn baseline_row(kernel: Kernel, replay: impl Fn(RowForm) -> Traffic) -> Traffic {
    match kernel {
        Kernel::BaselineVerify { t } => {
            let r = replay(RowForm { fill: 0, t, fold: 0 });
            Traffic {
                state_written: t as u64 * r.state_read,
                ring_written: 0,
                ..r
            }
        }
        Kernel::BaselineCommit { accepted } if accepted > 0 => {
            let state = replay(RowForm { fill: 0, t: 0, fold: 0 }).state_read;
            Traffic {
                state_read: state,
                state_written: state,
                ..Traffic::default()
            }
        }
        _ => Traffic::default(),
    }
}

/// Bytes one launch of `kernel` over `rows` moves in `family`'s layer.
pub fn launch_bytes(family: Family, kernel: Kernel, rows: &[RowForm]) -> u64 {
    let replay = |r: RowForm| match family {
        Family::Mamba2 => mamba2_row(Family::mamba2_dims(), r),
        Family::Gdn => gdn_row(Family::gdn_dims(), r),
    };
    let per_row = |r: &RowForm| match (family, kernel) {
        (Family::Mamba2, Kernel::RecurrentStep) => replay_mamba2::recurrent_step_traffic(Family::mamba2_dims()),
        (Family::Gdn, Kernel::RecurrentStep) => replay_gdn::recurrent_step_traffic(Family::gdn_dims()),
        (_, Kernel::BaselineVerify { .. } | Kernel::BaselineCommit { .. }) => baseline_row(kernel, replay),
        _ => replay(*r),
    };
    rows.iter().map(|r| per_row(r).total()).sum()
}
