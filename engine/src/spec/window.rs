//! The speculation window per step. `fixed` always drafts up to `T`; `adaptive` follows Snakes and Ladders §4
//! (apportioned speculation): one window for the whole step, the one that maximises the expected tokens per second,
//! `Σ_seq E[tokens_seq(T)] / time(B, T)`, where a sequence whose drafts are each accepted with probability `a`
//! yields `E[tokens(T)] = 1 + a + … + a^T` and `time(B, T)` is the step-cost model's ([`super::step_cost`]): this
//! machine's measured step times, or the analytic prior until anything was measured. `T = 0` (a plain decode step)
//! is one of the candidates, so speculation stops exactly where verifying costs more than it yields, at whatever
//! batch size that is on this machine.

use super::config::SpecPolicy;
use super::step_cost::{Cost, StepCostModel, StepProfile, DEFAULT_KNEE_TOKENS};
use crate::plan::projection::tokens_per_verify;

/// The acceptance assumed before any draft was checked.
const PRIOR_ACCEPTANCE: f64 = 0.5;
/// Weight of the newest verify in the running acceptance.
const EMA: f64 = 0.2;

/// What one drafting sequence brings to the step's choice.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Drafting {
    /// Its running acceptance per drafted token ([`AcceptanceMeter`]).
    pub acceptance: f64,
    /// The most drafts it can use (its verify's last row always yields a token: `remaining − 1`).
    pub cap: usize,
}

/// A step's window and the estimates it was chosen on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WindowChoice {
    /// Drafts per sequence (each sequence drafts at most its own cap); 0: the step decodes.
    pub window: usize,
    /// The estimated time of the step at that window, and of a plain decode step of the same batch.
    pub step: Cost,
    pub decode: Cost,
    /// Expected tokens the step yields, over all its sequences.
    pub tokens: f64,
    /// Expected tokens per second at the window over plain decoding's (1: no gain).
    pub gain: f64,
}

/// Chooses each step's window, and keeps the step-cost model it chooses on.
#[derive(Clone, Debug, PartialEq)]
pub struct WindowPolicy {
    pub max: usize,
    pub policy: SpecPolicy,
    costs: StepCostModel,
}

impl WindowPolicy {
    /// Up to `max` drafts under `policy`, the step costs seeded from `profile` (none: the analytic prior).
    pub fn new(max: usize, policy: SpecPolicy, profile: Option<&StepProfile>) -> Self {
        WindowPolicy {
            max,
            policy,
            costs: StepCostModel::new(profile, DEFAULT_KNEE_TOKENS),
        }
    }

    /// The step-cost model.
    pub fn costs(&self) -> &StepCostModel {
        &self.costs
    }

    /// Records a step of `batch` sequences that ran `tokens` tokens together in `secs` seconds.
    pub fn observe(&mut self, batch: usize, tokens: usize, secs: f64) {
        self.costs.observe(batch, tokens, secs);
    }

