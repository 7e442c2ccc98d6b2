//! The GPU options from the device flags, and the report of what a GPU load placed where.

use std::time::Instant;

use anyhow::Result;
use rewind_engine::gpu::{GpuOptions, GpuReport};

use crate::cli::DeviceArgs;
use crate::output::errln;

/// The engine's options from the flags.
pub fn options(d: &DeviceArgs, devices: Vec<usize>) -> Result<GpuOptions> {
    Ok(GpuOptions {
        devices,
        gpu_memory_fraction: d.gpu_memory_fraction,
        max_seqs: d.max_seqs(),
        max_model_len: d.max_model_len,
        prefill_chunk: d.prefill_chunk,
        dtype: d.dtype.parse()?,
        cuda_graphs: !d.no_cuda_graphs,
        stage_profile: d.stage_profile,
        ..GpuOptions::default()
    })
}

/// Prints what was placed where (`t0`: when loading began); returns the devices in words.
pub fn report(r: &GpuReport, d: &DeviceArgs, tp: usize, t0: Instant) -> Result<String> {
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    errln!(
        "GPU: {} | tp {} | {} activations | weights {:.2} GiB, state pools {:.2} GiB, activations {:.2} GiB, prefix cache {:.2} GiB per rank of \
         {:.1} GiB | \
         {} sequences × {} tokens, {} KV blocks | loaded in {:.1} s",
        r.devices.join(", "),
        tp,
        d.dtype,
        gib(r.weight_bytes.iter().copied().max().unwrap_or(0)),
        gib(r.state_bytes.iter().copied().max().unwrap_or(0)),
        gib(r.scratch_bytes.iter().copied().max().unwrap_or(0)),
        gib(r.store_bytes.iter().copied().max().unwrap_or(0)),
        gib(r.total_bytes.first().copied().unwrap_or(0)),
        r.sizes.max_seqs,
        r.sizes.max_len,
        r.sizes.num_blocks,
        t0.elapsed().as_secs_f64()
    );
    Ok(r.devices.join(", "))
}
