//! The one place the commands choose a backend: the model in `dir` as a [`Launcher`] of CPU ranks (`--tp` rank
//! threads) or GPU ranks, which a command either starts as a synchronous [`RankGroup`] (`logits`, `perplexity`, the
//! batched-step bench) or hands to the serving engine ([`start_engine`]: `generate`, the serving bench).

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use rewind_actors::{EngineConfig, EngineHandle};
use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::model::ModelConfig;
use rewind_engine::rank::{CpuLauncher, CpuOptions, FaultSpec, Launcher, RankGroup};

use crate::cli::{DecodeArgs, Device, DeviceArgs, EngineArgs};
use crate::output::errln;

/// What a command needs of the pools.
#[derive(Clone, Copy, Debug)]
pub struct Needs {
    /// Sequences alive at once.
    pub slots: usize,
    /// The longest context any of them reaches.
    pub context: usize,
    /// The most tokens one verify takes (1 + the speculation window; 1 without speculation).
    pub verify: usize,
    /// Speculation drafts with the checkpoint's MTP layer: ranks that can run it load it.
    pub mtp: bool,
    /// Bytes each GPU sets aside for the prefix cache's stored states ([`prefix_store`]; 0: none). CPU ranks keep
    /// theirs in host memory within the same budget, counted by the cache itself.
    pub prefix_store: u64,
    /// GPU ranks time their MTP work with CUDA events (`GpuOptions::time_mtp`; `rewind bench --mtp-draft`).
    pub time_mtp: bool,
}

/// A model's ranks, ready to start, with the decode form its sequences use.
pub struct Backend {
    pub launcher: Arc<dyn Launcher>,
    pub config: ModelConfig,
    pub form: FormChoice,
    /// The ranks loaded the MTP layer and draft with it (`--spec mtp`).
    pub mtp_on_ranks: bool,
    /// Prints what a GPU load placed where (after the ranks have started).
    #[cfg(feature = "cuda")]
    gpu: Option<(Arc<rewind_engine::gpu::GpuLauncher>, DeviceArgs)>,
    cpu_device: Option<String>,
    /// CPU ranks: the `rewind rank-worker` arguments that load the same ranks one per worker process.
    worker_args: Option<Vec<String>>,
}

impl Backend {
    /// The ranks as worker processes of this executable (`--rank-processes`), or why they cannot be.
    pub fn rank_processes(&self) -> Result<rewind_actors::rank_process::RankProcesses> {
        // `serve` refuses --rank-processes on GPUs before anything loads, with the reason.
        let args = self
            .worker_args
            .clone()
            .ok_or_else(|| anyhow::anyhow!("GPU ranks have no worker-process command"))?;
        let program = std::env::current_exe().context("finding this executable to start rank workers")?;
        Ok(rewind_actors::rank_process::RankProcesses::new(
            program,
            args,
            self.launcher.tp(),
        ))
    }

    /// Whether the ranks are GPUs.
    pub fn on_gpu(&self) -> bool {
        self.cpu_device.is_none()
    }

    /// What a GPU load placed where (after the ranks have started); `None` on the CPU.
    #[cfg(feature = "cuda")]
    pub fn gpu_report(&self) -> Result<Option<rewind_engine::gpu::GpuReport>> {
        Ok(self.gpu.as_ref().map(|(g, _)| g.report()).transpose()?)
    }

    /// The device, in words, after the ranks have started (a GPU's load report is printed too).
    pub fn started(&self, t0: std::time::Instant) -> Result<String> {
        #[cfg(feature = "cuda")]
        if let Some((g, d)) = &self.gpu {
            return super::gpu::report(&g.report()?, d, self.launcher.tp(), t0);
        }
        let _ = t0;
        Ok(self.cpu_device.clone().unwrap_or_default())
    }
}

/// A model loaded on its device as a synchronous rank group.
pub struct Loaded {
    pub group: RankGroup,
    pub config: ModelConfig,
    pub form: FormChoice,
    /// The device, in words (for reports).
    pub device: String,
}

