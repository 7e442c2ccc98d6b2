//! The integration tests of the `rewind` binaries and the `rewind_bin` library, as one test binary: each module was
//! its own test binary, and every test binary links the whole crate graph (tonic, axum, tokenizers, ...), so on CI's
//! two cores the links took more time than the tests. A new test file goes here as a module (`mod name;` below);
//! helpers shared by several modules are modules too (`common`, `process`, ...). The tests of all modules run as
//! threads of one process: anything a test writes goes to a path of its own (`common::scratch_dir`), and servers take
//! the ports the system chooses.

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
