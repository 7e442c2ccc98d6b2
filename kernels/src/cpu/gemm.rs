//! Matrix products through the `gemm` crate (the same one candle uses), never hand loops.

use gemm::Parallelism;

fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    // Threading a small product costs more than it saves.
    if m * n * k < 64 * 64 * 64 {
        Parallelism::None
    } else {
        Parallelism::Rayon(0)
    }
}

/// A row-major operand read through its strides: element `(i, j)` is at `i * rs + j * cs`.
struct Operand<'a> {
    data: &'a [f32],
    rs: isize,
    cs: isize,
}

/// `out[m, n] = lhs[m, k] · rhs[k, n]` for operands given by strides. Overwrites `out`.
fn product(lhs: Operand, rhs: Operand, out: &mut [f32], m: usize, k: usize, n: usize, what: &str) {
    assert_eq!(lhs.data.len(), m * k, "{what}: lhs");
    assert_eq!(rhs.data.len(), k * n, "{what}: rhs");
    assert_eq!(out.len(), m * n, "{what}: out");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out.fill(0.0);
        return;
    }
    // SAFETY: the lengths were checked above, and every caller's strides keep indices inside `m·k` / `k·n` / `m·n`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            lhs.data.as_ptr(),
            lhs.cs,
            lhs.rs,
            rhs.data.as_ptr(),
            rhs.cs,
            rhs.rs,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism(m, n, k),
        );
    }
}

/// `out[m, n] = a[m, k] · b[n, k]ᵀ` — the shape of `x · Wᵀ` with an HF `[out, in]` weight. Overwrites `out`.
pub fn matmul_nt(a: &[f32], b: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    let ki = k as isize;
    product(
        Operand { data: a, rs: ki, cs: 1 },
        Operand { data: b, rs: 1, cs: ki },
        out,
        m,
        k,
        n,
        "matmul_nt",
    );
}

/// `out[m, n] = a[m, k] · b[k, n]`. Overwrites `out`.
pub fn matmul_nn(a: &[f32], b: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    let (ki, ni) = (k as isize, n as isize);
    product(
        Operand { data: a, rs: ki, cs: 1 },
        Operand { data: b, rs: ni, cs: 1 },
        out,
        m,
        k,
        n,
        "matmul_nn",
    );
}

/// `out[m, n] = a[k, m]ᵀ · b[k, n]`. Overwrites `out`.
pub fn matmul_tn(a: &[f32], b: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    let (mi, ni) = (m as isize, n as isize);
    product(
        Operand { data: a, rs: 1, cs: mi },
        Operand { data: b, rs: ni, cs: 1 },
        out,
        m,
        k,
        n,
        "matmul_tn",
    );
}

/// A linear layer over `rows` inputs: `x[rows, in] · w[out, in]ᵀ (+ bias[out])`.
pub fn linear(x: &[f32], w: &[f32], bias: Option<&[f32]>, rows: usize, in_dim: usize, out_dim: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * out_dim];
    matmul_nt(x, w, &mut out, rows, in_dim, out_dim);
    if let Some(b) = bias {
        assert_eq!(b.len(), out_dim, "linear: bias");
        for row in out.chunks_exact_mut(out_dim) {
            for (o, bi) in row.iter_mut().zip(b) {
                *o += bi;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, a_t: bool, b_t: bool) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for p in 0..k {
                    let av = if a_t { a[p * m + i] } else { a[i * k + p] };
                    let bv = if b_t { b[j * k + p] } else { b[p * n + j] };
                    s += av as f64 * bv as f64;
                }
                out[i * n + j] = s as f32;
            }
        }
        out
    }

    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed)) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    #[test]
    fn products_match_naive() {
        for &(m, k, n) in &[(1, 7, 5), (3, 64, 17), (70, 80, 90), (130, 33, 1)] {
            let a = data(m * k, 1);
            let b = data(k * n, 2);
            let mut out = vec![f32::NAN; m * n];
            matmul_nt(&a, &b, &mut out, m, k, n);
            let r = naive(&a, &b, m, k, n, false, true);
            assert!(out.iter().zip(&r).all(|(x, y)| (x - y).abs() < 1e-3), "nt {m}x{k}x{n}");
            matmul_nn(&a, &b, &mut out, m, k, n);
            let r = naive(&a, &b, m, k, n, false, false);
            assert!(out.iter().zip(&r).all(|(x, y)| (x - y).abs() < 1e-3), "nn {m}x{k}x{n}");
            let at = data(k * m, 3);
            matmul_tn(&at, &b, &mut out, m, k, n);
            let r = naive(&at, &b, m, k, n, true, false);
            assert!(out.iter().zip(&r).all(|(x, y)| (x - y).abs() < 1e-3), "tn {m}x{k}x{n}");
        }
    }

    #[test]
    fn linear_adds_bias() {
        let x = [1.0, 2.0];
        let w = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let y = linear(&x, &w, Some(&[0.5, -0.5, 0.0]), 1, 2, 3);
        assert_eq!(y, vec![1.5, 1.5, 3.0]);
    }
}
