//! What a step costs, for the adaptive speculation window (Snakes and Ladders §4): the wall time of a step of `B`
//! sequences that each run `1 + T` tokens (`T = 0`: a plain decode step), from measured points.
//!
//! The points come from a profile that `rewind bench --write-step-profile` measured on this machine ([`StepProfile`],
//! `--spec-profile`), and from the server's own steps as it runs ([`StepCostModel::observe`], an exponential moving
//! average per batch bucket and window). The server's steps rarely cost exactly what the bench measured (another
//! context length, the host's own work), and it measures only the windows it chooses, so a running ratio of its
//! steps' times to the profile's ([`StepCostModel::scale`]) carries the profile's points it has not measured itself:
//! a decode step measured twice as slow as the profile says makes the profile's verify steps twice as slow too,
//! rather than suddenly cheap beside it. A time between measured points is interpolated: per window, linearly in the
//! batch size between the two nearest measured batches; a window whose points do not reach the batch on both sides
//! (none of its own, or only alone), linearly in tokens between the nearest windows whose points do. Outside the
//! measured range the analytic prior's shape ([`prior`]) carries the nearest point. Noise is flattened: each
//! window's points are made non-decreasing in the batch, and the estimates non-decreasing in the window.
//!
//! With no point at all the model is the analytic prior alone, in units of one lone decode step: a step costs the
//! same until its tokens reach the knee ([`DEFAULT_KNEE_TOKENS`], the weights dominate: memory-bound), then grows
//! linearly with them (compute-bound). [`StepCostModel::measured`] says which one is in use.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Tokens per step up to which the prior says a step costs about the same (memory-bound: weights dominate).
pub const DEFAULT_KNEE_TOKENS: usize = 64;
/// The profile format this build reads and writes (`step_profile_version`).
pub const PROFILE_VERSION: u64 = 1;
/// Weight of the newest measured step in its cell's running time and in the running scale.
const STEP_EMA: f64 = 0.1;

/// One measured step: `batch` sequences, each running its next token and `window` drafts, took `step_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepPoint {
    pub batch: usize,
    pub window: usize,
    pub step_ms: f64,
}

/// A machine's measured step times, as `rewind bench --write-step-profile` writes them and `--spec-profile` reads
/// them. The provenance fields are informational; only `points` enter the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepProfile {
    pub step_profile_version: u64,
    /// The device the points were measured on.
    #[serde(default)]
    pub device: String,
    /// The model, as `ModelConfig::summary` names it.
    #[serde(default)]
    pub model: String,
    /// The decode form the steps ran in.
    #[serde(default)]
    pub decode_form: String,
    /// The mean context of the measured steps, in tokens.
    #[serde(default)]
    pub context: usize,
    pub points: Vec<StepPoint>,
}

/// Why a step profile could not be used. Every message names the file, and the field when one is wrong.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("step profile {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("step profile {path}: malformed JSON: {message}")]
    Json { path: PathBuf, message: String },
    #[error("step profile {path}: field `{field}`: {message}")]
    Field {
        path: PathBuf,
        field: String,
        message: String,
    },
}

