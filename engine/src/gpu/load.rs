//! Loading a model onto GPUs ([`GpuLauncher`], and [`gpu_group`], its [`RankGroup`]): one rank thread per GPU opens its device, joins the NCCL group,
//! loads its shard block by block, measures what fits, agrees with the other ranks on the pool sizes (the smallest
//! KV capacity of any rank) and allocates.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use half::bf16;
use rewind_kernels::cuda::CudaDevice;
use tracing::info;

use super::loaded::{Capacity, LoadedRank};
use super::options::{GpuDtype, GpuOptions};
use super::rank::RunOptions;
use super::scratch::StepRows;
use super::state::{PoolSizes, ReplaySettings, BLOCK_SIZE};
use super::{Act, DeviceComm};
use crate::error::{EngineError, Result};
use crate::model::config::ModelConfig;
use crate::rank::{Abort, Launch, Launcher, Rank, RankGroup, RankLoader};
use crate::shard::{Communicator, LocalComm};
use rewind_kernels::cuda::ops::REPLAY_MAX_T;

/// What loading found, for logs and reports.
#[derive(Clone, Debug)]
pub struct GpuReport {
    /// Device names, per rank.
    pub devices: Vec<String>,
    pub sizes: PoolSizes,
    /// Per rank: bytes of weights (and runtime), state pools, activations; total device memory.
    pub weight_bytes: Vec<usize>,
    pub state_bytes: Vec<usize>,
    pub scratch_bytes: Vec<usize>,
    /// Per rank: bytes set aside for the prefix cache's stored states.
    pub store_bytes: Vec<usize>,
    pub total_bytes: Vec<usize>,
}

/// What one rank found while loading: its device's name, its capacity and the agreed pool sizes.
type RankReport = (String, Capacity, PoolSizes);

/// Checks the options against the model and the machine before any rank starts.
fn check_options(config: &ModelConfig, opts: &GpuOptions) -> Result<()> {
    let tp = opts.devices.len();
    if tp == 0 {
        return Err(EngineError::InvalidInput("no GPU given".into()));
    }
    if !(opts.gpu_memory_fraction > 0.0 && opts.gpu_memory_fraction <= 1.0) {
        return Err(EngineError::InvalidInput(format!(
            "--gpu-memory-fraction {} is outside (0, 1]",
            opts.gpu_memory_fraction
        )));
    }
    if opts.max_seqs == 0 || opts.prefill_chunk == 0 {
        return Err(EngineError::InvalidInput(
            "--max-seqs and the prefill chunk must be positive".into(),
        ));
    }
    if opts.buffer_len < 2 {
        return Err(EngineError::InvalidInput(format!(
            "--buffer-len {} is below 2",
            opts.buffer_len
        )));
    }
    if opts.max_verify == 0 || opts.max_verify > REPLAY_MAX_T || 2 * opts.max_verify > opts.buffer_len {
        return Err(EngineError::InvalidInput(format!(
            "the verify window {} must lie in 1..={} and at most half the buffer length {}",
            opts.max_verify,
            REPLAY_MAX_T.min(opts.buffer_len / 2),
            opts.buffer_len
        )));
    }
    if opts.stage_profile && opts.cuda_graphs {
        return Err(EngineError::InvalidInput(
            "the stage profile times each stage between eager launches, and a captured CUDA graph replays a whole \
             step as one launch: add --no-cuda-graphs"
                .into(),
        ));
    }
    if let Some(n) = opts.max_model_len {
        if n == 0 || n > config.max_position_embeddings {
            return Err(EngineError::InvalidInput(format!(
                "--max-model-len {n} is outside 1..={} (the model's max_position_embeddings)",
                config.max_position_embeddings
            )));
        }
    }
    let visible = rewind_kernels::cuda::device_count()?;
    if let Some(&bad) = opts.devices.iter().find(|&&d| d >= visible) {
        return Err(EngineError::Gpu(format!(
            "GPU {bad} requested, {visible} visible{}",
            if tp > 1 {
                format!(" (--tp {tp} needs {tp} GPUs)")
            } else {
                String::new()
            }
        )));
    }
    Ok(())
}

/// A `u64` as two f32 values that are exact (24-bit halves), for the host rendezvous.
fn split_u64(v: u64) -> [f32; 2] {
    [(v >> 24) as f32, (v & 0xFF_FFFF) as f32]
}

fn join_u64(v: &[f32]) -> u64 {
    ((v[0] as u64) << 24) | v[1] as u64
}

/// Loads the checkpoint in `dir` onto `opts.devices` (one tensor-parallel rank each) and sizes the pools.
pub fn gpu_group(dir: &Path, opts: &GpuOptions) -> Result<(RankGroup, GpuReport)> {
    let launcher = GpuLauncher::new(dir, opts)?;
    let group = RankGroup::start(&launcher)?;
    let report = launcher.report()?;
    Ok((group, report))
}

