//! The device side of the decode benchmark: one set of pools per family, sized beyond L2, and every case timed with
//! CUDA events (`timing::samples_ms`) while its operands rotate between launches.
//!
//! Rotation, so a launch reads HBM and not what the previous one left in L2: the state pool holds at least 512 slots
//! (1 GiB for the GDN layer, 2 GiB for Mamba-2) and each launch takes the next window of `batch` slots; the fresh
//! inputs and outputs come from token pools of at least 256 MiB a family (beyond any current L2), each launch the next window of
//! `batch · t` token rows. A batch of 1 thus never sees the same state twice in a run of up to 512 launches. The
//! baseline's snapshot pool (`[slots, max T, state]`, 12 GiB for Mamba-2 at T = 6) rotates with the state slots.

use half::bf16;

use super::bytes::{launch_bytes, row_forms, RowForm};
use super::{Family, Kernel, Report, Row, Sweep};
use crate::cuda::ops::{self, ReplayRow, ReplayShape};
use crate::cuda::parity::Rng;
use crate::cuda::{timing, CudaDevice, CudaError, CudaSlice, Elem, Result};

/// State slots of each pool (at least; more when a batch is larger).
const MIN_SLOTS: usize = 512;

/// Token pool bytes counted at 4 bytes an element (so at least half of it in bf16: beyond any current L2).
const TOKEN_POOL_BYTES: usize = 512 << 20;

/// Runs every case of `sweep` on `dev`, calling `progress` with each row as it is measured.
pub fn run_sweep(dev: &CudaDevice, sweep: &Sweep, mut progress: impl FnMut(&Row)) -> Result<Report> {
    sweep.validate().map_err(|message| CudaError::Shape {
        op: "bench_decode",
        message,
    })?;
    let copy_gbs = timing::copy_bandwidth(dev)?;
    let read_gbs = timing::read_bandwidth(dev)?;
    let mut report = Report {
        device: dev.name().to_string(),
        arch: dev.arch(),
        sm_count: dev.sm_count(),
        copy_gbs,
        read_gbs,
        sweep: sweep.clone(),
        rows: Vec::new(),
    };
    let slots = sweep.batches.iter().copied().max().unwrap_or(1).max(MIN_SLOTS);
    let rng = &mut Rng::new(11);
    for &family in &sweep.families {
        // One family's pools at a time: both at once would not fit a smaller device.
        let mut pools = Pools::new(dev, rng, family, sweep, slots)?;
        for kernel in sweep.kernels() {
            for &batch in &sweep.batches {
                let row = pools.measure(dev, sweep, kernel, batch, copy_gbs)?;
                progress(&row);
                report.rows.push(row);
            }
        }
    }
    report.relate();
    Ok(report)
}

/// `n` ordinary random values of type `T`: a block of at most 1 Mi values drawn on the host and repeated on the
/// device (drawing gigabytes on the host would take minutes; timing only needs finite, non-trivial numbers).
fn filled<T: Elem>(dev: &CudaDevice, rng: &mut Rng, n: usize, lo: f32, hi: f32) -> Result<CudaSlice<T>> {
    let block: Vec<f32> = (0..n.min(1 << 20)).map(|_| rng.uniform(lo, hi)).collect();
    let src = dev.upload_as::<T>(&block)?;
    let mut out = dev.alloc::<T>(n)?;
    let mut at = 0;
    while at < n {
        let len = block.len().min(n - at);
        dev.stream()
            .memcpy_dtod(&src.slice(..len), &mut out.slice_mut(at..at + len))
            .map_err(|e| CudaError::Unavailable(format!("filling a benchmark pool: {e:?}")))?;
        at += len;
    }
    Ok(out)
}

