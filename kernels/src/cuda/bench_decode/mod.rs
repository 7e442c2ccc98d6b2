//! Decode-kernel benchmark of one SSM layer at real shapes (`rewind bench kernels`): the recurrent step, input replay
//! at several ring capacities (with its flush step apart), and parallel verify of several windows, over a range of
//! batch sizes, each time judged against the byte model and the device's copy bandwidth measured in the same run.
//!
//! - this module: what is measured ([`Family`], [`Kernel`], [`Sweep`]) and what comes back ([`Row`], [`Report`]);
//! - [`bytes`]: each launch's rows (ring fill, window, fold) and the bytes the byte model says they move;
//! - [`render`]: the markdown tables (per family, and the targets);
//! - `run`: the device side ([`run_sweep`]): pools beyond L2, operands rotated between timed launches.
//!
//! Beside them, the serial snapshot baseline (what an engine without replay runs to verify drafts): its verify
//! writes one state snapshot per draft, and its commit copies the accepted one back, so that commit is timed per
//! accepted count.
//!
//! A verify's kernel does not depend on how many drafts are later accepted: the accepted count only moves the ring
//! counters on the host (`commit_replay`, a pointer move with no device work), so verify is timed once per window and
//! its rows say so ([`Row::commit`]) instead of repeating one time per accepted count.

pub mod bytes;
pub mod render;
mod run;

pub use run::run_sweep;

use crate::cpu::gdn::GdnDims;
use crate::cpu::mamba2::Mamba2Dims;
use crate::cuda::ops::REPLAY_MAX_T;

/// The layer families, each at the shape of a real model's layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// Nemotron-H-8B's Mamba-2 layer: 128 heads × 64, state 128, 8 groups.
    Mamba2,
    /// Qwen3.5-4B's Gated DeltaNet layer: 16 key / 32 value heads × 128.
    Gdn,
}

impl Family {
    /// Both families, in report order.
    pub const ALL: [Family; 2] = [Family::Mamba2, Family::Gdn];

    /// The name used on the command line and in JSON rows.
    pub fn name(self) -> &'static str {
        match self {
            Family::Mamba2 => "mamba2",
            Family::Gdn => "gdn",
        }
    }

    /// `mamba2`, `gdn` or `all`.
    pub fn parse_list(s: &str) -> Result<Vec<Family>, String> {
        match s {
            "mamba2" => Ok(vec![Family::Mamba2]),
            "gdn" => Ok(vec![Family::Gdn]),
            "all" => Ok(Family::ALL.to_vec()),
            other => Err(format!("unknown family `{other}` (mamba2, gdn or all)")),
        }
    }

    /// The Mamba-2 layer's dims.
    pub fn mamba2_dims() -> Mamba2Dims {
        Mamba2Dims {
            heads: 128,
            head_dim: 64,
            state_dim: 128,
            groups: 8,
        }
    }

    /// The GDN layer's dims.
    pub fn gdn_dims() -> GdnDims {
        GdnDims {
            k_heads: 16,
            v_heads: 32,
            k_dim: 128,
            v_dim: 128,
        }
    }

    /// The model and layer shape, for report headers.
    pub fn shape(self) -> &'static str {
        match self {
            Family::Mamba2 => "Nemotron-H-8B Mamba-2 layer: 128 heads × 64, state 128, 8 groups",
            Family::Gdn => "Qwen3.5-4B Gated DeltaNet layer: 16 key / 32 value heads × 128",
        }
    }
}

