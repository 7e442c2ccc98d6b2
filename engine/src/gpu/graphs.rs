//! CUDA graphs of a rank's decode and verify steps: the device work of a step (embedding, every block, the final
//! norm and the LM head's summaries) is captured once per step shape and replayed with the step's inputs uploaded
//! into the same scratch buffers, so a steady-state step costs one graph launch instead of hundreds of kernel
//! launches; the uploads before it and the summary read-back after it stay outside.
//!
//! A shape is captured the second time it is seen: the first run is eager, which warms every lazily-initialised
//! library path (cuBLAS heuristics, module loading) outside a capture and keeps one-off shapes from costing a capture.
//! Everything a captured launch reads is a buffer the rank owns for its lifetime (weights, pools, scratch, the
//! attention and cuBLAS workspaces), so a graph never goes stale; at most [`MAX_GRAPHS`] are kept, the least recently
//! used dropped first. Prompt chunks are not captured (their shapes rarely repeat).
//!
//! The MTP layer's work after a step (`gpu/mtp.rs`) is captured in the same cache under its own keys: the draft loop
//! (every draft step's head, pick and layer forward) by the jobs drafting at each step, and a catch-up launch of
//! equal-length jobs by its shape; a prompt's catch-up in pieces runs eagerly, as prompt chunks do.
//!
//! `--no-cuda-graphs` runs every step eagerly (for debugging and for the before/after benchmark); so does
//! `REWIND_CUDA_SYNC=1`, which synchronises after every launch and so cannot be captured. Each case is logged at load
//! and shows in the rank's health (`GraphStats::enabled`). Tensor-parallel ranks capture their NCCL all-reduces
//! inside the graph (each rank's capture is thread-local, so the other ranks' uploads do not disturb it).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use rewind_kernels::cuda::{CudaGraph, CudaStream, GraphCaptureMode, GraphInstantiateFlags};
use tracing::debug;

use super::forward::{SsmRun, Step};
use crate::error::{EngineError, Result};
use crate::rank::GraphStats;

/// Graphs kept per rank: a batch size's decode and verify shapes at a few ring fills, for a few dozen batch sizes.
pub(crate) const MAX_GRAPHS: usize = 256;

/// Ring fills are rounded up to a multiple of this in a captured step, so a replay ring that grows one entry a step
/// reuses a graph for several steps (the kernels loop over each row's own ring; `max_m` only sizes shared memory).
pub(crate) const RING_BUCKET: usize = 4;

/// What fixes a captured piece of device work's launches.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum GraphKey {
    /// A decode or verify step of the target.
    Step(StepKey),
    /// A catch-up launch of the MTP layer: `seqs` jobs of `t` rows each (`rows` in all), gathered, run through the
    /// layer, and the drafting jobs' last outputs handed on (`gpu/mtp.rs`).
    MtpCatchUp { rows: usize, seqs: usize, t: usize },
    /// The MTP draft loop: how many jobs draft at each draft step (non-increasing, the drafting jobs a prefix).
    MtpDraft { active: Vec<usize> },
}

/// What fixes a captured target step's launches: its shape and what the head computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct StepKey {
    rows: usize,
    seqs: usize,
    t: usize,
    /// 0 for the recurrent and baseline kernels, else the (bucketed) ring fill of the replay kernels.
    max_m: usize,
    /// The SSM layers run the speculative baseline (a verify of recurrent rows, writing snapshots) rather than the
    /// recurrent step or the replay kernels.
    baseline: bool,
    head_rows: usize,
    whole: bool,
}

impl GraphKey {
    /// The key of a decode or verify step (`None` for a prompt chunk, which runs eagerly).
    pub(crate) fn of(step: &Step, head_rows: usize, whole: bool) -> Option<Self> {
        let (max_m, baseline) = match step.ssm {
            SsmRun::Recurrent => (0, false),
            SsmRun::Baseline => (0, true),
            SsmRun::Replay {
                max_m, prompt: false, ..
            } => (max_m, false),
            SsmRun::Replay { prompt: true, .. } | SsmRun::Chunked { .. } => return None,
        };
        Some(GraphKey::Step(StepKey {
            rows: step.rows,
            seqs: step.seqs,
            t: step.t,
            max_m,
            baseline,
            head_rows,
            whole,
        }))
    }

