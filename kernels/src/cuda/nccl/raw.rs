//! The raw NCCL communicator behind [`super::NcclComm`], shared with [`NcclAbort`] handles so that another thread can
//! end it with `ncclCommAbort`.
//!
//! Why not cudarc's `Comm`: it keeps the `ncclComm_t` private, and a rank whose peer died sits in a stream
//! synchronisation behind an NCCL kernel that waits for that peer forever. Only `ncclCommAbort`, called from another
//! thread, makes that kernel return (NCCL kernels poll the communicator's abort flag), so the engine's fault recovery
//! must be able to reach the handle while its owner is blocked.
//!
//! After an abort the communicator is freed: every later collective on it is refused here (`aborted`) instead of
//! touching freed memory, and the drop does not free it twice. A collective holds `busy` while it enqueues, so an
//! abort does not free the communicator under a call that is about to return; a call blocked inside NCCL itself (a
//! peer that never joined) is what the abort exists to end, so the abort waits for `busy` only briefly.
//!
//! Limits of blocking communicators, which these are: a call blocked inside NCCL (the first collective's connection
//! set-up with a peer that died) may have its communicator freed under it once that wait is over, and a rank stuck in
//! `ncclCommInitRank` (a peer that failed before joining) has no handle yet and cannot be reached. Non-blocking
//! communicators (`ncclConfig_t::blocking = 0`, polled with `ncclCommGetAsyncError`) would close both.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::nccl::{result, sys};

/// How long an abort waits for a collective that is being enqueued before it aborts anyway.
const ABORT_WAIT: Duration = Duration::from_secs(2);

struct Shared {
    comm: sys::ncclComm_t,
    aborted: AtomicBool,
    busy: Mutex<()>,
}

// SAFETY: NCCL communicators may be used from any thread; `busy` serialises this crate's own calls on it, and
// `ncclCommAbort` is documented to be callable from another thread while the owner is blocked.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    fn abort(&self) {
        if self.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        let deadline = Instant::now() + ABORT_WAIT;
        let _guard = loop {
            match self.busy.try_lock() {
                Ok(g) => break Some(g),
                Err(TryLockError::Poisoned(p)) => break Some(p.into_inner()),
                Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(TryLockError::WouldBlock) => break None,
            }
        };
        // SAFETY: `comm` came from ncclCommInitRank and `aborted` guarantees this runs once; an abort error leaves
        // nothing further to do with the communicator.
        let _ = unsafe { result::comm_abort(self.comm) };
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if !*self.aborted.get_mut() {
            // SAFETY: as in `abort`; cudarc's own `Comm` ends communicators the same way.
            let _ = unsafe { result::comm_abort(self.comm) };
        }
    }
}

/// The threads running `ncclCommAbort` ([`NcclAbort::abort`]) that nobody has waited for yet.
static ABORTING: Mutex<Vec<JoinHandle<()>>> = Mutex::new(Vec::new());

