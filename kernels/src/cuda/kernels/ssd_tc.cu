// The Mamba-2 chunked (SSD) prefill scan on tensor cores, bf16 storage, chunk 64, head_dim 64, state 64 or 128: the
// contract and the three-launch structure of ssd.cu (which stays the f32 path and the path for other shapes;
// kernels/src/cuda/ops/scan.rs chooses), with its first and last launches as MMA-shaped work:
//   1. ssd_tc_state (grid chunks × heads): dS_c[p, n] = Σ_s x_s[p] · (w_s·B_s[n]) with w_s = dt_s·exp(seg(L−1, s)),
//      a [64 × 64] · [64 × N] product; warp w takes rows p = 16w..16w+15. Like mamba_ssm, the scaled B is rounded
//      to bf16 for the product, so chunk states carry bf16 operand rounding (they are accumulated in f32).
//   2. ssd_state_scan from ssd.cu (f32, unchanged).
//   3. ssd_tc_out (grid chunks × heads): per warp, the 16 rows t = 16w..16w+15 of the chunk:
//        Y = exp(cum_t) · (C · S_cᵀ)              [16 × N] · [N × 64]
//          + M · X,  M[t, s] = (C · Bᵀ)[t, s] · exp(cum_t − cum_s) · dt_s for s ≤ t   (M kept in registers:
//            the accumulator fragments of C · Bᵀ are the A fragments of M · X, as P is in flash attention)
//          + D · x_t.
//      C · Bᵀ is computed only for the key tiles at or below the warp's diagonal. The entering state S_c is rounded to
//      bf16 for its product (as mamba_ssm does); y is bf16 anyway.
// Decays are exponentials of sums of a_r = dt_r·A ≤ 0 within one chunk; the output kernel takes differences of the
// running sum cum_t = Σ_{r ≤ t} a_r, whose rounding error is an ulp of |cum| (≈ 1e-4 relative at |cum| = 1000), far
// below bf16's resolution. Operands staged by cp.async, read by ldmatrix, multiplied by mma.sync (see mma_common.cuh).

#define SSD_Q 64
#define SSD_P 64
#define ST_THREADS 128

template <int N> struct SsdTc {
    static constexpr int STATE_SMEM = (SSD_Q * SSD_P + SSD_Q * N) * 2;
    static constexpr int OUT_SMEM = (2 * SSD_Q * N + SSD_Q * SSD_P + SSD_P * N) * 2;
};

// Rows [0, rows) of a [SSD_Q][D] bf16 tile from global rows `src + r · stride` (16-byte chunks, cp.async); rows past
// `valid` are zeros.
template <int D>
__device__ __forceinline__ void stage_rows(bf16* dst, const bf16* __restrict__ src, u64 stride, int valid) {
    for (int idx = threadIdx.x; idx < SSD_Q * (D / 8); idx += ST_THREADS) {
        const int r = idx / (D / 8), ch = idx % (D / 8);
        const bool ok = r < valid;
        cp_async16(dst + swz<D>(r, ch), src + (ok ? (u64)r * stride : 0) + ch * 8, ok ? 16 : 0);
    }
}

