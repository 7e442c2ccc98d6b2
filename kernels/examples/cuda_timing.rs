//! Kernel times of the prefill / attention / MoE ops at the target shapes (bf16 storage), with CUDA events: 3 warm-up
//! launches, then the median of 20; attention beside the copy bandwidth measured in the same run. Correctness is the
//! selftest's job; this only says where time goes.
//!
//! `cargo run --release -p rewind-kernels --example cuda_timing [gemv|gemv_quant|gemm|attention|scans|moe]` on a
//! machine with a GPU; prints one line per op (one section when named, else all).

use half::bf16;
use rewind_kernels::cpu::gdn::GdnDims;
use rewind_kernels::cpu::mamba2::Mamba2Dims;
use rewind_kernels::cuda::ops::{self, Activation, MoeKernel, PagedKv, ScanKernel, SigmoidRouting};
use rewind_kernels::cuda::parity::Rng;
use rewind_kernels::cuda::timing;
use rewind_kernels::cuda::{Blas, CudaDevice, CudaSlice, Result};

/// `n` random bf16 values: a random block of at most 4 Mi values repeated on the device (drawing gigabytes on the host
/// would take minutes; the values only need to be ordinary numbers).
fn random(dev: &CudaDevice, rng: &mut Rng, n: usize, scale: f32) -> Result<CudaSlice<bf16>> {
    let block = n.min(1 << 22);
    let src = dev.upload_as::<bf16>(&rng.uniform_vec(block, scale))?;
    let mut out = dev.alloc::<bf16>(n)?;
    let mut at = 0;
    while at < n {
        let len = block.min(n - at);
        let mut dst = out.slice_mut(at..at + len);
        dev.stream()
            .memcpy_dtod(&src.slice(..len), &mut dst)
            .map_err(|e| rewind_kernels::cuda::CudaError::Unavailable(format!("copy: {e:?}")))?;
        at += len;
    }
    Ok(out)
}

/// One attention row: `batch` sequences of `len` tokens, the last `t` of each attending (decode `t = 1`; prefill
/// `batch = 1`, `t` tokens after `len − t` cached). Decode is reported as K/V bytes read per second and as a fraction
/// of `copy` (the device-to-device copy bandwidth of this run); prefill as causal FLOP/s.
#[allow(clippy::too_many_arguments)]
fn attention(
    dev: &CudaDevice,
    rng: &mut Rng,
    copy: f64,
    batch: usize,
    t: usize,
    len: usize,
    heads: usize,
    kvh: usize,
    d: usize,
) -> Result<()> {
    let bs = 16;
    let bps = len.div_ceil(bs);
    let layout = PagedKv {
        num_blocks: batch * bps,
        block_size: bs,
        kv_heads: kvh,
        head_dim: d,
        num_slots: batch,
        blocks_per_slot: bps,
    };
    let (kp, vp) = (
        random(dev, rng, layout.pool_len(), 1.0)?,
        random(dev, rng, layout.pool_len(), 1.0)?,
    );
    let table: Vec<i32> = rng
        .distinct(batch * bps, batch * bps)
        .iter()
        .map(|&b| b as i32)
        .collect();
    let (dt, dl, ds) = (
        dev.upload(&table)?,
        dev.upload(&vec![len as i32; batch])?,
        dev.upload(&(0..batch as i32).collect::<Vec<_>>())?,
    );
    let q = random(dev, rng, batch * t * heads * d, 1.0)?;
    let mut out = dev.alloc::<bf16>(batch * t * heads * d)?;
    let scale = 1.0 / (d as f32).sqrt();
    let plan = ops::paged_attention_plan::<bf16>(dev, layout, heads, t, batch)?;
    let ms = timing::median_ms(dev, || {
        ops::paged_attention(
            dev, layout, heads, t, &q, &kp, &vp, &dt, &dl, &ds, scale, &mut out, None,
        )
    })?;
    let kv_bytes = (batch * len * kvh * d * 2 * 2) as f64;
    let gbs = kv_bytes / ms / 1e6;
    let flops = 4.0 * (batch * heads * d) as f64 * (t as f64) * (len as f64 - (t as f64 - 1.0) / 2.0);
    println!(
        "paged_attention  batch {batch} t {t} len {len} {heads}/{kvh}×{d}: {ms:.4} ms, K/V {gbs:.0} GB/s \
         ({:.2} of copy), {:.1} TFLOP/s [{} × {} splits, {} blocks]",
        gbs / copy,
        flops / ms / 1e9,
        plan.kernel,
        plan.splits,
        plan.blocks
    );
    Ok(())
}

