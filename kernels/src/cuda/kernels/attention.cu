// Causal attention over a paged KV cache (kernels/src/cpu/attention.rs::causal_attention), and the write of new K/V
// rows into the pages.
//
// Pools: k_pool, v_pool [blocks, block_size, kv_heads, head_dim]; block_table [num_slots, blocks_per_slot] of block
// ids; lens [num_slots]: tokens cached per slot, including the ones being attended from. Position p of slot s lives in
// block block_table[s · blocks_per_slot + p / block_size], row p % block_size.

// Writes rows i of k_new / v_new [n, kv_heads, head_dim] at position positions[i] of slot slots[i]. A row whose slot,
// position or block id is out of range is skipped. Grid-stride over n · kv_heads · head_dim.
template <typename T>
__device__ void kv_write_impl(const T* __restrict__ k_new, const T* __restrict__ v_new, const int* __restrict__ slots,
                              const int* __restrict__ positions, const int* __restrict__ block_table, int num_slots,
                              int blocks_per_slot, int num_blocks, T* __restrict__ k_pool, T* __restrict__ v_pool, int n,
                              int kv_heads, int head_dim, int block_size) {
    const u64 row_len = (u64)kv_heads * head_dim;
    const u64 total = (u64)n * row_len;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const int r = (int)(i / row_len);
        const u64 c = i % row_len;
        const int slot = slots[r];
        const int pos = positions[r];
        if (slot < 0 || slot >= num_slots || pos < 0 || pos >= blocks_per_slot * block_size) {
            continue;
        }
        const int blk = block_table[(u64)slot * blocks_per_slot + pos / block_size];
        if (blk < 0 || blk >= num_blocks) {
            continue;
        }
        const u64 dst = ((u64)blk * block_size + pos % block_size) * row_len + c;
        k_pool[dst] = k_new[i];
        v_pool[dst] = v_new[i];
    }
}

#define ATTN_WARPS 8
#define ATTN_KEYS 32
#define ATTN_MAX_PER_LANE 8

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

