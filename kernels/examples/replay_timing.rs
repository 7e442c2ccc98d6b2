//! The SSM decode-kernel sweep of `rewind bench kernels` ([`rewind_kernels::cuda::bench_decode`]: recurrent, replay
//! at L = 4 … 32 with its flush step, verify at T = 2, 4, 6, batch 1 … 512, one Mamba-2 and one GDN layer at real
//! shapes), printed as markdown, after the replay and step kernels' register and occupancy figures.
//!
//! `cargo run --release -p rewind-kernels --example replay_timing` on a machine with a GPU.

use rewind_kernels::cpu::gdn::GdnDims;
use rewind_kernels::cpu::mamba2::Mamba2Dims;
use rewind_kernels::cuda::bench_decode::{render, run_sweep, Sweep};
use rewind_kernels::cuda::ops::{replay_geometry, ReplayKind};
use rewind_kernels::cuda::{CudaDevice, CudaError, Result};

fn main() -> Result<()> {
    let dev = CudaDevice::open(0)?;
    // The sweep's layers: one Nemotron-H-8B Mamba-2 layer and one Qwen3.5-4B GDN layer.
    let mamba2 = ReplayKind::Mamba2(Mamba2Dims {
        heads: 128,
        head_dim: 64,
        state_dim: 128,
        groups: 8,
    });
    let gdn = ReplayKind::Gdn(GdnDims {
        k_heads: 16,
        v_heads: 32,
        k_dim: 128,
        v_dim: 128,
    });
    // A decode (t = 1, L = 16) and a verify of 4 tokens, at the block shape and shared memory their launches use.
    for (name, kind, t) in [
        ("mamba2_replay_nc4_bf16", mamba2, 1),
        ("gdn_replay_nc4_sb1_bf16", gdn, 1),
        ("gdn_replay_nc4_sb4_bf16", gdn, 4),
    ] {
        let geo = replay_geometry(kind, t, 16 + t, dev.shared_limits())?;
        let f = dev.function(name)?;
        let err = |e| CudaError::Unavailable(format!("{name}: {e:?}"));
        let regs = f.num_regs().map_err(err)?;
        let threads = 32 * geo.warps as u32;
        let blocks = f
            .occupancy_max_active_blocks_per_multiprocessor(threads, geo.shared_bytes(), None)
            .map_err(err)?;
        let local = f
            .get_attribute(cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)
            .map_err(err)?;
        eprintln!(
            "{name} (t {t}): {regs} registers, {local} B local (spills), {blocks} blocks of {threads} threads per SM \
             with {} B shared each",
            geo.shared_bytes()
        );
    }
    for name in ["mamba2_step_bf16", "gdn_step_bf16"] {
        let f = dev.function(name)?;
        let err = |e| CudaError::Unavailable(format!("{name}: {e:?}"));
        let regs = f.num_regs().map_err(err)?;
        eprintln!("{name}: {regs} registers");
    }
    let report = run_sweep(&dev, &Sweep::default(), |r| eprintln!("{}", render::line(r)))?;
    print!("{}", render::markdown(&report, &[]));
    Ok(())
}
