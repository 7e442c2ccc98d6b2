//! Recovery from a fault: charge it to the requests of the failed step (past the retry limit they fail with a clear
//! error), send every running sequence back to the queue with its history, abort and stop the ranks, and start a
//! fresh generation (fresh communicators, weights read again). Each sequence is then re-prefilled with its prompt
//! and the tokens already streamed, and streaming resumes with the next token: none is repeated or dropped, and a
//! greedy request's tokens are those of a fault-free run.
//!
//! A fault is charged to a request as a retry of the work it was doing, not for having been in the step: the
//! count starts again each time the request gets further than it has ever been. Re-running a request's earlier
//! work (the re-prefill after a recovery or a preemption) is counted apart from its new work, so that faults which
//! keep landing on re-prefills charge the new work of nobody. A request fails only when its own new work broke
//! more than the retry limit's steps in a row, or its re-prefill broke that often without getting any further.

use std::time::Instant;

use rewind_engine::rank::Books;
use tracing::{error, info, warn};

use super::ranks::Generation;
use super::{sched_config, CoordinatorState, Fault};
use crate::metrics::{Metrics, Recovery};
use crate::request::{Event, FailureKind};

/// One request's faults, as retries of the work it was doing (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Retries {
    /// How far the request's successful steps have computed its sequence (the furthest position, exclusive).
    computed: usize,
    /// Faults in a row of steps that carried the request's new work (positions past `computed`).
    new_work: usize,
    /// Faults in a row of steps that re-ran only its earlier work.
    replay: usize,
}

impl Retries {
    /// A step that fed the request's sequence up to `end` succeeded: getting further clears both counts.
    pub(super) fn succeeded(&mut self, end: usize) {
        if end > self.computed {
            *self = Retries {
                computed: end,
                ..Retries::default()
            };
        }
    }

    /// Charges a fault of a step that fed the request up to `end`. `Some(why)` once past `limit` retries.
    pub(super) fn fault(&mut self, end: usize, limit: usize) -> Option<String> {
        let (count, what) = if end > self.computed {
            self.new_work += 1;
            (self.new_work, "steps computing its next tokens failed")
        } else {
            self.replay += 1;
            (self.replay, "re-prefills of its earlier tokens failed")
        };
        (count > limit).then(|| format!("{count} {what} in a row (the retry limit is {limit})"))
    }
}

impl CoordinatorState {
    /// Recovers from `fault`, charged to the requests `involved` (the failed step's, each with the position its
    /// work in the step reached); see the module docs.
    pub(super) async fn recover(&mut self, fault: Fault, involved: &[(u64, usize)]) {
        let t0 = Instant::now();
        let why = fault.to_string();
        warn!(fault = fault.class(), %why, step = self.index, "fault; restarting the ranks");
        Metrics::inc(&self.metrics.faults);
        for &(id, end) in involved {
            let Some(l) = self.live.get_mut(&id) else { continue };
            if let Some(count) = l.retries.fault(end, self.config.max_retries) {
                let error = format!("{count}; the last: {why}");
                Metrics::inc(&self.metrics.requests_failed);
                let _ = l.events.send(Event::failed(FailureKind::Unavailable, error));
                let request = l.request;
                self.live.remove(&id);
                self.sched.cancel(id);
                // The request's other choices end with it (the ranks restart, so no slot needs releasing).
                self.drop_choices(request);
            }
        }
        let requeued = self.sched.requeue_all();
        for id in &requeued {
            if let Some(l) = self.live.get_mut(id) {
                l.recoveries += 1;
                if let Some(s) = l.spec.as_mut() {
                    s.reset();
                }
            }
        }
        if let Some(g) = self.ranks.take() {
            g.stop(&why).await;
        }
        // The restart itself may fail (a device gone); it is retried up to the retry limit, then every request fails.
        let mut last = String::new();
        for attempt in 0..=self.config.max_retries {
            match self.restart().await {
                Ok(()) => {
                    let restart_seconds = t0.elapsed().as_secs_f64();
                    info!(
                        restart_seconds,
                        requeued = requeued.len(),
                        generation = self.generation,
                        "ranks restarted"
                    );
                    self.metrics.recovered(Recovery {
                        fault: fault.class().into(),
                        message: why,
                        restart_seconds,
                        requeued: requeued.len(),
                    });
                    return;
                }
                Err(e) => {
                    warn!(attempt, %e, "restarting the ranks failed");
                    last = e.to_string();
                }
            }
        }
        let broken = format!("the ranks could not be restarted after a fault ({why}): {last}");
        error!(%broken);
        for (_, l) in self.live.drain() {
            Metrics::inc(&self.metrics.requests_failed);
            let _ = l.events.send(Event::failed(FailureKind::Unavailable, broken.clone()));
        }
        self.sched.drain();
        self.broken = Some(broken);
    }

    /// Starts a new generation of ranks with the capacity of the first.
    async fn restart(&mut self) -> rewind_engine::Result<()> {
        let me = self.myself.clone();
        let g = Generation::start(
            &self.launcher,
            &self.faults,
            self.config.rank_processes.as_ref(),
            me,
            self.config.load_deadline,
        )
        .await?;
        let books = Books::new(&g.infos, self.info.vocab)?;
        let same = sched_config(&books, &self.info, &self.config) == self.capacity
            && g.infos.iter().map(|i| i.kv_blocks).min().unwrap_or(0) == self.info.kv_blocks;
        if !same {
            g.stop("a different capacity").await;
            return Err(rewind_engine::EngineError::GroupFailed(
                "the restarted ranks report a different capacity than the first ones".into(),
            ));
        }
        self.books = books;
        self.ranks = Some(g);
        self.generation += 1;
        self.lose_stored();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Retries;

    #[test]
    fn progress_between_faults_clears_the_count() {
        let mut r = Retries::default();
        for step in 0..10 {
            r.succeeded(10 + step);
            assert_eq!(r.fault(11 + step, 1), None, "step {step}");
        }
    }

    #[test]
    fn new_work_that_keeps_failing_fails_past_the_limit() {
        let mut r = Retries::default();
        r.succeeded(8);
        assert_eq!(r.fault(9, 2), None);
        assert_eq!(r.fault(9, 2), None);
        let why = r.fault(9, 2).expect("a third fault in a row is past 2 retries");
        assert!(
            why.starts_with("3 steps computing its next tokens failed in a row (the retry limit is 2)"),
            "{why}"
        );
    }

    #[test]
    fn faults_on_re_prefills_are_counted_apart_from_new_work() {
        let mut r = Retries::default();
        r.succeeded(20);
        assert_eq!(r.fault(21, 1), None, "its new work: the first retry");
        // Re-prefill chunks that are hit, with a successful one between: no new position, no new-work charge.
        assert_eq!(r.fault(8, 1), None);
        r.succeeded(8);
        r.succeeded(16);
        // Its new work breaks once more: the second such fault, not the third, as the replay is counted apart.
        let why = r.fault(21, 1).expect("past one retry");
        assert!(why.starts_with("2 steps computing"), "{why}");
    }

    #[test]
    fn a_re_prefill_that_keeps_failing_fails_too() {
        let mut r = Retries::default();
        r.succeeded(30);
        assert_eq!(r.fault(16, 1), None);
        r.succeeded(16);
        let why = r.fault(16, 1).expect("the re-prefill got no further");
        assert!(
            why.starts_with("2 re-prefills of its earlier tokens failed in a row"),
            "{why}"
        );
    }
}
