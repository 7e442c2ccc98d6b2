//! Recovery from a fault: charge it to the requests of the failed step (past the retry limit they fail with a clear
//! error), send every running sequence back to the queue with its history, abort and stop the ranks, and start a
//! fresh generation (fresh communicators, weights read again). Each sequence is then re-prefilled with its prompt
//! and the tokens already streamed, and streaming resumes with the next token: none is repeated or dropped, and a
//! greedy request's tokens are those of a fault-free run.

use std::time::Instant;

use rewind_engine::rank::Books;
use tracing::{error, info, warn};

use super::ranks::Generation;
use super::{sched_config, CoordinatorState, Fault};
use crate::metrics::{Metrics, Recovery};
use crate::request::{Event, FailureKind};

impl CoordinatorState {
    /// Recovers from `fault`, charged to the requests `involved` (the failed step's); see the module docs.
    pub(super) async fn recover(&mut self, fault: Fault, involved: &[u64]) {
        let t0 = Instant::now();
        let why = fault.to_string();
        warn!(fault = fault.class(), %why, step = self.index, "fault; restarting the ranks");
        Metrics::inc(&self.metrics.faults);
        for &id in involved {
            let Some(l) = self.live.get_mut(&id) else { continue };
            l.faults += 1;
            if l.faults > self.config.max_retries {
                let error = format!(
                    "the request was part of {} failed steps (the retry limit is {}); the last: {why}",
                    l.faults, self.config.max_retries
                );
                Metrics::inc(&self.metrics.requests_failed);
                let _ = l.events.send(Event::failed(FailureKind::Unavailable, error));
                self.live.remove(&id);
                self.sched.cancel(id);
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
        let g = Generation::start(&self.launcher, &self.faults, me, self.config.load_deadline).await?;
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
        Ok(())
    }
}