/// The operands of `[rows, k] · [n, k]ᵀ` (bf16): the weights in enough copies to exceed 256 MiB, so that rotating
/// them keeps every launch reading from memory rather than L2 (as in a model, whose layers each have their own), the
/// input, and the output.
#[allow(clippy::type_complexity)]
fn gemm_operands(
    dev: &CudaDevice,
    rng: &mut Rng,
    rows: usize,
    k: usize,
    n: usize,
) -> Result<(Vec<CudaSlice<bf16>>, CudaSlice<bf16>, CudaSlice<bf16>)> {
    let copies = (256usize << 20).div_ceil(n * k * 2).max(2);
    let ws = (0..copies)
        .map(|_| random(dev, rng, n * k, 0.05))
        .collect::<Result<_>>()?;
    Ok((ws, random(dev, rng, rows * k, 1.0)?, dev.alloc::<bf16>(rows * n)?))
}

/// One skinny GEMM shape `[rows, k] · [n, k]ᵀ` (bf16 in and out) through cuBLAS and through `gemv.cu`, side by side:
/// weight bytes per second and the fraction of `copy` ([`gemm_operands`]).
#[allow(clippy::too_many_arguments)]
fn skinny(
    dev: &CudaDevice,
    blas: &Blas,
    rng: &mut Rng,
    copy: f64,
    rows: usize,
    k: usize,
    n: usize,
    what: &str,
) -> Result<()> {
    let bytes = n * k * 2;
    let (ws, x, mut out) = gemm_operands(dev, rng, rows, k, n)?;
    let copies = ws.len();
    let mut i = 0;
    let cublas = timing::median_ms(dev, || {
        i += 1;
        blas.linear(&x, &ws[i % copies], &mut out, rows, k, n)
    })?;
    let gemv = timing::median_ms(dev, || {
        i += 1;
        ops::gemv(dev, &x, &ws[i % copies], &mut out, rows, k, n)
    })?;
    let gbs = |ms: f64| bytes as f64 / ms / 1e6;
    println!(
        "skinny gemm  [{rows}, {k}] · [{n}, {k}]ᵀ {what}: cuBLAS {cublas:.4} ms ({:.0} GB/s, {:.2} of copy), gemv \
         {gemv:.4} ms ({:.0} GB/s, {:.2} of copy), {:.2}× cuBLAS",
        gbs(cublas),
        gbs(cublas) / copy,
        gbs(gemv),
        gbs(gemv) / copy,
        cublas / gemv
    );
    Ok(())
}

fn main() -> Result<()> {
    let dev = CudaDevice::open(0)?;
    println!("{} (compute capability {:?})", dev.name(), dev.arch());
    let rng = &mut Rng::new(7);
    let copy = timing::copy_bandwidth(&dev)?;
    println!("copy bandwidth (device to device, read + write of 1 GiB): {copy:.0} GB/s");
    let only = std::env::args().nth(1);
    let want = |section: &str| only.as_deref().is_none_or(|o| o == section);
    if want("gemv") {
        gemv_section(&dev, rng, copy)?;
    }
    if want("gemv_quant") {
        gemv_quant_section(&dev, rng, copy)?;
    }
    if want("gemm") {
        gemm_section(&dev, rng)?;
    }
    if want("attention") {
        attention_section(&dev, rng, copy)?;
    }
    if want("scans") {
        scans_section(&dev, rng)?;
    }
    if want("moe") {
        for (tokens, experts, top_k, h, i, gated) in [
            (64, 128, 6, 2688, 1856, false),
            (64, 512, 10, 2048, 512, true),
            (1024, 128, 6, 2688, 1856, false),
            (1024, 512, 10, 2048, 512, true),
        ] {
            moe(&dev, rng, tokens, experts, top_k, h, i, gated)?;
        }
    }
    Ok(())
}

