//! Timing on the device for the kernel benchmarks (`kernels/examples/`, [`super::bench_decode`]): medians of
//! CUDA-event intervals, and the copy bandwidth that roofline fractions are measured against in the same run.

use cudarc::driver::sys::CUevent_flags;

use super::{CudaDevice, CudaError, Result};

/// Untimed launches before the timed ones.
pub const WARMUP: usize = 3;

/// Timed repeats; the median is reported.
pub const REPS: usize = 20;

/// Median milliseconds of `f` (queued on the device's stream) over [`REPS`] timed runs after [`WARMUP`] untimed ones.
pub fn median_ms(dev: &CudaDevice, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let ms = samples_ms(dev, WARMUP, REPS, |_| f())?;
    Ok(ms[ms.len() / 2])
}

/// Milliseconds of each of `reps` timed runs of `f` after `warmup` untimed ones, sorted ascending (at least one run is
/// timed). `f` gets the run's index, warm-up runs first (`0 .. warmup + reps`), so a benchmark can rotate its operands
/// between runs and measure memory rather than cache.
pub fn samples_ms(
    dev: &CudaDevice,
    warmup: usize,
    reps: usize,
    mut f: impl FnMut(usize) -> Result<()>,
) -> Result<Vec<f64>> {
    let err = |e| CudaError::Unavailable(format!("event: {e:?}"));
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    for i in 0..warmup {
        f(i)?;
    }
    let reps = reps.max(1);
    let mut ms = Vec::with_capacity(reps);
    for i in warmup..warmup + reps {
        let start = dev.stream().record_event(flags).map_err(err)?;
        f(i)?;
        let end = dev.stream().record_event(flags).map_err(err)?;
        ms.push(start.elapsed_ms(&end).map_err(err)? as f64);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms)
}

/// Device-to-device copy bandwidth in GB/s (read + write of 1 GiB, beyond L2): the denominator of "fraction of copy".
pub fn copy_bandwidth(dev: &CudaDevice) -> Result<f64> {
    let n = 1usize << 28;
    let src = dev.alloc_zeros::<f32>(n)?;
    let mut dst = dev.alloc_zeros::<f32>(n)?;
    let ms = median_ms(dev, || {
        dev.stream()
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| CudaError::Unavailable(format!("copy: {e:?}")))
    })?;
    Ok(2.0 * (n * 4) as f64 / ms / 1e6)
}
