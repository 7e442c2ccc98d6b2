//! Flags given in seconds.

use std::time::Duration;

/// The longest duration a seconds flag takes: a year, far past any useful timeout, and small enough that adding it to
/// an `Instant` cannot overflow.
pub const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

/// `v` seconds of the flag `flag` as a duration: finite, positive (or zero where `zero_ok`), at most [`MAX_SECONDS`].
pub fn seconds(v: f64, flag: &str, zero_ok: bool) -> anyhow::Result<Duration> {
    let (low_ok, what) = if zero_ok {
        (v >= 0.0, "a non-negative")
    } else {
        (v > 0.0, "a positive")
    };
    anyhow::ensure!(
        v.is_finite() && low_ok,
        "{flag} must be {what} number of seconds, got {v}"
    );
    anyhow::ensure!(
        v <= MAX_SECONDS,
        "{flag} must be at most {MAX_SECONDS} seconds (a year), got {v:e}"
    );
    Ok(Duration::from_secs_f64(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_are_checked_before_they_become_durations() {
        assert_eq!(seconds(1.5, "--x", false).unwrap(), Duration::from_millis(1500));
        assert_eq!(seconds(0.0, "--x", true).unwrap(), Duration::ZERO);
        for (v, zero_ok, want) in [
            (0.0, false, "--x must be a positive number of seconds, got 0"),
            (-1.0, true, "--x must be a non-negative number of seconds, got -1"),
            (f64::NAN, true, "got NaN"),
            (f64::INFINITY, false, "got inf"),
            (1e300, false, "must be at most 31536000 seconds (a year), got 1e300"),
        ] {
            let e = seconds(v, "--x", zero_ok).unwrap_err().to_string();
            assert!(e.contains(want), "{v}: {e}");
        }
        assert!(seconds(MAX_SECONDS, "--x", false).is_ok());
    }
}
