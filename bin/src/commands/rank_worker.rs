//! `rewind rank-worker` (hidden): one rank in a worker process of its own, started by a server with
//! `--rank-processes` (`rewind_actors::rank_process`). It exits when its rank stops, and when the server that
//! started it goes away (its stdin, a pipe from the server, closes; PR_SET_PDEATHSIG covers a killed server too).

use std::io::Read;

use anyhow::{Context, Result};
use rewind_actors::rank_process::{worker, WorkerArgs, COOKIE_ENV};
use rewind_engine::decode::DecoderConfig;
use rewind_engine::rank::{CpuLauncher, CpuOptions};

use crate::cli::RankWorkerArgs;
use crate::output::errln;

/// `rewind rank-worker`.
pub fn run(args: RankWorkerArgs) -> Result<()> {
    let cookie = std::env::var(COOKIE_ENV).with_context(|| {
        format!("{COOKIE_ENV} is not set: rank workers are started by `rewind serve --rank-processes`")
    })?;
    let decoder: DecoderConfig = serde_json::from_str(&args.decoder).context("--decoder is not a decoder config")?;
    anyhow::ensure!(
        args.rank < args.tp,
        "--rank {} does not exist (--tp {})",
        args.rank,
        args.tp
    );
    let launcher = CpuLauncher::new(&args.model, CpuOptions { tp: args.tp, decoder })?.with_mtp(args.mtp);
    // The server holds the write end of our stdin: end of file means it has gone, and a worker outliving its server
    // would hold its memory (and its CPU, in a collective) for nothing.
    std::thread::Builder::new()
        .name("parent-watch".into())
        .spawn(|| {
            let mut sink = [0u8; 64];
            while matches!(std::io::stdin().read(&mut sink), Ok(n) if n > 0) {}
            std::process::exit(0);
        })
        .context("starting the parent watch")?;
    // The server prefixes this with the rank: which pid serves which rank, for whoever reads the log.
    errln!(
        "rewind: rank {} of {} in worker process {}, joining the server at {}",
        args.rank,
        args.tp,
        std::process::id(),
        args.coordinator
    );
    let worker_args = WorkerArgs {
        rank: args.rank,
        coordinator: args.coordinator,
        group: args.group,
        cookie,
    };
    super::backend::runtime()?.block_on(worker::run(worker_args, launcher))?;
    Ok(())
}
