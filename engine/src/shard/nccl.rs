//! The NCCL [`Communicator`]: one tensor-parallel rank per GPU, each on its own thread, over
//! [`rewind_kernels::cuda::nccl::NcclComm`], and [`communicator_check`], the multi-GPU check of `rewind selftest`.
//!
//! The GPU runner reduces device buffers with [`NcclCommunicator::comm`] directly; the [`Communicator`] methods stage
//! host slices through device buffers (upload, collective, synchronise, download), so host-side code written against
//! the trait (and its tests with [`super::LocalComm`]) runs unchanged on GPUs.

use std::sync::Arc;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rewind_kernels::cuda::nccl::{disable_nvls_unless_set, NcclComm, NcclId};
use rewind_kernels::cuda::parity::{rel_err, worse};
use rewind_kernels::cuda::{bf16, device_count, CudaDevice, CudaError};

use super::comm::{Communicator, LocalComm};
use crate::error::{EngineError, Result};

/// A rank's [`Communicator`] on one GPU.
pub struct NcclCommunicator {
    dev: Arc<CudaDevice>,
    comm: NcclComm,
}

impl NcclCommunicator {
    /// Wraps `comm`, which must have been initialised on `dev`.
    pub fn new(dev: Arc<CudaDevice>, comm: NcclComm) -> Self {
        Self { dev, comm }
    }

    /// The device-side communicator (collectives on device buffers, enqueued on the device stream).
    pub fn comm(&self) -> &NcclComm {
        &self.comm
    }

    /// The rank's GPU.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    fn err(&self, op: &'static str) -> impl FnOnce(CudaError) -> EngineError {
        let (rank, world) = (self.comm.rank(), self.comm.world());
        move |e| EngineError::Communicator(format!("{op} on rank {rank} of {world}: {e}"))
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.world()
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        if self.comm.world() == 1 || buf.is_empty() {
            return Ok(());
        }
        let mut staged = self.dev.upload(buf).map_err(self.err("all_reduce_sum"))?;
        self.comm
            .all_reduce_sum_f32(&mut staged)
            .map_err(self.err("all_reduce_sum"))?;
        // `download` synchronises the stream, which also surfaces an asynchronous NCCL failure here.
        let out = self.dev.download(&staged).map_err(self.err("all_reduce_sum"))?;
        buf.copy_from_slice(&out);
        Ok(())
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        let world = self.comm.world();
        if recv.len() != send.len() * world {
            return Err(EngineError::Communicator(format!(
                "all_gather on rank {}: receive buffer holds {} elements, expected {} · {world}",
                self.comm.rank(),
                recv.len(),
                send.len()
            )));
        }
        if world == 1 || send.is_empty() {
            recv.copy_from_slice(send);
            return Ok(());
        }
        let staged = self.dev.upload(send).map_err(self.err("all_gather"))?;
        let mut gathered = self.dev.alloc::<f32>(recv.len()).map_err(self.err("all_gather"))?;
        self.comm
            .all_gather_f32(&staged, &mut gathered)
            .map_err(self.err("all_gather"))?;
        let out = self.dev.download(&gathered).map_err(self.err("all_gather"))?;
        recv.copy_from_slice(&out);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        if self.comm.world() == 1 {
            return Ok(());
        }
        // NCCL has no barrier: a one-element all-reduce, waited for, is one.
        let mut token = self.dev.upload(&[1.0f32]).map_err(self.err("barrier"))?;
        self.comm.all_reduce_sum_f32(&mut token).map_err(self.err("barrier"))?;
        self.dev.synchronize().map_err(self.err("barrier"))
    }
}

/// Outcome of [`communicator_check`]. Errors are `‖out − ref‖ / ‖ref‖` against f64 host sums, worst over the ranks.
#[derive(Clone, Debug)]
pub struct CommCheckReport {
    /// Ranks (GPUs 0..gpus).
    pub gpus: usize,
    /// Elements each rank contributes to each collective.
    pub elements: usize,
    /// [`Communicator::all_reduce_sum`] (host slices staged through the device).
    pub all_reduce_rel_err: f64,
    /// Elements of [`Communicator::all_gather`]'s output that differ bitwise from the inputs (a gather is a copy).
    pub all_gather_mismatches: usize,
    /// [`NcclComm::all_reduce_sum_f32`] on a device sub-view in the middle of a larger buffer.
    pub subview_rel_err: f64,
    /// Whether the elements around that sub-view came back bit-identical.
    pub subview_padding_intact: bool,
    /// [`NcclComm::all_reduce_sum_bf16`] against the f64 sum of the bf16 inputs.
    pub bf16_rel_err: f64,
    /// Whether every rank ended each all-reduce with bitwise the same values (NCCL's contract).
    pub ranks_agree: bool,
    /// Wall time of the whole check: opening the devices, joining the group, the collectives.
    pub seconds: f64,
}

