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

/// Read-only bandwidth in GB/s (1 GiB read once in 16-byte loads, beyond L2; `read_probe` in `kernels/probe.cu`): what
/// a kernel that streams state without writing it (a replay step) can approach, beside [`copy_bandwidth`].
pub fn read_bandwidth(dev: &CudaDevice) -> Result<f64> {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    let n = 1usize << 28;
    let src = dev.alloc_zeros::<f32>(n)?;
    let out = dev.alloc_zeros::<f32>(1)?;
    let n4 = (n / 4) as u64;
    let func = dev.function("read_probe")?;
    let cfg = LaunchConfig {
        grid_dim: (8 * dev.sm_count() as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let ms = median_ms(dev, || {
        let mut b = dev.stream().launch_builder(func);
        b.arg(&src).arg(&n4).arg(&out);
        // SAFETY: `src` holds n4 16-byte elements and `out` one float, as read_probe's signature reads them.
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| CudaError::Unavailable(format!("read probe: {e:?}")))
    })?;
    Ok((n * 4) as f64 / ms / 1e6)
}

/// Events recorded on a device's stream between the stages of a step (a profiling aid: `rewind bench
/// --stage-profile`), resolved to durations once the step's work is done. Each stage's time is the interval from the
/// previous mark (or [`StageMarks::begin`]) to its own; creating and recording events costs a few microseconds of host
/// time each, and a stage that overlaps the next on the device (it does not: the stream is in order) would blur.
#[derive(Default)]
pub struct StageMarks {
    start: Option<cudarc::driver::CudaEvent>,
    marks: Vec<(&'static str, cudarc::driver::CudaEvent)>,
}

impl StageMarks {
    /// Starts a step's marks (dropping any unresolved ones).
    pub fn begin(&mut self, dev: &CudaDevice) -> Result<()> {
        self.marks.clear();
        self.start = Some(record(dev)?);
        Ok(())
    }

    /// Ends the stage named `label` at the work queued so far.
    pub fn mark(&mut self, dev: &CudaDevice, label: &'static str) -> Result<()> {
        if self.start.is_none() {
            return Err(CudaError::Shape {
                op: "stage_marks",
                message: format!("stage `{label}` marked before the step began"),
            });
        }
        self.marks.push((label, record(dev)?));
        Ok(())
    }

    /// Waits for the last mark and returns each stage's milliseconds in order; empty when nothing was marked.
    pub fn finish(&mut self) -> Result<Vec<(&'static str, f64)>> {
        let err = |source| CudaError::Driver {
            context: "timing a stage".into(),
            source,
        };
        let Some(mut prev) = self.start.take() else {
            return Ok(Vec::new());
        };
        let mut out = Vec::with_capacity(self.marks.len());
        for (label, ev) in self.marks.drain(..) {
            out.push((label, prev.elapsed_ms(&ev).map_err(err)? as f64));
            prev = ev;
        }
        Ok(out)
    }
}

fn record(dev: &CudaDevice) -> Result<cudarc::driver::CudaEvent> {
    dev.stream()
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|source| CudaError::Driver {
            context: "recording a stage event".into(),
            source,
        })
}
