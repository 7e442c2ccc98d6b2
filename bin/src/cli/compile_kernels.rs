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
    /// Also store every module's image for every target in the kernel cache (`REWIND_CACHE`/nvrtc, else
    /// `XDG_CACHE_HOME`/rewind/nvrtc or ~/.cache/rewind/nvrtc), where a device of that architecture finds it instead
    /// of compiling when it opens: warm a cache here, carry it, and point `REWIND_CACHE` at it on the device. Only
    /// plain `sm_XY` targets, the ones a device asks for.
    #[arg(long)]
    pub fill_cache: bool,
}