/// Waits up to `timeout` for every abort started by [`NcclAbort::abort`] to finish; returns how many are still
/// running (left to finish on their own).
///
/// Why: an abort runs on a thread of its own and outlives the rank that asked for it, so without this a generation
/// could be replaced, or the process could exit, while NCCL is still tearing the old communicator down — and a process
/// that exits under a running `ncclCommAbort` unloads NCCL beneath it. The engine calls this when a generation of
/// ranks has stopped (their CUDA graphs destroyed, which is what an abort waits for).
pub fn settle_aborts(timeout: Duration) -> usize {
    let deadline = Instant::now() + timeout;
    let mut left = std::mem::take(&mut *ABORTING.lock().unwrap_or_else(|p| p.into_inner()));
    while !left.is_empty() {
        let (done, running): (Vec<_>, Vec<_>) = left.into_iter().partition(|t| t.is_finished());
        for t in done {
            // A panic inside NCCL's abort has nothing left to clean up; the communicator is marked aborted already.
            let _ = t.join();
        }
        left = running;
        if left.is_empty() || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let still = left.len();
    ABORTING.lock().unwrap_or_else(|p| p.into_inner()).extend(left);
    still
}

/// One rank's communicator handle (see the module docs).
pub(super) struct RawComm(Arc<Shared>);

impl RawComm {
    /// `ncclCommInitRank`: blocks until all `world` ranks have joined `id`. The caller binds the rank's device first.
    pub(super) fn init(rank: usize, world: usize, id: &cudarc::nccl::Id) -> Result<Self, result::NcclError> {
        let mut comm = MaybeUninit::uninit();
        let unique = sys::ncclUniqueId {
            internal: *id.internal(),
        };
        // World and rank were checked against each other and fit an i32 (GPUs per process).
        // SAFETY: `comm` is written by NCCL before it is read; the id is a valid unique id.
        unsafe { result::comm_init_rank(comm.as_mut_ptr(), world as i32, unique, rank as i32)? };
        Ok(Self(Arc::new(Shared {
            // SAFETY: initialised by the successful call above.
            comm: unsafe { comm.assume_init() },
            aborted: AtomicBool::new(false),
            busy: Mutex::new(()),
        })))
    }

    /// Runs `call` on the communicator unless it was aborted (`None`).
    pub(super) fn enqueue<R>(&self, call: impl FnOnce(sys::ncclComm_t) -> R) -> Option<R> {
        let _busy = self.0.busy.lock().unwrap_or_else(|p| p.into_inner());
        if self.0.aborted.load(Ordering::SeqCst) {
            return None;
        }
        Some(call(self.0.comm))
    }

    /// Whether the communicator was aborted.
    pub(super) fn is_aborted(&self) -> bool {
        self.0.aborted.load(Ordering::SeqCst)
    }

    /// A handle that aborts this communicator from any thread.
    pub(super) fn abort_handle(&self) -> NcclAbort {
        NcclAbort(Arc::downgrade(&self.0))
    }
}

/// Aborts one rank's communicator from any thread (`ncclCommAbort`): a collective of that rank waiting on the device for
/// a peer that will never come returns, and the rank's later collectives fail with an error instead of waiting. Used by
/// the engine's fault recovery, through the generation's abort signal.
///
/// The handle does not keep the communicator alive: it is freed with its rank, on the rank's thread while the rank's
/// CUDA context is current, as before this handle existed (a build whose abort hooks kept the communicators alive
/// until the generation ended left a serving process at TP 2 unable to exit on 2 × H200), and an abort after that
/// does nothing.
#[derive(Clone)]
pub struct NcclAbort(Weak<Shared>);

impl NcclAbort {
    /// Aborts the communicator (once; later calls, and calls after its rank is gone, do nothing), on a thread of its
    /// own, and returns at once: once the last communicator of a group is aborted NCCL's clean-up waits until every
    /// CUDA graph that captured the group's collectives is destroyed, and the caller may be a rank thread whose own
    /// graphs go only when it has returned (a rank aborting its generation on its own failure).
    pub fn abort(&self) {
        let Some(shared) = self.0.upgrade() else {
            return;
        };
        if shared.aborted.load(Ordering::SeqCst) {
            return;
        }
        let fallback = shared.clone();
        match std::thread::Builder::new()
            .name("nccl-abort".into())
            .spawn(move || shared.abort())
        {
            Ok(t) => ABORTING.lock().unwrap_or_else(|p| p.into_inner()).push(t),
            // No thread to be had: abort here (at worst this thread waits for NCCL's clean-up as described above).
            Err(_) => fallback.abort(),
        }
    }

    /// Whether the communicator was aborted (a freed one counts as aborted: nothing can wait on it).
    pub fn is_aborted(&self) -> bool {
        self.0.upgrade().is_none_or(|s| s.aborted.load(Ordering::SeqCst))
    }
}

impl std::fmt::Debug for NcclAbort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclAbort")
            .field("aborted", &self.is_aborted())
            .finish()
    }
}
