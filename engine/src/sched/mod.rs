//! Continuous batching as plain data and functions the coordinator calls each step (no threads, no I/O):
//! [`Scheduler`] keeps the waiting queue (priority, then arrival) and the running sequences, admits requests while
//! sequence slots and KV blocks last, fills each step's token budget with one decode token per running sequence and
//! then prompt chunks, and preempts by recompute when a running sequence needs a KV block and none is free (the victim
//! frees its slot and blocks and waits again with its history). A re-admitted sequence (after a preemption or a
//! fault, [`Scheduler::requeue_all`]) is rebuilt exactly as it was first computed: its prompt in the same chunks,
//! then each token it had generated fed again as one decode step, so a greedy request's output cannot change. [`OutputStream`] turns one
//! request's sampled tokens into text and decides when it ends.

mod output;
mod scheduler;

#[cfg(test)]
mod tests;

pub use output::{FinishReason, OutputStream, Pushed};
pub use scheduler::{Planned, Request, SchedConfig, SchedError, Scheduler, Step, StepWork};
