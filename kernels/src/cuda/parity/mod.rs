//! Parity of every CUDA op with its CPU twin: the cases `rewind selftest` runs.
//!
//! Each case draws fresh random inputs (seeded, never zeros), poisons its outputs with NaN before the launch, runs the
//! CUDA op and the CPU function from [`crate::cpu`] on the same values (inputs rounded to the storage type first, so the
//! comparison measures the kernel, not the rounding of its inputs) and reports `‖out − ref‖ / ‖ref‖` per output
//! against a threshold: 1e-5 for f32 storage, 1e-2 for bf16 storage (about four bf16 rounding units), 1e-3 for GEMMs
//! with f32 output (tensor-core accumulation order). A NaN anywhere (an element never written) fails.
//!
//! Adding an op: write a generic `fn my_op<T: Elem>(cx: &Ctx, rng: &mut Rng, ..) -> Result<Vec<Check>>` in
//! [`cases`] and register one line per shape in [`cases::all`] with `both!` (f32 and bf16) or `Case::new`.

use std::time::Instant;

use super::blas::Blas;
use super::device::{CudaDevice, Elem};
use super::Result;

/// Registers a case for f32 and for bf16 storage: `both!(cases, "op", shape, generic_fn(args..))` calls
/// `generic_fn::<T>(cx, rng, args..)`; the arguments must be `Copy`.
macro_rules! both {
    ($cases:ident, $op:literal, $shape:expr, $f:ident($($a:expr),* $(,)?)) => {{
        let shape: String = $shape.into();
        $cases.push(Case::new($op, "f32", shape.clone(), move |cx, rng| $f::<f32>(cx, rng, $($a),*)));
        $cases.push(Case::new($op, "bf16", shape, move |cx, rng| $f::<half::bf16>(cx, rng, $($a),*)));
    }};
}

pub mod cases;
mod cases_accept;
mod cases_chain;
mod cases_chain_spec;
mod cases_gemv_quant;
mod cases_glue;
mod cases_head;
mod cases_moe;
mod cases_replay;
mod cases_sample;
mod cases_seq;
mod cases_spec_baseline;
mod cases_ssm;

/// SplitMix64: a small seeded generator, so the parity cases need no extra dependency.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `[lo, hi)`, never exactly zero.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        loop {
            let v = lo + (hi - lo) * self.unit();
            if v != 0.0 {
                return v;
            }
        }
    }

    /// `n` values uniform in `[−scale, scale)`, none zero.
    pub fn uniform_vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(-scale, scale)).collect()
    }

    /// Uniform integer in `[lo, hi)`.
    pub fn below(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo) as u64) as usize
    }

    /// The first `k` entries of a random permutation of `0..n`.
    pub fn distinct(&mut self, k: usize, n: usize) -> Vec<usize> {
        let mut all: Vec<usize> = (0..n).collect();
        for i in 0..k.min(n) {
            let j = self.below(i, n);
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }
}

/// `‖out − ref‖₂ / ‖ref‖₂` in f64; NaN when any element is NaN or the lengths differ.
pub fn rel_err<A: Copy + Into<f64>, B: Copy + Into<f64>>(out: &[A], reference: &[B]) -> f64 {
    if out.len() != reference.len() {
        return f64::NAN;
    }
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&o, &r) in out.iter().zip(reference) {
        let (o, r): (f64, f64) = (o.into(), r.into());
        diff += (o - r) * (o - r);
        norm += r * r;
    }
    if diff == 0.0 {
        // Exact agreement, including an all-zero reference.
        return 0.0;
    }
    (diff / norm).sqrt()
}

/// The larger of two errors, NaN if either is NaN.
pub fn worse(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

/// One compared output of a case.
#[derive(Clone, Debug)]
pub struct Check {
    /// Which output (`out`, `state`, ...).
    pub output: &'static str,
    /// `‖out − ref‖ / ‖ref‖`.
    pub rel_err: f64,
    /// Largest error that passes.
    pub threshold: f64,
}

impl Check {
    /// Compares `out` with `reference`.
    pub fn new(output: &'static str, out: &[f32], reference: &[f32], threshold: f64) -> Self {
        Self {
            output,
            rel_err: rel_err(out, reference),
            threshold,
        }
    }

    /// Finite and within the threshold.
    pub fn passed(&self) -> bool {
        self.rel_err.is_finite() && self.rel_err <= self.threshold
    }
}

/// The threshold for an output stored as `T`.
pub fn tol<T: Elem>() -> f64 {
    if T::NAME == "f32" {
        1e-5
    } else {
        1e-2
    }
}

/// Rounds values to `T` and back, so the CPU twin sees exactly what the GPU sees.
pub fn rounded<T: Elem>(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| T::from_f32(x).to_f32()).collect()
}

