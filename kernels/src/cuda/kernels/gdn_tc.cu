// The chunked gated delta rule on tensor cores, bf16 storage, chunk 64, k_dim = v_dim = 128 (every Qwen3-Next /
// Qwen3.5 layer): the WY / UT form of gdn_chunk.cu (which stays the f32 path and the path for other shapes;
// kernels/src/cuda/ops/scan.rs chooses), with its products as MMA-shaped work. Two launches:
//   1. gdn_tc_prep (grid chunks × v_heads): K Kᵀ and Q Kᵀ [64 × 64] by mma.sync, masked and decayed with
//      Γ[i, j] = exp(G_i − G_j) (G the running sum of g inside the chunk); T = (I + A)⁻¹ for the strictly lower
//      A = diag(β) K Kᵀ ⊙ Γ by forward substitution, one column per thread (columns are independent, so no block-wide
//      barrier per row); then U = T · diag(β) V and W = T · diag(β γ) K [64 × 128] by mma.sync. The scores
//      Q Kᵀ ⊙ tril(Γ) go to the workspace as a full [64 × 64] tile per chunk and head (zeros outside).
//   2. gdn_tc_scan (grid v_dim / 16 × v_heads): a block owns 16 rows of the state S [v_dim, k_dim] in MMA accumulators
//      (f32) and walks the chunks in order: V' = U − W Sᵀ, O = diag(γ) Q Sᵀ + scores · V', S ← γ_last S +
//      V'ᵀ diag(exp(G_last − G_i)) K, each a [64 × 128]·[128 × 16] or [16 × 64]·[64 × 128] product.
// As in fla's kernels, the MMA operands are bf16: T, the scaled K / V, W, the scores, V' and S are rounded to bf16 for
// their products (accumulation and the carried state stay f32). Decays use differences of running sums within a
// chunk, whose rounding is an ulp of |G| — far below bf16's resolution.

#define GT_THREADS 128
#define GT_C 64
#define GT_D 128
#define GT_BV 16

struct GtPrep {
    // Kb, Qb, Vb [64][128] bf16; Af, Tf [64][64] f32; Tb [64][64] bf16
    static constexpr int SMEM = 3 * GT_C * GT_D * 2 + 2 * GT_C * GT_C * 4 + GT_C * GT_C * 2;
};
struct GtScan {
    // Wb, Qb, Kx [64][128] bf16; Sc [64][64] bf16; Vp [64][16] bf16; Sb [16][128] bf16
    static constexpr int SMEM = 3 * GT_C * GT_D * 2 + GT_C * GT_C * 2 + GT_C * GT_BV * 2 + GT_BV * GT_D * 2;
};

// Rows [0, 64) of a [64][128] bf16 tile from global rows src + r · stride (cp.async); rows past `valid` are zeros.
__device__ __forceinline__ void gt_stage(bf16* dst, const bf16* __restrict__ src, u64 stride, int valid) {
    for (int idx = threadIdx.x; idx < GT_C * (GT_D / 8); idx += GT_THREADS) {
        const int r = idx / (GT_D / 8), ch = idx % (GT_D / 8);
        const bool ok = r < valid;
        cp_async16(dst + swz<GT_D>(r, ch), src + (ok ? (u64)r * stride : 0) + ch * 8, ok ? 16 : 0);
    }
}

// Rows of a [64][D] bf16 tile from f32 (global or shared) rows src + r · stride, each row r scaled by scale(r);
// rows past `valid` are zeros.
template <int D, typename F>
__device__ __forceinline__ void gt_stage_f32(bf16* dst, const float* src, u64 stride, int valid, F scale) {
    for (int idx = threadIdx.x; idx < GT_C * (D / 8); idx += GT_THREADS) {
        const int r = idx / (D / 8), ch = idx % (D / 8);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < valid) {
            const float4 lo = *(const float4*)(src + r * stride + ch * 8);
            const float4 hi = *(const float4*)(src + r * stride + ch * 8 + 4);
            const float s = scale(r);
            v = make_uint4(pack_bf16(lo.x * s, lo.y * s), pack_bf16(lo.z * s, lo.w * s), pack_bf16(hi.x * s, hi.y * s),
                           pack_bf16(hi.z * s, hi.w * s));
        }
        *(uint4*)(dst + swz<D>(r, ch)) = v;
    }
}