/// Elements per token row of each fresh operand, in kernel argument order.
fn token_widths(family: Family) -> Vec<usize> {
    match family {
        Family::Mamba2 => {
            let d = Family::mamba2_dims();
            // x, dt, B, C, y
            vec![
                d.heads * d.head_dim,
                d.heads,
                d.groups * d.state_dim,
                d.groups * d.state_dim,
                d.heads * d.head_dim,
            ]
        }
        Family::Gdn => {
            let d = Family::gdn_dims();
            // q, k, v, g, beta, out
            vec![
                d.k_heads * d.k_dim,
                d.k_heads * d.k_dim,
                d.v_heads * d.v_dim,
                d.v_heads,
                d.v_heads,
                d.v_heads * d.v_dim,
            ]
        }
    }
}

/// Token rows of the pools: enough for the largest launch, and at least [`TOKEN_POOL_BYTES`] (every operand counted
/// at 4 bytes an element: an upper bound, so the bf16 pools are at least half that).
fn token_rows(family: Family, sweep: &Sweep) -> usize {
    let row_bytes: usize = token_widths(family).iter().map(|w| 4 * w).sum();
    let largest = sweep.batches.iter().copied().max().unwrap_or(1) * sweep.max_t();
    largest.max(TOKEN_POOL_BYTES.div_ceil(row_bytes))
}

/// The operands of one family, allocated once for the whole sweep.
struct Pools {
    family: Family,
    slots: usize,
    ring_rows: usize,
    token_rows: usize,
    state: CudaSlice<f32>,
    /// Ring pools: Mamba-2 `x`, `B` (bf16) and `dt` (f32); GDN `u`, `k` (bf16) and `g` (f32).
    ring_a: CudaSlice<bf16>,
    ring_b: CudaSlice<bf16>,
    ring_s: CudaSlice<f32>,
    /// Fresh bf16 vectors per token row: Mamba-2 `x`, `B`, `C`; GDN `q`, `k`, `v`.
    vec_a: CudaSlice<bf16>,
    vec_b: CudaSlice<bf16>,
    vec_c: CudaSlice<bf16>,
    /// Fresh f32 scalars per token row: Mamba-2 `dt` (and an unused second); GDN `g`, `β`.
    sc_a: CudaSlice<f32>,
    sc_b: CudaSlice<f32>,
    out: CudaSlice<bf16>,
    /// Mamba-2 `A` and `D` (unused for GDN).
    a: CudaSlice<f32>,
    d: CudaSlice<f32>,
    /// The baseline's snapshots, `[slots, max T, state]` (when the sweep verifies).
    snapshots: Option<CudaSlice<f32>>,
    state_len: usize,
}

impl Pools {
    fn new(dev: &CudaDevice, rng: &mut Rng, family: Family, sweep: &Sweep, slots: usize) -> Result<Self> {
        let ring_rows = sweep.ring_rows();
        let rows = token_rows(family, sweep);
        let (state_len, ring_a, ring_b, ring_s, vec_a, vec_b, vec_c, scalars, heads) = match family {
            Family::Mamba2 => {
                let d = Family::mamba2_dims();
                let (hp, gn) = (d.heads * d.head_dim, d.groups * d.state_dim);
                (
                    d.heads * d.head_dim * d.state_dim,
                    hp,
                    gn,
                    d.heads,
                    hp,
                    gn,
                    gn,
                    d.heads,
                    d.heads,
                )
            }
            Family::Gdn => {
                let d = Family::gdn_dims();
                let (kd, vd) = (d.k_heads * d.k_dim, d.v_heads * d.v_dim);
                (d.state_len(), vd, kd, d.v_heads, kd, kd, vd, d.v_heads, d.v_heads)
            }
        };
        let ring = slots * ring_rows;
        // dt ≈ 0.05 (Mamba-2) and g ≈ −0.05, β ≈ 0.5 (GDN): ordinary decays and write strengths. GDN keys and
        // queries of about unit norm (±0.15 over 128 dims), so the delta rule stays contracting over the thousands
        // of steps the sweep applies to its states.
        let (s_lo, s_hi) = match family {
            Family::Mamba2 => (0.01, 0.1),
            Family::Gdn => (-0.1, -0.01),
        };
        let key = match family {
            Family::Mamba2 => 0.5,
            Family::Gdn => 0.15,
        };
        Ok(Pools {
            family,
            slots,
            ring_rows,
            token_rows: rows,
            state: filled(dev, rng, slots * state_len, -0.5, 0.5)?,
            ring_a: filled(dev, rng, ring * ring_a, -0.5, 0.5)?,
            ring_b: filled(dev, rng, ring * ring_b, -key, key)?,
            ring_s: filled(dev, rng, ring * ring_s, s_lo, s_hi)?,
            vec_a: filled(dev, rng, rows * vec_a, -key, key)?,
            vec_b: filled(dev, rng, rows * vec_b, -key, key)?,
            vec_c: filled(dev, rng, rows * vec_c, -0.5, 0.5)?,
            sc_a: filled(dev, rng, rows * scalars, s_lo, s_hi)?,
            sc_b: filled(dev, rng, rows * scalars, 0.1, 0.9)?,
            out: dev.alloc_zeros(rows * vec_c.max(vec_a))?,
            a: filled(dev, rng, heads, -4.0, -0.5)?,
            d: filled(dev, rng, heads, 0.5, 1.5)?,
            snapshots: if sweep.windows.is_empty() {
                None
            } else {
                Some(dev.alloc_zeros(slots * sweep.max_t() * state_len)?)
            },
            state_len,
        })
    }