fn gemv_section(dev: &CudaDevice, rng: &mut Rng, copy: f64) -> Result<()> {
    let blas = Blas::new(dev)?;
    for rows in [1, 2, 4, 5, 8] {
        for (k, n, what) in [
            (4096, 18560, "Nemotron-H-8B Mamba in_proj"),
            (8192, 4096, "Nemotron-H-8B Mamba out_proj"),
            (4096, 21504, "Nemotron-H-8B MLP up"),
            (21504, 4096, "Nemotron-H-8B MLP down"),
            (4096, 1024, "Nemotron-H-8B k_proj"),
            (4096, 131072, "Nemotron-H-8B LM head"),
            (2560, 9216, "Qwen3.5-4B MLP gate"),
        ] {
            skinny(dev, &blas, rng, copy, rows, k, n, what)?;
        }
    }
    Ok(())
}

/// `len` random bytes on the device, a random block of at most 4 MiB repeated ([`random`]); E4M3's NaN codes are
/// moved to ±448 so that FP8 codes are finite.
fn random_codes(dev: &CudaDevice, rng: &mut Rng, len: usize) -> Result<CudaSlice<u8>> {
    let block: Vec<u8> = (0..len.min(1 << 22))
        .map(|_| rng.next_u64() as u8)
        .map(|b| if b & 0x7f == 0x7f { b ^ 1 } else { b })
        .collect();
    let src = dev.upload(&block)?;
    let mut out = dev.alloc::<u8>(len)?;
    let mut at = 0;
    while at < len {
        let n = block.len().min(len - at);
        let mut dst = out.slice_mut(at..at + n);
        dev.stream()
            .memcpy_dtod(&src.slice(..n), &mut dst)
            .map_err(|e| rewind_kernels::cuda::CudaError::Unavailable(format!("copy: {e:?}")))?;
        at += n;
    }
    Ok(out)
}

/// The skinny GEMMs on quantized weights (`gemv_quant.cu`, bf16 activations, f32 out) beside the bf16 one (`gemv.cu`)
/// at decode shapes: time, bytes read per second (codes and scales) as a fraction of `copy`, and the speed-up over
/// bf16, the decode step's bound at small batch. Weights rotate through copies past 256 MiB, as in [`gemm_operands`].
fn gemv_quant_section(dev: &CudaDevice, rng: &mut Rng, copy: f64) -> Result<()> {
    use rewind_kernels::cpu::gemv_quant::{FP8_BLOCK, NVFP4_GROUP};
    for rows in [1, 2, 4, 8] {
        for (k, n, what) in [
            (4096, 18560, "Nemotron-H-8B Mamba in_proj"),
            (8192, 4096, "Nemotron-H-8B Mamba out_proj"),
            (21504, 4096, "Nemotron-H-8B MLP down"),
            (2560, 9216, "Qwen3.5-4B MLP gate"),
            (9216, 2560, "Qwen3.5-4B MLP down"),
        ] {
            let (ws, x, _) = gemm_operands(dev, rng, rows, k, n)?;
            let mut out = dev.alloc::<f32>(rows * n)?;
            let copies = (256usize << 20).div_ceil(n * k).max(2);
            let grid = n.div_ceil(FP8_BLOCK) * k.div_ceil(FP8_BLOCK);
            let fp8: Vec<_> = (0..copies)
                .map(|_| Ok((random_codes(dev, rng, n * k)?, dev.upload(&vec![1e-3f32; grid])?)))
                .collect::<Result<_>>()?;
            let fp4: Vec<_> = (0..copies)
                .map(|_| {
                    Ok((
                        random_codes(dev, rng, n * k / 2)?,
                        random_codes(dev, rng, n * k / NVFP4_GROUP)?,
                    ))
                })
                .collect::<Result<_>>()?;
            let mut i = 0;
            let bf16_ms = timing::median_ms(dev, || {
                i += 1;
                ops::gemv(dev, &x, &ws[i % ws.len()], &mut out, rows, k, n)
            })?;
            let fp8_ms = timing::median_ms(dev, || {
                i += 1;
                let (w, s) = &fp8[i % copies];
                ops::gemv_fp8_block(dev, &x, w, s, &mut out, rows, k, n)
            })?;
            let fp4_ms = timing::median_ms(dev, || {
                i += 1;
                let (w, s) = &fp4[i % copies];
                ops::gemv_nvfp4(dev, &x, w, s, 1e-3, &mut out, rows, k, n)
            })?;
            let frac = |bytes: usize, ms: f64| bytes as f64 / ms / 1e6 / copy;
            println!(
                "skinny gemm  [{rows}, {k}] · [{n}, {k}]ᵀ {what}: bf16 {bf16_ms:.4} ms ({:.2} of copy), fp8 blocks \
                 {fp8_ms:.4} ms ({:.2} of copy, {:.2}× bf16), nvfp4 {fp4_ms:.4} ms ({:.2} of copy, {:.2}× bf16)",
                frac(n * k * 2, bf16_ms),
                frac(n * k + grid * 4, fp8_ms),
                bf16_ms / fp8_ms,
                frac(n * k / 2 + n * k / NVFP4_GROUP, fp4_ms),
                bf16_ms / fp4_ms
            );
        }
    }
    Ok(())
}

