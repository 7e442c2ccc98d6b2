//! Where a model runs: `--device`, `--tp` and the GPU-only flags shared by `generate`, `logits` and `bench`.

use clap::Args;

use super::non_negative;
use crate::output::errln;

/// Where a model runs (shared by `generate`, `logits` and `bench`).
#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Device: `cpu`, `cuda` (GPU 0) or `cuda:N` (with --tp, GPUs N .. N + tp − 1).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Tensor-parallel ranks: one GPU each (NCCL all-reduces between them), or on the CPU one thread each (in-process
    /// all-reduces).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub tp: usize,
    /// Fraction of each GPU's memory rewind may take for weights, activations and state pools, in (0, 1].
    #[arg(long, default_value_t = DEFAULT_GPU_MEMORY_FRACTION, allow_negative_numbers = true, help_heading = "GPU")]
    pub gpu_memory_fraction: f64,
    /// Most sequences alive at once on a GPU (state slots; also the largest decode batch) [default: 64]. A CPU
    /// server (`serve`, `chat`) sizes its pools by it too (default 8 there).
    // An Option, not a default value: "was it given?" must not be told by comparing with the default (a given 64
    // would look unset).
    #[arg(long, allow_negative_numbers = true, value_parser = non_negative::<usize>, help_heading = "GPU")]
    pub max_seqs: Option<usize>,
    /// Longest sequence on a GPU, in tokens (default: the model's limit, at most 32768).
    #[arg(long, allow_negative_numbers = true, value_parser = non_negative::<usize>, help_heading = "GPU")]
    pub max_model_len: Option<usize>,
    /// Tokens per prefill chunk on a GPU.
    #[arg(long, default_value_t = DEFAULT_PREFILL_CHUNK, allow_negative_numbers = true,
          value_parser = non_negative::<usize>, help_heading = "GPU")]
    pub prefill_chunk: usize,
    /// Storage type of GPU activations and state: bf16, or f32 (GEMM inputs still rounded to bf16; for accuracy
    /// checks).
    #[arg(long, default_value = DEFAULT_DTYPE, help_heading = "GPU")]
    pub dtype: String,
    /// Run every GPU step eagerly instead of replaying decode and verify steps as captured CUDA graphs (for
    /// debugging, and to measure what the graphs save).
    #[arg(long, help_heading = "GPU")]
    pub no_cuda_graphs: bool,
    /// Time every stage of every GPU step with CUDA events (embedding; each layer by kind, SSM and attention layers
    /// in their parts: projections, conv, scan, output; the LM head): `rewind bench` prints where a step's time goes,
    /// and the ranks' health reports it. A profiling aid that needs --no-cuda-graphs and waits for each step's events.
    #[arg(long, help_heading = "GPU")]
    pub stage_profile: bool,
}

/// Defaults of the GPU-only flags (a value other than these with `--device cpu` earns a note).
const DEFAULT_GPU_MEMORY_FRACTION: f64 = 0.9;
pub const DEFAULT_MAX_SEQS: usize = 64;
const DEFAULT_PREFILL_CHUNK: usize = 512;
const DEFAULT_DTYPE: &str = "bf16";

/// A parsed `--device`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// The GPU ordinals of the ranks.
    Cuda(Vec<usize>),
}

impl Device {
    /// A `--device` value (`cpu`, `cuda` or `cuda:N`) with `tp` ranks: a GPU device names GPUs N .. N + tp − 1.
    pub fn parse(device: &str, tp: usize) -> anyhow::Result<Device> {
        let first = match device {
            "cpu" => return Ok(Device::Cpu),
            "cuda" => 0,
            d => match d.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => n,
                _ => anyhow::bail!("unknown device `{d}`: expected `cpu`, `cuda` or `cuda:N`"),
            },
        };
        Ok(Device::Cuda((first..first + tp).collect()))
    }
}

impl DeviceArgs {
    /// `--max-seqs`, or its GPU default when not given.
    pub fn max_seqs(&self) -> usize {
        self.max_seqs.unwrap_or(DEFAULT_MAX_SEQS)
    }

    /// Parses `--device` and `--tp`, and checks every GPU flag's value whatever the device (so a bad value is an
    /// error on the CPU too, where it would otherwise be ignored).
    pub fn device(&self) -> anyhow::Result<Device> {
        if self.tp == 0 {
            anyhow::bail!("--tp must be at least 1");
        }
        let f = self.gpu_memory_fraction;
        if !(f > 0.0 && f <= 1.0) {
            anyhow::bail!("--gpu-memory-fraction {f} is outside (0, 1]");
        }
        if self.max_seqs == Some(0) {
            anyhow::bail!("--max-seqs must be at least 1");
        }
        if self.max_model_len == Some(0) {
            anyhow::bail!("--max-model-len must be at least 1");
        }
        if self.prefill_chunk == 0 {
            anyhow::bail!("--prefill-chunk must be at least 1");
        }
        if !matches!(self.dtype.as_str(), "bf16" | "f32") {
            anyhow::bail!("unknown GPU dtype `{}` for --dtype: expected bf16 or f32", self.dtype);
        }
        Device::parse(&self.device, self.tp)
    }

    /// The GPU-only flags given a value other than their default: with `--device cpu` they do nothing.
    pub fn gpu_only_flags_set(&self) -> Vec<&'static str> {
        let mut set = Vec::new();
        if self.gpu_memory_fraction != DEFAULT_GPU_MEMORY_FRACTION {
            set.push("--gpu-memory-fraction");
        }
        if self.max_seqs.is_some() {
            set.push("--max-seqs");
        }
        if self.max_model_len.is_some() {
            set.push("--max-model-len");
        }
        if self.prefill_chunk != DEFAULT_PREFILL_CHUNK {
            set.push("--prefill-chunk");
        }
        if self.dtype != DEFAULT_DTYPE {
            set.push("--dtype");
        }
        if self.no_cuda_graphs {
            set.push("--no-cuda-graphs");
        }
        if self.stage_profile {
            set.push("--stage-profile");
        }
        set
    }

    /// [`DeviceArgs::device`] for a command's own flags: also prints a note for each GPU-only flag that was given a
    /// value on the CPU, where it does nothing. Call once per command, on the flags as the user gave them.
    pub fn check(&self) -> anyhow::Result<Device> {
        let device = self.device()?;
        if device == Device::Cpu {
            for flag in self.gpu_only_flags_set() {
                errln!("note: {flag} does not apply to --device cpu");
            }
        }
        Ok(device)
    }
}
