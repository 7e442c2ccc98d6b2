// Skinny GEMMs, out[r, n] = Σ_k x[r, k] · w[n, k] for a few rows r (a decode step at small batch, one sequence's
// verify): the work is one pass over the weights, so the kernel is built to stream them. Each warp owns GEMV_COLS
// output columns and reads those weight rows once, 16 bytes per lane per load, with every row of x (bf16, hot in L1 /
// L2) against them; f32 accumulation, one warp reduction per output at the end.
//
// Contract (checked on the host): k a multiple of 8, x and w 16-byte aligned, 1 ≤ rows ≤ GEMV_MAX_ROWS.

#define GEMV_COLS 2
#define GEMV_MAX_ROWS 8

template <typename T, int R>
__device__ void gemv_rows(const bf16* __restrict__ x, const bf16* __restrict__ w, T* __restrict__ out, int k, int n) {
    const int lane = threadIdx.x & 31;
    const int col0 = (int)((blockIdx.x * (u64)blockDim.x + threadIdx.x) >> 5) * GEMV_COLS;
    if (col0 >= n) {
        return;
    }
    const int chunks = k >> 3;
    const uint4* xv = (const uint4*)x;
    const uint4* wv = (const uint4*)w;
    float acc[R][GEMV_COLS];
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
        for (int j = 0; j < GEMV_COLS; j++) {
            acc[r][j] = 0.0f;
        }
    }
    // A last warp with fewer columns re-reads its last column (results dropped) rather than branching in the loop.
    const uint4* wrow[GEMV_COLS];
#pragma unroll
    for (int j = 0; j < GEMV_COLS; j++) {
        wrow[j] = wv + (u64)min(col0 + j, n - 1) * chunks;
    }
#pragma unroll 4
    for (int c = lane; c < chunks; c += 32) {
        float wf[GEMV_COLS][8];
#pragma unroll
        for (int j = 0; j < GEMV_COLS; j++) {
            bf16x8(__ldg(wrow[j] + c), wf[j]);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            float xf[8];
            bf16x8(__ldg(xv + (u64)r * chunks + c), xf);
#pragma unroll
            for (int j = 0; j < GEMV_COLS; j++) {
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    acc[r][j] = fmaf(xf[e], wf[j][e], acc[r][j]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
        for (int j = 0; j < GEMV_COLS; j++) {
            const float s = warp_sum(acc[r][j]);
            if (lane == 0 && col0 + j < n) {
                out[(u64)r * n + col0 + j] = from_f32<T>(s);
            }
        }
    }
}

template <typename T>
__device__ void gemv_impl(const bf16* x, const bf16* w, T* out, int rows, int k, int n) {
    switch (rows) {
        case 1: gemv_rows<T, 1>(x, w, out, k, n); break;
        case 2: gemv_rows<T, 2>(x, w, out, k, n); break;
        case 3: gemv_rows<T, 3>(x, w, out, k, n); break;
        case 4: gemv_rows<T, 4>(x, w, out, k, n); break;
        case 5: gemv_rows<T, 5>(x, w, out, k, n); break;
        case 6: gemv_rows<T, 6>(x, w, out, k, n); break;
        case 7: gemv_rows<T, 7>(x, w, out, k, n); break;
        case 8: gemv_rows<T, 8>(x, w, out, k, n); break;
        default: break;
    }
}

// `_f32` / `_bf16` name the output's storage; x and w are bf16 in both.
#define GEMV(T, S)                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) gemv_##S(const bf16* x, const bf16* w, T* out, int rows, \
                                                              int k, int n) {                                \
        gemv_impl<T>(x, w, out, rows, k, n);                                                                  \
    }
GEMV(float, f32)
GEMV(bf16, bf16)
