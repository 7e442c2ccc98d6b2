//! Decode-kernel times of one SSM layer at batch 1, 64 and 256 (bf16 storage, f32 state), CUDA events, 3 warm-up
//! launches then the median of 20 (`rewind_kernels::cuda::timing`), state pools of 256 slots (1 GB for the Mamba-2
//! layer, beyond L2): the recurrent step kernel, the replay kernel running recurrent rows (read and fold), replay with
//! a ring of L = 16 (rows at fills 0 .. 14, none flushing), and verify of T = 4 drafts. Each line gives the byte model's bytes, the achieved bandwidth and its
//! fraction of a device-to-device copy measured in the same run.
//!
//! `cargo run --release -p rewind-kernels --example replay_timing` on a machine with a GPU.

use half::bf16;
use rewind_kernels::cpu::gdn::GdnDims;
use rewind_kernels::cpu::mamba2::Mamba2Dims;
use rewind_kernels::cuda::ops::{self, ReplayRow, ReplayShape};
use rewind_kernels::cuda::parity::Rng;
use rewind_kernels::cuda::timing;
use rewind_kernels::cuda::{CudaDevice, CudaError, CudaSlice, Result};

const SLOTS: usize = 256;
const L: usize = 16;

fn bf16s(dev: &CudaDevice, rng: &mut Rng, n: usize) -> Result<CudaSlice<bf16>> {
    dev.upload_as::<bf16>(&rng.uniform_vec(n, 0.5))
}

/// The rows of a launch: distinct slots; `kind` 0 recurrent (empty ring, folds its entry), 1 replay (fill `b % L`
/// within `L − t`, the rows at the fullest fill flushing), 2 verify of `t` drafts.
fn rows(batch: usize, kind: usize, t: usize) -> Vec<ReplayRow> {
    (0..batch)
        .map(|b| {
            let h = if kind == 0 { 0 } else { b % (L - t) };
            let fold = match kind {
                0 => 1,
                1 if h + 2 * t > L => h + t,
                _ => 0,
            };
            ReplayRow {
                slot: (b * 37) % SLOTS,
                ring_start: b % L,
                ring_len: h,
                ring_cap: L,
                fold,
                read_state: true,
                conv_head: 0,
            }
        })
        .collect()
}

fn report(what: &str, batch: usize, ms: f64, bytes: f64, copy: f64) {
    let gbs = bytes / ms / 1e6;
    println!(
        "{what:<48} batch {batch:>3}: {ms:>7.3} ms  {:>7.1} MB  {gbs:>6.0} GB/s  {:.2} of copy",
        bytes / 1e6,
        gbs / copy
    );
}