template <int N>
__device__ void ssd_tc_state_impl(const bf16* __restrict__ x, const float* __restrict__ dt, const float* __restrict__ A,
                                  const bf16* __restrict__ B, float* __restrict__ ws, float* __restrict__ decay,
                                  int seq, int heads, int groups) {
    extern __shared__ __align__(16) unsigned char ssd_smem[];
    bf16* xs = (bf16*)ssd_smem;     // [s][p]
    bf16* bs = xs + SSD_Q * SSD_P;  // [s][n], row s scaled by w_s
    __shared__ float adt[SSD_Q];
    __shared__ float wv[SSD_Q];
    const int c = blockIdx.x, h = blockIdx.y;
    const int t0 = c * SSD_Q;
    const int L = min(SSD_Q, seq - t0);
    const int g = h / (heads / groups);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, c4 = lane & 3;

    stage_rows<SSD_P>(xs, x + ((u64)t0 * heads + h) * SSD_P, (u64)heads * SSD_P, L);
    cp_async_commit();
    for (int s = tid; s < L; s += ST_THREADS) adt[s] = dt[(u64)(t0 + s) * heads + h] * A[h];
    __syncthreads();
    if (tid == 0) {
        // Suffix sums in the CPU twin's order: w_s uses Σ_{r = L−1 .. s+1} a_r, the decay the whole sum.
        float seg = 0.0f;
        for (int s = L - 1; s >= 0; --s) {
            wv[s] = dt[(u64)(t0 + s) * heads + h] * expf(seg);
            seg += adt[s];
        }
        decay[(u64)c * heads + h] = expf(seg);
    }
    __syncthreads();
    for (int idx = tid; idx < SSD_Q * (N / 8); idx += ST_THREADS) {
        const int s = idx / (N / 8), ch = idx % (N / 8);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (s < L) {
            const uint4 raw = *(const uint4*)(B + ((u64)(t0 + s) * groups + g) * N + ch * 8);
            const bf16* r = (const bf16*)&raw;
            const float w = wv[s];
            v = make_uint4(pack_bf16(to_f32(r[0]) * w, to_f32(r[1]) * w), pack_bf16(to_f32(r[2]) * w, to_f32(r[3]) * w),
                           pack_bf16(to_f32(r[4]) * w, to_f32(r[5]) * w), pack_bf16(to_f32(r[6]) * w, to_f32(r[7]) * w));
        }
        *(uint4*)(bs + swz<N>(s, ch)) = v;
    }
    cp_async_wait<0>();
    __syncthreads();

    float acc[N / 8][4];
#pragma unroll
    for (int j = 0; j < N / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < SSD_Q / 16; ++kk) {
        // A = Xᵀ (rows p, k = s) from the [s][p] tile: transposed ldmatrix.
        u32 a[4];
        ldsm_x4_t(a, xs + swz<SSD_P>(kk * 16 + (lane & 7) + ((lane >> 4) << 3), warp * 2 + ((lane >> 3) & 1)));
#pragma unroll
        for (int j = 0; j < N / 8; j += 2) {
            u32 b[4];
            ldsm_x4_t(b, bs + swz<N>(kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7), j + (lane >> 4)));
            mma_bf16(acc[j], a, b[0], b[1]);
            mma_bf16(acc[j + 1], a, b[2], b[3]);
        }
    }
    float* out = ws + ((u64)c * heads + h) * SSD_P * N;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int p = warp * 16 + gq + 8 * hh;
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
            *(float2*)(out + (u64)p * N + j * 8 + 2 * c4) = make_float2(acc[j][2 * hh], acc[j][2 * hh + 1]);
        }
    }
}

