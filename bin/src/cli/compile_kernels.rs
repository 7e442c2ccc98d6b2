//! `rewind compile-kernels`'s flags.

use std::path::PathBuf;

use clap::Args;

/// `rewind compile-kernels`: every CUDA kernel module compiled by NVRTC for real architectures, without a GPU.
#[derive(Args, Debug)]
pub struct CompileKernelsArgs {
    /// Targets, comma-separated: `sm_XY` or `sm_XYa` (default: Hopper and Blackwell, the architectures rewind serves).
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "LIST",
        default_value = "sm_90,sm_100,sm_103"
    )]
    pub arch: Vec<String>,
    /// Only the modules whose name contains this string.
    #[arg(long)]
    pub only: Option<String>,
    /// Write the report (every entry point's registers, stack and spills per target) as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Fail when an entry point spills registers (by default spills are reported, not failed).
    #[arg(long)]
    pub deny_spills: bool,
}