fn main() -> Result<()> {
    let dev = CudaDevice::open(0)?;
    let rng = &mut Rng::new(11);
    let copy = timing::copy_bandwidth(&dev)?;
    println!("{} | copy {copy:.0} GB/s | {} SMs", dev.name(), dev.sm_count());
    for name in [
        "mamba2_replay_nc4_bf16",
        "gdn_replay_nc4_bf16",
        "mamba2_step_bf16",
        "gdn_step_bf16",
    ] {
        let f = dev.function(name)?;
        let regs = f.num_regs().map_err(|e| CudaError::Unavailable(format!("{e:?}")))?;
        let blocks = f
            .occupancy_max_active_blocks_per_multiprocessor(256, 16 * 1024, None)
            .map_err(|e| CudaError::Unavailable(format!("{e:?}")))?;
        let local = f
            .get_attribute(cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)
            .map_err(|e| CudaError::Unavailable(format!("{e:?}")))?;
        println!("{name}: {regs} registers, {local} B local (spills), {blocks} blocks of 256 threads per SM with 16 KiB shared");
    }
    let md = Mamba2Dims {
        heads: 128,
        head_dim: 64,
        state_dim: 128,
        groups: 8,
    };
    let (h, p, n, g) = (md.heads, md.head_dim, md.state_dim, md.groups);
    let state_bytes = (h * p * n * 4) as f64;
    let entry = (h * (2 * p + 4) + g * 2 * n) as f64;
    let mut state = dev.alloc_zeros::<f32>(SLOTS * h * p * n)?;
    let mut rx = bf16s(&dev, rng, SLOTS * L * h * p)?;
    let mut rdt = dev.upload(&vec![0.05f32; SLOTS * L * h])?;
    let mut rb = bf16s(&dev, rng, SLOTS * L * g * n)?;
    let a = dev.upload(&vec![-1.0f32; h])?;
    let d = dev.upload(&vec![1.0f32; h])?;
    for batch in [1usize, 64, 256] {
        let t_max = 4;
        let x = bf16s(&dev, rng, batch * t_max * h * p)?;
        let dt = dev.upload(&vec![0.05f32; batch * t_max * h])?;
        let (b, c) = (
            bf16s(&dev, rng, batch * t_max * g * n)?,
            bf16s(&dev, rng, batch * t_max * g * n)?,
        );
        let mut y = dev.alloc_zeros::<bf16>(batch * t_max * h * p)?;
        let slots: Vec<i32> = (0..batch).map(|b| ((b * 37) % SLOTS) as i32).collect();
        let dslots = dev.upload(&slots)?;
        let ms = timing::median_ms(&dev, || {
            ops::mamba2_step(
                &dev,
                md,
                &mut state,
                &dslots,
                &x.slice(..batch * h * p),
                &dt.slice(..batch * h),
                &a,
                &b.slice(..batch * g * n),
                &c.slice(..batch * g * n),
                &d,
                &mut y.slice_mut(..batch * h * p),
            )
        })?;
        report(
            "mamba2 recurrent (step kernel)",
            batch,
            ms,
            batch as f64 * 2.0 * state_bytes,
            copy,
        );
        for (kind, t, what) in [
            (0usize, 1usize, "mamba2 recurrent (replay kernel)"),
            (1, 1, "mamba2 replay L=16"),
            (2, 4, "mamba2 verify T=4"),
        ] {
            let r = rows(batch, kind, t);
            let meta = dev.upload(&ReplayRow::encode_all(&r))?;
            let shape = ReplayShape {
                batch,
                t,
                ring_rows: L,
                max_m: r.iter().map(|r| r.ring_len + t).max().unwrap_or(t),
            };
            let ms = timing::median_ms(&dev, || {
                ops::mamba2_replay(
                    &dev,
                    md,
                    shape,
                    &mut state,
                    &mut rx,
                    &mut rdt,
                    &mut rb,
                    &meta,
                    &x.slice(..batch * t * h * p),
                    &dt.slice(..batch * t * h),
                    &a,
                    &b.slice(..batch * t * g * n),
                    &c.slice(..batch * t * g * n),
                    &d,
                    &mut y.slice_mut(..batch * t * h * p),
                )
            })?;
            let bytes: f64 = r
                .iter()
                .map(|r| state_bytes * (1.0 + (r.fold > 0) as u8 as f64) + entry * (r.ring_len + t) as f64)
                .sum();
            report(what, batch, ms, bytes, copy);
        }
    }
    let gd = GdnDims {
        k_heads: 16,
        v_heads: 32,
        k_dim: 128,
        v_dim: 128,
    };
    let (hk, hv, dk, dv) = (gd.k_heads, gd.v_heads, gd.k_dim, gd.v_dim);
    let state_bytes = (hv * dv * dk * 4) as f64;
    let entry = (hv * (2 * dv + 4) + hk * 2 * dk) as f64;
    let mut state = dev.alloc_zeros::<f32>(SLOTS * gd.state_len())?;
    let mut ru = bf16s(&dev, rng, SLOTS * L * hv * dv)?;
    let mut rk = bf16s(&dev, rng, SLOTS * L * hk * dk)?;
    let mut rg = dev.upload(&vec![-0.05f32; SLOTS * L * hv])?;
    for batch in [1usize, 64, 256] {
        let t_max = 4;
        let (q, k) = (
            bf16s(&dev, rng, batch * t_max * hk * dk)?,
            bf16s(&dev, rng, batch * t_max * hk * dk)?,
        );
        let v = bf16s(&dev, rng, batch * t_max * hv * dv)?;
        let gg = dev.upload(&vec![-0.05f32; batch * t_max * hv])?;
        let beta = dev.upload(&vec![0.5f32; batch * t_max * hv])?;
        let mut out = dev.alloc_zeros::<bf16>(batch * t_max * hv * dv)?;
        let slots: Vec<i32> = (0..batch).map(|b| ((b * 37) % SLOTS) as i32).collect();
        let dslots = dev.upload(&slots)?;
        let ms = timing::median_ms(&dev, || {
            ops::gdn_step(
                &dev,
                gd,
                &mut state,
                &dslots,
                &q.slice(..batch * hk * dk),
                &k.slice(..batch * hk * dk),
                &v.slice(..batch * hv * dv),
                &gg.slice(..batch * hv),
                &beta.slice(..batch * hv),
                &mut out.slice_mut(..batch * hv * dv),
            )
        })?;
        report(
            "gdn recurrent (step kernel)",
            batch,
            ms,
            batch as f64 * 2.0 * state_bytes,
            copy,
        );
        for (kind, t, what) in [
            (0usize, 1usize, "gdn recurrent (replay kernel)"),
            (1, 1, "gdn replay L=16"),
            (2, 4, "gdn verify T=4"),
        ] {
            let r = rows(batch, kind, t);
            let meta = dev.upload(&ReplayRow::encode_all(&r))?;
            let shape = ReplayShape {
                batch,
                t,
                ring_rows: L,
                max_m: r.iter().map(|r| r.ring_len + t).max().unwrap_or(t),
            };
            let ms = timing::median_ms(&dev, || {
                ops::gdn_replay(
                    &dev,
                    gd,
                    shape,
                    &mut state,
                    &mut ru,
                    &mut rk,
                    &mut rg,
                    &meta,
                    &q.slice(..batch * t * hk * dk),
                    &k.slice(..batch * t * hk * dk),
                    &v.slice(..batch * t * hv * dv),
                    &gg.slice(..batch * t * hv),
                    &beta.slice(..batch * t * hv),
                    &mut out.slice_mut(..batch * t * hv * dv),
                )
            })?;
            let bytes: f64 = r
                .iter()
                .map(|r| state_bytes * (1.0 + (r.fold > 0) as u8 as f64) + entry * (r.ring_len + t) as f64)
                .sum();
            report(what, batch, ms, bytes, copy);
        }
    }
    Ok(())
}