/// Starts generations of GPU ranks: each launch makes a fresh NCCL id (under tensor parallelism) and host
/// rendezvous, and each rank opens its device, joins the group, loads its shard and sizes its pools on its own thread.
///
/// Aborting a generation wakes ranks waiting in the host rendezvous and aborts every rank's NCCL communicator
/// (`ncclCommAbort` through [`rewind_kernels::cuda::nccl::NcclAbort`]), so a rank waiting on the device for a peer
/// that panicked, failed or hangs gets its collective back and its thread ends.
pub struct GpuLauncher {
    dir: PathBuf,
    opts: GpuOptions,
    max_len: usize,
    rows: StepRows,
    replay: ReplaySettings,
    reports: Arc<Mutex<Vec<Option<RankReport>>>>,
}

impl GpuLauncher {
    /// A launcher for the checkpoint in `dir` with `opts`, checked against the model and the machine.
    pub fn new(dir: &Path, opts: &GpuOptions) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        check_options(&config, opts)?;
        let max_len = opts
            .max_model_len
            .unwrap_or(config.max_position_embeddings.min(32_768))
            .min(config.max_position_embeddings)
            .next_multiple_of(BLOCK_SIZE);
        let replay = ReplaySettings {
            buffer_len: opts.buffer_len,
            max_verify: opts.max_verify,
            threshold: opts
                .kv_only_threshold
                .unwrap_or_else(|| crate::state::memory::kv_only_threshold(&config)),
            recurrent_verify: opts.recurrent_verify,
        };
        Ok(GpuLauncher {
            dir: dir.to_path_buf(),
            opts: opts.clone(),
            max_len,
            replay,
            rows: StepRows::new(opts.prefill_chunk, opts.max_seqs, opts.max_verify),
            reports: Arc::new(Mutex::new(vec![None; opts.devices.len()])),
        })
    }

    /// What the latest generation's ranks found while loading.
    pub fn report(&self) -> Result<GpuReport> {
        let all = self
            .reports
            .lock()
            .map_err(|_| EngineError::Gpu("the load reports were poisoned".into()))?
            .clone();
        let all: Vec<RankReport> = all.into_iter().flatten().collect();
        let sizes = all
            .first()
            .map(|r| r.2)
            .ok_or_else(|| EngineError::Gpu("no rank reported".into()))?;
        info!(?sizes, tp = self.opts.devices.len(), "GPU model loaded");
        Ok(GpuReport {
            devices: all.iter().map(|r| r.0.clone()).collect(),
            sizes,
            weight_bytes: all.iter().map(|r| r.1.weight_bytes).collect(),
            state_bytes: all.iter().map(|r| r.1.state_bytes).collect(),
            scratch_bytes: all.iter().map(|r| r.1.scratch_bytes).collect(),
            store_bytes: all.iter().map(|r| r.1.store_bytes).collect(),
            total_bytes: all.iter().map(|r| r.1.total_bytes).collect(),
        })
    }
}

impl Launcher for GpuLauncher {
    fn tp(&self) -> usize {
        self.opts.devices.len()
    }

    fn name(&self) -> &str {
        "gpu-rank"
    }

    fn launch(&self) -> Result<Launch> {
        let tp = self.tp();
        let nccl_id = if tp > 1 {
            rewind_kernels::cuda::nccl::disable_nvls_unless_set();
            Some(rewind_kernels::cuda::nccl::NcclId::new()?)
        } else {
            None
        };
        // The ranks agree on the pool sizes through a host rendezvous (a rank that fails aborts it, so none waits).
        let meet = LocalComm::group(tp);
        let abort = Abort::new();
        abort.on_abort(meet[0].abort_handle());
        let meet = Arc::new(Mutex::new(meet.into_iter().map(Some).collect::<Vec<_>>()));
        if let Ok(mut r) = self.reports.lock() {
            r.iter_mut().for_each(|x| *x = None);
        }
        let reports = self.reports.clone();
        let (dir, devices, dtype) = (self.dir.clone(), self.opts.devices.clone(), self.opts.dtype);
        let store = self.opts.prefix_store;
        let (fraction, max_seqs, max_len, rows, replay, graphs, stage_profile, mtp) = (
            self.opts.gpu_memory_fraction,
            self.opts.max_seqs,
            self.max_len,
            self.rows,
            self.replay,
            self.opts.cuda_graphs,
            self.opts.stage_profile,
            (self.opts.mtp, self.opts.time_mtp),
        );
        let generation = abort.clone();
        let load: RankLoader = Arc::new(move |rank| {
            let comm = meet
                .lock()
                .map_err(|_| EngineError::Communicator("the rendezvous handles were poisoned".into()))?
                .get_mut(rank)
                .and_then(Option::take)
                .ok_or_else(|| EngineError::Communicator(format!("no rendezvous handle for rank {rank}")))?;
            let setup = Setup {
                ordinal: devices[rank],
                rank,
                tp,
                id: nccl_id,
                dir: &dir,
                fraction,
                max_seqs,
                max_len,
                rows,
                replay,
                graphs,
                stage_profile,
                mtp: mtp.0,
                time_mtp: mtp.1,
                store,
            };
            let (r, report) = match dtype {
                GpuDtype::Bf16 => setup.build::<bf16>(&comm, &generation),
                GpuDtype::F32 => setup.build::<f32>(&comm, &generation),
            }?;
            if let Ok(mut all) = reports.lock() {
                all[rank] = Some(report);
            }
            Ok(r)
        });
        Ok(Launch {
            load,
            abort,
            settle: rewind_kernels::cuda::nccl::settle_aborts,
        })
    }
}