/// Dense bf16 peak of the H100 / H200 (SXM), TFLOP/s: the denominator of the GEMM lines' fraction.
const HOPPER_BF16_TFLOPS: f64 = 989.0;

/// The GEMMs of a verify step (rows = batch · T tokens) and of a decode at batch 256, through `cublasGemmEx` (what the
/// engine's `linear` calls) and through cuBLASLt's heuristic (`linear_lt`), both bf16 in and out: whether the verify
/// step's 1024-row GEMMs (about half the dense peak in the stage profile) would gain from the other entry point.
fn gemm_section(dev: &CudaDevice, rng: &mut Rng) -> Result<()> {
    let blas = Blas::new(dev)?;
    for rows in [256, 1024] {
        for (k, n, what) in [
            (4096, 18560, "Nemotron-H-8B Mamba in_proj"),
            (8192, 4096, "Nemotron-H-8B Mamba out_proj"),
            (4096, 21504, "Nemotron-H-8B MLP up"),
            (21504, 4096, "Nemotron-H-8B MLP down"),
            (2560, 9216, "Qwen3.5-4B MLP gate"),
            (9216, 2560, "Qwen3.5-4B MLP down"),
        ] {
            let (ws, x, mut out) = gemm_operands(dev, rng, rows, k, n)?;
            let copies = ws.len();
            let mut i = 0;
            let gemm_ex = timing::median_ms(dev, || {
                i += 1;
                blas.linear(&x, &ws[i % copies], &mut out, rows, k, n)
            })?;
            let lt = timing::median_ms(dev, || {
                i += 1;
                blas.linear_lt(&x, &ws[i % copies], None, &mut out, rows, k, n)
            })?;
            let tflops = |ms: f64| 2.0 * (rows * k * n) as f64 / ms / 1e9;
            println!(
                "gemm  [{rows}, {k}] · [{n}, {k}]ᵀ {what}: cublasGemmEx {gemm_ex:.4} ms ({:.0} TFLOP/s, {:.2} of peak), \
                 cuBLASLt {lt:.4} ms ({:.0} TFLOP/s, {:.2} of peak), Lt {:.2}× GemmEx",
                tflops(gemm_ex),
                tflops(gemm_ex) / HOPPER_BF16_TFLOPS,
                tflops(lt),
                tflops(lt) / HOPPER_BF16_TFLOPS,
                gemm_ex / lt
            );
        }
    }
    Ok(())
}

fn attention_section(dev: &CudaDevice, rng: &mut Rng, copy: f64) -> Result<()> {
    for (batch, t, len, heads, kvh, d) in [
        (32, 1, 4096, 32, 8, 128),
        (32, 1, 4096, 16, 4, 256),
        (32, 1, 4096, 16, 2, 256),
        (1, 1, 128, 32, 8, 128),
        (64, 1, 8192, 32, 8, 128),
        (64, 1, 8192, 16, 2, 256),
        (256, 1, 32768, 32, 8, 128),
        (256, 1, 32768, 16, 2, 256),
        (1, 1024, 1024, 32, 8, 128),
        (1, 1024, 1024, 16, 4, 256),
        (1, 1024, 4096, 32, 8, 128),
    ] {
        attention(dev, rng, copy, batch, t, len, heads, kvh, d)?;
    }
    Ok(())
}

