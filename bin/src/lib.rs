//! The rewind binaries' library: the `rewind` command line ([`cli`], [`commands`]), the servers every front end
//! shares ([`serve`]: gRPC sessions and the OpenAI-compatible HTTP API over one engine), and what `rewind-launch`
//! adds on top of them.

pub mod cli;
pub mod commands;
pub mod default_model;
pub mod launch;
pub mod output;
pub mod progress_bars;
pub mod serve;