    /// Whether the key is one of the MTP layer's.
    fn is_mtp(&self) -> bool {
        !matches!(self, GraphKey::Step(_))
    }
}

/// Rounds a replay step's ring fill up to its bucket (at most the ring's rows), so that captured steps share graphs.
pub(crate) fn bucket_ring(step: &mut Step) {
    if let SsmRun::Replay {
        max_m, prompt: false, ..
    } = &mut step.ssm
    {
        *max_m = max_m
            .div_ceil(RING_BUCKET)
            .saturating_mul(RING_BUCKET)
            .min(step.ring_rows)
            .max(*max_m);
    }
}

/// A captured step; `CudaGraph` holds raw driver handles, which the rank's one thread owns and uses.
struct Held {
    graph: CudaGraph,
    last_use: u64,
}

/// The rank's captured steps.
pub(crate) struct StepGraphs {
    enabled: bool,
    seen: HashSet<GraphKey>,
    graphs: HashMap<GraphKey, Held>,
    clock: u64,
    stats: GraphStats,
}

// SAFETY: the graphs are created, launched and destroyed by whichever thread owns the rank, never concurrently
// (a rank is driven by one thread at a time through `&mut`); CUDA graph objects need only that external
// serialisation.
unsafe impl Send for StepGraphs {}