impl CommCheckReport {
    /// Largest accepted f32 error (f32 sums in another order than the host's f64 sum).
    pub const F32_THRESHOLD: f64 = 1e-6;
    /// Largest accepted bf16 error (each step of the reduction rounds to bf16, 2⁻⁹ relative per step).
    pub const BF16_THRESHOLD: f64 = 1e-2;

    /// Whether every part of the check is within its threshold.
    pub fn passed(&self) -> bool {
        let within = |e: f64, t: f64| e.is_finite() && e <= t;
        within(self.all_reduce_rel_err, Self::F32_THRESHOLD)
            && within(self.subview_rel_err, Self::F32_THRESHOLD)
            && within(self.bf16_rel_err, Self::BF16_THRESHOLD)
            && self.all_gather_mismatches == 0
            && self.subview_padding_intact
            && self.ranks_agree
    }
}

/// Elements left untouched on each side of the sub-view.
const PAD: usize = 37;

/// One rank's random inputs.
struct RankInputs {
    reduce: Vec<f32>,
    gather: Vec<f32>,
    /// `PAD + elements + PAD`; the middle is reduced.
    padded: Vec<f32>,
    bf16: Vec<bf16>,
}

/// What a rank read back.
struct RankOutputs {
    reduce: Vec<f32>,
    gather: Vec<f32>,
    padded: Vec<f32>,
    bf16: Vec<f32>,
}

fn rank_inputs(rank: usize, elements: usize) -> RankInputs {
    let mut rng = ChaCha8Rng::seed_from_u64(0x6e63_636c ^ rank as u64);
    let mut vec = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
    let reduce = vec(elements);
    let gather = vec(elements);
    let padded = vec(elements + 2 * PAD);
    let bf16 = vec(elements).into_iter().map(bf16::from_f32).collect();
    RankInputs {
        reduce,
        gather,
        padded,
        bf16,
    }
}

/// Opens GPU `rank`, joins the group and runs every collective of the check through the trait and on device buffers.
fn run_rank(
    rank: usize,
    gpus: usize,
    id: Option<&NcclId>,
    rendezvous: &LocalComm,
    inputs: &RankInputs,
) -> Result<RankOutputs> {
    let opened = CudaDevice::open(rank).map(Arc::new);
    let dev = match opened {
        Ok(dev) => dev,
        Err(e) => {
            // The other ranks must not enter NCCL initialisation, which would wait for this rank forever.
            rendezvous.abort(&format!("cannot open GPU {rank}: {e}"));
            return Err(EngineError::Communicator(format!(
                "rank {rank}: cannot open GPU {rank}: {e}"
            )));
        }
    };
    rendezvous.barrier()?;
    let comm = match id {
        Some(id) => NcclComm::init(&dev, rank, gpus, id),
        None => Ok(NcclComm::single(&dev)),
    }
    .map_err(|e| EngineError::Communicator(format!("rank {rank}: joining the NCCL group: {e}")))?;
    let c = NcclCommunicator::new(dev.clone(), comm);
    let err = |op: &'static str| c.err(op);

    let mut reduce = inputs.reduce.clone();
    c.all_reduce_sum(&mut reduce)?;
    let mut gather = vec![f32::NAN; inputs.gather.len() * gpus];
    c.all_gather(&inputs.gather, &mut gather)?;

    let mut padded_dev = dev.upload(&inputs.padded).map_err(err("sub-view all_reduce_sum_f32"))?;
    let elements = inputs.reduce.len();
    c.comm()
        .all_reduce_sum_f32(&mut padded_dev.slice_mut(PAD..PAD + elements))
        .map_err(err("sub-view all_reduce_sum_f32"))?;
    let padded = dev.download(&padded_dev).map_err(err("sub-view all_reduce_sum_f32"))?;

    let mut bf16_dev = dev.upload(&inputs.bf16).map_err(err("all_reduce_sum_bf16"))?;
    c.comm()
        .all_reduce_sum_bf16(&mut bf16_dev)
        .map_err(err("all_reduce_sum_bf16"))?;
    let bf16 = dev.download_f32(&bf16_dev).map_err(err("all_reduce_sum_bf16"))?;
    c.barrier()?;
    Ok(RankOutputs {
        reduce,
        gather,
        padded,
        bf16,
    })
}

