//! NCCL across the visible GPUs of one process: [`NcclComm`], one tensor-parallel rank's communicator (one rank per
//! GPU, each rank on its own OS thread), and the all-reduce check of `rewind selftest`.
//!
//! NVLink multicast (NVLS) stays off: `NCCL_NVLS_ENABLE=0` is set before NCCL initialises unless the caller chose a
//! value (the lent machines forbid multicast objects). Programs call [`disable_nvls_unless_set`] once at start-up,
//! before spawning rank threads.

use std::panic::catch_unwind;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{self, Comm, Id, NcclType, ReduceOp};
use half::bf16;

mod raw;
use raw::RawComm;
pub use raw::{settle_aborts, NcclAbort};

use super::device::{device_count, probe_driver, CudaDevice};
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

/// The rendezvous token of one communicator group: created once (by one thread), then cloned to every rank, which
/// passes it to [`NcclComm::init`].
#[derive(Clone, Copy, Debug)]
pub struct NcclId(Id);

impl NcclId {
    /// A fresh group id; `Unavailable` without the CUDA driver or libnccl (never panics).
    pub fn new() -> Result<Self> {
        probe_nccl()?;
        // cudarc panics when a symbol it expects is missing from the library it loaded.
        let id = catch_unwind(Id::new).map_err(|_| {
            CudaError::Unavailable("libnccl.so.2 was loaded but lacks ncclGetUniqueId (too old?)".into())
        })?;
        id.map(Self).map_err(nccl_err("ncclGetUniqueId"))
    }
}

/// One rank's NCCL communicator, bound to its device's stream: collectives are enqueued there, in stream order with the
/// rank's kernels, and return without waiting (synchronise the device to read results on the host).
///
/// Every rank must issue the same collectives in the same order with the same element counts; a rank that skips one
/// makes the others wait forever. With `world == 1` no NCCL call is made (all-reduce is a no-op, all-gather a device
/// copy), so single-GPU code paths can share the tensor-parallel ones without libnccl.
///
/// `Send` (a rank may build it on one thread and hand it to another) but not `Sync`: NCCL forbids using one
/// communicator from two threads at once.
pub struct NcclComm {
    /// `None` when `world == 1`.
    comm: Option<RawComm>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("ordinal", &self.ctx.ordinal())
            .finish()
    }
}

