//! The SSM decode-kernel sweep of `rewind bench kernels` ([`rewind_kernels::cuda::bench_decode`]: recurrent, replay
//! at L = 4 … 32 with its flush step, verify at T = 2, 4, 6, batch 1 … 512, one Mamba-2 and one GDN layer at real
//! shapes), printed as markdown, after the replay and step kernels' register and occupancy figures.
//!
//! `cargo run --release -p rewind-kernels --example replay_timing` on a machine with a GPU.

use rewind_kernels::cuda::bench_decode::{render, run_sweep, Sweep};
use rewind_kernels::cuda::{CudaDevice, CudaError, Result};

fn main() -> Result<()> {
    let dev = CudaDevice::open(0)?;
    for name in [
        "mamba2_replay_nc4_bf16",
        "gdn_replay_nc4_bf16",
        "mamba2_step_bf16",
        "gdn_step_bf16",
    ] {
        let f = dev.function(name)?;
        let err = |e| CudaError::Unavailable(format!("{name}: {e:?}"));
        let regs = f.num_regs().map_err(err)?;
        let blocks = f
            .occupancy_max_active_blocks_per_multiprocessor(256, 16 * 1024, None)
            .map_err(err)?;
        let local = f
            .get_attribute(cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)
            .map_err(err)?;
        eprintln!("{name}: {regs} registers, {local} B local (spills), {blocks} blocks of 256 threads per SM with 16 KiB shared");
    }
    let report = run_sweep(&dev, &Sweep::default(), |r| eprintln!("{}", render::line(r)))?;
    print!("{}", render::markdown(&report, &[]));
    Ok(())
}
