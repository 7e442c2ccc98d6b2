//! Progress of long work (loading a checkpoint, writing one) as plain log lines on the `rewind::progress` target:
//! one line when the work starts, one at each further tenth, one when it ends, with the elapsed time. The CLI shows
//! this target at `info` by default, so a 16 GB load or write is never silent.

use std::time::Instant;

use tracing::info;

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
        info!(target: "rewind::progress", "{what} ...");
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
