//! `rewind-launch`: serve a model on every GPU (or those listed) with a tensor-parallel size checked against it, a
//! banner with the memory plan, and a drain on SIGINT / SIGTERM. See `rewind_bin::launch`.

use std::io::Write;
use std::process::ExitCode;

use rewind_bin::launch;

fn fail(e: &anyhow::Error) -> ExitCode {
    // Not eprintln!: it panics when stderr itself cannot be written.
    let _ = writeln!(std::io::stderr(), "error: {}", rewind_bin::output::error_line(e));
    ExitCode::FAILURE
}

fn main() -> ExitCode {
    // With --rank-processes the ranks' workers are this executable run as `rank-worker` (`rewind`'s hidden
    // subcommand), so a worker runs the very code of the server that started it.
    if std::env::args_os().nth(1).is_some_and(|a| a == "rank-worker") {
        let cli =
            <rewind_bin::cli::Cli as clap::Parser>::try_parse().unwrap_or_else(|e| rewind_bin::output::clap_exit(e));
        rewind_bin::init_logging();
        return match rewind_bin::commands::run(cli) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(&e),
        };
    }
    let args = launch::parse();
    // The environment is written while this is the only thread (writing it races with readers on other threads), and
    // before CUDA starts (it reads CUDA_VISIBLE_DEVICES once): --gpus, and NCCL's NVLS switch as `rewind` sets it.
    if let Err(e) = launch::restrict_gpus(&args) {
        return fail(&e);
    }
    #[cfg(feature = "cuda")]
    rewind_engine::gpu::device::disable_nvls_unless_set();
    rewind_bin::init_logging();
    match launch::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}
