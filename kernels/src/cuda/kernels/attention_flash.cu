// Causal attention over the paged KV cache on tensor cores (bf16 storage, head dims 64 / 128 / 256): one kernel body
// in two tilings, split-KV partials and the kernel that combines them. Same contract as attn_paged in attention.cu
// (kernels/src/cpu/attention.rs::causal_attention is the reference); kernels/src/cuda/ops/attention.rs chooses.
//
// Rows: the (query, head-in-group) items of one KV head, item = query · group + j, so every query head of a GQA group
// is computed from the same K/V loads (K/V are never repeated). A block takes R consecutive items of one sequence and
// KV head, and one contiguous range of keys (a split: the block's causal key range cut into `splits` pieces of whole
// tiles). Per warp: S = Q·Kᵀ and O += P·V with mma.sync m16n8k16 (bf16 in, f32 accumulate), operands staged in shared
// memory by cp.async (16 bytes, zero-filled past the range, two or three stages) and read with ldmatrix; online softmax in
// the exp2 domain on the accumulator fragments. Only mma.sync / ldmatrix / cp.async: these run on sm_80 and later,
// Hopper (sm_90) and Blackwell (sm_100 / sm_103) alike.
//
// DECODE tiling (t · group ≤ 16 items): R = 16 rows in one m16 tile; the warps (4, or 2 at head dim 256) take 16
// keys each of every tile, and their softmax states are merged at the end through shared memory. PREFILL tiling: warp w owns rows
// 16w..16w+15 against every key of the tile (64 keys, 32 for head dim 256 to bound registers); 8 warps (R = 128) up
// to head dim 128, so each staged K/V tile serves twice the rows and twice the warps hide its latency, 4 (R = 64) at
// head dim 256, whose Q tile and K/V stages would not leave room for a second block per SM otherwise.
//
// With splits == 1 a block writes its normalised rows to out; otherwise it writes (m, l) and the unnormalised O per
// row and split to the workspace and attn_combine_bf16 merges them. A sequence with a bad slot or length gets NaN.

template <int D, bool DECODE> struct FaShape {
    // Decode blocks: 4 warps, or 2 at head dim 256, whose K/V tiles are twice as large: a 4-warp block there staged
    // 200 KB and ran alone on its SM (4 warps an SM, issue-bound on dependent latencies by Nsight Compute); 2-warp
    // blocks with two 32-key stages take 72 KB, so three share an SM (6 warps). Prefill: a warp per 16 rows.
    static constexpr int WARPS = DECODE ? (D > 128 ? 2 : 4) : (D > 128 ? 4 : 8);
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int R = DECODE ? 16 : 16 * WARPS;                 // rows (items) per block
    static constexpr int KT = DECODE ? 16 * WARPS : (D > 128 ? 32 : 64);  // keys per staged tile
    static constexpr int NW = DECODE ? 16 : KT;                        // keys per warp per tile
    static constexpr int COPIES = DECODE ? WARPS : 1;                  // softmax states per row merged at the end
    static constexpr int STAGES = 2;                                   // K/V stages in flight
    static constexpr int DS = D + 4;                               // f32 row stride of the epilogue buffer
    static constexpr int LOOP_BYTES = (R * D + 2 * STAGES * KT * D) * 2;
    static constexpr int EPI_BYTES = COPIES * R * (DS + 2) * 4;
    static constexpr int SMEM = LOOP_BYTES > EPI_BYTES ? LOOP_BYTES : EPI_BYTES;
};