// Rows of a [64][128] bf16 tile from bf16 global rows, each row r scaled by scale(r) (rows past `valid`: zeros).
template <typename F>
__device__ __forceinline__ void gt_stage_scaled(bf16* dst, const bf16* __restrict__ src, u64 stride, int valid,
                                                F scale) {
    for (int idx = threadIdx.x; idx < GT_C * (GT_D / 8); idx += GT_THREADS) {
        const int r = idx / (GT_D / 8), ch = idx % (GT_D / 8);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < valid) {
            const uint4 raw = *(const uint4*)(src + (u64)r * stride + ch * 8);
            const bf16* e = (const bf16*)&raw;
            const float s = scale(r);
            v = make_uint4(pack_bf16(to_f32(e[0]) * s, to_f32(e[1]) * s), pack_bf16(to_f32(e[2]) * s, to_f32(e[3]) * s),
                           pack_bf16(to_f32(e[4]) * s, to_f32(e[5]) * s), pack_bf16(to_f32(e[6]) * s, to_f32(e[7]) * s));
        }
        *(uint4*)(dst + swz<GT_D>(r, ch)) = v;
    }
}

extern "C" __global__ void __launch_bounds__(GT_THREADS)
    gdn_tc_prep(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ u_ws,
                float* __restrict__ w_ws, float* __restrict__ s_ws, int seq, int k_heads, int v_heads) {
    extern __shared__ __align__(16) unsigned char gt_smem[];
    bf16* kb = (bf16*)gt_smem;         // K, later β γ K
    bf16* qb = kb + GT_C * GT_D;       // Q
    bf16* vb = qb + GT_C * GT_D;       // β V
    float* af = (float*)(vb + GT_C * GT_D);  // A (strictly lower)
    float* tf = af + GT_C * GT_C;      // T, f32, [row][column]
    bf16* tb = (bf16*)(tf + GT_C * GT_C);    // T, bf16 operand
    __shared__ float G[GT_C];
    __shared__ float bs[GT_C];
    const int c = blockIdx.x, h = blockIdx.y;
    const int kh = h / (v_heads / k_heads);
    const int t0 = c * GT_C;
    const int L = min(GT_C, seq - t0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, c4 = lane & 3;

    gt_stage(kb, k + ((u64)t0 * k_heads + kh) * GT_D, (u64)k_heads * GT_D, L);
    gt_stage(qb, q + ((u64)t0 * k_heads + kh) * GT_D, (u64)k_heads * GT_D, L);
    cp_async_commit();
    for (int i = tid; i < GT_C; i += GT_THREADS) {
        G[i] = i < L ? g[(u64)(t0 + i) * v_heads + h] : 0.0f;
        bs[i] = i < L ? beta[(u64)(t0 + i) * v_heads + h] : 0.0f;
    }
    __syncthreads();
    if (tid == 0) {
        float run = 0.0f;
        for (int i = 0; i < GT_C; ++i) {
            run += G[i];
            G[i] = run;
        }
    }
    gt_stage_scaled(vb, v + ((u64)t0 * v_heads + h) * GT_D, (u64)v_heads * GT_D, L, [&](int r) { return bs[r]; });
    cp_async_wait<0>();
    __syncthreads();

    // K Kᵀ and Q Kᵀ: warp w rows i = 16w..16w+15 against all 64 j.
    const int r0 = warp * 16;
    float kk[8][4], qk[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) kk[j][e] = qk[j][e] = 0.0f;
    }
#pragma unroll
    for (int ks = 0; ks < GT_D / 16; ++ks) {
        u32 ak[4], aq[4];
        ldsm_x4(ak, kb + swz<GT_D>(r0 + (lane & 15), ks * 2 + (lane >> 4)));
        ldsm_x4(aq, qb + swz<GT_D>(r0 + (lane & 15), ks * 2 + (lane >> 4)));
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            if (j <= 2 * warp) {
                u32 b[4];
                ldsm_x4(b, kb + swz<GT_D>(j * 8 + ((lane >> 4) << 3) + (lane & 7), ks * 2 + ((lane >> 3) & 1)));
                mma_bf16(kk[j], ak, b[0], b[1]);
                mma_bf16(kk[j + 1], ak, b[2], b[3]);
                mma_bf16(qk[j], aq, b[0], b[1]);
                mma_bf16(qk[j + 1], aq, b[2], b[3]);
            }
        }
    }
    float* scores = s_ws + ((u64)c * v_heads + h) * GT_C * GT_C;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int i = r0 + gq + 8 * hh;
            float sv[2], av[2];
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const int jj = j * 8 + 2 * c4 + x;
                const bool ok = i < L && jj <= i;
                const float decay = ok ? expf(G[i] - G[jj]) : 0.0f;
                sv[x] = ok ? qk[j][2 * hh + x] * decay : 0.0f;
                av[x] = (ok && jj < i) ? kk[j][2 * hh + x] * bs[i] * decay : 0.0f;
            }
            *(float2*)(scores + i * GT_C + j * 8 + 2 * c4) = make_float2(sv[0], sv[1]);
            *(float2*)(af + i * GT_C + j * 8 + 2 * c4) = make_float2(av[0], av[1]);
        }
    }
    __syncthreads();
    if (tid < GT_C) {
        // Column m of T = (I + A)⁻¹: T[i, m] = δ_im − Σ_{m ≤ j < i} A[i, j] T[j, m], rows in order. Each thread reads
        // only its own column of T (consecutive threads, consecutive banks) and broadcasts of A.
        const int m = tid;
        for (int i = 0; i < GT_C; ++i) {
            float val = i == m ? 1.0f : 0.0f;
            if (i > m) {
                float s = 0.0f;
                for (int j = m; j < i; ++j) s += af[i * GT_C + j] * tf[j * GT_C + m];
                val = -s;
            }
            tf[i * GT_C + m] = val;
        }
    } else {
        // Meanwhile the other warps turn K into β γ K in place (K Kᵀ and Q Kᵀ are done with it).
        for (int idx = tid - GT_C; idx < GT_C * (GT_D / 8); idx += GT_THREADS - GT_C) {
            const int r = idx / (GT_D / 8), ch = idx % (GT_D / 8);
            bf16* p = kb + swz<GT_D>(r, ch);
            const float s = bs[r] * expf(G[r]);
            u32* w = (u32*)p;
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                const u32 pr = w[x];
                w[x] = pack_bf16(to_f32((bf16)(pr & 0xffffu)) * s, to_f32((bf16)(pr >> 16)) * s);
            }
        }
    }
    __syncthreads();
    for (int idx = tid; idx < GT_C * (GT_C / 8); idx += GT_THREADS) {
        const int r = idx / (GT_C / 8), ch = idx % (GT_C / 8);
        const float* src = tf + r * GT_C + ch * 8;
        *(uint4*)(tb + swz<GT_C>(r, ch)) = make_uint4(pack_bf16(src[0], src[1]), pack_bf16(src[2], src[3]),
                                                     pack_bf16(src[4], src[5]), pack_bf16(src[6], src[7]));
    }
    __syncthreads();

    // U = T · (β V) and W = T · (β γ K): warp w rows 16w.., all 128 columns, k = j over the chunk.
