// One decode step of the gated delta rule for a batch of sequences (kernels/src/cpu/gdn.rs::gdn_step).
//
// Per row b (state slot slots[b]) and value head h (key head h / (v_heads / k_heads)), with the state S [v_dim, k_dim]:
//   S ← exp(g)·S;  u = β·(v − S k);  S ← S + u kᵀ;  o = S q.
// state_pool: [slots, v_heads, v_dim, k_dim] f32; q, k: [batch, k_heads, k_dim] (already L2-normalised, q scaled);
// v, out: [batch, v_heads, v_dim]; g, beta: [batch, v_heads] f32. Grid (v_heads, batch); one warp per state row, which
// is read once and written once; q and k are staged in shared memory (2 · k_dim floats). k_dim ≤ 32 · GDN_MAX_PER_LANE.
// A row whose slot is out of range gets NaN outputs and no update.

#define GDN_MAX_PER_LANE 8

template <typename T>
__device__ void gdn_step_impl(float* __restrict__ state_pool, const int* __restrict__ slots, int num_slots,
                              const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              const float* __restrict__ g, const float* __restrict__ beta, T* __restrict__ out,
                              int k_heads, int v_heads, int k_dim, int v_dim) {
    extern __shared__ float smem[];
    float* qs = smem;
    float* ks = smem + k_dim;
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int kh = h / (v_heads / k_heads);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const u64 vo = ((u64)b * v_heads + h) * v_dim;
    const int slot = slots[b];
    if (slot < 0 || slot >= num_slots) {
        for (int i = threadIdx.x; i < v_dim; i += blockDim.x) {
            out[vo + i] = from_f32<T>(nan_f32());
        }
        return;
    }
    const u64 qk = ((u64)b * k_heads + kh) * k_dim;
    for (int c = threadIdx.x; c < k_dim; c += blockDim.x) {
        qs[c] = to_f32(q[qk + c]);
        ks[c] = to_f32(k[qk + c]);
    }
    __syncthreads();
    const float decay = expf(g[(u64)b * v_heads + h]);
    const float bt = beta[(u64)b * v_heads + h];
    float* S = state_pool + ((u64)slot * v_heads + h) * v_dim * k_dim;
    for (int r = warp; r < v_dim; r += warps) {
        float* row = S + (u64)r * k_dim;
        float s[GDN_MAX_PER_LANE];
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < GDN_MAX_PER_LANE; ++j) {
            const int c = lane + 32 * j;
            s[j] = 0.0f;
            if (c < k_dim) {
                s[j] = row[c] * decay;
                dot += s[j] * ks[c];
            }
        }
        dot = warp_sum(dot);
        const float u = bt * (to_f32(v[vo + r]) - dot);
        float o = 0.0f;
#pragma unroll
        for (int j = 0; j < GDN_MAX_PER_LANE; ++j) {
            const int c = lane + 32 * j;
            if (c < k_dim) {
                s[j] += u * ks[c];
                row[c] = s[j];
                o += s[j] * qs[c];
            }
        }
        o = warp_sum(o);
        if (lane == 0) {
            out[vo + r] = from_f32<T>(o);
        }
    }
}

#define GDN(T, S)                                                                                                 \
    extern "C" __global__ void gdn_step_##S(float* state_pool, const int* slots, int num_slots, const T* q,        \
                                            const T* k, const T* v, const float* g, const float* beta, T* out,     \
                                            int k_heads, int v_heads, int k_dim, int v_dim) {                     \
        gdn_step_impl<T>(state_pool, slots, num_slots, q, k, v, g, beta, out, k_heads, v_heads, k_dim, v_dim);    \
    }
GDN(float, f32)
GDN(bf16, bf16)
