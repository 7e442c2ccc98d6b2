// The grouped expert pass of a MoE layer: one launch runs every expert's GEMM over its run of rows (grouped by
// moe_align), and moe_combine sums each token's weighted expert outputs.

#define MOE_BM 64
#define MOE_BN 64
#define MOE_BK 16

// out[r, n] = Σ_k a[src(r), k] · w[e, n, k] for every row r of expert e's run offsets[e] .. offsets[e + 1], with
// src(r) = gather[r] when gather is given (rows of x picked by token) and r otherwise. Grid (ceil(N / 64),
// ceil(max_rows / 64), experts) where max_rows bounds any expert's run (the token count); blocks past their expert's
// run exit at once, so no host round trip for the histogram is needed. 256 threads, each a 4 × 4 tile of the 64 × 64
// block tile, operands staged in shared memory as f32 in 16-wide k slices, f32 accumulation.
template <typename T>
__device__ void moe_gemm_impl(const T* __restrict__ a, const int* __restrict__ gather, const T* __restrict__ w,
                              const int* __restrict__ offsets, T* __restrict__ out, int K, int N) {
    __shared__ float as[MOE_BK][MOE_BM + 1];
    __shared__ float ws[MOE_BK][MOE_BN + 1];
    const int e = blockIdx.z;
    const int start = offsets[e];
    const int count = offsets[e + 1] - start;
    const int m0 = blockIdx.y * MOE_BM;
    if (m0 >= count) {
        return;
    }
    const int n0 = blockIdx.x * MOE_BN;
    const int tx = threadIdx.x & 15;
    const int ty = threadIdx.x >> 4;
    const T* we = w + (u64)e * N * K;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc[i][j] = 0.0f;
        }
    }
    for (int k0 = 0; k0 < K; k0 += MOE_BK) {
#pragma unroll
        for (int u = 0; u < (MOE_BM * MOE_BK) / 256; ++u) {
            const int idx = threadIdx.x + 256 * u;
            const int i = idx / MOE_BK;
            const int kk = idx - i * MOE_BK;
            const int k = k0 + kk;
            float av = 0.0f, wv = 0.0f;
            if (k < K) {
                const int r = m0 + i;
                if (r < count) {
                    const int src = gather ? gather[start + r] : start + r;
                    av = to_f32(a[(u64)src * K + k]);
                }
                const int n = n0 + i;
                if (n < N) {
                    wv = to_f32(we[(u64)n * K + k]);
                }
            }
            as[kk][i] = av;
            ws[kk][i] = wv;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < MOE_BK; ++kk) {
            float av[4], bv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                av[i] = as[kk][ty * 4 + i];
                bv[i] = ws[kk][tx * 4 + i];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    acc[i][j] += av[i] * bv[j];
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = m0 + ty * 4 + i;
        if (r >= count) {
            continue;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = n0 + tx * 4 + j;
            if (n < N) {
                out[(u64)(start + r) * N + n] = from_f32<T>(acc[i][j]);
            }
        }
    }
}

// out[t, d] = Σ_k weights[t, k] · y[pos[t, k], d] (in k order, f32), skipping assignments with pos −1; with
// accumulate the sum is added to out. Grid-stride over tokens · dim.
template <typename T>
__device__ void moe_combine_impl(const T* __restrict__ y, const int* __restrict__ pos, const float* __restrict__ weights,
                                 T* __restrict__ out, int tokens, int top_k, int dim, int accumulate) {
    const u64 total = (u64)tokens * dim;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 t = i / dim;
        const u64 d = i - t * dim;
        float acc = 0.0f;
        for (int kk = 0; kk < top_k; ++kk) {
            const int p = pos[t * top_k + kk];
            if (p >= 0) {
                acc += weights[t * top_k + kk] * to_f32(y[(u64)p * dim + d]);
            }
        }
        out[i] = from_f32<T>(accumulate ? to_f32(out[i]) + acc : acc);
    }
}

#define MOE(T, S)                                                                                                  \
    extern "C" __global__ void moe_gemm_##S(const T* a, const int* gather, const T* w, const int* offsets, T* out, \
                                            int K, int N) {                                                        \
        moe_gemm_impl<T>(a, gather, w, offsets, out, K, N);                                                        \
    }                                                                                                              \
    extern "C" __global__ void moe_combine_##S(const T* y, const int* pos, const float* weights, T* out,           \
                                               int tokens, int top_k, int dim, int accumulate) {                   \
        moe_combine_impl<T>(y, pos, weights, out, tokens, top_k, dim, accumulate);                                 \
    }
MOE(float, f32)
MOE(bf16, bf16)