impl StepGraphs {
    pub(crate) fn new(enabled: bool) -> Self {
        StepGraphs {
            enabled,
            seen: HashSet::new(),
            graphs: HashMap::new(),
            clock: 0,
            stats: GraphStats {
                enabled,
                ..GraphStats::default()
            },
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// Destroys every captured graph (the counters stay). A rank does this before its NCCL communicator goes: NCCL
    /// frees a communicator only once every graph that captured its collectives is destroyed, and waits for that.
    pub(crate) fn clear(&mut self) {
        self.graphs.clear();
        self.seen.clear();
    }

    /// Destroys the MTP layer's graphs (a buffer they read was reallocated), keeping the target's steps.
    pub(crate) fn clear_mtp(&mut self) {
        self.graphs.retain(|k, _| !k.is_mtp());
        self.seen.retain(|k| !k.is_mtp());
    }

    pub(crate) fn stats(&self) -> GraphStats {
        self.stats
    }

    /// Runs a step's device work `work` for `key`: a replay of its graph, a capture then a replay (second sighting),
    /// or eagerly (first sighting, graphs off, or a prompt chunk). `work` must queue only device work on `stream`: no
    /// host copies, allocations or synchronisation.
    pub(crate) fn run(
        &mut self,
        key: Option<GraphKey>,
        stream: &Arc<CudaStream>,
        work: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let key = match key {
            Some(k) if self.enabled => k,
            Some(_) => {
                self.stats.eager += 1;
                return work();
            }
            None => return work(),
        };
        let mtp = key.is_mtp();
        self.clock += 1;
        if let Some(held) = self.graphs.get_mut(&key) {
            held.last_use = self.clock;
            self.stats.replayed += 1;
            self.stats.mtp_replayed += u64::from(mtp);
            return held
                .graph
                .launch()
                .map_err(|e| EngineError::Gpu(format!("replaying the step graph for {key:?}: {e}")));
        }
        if self.seen.insert(key.clone()) {
            self.stats.eager += 1;
            return work();
        }
        stream
            .begin_capture(GraphCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| EngineError::Gpu(format!("starting to capture a step graph: {e}")))?;
        let worked = work();
        // The capture must end whatever happened, or the stream stays in capture mode.
        let ended = stream.end_capture(GraphInstantiateFlags(0));
        worked?;
        let graph = ended
            .map_err(|e| EngineError::Gpu(format!("capturing the step graph for {key:?}: {e}")))?
            .ok_or_else(|| EngineError::Gpu(format!("capturing the step graph for {key:?} recorded nothing")))?;
        // The captured work has not run yet: this launch is the step.
        graph
            .launch()
            .map_err(|e| EngineError::Gpu(format!("launching the new step graph for {key:?}: {e}")))?;
        self.stats.captured += 1;
        self.stats.mtp_captured += u64::from(mtp);
        debug!(?key, graphs = self.graphs.len() + 1, "captured a step graph");
        if self.graphs.len() >= MAX_GRAPHS {
            if let Some(old) = self
                .graphs
                .iter()
                .min_by_key(|(_, h)| h.last_use)
                .map(|(k, _)| k.clone())
            {
                self.graphs.remove(&old);
                self.stats.evicted += 1;
            }
        }
        self.graphs.insert(
            key,
            Held {
                graph,
                last_use: self.clock,
            },
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replay_step(max_m: usize, ring_rows: usize) -> Step {
        Step {
            rows: 8,
            seqs: 8,
            t: 1,
            clamp: false,
            ssm: SsmRun::Replay {
                max_m,
                piece: 1,
                prompt: false,
            },
            ring_rows,
            conv_rows: 4,
        }
    }

    fn max_m(step: &Step) -> usize {
        match step.ssm {
            SsmRun::Replay { max_m, .. } => max_m,
            _ => unreachable!(),
        }
    }

    /// The MTP layer's keys are its own: a draft loop by its jobs per step, a catch-up by its shape, neither ever
    /// a target step's; only they are dropped with the MTP graphs.
    #[test]
    fn mtp_keys_tell_loops_and_catch_ups_apart() {
        let draft = |active: &[usize]| GraphKey::MtpDraft {
            active: active.to_vec(),
        };
        assert_eq!(draft(&[4, 4, 4]), draft(&[4, 4, 4]));
        assert_ne!(draft(&[4, 4, 4]), draft(&[4, 4, 3]));
        assert_ne!(draft(&[4, 4, 4]), draft(&[4, 4]));
        let catch_up = GraphKey::MtpCatchUp { rows: 8, seqs: 4, t: 2 };
        assert_ne!(catch_up, GraphKey::MtpCatchUp { rows: 8, seqs: 8, t: 1 });
        let step = GraphKey::of(&replay_step(4, 20), 8, false).expect("a decode step's key");
        assert!(draft(&[8]).is_mtp() && catch_up.is_mtp() && !step.is_mtp());
    }

    #[test]
    fn ring_fills_round_up_within_the_ring() {
        for (m, rows, want) in [
            (1, 20, 4),
            (4, 20, 4),
            (5, 20, 8),
            (17, 20, 20),
            (18, 18, 18),
            (19, 18, 19),
        ] {
            let mut s = replay_step(m, rows);
            bucket_ring(&mut s);
            assert_eq!(max_m(&s), want, "{m} {rows}");
        }
        // Recurrent steps and prompts keep their shape.
        let mut s = replay_step(3, 20);
        s.ssm = SsmRun::Recurrent;
        bucket_ring(&mut s);
        assert!(matches!(s.ssm, SsmRun::Recurrent));
    }

    #[test]
    fn prompts_are_not_captured_and_keys_tell_shapes_apart() {
        let mut prompt = replay_step(3, 20);
        prompt.ssm = SsmRun::Replay {
            max_m: 3,
            piece: 1,
            prompt: true,
        };
        assert_eq!(GraphKey::of(&prompt, 1, false), None);
        let mut chunked = replay_step(3, 20);
        chunked.ssm = SsmRun::Chunked { slot: 0 };
        assert_eq!(GraphKey::of(&chunked, 1, false), None);
        let a = GraphKey::of(&replay_step(4, 20), 8, false);
        assert!(a.is_some());
        assert_ne!(a, GraphKey::of(&replay_step(8, 20), 8, false));
        assert_ne!(a, GraphKey::of(&replay_step(4, 20), 8, true));
        assert_ne!(a, GraphKey::of(&replay_step(4, 20), 1, false));
        // A verify of recurrent rows (the baseline, writing snapshots) never replays a recurrent decode's graph.
        let (mut recurrent, mut baseline) = (replay_step(4, 20), replay_step(4, 20));
        recurrent.ssm = SsmRun::Recurrent;
        baseline.ssm = SsmRun::Baseline;
        let b = GraphKey::of(&baseline, 8, false);
        assert!(b.is_some());
        assert_ne!(b, GraphKey::of(&recurrent, 8, false));
    }
}
