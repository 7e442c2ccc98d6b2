// The grouped expert GEMM on tensor cores (bf16 storage): the contract of moe_gemm in moe.cu, which stays the f32 path
// and the path for in_dim not a multiple of 8; kernels/src/cuda/ops/moe.rs chooses. For every expert e and row r of its
// run offsets[e] .. offsets[e + 1]: out[r, n] = Σ_k a[src(r), k] · w[e, n, k], src(r) = gather[r] when gather is given
// (a token of a), else r.
//
// The grid enumerates real work only: blockIdx.y is a row tile among all experts' tiles, of which there are
// Σ_e ceil(count_e / BM) ≤ rows / BM + experts (the host sizes the grid by that bound and blocks past the true total
// exit at once); each block finds its expert with a scan of the offsets in shared memory, so no histogram goes back to
// the host and the launch can sit in a CUDA graph. blockIdx.x is a 64-wide tile of output columns.
//
// Two tilings, 4 warps each. M16 (decode: a few rows per expert, bandwidth-bound): one m16 tile of rows, warp w takes
// output columns 16w..16w+15, so each expert's weights are read once per 16 of its rows. M64 (prefill: many rows per
// expert): warp w takes rows 16w..16w+15 against all 64 columns. Operands are staged by cp.async in 64-wide k slices
// (four / three stages in flight), read with ldmatrix, multiplied with mma.sync m16n8k16, accumulated in f32.
// Needs K % 8 == 0 (16-byte rows); any N.

#define MT_THREADS 128
#define MT_BN 64
#define MT_BK 64

template <int BM> struct MtShape {
    static constexpr int STAGES = BM == 16 ? 4 : 3;
    static constexpr int STAGE_ELEMS = (BM + MT_BN) * MT_BK;
    static constexpr int SMEM = STAGES * STAGE_ELEMS * 2;
    static constexpr int A_CHUNKS = BM * 8 / MT_THREADS;     // 16-byte chunks of the A slice per thread
    static constexpr int W_CHUNKS = MT_BN * 8 / MT_THREADS;  // ... of the weight slice
    static constexpr int NJ = BM == 16 ? 2 : 8;              // n8 tiles per warp
};

// The expert and first row (within the expert's run) of row tile `tile`, into *e and *m0; false when the tile lies
// past every expert's rows. Thread t sums the tiles of a contiguous range of experts; a block-wide exclusive scan
// tells the one thread whose range holds `tile` where to look.
template <int BM>
__device__ bool moe_find_tile(const int* __restrict__ offsets, int experts, int tile, int* e, int* m0) {
    __shared__ int found[2];
    __shared__ int warp_total[MT_THREADS / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int per = (experts + MT_THREADS - 1) / MT_THREADS;
    const int e0 = min(tid * per, experts), e1 = min(e0 + per, experts);
    int mine = 0;
    for (int x = e0; x < e1; ++x) mine += (max(offsets[x + 1] - offsets[x], 0) + BM - 1) / BM;
    int incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) warp_total[warp] = incl;
    if (tid == 0) found[0] = -1;
    __syncthreads();
    int t = incl - mine;
    for (int w = 0; w < warp; ++w) t += warp_total[w];
    if (tile >= t && tile < t + mine) {
        for (int x = e0; x < e1; ++x) {
            const int n = (max(offsets[x + 1] - offsets[x], 0) + BM - 1) / BM;
            if (tile < t + n) {
                found[0] = x;
                found[1] = (tile - t) * BM;
                break;
            }
            t += n;
        }
    }
    __syncthreads();
    *e = found[0];
    *m0 = found[1];
    return found[0] >= 0;
}

