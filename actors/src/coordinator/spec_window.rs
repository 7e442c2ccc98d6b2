//! The speculation window of each step, and the step times it is chosen on: before a step the policy
//! ([`rewind_engine::spec::window`]) chooses one window for every drafting sequence from their running acceptance
//! and the step-cost model; after it the ranks' wall time of the step feeds the model
//! ([`rewind_engine::spec::step_cost`]), so the adaptive window follows this machine's measured costs. The choice
//! and the model's estimates go to `/metrics` (`rewind_spec_window`, `rewind_spec_*_estimate_us`, ...).

use rewind_engine::rank::StepResult;
use rewind_engine::sched::{Step, StepWork};
use rewind_engine::spec::step_cost::CostSource;
use rewind_engine::spec::{Drafting, SpecPolicy, WindowChoice, WindowPolicy};
use tracing::{debug, info};

use super::{CoordinatorState, EngineSpec};
use crate::metrics::Metrics;

/// The window policy of `spec`, its step costs seeded from the profile when one was given (logged, since the
/// adaptive window is only as good as the costs it is chosen on).
pub(super) fn policy(spec: &EngineSpec) -> WindowPolicy {
    let c = &spec.config;
    let policy = WindowPolicy::new(c.window, c.policy, c.profile.as_ref());
    if c.policy == SpecPolicy::Adaptive {
        match &c.profile {
            Some(p) => info!(
                points = p.points.len(),
                device = %p.device,
                model = %p.model,
                "adaptive speculation: step costs from the step profile, then from this server's own steps"
            ),
            None => info!(
                "adaptive speculation: no step profile (--spec-profile), so the window follows the analytic prior \
                 until this server has measured its own steps"
            ),
        }
    }
    policy
}

/// The metrics' code for where the estimates come from.
fn source_code(s: CostSource) -> u64 {
    match s {
        CostSource::Prior => 0,
        CostSource::Profile => 1,
        CostSource::Online => 2,
    }
}

/// Microseconds, for a gauge.
fn micros(secs: Option<f64>) -> u64 {
    secs.map_or(0, |s| (s * 1e6).round() as u64)
}

impl CoordinatorState {
    /// The most drafts any sequence of the next step may propose (each also within its own remaining tokens), or
    /// `None` without speculation. `ready`: the sequences about to sample.
    pub(super) fn step_window(&self, ready: &[u64]) -> Option<usize> {
        let policy = self.window.as_ref()?;
        let drafting: Vec<Drafting> = ready
            .iter()
            .filter_map(|id| {
                let l = self.live.get(id)?;
                l.spec
                    .as_ref()?
                    .drafting(l.output.limit().saturating_sub(l.output.generated()))
            })
            .collect();
        let batch = self.sched.counts().1;
        let choice = policy.choose(batch, &drafting);
        self.window_metrics(policy, &choice);
        debug!(
            batch,
            drafting = drafting.len(),
            window = choice.window,
            step_secs = choice.step.seconds(),
            decode_secs = choice.decode.seconds(),
            gain = choice.gain,
            costs = %policy.costs().source(),
            "speculation window"
        );
        Some(choice.window)
    }

    fn window_metrics(&self, policy: &WindowPolicy, c: &WindowChoice) {
        let m = &self.metrics;
        Metrics::set(&m.spec_window, c.window as u64);
        Metrics::set(&m.spec_step_estimate_us, micros(c.step.seconds()));
        Metrics::set(&m.spec_decode_estimate_us, micros(c.decode.seconds()));
        Metrics::set(&m.spec_gain_milli, (c.gain * 1e3).round() as u64);
        Metrics::set(&m.spec_cost_source, source_code(policy.costs().source()));
        Metrics::set(
            &m.spec_profile_scale_milli,
            (policy.costs().scale() * 1e3).round() as u64,
        );
    }

    /// Feeds the ranks' wall time `secs` of the step just run to the step-cost model. Only steps of decodes and
    /// verifies count (a prompt chunk or a restored state costs what a window does not explain), per model step
    /// of a chain.
    pub(super) fn measure_step(&mut self, planned: &Step, result: &StepResult, secs: f64) {
        let Some(policy) = self.window.as_mut() else { return };
        let seqs = planned.work.len();
        let plain = planned
            .work
            .iter()
            .all(|p| !p.fresh && !matches!(p.work, StepWork::Prefill { .. }));
        if seqs == 0 || !plain {
            return;
        }
        let steps = match (&result.chain, planned.spec_chain) {
            (Some(log), true) => log.accepted.len() / seqs,
            _ => 1 + planned.chained,
        }
        .max(1);
        let before = policy.costs().observed();
        policy.observe(seqs, planned.tokens(), secs / steps as f64);
        let after = policy.costs().observed();
        Metrics::add(&self.metrics.spec_cost_steps, after - before);
        if before == 0 && after > 0 && policy.policy == SpecPolicy::Adaptive {
            info!(
                seqs,
                tokens = planned.tokens(),
                secs,
                "adaptive speculation: the step costs now include this server's measured steps"
            );
        }
    }
}
