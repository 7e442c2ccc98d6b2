// Skinny GEMMs on quantized weights, out[r, n] = Σ_k x[r, k] · W[n, k] for a few rows r (a decode step at small
// batch): the CUDA twins of kernels/src/cpu/gemv_quant.rs. A decode step at small batch is one pass over the weights,
// and these weights are 1 (FP8) or 1/2 (NVFP4) byte an element against bf16's 2, so the kernels are built like
// gemv.cu to stream them: each warp owns QGEMV_COLS output columns and reads their rows of codes once, 16 bytes per
// lane per load; the codes are decoded in registers and multiplied with every row of x (bf16 or f32, hot in L1 / L2)
// in f32; each run of 16 elements sharing a scale (a lane's 16 FP8 codes lie in one 128-column block; an NVFP4 group
// is 16 elements) sums unscaled and is scaled once; one warp reduction per output at the end.
//
// Decoding is exact and needs no table: an E4M3 code's low 7 bits placed at f32 bits 20..26 (its sign at 31) make the
// f32 whose value is the code's times 2^-120 (subnormal codes land on f32 subnormals with the same mantissa), so one
// multiply by 2^120 gives the code's value; an E2M1 code at bits 22..24 is its value times 2^-126 likewise. NaN codes
// (0x7F / 0xFF), which quantizers never write (they saturate at 448), are detected per 16 bytes and make the output
// NaN, as the CPU twin's NaN weight does.
//
// Contract (checked on the host): 1 ≤ rows ≤ QGEMV_MAX_ROWS; k a multiple of 16 (FP8) / 32 (NVFP4); x and w 16-byte
// aligned; the NVFP4 scales 2-byte aligned.

#define QGEMV_COLS 2
#define QGEMV_MAX_ROWS 8
#define FP8_BLOCK 128

typedef unsigned char u8;
typedef unsigned short u16;

// E4M3 code in byte P of v, as its value times 2^-120.
template <int P>
__device__ __forceinline__ float e4m3_raw(u32 v) {
    const u32 s = v >> (8 * P);
    return __uint_as_float(((s & 0x7fu) << 20) | ((s & 0x80u) << 24));
}

