//! Fault injection, a testing aid: `--inject-fault RANK:KIND@STEP` makes rank `RANK` fail the coordinator's step
//! number `STEP` (counted from 1 over the engine's life, across recoveries) in one of four ways. Each spec fires
//! once; repeat a spec at consecutive steps to exercise the retry limit. `kill` and `abort` end the rank's whole
//! process, so they are only accepted when ranks run in worker processes of their own (`--rank-processes`).

use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{EngineError, Result};

/// How an injected fault fails the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// The rank's thread panics inside the step.
    Panic,
    /// The rank stops answering until its generation is aborted (the coordinator's step deadline).
    Hang,
    /// The rank returns an error.
    Error,
    /// The rank's answer carries non-finite logits.
    Nan,
    /// The rank's process SIGKILLs itself (a worker process lost to the OOM killer, say).
    Kill,
    /// The rank's process calls `abort()` (a crash: SIGABRT, as a failed assertion in a C library raises).
    Abort,
}

impl FaultKind {
    /// Whether the fault ends the rank's whole process (which must then be a worker process of its own).
    pub fn ends_process(self) -> bool {
        matches!(self, FaultKind::Kill | FaultKind::Abort)
    }
}

impl std::fmt::Display for FaultKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FaultKind::Panic => "panic",
            FaultKind::Hang => "hang",
            FaultKind::Error => "error",
            FaultKind::Nan => "nan",
            FaultKind::Kill => "kill",
            FaultKind::Abort => "abort",
        })
    }
}

/// One `RANK:KIND@STEP`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FaultSpec {
    pub rank: usize,
    pub kind: FaultKind,
    /// The coordinator's step number, from 1.
    pub step: u64,
}

impl FromStr for FaultSpec {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: &str| {
            EngineError::InvalidInput(format!(
                "--inject-fault {s:?}: {why} (expected RANK:KIND@STEP, KIND one of panic, hang, error, nan, kill, abort, e.g. 0:panic@5)"
            ))
        };
        let (rank, rest) = s.split_once(':').ok_or_else(|| bad("no ':'"))?;
        let (kind, step) = rest.split_once('@').ok_or_else(|| bad("no '@'"))?;
        let rank = rank
            .trim()
            .parse::<usize>()
            .map_err(|_| bad("RANK is not a rank number"))?;
        let kind = match kind.trim() {
            "panic" => FaultKind::Panic,
            "hang" => FaultKind::Hang,
            "error" => FaultKind::Error,
            "nan" => FaultKind::Nan,
            "kill" => FaultKind::Kill,
            "abort" => FaultKind::Abort,
            _ => return Err(bad("unknown KIND")),
        };
        let step = step
            .trim()
            .parse::<u64>()
            .map_err(|_| bad("STEP is not a step number"))?;
        if step == 0 {
            return Err(bad("steps are counted from 1"));
        }
        Ok(FaultSpec { rank, kind, step })
    }
}

impl std::fmt::Display for FaultSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}@{}", self.rank, self.kind, self.step)
    }
}

/// The faults of one engine, shared by every generation of its ranks (so a fault fires once, not once per restart).
#[derive(Debug, Default)]
pub struct Faults {
    specs: Vec<FaultSpec>,
    fired: Vec<AtomicBool>,
}

impl Faults {
    /// Faults from their specs; every spec's rank must be below `tp`.
    pub fn new(specs: Vec<FaultSpec>, tp: usize) -> Result<Self> {
        if let Some(s) = specs.iter().find(|s| s.rank >= tp) {
            return Err(EngineError::InvalidInput(format!(
                "--inject-fault {s}: rank {} does not exist (tp {tp})",
                s.rank
            )));
        }
        let fired = specs.iter().map(|_| AtomicBool::new(false)).collect();
        Ok(Faults { specs, fired })
    }

    /// No faults.
    pub fn none() -> Self {
        Self::default()
    }

    /// The fault rank `rank` injects into step `step`, marking it fired.
    pub fn take(&self, rank: usize, step: u64) -> Option<FaultKind> {
        self.specs
            .iter()
            .zip(&self.fired)
            .find(|(s, fired)| s.rank == rank && s.step == step && !fired.swap(true, Ordering::SeqCst))
            .map(|(s, _)| s.kind)
    }

    /// The specs.
    pub fn specs(&self) -> &[FaultSpec] {
        &self.specs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_fire_once() {
        let k: FaultSpec = "0:kill@3".parse().expect("parse");
        assert!(k.kind.ends_process() && !FaultKind::Panic.ends_process());
        assert_eq!("1:abort@2".parse::<FaultSpec>().expect("parse").kind, FaultKind::Abort);
        let s: FaultSpec = "1:hang@12".parse().expect("parse");
        assert_eq!(
            s,
            FaultSpec {
                rank: 1,
                kind: FaultKind::Hang,
                step: 12
            }
        );
        assert_eq!(s.to_string(), "1:hang@12");
        for bad in ["", "1", "1:hang", "x:hang@1", "1:boom@1", "1:nan@0", "1:nan@x"] {
            let e = bad.parse::<FaultSpec>().expect_err(bad).to_string();
            assert!(e.contains("RANK:KIND@STEP"), "{e}");
        }
        let f = Faults::new(vec![s, s], 2).expect("faults");
        assert_eq!(f.take(0, 12), None);
        assert_eq!(f.take(1, 11), None);
        assert_eq!(f.take(1, 12), Some(FaultKind::Hang));
        assert_eq!(f.take(1, 12), Some(FaultKind::Hang));
        assert_eq!(f.take(1, 12), None);
        assert!(Faults::new(vec![s], 1)
            .expect_err("rank 1 of 1")
            .to_string()
            .contains("does not exist"));
    }
}