    /// Times `kernel` over `batch` rows.
    fn measure(&mut self, dev: &CudaDevice, sweep: &Sweep, kernel: Kernel, batch: usize, copy_gbs: f64) -> Result<Row> {
        let forms = row_forms(kernel, batch);
        let t = kernel.t();
        let launches = sweep.warmup + sweep.repeats;
        // Launch i takes slot window i mod (slots / batch) and token window i mod (token rows / (batch · t)).
        let slot_windows = (self.slots / batch).max(1);
        let token_windows = (self.token_rows / (batch * t)).max(1);
        let sets = launches.min(slot_windows.max(1));
        let metas = (0..sets)
            .map(|i| self.launch_meta(dev, kernel, &forms, (i % slot_windows) * batch))
            .collect::<Result<Vec<_>>>()?;
        let max_m = forms.iter().map(|r| r.fill + r.t).max().unwrap_or(t);
        let shape = ReplayShape {
            batch,
            t,
            ring_rows: self.ring_rows,
            max_m,
        };
        let samples = timing::samples_ms(dev, sweep.warmup, sweep.repeats, |i| {
            let meta = &metas[i % sets];
            let tok = (i % token_windows) * batch * t;
            self.launch(dev, kernel, shape, meta, tok)
        })?;
        let bytes = launch_bytes(self.family, kernel, &forms) as f64;
        Ok(Row::new(self.family, kernel, batch, &samples, bytes, copy_gbs))
    }

    /// The device metadata of one launch whose rows take slots `base ..`: the slot list for the step kernel and the
    /// baseline verify, (slot, accepted) rows for the baseline commit, the replay rows otherwise.
    fn launch_meta(&self, dev: &CudaDevice, kernel: Kernel, forms: &[RowForm], base: usize) -> Result<CudaSlice<i32>> {
        match kernel {
            Kernel::RecurrentStep | Kernel::BaselineVerify { .. } => {
                let slots: Vec<i32> = (0..forms.len()).map(|b| (base + b) as i32).collect();
                return dev.upload(&slots);
            }
            Kernel::BaselineCommit { accepted } => {
                let rows: Vec<i32> = (0..forms.len())
                    .flat_map(|b| [(base + b) as i32, accepted as i32])
                    .collect();
                return dev.upload(&rows);
            }
            _ => {}
        }
        let cap = kernel.l().unwrap_or(self.ring_rows);
        let rows: Vec<ReplayRow> = forms
            .iter()
            .enumerate()
            .map(|(b, r)| ReplayRow {
                slot: base + b,
                // Rings start anywhere, so rows wrap as they do in a long-running engine.
                ring_start: (b * 5) % cap,
                ring_len: r.fill,
                ring_cap: cap,
                fold: r.fold,
                read_state: true,
                conv_head: 0,
            })
            .collect();
        dev.upload(&ReplayRow::encode_all(&rows))
    }