template <int D, bool DECODE>
__device__ void flash_impl(const bf16* __restrict__ q, const bf16* __restrict__ k_pool, const bf16* __restrict__ v_pool,
                           const int* __restrict__ block_table, const int* __restrict__ lens,
                           const int* __restrict__ slots, int num_slots, int blocks_per_slot, int num_blocks,
                           bf16* __restrict__ out, float* __restrict__ ws_o, float* __restrict__ ws_ml, int t,
                           int heads, int kv_heads, int block_size, float scale_log2, int splits) {
    typedef FaShape<D, DECODE> S;
    constexpr int R = S::R, KT = S::KT, NW = S::NW, CPR = D / 8, STAGES = S::STAGES;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    bf16* qs = (bf16*)fa_smem;
    bf16* ks = qs + R * D;
    bf16* vs = ks + STAGES * KT * D;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, c4 = lane & 3;
    const int group = heads / kv_heads;
    const int items = t * group;
    const int row_tiles = (items + R - 1) / R;
    // Prefill: the tiles with the most keys (last queries) start first, so the short ones fill the tail.
    const int tile = DECODE ? (int)blockIdx.x / splits : row_tiles - 1 - (int)blockIdx.x / splits;
    const int split = (int)blockIdx.x % splits;
    const int kvh = blockIdx.y, b = blockIdx.z;
    const u64 n_rows = (u64)gridDim.z * t * heads;

    const int slot = slots[b];
    const int len = (slot >= 0 && slot < num_slots) ? lens[slot] : -1;
    if (len < t || len > blocks_per_slot * block_size) {
        for (int idx = tid; idx < R * D; idx += S::THREADS) {
            const int item = tile * R + idx / D, d = idx % D;
            if (item >= items) continue;
            const u64 orow = ((u64)b * t + item / group) * heads + kvh * group + item % group;
            if (splits == 1) {
                out[orow * D + d] = from_f32<bf16>(nan_f32());
            } else {
                ws_o[((u64)split * n_rows + orow) * D + d] = nan_f32();
                if (d < 2) ws_ml[((u64)split * n_rows + orow) * 2 + d] = nan_f32();
            }
        }
        return;
    }
    const int last_item = min(items, (tile + 1) * R) - 1;
    const int block_keys = len - t + last_item / group + 1;
    const int chunk = ((block_keys + splits - 1) / splits + KT - 1) / KT * KT;
    const int k_begin = split * chunk;
    const int k_end = min(block_keys, k_begin + chunk);
    const int n_tiles = k_end > k_begin ? (k_end - k_begin + KT - 1) / KT : 0;
    const u64 row_len = (u64)kv_heads * D;
    const int* table = block_table + (u64)slot * blocks_per_slot;
    // Page arithmetic with shifts when the block size is a power of two (the engine's 16): the loader does it for
    // every 16-byte chunk.
    const bool pow2 = (block_size & (block_size - 1)) == 0;
    const int bs_shift = __ffs(block_size) - 1;

    // Q tile, zeros for padding rows.
    for (int idx = tid; idx < R * CPR; idx += S::THREADS) {
        const int r = idx / CPR, c = idx % CPR, item = tile * R + r;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (item < items) {
            const u64 qrow = ((u64)b * t + item / group) * heads + kvh * group + item % group;
            v = *(const uint4*)(q + qrow * D + c * 8);
        }
        *(uint4*)(qs + swz<D>(r, c)) = v;
    }
    // Each thread holds rows g and g + 8 of its warp's m16 tile; a row sees keys below its causal limit and below
    // this split's end. Padding rows see none.
    const int rbase = DECODE ? 0 : warp * 16;
    // Up to head dim 128 the warp's Q fragments stay in registers for the whole key loop (32 registers) instead of
    // being re-read from shared memory for every key tile; at 256 they would cost 64 registers beside the 128 of O.
    constexpr bool QREG = D <= 128;
    u32 qf[QREG ? D / 16 : 1][4];
    if constexpr (QREG) {
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) ldsm_x4(qf[kk], qs + swz<D>(rbase + (lane & 15), kk * 2 + (lane >> 4)));
    }
    int lim[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int item = tile * R + rbase + g + 8 * h;
        lim[h] = item < items ? min(len - t + item / group + 1, k_end) : 0;
    }

    auto load_tile = [&](int i, int stage) {
        const int kb = k_begin + i * KT;
        bf16* kd = ks + stage * KT * D;
        bf16* vd = vs + stage * KT * D;
        for (int idx = tid; idx < KT * CPR; idx += S::THREADS) {
            const int r = idx / CPR, c = idx % CPR, key = kb + r;
            const bool ok = key < k_end;
            u64 src = 0;
            if (ok) {
                const int page = pow2 ? key >> bs_shift : key / block_size;
                const int in_page = pow2 ? key & (block_size - 1) : key % block_size;
                int blk = table[page];
                blk = (blk >= 0 && blk < num_blocks) ? blk : 0;
                src = ((u64)blk * block_size + in_page) * row_len + (u64)kvh * D + c * 8;
            }
            cp_async16(kd + swz<D>(r, c), k_pool + src, ok ? 16 : 0);
            cp_async16(vd + swz<D>(r, c), v_pool + src, ok ? 16 : 0);
        }
    };

    float m[2] = {neg_inf_f32(), neg_inf_f32()};
    float l[2] = {0.0f, 0.0f};
    float o[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    const int kw0 = DECODE ? warp * NW : 0;  // this warp's keys within a tile

#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < n_tiles) load_tile(st, st);
        cp_async_commit();
    }
    for (int i = 0; i < n_tiles; ++i) {
        // Refill the stage computed on in the previous iteration (every warp left it at the closing barrier).
        const int next = i + STAGES - 1;
        if (next < n_tiles) load_tile(next, next % STAGES);
        cp_async_commit();  // possibly empty: keeps "all but the newest STAGES − 1 groups" meaning tile i
        cp_async_wait<STAGES - 1>();
        __syncthreads();
        const bf16* kt = ks + (i % STAGES) * KT * D;
        const bf16* vt = vs + (i % STAGES) * KT * D;
        const int kb = k_begin + i * KT + kw0;

        float s[NW / 8][4];
#pragma unroll
        for (int j = 0; j < NW / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 qs_frag[4];
            const u32* a = qf[QREG ? kk : 0];
            if constexpr (!QREG) {
                ldsm_x4(qs_frag, qs + swz<D>(rbase + (lane & 15), kk * 2 + (lane >> 4)));
                a = qs_frag;
            }
#pragma unroll
            for (int j = 0; j < NW / 8; j += 2) {
                u32 bk[4];
                ldsm_x4(bk, kt + swz<D>(kw0 + j * 8 + ((lane >> 4) << 3) + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
                mma_bf16(s[j], a, bk[0], bk[1]);
                mma_bf16(s[j + 1], a, bk[2], bk[3]);
            }
        }
        // Online softmax on the fragments: element e of n-tile j is row g + 8·(e / 2), key kb + 8j + 2·c4 + e % 2.
        // Tiles wholly inside every row's causal range (all but the diagonal ones in a long prefill) skip the
        // per-element key comparison: the softmax's scalar work, not the MMAs, bounds this loop.
        float mx[2] = {neg_inf_f32(), neg_inf_f32()};
        if (__all_sync(0xffffffffu, kb + NW <= lim[0] && kb + NW <= lim[1])) {
#pragma unroll
            for (int j = 0; j < NW / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[j][e] *= scale_log2;
                    mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < NW / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = kb + j * 8 + 2 * c4 + (e & 1);
                    const float v = key < lim[e >> 1] ? s[j][e] * scale_log2 : neg_inf_f32();
                    s[j][e] = v;
                    mx[e >> 1] = fmaxf(mx[e >> 1], v);
                }
            }
        }
        float corr[2], mu[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            const float mn = fmaxf(m[h], mx[h]);
            mu[h] = mn == neg_inf_f32() ? 0.0f : mn;  // a row with no key yet: keep everything at exactly 0
            corr[h] = exp2f(m[h] - mu[h]);
            m[h] = mn;
            l[h] *= corr[h];
        }
#pragma unroll
        for (int j = 0; j < NW / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[j][e] = exp2f(s[j][e] - mu[e >> 1]);
                l[e >> 1] += s[j][e];
            }
        }
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            o[j][0] *= corr[0];
            o[j][1] *= corr[0];
            o[j][2] *= corr[1];
            o[j][3] *= corr[1];
        }
        // O += P · V: the S fragments of key tiles 2kk, 2kk + 1 are exactly the A fragment of a 16-key step.
