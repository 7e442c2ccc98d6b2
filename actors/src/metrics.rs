//! The coordinator's counters and gauges, kept where an exporter (the HTTP server's `/metrics`) can read them:
//! lock-free atomics updated on the step path, plus the log of recoveries.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde::Serialize;

/// One recovery: what failed and how long the restart took (from the fault to the new ranks being ready; the
/// sequences' re-prefill follows in the next steps).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Recovery {
    /// `deadline`, `panic`, `error`, `non_finite` or `stopped`.
    pub fault: String,
    pub message: String,
    pub restart_seconds: f64,
    /// Sequences sent back to be re-prefilled.
    pub requeued: usize,
}

macro_rules! metrics {
    ($( $name:ident: $kind:literal, $help:literal; )*) => {
        /// The engine's metrics; see the module docs.
        #[derive(Debug, Default)]
        pub struct Metrics {
            $( #[doc = $help] pub $name: AtomicU64, )*
            recoveries_log: Mutex<Vec<Recovery>>,
        }

        /// A copy of every metric at one moment.
        #[derive(Clone, Debug, Default, PartialEq, Serialize)]
        pub struct MetricsSnapshot {
            $( #[doc = $help] pub $name: u64, )*
            pub recoveries_log: Vec<Recovery>,
        }

        impl Metrics {
            /// Reads every metric.
            pub fn snapshot(&self) -> MetricsSnapshot {
                MetricsSnapshot {
                    $( $name: self.$name.load(Ordering::Relaxed), )*
                    recoveries_log: self.recoveries_log.lock().map(|l| l.clone()).unwrap_or_default(),
                }
            }

            /// The metrics in Prometheus' text format, each named `rewind_<metric>`.
            pub fn prometheus(&self) -> String {
                let mut out = String::new();
                $(
                    out.push_str(&format!(
                        "# HELP rewind_{0} {1}\n# TYPE rewind_{0} {2}\nrewind_{0} {3}\n",
                        stringify!($name),
                        $help,
                        $kind,
                        self.$name.load(Ordering::Relaxed)
                    ));
                )*
                out
            }
        }
    };
}

metrics! {
    steps: "counter", "Steps run.";
    chained_steps: "counter", "Further decode steps the ranks chained after a step's first (--decode-steps).";
    spec_chained_steps: "counter", "Further verify steps the ranks chained after a step's first, judged, committed and drafted on the ranks (--spec ngram or oracle with --decode-steps).";
    prefill_tokens: "counter", "Prompt tokens prefilled (re-prefills after a preemption or a fault included).";
    generated_tokens: "counter", "Tokens generated and streamed.";
    requests_submitted: "counter", "Requests accepted.";
    requests_finished: "counter", "Requests finished.";
    requests_failed: "counter", "Requests failed (bad parameters, faults beyond the retry limit).";
    requests_cancelled: "counter", "Requests cancelled by their client.";
    preemptions: "counter", "Sequences preempted to free slots or KV blocks.";
    faults: "counter", "Faults seen (a failed or late step, a rank that stopped).";
    recoveries: "counter", "Recoveries completed (ranks restarted).";
    recovery_ms_total: "counter", "Total restart time of the recoveries, in milliseconds.";
    last_recovery_ms: "gauge", "Restart time of the latest recovery, in milliseconds.";
    queue_depth: "gauge", "Requests waiting.";
    running: "gauge", "Sequences running.";
    batch_seqs: "gauge", "Sequences in the latest step.";
    batch_tokens: "gauge", "Token positions the latest step ran (every position of a chain, those past a sequence that finished inside it included).";
    free_slots: "gauge", "Free sequence slots.";
    free_kv_blocks: "gauge", "Free KV blocks.";
    spec_verifies: "counter", "Speculative verify steps run (one per sequence and step).";
    spec_drafted: "counter", "Draft tokens verified.";
    spec_accepted: "counter", "Draft tokens accepted.";
    spec_window: "gauge", "Drafts per sequence the window policy chose for the latest step (0: a plain decode step).";
    spec_step_estimate_us: "gauge", "The step-cost model's time of the latest step at its chosen window, in microseconds (0 while it has no measured step: the analytic prior has no unit).";
    spec_decode_estimate_us: "gauge", "The step-cost model's time of a plain decode step of the latest step's batch, in microseconds (0 while it has no measured step).";
    spec_gain_milli: "gauge", "Expected tokens per second of the latest step's window over plain decoding's, times 1000 (1000: no gain).";
    spec_cost_source: "gauge", "What the step-cost model rests on: 0 the analytic prior (nothing measured), 1 the step profile (--spec-profile), 2 this server's measured steps too.";
    spec_cost_steps: "counter", "Steps whose measured time fed the step-cost model.";
    spec_profile_scale_milli: "gauge", "This server's measured step times over the step profile's, times 1000: the factor on the profile's points it has not measured itself (1000 without a profile).";
    grammar_masks: "counter", "Grammar token masks the sampled rows of constrained requests took (structured outputs).";
    grammar_masks_ahead: "counter", "Of those, the masks computed ahead, overlapped with the ranks' step or the coordinator's other work, or by the drafts' check.";
    spec_grammar_cut: "counter", "Draft tokens cut before their verify because the request's grammar does not allow them (structured outputs).";
    spec_grammar_unresolved: "counter", "Constrained verifies whose token after the accepted drafts the grammar does not allow (the next step decodes that position with the mask).";
    restored_tokens: "counter", "Prompt tokens restored from a session's saved state instead of prefilled.";
    sessions: "gauge", "Sessions held.";
    sessions_evicted: "counter", "Sessions evicted after sitting idle past the timeout.";
    session_state_bytes: "gauge", "Host bytes of the sessions' saved states (a state forks share counted once).";
    session_memory_budget: "gauge", "The most host bytes the sessions' saved states may hold (--session-memory).";
    sessions_evicted_memory: "counter", "Idle sessions evicted to keep the saved states within the session memory budget.";
    session_saves_refused: "counter", "Session turns failed because their state did not fit the session memory budget even after evicting every idle session.";
    requests_refused: "counter", "Requests refused as back-pressure (the waiting queue at its limit).";
    prefix_cache_query_tokens: "counter", "Prompt tokens of requests that looked up the prefix cache.";
    prefix_cache_hit_tokens: "counter", "Prompt tokens restored from the prefix cache instead of prefilled.";
    prefix_cache_inserts: "counter", "States copied into the prefix cache.";
    prefix_cache_evictions: "counter", "Prefix cache states evicted (least recently used) to stay within its memory budget.";
    prefix_cache_states: "gauge", "States the prefix cache holds.";
    prefix_cache_bytes: "gauge", "Host bytes of the prefix cache's states (a state a session shares counted here too).";
    prefix_cache_memory_budget: "gauge", "The most host bytes the prefix cache may hold (--prefix-cache-gib).";
}

impl Metrics {
    /// Adds 1 to a counter.
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds `n` to a counter.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Sets a gauge.
    pub fn set(gauge: &AtomicU64, v: u64) {
        gauge.store(v, Ordering::Relaxed);
    }

    /// Records a completed recovery.
    pub fn recovered(&self, r: Recovery) {
        let ms = (r.restart_seconds * 1e3).round() as u64;
        Self::inc(&self.recoveries);
        Self::add(&self.recovery_ms_total, ms);
        Self::set(&self.last_recovery_ms, ms);
        if let Ok(mut log) = self.recoveries_log.lock() {
            log.push(r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_names_types_and_help() {
        let m = Metrics::default();
        Metrics::inc(&m.steps);
        Metrics::set(&m.queue_depth, 7);
        let text = m.prometheus();
        assert!(text.contains("# TYPE rewind_steps counter\nrewind_steps 1\n"), "{text}");
        assert!(
            text.contains("# TYPE rewind_queue_depth gauge\nrewind_queue_depth 7\n"),
            "{text}"
        );
        assert!(text.contains("# HELP rewind_steps Steps run.\n"), "{text}");
        assert_eq!(m.snapshot().steps, 1);
    }
}
