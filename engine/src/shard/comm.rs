//! Collectives between tensor-parallel ranks: the [`Communicator`] trait and [`LocalComm`], its in-process CPU
//! implementation (ranks are threads of one process), which lets TP correctness be tested without GPUs.
//!
//! The trait follows NCCL's semantics so the NCCL implementation is a thin wrapper: every rank issues the same
//! collectives in the same order with the same element counts; an all-reduce leaves the same values on every rank;
//! an all-gather takes equal-sized contributions (callers pad uneven slices).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::error::{EngineError, Result};

/// The collectives a tensor-parallel forward pass needs.
///
/// Not `Send`-bound: an NCCL communicator lives on its rank's thread.
pub trait Communicator {
    /// This rank's index, `0..size()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn size(&self) -> usize;

    /// Sums `buf` element-wise over all ranks, in place; every rank ends with the same values.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;

    /// Concatenates every rank's `send` in rank order into `recv` (`recv.len() == send.len() · size()`); every rank
    /// must send the same number of elements.
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<()>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
}

/// Which collective a rank entered, to catch ranks that disagree (NCCL would hang or corrupt memory instead).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    AllReduce(usize),
    AllGather(usize),
    Barrier,
}

struct Rendezvous {
    /// Each rank's contribution to the current collective.
    slots: Vec<Vec<f32>>,
    ops: Vec<Option<Op>>,
    arrived: usize,
    generation: u64,
    /// Set when a rank aborted (or panicked while holding its communicator); every later call fails.
    aborted: Option<String>,
}

struct Shared {
    size: usize,
    state: Mutex<Rendezvous>,
    cv: Condvar,
}