#pragma unroll
        for (int kk = 0; kk < NW / 16; ++kk) {
            u32 a[4];
            a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int j = 0; j < D / 8; j += 2) {
                u32 bv[4];
                ldsm_x4_t(bv, vt + swz<D>(kw0 + kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7), j + (lane >> 4)));
                mma_bf16(o[j], a, bv[0], bv[1]);
                mma_bf16(o[j + 1], a, bv[2], bv[3]);
            }
        }
        __syncthreads();  // every warp is done with this stage before it is refilled
    }
    cp_async_wait<0>();
    __syncthreads();

    // Epilogue: every warp's (m, l, O) into shared memory (the K/V stages are free), then merged per row (DECODE: the
    // 4 warps' key ranges) and written by all threads.
    float* ob = (float*)fa_smem;
    float* mlb = ob + S::COPIES * R * S::DS;
    const int copy = DECODE ? warp : 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        const int row = copy * R + rbase + g + 8 * h;
        if (c4 == 0) {
            mlb[row * 2] = m[h];
            mlb[row * 2 + 1] = l[h];
        }
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            *(float2*)(ob + row * S::DS + j * 8 + 2 * c4) = make_float2(o[j][2 * h], o[j][2 * h + 1]);
        }
    }
    __syncthreads();
    for (int idx = tid; idx < R * D; idx += S::THREADS) {
        const int r = idx / D, d = idx % D, item = tile * R + r;
        if (item >= items) continue;
        float mm = neg_inf_f32();
#pragma unroll
        for (int cp = 0; cp < S::COPIES; ++cp) mm = fmaxf(mm, mlb[(cp * R + r) * 2]);
        const float mu = mm == neg_inf_f32() ? 0.0f : mm;
        float ll = 0.0f, acc = 0.0f;
#pragma unroll
        for (int cp = 0; cp < S::COPIES; ++cp) {
            const float w = exp2f(mlb[(cp * R + r) * 2] - mu);
            ll += w * mlb[(cp * R + r) * 2 + 1];
            acc += w * ob[(cp * R + r) * S::DS + d];
        }
        const u64 orow = ((u64)b * t + item / group) * heads + kvh * group + item % group;
        if (splits == 1) {
            out[orow * D + d] = from_f32<bf16>(acc / ll);
        } else {
            ws_o[((u64)split * n_rows + orow) * D + d] = acc;
            if (d == 0) {
                ws_ml[((u64)split * n_rows + orow) * 2] = mm;
                ws_ml[((u64)split * n_rows + orow) * 2 + 1] = ll;
            }
        }
    }
}

