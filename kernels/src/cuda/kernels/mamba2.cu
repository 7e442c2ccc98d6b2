// One decode step of the Mamba-2 recurrence for a batch of sequences (kernels/src/cpu/mamba2.rs::mamba2_step).
//
// Per row b (state slot slots[b]) and head h (B/C group h / (heads / groups)), with dA = exp(dt·A):
//   S = dA·S + dt·x ⊗ B;  y = S·C + D·x.
// state_pool: [slots, heads, head_dim, state_dim] f32; x, y: [batch, heads, head_dim]; dt: [batch, heads] f32
// (already softplus'd and clamped); A, D: [heads] f32; B, C: [batch, groups, state_dim].
// Grid (heads, batch); one warp per row of the head's state, B and C staged in shared memory as f32
// (dynamic shared memory: 2 · state_dim floats). A row whose slot is out of range gets NaN outputs and no update.

template <typename T>
__device__ void mamba2_step_impl(float* __restrict__ state_pool, const int* __restrict__ slots, int num_slots,
                                 const T* __restrict__ x, const float* __restrict__ dt, const float* __restrict__ A,
                                 const T* __restrict__ B, const T* __restrict__ C, const float* __restrict__ D,
                                 T* __restrict__ y, int heads, int head_dim, int state_dim, int groups) {
    extern __shared__ float smem[];
    float* bs = smem;
    float* cs = smem + state_dim;
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int g = h / (heads / groups);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const u64 xy = ((u64)b * heads + h) * head_dim;
    const int slot = slots[b];
    if (slot < 0 || slot >= num_slots) {
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
            y[xy + i] = from_f32<T>(nan_f32());
        }
        return;
    }
    const u64 bc = ((u64)b * groups + g) * state_dim;
    for (int n = threadIdx.x; n < state_dim; n += blockDim.x) {
        bs[n] = to_f32(B[bc + n]);
        cs[n] = to_f32(C[bc + n]);
    }
    __syncthreads();
    const float dth = dt[(u64)b * heads + h];
    const float da = expf(dth * A[h]);
    const float dskip = D[h];
    float* S = state_pool + ((u64)slot * heads + h) * head_dim * state_dim;
    for (int i = warp; i < head_dim; i += warps) {
        const float xi = to_f32(x[xy + i]);
        const float dtx = dth * xi;
        float* row = S + (u64)i * state_dim;
        float acc = 0.0f;
        for (int n = lane; n < state_dim; n += 32) {
            const float s = da * row[n] + dtx * bs[n];
            row[n] = s;
            acc += s * cs[n];
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            y[xy + i] = from_f32<T>(acc + dskip * xi);
        }
    }
}

#define MAMBA2(T, S)                                                                                              \
    extern "C" __global__ void mamba2_step_##S(float* state_pool, const int* slots, int num_slots, const T* x,     \
                                               const float* dt, const float* A, const T* B, const T* C,           \
                                               const float* D, T* y, int heads, int head_dim, int state_dim,      \
                                               int groups) {                                                      \
        mamba2_step_impl<T>(state_pool, slots, num_slots, x, dt, A, B, C, D, y, heads, head_dim, state_dim, groups); \
    }
MAMBA2(float, f32)
MAMBA2(bf16, bf16)
