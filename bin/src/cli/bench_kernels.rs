//! `rewind bench kernels`: the flags of the decode-kernel benchmark, an optional subcommand of `rewind bench` (plain
//! `rewind bench ...` keeps its own flags unchanged).

use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};

use super::non_negative;

/// What `rewind bench` may run instead of the model benchmark.
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// SSM decode kernels of one layer on the GPU, against their byte roofline.
    ///
    /// One Nemotron-H-8B Mamba-2 and one Qwen3.5-4B GDN layer at their real shapes: the recurrent step, replay at
    /// L = 4 … 32 and its flush step, verify at T = 2, 4, 6, and the serial snapshot baseline, at batch 1 … 512; each
    /// against the byte model and the copy bandwidth measured in the same run.
    #[command(after_help = BENCH_KERNELS_EXAMPLES)]
    Kernels(BenchKernelsArgs),
    /// End to end on the GPU: random-weight models of real shapes (Nemotron-H-8B, Qwen3.5-4B, Nemotron-3-Nano cut to
    /// fit), the batched decode step per form and batch against its byte roofline (recurrent, replay, and
    /// speculative verify at every kept count), serving through the coordinator, and the concurrency a fixed memory
    /// budget admits with per-draft snapshots vs replay, measured by admitting sequences.
    #[command(after_help = super::bench_e2e::BENCH_E2E_EXAMPLES)]
    E2e(Box<super::BenchE2eArgs>),
    /// PNG plots and a markdown index from benchmark JSON (`bench e2e`, `bench kernels`, the peers' script).
    #[command(after_help = super::bench_e2e::BENCH_PLOT_EXAMPLES)]
    Plot(super::BenchPlotArgs),
    /// Multi-turn chat through the serving engine, with automatic prefix caching off and on: conversations that
    /// resend their whole history every turn (a shared system prompt, a per-conversation prefix, user turns and the
    /// model's replies); reported per pass are the tokens prefilled against the prompt tokens sent, time to first
    /// token, and whether the replies match.
    #[command(name = "multi-turn", after_help = super::bench_multiturn::BENCH_MULTI_TURN_EXAMPLES)]
    MultiTurn(Box<super::BenchMultiTurnArgs>),
}

/// Examples shown after `rewind bench kernels --help`.
const BENCH_KERNELS_EXAMPLES: &str = "\
Examples:
  rewind bench kernels --device cuda --json kernels.json --markdown kernels.md
  rewind bench kernels --device cuda:1 --family gdn --batch 64,256 --repeats 50";

/// Which layer families to time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KernelFamily {
    /// Nemotron-H-8B's Mamba-2 layer (128 heads × 64, state 128, 8 groups).
    Mamba2,
    /// Qwen3.5-4B's Gated DeltaNet layer (16 key / 32 value heads × 128).
    Gdn,
    /// Both.
    All,
}

#[derive(Args, Debug)]
pub struct BenchKernelsArgs {
    /// Device: `cuda` (GPU 0) or `cuda:N`. The kernels timed are CUDA's, so `cpu` is refused.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Layer family.
    #[arg(long, value_enum, default_value_t = KernelFamily::All)]
    pub family: KernelFamily,
    /// Batch sizes (rows per launch; default 1,8,32,64,128,256,512).
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub batch: Option<Vec<usize>>,
    /// Timed launches per case, after 3 warm-up ones (the median is reported).
    #[arg(long, default_value_t = 20, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub repeats: usize,
    /// Write the results as JSON to this file (device, date, commit, copy bandwidth, one object per row).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write the markdown tables to this file too (they always go to stdout).
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
}