/// One kernel launch form of the sweep. Every form but [`Kernel::RecurrentStep`] is the replay kernel with rows of
/// some form ([`bytes::row_forms`] says which fills and folds).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// The recurrent step kernel (`mamba2_step` / `gdn_step`): the recurrent form's decode step.
    RecurrentStep,
    /// Recurrent rows through the replay kernel (empty ring, the row folds its own entry), as a batch mixing forms
    /// runs them.
    RecurrentReplay,
    /// Replay decode with ring capacity `l`, rows at fills spread over `0 ..= l − 2` (none flushing).
    Replay {
        /// Ring capacity L.
        l: usize,
    },
    /// The replay decode step that flushes: every row at fill `l − 1` folds all its entries, its own included.
    ReplayFlush {
        /// Ring capacity L.
        l: usize,
    },
    /// Parallel verify of `t` drafts, ring capacity `l`, rows at fills spread over `0 ..= l − 2t` (none flushing).
    Verify {
        /// Ring capacity L.
        l: usize,
        /// Drafts T.
        t: usize,
    },
    /// Verify whose rows flush first (fills `l − 2t + 1 ..= l − t`): the committed history is folded, no draft.
    VerifyFlush {
        /// Ring capacity L.
        l: usize,
        /// Drafts T.
        t: usize,
    },
    /// The serial snapshot baseline's verify (`ops::*_spec_verify`): the recurrence run draft by draft from the
    /// slot's state, one full state snapshot written per draft.
    BaselineVerify {
        /// Drafts T.
        t: usize,
    },
    /// The baseline's commit (`ops::spec_commit`): the state becomes snapshot `accepted − 1`; 0 keeps it.
    BaselineCommit {
        /// Drafts accepted.
        accepted: usize,
    },
}

impl Kernel {
    /// The kernel kind of JSON rows.
    pub fn kind(self) -> &'static str {
        match self {
            Kernel::RecurrentStep => "recurrent_step",
            Kernel::RecurrentReplay => "recurrent_replay",
            Kernel::Replay { .. } => "replay",
            Kernel::ReplayFlush { .. } => "replay_flush",
            Kernel::Verify { .. } => "verify",
            Kernel::VerifyFlush { .. } => "verify_flush",
            Kernel::BaselineVerify { .. } => "baseline_verify",
            Kernel::BaselineCommit { .. } => "baseline_commit",
        }
    }

    /// Ring capacity L, where the kernel has a ring.
    pub fn l(self) -> Option<usize> {
        match self {
            Kernel::RecurrentStep
            | Kernel::RecurrentReplay
            | Kernel::BaselineVerify { .. }
            | Kernel::BaselineCommit { .. } => None,
            Kernel::Replay { l }
            | Kernel::ReplayFlush { l }
            | Kernel::Verify { l, .. }
            | Kernel::VerifyFlush { l, .. } => Some(l),
        }
    }

    /// Tokens each row appends: the window T of a verify, else 1.
    pub fn t(self) -> usize {
        match self {
            Kernel::Verify { t, .. } | Kernel::VerifyFlush { t, .. } | Kernel::BaselineVerify { t } => t,
            _ => 1,
        }
    }

    /// Accepted drafts, for the rows whose time depends on them.
    pub fn accepted(self) -> Option<usize> {
        match self {
            Kernel::BaselineCommit { accepted } => Some(accepted),
            _ => None,
        }
    }

    /// What a verify row says about the commit after it.
    pub fn commit_note(self) -> Option<&'static str> {
        match self {
            Kernel::Verify { .. } | Kernel::VerifyFlush { .. } => Some(REPLAY_COMMIT),
            Kernel::BaselineVerify { .. } => Some(BASELINE_COMMIT),
            _ => None,
        }
    }

    /// A short label for tables: `replay L=16`, `verify T=4 (L=16)`.
    pub fn label(self) -> String {
        match self {
            Kernel::RecurrentStep => "recurrent (step kernel)".into(),
            Kernel::RecurrentReplay => "recurrent rows (replay kernel)".into(),
            Kernel::Replay { l } => format!("replay L={l}"),
            Kernel::ReplayFlush { l } => format!("replay flush step L={l}"),
            Kernel::Verify { l, t } => format!("verify T={t} (L={l})"),
            Kernel::VerifyFlush { l, t } => format!("verify T={t} flushing (L={l})"),
            Kernel::BaselineVerify { t } => format!("baseline verify T={t} (snapshots)"),
            Kernel::BaselineCommit { accepted } => format!("baseline commit, {accepted} accepted"),
        }
    }
}

