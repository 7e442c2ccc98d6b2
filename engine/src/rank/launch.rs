//! Starting a model's ranks, as often as recovery needs: a [`Launcher`] knows the model, the device and the options;
//! each [`Launcher::launch`] prepares one generation of ranks — fresh communicators and the per-rank loader that
//! each rank's own thread calls — and the [`Abort`] signal that ends that generation's collectives.
//!
//! After a fault the actor runtime aborts the old generation (ranks waiting in a collective get an error instead of
//! waiting forever), drops it and launches the next one; the weights are read again from the checkpoint (mmap).

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::Rank;
use crate::error::Result;

/// Builds rank `r` of one generation; called on the thread that will own the rank.
pub type RankLoader = Arc<dyn Fn(usize) -> Result<Box<dyn Rank>> + Send + Sync>;

type Hook = Box<dyn Fn(&str) + Send + Sync>;

#[derive(Default)]
struct AbortInner {
    reason: Mutex<Option<String>>,
    cv: Condvar,
    hooks: Mutex<Vec<Hook>>,
}

/// One generation's abort signal: set once (the first reason wins), it runs the registered hooks (aborting the
/// communicators) and wakes every thread waiting on it. Cloning shares the signal.
#[derive(Clone, Default)]
pub struct Abort {
    inner: Arc<AbortInner>,
}

impl std::fmt::Debug for Abort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Abort").field("reason", &self.reason()).finish()
    }
}

impl Abort {
    /// A signal not yet set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `hook` when the signal is set (at once when it already is).
    ///
    /// The check and the registration happen under the hooks' lock, which [`Abort::abort`] holds while it sets the
    /// reason, so a hook registered while another thread aborts either sees the reason or is taken by that abort:
    /// none is lost (a lost hook would leave a rank's communicator un-aborted, waiting forever).
    pub fn on_abort(&self, hook: impl Fn(&str) + Send + Sync + 'static) {
        let mut hooks = self.inner.hooks.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = self.reason() {
            drop(hooks);
            hook(&why);
            return;
        }
        hooks.push(Box::new(hook));
    }

    /// Sets the signal with `reason` (ignored when already set) and runs the hooks.
    pub fn abort(&self, reason: &str) {
        let hooks = {
            let mut hooks = self.inner.hooks.lock().unwrap_or_else(|e| e.into_inner());
            let mut r = self.inner.reason.lock().unwrap_or_else(|e| e.into_inner());
            if r.is_some() {
                return;
            }
            *r = Some(reason.to_string());
            self.inner.cv.notify_all();
            std::mem::take(&mut *hooks)
        };
        for h in hooks {
            h(reason);
        }
    }

    /// Why the signal was set, if it was.
    pub fn reason(&self) -> Option<String> {
        self.inner.reason.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Waits until the signal is set or `timeout` passes; returns the reason when set.
    pub fn wait(&self, timeout: Duration) -> Option<String> {
        let r = self.inner.reason.lock().unwrap_or_else(|e| e.into_inner());
        let (r, _) = self
            .inner
            .cv
            .wait_timeout_while(r, timeout, |r| r.is_none())
            .unwrap_or_else(|e| e.into_inner());
        r.clone()
    }
}

/// One generation of a group's ranks: the loader each rank thread calls, and the signal that aborts them.
#[derive(Clone)]
pub struct Launch {
    pub load: RankLoader,
    pub abort: Abort,
    /// Waits up to the given time for teardown an abort left running beside the stopped ranks (the GPU ranks' NCCL
    /// aborts run on threads of their own); returns how many are still running. Called once the generation's rank
    /// threads have ended, so that neither the next generation nor the process's exit overlaps it.
    pub settle: fn(Duration) -> usize,
}

/// [`Launch::settle`] for ranks whose aborts finish inside the abort call (nothing left to wait for).
pub fn settled(_: Duration) -> usize {
    0
}

/// Starts generations of one model's ranks (the first at start-up, another after every fault).
pub trait Launcher: Send + Sync {
    /// Tensor-parallel ranks per generation.
    fn tp(&self) -> usize;

    /// A name for the rank threads (`{name}-{rank}`).
    fn name(&self) -> &str;

    /// Prepares a generation: fresh communicators, a fresh abort signal.
    fn launch(&self) -> Result<Launch>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn abort_runs_hooks_once_and_wakes_waiters() {
        let a = Abort::new();
        let count = Arc::new(AtomicUsize::new(0));
        let c = count.clone();
        a.on_abort(move |_| {
            c.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(a.wait(Duration::from_millis(1)), None);
        let b = a.clone();
        let waiter = std::thread::spawn(move || b.wait(Duration::from_secs(30)));
        a.abort("first");
        a.abort("second");
        assert_eq!(waiter.join().expect("waiter"), Some("first".into()));
        assert_eq!(count.load(Ordering::SeqCst), 1);
        let late = Arc::new(AtomicUsize::new(0));
        let l = late.clone();
        a.on_abort(move |why| {
            assert_eq!(why, "first");
            l.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(late.load(Ordering::SeqCst), 1);
    }

    /// A hook registered while another thread aborts runs exactly once, whichever wins (a lost hook would leave a
    /// rank's communicator un-aborted). Many rounds, so the interleavings the scheduler offers are covered.
    #[test]
    fn a_hook_registered_during_an_abort_is_never_lost() {
        for round in 0..2000 {
            let a = Abort::new();
            let ran = Arc::new(AtomicUsize::new(0));
            let (b, r) = (a.clone(), ran.clone());
            let register = std::thread::spawn(move || {
                b.on_abort(move |_| {
                    r.fetch_add(1, Ordering::SeqCst);
                })
            });
            a.abort("race");
            register.join().expect("register");
            assert_eq!(ran.load(Ordering::SeqCst), 1, "round {round}");
        }
    }
}