/// What a case needs: the device and the BLAS handles.
pub struct Ctx<'a> {
    /// The device under test.
    pub dev: &'a CudaDevice,
    /// cuBLAS / cuBLASLt handles on its stream.
    pub blas: &'a Blas,
}

type CaseFn = Box<dyn Fn(&Ctx, &mut Rng) -> Result<Vec<Check>>>;

/// One op at one shape and storage type.
pub struct Case {
    /// The op's name.
    pub op: &'static str,
    /// Storage type (`f32`, `bf16`, or a conversion such as `f32→bf16`).
    pub dtype: &'static str,
    /// The shape, with the model it comes from.
    pub shape: String,
    run: CaseFn,
}

impl Case {
    /// A case of storage type `dtype`.
    pub fn new(
        op: &'static str,
        dtype: &'static str,
        shape: impl Into<String>,
        run: impl Fn(&Ctx, &mut Rng) -> Result<Vec<Check>> + 'static,
    ) -> Self {
        Self {
            op,
            dtype,
            shape: shape.into(),
            run: Box::new(run),
        }
    }
}

/// The outcome of one case.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// The op's name.
    pub op: &'static str,
    /// Storage type.
    pub dtype: &'static str,
    /// The shape.
    pub shape: String,
    /// Compared outputs (empty when the case failed to run).
    pub checks: Vec<Check>,
    /// Why the case could not run.
    pub error: Option<String>,
    /// Wall time of the case (inputs, launch, reference, comparison).
    pub seconds: f64,
}

impl CaseResult {
    /// Ran, and every output passed.
    pub fn passed(&self) -> bool {
        self.error.is_none() && !self.checks.is_empty() && self.checks.iter().all(Check::passed)
    }
}

/// Runs every case whose op name contains `filter` (all when `None`), each with its own generator derived from
/// `seed`, and synchronises after each so that a fault is charged to the case that caused it.
pub fn run_all(dev: &CudaDevice, blas: &Blas, seed: u64, filter: Option<&str>) -> Vec<CaseResult> {
    let cx = Ctx { dev, blas };
    cases::all()
        .into_iter()
        .filter(|c| filter.is_none_or(|f| c.op.contains(f)))
        .enumerate()
        .map(|(i, case)| {
            let mut rng = Rng::new(seed ^ (i as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
            let t0 = Instant::now();
            let outcome = (case.run)(&cx, &mut rng).and_then(|checks| dev.synchronize().map(|()| checks));
            let seconds = t0.elapsed().as_secs_f64();
            let (checks, error) = match outcome {
                Ok(c) => (c, None),
                Err(e) => (Vec::new(), Some(e.to_string())),
            };
            CaseResult {
                op: case.op,
                dtype: case.dtype,
                shape: case.shape,
                checks,
                error,
                seconds,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_seeded_and_never_zero() {
        let a = Rng::new(7).uniform_vec(10_000, 1.0);
        assert_eq!(a, Rng::new(7).uniform_vec(10_000, 1.0));
        assert_ne!(a, Rng::new(8).uniform_vec(10_000, 1.0));
        assert!(a.iter().all(|&v| v != 0.0 && (-1.0..1.0).contains(&v)));
        let d = Rng::new(3).distinct(5, 9);
        let mut s = d.clone();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), 5);
        assert!(d.iter().all(|&i| i < 9));
    }

    #[test]
    fn rel_err_flags_nan_and_measures() {
        assert_eq!(rel_err(&[1.0f32, 2.0], &[1.0f32, 2.0]), 0.0);
        assert!(rel_err(&[f32::NAN, 2.0], &[1.0f32, 2.0]).is_nan());
        assert!(rel_err(&[1.0f32], &[1.0f32, 2.0]).is_nan());
        let e = rel_err(&[3.0f32, 4.0], &[3.0f32, 4.5]);
        assert!((e - 0.5 / (9.0f64 + 20.25).sqrt()).abs() < 1e-12);
        assert!(!Check::new("out", &[f32::NAN], &[1.0], 1.0).passed());
        assert!(Check::new("out", &[1.0], &[1.0], 0.0).passed());
        assert!(worse(1.0, f64::NAN).is_nan() && worse(f64::NAN, 0.0).is_nan());
    }
}