/// Runs one rank per GPU `0..gpus`, each on its own thread with its own [`CudaDevice`] and [`NcclCommunicator`]:
/// `all_reduce_sum` and `all_gather` through the [`Communicator`] trait, then in-place f32 (on a sub-view) and bf16
/// all-reduces on device buffers, all on random data, compared with host results.
///
/// Sets `NCCL_NVLS_ENABLE=0` unless set, so call it before other threads read the environment. Without CUDA, NCCL or
/// enough GPUs this is an [`EngineError::Communicator`] saying what is unavailable. A rank that fails after the group
/// formed can leave the others waiting inside NCCL.
pub fn communicator_check(gpus: usize, elements: usize) -> Result<CommCheckReport> {
    if gpus == 0 || elements == 0 {
        return Err(EngineError::InvalidInput(format!(
            "communicator check: needs at least one GPU and one element, got {gpus} GPU(s) × {elements} elements"
        )));
    }
    let unavailable = |e: CudaError| EngineError::Communicator(format!("communicator check: {e}"));
    disable_nvls_unless_set();
    let visible = device_count().map_err(unavailable)?;
    if visible < gpus {
        return Err(EngineError::Communicator(format!(
            "communicator check: {gpus} GPUs requested, {visible} visible"
        )));
    }
    let id = if gpus > 1 {
        Some(NcclId::new().map_err(unavailable)?)
    } else {
        None
    };
    let inputs: Vec<RankInputs> = (0..gpus).map(|r| rank_inputs(r, elements)).collect();
    let t0 = Instant::now();
    let outputs: Vec<Result<RankOutputs>> = std::thread::scope(|s| {
        let handles: Vec<_> = LocalComm::group(gpus)
            .into_iter()
            .zip(&inputs)
            .enumerate()
            .map(|(rank, (rendezvous, input))| {
                let id = id.as_ref();
                s.spawn(move || run_rank(rank, gpus, id, &rendezvous, input))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join()
                    .unwrap_or_else(|_| Err(EngineError::Communicator(format!("rank {rank} panicked"))))
            })
            .collect()
    });
    let seconds = t0.elapsed().as_secs_f64();
    let outputs = outputs.into_iter().collect::<Result<Vec<_>>>()?;
    Ok(compare(&inputs, &outputs, elements, seconds))
}

fn sum_f64(inputs: &[RankInputs], value: impl Fn(&RankInputs, usize) -> f64, elements: usize) -> Vec<f64> {
    (0..elements)
        .map(|i| inputs.iter().map(|r| value(r, i)).sum())
        .collect()
}

