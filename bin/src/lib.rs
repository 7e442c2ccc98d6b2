//! The rewind binaries' library: the `rewind` command line ([`cli`], [`commands`]), the servers every front end
//! shares ([`serve`]: gRPC sessions and the OpenAI-compatible HTTP API over one engine), and what `rewind-launch`
//! adds on top of them.

// Diagnostics go through output::errln!, which survives a closed stderr; eprintln! panics there.
#![deny(clippy::print_stderr)]

pub mod cli;
pub mod commands;
pub mod default_model;
pub mod launch;
pub mod output;
pub mod progress_bars;

/// Logging for both binaries: structured lines on stderr filtered by `RUST_LOG` (default `warn`), and on a terminal
/// progress bars for long work (loading, writing a checkpoint); elsewhere that progress is logged at `info`
/// (`RUST_LOG=rewind::progress=info`).
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_writer(|| output::QuietStderr)
        // Colour codes only on a terminal: redirected logs stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RUST_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        progress_bars::install();
    }
}
pub mod serve;