#pragma unroll 1
    for (int which = 0; which < 2; ++which) {
        const bf16* rhs = which == 0 ? vb : kb;
        float* dst = which == 0 ? u_ws : w_ws;
        float acc[GT_D / 8][4];
#pragma unroll
        for (int j = 0; j < GT_D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < GT_C / 16; ++ks) {
            if (ks <= warp) {  // T is lower triangular: columns past the warp's rows are zero
                u32 a[4];
                ldsm_x4(a, tb + swz<GT_C>(r0 + (lane & 15), ks * 2 + (lane >> 4)));
#pragma unroll
                for (int j = 0; j < GT_D / 8; j += 2) {
                    u32 b[4];
                    ldsm_x4_t(b, rhs + swz<GT_D>(ks * 16 + (((lane >> 3) & 1) << 3) + (lane & 7), j + (lane >> 4)));
                    mma_bf16(acc[j], a, b[0], b[1]);
                    mma_bf16(acc[j + 1], a, b[2], b[3]);
                }
            }
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int i = r0 + gq + 8 * hh;
            if (i >= L) continue;
            float* row = dst + ((u64)(t0 + i) * v_heads + h) * GT_D;
#pragma unroll
            for (int j = 0; j < GT_D / 8; ++j) {
                *(float2*)(row + j * 8 + 2 * c4) = make_float2(acc[j][2 * hh], acc[j][2 * hh + 1]);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(GT_THREADS)
    gdn_tc_scan(const bf16* __restrict__ q, const bf16* __restrict__ k, const float* __restrict__ g,
                const float* __restrict__ u_ws, const float* __restrict__ w_ws, const float* __restrict__ s_ws,
                float* __restrict__ state, bf16* __restrict__ out, int seq, int k_heads, int v_heads) {
    extern __shared__ __align__(16) unsigned char gt_smem[];
    bf16* wb = (bf16*)gt_smem;         // W
    bf16* qb = wb + GT_C * GT_D;       // Q
    bf16* kx = qb + GT_C * GT_D;       // exp(G_last − G_i) K_i
    bf16* sc = kx + GT_C * GT_D;       // scores [64][64]
    bf16* vp = sc + GT_C * GT_C;       // V' [64][16]
    bf16* sb = vp + GT_C * GT_BV;      // S rows [16][128], bf16 operand
    __shared__ float fx[GT_C];
    __shared__ float ex[GT_C];
    __shared__ float last;
    const int v0 = blockIdx.x * GT_BV, h = blockIdx.y;
    const int kh = h / (v_heads / k_heads);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, c4 = lane & 3;
    const int r0 = warp * 16;   // this warp's chunk rows in V' and O
    const int d0 = warp * 32;   // this warp's state columns

    // The state block: rows v0 + (g + 8·(e / 2)), columns d0 + 8j + 2·c4 + e % 2 of each accumulator tile.
    float* srows = state + ((u64)h * GT_D + v0) * GT_D;
    float s[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float2 v = *(const float2*)(srows + (gq + 8 * hh) * GT_D + d0 + j * 8 + 2 * c4);
            s[j][2 * hh] = v.x;
            s[j][2 * hh + 1] = v.y;
        }
    }
    auto write_sb = [&]() {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int col = d0 + j * 8 + 2 * c4;
                *(u32*)(sb + swz<GT_D>(gq + 8 * hh, col >> 3) + (col & 7)) = pack_bf16(s[j][2 * hh], s[j][2 * hh + 1]);
            }
        }
    };
    write_sb();

    const int chunks = (seq + GT_C - 1) / GT_C;
    for (int c = 0; c < chunks; ++c) {
        const int t0 = c * GT_C;
        const int L = min(GT_C, seq - t0);
        gt_stage(qb, q + ((u64)t0 * k_heads + kh) * GT_D, (u64)k_heads * GT_D, L);
        cp_async_commit();
        if (tid == 0) {
            float run = 0.0f;
            for (int i = 0; i < L; ++i) {
                run += g[(u64)(t0 + i) * v_heads + h];
                fx[i] = run;
            }
            last = run;
            for (int i = 0; i < GT_C; ++i) {
                ex[i] = i < L ? expf(run - fx[i]) : 0.0f;
                fx[i] = i < L ? expf(fx[i]) : 0.0f;
            }
        }
        gt_stage_f32<GT_D>(wb, w_ws + ((u64)t0 * v_heads + h) * GT_D, (u64)v_heads * GT_D, L, [](int) { return 1.0f; });
        gt_stage_f32<GT_C>(sc, s_ws + ((u64)c * v_heads + h) * GT_C * GT_C, GT_C, GT_C, [](int) { return 1.0f; });
        __syncthreads();  // ex ready; the previous chunk is done with kx
        gt_stage_scaled(kx, k + ((u64)t0 * k_heads + kh) * GT_D, (u64)k_heads * GT_D, L, [&](int r) { return ex[r]; });
        cp_async_wait<0>();
        __syncthreads();

        // V' = U − W Sᵀ and Q Sᵀ for this warp's 16 rows (N = the block's 16 state rows).
        float vw[2][4], o[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) vw[j][e] = o[j][e] = 0.0f;
        }
#pragma unroll
        for (int ks = 0; ks < GT_D / 16; ++ks) {
            u32 aw[4], aq[4], b[4];
            ldsm_x4(aw, wb + swz<GT_D>(r0 + (lane & 15), ks * 2 + (lane >> 4)));
            ldsm_x4(aq, qb + swz<GT_D>(r0 + (lane & 15), ks * 2 + (lane >> 4)));
            ldsm_x4(b, sb + swz<GT_D>(((lane >> 4) << 3) + (lane & 7), ks * 2 + ((lane >> 3) & 1)));
            mma_bf16(vw[0], aw, b[0], b[1]);
            mma_bf16(vw[1], aw, b[2], b[3]);
            mma_bf16(o[0], aq, b[0], b[1]);
            mma_bf16(o[1], aq, b[2], b[3]);
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int i = r0 + gq + 8 * hh;
            const float f = fx[i];
            const float* urow = u_ws + ((u64)(t0 + min(i, L - 1)) * v_heads + h) * GT_D + v0;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int col = j * 8 + 2 * c4;
                float2 u = make_float2(0.0f, 0.0f);
                if (i < L) u = *(const float2*)(urow + col);
                *(u32*)(vp + swz<GT_BV>(i, j) + 2 * c4) = pack_bf16(u.x - vw[j][2 * hh], u.y - vw[j][2 * hh + 1]);
                o[j][2 * hh] *= f;
                o[j][2 * hh + 1] *= f;
            }
        }
        __syncthreads();

        // O += scores · V' (keys at or below the diagonal), then out.