fn scans_section(dev: &CudaDevice, rng: &mut Rng) -> Result<()> {
    let (seq, chunk) = (1024, 64);
    let md = Mamba2Dims {
        heads: 128,
        head_dim: 64,
        state_dim: 128,
        groups: 8,
    };
    let x = random(dev, rng, seq * 128 * 64, 1.0)?;
    let (b, c) = (
        random(dev, rng, seq * 8 * 128, 1.0)?,
        random(dev, rng, seq * 8 * 128, 1.0)?,
    );
    let dt = dev.upload(&(0..seq * 128).map(|_| rng.uniform(0.01, 0.2)).collect::<Vec<f32>>())?;
    let a = dev.upload(&(0..128).map(|_| -rng.uniform(0.5, 4.0)).collect::<Vec<f32>>())?;
    let dsk = dev.upload(&rng.uniform_vec(128, 1.0))?;
    let mut state = dev.upload(&rng.uniform_vec(128 * 64 * 128, 1.0))?;
    let mut y = dev.alloc::<bf16>(seq * 128 * 64)?;
    let mut ws = dev.alloc::<f32>(ops::mamba2_chunked_workspace(md, seq, chunk))?;
    let mut ms = [0.0; 2];
    for (slot, kernel) in [ScanKernel::Simt, ScanKernel::Auto].into_iter().enumerate() {
        ms[slot] = timing::median_ms(dev, || {
            ops::mamba2_chunked_using(
                dev, kernel, md, seq, chunk, &mut state, &x, &dt, &a, &b, &c, &dsk, &mut y, &mut ws,
            )
        })?;
    }
    println!(
        "mamba2_chunked   Nemotron-H-8B 128×64 state 128, seq {seq}: SIMT {:.3} ms, auto (tensor cores) {:.3} ms, {:.2}x",
        ms[0],
        ms[1],
        ms[0] / ms[1]
    );

    let gd = GdnDims {
        k_heads: 16,
        v_heads: 32,
        k_dim: 128,
        v_dim: 128,
    };
    let (q, k) = (
        random(dev, rng, seq * 16 * 128, 0.09)?,
        random(dev, rng, seq * 16 * 128, 0.09)?,
    );
    let v = random(dev, rng, seq * 32 * 128, 1.0)?;
    let g = dev.upload(&(0..seq * 32).map(|_| -rng.uniform(0.01, 1.0)).collect::<Vec<f32>>())?;
    let beta = dev.upload(&(0..seq * 32).map(|_| rng.uniform(0.1, 0.9)).collect::<Vec<f32>>())?;
    let mut gstate = dev.upload(&rng.uniform_vec(gd.state_len(), 0.5))?;
    let mut o = dev.alloc::<bf16>(seq * 32 * 128)?;
    let mut gws = dev.alloc::<f32>(ops::gdn_chunked_workspace(gd, seq, chunk))?;
    let mut ms = [0.0; 2];
    for (slot, kernel) in [ScanKernel::Simt, ScanKernel::Auto].into_iter().enumerate() {
        ms[slot] = timing::median_ms(dev, || {
            ops::gdn_chunked_using(
                dev,
                kernel,
                gd,
                seq,
                chunk,
                &mut gstate,
                &q,
                &k,
                &v,
                &g,
                &beta,
                &mut o,
                &mut gws,
            )
        })?;
    }
    println!(
        "gdn_chunked      Qwen3.5-4B 16/32×128, seq {seq}: SIMT {:.3} ms, auto (tensor cores) {:.3} ms, {:.2}x",
        ms[0],
        ms[1],
        ms[0] / ms[1]
    );

    Ok(())
}

