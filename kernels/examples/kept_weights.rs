//! Times `rewind_kernels::cpu::sample::kept_weights` (the host's sampling filters, which the coordinator runs on every
//! sampled row under tensor parallelism on GPUs, and speculative judging on whole rows) on one row of Qwen3.5's
//! 248,320 ids: plain temperature, top-k 50 and top-p 0.9, the mean of 20 calls each.
//!
//! `cargo run --release -p rewind-kernels --example kept_weights` (results: bench/results/cpu-kept-weights-2026-11-27.md).

fn main() {
    let n = 248_320;
    let mut x: u64 = 7;
    let row: Vec<f32> = (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 16.0 - 8.0
        })
        .collect();
    for (k, p) in [(0usize, 1.0f32), (50, 1.0), (0, 0.9)] {
        let t0 = std::time::Instant::now();
        let mut s = 0usize;
        for _ in 0..20 {
            s += rewind_kernels::cpu::sample::kept_weights(&row, 0.7, k, p, 0.0).len();
        }
        println!(
            "top_k {k} top_p {p}: {:.2} ms per row ({s})",
            t0.elapsed().as_secs_f64() * 1e3 / 20.0
        );
    }
}