#pragma unroll
        for (int ks = 0; ks < GT_C / 16; ++ks) {
            if (ks <= warp) {
                u32 a[4], b[4];
                ldsm_x4(a, sc + swz<GT_C>(r0 + (lane & 15), ks * 2 + (lane >> 4)));
                ldsm_x4_t(b, vp + swz<GT_BV>(ks * 16 + (((lane >> 3) & 1) << 3) + (lane & 7), lane >> 4));
                mma_bf16(o[0], a, b[0], b[1]);
                mma_bf16(o[1], a, b[2], b[3]);
            }
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int i = r0 + gq + 8 * hh;
            if (i >= L) continue;
            bf16* orow = out + ((u64)(t0 + i) * v_heads + h) * GT_D + v0;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                *(u32*)(orow + j * 8 + 2 * c4) = pack_bf16(o[j][2 * hh], o[j][2 * hh + 1]);
            }
        }

        // S ← exp(G_last) S + V'ᵀ · (exp(G_last − G_i) K_i): M = the 16 state rows, this warp's 32 columns.
        const float decay = expf(last);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] *= decay;
        }
#pragma unroll
        for (int ks = 0; ks < GT_C / 16; ++ks) {
            u32 a[4];
            ldsm_x4_t(a, vp + swz<GT_BV>(ks * 16 + (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1));
#pragma unroll
            for (int j = 0; j < 4; j += 2) {
                u32 b[4];
                ldsm_x4_t(b, kx + swz<GT_D>(ks * 16 + (((lane >> 3) & 1) << 3) + (lane & 7), (d0 >> 3) + j + (lane >> 4)));
                mma_bf16(s[j], a, b[0], b[1]);
                mma_bf16(s[j + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();  // every warp is done reading sb, vp and the staged tiles
        write_sb();
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            *(float2*)(srows + (gq + 8 * hh) * GT_D + d0 + j * 8 + 2 * c4) = make_float2(s[j][2 * hh], s[j][2 * hh + 1]);
        }
    }
}
