//! Continuous batching as plain data and functions the coordinator calls each step (no threads, no I/O):
//! [`Scheduler`] keeps the waiting queue (priority, then arrival) and the running sequences, admits requests while
//! sequence slots and KV blocks last, fills each step's token budget with one decode token per running sequence and
//! then prompt chunks, and preempts by recompute when a running sequence needs a KV block and none is free (the victim
//! frees its slot and blocks and waits again with its history). A re-admitted sequence (after a preemption or a
//! fault, [`Scheduler::requeue_all`]) is rebuilt exactly as it was first computed: its prompt in the same chunks,
//! then each token it had generated fed again as one decode step, so a greedy request's output cannot change. [`OutputStream`] turns one
//! request's sampled tokens into text and decides when it ends.
//!
//! Chained decode steps ([`SchedConfig::decode_steps`], like vLLM's multi-step scheduling): when a step is nothing but
//! sampled decodes of every running sequence, all allowed to chain ([`Request::chain`]), the ranks may run several
//! decode steps back to back, each feeding its sampled token to the next on the device ([`Step::chained`]), so a
//! steady batch pays one host round trip per chain instead of one per token. The chain is as long as every sequence's
//! context and the free KV blocks allow (reserved up front, never by preempting anyone); it runs past a sequence's
//! last token (which is then dropped) only while no request waits, else it ends at the first sequence's last; and it
//! never forms beside commits, preemptions, prompt chunks, verifies, drafts or replayed tokens, nor while a waiting
//! request could start (a free slot and its first chunk's KV blocks: chaining would delay its first token by the
//! chained steps).

mod output;
mod scheduler;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_chain;
#[cfg(test)]
mod tests_ranks;

pub use output::{FinishReason, OutputStream, Pushed};
pub use scheduler::{Chain, Planned, Request, SchedConfig, SchedError, Scheduler, Step, StepWork};
