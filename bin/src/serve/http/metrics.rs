//! The HTTP API's own metrics, rendered in Prometheus' text format after the engine's: requests by endpoint and
//! status, request latency and time to first token as histograms by endpoint, and the requests in flight.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Upper bounds (seconds) of the request-latency buckets: from a rejected request to a long generation.
const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];
/// Upper bounds (seconds) of the time-to-first-token buckets: a short prompt's decode step to a long prefill behind a
/// queue.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The status recorded for a request whose client went away before the response (nginx's convention).
pub const CLIENT_CLOSED: u16 = 499;

/// One histogram: a count per bucket (not cumulative; the last counts what is above every bound), the sum and count.
#[derive(Clone, Debug)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, seconds: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| seconds <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += seconds;
        self.count += 1;
    }

    /// The `_bucket` (cumulative, as Prometheus wants), `_sum` and `_count` lines under `labels`.
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (i, c) in self.counts.iter().enumerate() {
            cumulative += c;
            let le = self.bounds.get(i).map_or_else(|| "+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// The HTTP metrics; see the module docs. Endpoint labels are the router's fixed paths, so the label sets stay small.
#[derive(Debug, Default)]
pub struct HttpMetrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    latency: Mutex<BTreeMap<&'static str, Histogram>>,
    ttft: Mutex<BTreeMap<&'static str, Histogram>>,
    in_flight: AtomicI64,
    /// Unknown top-level request fields ignored, by endpoint (the names are the client's, so not labels).
    unknown_fields: Mutex<BTreeMap<&'static str, u64>>,
    /// Request bodies refused before parsing, by reason (`too_large`, `timeout`).
    bodies_refused: Mutex<BTreeMap<&'static str, u64>>,
    /// Large bodies being parsed on the blocking pool.
    parsing: Arc<AtomicI64>,
}

/// A lock that a panic elsewhere cannot make unusable: the metrics are plain counters, valid at any point.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl HttpMetrics {
    /// Starts observing a request to `endpoint`: it is in flight until the returned guard drops.
    pub fn start(self: &Arc<Self>, endpoint: &'static str) -> Observation {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Observation {
            metrics: self.clone(),
            endpoint,
            start: Instant::now(),
            status: None,
        }
    }

    /// Records a request's time to its first generated token.
    pub fn first_token(&self, endpoint: &'static str, elapsed: Duration) {
        lock(&self.ttft)
            .entry(endpoint)
            .or_insert_with(|| Histogram::new(TTFT_BUCKETS))
            .observe(elapsed.as_secs_f64());
    }

    /// Records `n` unknown fields ignored in a request to `endpoint`.
    pub fn unknown_fields(&self, endpoint: &'static str, n: usize) {
        *lock(&self.unknown_fields).entry(endpoint).or_default() += n as u64;
    }

    /// Records a request body refused for `reason` (`too_large`, `timeout`).
    pub fn body_refused(&self, reason: &'static str) {
        *lock(&self.bodies_refused).entry(reason).or_default() += 1;
    }

    /// Counts a body being parsed off the async workers until the guard drops.
    pub fn parsing(&self) -> Parsing {
        self.parsing.fetch_add(1, Ordering::Relaxed);
        Parsing(self.parsing.clone())
    }

    fn finished(&self, endpoint: &'static str, status: u16, elapsed: Duration) {
        *lock(&self.requests).entry((endpoint, status)).or_default() += 1;
        lock(&self.latency)
            .entry(endpoint)
            .or_insert_with(|| Histogram::new(LATENCY_BUCKETS))
            .observe(elapsed.as_secs_f64());
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    /// The metrics in Prometheus' text format.
    pub fn prometheus(&self) -> String {
        let mut out = String::new();
        out.push_str("# HELP rewind_http_requests_total HTTP requests answered, by endpoint and status.\n");
        out.push_str("# TYPE rewind_http_requests_total counter\n");
        for ((endpoint, status), n) in lock(&self.requests).iter() {
            let _ = writeln!(
                out,
                "rewind_http_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
            );
        }
        for (name, help, map) in [
            (
                "rewind_http_request_duration_seconds",
                "Time from a request's arrival to the end of its response (a stream's last event included).",
                &self.latency,
            ),
            (
                "rewind_http_time_to_first_token_seconds",
                "Time from a generation request's arrival to its first generated token.",
                &self.ttft,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
            for (endpoint, h) in lock(map).iter() {
                h.render(&mut out, name, &format!("endpoint=\"{endpoint}\""));
            }
        }
        out.push_str(
            "# HELP rewind_http_unknown_fields_total Unknown top-level request fields ignored, by endpoint.\n",
        );
        out.push_str("# TYPE rewind_http_unknown_fields_total counter\n");
        for (endpoint, n) in lock(&self.unknown_fields).iter() {
            let _ = writeln!(out, "rewind_http_unknown_fields_total{{endpoint=\"{endpoint}\"}} {n}");
        }
        out.push_str(
            "# HELP rewind_http_bodies_refused_total Request bodies refused unread: too_large (over \
             --max-request-bytes) or timeout (slower than --body-timeout).\n",
        );
        out.push_str("# TYPE rewind_http_bodies_refused_total counter\n");
        for (reason, n) in lock(&self.bodies_refused).iter() {
            let _ = writeln!(out, "rewind_http_bodies_refused_total{{reason=\"{reason}\"}} {n}");
        }
        out.push_str(
            "# HELP rewind_http_body_parses_in_flight Large request bodies being parsed off the async workers.\n",
        );
        out.push_str("# TYPE rewind_http_body_parses_in_flight gauge\n");
        let _ = writeln!(
            out,
            "rewind_http_body_parses_in_flight {}",
            self.parsing.load(Ordering::Relaxed)
        );
        out.push_str("# HELP rewind_http_requests_in_flight HTTP requests being answered (streams included).\n");
        out.push_str("# TYPE rewind_http_requests_in_flight gauge\n");
        let _ = writeln!(
            out,
            "rewind_http_requests_in_flight {}",
            self.in_flight.load(Ordering::Relaxed)
        );
        out
    }
}

/// A body being parsed (see [`HttpMetrics::parsing`]).
pub struct Parsing(Arc<AtomicI64>);

impl Drop for Parsing {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One request being answered. Dropping it records the request: with its status once [`Observation::status`] set
/// one, else as [`CLIENT_CLOSED`] (the handler was dropped because the client went away).
pub struct Observation {
    metrics: Arc<HttpMetrics>,
    endpoint: &'static str,
    start: Instant,
    status: Option<u16>,
}

impl Observation {
    /// The response's status (its head is on its way; a stream's body may still be running).
    pub fn status(&mut self, status: u16) {
        self.status = Some(status);
    }
}

impl Drop for Observation {
    fn drop(&mut self) {
        let status = self.status.unwrap_or(CLIENT_CLOSED);
        let elapsed = self.start.elapsed();
        // 503 is the server refusing work on purpose (draining, or the engine restarting): not an operator's alarm.
        if status >= 500 && status != 503 {
            tracing::warn!(
                endpoint = self.endpoint,
                status,
                seconds = elapsed.as_secs_f64(),
                "request failed"
            );
        } else {
            tracing::debug!(
                endpoint = self.endpoint,
                status,
                seconds = elapsed.as_secs_f64(),
                "request done"
            );
        }
        self.metrics.finished(self.endpoint, status, elapsed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_with_sum_and_count() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for s in [0.05, 0.5, 0.7, 5.0] {
            h.observe(s);
        }
        let mut out = String::new();
        h.render(&mut out, "x", "endpoint=\"/a\"");
        assert!(out.contains("x_bucket{endpoint=\"/a\",le=\"0.1\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{endpoint=\"/a\",le=\"1\"} 3\n"), "{out}");
        assert!(out.contains("x_bucket{endpoint=\"/a\",le=\"+Inf\"} 4\n"), "{out}");
        assert!(out.contains("x_sum{endpoint=\"/a\"} 6.25\n"), "{out}");
        assert!(out.contains("x_count{endpoint=\"/a\"} 4\n"), "{out}");
    }

    #[test]
    fn observations_count_requests_and_in_flight() {
        let m = Arc::new(HttpMetrics::default());
        let mut a = m.start("/v1/completions");
        let b = m.start("/v1/completions");
        assert!(m.prometheus().contains("rewind_http_requests_in_flight 2\n"));
        a.status(200);
        drop(a);
        drop(b);
        m.first_token("/v1/completions", Duration::from_millis(3));
        m.unknown_fields("/v1/completions", 2);
        m.unknown_fields("/v1/completions", 1);
        let text = m.prometheus();
        assert!(text.contains("rewind_http_requests_in_flight 0\n"), "{text}");
        assert!(text.contains("rewind_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1\n"));
        assert!(text.contains("rewind_http_requests_total{endpoint=\"/v1/completions\",status=\"499\"} 1\n"));
        assert!(text.contains("rewind_http_request_duration_seconds_count{endpoint=\"/v1/completions\"} 2\n"));
        assert!(text
            .contains("rewind_http_time_to_first_token_seconds_bucket{endpoint=\"/v1/completions\",le=\"0.005\"} 1\n"));
        assert!(text.contains("# TYPE rewind_http_time_to_first_token_seconds histogram\n"));
        assert!(
            text.contains("rewind_http_unknown_fields_total{endpoint=\"/v1/completions\"} 3\n"),
            "{text}"
        );
    }
}