// q, out: [batch, t, heads, head_dim]: the last t tokens of each row's sequence (slot slots[b], lens[slot] tokens
// cached, these included), so query i sits at position lens − t + i and sees keys 0 ..= lens − t + i.
// Grid (ceil(t · group / ATTN_WARPS), kv_heads, batch), ATTN_WARPS warps; warp w takes item blockIdx.x · ATTN_WARPS + w,
// item = query · group + head-in-group, so the heads of one KV head share every K/V tile the block stages in shared
// memory (ATTN_KEYS keys, f32, K rows padded to head_dim + 1 so lane j reading key j hits distinct banks). Each warp
// keeps an online softmax: lane j scores key j of the tile, the warp reduces max and sum, and every lane accumulates
// head_dim / 32 output channels. A row with a bad slot or length gets NaN outputs.
template <typename T>
__device__ void attn_paged_impl(const T* __restrict__ q, const T* __restrict__ k_pool, const T* __restrict__ v_pool,
                                const int* __restrict__ block_table, const int* __restrict__ lens,
                                const int* __restrict__ slots, int num_slots, int blocks_per_slot, int num_blocks,
                                T* __restrict__ out, int t, int heads, int kv_heads, int head_dim, int block_size,
                                float scale) {
    extern __shared__ float smem[];
    const int kstride = head_dim + 1;
    float* ks = smem;
    float* vs = ks + ATTN_KEYS * kstride;
    float* qs = vs + ATTN_KEYS * head_dim;
    const int group = heads / kv_heads;
    const int kvh = blockIdx.y;
    const int b = blockIdx.z;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int items = t * group;
    const int item = blockIdx.x * ATTN_WARPS + warp;
    const bool active = item < items;
    const int qi = active ? item / group : 0;
    const int h = kvh * group + (active ? item % group : 0);
    const u64 qo = (((u64)b * t + qi) * heads + h) * head_dim;

    const int slot = slots[b];
    const int len = (slot >= 0 && slot < num_slots) ? lens[slot] : -1;
    if (len < t || len > blocks_per_slot * block_size) {
        if (active) {
            for (int d = lane; d < head_dim; d += 32) {
                out[qo + d] = from_f32<T>(nan_f32());
            }
        }
        return;
    }
    const int last_item = min(items, (int)(blockIdx.x + 1) * ATTN_WARPS) - 1;
    const int block_keys = len - t + last_item / group + 1;
    const int limit = len - t + qi + 1;
    const u64 row_len = (u64)kv_heads * head_dim;
    const int* table = block_table + (u64)slot * blocks_per_slot;

    float* qw = qs + warp * head_dim;
    for (int d = lane; d < head_dim; d += 32) {
        qw[d] = active ? to_f32(q[qo + d]) : 0.0f;
    }
    float m = neg_inf_f32();
    float l = 0.0f;
    float acc[ATTN_MAX_PER_LANE];
#pragma unroll
    for (int j = 0; j < ATTN_MAX_PER_LANE; ++j) {
        acc[j] = 0.0f;
    }
    for (int k0 = 0; k0 < block_keys; k0 += ATTN_KEYS) {
        __syncthreads();  // the previous tile has been read by every warp
        for (int idx = threadIdx.x; idx < ATTN_KEYS * head_dim; idx += blockDim.x) {
            const int j = idx / head_dim;
            const int d = idx - j * head_dim;
            const int key = k0 + j;
            float kv = 0.0f, vv = 0.0f;
            if (key < block_keys) {
                int blk = table[key / block_size];
                blk = (blk >= 0 && blk < num_blocks) ? blk : 0;
                const u64 src = ((u64)blk * block_size + key % block_size) * row_len + (u64)kvh * head_dim + d;
                kv = to_f32(k_pool[src]);
                vv = to_f32(v_pool[src]);
            }
            ks[j * kstride + d] = kv;
            vs[j * head_dim + d] = vv;
        }
        __syncthreads();
        if (!active || k0 >= limit) {
            continue;
        }
        const int key = k0 + lane;
        float s = neg_inf_f32();
        if (key < limit) {
            const float* kr = ks + lane * kstride;
            float dot = 0.0f;
            for (int d = 0; d < head_dim; ++d) {
                dot += qw[d] * kr[d];
            }
            s = dot * scale;
        }
        const float m_new = fmaxf(m, warp_max(s));
        const float corr = expf(m - m_new);
        const float p = key < limit ? expf(s - m_new) : 0.0f;
        l = l * corr + warp_sum(p);
        const int nk = min(ATTN_KEYS, limit - k0);
#pragma unroll
        for (int jj = 0; jj < ATTN_MAX_PER_LANE; ++jj) {
            acc[jj] *= corr;
        }
        for (int j = 0; j < nk; ++j) {
            const float pj = __shfl_sync(0xffffffffu, p, j);
            const float* vr = vs + j * head_dim;
#pragma unroll
            for (int jj = 0; jj < ATTN_MAX_PER_LANE; ++jj) {
                const int d = lane + 32 * jj;
                if (d < head_dim) {
                    acc[jj] += pj * vr[d];
                }
            }
        }
        m = m_new;
    }
    if (active) {
        const float inv = 1.0f / l;
#pragma unroll
        for (int jj = 0; jj < ATTN_MAX_PER_LANE; ++jj) {
            const int d = lane + 32 * jj;
            if (d < head_dim) {
                out[qo + d] = from_f32<T>(acc[jj] * inv);
            }
        }
    }
}

#define ATTN(T, S)                                                                                                 \
    extern "C" __global__ void kv_write_##S(const T* k_new, const T* v_new, const int* slots, const int* positions, \
                                            const int* block_table, int num_slots, int blocks_per_slot,            \
                                            int num_blocks, T* k_pool, T* v_pool, int n, int kv_heads,             \
                                            int head_dim, int block_size) {                                        \
        kv_write_impl<T>(k_new, v_new, slots, positions, block_table, num_slots, blocks_per_slot, num_blocks,      \
                         k_pool, v_pool, n, kv_heads, head_dim, block_size);                                       \
    }                                                                                                              \
    extern "C" __global__ void attn_paged_##S(const T* q, const T* k_pool, const T* v_pool, const int* block_table, \
                                              const int* lens, const int* slots, int num_slots,                    \
                                              int blocks_per_slot, int num_blocks, T* out, int t, int heads,       \
                                              int kv_heads, int head_dim, int block_size, float scale) {           \
        attn_paged_impl<T>(q, k_pool, v_pool, block_table, lens, slots, num_slots, blocks_per_slot, num_blocks,    \
                           out, t, heads, kv_heads, head_dim, block_size, scale);                                  \
    }
ATTN(float, f32)
ATTN(bf16, bf16)
