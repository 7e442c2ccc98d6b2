//! The workspace-level integration tests (engine and actor runtime on CPU ranks, parity with the transformers
//! reference) as one test binary. Each module was its own test binary, and each compiled its own copy of the generic
//! code it uses and linked the whole crate graph (see `bin/tests/cli/main.rs`). A new test file goes here as a module
//! (`mod name;` below); helpers shared by several modules are modules too (`outcomes`, `speculative_support`).

// Helpers shared by the test modules.
mod outcomes;
mod speculative_support;

mod chained;
mod choices;
mod decode_forms;
mod mtp_parity;
mod parity;
mod prefix_cache;
mod serving;
mod sessions;
mod spec_chained;
mod speculative;
mod speculative_mtp;
mod structured_spec;
mod tp_forms;