fn compare(inputs: &[RankInputs], outputs: &[RankOutputs], elements: usize, seconds: f64) -> CommCheckReport {
    let reduce_ref = sum_f64(inputs, |r, i| f64::from(r.reduce[i]), elements);
    let padded_ref = sum_f64(inputs, |r, i| f64::from(r.padded[PAD + i]), elements);
    let bf16_ref = sum_f64(inputs, |r, i| f64::from(r.bf16[i].to_f32()), elements);
    let gather_ref: Vec<f32> = inputs.iter().flat_map(|r| r.gather.iter().copied()).collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut report = CommCheckReport {
        gpus: inputs.len(),
        elements,
        all_reduce_rel_err: 0.0,
        all_gather_mismatches: 0,
        subview_rel_err: 0.0,
        subview_padding_intact: true,
        bf16_rel_err: 0.0,
        ranks_agree: true,
        seconds,
    };
    for (input, out) in inputs.iter().zip(outputs) {
        report.all_reduce_rel_err = worse(report.all_reduce_rel_err, rel_err(&out.reduce, &reduce_ref));
        report.subview_rel_err = worse(
            report.subview_rel_err,
            rel_err(&out.padded[PAD..PAD + elements], &padded_ref),
        );
        report.bf16_rel_err = worse(report.bf16_rel_err, rel_err(&out.bf16, &bf16_ref));
        report.all_gather_mismatches += out
            .gather
            .iter()
            .zip(&gather_ref)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let (head, tail) = (&out.padded[..PAD], &out.padded[PAD + elements..]);
        report.subview_padding_intact &=
            bits(head) == bits(&input.padded[..PAD]) && bits(tail) == bits(&input.padded[PAD + elements..]);
        let first = &outputs[0];
        report.ranks_agree &= bits(&out.reduce) == bits(&first.reduce)
            && bits(&out.padded)[PAD..PAD + elements] == bits(&first.padded)[PAD..PAD + elements]
            && bits(&out.bf16) == bits(&first.bf16);
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver, NCCL or two GPUs (CI) the check is an error naming what is missing, never a panic; where two
    /// GPUs exist it must pass.
    #[test]
    fn check_fails_cleanly_without_gpus_and_passes_with_them() {
        match communicator_check(2, 1000) {
            Ok(r) => assert!(r.passed(), "{r:?}"),
            Err(EngineError::Communicator(msg)) => {
                let gpus = device_count().unwrap_or(0);
                assert!(gpus < 2 || rewind_kernels::cuda::nccl::probe_nccl().is_err(), "{msg}");
                assert!(msg.contains("unavailable") || msg.contains("visible"), "{msg}");
            }
            Err(e) => panic!("expected a communicator error, got {e}"),
        }
        assert!(matches!(communicator_check(0, 10), Err(EngineError::InvalidInput(_))));
        assert!(matches!(communicator_check(1, 0), Err(EngineError::InvalidInput(_))));
    }

    /// The comparison itself catches a wrong sum, a wrong gather, touched padding and disagreeing ranks.
    #[test]
    fn comparison_detects_each_kind_of_fault() {
        let (gpus, elements) = (3, 50);
        let inputs: Vec<RankInputs> = (0..gpus).map(|r| rank_inputs(r, elements)).collect();
        let sum = |f: &dyn Fn(&RankInputs, usize) -> f32| -> Vec<f32> {
            (0..elements).map(|i| inputs.iter().map(|r| f(r, i)).sum()).collect()
        };
        let reduce = sum(&|r, i| r.reduce[i]);
        let middle = sum(&|r, i| r.padded[PAD + i]);
        let bf16_sum = sum(&|r, i| r.bf16[i].to_f32());
        let good = |input: &RankInputs| {
            let mut padded = input.padded.clone();
            padded[PAD..PAD + elements].copy_from_slice(&middle);
            RankOutputs {
                reduce: reduce.clone(),
                gather: inputs.iter().flat_map(|r| r.gather.clone()).collect(),
                padded,
                bf16: bf16_sum.iter().map(|&x| bf16::from_f32(x).to_f32()).collect(),
            }
        };
        let outputs: Vec<RankOutputs> = inputs.iter().map(good).collect();
        let r = compare(&inputs, &outputs, elements, 0.0);
        assert!(r.passed(), "{r:?}");
        assert!(r.bf16_rel_err > 0.0 && r.all_reduce_rel_err < 1e-6);

        let faults: [&dyn Fn(&mut RankOutputs); 4] = [
            &|o| o.reduce[3] += 0.01,
            &|o| o.gather.swap(0, elements),
            &|o| o.padded[PAD - 1] += 1.0,
            &|o| o.bf16[7] = -o.bf16[7],
        ];
        for (k, fault) in faults.iter().enumerate() {
            let mut outputs: Vec<RankOutputs> = inputs.iter().map(good).collect();
            fault(&mut outputs[1]);
            let r = compare(&inputs, &outputs, elements, 0.0);
            assert!(!r.passed(), "fault {k} went unnoticed: {r:?}");
        }
        // A rank off by one ulp is within tolerance but breaks agreement.
        let mut outputs: Vec<RankOutputs> = inputs.iter().map(good).collect();
        outputs[2].reduce[0] = f32::from_bits(outputs[2].reduce[0].to_bits() + 1);
        let r = compare(&inputs, &outputs, elements, 0.0);
        assert!(!r.ranks_agree && !r.passed());
    }
}
