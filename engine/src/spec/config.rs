//! The speculative-decoding settings (`--spec`, `--spec-window`, `--spec-policy`, `--spec-profile`, the n-gram range)
//! and their checks, made before anything loads.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use super::step_cost::StepProfile;
use crate::error::{EngineError, Result};

/// Which drafter proposes tokens.
#[derive(Clone, Debug, PartialEq)]
pub enum DrafterKind {
    /// Prompt lookup: the longest recent n-gram (n in `min_n..=max_n`) that occurred earlier in the prompt or the
    /// generated text proposes what followed it.
    Ngram { min_n: usize, max_n: usize },
    /// The checkpoint's own multi-token-prediction layer(s).
    Mtp,
    /// A separate, smaller checkpoint with the same tokenizer.
    Draft(PathBuf),
    /// A benchmarking tool: the target's own greedy continuation (computed once without speculation), each token
    /// corrupted with probability `p`, so acceptance is controlled on random-weight models.
    Oracle { p: f64 },
}

/// Default n-gram range of the prompt-lookup drafter.
pub const NGRAM_MIN: usize = 1;
pub const NGRAM_MAX: usize = 3;

impl DrafterKind {
    /// The name `--spec` uses.
    pub fn name(&self) -> &'static str {
        match self {
            DrafterKind::Ngram { .. } => "ngram",
            DrafterKind::Mtp => "mtp",
            DrafterKind::Draft(_) => "draft",
            DrafterKind::Oracle { .. } => "oracle",
        }
    }

    /// Parses a `--spec` value: `none` (no speculation), `ngram`, `mtp`, `draft:DIR` or `oracle:P`.
    pub fn parse_flag(s: &str) -> Result<Option<DrafterKind>> {
        if s == "none" {
            return Ok(None);
        }
        s.parse().map(Some)
    }
}

impl fmt::Display for DrafterKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DrafterKind::Ngram { min_n, max_n } => write!(f, "ngram (n {min_n}..={max_n})"),
            DrafterKind::Mtp => f.write_str("mtp"),
            DrafterKind::Draft(dir) => write!(f, "draft:{}", dir.display()),
            DrafterKind::Oracle { p } => write!(f, "oracle:{p}"),
        }
    }
}

impl FromStr for DrafterKind {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: String| Err(EngineError::InvalidInput(why));
        match s.split_once(':') {
            None if s == "ngram" => Ok(DrafterKind::Ngram {
                min_n: NGRAM_MIN,
                max_n: NGRAM_MAX,
            }),
            None if s == "mtp" => Ok(DrafterKind::Mtp),
            None if s == "draft" => bad("--spec draft needs the draft model's directory: draft:DIR".into()),
            None if s == "oracle" => bad("--spec oracle needs a corruption probability: oracle:P, P in [0, 1]".into()),
            Some(("draft", dir)) if !dir.is_empty() => Ok(DrafterKind::Draft(PathBuf::from(dir))),
            Some(("oracle", p)) => match p.parse::<f64>() {
                Ok(p) if (0.0..=1.0).contains(&p) => Ok(DrafterKind::Oracle { p }),
                _ => bad(format!("oracle:P needs P in [0, 1], got `{p}`")),
            },
            _ => bad(format!(
                "unknown drafter `{s}` (expected none, ngram, mtp, draft:DIR or oracle:P)"
            )),
        }
    }
}

/// How each step's window is chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SpecPolicy {
    /// Always up to `T` drafts.
    #[default]
    Fixed,
    /// The window with the most expected tokens per second for the measured acceptance and step times (see
    /// [`super::window`]): fewer drafts, down to none, where verifying costs more than it yields.
    Adaptive,
}

impl FromStr for SpecPolicy {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "fixed" => Ok(SpecPolicy::Fixed),
            "adaptive" => Ok(SpecPolicy::Adaptive),
            _ => Err(EngineError::InvalidInput(format!(
                "unknown speculation policy `{s}` (expected fixed or adaptive)"
            ))),
        }
    }
}

impl fmt::Display for SpecPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SpecPolicy::Fixed => "fixed",
            SpecPolicy::Adaptive => "adaptive",
        })
    }
}

/// Speculative decoding as configured.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecConfig {
    pub drafter: DrafterKind,
    /// The most drafts per step (`T`, ≥ 1); a verify runs `1 + T` tokens.
    pub window: usize,
    pub policy: SpecPolicy,
    /// The measured step times the adaptive policy starts from (`--spec-profile`); `None`: the analytic prior until
    /// the server has measured its own steps.
    pub profile: Option<StepProfile>,
}

impl SpecConfig {
    /// Checks the settings against an input ring of `buffer_len` entries: a verify of `1 + T` tokens needs
    /// `L ≥ 2 (1 + T)` (the flush rule `h + 2T > L` decides one window early).
    pub fn validate(&self, buffer_len: usize) -> Result<()> {
        if self.window == 0 {
            return Err(EngineError::InvalidInput(
                "--spec-window must be at least 1 (the drafts per step); use --spec none to decode without \
                 speculation"
                    .into(),
            ));
        }
        let need = 2 * (self.window + 1);
        if need > buffer_len {
            return Err(EngineError::InvalidInput(format!(
                "--spec-window {} needs an input ring of at least {need} entries (a verify of {} tokens, L ≥ 2·(1 + T)); \
                 the ring holds {buffer_len} (--buffer-len)",
                self.window,
                self.window + 1
            )));
        }
        if self.profile.is_some() && self.policy != SpecPolicy::Adaptive {
            return Err(EngineError::InvalidInput(format!(
                "--spec-profile only applies to --spec-policy adaptive (the {} policy always drafts up to T)",
                self.policy
            )));
        }
        if let DrafterKind::Ngram { min_n, max_n } = self.drafter {
            if min_n == 0 || min_n > max_n {
                return Err(EngineError::InvalidInput(format!(
                    "the n-gram range must satisfy 1 ≤ min ≤ max, got {min_n}..={max_n}"
                )));
            }
        }
        Ok(())
    }

    /// The verify window the ranks must accept (`1 + T` tokens).
    pub fn max_verify(&self) -> usize {
        self.window + 1
    }
}
