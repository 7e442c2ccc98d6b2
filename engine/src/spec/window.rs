//! The speculation window per step. `fixed` always drafts up to `T`; `adaptive` follows Snakes and Ladders §4
//! (apportioned speculation): while a step is memory-bound, verifying more tokens is nearly free, so the window is
//! the one that maximises expected tokens per unit of step cost for the measured acceptance, and speculation stops
//! above a batch size where every verified token costs compute that plain decoding would use for other sequences.

use super::config::SpecPolicy;

/// Batch sizes above which the adaptive policy stops drafting.
pub const DEFAULT_OFF_ABOVE: usize = 32;
/// Tokens per step up to which a step costs about the same (memory-bound: weights dominate).
pub const DEFAULT_KNEE_TOKENS: usize = 64;
/// The acceptance assumed before any draft was checked.
const PRIOR_ACCEPTANCE: f64 = 0.5;
/// Weight of the newest verify in the running acceptance.
const EMA: f64 = 0.2;

/// Chooses each step's window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WindowPolicy {
    pub max: usize,
    pub policy: SpecPolicy,
    /// Adaptive: no drafts when the batch holds more sequences than this.
    pub off_above: usize,
    /// Adaptive: tokens per step below which the step's cost is flat.
    pub knee_tokens: usize,
}

impl WindowPolicy {
    /// Up to `max` drafts under `policy`, with the default adaptive thresholds.
    pub fn new(max: usize, policy: SpecPolicy) -> Self {
        WindowPolicy {
            max,
            policy,
            off_above: DEFAULT_OFF_ABOVE,
            knee_tokens: DEFAULT_KNEE_TOKENS,
        }
    }

    /// The drafts to ask for in a step of `batch` decoding sequences, for a sequence whose running acceptance
    /// (per drafted token) is `acceptance`.
    pub fn window(&self, batch: usize, acceptance: f64) -> usize {
        match self.policy {
            SpecPolicy::Fixed => self.max,
            SpecPolicy::Adaptive => {
                if batch > self.off_above {
                    return 0;
                }
                let a = acceptance.clamp(0.0, 0.99);
                let batch = batch.max(1) as f64;
                // Expected tokens from t drafts accepted left to right with probability a each: 1 + a + … + a^t.
                // Step cost relative to a plain decode step of the same batch: flat below the knee, then linear.
                let knee = self.knee_tokens.max(1) as f64;
                let cost = |t: usize| (batch * (1 + t) as f64 / knee).max(1.0) / (batch / knee).max(1.0);
                (0..=self.max)
                    .map(|t| {
                        let tokens = (1.0 - a.powi(t as i32 + 1)) / (1.0 - a);
                        (t, tokens / cost(t))
                    })
                    .fold((0, 0.0), |best, c| if c.1 > best.1 + 1e-9 { c } else { best })
                    .0
            }
        }
    }
}

/// A sequence's running acceptance rate per drafted token (an exponential moving average over verifies).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AcceptanceMeter {
    rate: f64,
}

impl Default for AcceptanceMeter {
    fn default() -> Self {
        AcceptanceMeter { rate: PRIOR_ACCEPTANCE }
    }
}

impl AcceptanceMeter {
    /// Records a verify that accepted `accepted` of `drafted` drafts.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted > 0 {
            self.rate = (1.0 - EMA) * self.rate + EMA * accepted as f64 / drafted as f64;
        }
    }

    /// The running rate.
    pub fn rate(&self) -> f64 {
        self.rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_is_fixed_and_adaptive_backs_off() {
        let f = WindowPolicy::new(4, SpecPolicy::Fixed);
        assert_eq!(f.window(1, 0.0), 4);
        assert_eq!(f.window(1000, 0.0), 4);
        let a = WindowPolicy::new(4, SpecPolicy::Adaptive);
        assert_eq!(a.window(1, 0.9), 4, "a lone sequence with good acceptance drafts fully");
        assert_eq!(a.window(64, 0.9), 0, "off above the batch threshold");
        assert!(a.window(24, 0.9) < 4, "a larger batch drafts less");
        assert_eq!(a.window(1, 0.0), 0, "nothing is ever accepted: no drafts");
    }

    #[test]
    fn the_meter_moves_toward_what_it_sees() {
        let mut m = AcceptanceMeter::default();
        for _ in 0..50 {
            m.record(4, 4);
        }
        assert!(m.rate() > 0.95);
        for _ in 0..50 {
            m.record(4, 0);
        }
        assert!(m.rate() < 0.05);
        m.record(0, 0);
    }
}