impl StepProfile {
    /// Reads and checks the profile at `path`.
    pub fn load(path: &Path) -> Result<StepProfile, ProfileError> {
        let text = std::fs::read_to_string(path).map_err(|error| ProfileError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        let profile: StepProfile = serde_json::from_str(&text).map_err(|e| ProfileError::Json {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        profile.check().map_err(|(field, message)| ProfileError::Field {
            path: path.to_path_buf(),
            field,
            message,
        })?;
        Ok(profile)
    }

    /// Checks the profile and writes it to `path` as JSON.
    pub fn save(&self, path: &Path) -> Result<(), ProfileError> {
        self.check().map_err(|(field, message)| ProfileError::Field {
            path: path.to_path_buf(),
            field,
            message,
        })?;
        let text = serde_json::to_string_pretty(self).map_err(|e| ProfileError::Json {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        std::fs::write(path, text + "\n").map_err(|error| ProfileError::Io {
            path: path.to_path_buf(),
            error,
        })
    }

    /// The first wrong field and what is wrong with it.
    fn check(&self) -> Result<(), (String, String)> {
        if self.step_profile_version != PROFILE_VERSION {
            return Err((
                "step_profile_version".into(),
                format!(
                    "this build reads version {PROFILE_VERSION}, the file is version {}",
                    self.step_profile_version
                ),
            ));
        }
        if self.points.is_empty() {
            return Err((
                "points".into(),
                "holds no measured step (write one with `rewind bench --verify-window T --write-step-profile PATH`)"
                    .into(),
            ));
        }
        for (i, p) in self.points.iter().enumerate() {
            if p.batch == 0 {
                return Err((format!("points[{i}].batch"), "must be at least 1".into()));
            }
            if !(p.step_ms.is_finite() && p.step_ms > 0.0) {
                return Err((
                    format!("points[{i}].step_ms"),
                    format!("must be a positive number of milliseconds, got {}", p.step_ms),
                ));
            }
        }
        Ok(())
    }
}

/// The prior's cost of a step of `batch` sequences running `tokens` tokens each, in units of a lone decode step:
/// flat until the step's tokens reach `knee`, then linear in them.
pub fn prior(batch: f64, tokens: f64, knee: usize) -> f64 {
    (batch * tokens / knee.max(1) as f64).max(1.0)
}

/// One cell of measured steps: the running batch size and step time of the steps that fell in it.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Cell {
    batch: f64,
    secs: f64,
    /// The profile's points averaged in the cell.
    samples: u64,
    /// The server's steps measured in it: its time is then theirs, no longer the profile's times the scale.
    online: u64,
}

/// A step's estimated time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cost {
    /// Seconds when [`Cost::measured`], else units of a lone decode step under the prior.
    pub value: f64,
    pub measured: bool,
}

impl Cost {
    /// The estimate in seconds, when it rests on measured steps.
    pub fn seconds(&self) -> Option<f64> {
        self.measured.then_some(self.value)
    }
}

/// Where the model's points come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CostSource {
    /// No point: the analytic prior.
    Prior,
    /// A profile's points, not yet moved by the server's own steps.
    Profile,
    /// The server's own steps (over a profile's points when one was given).
    Online,
}

impl fmt::Display for CostSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CostSource::Prior => "the analytic prior (no measured step yet)",
            CostSource::Profile => "the step profile",
            CostSource::Online => "this server's measured steps",
        })
    }
}

/// Step times by batch size and window: measured points, interpolated (module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct StepCostModel {
    /// Cells by (batch bucket, window).
    cells: BTreeMap<(u32, usize), Cell>,
    knee: usize,
    /// Steps fed by [`StepCostModel::observe`].
    observed: u64,
    /// The server's measured step times over the profile's (1 without a profile).
    scale: f64,
    /// The profile's points alone, never moved: what the scale compares the server's steps with.
    profile: Option<Box<StepCostModel>>,
}

/// The batch bucket of `batch`: half-octave steps (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, … each its own), so a
/// bucket's steps cost about the same.
fn bucket(batch: f64) -> u32 {
    (2.0 * batch.max(1.0).log2()).round() as u32
}

/// `a + (b − a)·f`.
fn lerp(a: f64, b: f64, f: f64) -> f64 {
    a + (b - a) * f
}

impl StepCostModel {
    /// A model seeded with `profile`'s points (none: the prior alone), with the prior's knee at `knee` tokens.
    pub fn new(profile: Option<&StepProfile>, knee: usize) -> Self {
        let mut m = StepCostModel {
            cells: BTreeMap::new(),
            knee,
            observed: 0,
            scale: 1.0,
            profile: None,
        };
        // Points of one cell (the same bucket and window) are averaged.
        for p in profile.map(|p| p.points.as_slice()).unwrap_or_default() {
            let (batch, secs) = (p.batch as f64, p.step_ms / 1e3);
            m.cells
                .entry((bucket(batch), p.window))
                .and_modify(|c| {
                    let n = c.samples as f64;
                    c.batch = (c.batch * n + batch) / (n + 1.0);
                    c.secs = (c.secs * n + secs) / (n + 1.0);
                    c.samples += 1;
                })
                .or_insert(Cell {
                    batch,
                    secs,
                    samples: 1,
                    online: 0,
                });
        }
        if m.measured() {
            m.profile = Some(Box::new(m.clone()));
        }
        m
    }

