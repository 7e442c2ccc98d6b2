//! Command output on stdout that fails with an error instead of a panic, and on stderr that never fails.
//!
//! `println!` panics when stdout cannot be written: a reader that went away (`rewind ... | head`, EPIPE) or a full
//! disk (`> /dev/full`, ENOSPC). Commands write through [`write_stdout`] or the [`outln!`] macro instead, which return
//! the failure as an error naming stdout; `main` ends quietly with exit 0 on a closed pipe ([`is_broken_pipe`]), as
//! `head` users expect, and prints one `error: writing to stdout: ...` line with a non-zero exit otherwise.
//!
//! Use from any command module (`?` needs the function to return `anyhow::Result`):
//!
//! Notes, logs and progress on stderr go through [`errln!`] / [`write_stderr`] (and the log subscriber's
//! [`QuietStderr`]), which drop what cannot be written: `eprintln!` panics on a closed stderr (`rewind ... 2>&1 |
//! head`), and a command must not die for its diagnostics. The crate denies `clippy::print_stderr` to keep it so.
//!
//! ```ignore
//! use crate::output::{outln, write_stdout};
//! outln!("{} tokens/s", rate)?;          // println! that returns the error
//! write_stdout(&piece)?;                 // print! + flush, for streamed text
//! write_stdout(&table)?;                 // a whole report built in a String, in one write
//! ```

use std::fmt;
use std::io::{self, Write};

use anyhow::Result;

/// A failed write to stdout: shows as `writing to stdout: <the io error>` under `{:#}`, and lets `main` tell a
/// closed stdout pipe from any other broken pipe. Wrap an [`io::Error`] from a hand-made stdout writer with
/// `StdoutError::from(e)` (or `.map_err(StdoutError::from)?`) to get the same treatment.
#[derive(Debug)]
pub struct StdoutError(pub io::Error);

impl fmt::Display for StdoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("writing to stdout")
    }
}

impl std::error::Error for StdoutError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

impl From<io::Error> for StdoutError {
    fn from(e: io::Error) -> Self {
        StdoutError(e)
    }
}

/// Writes `text` to stdout as is (add the newline yourself) and flushes it, so that a failure surfaces here rather
/// than being lost at exit. A failure is a [`StdoutError`].
pub fn write_stdout(text: &str) -> Result<()> {
    let mut out = io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| StdoutError(e).into())
}

/// `println!` that returns `anyhow::Result<()>` (through [`write_stdout`]) instead of panicking when stdout fails.
macro_rules! outln {
    () => {
        $crate::output::write_stdout("\n")
    };
    ($($arg:tt)*) => {
        $crate::output::write_stdout(&format!("{}\n", format_args!($($arg)*)))
    };
}
pub(crate) use outln;

/// Writes `text` to stderr as is, dropping it when stderr cannot be written (a reader that went away): see the module
/// docs.
pub fn write_stderr(text: &str) {
    let mut err = io::stderr().lock();
    let _ = err.write_all(text.as_bytes()).and_then(|()| err.flush());
}

/// `eprintln!` that never panics (through [`write_stderr`]).
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::output::write_stderr(&format!("{}\n", format_args!($($arg)*)))
    };
}
pub(crate) use errln;

/// `err` and its causes as one line, `: ` between them, like `{:#}`, except that a cause the message before it
/// already ends with is left out: some libraries (hyper, tonic) put their source into their own message, so `{:#}`
/// would say "tcp connect error: tcp connect error: Connection refused".
pub fn error_line(err: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if line.ends_with(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// Ends the process for a command line clap refused, or for `--help` / `--version`: clap's own `exit` panics when
/// its message cannot be written (a closed stderr, or stdout for the help).
pub fn clap_exit(e: clap::Error) -> ! {
    let _ = e.print();
    std::process::exit(e.exit_code())
}

/// Stderr for the log subscriber: every write reports success, so that a closed stderr neither fails a command nor
/// makes the subscriber report the failure with `eprintln!` (which would panic on the same closed stderr).
#[derive(Clone, Copy, Debug, Default)]
pub struct QuietStderr;

impl Write for QuietStderr {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let _ = io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        let _ = io::stderr().flush();
        Ok(())
    }
}

/// Whether `err` comes from writing to stdout after its reader has gone (EPIPE, e.g. `rewind ... | head`): the
/// consumer stopped reading, which is not a failure of the command. Other broken pipes are real errors.
pub fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain()
        .filter_map(|e| e.downcast_ref::<StdoutError>())
        .any(|e| e.0.kind() == io::ErrorKind::BrokenPipe)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_line_says_each_cause_once() {
        #[derive(Debug)]
        struct Echoing(io::Error);
        impl fmt::Display for Echoing {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "tcp connect error: {}", self.0)
            }
        }
        impl std::error::Error for Echoing {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let refused = || io::Error::new(io::ErrorKind::ConnectionRefused, "Connection refused");
        let e = anyhow::Error::new(Echoing(refused())).context("connecting to http://x:1");
        assert_eq!(
            error_line(&e),
            "connecting to http://x:1: tcp connect error: Connection refused"
        );
        let plain = anyhow::Error::new(refused()).context("reading");
        assert_eq!(error_line(&plain), format!("{plain:#}"));
    }
}