/// What a verify row says about the commit that follows it.
pub const REPLAY_COMMIT: &str =
    "commit of any accepted count 0..=T is a ring-counter move on the host (commit_replay): no device work, not timed";

/// What a baseline verify row says about its commit.
pub const BASELINE_COMMIT: &str =
    "the commit (state <- snapshot accepted-1) is timed apart, one row per accepted count (baseline_commit)";

/// What one run measures.
#[derive(Clone, Debug, PartialEq)]
pub struct Sweep {
    /// Layer families.
    pub families: Vec<Family>,
    /// Batch sizes (rows per launch).
    pub batches: Vec<usize>,
    /// Ring capacities L of the replay decode rows.
    pub ring_lens: Vec<usize>,
    /// Verify windows T.
    pub windows: Vec<usize>,
    /// The ring capacity verify rows run at (the engine's default, 16).
    pub verify_ring: usize,
    /// Untimed launches before the timed ones.
    pub warmup: usize,
    /// Timed launches; the median is reported.
    pub repeats: usize,
}

impl Default for Sweep {
    fn default() -> Self {
        Sweep {
            families: Family::ALL.to_vec(),
            batches: vec![1, 8, 32, 64, 128, 256, 512],
            ring_lens: vec![4, 8, 16, 32],
            windows: vec![2, 4, 6],
            verify_ring: 16,
            warmup: super::timing::WARMUP,
            repeats: super::timing::REPS,
        }
    }
}

/// The most rows one launch of the sweep may have (the kernels' grid limit).
pub const MAX_BATCH: usize = 65_535;

impl Sweep {
    /// Checks the sweep before anything is allocated.
    pub fn validate(&self) -> Result<(), String> {
        if self.families.is_empty() {
            return Err("no family to measure".into());
        }
        if self.batches.is_empty() || self.batches.iter().any(|&b| b == 0 || b > MAX_BATCH) {
            return Err(format!("batch sizes must lie in 1..={MAX_BATCH}"));
        }
        if self.repeats == 0 {
            return Err("repeats must be at least 1".into());
        }
        if let Some(&l) = self.ring_lens.iter().find(|&&l| l < 2) {
            return Err(format!("ring capacity L = {l} is below 2"));
        }
        for &t in &self.windows {
            if t == 0 || t > REPLAY_MAX_T {
                return Err(format!("verify window T = {t} is outside 1..={REPLAY_MAX_T}"));
            }
            if 2 * t > self.verify_ring {
                return Err(format!(
                    "verify window T = {t} needs a ring of at least 2T = {} (verify ring {})",
                    2 * t,
                    self.verify_ring
                ));
            }
        }
        Ok(())
    }

    /// Every kernel form, in report order: recurrent (both kernels), replay and its flush step per L, verify and its
    /// flushing form per T, then the serial snapshot baseline: its verify per T and its commit per accepted count
    /// `0 ..= max T` (the commit does not depend on T).
    pub fn kernels(&self) -> Vec<Kernel> {
        let mut k = vec![Kernel::RecurrentStep, Kernel::RecurrentReplay];
        k.extend(self.ring_lens.iter().map(|&l| Kernel::Replay { l }));
        k.extend(self.ring_lens.iter().map(|&l| Kernel::ReplayFlush { l }));
        let l = self.verify_ring;
        k.extend(self.windows.iter().map(|&t| Kernel::Verify { l, t }));
        k.extend(self.windows.iter().map(|&t| Kernel::VerifyFlush { l, t }));
        k.extend(self.windows.iter().map(|&t| Kernel::BaselineVerify { t }));
        if !self.windows.is_empty() {
            k.extend((0..=self.max_t()).map(|accepted| Kernel::BaselineCommit { accepted }));
        }
        k
    }

    /// Ring rows per slot the pools need: the largest capacity any kernel uses.
    pub fn ring_rows(&self) -> usize {
        self.kernels().iter().filter_map(|k| k.l()).max().unwrap_or(1)
    }