// SAFETY: the NCCL handle may be used from any thread as long as only one thread uses it at a time, which `!Sync` and
// the `&mut`-free API (one owner) guarantee; the context and stream handles are already `Send`.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Joins group `id` as `rank` of `world`, on `dev`'s stream. Every rank calls this concurrently from its own thread;
    /// it blocks until all `world` ranks have joined. `id` is ignored when `world == 1`.
    ///
    /// Call [`disable_nvls_unless_set`] at program start-up, before rank threads exist (it writes the environment).
    pub fn init(dev: &CudaDevice, rank: usize, world: usize, id: &NcclId) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(CudaError::Shape {
                op: "NcclComm::init",
                message: format!("rank {rank} is outside a world of {world}"),
            });
        }
        if world == 1 {
            return Ok(Self::single(dev));
        }
        probe_nccl()?;
        let ctx = dev.context().clone();
        // ncclCommInitRank sets up on the calling thread's current device.
        ctx.bind_to_thread().map_err(driver_err(format!(
            "binding GPU {} to rank {rank}'s thread",
            ctx.ordinal()
        )))?;
        let comm = RawComm::init(rank, world, &id.0)
            .map_err(nccl_err(&format!("ncclCommInitRank (rank {rank} of {world})")))?;
        Ok(Self {
            comm: Some(comm),
            ctx,
            stream: dev.stream().clone(),
            rank,
            world,
        })
    }

    /// A world of one on `dev` (no NCCL): rank 0 of 1.
    pub fn single(dev: &CudaDevice) -> Self {
        Self {
            comm: None,
            ctx: dev.context().clone(),
            stream: dev.stream().clone(),
            rank: 0,
            world: 1,
        }
    }

    /// This rank, `0..world()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Whether this rank's communicator was aborted (a world of one never is). Collectives captured in a CUDA graph
    /// return at once on the device after an abort, without their sums, so a step must check this after it ran.
    pub fn is_aborted(&self) -> bool {
        self.comm.as_ref().is_some_and(RawComm::is_aborted)
    }

    /// A handle that aborts this communicator from another thread (`None` for a world of one, which has none);
    /// see [`NcclAbort`].
    pub fn abort_handle(&self) -> Option<NcclAbort> {
        self.comm.as_ref().map(RawComm::abort_handle)
    }

    /// The stream collectives are enqueued on (the device's).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Sums `buf` over all ranks, in place (works on sub-views of larger buffers).
    pub fn all_reduce_sum_f32(&self, buf: &mut impl DevicePtrMut<f32>) -> Result<()> {
        self.all_reduce_sum(buf, "all_reduce_sum_f32")
    }

    /// Sums `buf` over all ranks, in place; NCCL accumulates each step in f32 and rounds to bf16 between steps.
    pub fn all_reduce_sum_bf16(&self, buf: &mut impl DevicePtrMut<bf16>) -> Result<()> {
        self.all_reduce_sum(buf, "all_reduce_sum_bf16")
    }

    /// Concatenates every rank's `send` in rank order into `recv` (`recv.len() == world · send.len()`, rank-major).
    pub fn all_gather_f32(&self, send: &impl DevicePtr<f32>, recv: &mut impl DevicePtrMut<f32>) -> Result<()> {
        self.all_gather(send, recv, "all_gather_f32")
    }

    /// [`NcclComm::all_gather_f32`] of 32-bit words (bit patterns, e.g. the LM head's summaries).
    pub fn all_gather_u32(&self, send: &impl DevicePtr<u32>, recv: &mut impl DevicePtrMut<u32>) -> Result<()> {
        self.all_gather(send, recv, "all_gather_u32")
    }

    fn all_gather<T: NcclType>(
        &self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        op: &'static str,
    ) -> Result<()> {
        super::check_len(op, "recv", recv.len(), self.world * send.len())?;
        if send.is_empty() {
            return Ok(());
        }
        let Some(comm) = &self.comm else {
            return self
                .stream
                .memcpy_dtod(send, recv)
                .map_err(driver_err(format!("{op}: copying a world-of-one gather")));
        };
        self.bind()?;
        let context = format!("ncclAllGather ({op}, rank {} of {})", self.rank, self.world);
        let count = send.len();
        let (src, _src_done) = send.device_ptr(&self.stream);
        let (dst, _dst_done) = recv.device_ptr_mut(&self.stream);
        let stream = self.stream.cu_stream();
        // SAFETY: both pointers are live device buffers on this rank's stream with the checked lengths; the
        // guards record their use on the stream when they drop, after the enqueue.
        let status = comm.enqueue(|c| unsafe {
            nccl::result::all_gather(src as _, dst as _, count, T::as_nccl_type(), c, stream as _)
        });
        Self::finish(status, &context)
    }

    fn all_reduce_sum<T: NcclType>(&self, buf: &mut impl DevicePtrMut<T>, op: &str) -> Result<()> {
        let Some(comm) = &self.comm else {
            return Ok(());
        };
        // A zero-length collective is skipped on every rank alike (all ranks pass equal counts).
        if buf.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let context = format!("ncclAllReduce ({op}, rank {} of {})", self.rank, self.world);
        let count = buf.len();
        let (ptr, _done) = buf.device_ptr_mut(&self.stream);
        let stream = self.stream.cu_stream();
        // SAFETY: `ptr` is a live device buffer of `count` elements on this rank's stream (in place: send = recv);
        // the guard records its use on the stream when it drops, after the enqueue.
        let status = comm.enqueue(|c| unsafe {
            nccl::result::all_reduce(
                ptr as _,
                ptr as _,
                count,
                T::as_nccl_type(),
                nccl::sys::ncclRedOp_t::ncclSum,
                c,
                stream as _,
            )
        });
        Self::finish(status, &context)
    }

    /// The outcome of an enqueue: NCCL's status, or a refusal when the communicator was aborted (a peer failed).
    fn finish(
        status: Option<std::result::Result<nccl::result::NcclStatus, nccl::result::NcclError>>,
        context: &str,
    ) -> Result<()> {
        match status {
            Some(r) => r.map(drop).map_err(nccl_err(context)),
            None => Err(CudaError::Nccl {
                context: context.to_string(),
                status: "the communicator was aborted (a rank of the group failed)".into(),
            }),
        }
    }

    /// NCCL launches on the current device; the rank's thread may have touched another context in between.
    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver_err(format!(
            "binding GPU {} to rank {}",
            self.ctx.ordinal(),
            self.rank
        )))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Without libcuda or libnccl (CI), asking for a group id is an `Unavailable` error naming the library, never a
    /// panic; with both it must succeed.
    #[test]
    fn id_is_unavailable_without_nccl() {
        match (probe_nccl(), NcclId::new()) {
            (Ok(()), id) => assert!(id.is_ok(), "NCCL loads but no id: {:?}", id.err()),
            (Err(_), Err(CudaError::Unavailable(msg))) => {
                assert!(msg.contains("libnccl") || msg.contains("libcuda"), "{msg}");
            }
            (Err(_), other) => panic!("expected Unavailable, got {other:?}"),
        }
    }

    /// A rank outside its world is refused before any library is touched.
    #[test]
    fn init_rejects_a_rank_outside_the_world() {
        let Ok(dev) = CudaDevice::open(0) else {
            // No GPU here: the check happens before the device is used, but it needs a device to be called at all.
            assert!(device_count().is_err() || device_count().is_ok_and(|n| n == 0));
            return;
        };
        let id = NcclId(Id::uninit([0; 128]));
        assert!(matches!(NcclComm::init(&dev, 2, 2, &id), Err(CudaError::Shape { .. })));
        assert!(matches!(NcclComm::init(&dev, 0, 0, &id), Err(CudaError::Shape { .. })));
        let solo = NcclComm::init(&dev, 0, 1, &id).expect("a world of one needs no NCCL");
        assert_eq!((solo.rank(), solo.world()), (0, 1));
    }
}