    /// Where the estimates come from.
    pub fn source(&self) -> CostSource {
        if self.observed > 0 {
            CostSource::Online
        } else if self.cells.is_empty() {
            CostSource::Prior
        } else {
            CostSource::Profile
        }
    }

    /// Whether any measured step backs the estimates (otherwise they are the prior's).
    pub fn measured(&self) -> bool {
        !self.cells.is_empty()
    }

    /// Steps the server fed so far.
    pub fn observed(&self) -> u64 {
        self.observed
    }

    /// The server's measured step times over the profile's, a running ratio (1 without a profile, or before the
    /// first measured step): the factor on the profile's points the server has not measured itself.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Records a step of `batch` sequences that ran `tokens` tokens together in `secs` seconds. A step whose
    /// sequences ran windows of different sizes counts as the nearest whole window `round(tokens / batch) − 1`, its
    /// time scaled to that window by the model's own slope.
    pub fn observe(&mut self, batch: usize, tokens: usize, secs: f64) {
        if batch == 0 || tokens < batch || !(secs.is_finite() && secs > 0.0) {
            return;
        }
        let width = tokens as f64 / batch as f64 - 1.0;
        let window = width.round() as usize;
        let here = self.cost(batch, width).value;
        let there = self.cost(batch, window as f64).value;
        let secs = if here > 0.0 { secs * there / here } else { secs };
        if let Some(profile) = &self.profile {
            let ratio = secs / profile.cost(batch, window as f64).value;
            if ratio.is_finite() && ratio > 0.0 {
                self.scale = lerp(self.scale, ratio, STEP_EMA);
            }
        }
        let (b, scale) = (batch as f64, self.scale);
        self.cells
            .entry((bucket(b), window))
            .and_modify(|c| {
                // A profile's cell starts from its scaled time, as the estimates read it.
                if c.online == 0 {
                    c.secs *= scale;
                }
                c.batch = lerp(c.batch, b, STEP_EMA);
                c.secs = lerp(c.secs, secs, STEP_EMA);
                c.online += 1;
            })
            .or_insert(Cell {
                batch: b,
                secs,
                samples: 0,
                online: 1,
            });
        self.observed += 1;
    }

    /// The estimated time of a step of `batch` sequences running `1 + window` tokens each; a fractional window (a
    /// step whose sequences verify different windows) lies between the whole ones around it.
    pub fn cost(&self, batch: usize, window: f64) -> Cost {
        let window = window.max(0.0);
        let (lo, f) = (window.floor() as usize, window.fract());
        let at = |t: usize| self.whole(batch.max(1) as f64, t);
        let value = if f > 0.0 { lerp(at(lo), at(lo + 1), f) } else { at(lo) };
        Cost {
            value,
            measured: self.measured(),
        }
    }

    /// The time at a whole window: the running maximum over the windows up to `t`, so it never falls as `t` grows.
    fn whole(&self, batch: f64, t: usize) -> f64 {
        if self.cells.is_empty() {
            return prior(batch, (1 + t) as f64, self.knee);
        }
        (0..=t).map(|w| self.raw(batch, w)).fold(0.0, f64::max)
    }