template <int BM>
__device__ void moe_tc_impl(const bf16* __restrict__ a, const int* __restrict__ gather, const bf16* __restrict__ w,
                            const int* __restrict__ offsets, bf16* __restrict__ out, int K, int N, int experts) {
    typedef MtShape<BM> S;
    extern __shared__ __align__(16) unsigned char mt_smem[];
    int e, m0;
    if (!moe_find_tile<BM>(offsets, experts, blockIdx.y, &e, &m0)) return;
    const int start = offsets[e];
    const int count = offsets[e + 1] - start;
    const int n0 = blockIdx.x * MT_BN;
    const bf16* we = w + (u64)e * N * K;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c4 = lane & 3;

    // This thread's 16-byte chunks: chunk column c of rows (tid / 8) + 16u, for A and for the weights. Their sources
    // are fixed over k; rows past the expert's run or past N load zeros.
    const int c = tid & 7;
    const bf16* arow[S::A_CHUNKS];
    bool aok[S::A_CHUNKS];
#pragma unroll
    for (int u = 0; u < S::A_CHUNKS; ++u) {
        const int r = m0 + (tid >> 3) + 16 * u;
        aok[u] = r < count;
        const int src = aok[u] ? (gather ? gather[start + r] : start + r) : 0;
        arow[u] = a + (u64)src * K;
    }
    const bf16* wrow[S::W_CHUNKS];
    bool wok[S::W_CHUNKS];
#pragma unroll
    for (int u = 0; u < S::W_CHUNKS; ++u) {
        const int n = n0 + (tid >> 3) + 16 * u;
        wok[u] = n < N;
        wrow[u] = we + (u64)(wok[u] ? n : 0) * K;
    }
    auto load = [&](int kt, int stage) {
        bf16* as = (bf16*)mt_smem + stage * S::STAGE_ELEMS;
        bf16* ws = as + BM * MT_BK;
        const int k = kt * MT_BK + c * 8;
        const bool kok = k < K;
        const int ks = kok ? k : 0;
#pragma unroll
        for (int u = 0; u < S::A_CHUNKS; ++u) {
            cp_async16(as + swz<MT_BK>((tid >> 3) + 16 * u, c), arow[u] + ks, (aok[u] && kok) ? 16 : 0);
        }
#pragma unroll
        for (int u = 0; u < S::W_CHUNKS; ++u) {
            cp_async16(ws + swz<MT_BK>((tid >> 3) + 16 * u, c), wrow[u] + ks, (wok[u] && kok) ? 16 : 0);
        }
    };

    const int rbase = BM == 16 ? 0 : warp * 16;  // this warp's rows in the tile
    const int cbase = BM == 16 ? warp * 16 : 0;  // ... and columns
    float acc[S::NJ][4];
#pragma unroll
    for (int j = 0; j < S::NJ; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

    const int k_tiles = (K + MT_BK - 1) / MT_BK;
#pragma unroll
    for (int st = 0; st < S::STAGES - 1; ++st) {
        if (st < k_tiles) load(st, st);
        cp_async_commit();
    }
    for (int i = 0; i < k_tiles; ++i) {
        const int next = i + S::STAGES - 1;
        if (next < k_tiles) load(next, next % S::STAGES);
        cp_async_commit();  // possibly empty: keeps "all but the newest STAGES − 1 groups" meaning slice i
        cp_async_wait<S::STAGES - 1>();
        __syncthreads();
        const bf16* as = (const bf16*)mt_smem + (i % S::STAGES) * S::STAGE_ELEMS;
        const bf16* ws = as + BM * MT_BK;
#pragma unroll
        for (int kk = 0; kk < MT_BK / 16; ++kk) {
            u32 af[4];
            ldsm_x4(af, as + swz<MT_BK>(rbase + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
            for (int j = 0; j < S::NJ; j += 2) {
                u32 bw[4];
                ldsm_x4(bw, ws + swz<MT_BK>(cbase + j * 8 + ((lane >> 4) << 3) + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
                mma_bf16(acc[j], af, bw[0], bw[1]);
                mma_bf16(acc[j + 1], af, bw[2], bw[3]);
            }
        }
        __syncthreads();  // every warp is done with this stage before it is refilled
    }
    cp_async_wait<0>();

    const bool even = (N & 1) == 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = m0 + rbase + g + 8 * h;
        if (r >= count) continue;
        bf16* orow = out + (u64)(start + r) * N;
#pragma unroll
        for (int j = 0; j < S::NJ; ++j) {
            const int col = n0 + cbase + j * 8 + 2 * c4;
            if (even && col + 1 < N) {
                *(u32*)(orow + col) = pack_bf16(acc[j][2 * h], acc[j][2 * h + 1]);
            } else {
                if (col < N) orow[col] = from_f32<bf16>(acc[j][2 * h]);
                if (col + 1 < N) orow[col + 1] = from_f32<bf16>(acc[j][2 * h + 1]);
            }
        }
    }
}

#define MOE_TC(NAME, BM)                                                                                            \
    extern "C" __global__ void __launch_bounds__(MT_THREADS)                                                        \
        NAME(const bf16* a, const int* gather, const bf16* w, const int* offsets, bf16* out, int K, int N,          \
             int experts) {                                                                                         \
        moe_tc_impl<BM>(a, gather, w, offsets, out, K, N, experts);                                                 \
    }
MOE_TC(moe_gemm_tc_m16, 16)
MOE_TC(moe_gemm_tc_m64, 64)