/// One rank's load parameters.
struct Setup<'a> {
    ordinal: usize,
    rank: usize,
    tp: usize,
    id: Option<rewind_kernels::cuda::nccl::NcclId>,
    dir: &'a Path,
    fraction: f64,
    max_seqs: usize,
    max_len: usize,
    rows: StepRows,
    replay: ReplaySettings,
    /// Capture decode and verify steps as CUDA graphs.
    graphs: bool,
    /// Time every stage of every step (`GpuOptions::stage_profile`).
    stage_profile: bool,
    /// Load the MTP layer (`GpuOptions::mtp`), and time its work (`GpuOptions::time_mtp`).
    mtp: bool,
    time_mtp: bool,
    /// Bytes set aside for stored states (`GpuOptions::prefix_store`).
    store: u64,
}

impl Setup<'_> {
    /// Opens the GPU, joins the NCCL group, loads the shard, agrees on the KV blocks with the other ranks through
    /// `meet`, and allocates.
    ///
    /// The NCCL communicator is aborted with the generation (`abort`): a rank that panics, fails or hangs aborts it,
    /// so the other ranks' collectives waiting for it on the device return and their threads end.
    fn build<A: Act>(&self, meet: &LocalComm, abort: &Abort) -> Result<(Box<dyn Rank>, RankReport)> {
        let dev = Arc::new(CudaDevice::open(self.ordinal)?);
        let name = dev.name().to_string();
        let comm: Option<Box<dyn DeviceComm>> = match &self.id {
            Some(id) => {
                let comm = rewind_kernels::cuda::nccl::NcclComm::init(&dev, self.rank, self.tp, id)?;
                if let Some(handle) = comm.abort_handle() {
                    abort.on_abort(move |_| handle.abort());
                }
                Some(Box::new(comm))
            }
            None => None,
        };
        let loaded = LoadedRank::<A>::load(dev, comm, self.dir, self.tp, self.rank, self.mtp)?;
        let store = usize::try_from(self.store)
            .map_err(|_| EngineError::InvalidInput(format!("a prefix store of {} bytes", self.store)))?;
        let cap = loaded.capacity(
            self.fraction,
            store,
            self.max_seqs,
            self.max_len,
            self.rows,
            self.replay.rows(),
        )?;
        let mut all = vec![0.0f32; 2 * self.tp];
        meet.all_gather(&split_u64(cap.kv_blocks as u64), &mut all)?;
        let kv_blocks = all.chunks_exact(2).map(join_u64).min().unwrap_or(0) as usize;
        let sizes = PoolSizes {
            max_seqs: self.max_seqs,
            max_len: self.max_len,
            num_blocks: kv_blocks,
            rows: self.replay.rows(),
        };
        // Tensor-parallel ranks capture too: the NCCL all-reduces are captured into the graph (the communicator's
        // connections are made by the eager first sighting of each shape, and every rank captures in its own
        // thread-local capture mode, so the other ranks' uploads never touch the capture).
        let graphs = self.graphs && !loaded.dev.sync_each_launch();
        if self.graphs && !graphs {
            tracing::warn!(
                "CUDA graphs off for this rank: REWIND_CUDA_SYNC=1 synchronises after every launch, which a graph \
                 cannot capture"
            );
        }
        let rank = loaded.allocate(
            sizes,
            self.rows,
            self.replay,
            cap.attention_ws,
            RunOptions {
                graphs,
                profile: super::rank::Profiling {
                    stages: self.stage_profile,
                    mtp: self.time_mtp,
                },
                store: self.store,
            },
        )?;
        Ok((Box::new(rank), (name, cap, sizes)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stage_profile_needs_eager_launches() {
        use crate::model::{Family, ModelConfig};
        use crate::presets::{preset_config, tokenizer_vocab};
        let json = preset_config(Family::NemotronH, "tiny", None, tokenizer_vocab("tiny"), 1, 2).expect("preset");
        let config = ModelConfig::from_json(&json).expect("parse");
        let opts = GpuOptions {
            stage_profile: true,
            ..GpuOptions::default()
        };
        let e = check_options(&config, &opts).expect_err("graphs and the stage profile together");
        assert!(e.to_string().contains("--no-cuda-graphs"), "{e}");
    }

    #[test]
    fn u64_survives_the_f32_rendezvous() {
        for v in [0u64, 1, (1 << 24) - 1, 1 << 24, 123_456_789_012, (1 << 48) - 1] {
            assert_eq!(join_u64(&split_u64(v)), v);
        }
    }
}
