//! NCCL across the visible GPUs of one process: the all-reduce check of `rewind selftest`.
//!
//! NVLink multicast (NVLS) stays off: `NCCL_NVLS_ENABLE=0` is set before NCCL initialises unless the caller chose a
//! value (the lent machines forbid multicast objects).

use std::time::Instant;

use cudarc::driver::CudaContext;
use cudarc::nccl::{self, Comm, ReduceOp};

use super::device::{device_count, probe_driver};
use super::parity::Rng;
use super::{driver_err, CudaError, Result};

fn nccl_err(context: &str) -> impl FnOnce(nccl::result::NcclError) -> CudaError + '_ {
    move |e| CudaError::Nccl {
        context: context.to_string(),
        status: format!("{:?}", e.0),
    }
}

/// Checks that libnccl can be opened.
pub fn probe_nccl() -> Result<()> {
    probe_driver()?;
    // SAFETY: only tries to dlopen the library.
    if unsafe { nccl::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::Unavailable(
            "NCCL (libnccl.so.2) cannot be loaded; put its directory (e.g. /usr/lib/x86_64-linux-gnu) on LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

/// Sets `NCCL_NVLS_ENABLE=0` unless it is already set. Call before any thread of the process may read the
/// environment concurrently (at start-up).
pub fn disable_nvls_unless_set() {
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
}

/// Outcome of [`all_reduce_check`].
#[derive(Clone, Debug)]
pub struct AllReduceReport {
    /// GPUs in the communicator.
    pub gpus: usize,
    /// Elements per GPU.
    pub elements: usize,
    /// `‖out − ref‖ / ‖ref‖`, worst over the ranks, against the host sum.
    pub rel_err: f64,
    /// Wall time of the all-reduce itself (after communicator set-up), in seconds.
    pub seconds: f64,
}

/// A sum all-reduce of `elements` random f32 values across every visible GPU (at least 2), compared on the host with
/// the f64 sum of the inputs.
pub fn all_reduce_check(elements: usize, seed: u64) -> Result<AllReduceReport> {
    disable_nvls_unless_set();
    probe_nccl()?;
    let gpus = device_count()?;
    if gpus < 2 {
        return Err(CudaError::Unavailable(format!(
            "the all-reduce check needs at least 2 GPUs, {gpus} visible"
        )));
    }
    let mut streams = Vec::with_capacity(gpus);
    for i in 0..gpus {
        let ctx = CudaContext::new(i).map_err(driver_err(format!("creating a context on GPU {i}")))?;
        streams.push(
            ctx.new_stream()
                .map_err(driver_err(format!("creating a stream on GPU {i}")))?,
        );
    }
    let comms = Comm::from_devices(streams.clone()).map_err(nccl_err("ncclCommInitAll"))?;
    let mut rng = Rng::new(seed);
    let inputs: Vec<Vec<f32>> = (0..gpus).map(|_| rng.uniform_vec(elements, 1.0)).collect();
    let mut bufs = Vec::with_capacity(gpus);
    for (s, data) in streams.iter().zip(&inputs) {
        bufs.push(s.clone_htod(data).map_err(driver_err("copying all-reduce inputs"))?);
    }
    for s in &streams {
        s.synchronize().map_err(driver_err("uploading all-reduce inputs"))?;
    }
    let t0 = Instant::now();
    nccl::result::group_start().map_err(nccl_err("ncclGroupStart"))?;
    let mut queued = Ok(());
    for (comm, buf) in comms.iter().zip(bufs.iter_mut()) {
        if let Err(e) = comm.all_reduce_in_place(buf, &ReduceOp::Sum) {
            queued = Err(nccl_err("ncclAllReduce")(e));
            break;
        }
    }
    // The group must be closed even when a call inside it failed.
    let ended = nccl::result::group_end().map_err(nccl_err("ncclGroupEnd"));
    queued?;
    ended?;
    for s in &streams {
        s.synchronize().map_err(driver_err("waiting for the all-reduce"))?;
    }
    let seconds = t0.elapsed().as_secs_f64();
    let reference: Vec<f64> = (0..elements)
        .map(|i| inputs.iter().map(|v| f64::from(v[i])).sum())
        .collect();
    let mut worst = 0.0f64;
    for (s, buf) in streams.iter().zip(&bufs) {
        let out = s.clone_dtoh(buf).map_err(driver_err("copying all-reduce results"))?;
        s.synchronize().map_err(driver_err("copying all-reduce results"))?;
        let out: Vec<f64> = out.into_iter().map(f64::from).collect();
        let e = super::parity::rel_err(&out, &reference);
        worst = super::parity::worse(worst, e);
    }
    Ok(AllReduceReport {
        gpus,
        elements,
        rel_err: worst,
        seconds,
    })
}
