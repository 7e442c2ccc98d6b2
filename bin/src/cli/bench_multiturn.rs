//! `rewind bench multi-turn`: the flags of the multi-turn chat workload that measures automatic prefix caching.

use std::path::PathBuf;

use clap::Args;

use super::model::ModelArgs;
use super::non_negative;
use super::serving::RunArgs;

/// Examples shown after `rewind bench multi-turn --help`.
pub(super) const BENCH_MULTI_TURN_EXAMPLES: &str = "\
Examples:
  rewind bench multi-turn --model /tmp/nemotron-h-8b --device cuda --json multi-turn.json
  rewind bench multi-turn --conversations 8 --turns 3-4 --system 64 --prefix 64 --user 16-24 --reply 8-12 --clients 4";

#[derive(Args, Debug)]
pub struct BenchMultiTurnArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Conversations in the workload.
    #[arg(long, default_value_t = 32, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub conversations: usize,
    /// Clients: conversations in flight at once (each client runs its conversations' turns one after another).
    #[arg(long, default_value_t = 16, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub clients: usize,
    /// Turns per conversation, `N` or `LO-HI` (uniform per conversation).
    #[arg(long, default_value = "8-12")]
    pub turns: String,
    /// Tokens of the system prompt every conversation shares.
    #[arg(long, default_value_t = 500, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub system: usize,
    /// Tokens of each conversation's own prefix after the system prompt (a document, earlier context).
    #[arg(long, default_value_t = 1000, allow_negative_numbers = true, value_parser = non_negative::<usize>)]
    pub prefix: usize,
    /// Tokens of each user turn, `N` or `LO-HI`.
    #[arg(long, default_value = "120-160")]
    pub user: String,
    /// Tokens of each reply (generated greedily, end of sequence ignored), `N` or `LO-HI`.
    #[arg(long, default_value = "80-120")]
    pub reply: String,
    /// Which passes run: `both` (the cache off, then on, side by side in one run), `on` or `off`.
    #[arg(long, default_value = "both", value_parser = ["both", "on", "off"])]
    pub passes: String,
    /// Write the result as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub run: RunArgs,
}