    /// Queues one launch of `kernel` whose fresh operands start at token row `tok`.
    fn launch(
        &mut self,
        dev: &CudaDevice,
        kernel: Kernel,
        shape: ReplayShape,
        meta: &CudaSlice<i32>,
        tok: usize,
    ) -> Result<()> {
        let no_snapshots = || CudaError::Shape {
            op: "bench_decode",
            message: "the baseline needs a snapshot pool (a sweep with verify windows)".into(),
        };
        if let Kernel::BaselineCommit { .. } = kernel {
            let snapshots = self.snapshots.as_ref().ok_or_else(no_snapshots)?;
            return ops::spec_commit(dev, self.state_len, &mut self.state, snapshots, meta);
        }
        let n = shape.batch * shape.t;
        let w = token_widths(self.family);
        let at = |i: usize| tok * w[i]..(tok + n) * w[i];
        match self.family {
            Family::Mamba2 => {
                let dims = Family::mamba2_dims();
                let (x, dt, b, c) = (
                    self.vec_a.slice(at(0)),
                    self.sc_a.slice(at(1)),
                    self.vec_b.slice(at(2)),
                    self.vec_c.slice(at(3)),
                );
                let mut y = self.out.slice_mut(at(4));
                if let Kernel::BaselineVerify { t } = kernel {
                    let snapshots = self.snapshots.as_mut().ok_or_else(no_snapshots)?;
                    ops::mamba2_spec_verify(
                        dev,
                        dims,
                        t,
                        &self.state,
                        snapshots,
                        meta,
                        &x,
                        &dt,
                        &self.a,
                        &b,
                        &c,
                        &self.d,
                        &mut y,
                    )
                } else if kernel == Kernel::RecurrentStep {
                    ops::mamba2_step(
                        dev,
                        dims,
                        &mut self.state,
                        meta,
                        &x,
                        &dt,
                        &self.a,
                        &b,
                        &c,
                        &self.d,
                        &mut y,
                    )
                } else {
                    ops::mamba2_replay(
                        dev,
                        dims,
                        shape,
                        &mut self.state,
                        &mut self.ring_a,
                        &mut self.ring_s,
                        &mut self.ring_b,
                        meta,
                        &x,
                        &dt,
                        &self.a,
                        &b,
                        &c,
                        &self.d,
                        &mut y,
                    )
                }
            }
            Family::Gdn => {
                let dims = Family::gdn_dims();
                let (q, k, v, g, beta) = (
                    self.vec_a.slice(at(0)),
                    self.vec_b.slice(at(1)),
                    self.vec_c.slice(at(2)),
                    self.sc_a.slice(at(3)),
                    self.sc_b.slice(at(4)),
                );
                let mut out = self.out.slice_mut(at(5));
                if let Kernel::BaselineVerify { t } = kernel {
                    let snapshots = self.snapshots.as_mut().ok_or_else(no_snapshots)?;
                    ops::gdn_spec_verify(
                        dev,
                        dims,
                        t,
                        &self.state,
                        snapshots,
                        meta,
                        &q,
                        &k,
                        &v,
                        &g,
                        &beta,
                        &mut out,
                    )
                } else if kernel == Kernel::RecurrentStep {
                    ops::gdn_step(dev, dims, &mut self.state, meta, &q, &k, &v, &g, &beta, &mut out)
                } else {
                    ops::gdn_replay(
                        dev,
                        dims,
                        shape,
                        &mut self.state,
                        &mut self.ring_a,
                        &mut self.ring_b,
                        &mut self.ring_s,
                        meta,
                        &q,
                        &k,
                        &v,
                        &g,
                        &beta,
                        &mut out,
                    )
                }
            }
        }
    }
}