// Merges the splits of each output row: out = Σ 2^(m_s − M) O_s / Σ 2^(m_s − M) l_s. Grid n_rows, block head_dim.
// A NaN l (a sequence with a bad slot or length) gives NaN.
extern "C" __global__ void attn_combine_bf16(const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
                                             bf16* __restrict__ out, int n_rows, int head_dim, int splits) {
    const u64 row = blockIdx.x;
    const int d = threadIdx.x;
    float mm = neg_inf_f32();
    bool bad = false;
    for (int s = 0; s < splits; ++s) {
        const float ls = ws_ml[((u64)s * n_rows + row) * 2 + 1];
        bad |= ls != ls;
        mm = fmaxf(mm, ws_ml[((u64)s * n_rows + row) * 2]);
    }
    const float mu = mm == neg_inf_f32() ? 0.0f : mm;
    float ll = 0.0f, acc = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float w = exp2f(ws_ml[((u64)s * n_rows + row) * 2] - mu);
        ll += w * ws_ml[((u64)s * n_rows + row) * 2 + 1];
        acc += w * ws_o[((u64)s * n_rows + row) * head_dim + d];
    }
    out[row * head_dim + d] = from_f32<bf16>(bad ? nan_f32() : acc / ll);
}

#define FLASH(NAME, D, DECODE)                                                                                       \
    extern "C" __global__ void __launch_bounds__((FaShape<D, DECODE>::THREADS))                                      \
        NAME(const bf16* q, const bf16* k_pool, const bf16* v_pool, const int* block_table, const int* lens,         \
             const int* slots, int num_slots, int blocks_per_slot, int num_blocks, bf16* out, float* ws_o,          \
             float* ws_ml, int t, int heads, int kv_heads, int block_size, float scale_log2, int splits) {          \
        flash_impl<D, DECODE>(q, k_pool, v_pool, block_table, lens, slots, num_slots, blocks_per_slot, num_blocks,  \
                              out, ws_o, ws_ml, t, heads, kv_heads, block_size, scale_log2, splits);                \
    }
FLASH(attn_flash_decode_d64, 64, true)
FLASH(attn_flash_decode_d128, 128, true)
FLASH(attn_flash_decode_d256, 256, true)
FLASH(attn_flash_prefill_d64, 64, false)
FLASH(attn_flash_prefill_d128, 128, false)
FLASH(attn_flash_prefill_d256, 256, false)
