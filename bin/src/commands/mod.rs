//! One module per subcommand.

mod bench;
mod generate;
mod init_model;
mod logits;
mod perplexity;
mod plan_memory;
mod selftest;

use anyhow::Result;

use crate::cli::{Cli, Command};

/// Runs the parsed command line.
pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Logits(a) => logits::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::InitModel(a) => init_model::run(a),
        Command::Bench(a) => bench::run(a),
        Command::PlanMemory(a) => plan_memory::run(a),
        Command::Selftest(a) => selftest::run(a),
    }
}