    /// The time at window `t` before the maximum over smaller windows: from `t`'s own points when they span the
    /// batch, else linearly in tokens between the nearest windows whose points do, else the nearest such window's
    /// carried by the prior. Only when no window's points span the batch is a window's time carried past its points
    /// in the batch: a window the server measured only alone says little about its cost in a crowd, where the
    /// windows measured around it say more.
    fn raw(&self, batch: f64, t: usize) -> f64 {
        let all: BTreeSet<usize> = self.cells.keys().map(|&(_, w)| w).collect();
        let b = bucket(batch);
        let spanning: BTreeSet<usize> = all.iter().copied().filter(|&w| self.spans(w, b)).collect();
        let windows = if spanning.is_empty() { all } else { spanning };
        if windows.contains(&t) {
            return self.in_batch(batch, t);
        }
        let below = windows.range(..t).next_back().copied();
        let above = windows.range(t + 1..).next().copied();
        let n = |w: usize| (1 + w) as f64;
        match (below, above) {
            (Some(a), Some(b)) => lerp(
                self.in_batch(batch, a),
                self.in_batch(batch, b),
                (n(t) - n(a)) / (n(b) - n(a)),
            ),
            (Some(w), None) | (None, Some(w)) => {
                self.in_batch(batch, w) * prior(batch, n(t), self.knee) / prior(batch, n(w), self.knee)
            }
            (None, None) => prior(batch, n(t), self.knee),
        }
    }

    /// Whether window `w`'s points reach batch bucket `b` from both sides (or lie in it).
    fn spans(&self, w: usize, b: u32) -> bool {
        let mut buckets = self.cells.keys().filter(|&&(_, x)| x == w).map(|&(k, _)| k);
        let first = buckets.next();
        let last = buckets.next_back().or(first);
        matches!((first, last), (Some(lo), Some(hi)) if lo <= b && b <= hi)
    }

