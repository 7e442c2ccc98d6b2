//! `rewind`: the command-line interface of the rewind serving engine.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use rewind_bin::{cli, commands, output};

fn main() -> ExitCode {
    // NCCL reads NCCL_NVLS_ENABLE when the first communicator is made; set it (unless the user did) while this is the
    // only thread, since writing the environment races with readers on other threads.
    #[cfg(feature = "cuda")]
    rewind_engine::gpu::device::disable_nvls_unless_set();
    let args = cli::Cli::try_parse().unwrap_or_else(|e| output::clap_exit(e));
    rewind_bin::init_logging();
    match commands::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of stdout went away (`rewind ... | head`): it wanted no more output, so end quietly.
        Err(e) if output::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            // Not eprintln!: it panics when stderr itself cannot be written.
            let _ = writeln!(std::io::stderr(), "error: {}", output::error_line(&e));
            ExitCode::FAILURE
        }
    }
}