/// One rank's handle on an in-process group; create the group with [`LocalComm::group`] and move one handle into
/// each rank's thread.
///
/// Each collective is two barriers: ranks deposit their contributions, meet, read everyone's (summing in rank order,
/// so every rank computes bit-identical results), and meet again before the slots can be reused. If a rank panics,
/// dropping its handle aborts the group, so the other ranks get an error instead of waiting forever.
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl LocalComm {
    /// A group of `size` ranks; handle `i` is rank `i`.
    pub fn group(size: usize) -> Vec<LocalComm> {
        assert!(size > 0, "LocalComm::group: size must be positive");
        let shared = Arc::new(Shared {
            size,
            state: Mutex::new(Rendezvous {
                slots: vec![Vec::new(); size],
                ops: vec![None; size],
                arrived: 0,
                generation: 0,
                aborted: None,
            }),
            cv: Condvar::new(),
        });
        (0..size)
            .map(|rank| LocalComm {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Aborts the group: every pending and later collective on every rank fails with `reason`.
    pub fn abort(&self, reason: &str) {
        let mut st = self.lock();
        if st.aborted.is_none() {
            st.aborted = Some(format!("rank {}: {reason}", self.rank));
        }
        self.shared.cv.notify_all();
    }

    /// A function that aborts this group from any thread (as [`LocalComm::abort`] on this rank does), for a
    /// coordinator whose ranks may be stuck in a collective.
    pub fn abort_handle(&self) -> impl Fn(&str) + Send + Sync + 'static {
        let handle = LocalComm {
            rank: self.rank,
            shared: self.shared.clone(),
        };
        move |reason: &str| handle.abort(reason)
    }

    fn lock(&self) -> MutexGuard<'_, Rendezvous> {
        // A poisoned lock means a rank panicked inside a collective; the data is still consistent enough to read the
        // abort flag, which the panicking rank's drop sets.
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check(st: &Rendezvous) -> Result<()> {
        match &st.aborted {
            Some(why) => Err(EngineError::Communicator(format!("group aborted ({why})"))),
            None => Ok(()),
        }
    }

    /// Waits until every rank has arrived, with the lock held on return.
    fn meet<'a>(&'a self, mut st: MutexGuard<'a, Rendezvous>) -> Result<MutexGuard<'a, Rendezvous>> {
        Self::check(&st)?;
        st.arrived += 1;
        if st.arrived == self.shared.size {
            st.arrived = 0;
            st.generation += 1;
            self.shared.cv.notify_all();
            return Ok(st);
        }
        let generation = st.generation;
        while st.generation == generation && st.aborted.is_none() {
            st = self.shared.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        Self::check(&st)?;
        Ok(st)
    }

    /// Deposits `data` for `op`, meets, runs `read` over everyone's slots, and meets again.
    fn collective(&self, op: Op, data: &[f32], read: impl FnOnce(&[Vec<f32>])) -> Result<()> {
        let mut st = self.lock();
        Self::check(&st)?;
        st.slots[self.rank].clear();
        st.slots[self.rank].extend_from_slice(data);
        st.ops[self.rank] = Some(op);
        let st = self.meet(st)?;
        if let Some(other) = st.ops.iter().position(|o| *o != Some(op)) {
            let msg = format!(
                "rank {} entered {op:?} while rank {other} entered {:?}",
                self.rank, st.ops[other]
            );
            drop(st);
            self.abort(&msg);
            return Err(EngineError::Communicator(msg));
        }
        read(&st.slots);
        self.meet(st).map(drop)
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.abort("panicked");
        }
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let data = buf.to_vec();
        self.collective(Op::AllReduce(buf.len()), &data, |slots| {
            buf.copy_from_slice(&slots[0]);
            for slot in &slots[1..] {
                for (b, v) in buf.iter_mut().zip(slot) {
                    *b += v;
                }
            }
        })
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        if recv.len() != send.len() * self.shared.size {
            return Err(EngineError::Communicator(format!(
                "all_gather: receive buffer holds {} elements, expected {} · {}",
                recv.len(),
                send.len(),
                self.shared.size
            )));
        }
        self.collective(Op::AllGather(send.len()), send, |slots| {
            for (chunk, slot) in recv.chunks_exact_mut(send.len().max(1)).zip(slots) {
                chunk.copy_from_slice(slot);
            }
        })
    }

    fn barrier(&self) -> Result<()> {
        self.collective(Op::Barrier, &[], |_| {})
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;

    #[test]
    fn all_reduce_and_gather_agree_on_every_rank() {
        for size in [1, 2, 3, 5] {
            let inputs: Vec<Vec<f32>> = (0..size)
                .map(|r| {
                    let mut rng = ChaCha8Rng::seed_from_u64(r as u64);
                    (0..7).map(|_| rng.random_range(-1.0..1.0)).collect()
                })
                .collect();
            let want: Vec<f32> = (0..7).map(|i| inputs.iter().map(|v| v[i]).sum()).collect();
            let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
                let handles: Vec<_> = LocalComm::group(size)
                    .into_iter()
                    .zip(&inputs)
                    .map(|(comm, input)| {
                        s.spawn(move || {
                            let mut sum = input.clone();
                            // Several rounds back to back: slots must not be overwritten before everyone has read.
                            for _ in 0..3 {
                                sum.copy_from_slice(input);
                                comm.all_reduce_sum(&mut sum).expect("all_reduce");
                            }
                            let mut gathered = vec![0.0; 2 * size];
                            comm.all_gather(&input[..2], &mut gathered).expect("all_gather");
                            comm.barrier().expect("barrier");
                            (sum, gathered)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().expect("rank")).collect()
            });
            for (sum, gathered) in &results {
                assert_eq!(sum, &results[0].0, "ranks disagree");
                for (g, w) in sum.iter().zip(&want) {
                    assert!((g - w).abs() < 1e-6);
                }
                let want_gather: Vec<f32> = inputs.iter().flat_map(|v| v[..2].to_vec()).collect();
                assert_eq!(gathered, &want_gather);
            }
        }
    }

    #[test]
    fn mismatched_collectives_and_panics_fail_instead_of_hanging() {
        let errors: Vec<bool> = std::thread::scope(|s| {
            let handles: Vec<_> = LocalComm::group(2)
                .into_iter()
                .map(|comm| {
                    s.spawn(move || {
                        let mut buf = vec![1.0; 3 + comm.rank()];
                        comm.all_reduce_sum(&mut buf).is_err()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        assert_eq!(errors, vec![true, true]);

        let outcome: Vec<bool> = std::thread::scope(|s| {
            let handles: Vec<_> = LocalComm::group(3)
                .into_iter()
                .map(|comm| {
                    s.spawn(move || {
                        if comm.rank() == 1 {
                            panic!("injected fault");
                        }
                        comm.barrier().is_err()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(true)).collect()
        });
        assert_eq!(outcome, vec![true, true, true]);
    }
}