    /// The window of a step of `batch` running sequences, of which `drafting` may draft (the others decode one
    /// token whatever the window). `fixed`: the most drafts; `adaptive`: the most expected tokens per second,
    /// the smaller window on a tie.
    pub fn choose(&self, batch: usize, drafting: &[Drafting]) -> WindowChoice {
        let batch = batch.max(drafting.len()).max(1);
        let plain = (batch - drafting.len()) as f64;
        let at = |t: usize| {
            let (mut tokens, mut drafts) = (plain, 0usize);
            for d in drafting {
                let w = t.min(d.cap);
                tokens += tokens_per_verify(w, d.acceptance.clamp(0.0, 1.0));
                drafts += w;
            }
            let step = self.costs.cost(batch, drafts as f64 / batch as f64);
            (tokens, step)
        };
        let (decode_tokens, decode) = at(0);
        let rate = |tokens: f64, step: Cost| tokens / step.value.max(f64::MIN_POSITIVE);
        let base = rate(decode_tokens, decode);
        let choice = |window: usize| {
            let (tokens, step) = at(window);
            WindowChoice {
                window,
                step,
                decode,
                tokens,
                gain: rate(tokens, step) / base,
            }
        };
        match self.policy {
            SpecPolicy::Fixed => choice(self.max),
            SpecPolicy::Adaptive => {
                (1..=self.max).map(choice).fold(
                    choice(0),
                    |best, c| {
                        if c.gain > best.gain * (1.0 + 1e-9) {
                            c
                        } else {
                            best
                        }
                    },
                )
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

    use crate::spec::step_cost::{StepPoint, PROFILE_VERSION};

    fn seqs(n: usize, acceptance: f64) -> Vec<Drafting> {
        vec![Drafting { acceptance, cap: 100 }; n]
    }

    /// A profile at batch 64: a decode step of `decode_ms`, a verify of 4 drafts of `verify_ms`.
    fn profile(decode_ms: f64, verify_ms: f64) -> StepProfile {
        StepProfile {
            step_profile_version: PROFILE_VERSION,
            device: "test".into(),
            model: "test".into(),
            decode_form: "replay".into(),
            context: 16,
            points: vec![
                StepPoint {
                    batch: 64,
                    window: 0,
                    step_ms: decode_ms,
                },
                StepPoint {
                    batch: 64,
                    window: 4,
                    step_ms: verify_ms,
                },
            ],
        }
    }

    #[test]
    fn fixed_is_fixed() {
        let f = WindowPolicy::new(4, SpecPolicy::Fixed, None);
        assert_eq!(f.choose(1, &seqs(1, 0.0)).window, 4);
        assert_eq!(f.choose(1000, &seqs(1000, 0.0)).window, 4);
    }

    #[test]
    fn the_prior_drafts_alone_and_backs_off_in_a_crowd() {
        let a = WindowPolicy::new(4, SpecPolicy::Adaptive, None);
        assert!(!a.costs().measured());
        let alone = a.choose(1, &seqs(1, 0.9));
        assert_eq!(alone.window, 4, "a lone sequence with good acceptance drafts fully");
        assert!(alone.gain > 4.0 && alone.step.seconds().is_none(), "{alone:?}");
        assert!(a.choose(24, &seqs(24, 0.9)).window < 4, "a larger batch drafts less");
        assert_eq!(
            a.choose(1, &seqs(1, 0.0)).window,
            0,
            "nothing is ever accepted: no drafts"
        );
        assert_eq!(
            a.choose(64, &seqs(64, 0.5)).window,
            0,
            "past the knee verifying costs more than it yields"
        );
        // No batch cut-off: above the old one (32) speculation goes on while it pays.
        assert!(a.choose(33, &seqs(33, 0.9)).window > 0);
    }

    #[test]
    fn a_flat_measured_verify_drafts_at_batch_64() {
        // Memory-bound: verifying 5 tokens a sequence costs 10% more than decoding one.
        let a = WindowPolicy::new(4, SpecPolicy::Adaptive, Some(&profile(20.0, 22.0)));
        let c = a.choose(64, &seqs(64, 0.7));
        assert_eq!(c.window, 4, "{c:?}");
        assert!((c.step.seconds().expect("measured") - 0.022).abs() < 1e-12, "{c:?}");
        assert!((c.decode.seconds().expect("measured") - 0.020).abs() < 1e-12, "{c:?}");
        assert!(c.gain > 2.0, "{c:?}");
    }

    #[test]
    fn a_linear_measured_verify_with_low_acceptance_decodes() {
        // Compute-bound: a verify costs its tokens.
        let a = WindowPolicy::new(4, SpecPolicy::Adaptive, Some(&profile(20.0, 100.0)));
        let c = a.choose(64, &seqs(64, 0.3));
        assert_eq!(c.window, 0, "{c:?}");
        assert_eq!(c.gain, 1.0);
        // Near-perfect acceptance makes even a linear cost break even at best: still no drafts.
        assert_eq!(a.choose(64, &seqs(64, 0.95)).window, 0);
    }

    #[test]
    fn the_servers_own_steps_move_the_choice() {
        let mut a = WindowPolicy::new(4, SpecPolicy::Adaptive, Some(&profile(20.0, 22.0)));
        assert_eq!(a.choose(64, &seqs(64, 0.5)).window, 4);
        // On this server a verify of 4 drafts turns out to cost 4× a decode step.
        for _ in 0..60 {
            a.observe(64, 64, 0.020);
            a.observe(64, 64 * 5, 0.080);
        }
        assert_eq!(a.choose(64, &seqs(64, 0.5)).window, 0);
        // And then cheap again.
        for _ in 0..60 {
            a.observe(64, 64, 0.020);
            a.observe(64, 64 * 5, 0.021);
        }
        assert_eq!(a.choose(64, &seqs(64, 0.5)).window, 4);
    }

    #[test]
    fn caps_and_plain_sequences_count() {
        let a = WindowPolicy::new(4, SpecPolicy::Adaptive, Some(&profile(20.0, 22.0)));
        // A window past every sequence's cap gains nothing, so the smaller one stays.
        let capped = vec![
            Drafting {
                acceptance: 0.9,
                cap: 2
            };
            64
        ];
        assert_eq!(a.choose(64, &capped).window, 2);
        // One drafting sequence among 64: its few drafts barely move the step's tokens or its cost.
        let c = a.choose(64, &seqs(1, 0.9));
        assert!(c.gain > 1.0 && c.gain < 1.1, "{c:?}");
        assert!(
            (c.tokens - (63.0 + tokens_per_verify(c.window, 0.9))).abs() < 1e-9,
            "{c:?}"
        );
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