/// One routed MLP pass: routing, then the up GEMM alone with each kernel, then the whole pass (align, GEMMs,
/// activation, combine) with the SIMT kernel and with the automatic choice.
#[allow(clippy::too_many_arguments)]
fn moe(
    dev: &CudaDevice,
    rng: &mut Rng,
    tokens: usize,
    experts: usize,
    top_k: usize,
    h: usize,
    i: usize,
    gated: bool,
) -> Result<()> {
    let logits = dev.upload(&rng.uniform_vec(tokens * experts, 4.0))?;
    let bias = dev.upload(&rng.uniform_vec(experts, 0.5))?;
    let mut ids = dev.alloc_zeros::<i32>(tokens * top_k)?;
    let mut wts = dev.alloc_zeros::<f32>(tokens * top_k)?;
    let ms_route = if gated {
        timing::median_ms(dev, || {
            ops::route_softmax(dev, &logits, experts, top_k, true, &mut ids, &mut wts)
        })?
    } else {
        let cfg = SigmoidRouting {
            experts,
            top_k,
            n_group: 1,
            topk_group: 1,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
        };
        timing::median_ms(dev, || {
            ops::route_sigmoid_grouped(dev, cfg, &logits, &bias, &mut ids, &mut wts)
        })?
    };
    // The GEMMs run on uniformly spread assignments (each token's top-k a random set, as the peer's draw in
    // bench/peers/prefill.py): random logits with a correction bias concentrate the picks on a few experts, which
    // would time a different amount of weight traffic than the peer reads.
    let spread: Vec<i32> = (0..tokens)
        .flat_map(|_| rng.distinct(top_k, experts))
        .map(|e| e as i32)
        .collect();
    let ids = dev.upload(&spread)?;
    let n = tokens * top_k;
    let x = random(dev, rng, tokens * h, 1.0)?;
    let w_up = random(dev, rng, experts * i * h, 0.02)?;
    let w_gate = random(dev, rng, if gated { experts * i * h } else { 1 }, 0.02)?;
    let w_down = random(dev, rng, experts * h * i, 0.02)?;
    let mut offsets = dev.alloc_zeros::<i32>(experts + 1)?;
    let (mut rows, mut pos) = (dev.alloc_zeros::<i32>(n)?, dev.alloc_zeros::<i32>(n)?);
    let (mut up, mut gt, mut act) = (
        dev.alloc::<bf16>(n * i)?,
        dev.alloc::<bf16>(n * i)?,
        dev.alloc::<bf16>(n * i)?,
    );
    let mut yv = dev.alloc::<bf16>(n * h)?;
    let mut out = dev.alloc::<bf16>(tokens * h)?;
    ops::moe_align(dev, &ids, top_k, experts, &mut offsets, &mut rows, &mut pos)?;
    let used: Vec<i32> = dev.download(&offsets)?;
    let active = used.windows(2).filter(|w| w[1] > w[0]).count();
    let up_bytes = (active * i * h * 2) as f64;
    let up_flop = (2 * n * i * h) as f64;
    let mut ups = Vec::new();
    for (kernel, what) in [
        (MoeKernel::Simt, "SIMT"),
        (MoeKernel::TensorM16, "tensor m16"),
        (MoeKernel::TensorM64, "tensor m64"),
    ] {
        let ms = timing::median_ms(dev, || {
            ops::moe_gemm_using(dev, kernel, &x, Some(&rows), &w_up, &offsets, &mut up, tokens, h, i)
        })?;
        ups.push(format!(
            "{what} {ms:.3} ms ({:.0} GB/s, {:.1} TFLOP/s)",
            up_bytes / ms / 1e6,
            up_flop / ms / 1e9
        ));
    }
    let mut whole = |kernel: MoeKernel| {
        timing::median_ms(dev, || {
            ops::moe_align(dev, &ids, top_k, experts, &mut offsets, &mut rows, &mut pos)?;
            ops::moe_gemm_using(dev, kernel, &x, Some(&rows), &w_up, &offsets, &mut up, tokens, h, i)?;
            if gated {
                ops::moe_gemm_using(dev, kernel, &x, Some(&rows), &w_gate, &offsets, &mut gt, tokens, h, i)?;
                ops::swiglu(dev, &gt, &up, &mut act)?;
            } else {
                ops::activation(dev, Activation::Relu2, &up, &mut act)?;
            }
            ops::moe_gemm_using::<bf16, CudaSlice<i32>>(
                dev, kernel, &act, None, &w_down, &offsets, &mut yv, tokens, i, h,
            )?;
            ops::moe_combine(dev, &yv, &pos, &wts, top_k, false, &mut out)
        })
    };
    let (ms_simt, ms_auto) = (whole(MoeKernel::Simt)?, whole(MoeKernel::Auto)?);
    let mats = if gated { 3 } else { 2 };
    let bytes = (active * mats * i * h * 2) as f64;
    println!(
        "moe {experts} experts top-{top_k} {h}/{i}, {tokens} tokens, {active} experts active: route {ms_route:.3} ms; \
         up GEMM {}; whole pass SIMT {ms_simt:.3} ms ({:.0} GB/s of weights), auto {ms_auto:.3} ms ({:.0} GB/s), \
         {:.2}x",
        ups.join(", "),
        bytes / ms_simt / 1e6,
        bytes / ms_auto / 1e6,
        ms_simt / ms_auto
    );
    Ok(())
}
