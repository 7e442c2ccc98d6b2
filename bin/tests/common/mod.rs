//! Helpers shared by the CLI integration tests: run the `rewind` binary and read what it wrote.

use std::process::{Command, Output};

/// Runs `rewind` with `args` and collects its output.
pub fn rewind(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rewind"))
        .args(args)
        .output()
        .expect("run rewind")
}

/// What the run wrote to stderr.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}