/// The model in `dir` where `device` says, sized for `needs`, with `decode`'s form and ring length (default form
/// `auto`: kv-only while the context is short, then replay, on the CPU and on GPUs).
pub fn backend(dir: &Path, device: &DeviceArgs, decode: Option<&DecodeArgs>, needs: Needs) -> Result<Backend> {
    // The flags are checked before anything is read.
    let which = device.device()?;
    let config = ModelConfig::from_dir(dir)?;
    // Before any rank (a thread on the CPU, a GPU) starts: a size the model cannot split is refused with the reason.
    crate::launch::tp::check(&config, device.tp)?;
    let context = needs.context.clamp(1, config.max_position_embeddings);
    if let Some(q) = rewind_engine::checkpoint::quant::Quantization::read(dir)? {
        // Said every time: the memory and speed of a quantized checkpoint are not what its format promises yet.
        errln!(
            "rewind: {} holds {} weights: they are dequantized when loaded (f32 on the CPU, bf16 on GPUs); \
             quantized GEMMs are not built yet",
            dir.display(),
            q.describe()
        );
    }
    match which {
        Device::Cpu => {
            let mut dc = DecoderConfig::new(needs.slots.max(1), context);
            if let Some(d) = decode {
                dc.buffer_len = d.buffer_len;
            }
            dc.max_verify = needs.verify.max(1);
            let mut worker_args: Vec<String> = ["rank-worker", "--tp", &device.tp.to_string(), "--decoder"]
                .into_iter()
                .map(String::from)
                .collect();
            worker_args.push(serde_json::to_string(&dc).context("encoding the ranks' decoder settings")?);
            worker_args.push("--model".into());
            worker_args.push(dir.display().to_string());
            if needs.mtp {
                worker_args.push("--mtp".into());
            }
            let launcher = CpuLauncher::new(
                dir,
                CpuOptions {
                    tp: device.tp,
                    decoder: dc,
                },
            )?
            .with_mtp(needs.mtp);
            Ok(Backend {
                launcher: Arc::new(launcher),
                config,
                mtp_on_ranks: needs.mtp,
                form: decode.and_then(|d| d.form).unwrap_or(FormChoice::Auto),
                #[cfg(feature = "cuda")]
                gpu: None,
                cpu_device: Some(format!(
                    "cpu ({} threads, tp {})",
                    rayon::current_num_threads(),
                    device.tp
                )),
                worker_args: Some(worker_args),
            })
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(devices) => {
            let mut dargs = device.clone();
            if dargs.max_model_len.is_none() {
                dargs.max_model_len = Some(context);
            }
            dargs.max_seqs = Some(dargs.max_seqs().max(needs.slots));
            let mut opts = super::gpu::options(&dargs, devices)?;
            if let Some(d) = decode {
                opts.buffer_len = d.buffer_len;
            }
            opts.max_verify = needs.verify.max(1);
            // Only the recurrent form verifies drafts through per-draft state snapshots (T states per slot).
            opts.recurrent_verify = decode.and_then(|d| d.form) == Some(FormChoice::Recurrent);
            opts.mtp = needs.mtp;
            opts.prefix_store = needs.prefix_store;
            opts.time_mtp = needs.time_mtp;
            let g = Arc::new(rewind_engine::gpu::GpuLauncher::new(dir, &opts)?);
            Ok(Backend {
                launcher: g.clone(),
                config,
                mtp_on_ranks: needs.mtp,
                // kv-only while short, then replay: faster than the recurrent step from batch 64 up and within a few
                // percent of it at batch 1 (bench/results/gpu-replay-kernels-2026-11-24.md).
                form: decode.and_then(|d| d.form).unwrap_or(FormChoice::Auto),
                gpu: Some((g, dargs)),
                cpu_device: None,
                worker_args: None,
            })
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(super::no_cuda()),
    }
}

/// Loads the model in `dir` as a synchronous rank group; see [`backend`].
pub fn open(dir: &Path, device: &DeviceArgs, decode: Option<&DecodeArgs>, needs: Needs) -> Result<Loaded> {
    let b = backend(dir, device, decode, needs)?;
    let t0 = std::time::Instant::now();
    let group = RankGroup::start(b.launcher.as_ref())?;
    let device = b.started(t0)?;
    Ok(Loaded {
        group,
        config: b.config,
        form: b.form,
        device,
    })
}

/// The prefix cache the flags ask for whatever the device (`None`: `--no-enable-prefix-caching`), checked.
pub fn prefix_cache_config(args: &EngineArgs) -> Result<Option<rewind_actors::PrefixCacheConfig>> {
    if args.no_enable_prefix_caching {
        return Ok(None);
    }
    let gib = args.prefix_cache_gib;
    anyhow::ensure!(
        gib.is_finite() && gib > 0.0,
        "--prefix-cache-gib must be a positive number of GiB, got {gib} (--no-enable-prefix-caching turns the cache \
         off)"
    );
    let memory = gib * crate::cli::GIB;
    anyhow::ensure!(
        memory < usize::MAX as f64,
        "--prefix-cache-gib {gib} is more than this host can address"
    );
    Ok(Some(rewind_actors::PrefixCacheConfig {
        memory: (memory as usize).max(1),
        min_tokens: args.prefix_cache_min_tokens,
    }))
}

/// The bytes each rank sets aside for the prefix cache's stored states: its budget when the flags leave it on.
pub fn prefix_store(args: &EngineArgs) -> Result<u64> {
    Ok(prefix_cache_config(args)?.map_or(0, |c| c.memory as u64))
}

/// The engine's settings from the flags (checked before anything loads). The prefix cache is on by default on every
/// device (`--no-enable-prefix-caching` turns it off).
pub fn engine_config(args: &EngineArgs, form: FormChoice) -> Result<EngineConfig> {
    anyhow::ensure!(args.max_batch_tokens > 0, "--max-batch-tokens must be at least 1");
    anyhow::ensure!(
        (1..=rewind_engine::rank::MAX_CHAINED + 1).contains(&args.decode_steps),
        "--decode-steps must be 1 to {}, got {}",
        rewind_engine::rank::MAX_CHAINED + 1,
        args.decode_steps
    );
    let step_deadline = crate::cli::seconds(args.step_timeout, "--step-timeout", false)?;
    let mut c = EngineConfig::new(form);
    c.max_batch_tokens = args.max_batch_tokens;
    c.step_deadline = step_deadline;
    c.max_retries = args.max_retries;
    c.decode_steps = args.decode_steps;
    c.prefix_cache = prefix_cache_config(args)?;
    c.faults = args
        .inject_fault
        .iter()
        .map(|s| s.parse::<FaultSpec>())
        .collect::<rewind_engine::Result<_>>()?;
    Ok(c)
}

/// A multi-threaded runtime for the engine's actors.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("rewind-actors")
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Starts the serving engine on `b`'s ranks; returns it and the device in words.
pub async fn start_engine(b: &Backend, config: EngineConfig) -> Result<(EngineHandle, String)> {
    let t0 = std::time::Instant::now();
    let engine = EngineHandle::start(b.launcher.clone(), config).await?;
    let device = b.started(t0)?;
    Ok((engine, device))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::engine_config;
    use crate::cli::EngineArgs;
    use rewind_engine::decode::FormChoice;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        engine: EngineArgs,
    }

    fn cache(flags: &[&str]) -> anyhow::Result<(Option<usize>, u64)> {
        let f = Flags::try_parse_from(std::iter::once("rewind").chain(flags.iter().copied()))?;
        let memory = engine_config(&f.engine, FormChoice::Auto)?
            .prefix_cache
            .map(|c| c.memory);
        Ok((memory, super::prefix_store(&f.engine)?))
    }

    #[test]
    fn the_prefix_cache_is_on_by_default_and_its_store_follows_its_budget() {
        let four = 4usize << 30;
        assert_eq!(cache(&[]).unwrap(), (Some(four), four as u64));
        assert_eq!(cache(&["--enable-prefix-caching"]).unwrap(), (Some(four), four as u64));
        assert_eq!(cache(&["--prefix-cache-gib", "1"]).unwrap(), (Some(1 << 30), 1 << 30));
        assert_eq!(cache(&["--no-enable-prefix-caching"]).unwrap(), (None, 0));
        assert!(cache(&["--no-enable-prefix-caching", "--enable-prefix-caching"]).is_err());
        let e = cache(&["--prefix-cache-gib", "0"]).unwrap_err().to_string();
        assert!(e.contains("--prefix-cache-gib"), "{e}");
    }
}