// Nonzero when a byte of v is an E4M3 NaN code.
__device__ __forceinline__ u32 e4m3_nan_bytes(u32 v) { return ((v & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u; }

// One E4M3 code's value (a scale: read once per 16 elements, so the NaN check costs nothing that matters).
__device__ __forceinline__ float e4m3_value(u32 b) {
    return (b & 0x7fu) == 0x7fu ? nan_f32() : e4m3_raw<0>(b) * 0x1p120f;
}

// E2M1 code in nibble P of v, as its value times 2^-126.
template <int P>
__device__ __forceinline__ float e2m1_raw(u32 v) {
    const u32 s = v >> (4 * P);
    return __uint_as_float(((s & 0x7u) << 22) | ((s & 0x8u) << 28));
}

// The 4 E4M3 codes of v, decoded.
__device__ __forceinline__ void fp8x4(u32 v, float* f) {
    f[0] = e4m3_raw<0>(v) * 0x1p120f;
    f[1] = e4m3_raw<1>(v) * 0x1p120f;
    f[2] = e4m3_raw<2>(v) * 0x1p120f;
    f[3] = e4m3_raw<3>(v) * 0x1p120f;
}

// The 8 E2M1 codes of v (element 2j in the low nibble of byte j), decoded.
__device__ __forceinline__ void fp4x8(u32 v, float* f) {
    f[0] = e2m1_raw<0>(v) * 0x1p126f;
    f[1] = e2m1_raw<1>(v) * 0x1p126f;
    f[2] = e2m1_raw<2>(v) * 0x1p126f;
    f[3] = e2m1_raw<3>(v) * 0x1p126f;
    f[4] = e2m1_raw<4>(v) * 0x1p126f;
    f[5] = e2m1_raw<5>(v) * 0x1p126f;
    f[6] = e2m1_raw<6>(v) * 0x1p126f;
    f[7] = e2m1_raw<7>(v) * 0x1p126f;
}

// x[i .. i + 8) widened to f32 (i a multiple of 8, so the loads are aligned).
__device__ __forceinline__ void x8(const bf16* x, u64 i, float f[8]) { bf16x8(__ldg((const uint4*)(x + i)), f); }
__device__ __forceinline__ void x8(const float* x, u64 i, float f[8]) {
    const float4 a = __ldg((const float4*)(x + i));
    const float4 b = __ldg((const float4*)(x + i) + 1);
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
    f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

// The warp's first column, or -1 past the end; `wrow`: each column's row of 16-byte words (a last warp with fewer
// columns re-reads its last one, results dropped, rather than branching in the loop).
__device__ __forceinline__ int warp_columns(int n, int words_per_row, const uint4* w, const uint4* wrow[QGEMV_COLS],
                                            int col[QGEMV_COLS]) {
    const int col0 = (int)((blockIdx.x * (u64)blockDim.x + threadIdx.x) >> 5) * QGEMV_COLS;
    if (col0 >= n) {
        return -1;
    }
#pragma unroll
    for (int j = 0; j < QGEMV_COLS; j++) {
        col[j] = min(col0 + j, n - 1);
        wrow[j] = w + (u64)col[j] * words_per_row;
    }
    return col0;
}

// FP8 weights. BLOCKED: `scales` is the [⌈n / 128⌉, ⌈k / 128⌉] block grid, each lane's 16 codes scaled by their block's
// entry; otherwise one scale per tensor (`per_row` 0) or per output row (1), applied to the finished sum.
template <typename T, int R, bool BLOCKED>
__device__ void fp8_rows(const T* __restrict__ x, const u8* __restrict__ w, const float* __restrict__ scales,
                         int per_row, float* __restrict__ out, int k, int n) {
    const int lane = threadIdx.x & 31;
    const int chunks = k >> 4;
    const uint4* wrow[QGEMV_COLS];
    int col[QGEMV_COLS];
    const int col0 = warp_columns(n, chunks, (const uint4*)w, wrow, col);
    if (col0 < 0) {
        return;
    }
    const int bcols = (k + FP8_BLOCK - 1) / FP8_BLOCK;
    const float* srow[QGEMV_COLS];
    float acc[R][QGEMV_COLS];
    u32 nan[QGEMV_COLS];
#pragma unroll
    for (int j = 0; j < QGEMV_COLS; j++) {
        srow[j] = scales + (BLOCKED ? (u64)(col[j] / FP8_BLOCK) * bcols : 0);
        nan[j] = 0;
#pragma unroll
        for (int r = 0; r < R; r++) {
            acc[r][j] = 0.0f;
        }
    }
#pragma unroll 4
    for (int c = lane; c < chunks; c += 32) {
        u32 q[QGEMV_COLS][4];
#pragma unroll
        for (int j = 0; j < QGEMV_COLS; j++) {
            const uint4 v = __ldg(wrow[j] + c);
            q[j][0] = v.x, q[j][1] = v.y, q[j][2] = v.z, q[j][3] = v.w;
            nan[j] |= e4m3_nan_bytes(v.x) | e4m3_nan_bytes(v.y) | e4m3_nan_bytes(v.z) | e4m3_nan_bytes(v.w);
        }
        float part[R][QGEMV_COLS];
#pragma unroll
        for (int r = 0; r < R; r++) {
#pragma unroll
            for (int j = 0; j < QGEMV_COLS; j++) {
                part[r][j] = 0.0f;
            }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float wf[QGEMV_COLS][8];
#pragma unroll
            for (int j = 0; j < QGEMV_COLS; j++) {
                fp8x4(q[j][2 * h], wf[j]);
                fp8x4(q[j][2 * h + 1], wf[j] + 4);
            }
#pragma unroll
            for (int r = 0; r < R; r++) {
                float xf[8];
                x8(x, (u64)r * k + (u64)c * 16 + h * 8, xf);
#pragma unroll
                for (int j = 0; j < QGEMV_COLS; j++) {
#pragma unroll
                    for (int e = 0; e < 8; e++) {
                        part[r][j] = fmaf(xf[e], wf[j][e], part[r][j]);
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < QGEMV_COLS; j++) {
            const float s = BLOCKED ? __ldg(srow[j] + (c >> 3)) : 1.0f;
#pragma unroll
            for (int r = 0; r < R; r++) {
                acc[r][j] = BLOCKED ? fmaf(part[r][j], s, acc[r][j]) : acc[r][j] + part[r][j];
            }
        }
    }
#pragma unroll
    for (int j = 0; j < QGEMV_COLS; j++) {
        const bool bad = __any_sync(0xffffffffu, nan[j] != 0);
        const float s = BLOCKED ? 1.0f : __ldg(scales + (per_row ? col[j] : 0));
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float sum = warp_sum(acc[r][j]);
            if (lane == 0 && col0 + j < n) {
                out[(u64)r * n + col0 + j] = bad ? nan_f32() : (BLOCKED ? sum : sum * s);
            }
        }
    }
}

// NVFP4 weights: 32 elements per 16-byte word, two groups of 16, each with its E4M3 scale (the pair read as one u16)
// times `global`.
template <typename T, int R>
__device__ void nvfp4_rows(const T* __restrict__ x, const u8* __restrict__ w, const u8* __restrict__ scales,
                           float global, float* __restrict__ out, int k, int n) {
    const int lane = threadIdx.x & 31;
    const int chunks = k >> 5;
    const uint4* wrow[QGEMV_COLS];
    int col[QGEMV_COLS];
    const int col0 = warp_columns(n, chunks, (const uint4*)w, wrow, col);
    if (col0 < 0) {
        return;
    }
    const u16* srow[QGEMV_COLS];
    float acc[R][QGEMV_COLS];
#pragma unroll
    for (int j = 0; j < QGEMV_COLS; j++) {
        srow[j] = (const u16*)scales + (u64)col[j] * chunks;
#pragma unroll
        for (int r = 0; r < R; r++) {
            acc[r][j] = 0.0f;
        }
    }
#pragma unroll 2
    for (int c = lane; c < chunks; c += 32) {
        u32 q[QGEMV_COLS][4];
        float gs[QGEMV_COLS][2];
#pragma unroll
        for (int j = 0; j < QGEMV_COLS; j++) {
            const uint4 v = __ldg(wrow[j] + c);
            q[j][0] = v.x, q[j][1] = v.y, q[j][2] = v.z, q[j][3] = v.w;
            const u32 s = __ldg(srow[j] + c);
            // As the CPU twin rounds it: e4m3(scale) · global, then the element times that.
            gs[j][0] = e4m3_value(s & 0xffu) * global;
            gs[j][1] = e4m3_value(s >> 8) * global;
        }
#pragma unroll
        for (int g = 0; g < 2; g++) {
            float part[R][QGEMV_COLS];
#pragma unroll
            for (int r = 0; r < R; r++) {
#pragma unroll
                for (int j = 0; j < QGEMV_COLS; j++) {
                    part[r][j] = 0.0f;
                }
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float wf[QGEMV_COLS][8];
#pragma unroll
                for (int j = 0; j < QGEMV_COLS; j++) {
                    fp4x8(q[j][2 * g + h], wf[j]);
                }
#pragma unroll
                for (int r = 0; r < R; r++) {
                    float xf[8];
                    x8(x, (u64)r * k + (u64)c * 32 + g * 16 + h * 8, xf);
#pragma unroll
                    for (int j = 0; j < QGEMV_COLS; j++) {
#pragma unroll
                        for (int e = 0; e < 8; e++) {
                            part[r][j] = fmaf(xf[e], wf[j][e], part[r][j]);
                        }
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < R; r++) {
#pragma unroll
                for (int j = 0; j < QGEMV_COLS; j++) {
                    acc[r][j] = fmaf(part[r][j], gs[j][g], acc[r][j]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
        for (int j = 0; j < QGEMV_COLS; j++) {
            const float sum = warp_sum(acc[r][j]);
            if (lane == 0 && col0 + j < n) {
                out[(u64)r * n + col0 + j] = sum;
            }
        }
    }
}

// One instantiation per row count, as gemv.cu does: the accumulators stay in registers.
template <typename T, bool BLOCKED>
__device__ void fp8_impl(const T* x, const u8* w, const float* scales, int per_row, float* out, int rows, int k,
                         int n) {
    switch (rows) {
        case 1: fp8_rows<T, 1, BLOCKED>(x, w, scales, per_row, out, k, n); break;
        case 2: fp8_rows<T, 2, BLOCKED>(x, w, scales, per_row, out, k, n); break;
        case 3: fp8_rows<T, 3, BLOCKED>(x, w, scales, per_row, out, k, n); break;
        case 4: fp8_rows<T, 4, BLOCKED>(x, w, scales, per_row, out, k, n); break;
        case 5: fp8_rows<T, 5, BLOCKED>(x, w, scales, per_row, out, k, n); break;
        case 6: fp8_rows<T, 6, BLOCKED>(x, w, scales, per_row, out, k, n); break;
        case 7: fp8_rows<T, 7, BLOCKED>(x, w, scales, per_row, out, k, n); break;
        case 8: fp8_rows<T, 8, BLOCKED>(x, w, scales, per_row, out, k, n); break;
        default: break;
    }
}

template <typename T>
__device__ void nvfp4_impl(const T* x, const u8* w, const u8* scales, float global, float* out, int rows, int k,
                           int n) {
    switch (rows) {
        case 1: nvfp4_rows<T, 1>(x, w, scales, global, out, k, n); break;
        case 2: nvfp4_rows<T, 2>(x, w, scales, global, out, k, n); break;
        case 3: nvfp4_rows<T, 3>(x, w, scales, global, out, k, n); break;
        case 4: nvfp4_rows<T, 4>(x, w, scales, global, out, k, n); break;
        case 5: nvfp4_rows<T, 5>(x, w, scales, global, out, k, n); break;
        case 6: nvfp4_rows<T, 6>(x, w, scales, global, out, k, n); break;
        case 7: nvfp4_rows<T, 7>(x, w, scales, global, out, k, n); break;
        case 8: nvfp4_rows<T, 8>(x, w, scales, global, out, k, n); break;
        default: break;
    }
}

// `_f32` / `_bf16` name the storage of x; the output is f32.
#define QGEMV(T, S)                                                                                              \
    extern "C" __global__ void __launch_bounds__(128)                                                            \
        gemv_fp8_block_##S(const T* x, const u8* w, const float* scale_inv, float* out, int rows, int k, int n) { \
        fp8_impl<T, true>(x, w, scale_inv, 0, out, rows, k, n);                                                  \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) gemv_fp8_scaled_##S(                                       \
        const T* x, const u8* w, const float* scales, int per_row, float* out, int rows, int k, int n) {        \
        fp8_impl<T, false>(x, w, scales, per_row, out, rows, k, n);                                              \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) gemv_nvfp4_##S(                                            \
        const T* x, const u8* w, const u8* scales, float global, float* out, int rows, int k, int n) {          \
        nvfp4_impl<T>(x, w, scales, global, out, rows, k, n);                                                    \
    }
QGEMV(float, f32)
QGEMV(bf16, bf16)
