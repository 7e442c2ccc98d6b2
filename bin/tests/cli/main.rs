//! The integration tests of the `rewind` binaries and the `rewind_bin` library, as one test binary. Each module was
//! its own test binary, and each compiled its own copy of the generic code it uses (tokio, tonic, axum, the engine)
//! and linked the whole crate graph: the 40 integration test binaries of the workspace took about half of a cold
//! `cargo test --workspace` build on CI's two cores. A new test file goes here as a module (`mod name;` below);
//! helpers shared by several modules are modules too (`common`, `process`, ...). The tests of all modules run as
//! threads of one process: the shared helpers' scratch directories are unique per call (`common::scratch_dir`), a
//! module's own paths carry its name and the process id, and servers take the ports the system chooses.

// Helpers shared by the test modules.
mod cli_flags;
mod common;
mod grpc_fixture;
mod http_fixture;
mod process;

mod bench_e2e_cli;
mod bench_flags;
mod bench_kernels_cli;
mod bench_multiturn_cli;
mod cli;
mod decode_cli;
mod default_model;
mod generate_bench_flags;
mod git_head;
mod grpc_api;
mod grpc_choices;
mod http_api;
mod http_choices;
mod http_logprobs;
mod http_prefix;
mod http_structured;
mod init_hardening;
mod launch;
mod openai_sdk;
mod output_errors;
mod plan;
mod plan_memory;
mod quantized_cli;
mod serve_cli;
mod serve_limits;
mod spec_bench_cli;
mod spec_cli;
