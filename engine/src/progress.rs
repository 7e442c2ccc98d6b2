//! Progress of long work (loading a checkpoint, writing one): handed to the process's [`Reporter`] when one is set
//! (the CLI draws progress bars on a terminal), else plain log lines on the `rewind::progress` target — one when the
//! work starts, one at each further tenth, one when it ends, with the elapsed time.

use std::sync::OnceLock;
use std::time::Instant;

use tracing::info;

/// Receives every update instead of the log lines: what, units done, units in all (`done == total` ends it).
pub type Reporter = Box<dyn Fn(&str, u64, u64) + Send + Sync>;

static REPORTER: OnceLock<Reporter> = OnceLock::new();

/// Sets the process's reporter (once; returns false when one was already set).
pub fn set_reporter(r: Reporter) -> bool {
    REPORTER.set(r).is_ok()
}

/// One piece of long work counted in units (blocks, elements); see the module docs.
pub struct Progress {
    what: String,
    total: u64,
    done: u64,
    /// The last tenth reported.
    tenth: u64,
    started: Instant,
}

impl Progress {
    /// Starts counting `total` units of `what` (logs the start).
    pub fn new(what: impl Into<String>, total: u64) -> Self {
        let what = what.into();
        match REPORTER.get() {
            Some(r) => r(&what, 0, total.max(1)),
            None => info!(target: "rewind::progress", "{what} ..."),
        }
        Progress {
            what,
            total: total.max(1),
            done: 0,
            tenth: 0,
            started: Instant::now(),
        }
    }

    /// Counts `n` more units; logs each tenth passed and the end.
    pub fn advance(&mut self, n: u64) {
        self.done = (self.done + n).min(self.total);
        if let Some(r) = REPORTER.get() {
            r(&self.what, self.done, self.total);
            return;
        }
        let tenth = self.done * 10 / self.total;
        if tenth > self.tenth {
            self.tenth = tenth;
            let secs = self.started.elapsed().as_secs_f64();
            if self.done == self.total {
                info!(target: "rewind::progress", "{}: done in {secs:.1} s", self.what);
            } else {
                info!(target: "rewind::progress", "{}: {}% ({secs:.1} s)", self.what, tenth * 10);
            }
        }
    }
}
