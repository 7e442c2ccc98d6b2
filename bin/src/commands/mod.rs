//! One module per subcommand.

mod backend;
mod bench;
mod bench_e2e;
mod bench_kernels;
mod bench_mtp;
mod bench_multiturn;
mod bench_plot;
mod bench_spec_chain;
mod bench_steps;
mod chat;
pub mod client;
mod compile_kernels;
mod generate;
#[cfg(feature = "cuda")]
mod gpu;
mod init_model;
mod logits;
mod perplexity;
mod plan;
mod plan_memory;
mod rank_worker;
mod selftest;
#[cfg(feature = "cuda")]
mod selftest_choices;
#[cfg(feature = "cuda")]
mod selftest_model;
#[cfg(feature = "cuda")]
mod selftest_mtp;
#[cfg(feature = "cuda")]
mod selftest_prefix;
mod selftest_spec_chain;
#[cfg(feature = "cuda")]
mod selftest_structured;
pub mod serve;
mod serve_bench;
mod spec;

use anyhow::Result;

use crate::cli::{Cli, Command};

/// The error for `--device cuda` in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub(crate) fn no_cuda() -> anyhow::Error {
    anyhow::anyhow!("this rewind was built without the `cuda` feature; --device cuda is not available")
}

/// Runs the parsed command line.
pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Logits(a) => logits::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::InitModel(a) => init_model::run(a),
        Command::Quantize(a) => init_model::quantize(a),
        Command::Bench(a) => bench::run(a),
        Command::PlanMemory(a) => plan_memory::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Selftest(a) => selftest::run(a),
        Command::CompileKernels(a) => compile_kernels::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Client(a) => client::run(a),
        Command::RankWorker(a) => rank_worker::run(a),
    }
}