    /// The largest number of tokens a row appends.
    pub fn max_t(&self) -> usize {
        self.windows.iter().copied().max().unwrap_or(1).max(1)
    }

    /// Every (family, kernel, batch) case, in report order.
    pub fn cases(&self) -> Vec<(Family, Kernel, usize)> {
        let mut cases = Vec::new();
        for &f in &self.families {
            for k in self.kernels() {
                cases.extend(self.batches.iter().map(|&b| (f, k, b)));
            }
        }
        cases
    }
}

/// One measured case.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// Layer family.
    pub family: Family,
    /// Launch form.
    pub kernel: Kernel,
    /// Rows per launch.
    pub batch: usize,
    /// Accepted drafts, for rows whose time depends on it (the baseline's commit; a replay commit moves no data,
    /// see [`Row::commit`]).
    pub accepted: Option<usize>,
    /// Median milliseconds of one launch.
    pub ms: f64,
    /// Fastest and slowest timed launch, milliseconds (the spread a difference must beat to be real).
    pub ms_min: f64,
    /// See `ms_min`.
    pub ms_max: f64,
    /// Bytes the byte model says the launch moves.
    pub bytes: f64,
    /// `bytes / ms`, GB/s.
    pub gbs: f64,
    /// `gbs` over the copy bandwidth of the same run.
    pub frac_copy: f64,
    /// `ms` over the recurrent step kernel's at the same family and batch (when measured).
    pub vs_recurrent: Option<f64>,
    /// For verify rows: what the commit of each accepted count costs ([`REPLAY_COMMIT`], [`BASELINE_COMMIT`]).
    pub commit: Option<&'static str>,
}

impl Row {
    /// A row from its timed samples (sorted, milliseconds) and the byte model's bytes, against `copy_gbs`.
    pub fn new(family: Family, kernel: Kernel, batch: usize, samples: &[f64], bytes: f64, copy_gbs: f64) -> Row {
        let ms = samples.get(samples.len() / 2).copied().unwrap_or(f64::NAN);
        let gbs = bytes / ms / 1e6;
        Row {
            family,
            kernel,
            batch,
            accepted: kernel.accepted(),
            ms,
            ms_min: samples.first().copied().unwrap_or(f64::NAN),
            ms_max: samples.last().copied().unwrap_or(f64::NAN),
            bytes,
            gbs,
            frac_copy: gbs / copy_gbs,
            vs_recurrent: None,
            commit: kernel.commit_note(),
        }
    }
}

/// A whole run: the device, its copy bandwidth, and every row.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// Device name.
    pub device: String,
    /// Compute capability.
    pub arch: (u32, u32),
    /// Streaming multiprocessors.
    pub sm_count: usize,
    /// Device-to-device copy bandwidth (read + write), GB/s, measured in this run.
    pub copy_gbs: f64,
    /// Read-only bandwidth, GB/s, measured in this run (`timing::read_bandwidth`).
    pub read_gbs: f64,
    /// What was measured.
    pub sweep: Sweep,
    /// Every case, in [`Sweep::cases`] order.
    pub rows: Vec<Row>,
}

impl Report {
    /// Fills every row's [`Row::vs_recurrent`] from the recurrent step rows of the same family and batch.
    pub fn relate(&mut self) {
        let base: Vec<(Family, usize, f64)> = self
            .rows
            .iter()
            .filter(|r| r.kernel == Kernel::RecurrentStep)
            .map(|r| (r.family, r.batch, r.ms))
            .collect();
        for r in &mut self.rows {
            r.vs_recurrent = base
                .iter()
                .find(|(f, b, _)| *f == r.family && *b == r.batch)
                .map(|(_, _, ms)| r.ms / ms);
        }
    }

    /// The row of `family`, `kernel` and `batch`, if measured.
    pub fn find(&self, family: Family, kernel: Kernel, batch: usize) -> Option<&Row> {
        self.rows
            .iter()
            .find(|r| r.family == family && r.kernel == kernel && r.batch == batch)
    }
}

#[cfg(test)]
mod tests;