    /// The time at window `t` (which has points) and `batch`: linear between the nearest measured batches, the
    /// nearest one's carried by the prior outside them. The points are first made non-decreasing in the batch.
    fn in_batch(&self, batch: f64, t: usize) -> f64 {
        let mut points: Vec<(f64, f64)> = self
            .cells
            .iter()
            .filter(|(&(_, w), _)| w == t)
            .map(|(_, c)| (c.batch, if c.online > 0 { c.secs } else { c.secs * self.scale }))
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut top = 0.0f64;
        for p in &mut points {
            top = top.max(p.1);
            p.1 = top;
        }
        let tokens = (1 + t) as f64;
        let carry = |(b, s): (f64, f64)| s * prior(batch, tokens, self.knee) / prior(b, tokens, self.knee);
        match points.iter().position(|p| p.0 >= batch) {
            None => carry(*points.last().expect("a window with points")),
            Some(0) => carry(points[0]),
            Some(i) => {
                let ((b0, s0), (b1, s1)) = (points[i - 1], points[i]);
                lerp(s0, s1, (batch - b0) / (b1 - b0))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(points: &[(usize, usize, f64)]) -> StepProfile {
        StepProfile {
            step_profile_version: PROFILE_VERSION,
            device: "test".into(),
            model: "test".into(),
            decode_form: "replay".into(),
            context: 16,
            points: points
                .iter()
                .map(|&(batch, window, step_ms)| StepPoint { batch, window, step_ms })
                .collect(),
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
    }

    #[test]
    fn the_prior_is_flat_below_the_knee_and_linear_above() {
        let m = StepCostModel::new(None, 64);
        assert_eq!(m.source(), CostSource::Prior);
        assert!(!m.cost(1, 0.0).measured);
        assert_eq!(m.cost(1, 0.0).value, 1.0);
        assert_eq!(m.cost(8, 7.0).value, 1.0, "64 tokens: still at the knee");
        assert_eq!(m.cost(64, 0.0).value, 1.0);
        assert_eq!(m.cost(64, 1.0).value, 2.0);
        assert_eq!(m.cost(128, 3.0).value, 8.0);
    }

    #[test]
    fn measured_points_interpolate_in_batch_and_window() {
        // Decode: 10 ms at batch 1, 20 ms at batch 64; verify T = 4: 12 ms and 40 ms.
        let m = StepCostModel::new(
            Some(&profile(&[(1, 0, 10.0), (64, 0, 20.0), (1, 4, 12.0), (64, 4, 40.0)])),
            64,
        );
        assert_eq!(m.source(), CostSource::Profile);
        let s = |b, t: f64| m.cost(b, t).seconds().expect("measured");
        assert!(close(s(1, 0.0), 0.010));
        assert!(close(s(64, 4.0), 0.040));
        // Halfway in batch: halfway in time.
        assert!(close(s(32, 0.0), 0.010 + 0.010 * 31.0 / 63.0), "{}", s(32, 0.0));
        // T = 2 at batch 64: halfway in tokens between 1 and 5.
        assert!(close(s(64, 2.0), 0.030), "{}", s(64, 2.0));
        // A fractional window lies between the whole ones.
        let mid = s(64, 2.5);
        assert!(s(64, 2.0) < mid && mid < s(64, 3.0));
        // Past the last measured batch the prior's shape carries it: 128 × 5 tokens is 2.5× 64 × 5 tokens' 5.
        assert!(close(s(128, 4.0), 0.040 * 10.0 / 5.0), "{}", s(128, 4.0));
        // Past the last measured window too.
        assert!(close(s(64, 6.0), 0.040 * 7.0 / 5.0), "{}", s(64, 6.0));
    }

    #[test]
    fn estimates_never_fall_as_batch_or_window_grows() {
        // Noisy points: batch 16 measured faster than batch 8, T = 2 faster than T = 1.
        let m = StepCostModel::new(
            Some(&profile(&[
                (8, 0, 10.0),
                (16, 0, 9.0),
                (32, 0, 12.0),
                (8, 1, 15.0),
                (8, 2, 14.0),
            ])),
            64,
        );
        let mut last = 0.0;
        for b in 1..=64 {
            let s = m.cost(b, 0.0).value;
            assert!(s >= last, "batch {b}: {s} < {last}");
            last = s;
        }
        for b in [1, 8, 20, 64] {
            let mut last = 0.0;
            for t in 0..=6 {
                let s = m.cost(b, t as f64).value;
                assert!(s >= last, "batch {b}, T = {t}: {s} < {last}");
                last = s;
            }
        }
    }

    #[test]
    fn online_steps_move_the_estimates() {
        let mut m = StepCostModel::new(Some(&profile(&[(64, 0, 20.0), (64, 4, 22.0)])), 64);
        let before = m.cost(64, 4.0).seconds().expect("measured");
        for _ in 0..100 {
            // 64 sequences verifying 5 tokens each, 60 ms a step.
            m.observe(64, 64 * 5, 0.060);
        }
        assert_eq!(m.source(), CostSource::Online);
        assert_eq!(m.observed(), 100);
        let after = m.cost(64, 4.0).seconds().expect("measured");
        assert!(
            close(before, 0.022) && (after - 0.060).abs() < 1e-3,
            "{before} → {after}"
        );
        // Unmeasured, the decode step is taken to be as much slower than the profile says as the verifies were.
        assert!((m.scale() - 60.0 / 22.0).abs() < 1e-2, "{}", m.scale());
        assert!(close(m.cost(64, 0.0).value, 0.020 * m.scale()));
        // Measured, it is what it was measured at.
        for _ in 0..100 {
            m.observe(64, 64, 0.020);
        }
        assert!(
            (m.cost(64, 0.0).value - 0.020).abs() < 1e-4,
            "{}",
            m.cost(64, 0.0).value
        );
        assert!(
            (m.cost(64, 4.0).value - 0.060).abs() < 1e-3,
            "{}",
            m.cost(64, 4.0).value
        );
        // A first step in an empty model sets its cell at once, and the model is measured from then on.
        let mut m = StepCostModel::new(None, 64);
        m.observe(4, 4, 0.005);
        assert!(close(m.cost(4, 0.0).seconds().expect("measured"), 0.005));
        // Nonsense is ignored.
        m.observe(0, 0, 1.0);
        m.observe(4, 8, f64::NAN);
        m.observe(4, 2, 1.0);
        assert_eq!(m.observed(), 1);
    }

    #[test]
    fn a_server_faster_than_its_profile_scales_the_points_it_did_not_measure() {
        // The profile says decode 1 ms, verify 1.1 ms; this server decodes in 0.1 ms.
        let mut m = StepCostModel::new(Some(&profile(&[(1, 0, 1.0), (1, 4, 1.1)])), 64);
        for _ in 0..100 {
            m.observe(1, 1, 0.0001);
        }
        assert!((m.scale() - 0.1).abs() < 1e-3, "{}", m.scale());
        let (decode, verify) = (m.cost(1, 0.0).value, m.cost(1, 4.0).value);
        assert!((verify / decode - 1.1).abs() < 1e-2, "{decode} {verify}");
        // Without a profile there is nothing to scale.
        let mut m = StepCostModel::new(None, 64);
        m.observe(1, 1, 0.0001);
        assert_eq!(m.scale(), 1.0);
    }

    #[test]
    fn a_window_measured_only_alone_says_little_about_a_crowd() {
        // Verifies are cheap alone and dear at batch 8; the server has also measured T = 1 alone.
        let mut m = StepCostModel::new(
            Some(&profile(&[(1, 0, 1.0), (1, 4, 1.1), (8, 0, 1.0), (8, 4, 1000.0)])),
            64,
        );
        m.observe(1, 2, 0.001);
        // At batch 8, T = 1 lies a quarter of the way (in tokens) from the decode step to T = 4, not at its lone cost.
        let t1 = m.cost(8, 1.0).value;
        assert!((t1 - (0.001 + 0.999 * 0.25) * m.scale()).abs() < 1e-3, "{t1}");
        // Alone it is what was measured.
        assert!((m.cost(1, 1.0).value - 0.001).abs() < 1e-9);
    }

    #[test]
    fn a_mixed_step_counts_as_the_nearest_whole_window() {
        // Flat decode, verify cost linear in tokens: 10 ms a token per sequence at batch 10.
        let mut m = StepCostModel::new(Some(&profile(&[(10, 0, 10.0), (10, 2, 30.0)])), 64);
        // 10 sequences, 28 tokens: window 1.8, counted as T = 2; at the model's slope 28 tokens cost 28 ms, so a
        // measured 28 ms is 30 ms at T = 2 (the cell does not move).
        m.observe(10, 28, 0.028);
        assert!(close(m.cost(10, 2.0).value, 0.030), "{}", m.cost(10, 2.0).value);
    }

    #[test]
    fn profiles_round_trip_and_bad_files_name_the_path_and_field() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("profile.json");
        let p = profile(&[(1, 0, 1.5), (1, 4, 1.7)]);
        p.save(&path).expect("save");
        assert_eq!(StepProfile::load(&path).expect("load"), p);

        let missing = dir.path().join("nope.json");
        let e = StepProfile::load(&missing).unwrap_err().to_string();
        assert!(e.contains("nope.json") && e.contains("step profile"), "{e}");

        let write = |text: &str| {
            std::fs::write(&path, text).expect("write");
            StepProfile::load(&path).unwrap_err().to_string()
        };
        let e = write("{ not json");
        assert!(e.contains("profile.json") && e.contains("malformed JSON"), "{e}");
        let e = write(r#"{"step_profile_version": 1, "points": [{"batch": 1, "window": 0}]}"#);
        assert!(e.contains("profile.json") && e.contains("step_ms"), "{e}");
        let e = write(r#"{"points": []}"#);
        assert!(e.contains("step_profile_version"), "{e}");
        let e = write(r#"{"step_profile_version": 2, "points": [{"batch": 1, "window": 0, "step_ms": 1}]}"#);
        assert!(
            e.contains("field `step_profile_version`") && e.contains("version 2"),
            "{e}"
        );
        let e = write(r#"{"step_profile_version": 1, "points": []}"#);
        assert!(e.contains("field `points`"), "{e}");
        let e = write(
            r#"{"step_profile_version": 1, "points": [{"batch": 1, "window": 0, "step_ms": 1}, {"batch": 0, "window": 0, "step_ms": 1}]}"#,
        );
        assert!(e.contains("field `points[1].batch`"), "{e}");
        let e = write(r#"{"step_profile_version": 1, "points": [{"batch": 1, "window": 0, "step_ms": -1}]}"#);
        assert!(e.contains("field `points[0].step_ms`"), "{e}");
    }
}