template <int N>
__device__ void ssd_tc_out_impl(const bf16* __restrict__ x, const float* __restrict__ dt, const float* __restrict__ A,
                                const bf16* __restrict__ B, const bf16* __restrict__ C, const float* __restrict__ D,
                                const float* __restrict__ ws, bf16* __restrict__ y, int seq, int heads, int groups) {
    extern __shared__ __align__(16) unsigned char ssd_smem[];
    bf16* cs = (bf16*)ssd_smem;  // C [t][n]
    bf16* bs = cs + SSD_Q * N;   // B [s][n]
    bf16* xs = bs + SSD_Q * N;   // X [s][p]
    bf16* ss = xs + SSD_Q * SSD_P;  // S_c [p][n], bf16
    __shared__ float cum[SSD_Q];
    __shared__ float dts[SSD_Q];
    const int c = blockIdx.x, h = blockIdx.y;
    const int t0 = c * SSD_Q;
    const int L = min(SSD_Q, seq - t0);
    const int g = h / (heads / groups);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, c4 = lane & 3;

    stage_rows<N>(cs, C + ((u64)t0 * groups + g) * N, (u64)groups * N, L);
    stage_rows<N>(bs, B + ((u64)t0 * groups + g) * N, (u64)groups * N, L);
    stage_rows<SSD_P>(xs, x + ((u64)t0 * heads + h) * SSD_P, (u64)heads * SSD_P, L);
    cp_async_commit();
    const float* S = ws + ((u64)c * heads + h) * SSD_P * N;
    for (int idx = tid; idx < SSD_P * (N / 8); idx += ST_THREADS) {
        const int p = idx / (N / 8), ch = idx % (N / 8);
        const float4 lo = *(const float4*)(S + (u64)p * N + ch * 8);
        const float4 hi = *(const float4*)(S + (u64)p * N + ch * 8 + 4);
        *(uint4*)(ss + swz<N>(p, ch)) =
            make_uint4(pack_bf16(lo.x, lo.y), pack_bf16(lo.z, lo.w), pack_bf16(hi.x, hi.y), pack_bf16(hi.z, hi.w));
    }
    for (int s = tid; s < SSD_Q; s += ST_THREADS) dts[s] = s < L ? dt[(u64)(t0 + s) * heads + h] : 0.0f;
    __syncthreads();
    if (tid == 0) {
        const float a_h = A[h];
        float run = 0.0f;
        for (int s = 0; s < SSD_Q; ++s) {
            if (s < L) run += dts[s] * a_h;
            cum[s] = run;
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    const int r0 = warp * 16;
    float yacc[SSD_P / 8][4];
    float sacc[SSD_Q / 8][4];
#pragma unroll
    for (int j = 0; j < SSD_P / 8; ++j) yacc[j][0] = yacc[j][1] = yacc[j][2] = yacc[j][3] = 0.0f;
#pragma unroll
    for (int j = 0; j < SSD_Q / 8; ++j) sacc[j][0] = sacc[j][1] = sacc[j][2] = sacc[j][3] = 0.0f;
    // C · S_cᵀ and C · Bᵀ share the A fragments of C (k = n).
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
        u32 a[4];
        ldsm_x4(a, cs + swz<N>(r0 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
        for (int j = 0; j < SSD_P / 8; j += 2) {
            u32 b[4];
            ldsm_x4(b, ss + swz<N>(j * 8 + ((lane >> 4) << 3) + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
            mma_bf16(yacc[j], a, b[0], b[1]);
            mma_bf16(yacc[j + 1], a, b[2], b[3]);
        }
#pragma unroll
        for (int j = 0; j < SSD_Q / 8; j += 2) {
            if (j <= 2 * warp) {  // key tiles j, j + 1 hold s < 8j + 16 ≤ r0 + 16: at or below the diagonal
                u32 b[4];
                ldsm_x4(b, bs + swz<N>(j * 8 + ((lane >> 4) << 3) + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
                mma_bf16(sacc[j], a, b[0], b[1]);
                mma_bf16(sacc[j + 1], a, b[2], b[3]);
            }
        }
    }
    float ct[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        ct[hh] = cum[r0 + gq + 8 * hh];
        const float f = expf(ct[hh]);
#pragma unroll
        for (int j = 0; j < SSD_P / 8; ++j) {
            yacc[j][2 * hh] *= f;
            yacc[j][2 * hh + 1] *= f;
        }
    }
#pragma unroll
    for (int j = 0; j < SSD_Q / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int t = r0 + gq + 8 * (e >> 1);
            const int s = j * 8 + 2 * c4 + (e & 1);
            sacc[j][e] = (s <= t && s < L) ? sacc[j][e] * expf(ct[e >> 1] - cum[s]) * dts[s] : 0.0f;
        }
    }
    // Y += M · X over the key steps at or below the diagonal.
#pragma unroll
    for (int kk = 0; kk < SSD_Q / 16; ++kk) {
        if (kk <= warp) {
            u32 a[4];
            a[0] = pack_bf16(sacc[2 * kk][0], sacc[2 * kk][1]);
            a[1] = pack_bf16(sacc[2 * kk][2], sacc[2 * kk][3]);
            a[2] = pack_bf16(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1]);
            a[3] = pack_bf16(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3]);
#pragma unroll
            for (int j = 0; j < SSD_P / 8; j += 2) {
                u32 b[4];
                ldsm_x4_t(b, xs + swz<SSD_P>(kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7), j + (lane >> 4)));
                mma_bf16(yacc[j], a, b[0], b[1]);
                mma_bf16(yacc[j + 1], a, b[2], b[3]);
            }
        }
    }
    const float dsk = D[h];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int t = r0 + gq + 8 * hh;
        if (t >= L) continue;
        bf16* yr = y + ((u64)(t0 + t) * heads + h) * SSD_P;
#pragma unroll
        for (int j = 0; j < SSD_P / 8; ++j) {
            const int p = j * 8 + 2 * c4;
            const bf16* xr = xs + swz<SSD_P>(t, j) + 2 * c4;
            *(u32*)(yr + p) = pack_bf16(yacc[j][2 * hh] + dsk * to_f32(xr[0]), yacc[j][2 * hh + 1] + dsk * to_f32(xr[1]));
        }
    }
}

// The entry points are named in full at each instantiation, so the module's kernel list can be checked against the
// source text (kernels/src/cuda/nvrtc.rs, module_names_cover_both_types).
#define SSD_TC(STATE, OUT, N)                                                                                       \
    extern "C" __global__ void __launch_bounds__(ST_THREADS)                                                        \
        STATE(const bf16* x, const float* dt, const float* A, const bf16* B, float* ws, float* decay, int seq,       \
              int heads, int groups) {                                                                              \
        ssd_tc_state_impl<N>(x, dt, A, B, ws, decay, seq, heads, groups);                                           \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(ST_THREADS)                                                        \
        OUT(const bf16* x, const float* dt, const float* A, const bf16* B, const bf16* C, const float* D,            \
            const float* ws, bf16* y, int seq, int heads, int groups) {                                             \
        ssd_tc_out_impl<N>(x, dt, A, B, C, D, ws, y, seq, heads, groups);                                           \
    }
SSD_TC(ssd_tc_state_n64, ssd_tc_out_n64, 64)
SSD_TC(ssd_tc_state_n128, ssd_tc_out_n128, 128)
