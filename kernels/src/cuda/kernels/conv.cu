// Depthwise causal conv1d with a carried state (kernels/src/cpu/conv.rs::causal_conv1d), batched over state slots.
//
// x, out: [batch, seq, channels]; w: [channels, k]; bias: [channels] or null; state_pool: [slots, k − 1, channels],
// oldest first; row b uses slot slots[b] and leaves the last k − 1 inputs there. One thread per (row, channel) walks
// the sequence with a sliding window in registers. A row whose slot is out of range gets NaN outputs and no state
// update, so a bad index shows up instead of corrupting another sequence.

#define CONV_MAX_K 8

template <typename T>
__device__ void conv1d_impl(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                            T* __restrict__ state_pool, const int* __restrict__ slots, int num_slots,
                            T* __restrict__ out, int seq, int channels, int k, int apply_silu) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = blockIdx.y;
    if (c >= channels) {
        return;
    }
    const T* xb = x + (u64)b * seq * channels;
    T* ob = out + (u64)b * seq * channels;
    const int slot = slots[b];
    if (slot < 0 || slot >= num_slots) {
        for (int t = 0; t < seq; ++t) {
            ob[(u64)t * channels + c] = from_f32<T>(nan_f32());
        }
        return;
    }
    T* st = state_pool + (u64)slot * (k - 1) * channels;
    float win[CONV_MAX_K];  // win[j]: input at time t − (k − 1) + j
    float wr[CONV_MAX_K];
#pragma unroll
    for (int j = 0; j < CONV_MAX_K; ++j) {
        win[j] = (j < k - 1) ? to_f32(st[(u64)j * channels + c]) : 0.0f;
        wr[j] = (j < k) ? to_f32(w[(u64)c * k + j]) : 0.0f;
    }
    const float bv = bias ? to_f32(bias[c]) : 0.0f;
    for (int t = 0; t < seq; ++t) {
        const float xt = to_f32(xb[(u64)t * channels + c]);
        float acc = bv;
#pragma unroll
        for (int j = 0; j < CONV_MAX_K; ++j) {
            if (j < k) {
                acc += wr[j] * (j == k - 1 ? xt : win[j]);
            }
        }
        ob[(u64)t * channels + c] = from_f32<T>(apply_silu ? silu_f(acc) : acc);
#pragma unroll
        for (int j = 0; j < CONV_MAX_K - 1; ++j) {
            if (j < k - 2) {
                win[j] = win[j + 1];
            } else if (j == k - 2) {
                win[j] = xt;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < CONV_MAX_K - 1; ++j) {
        if (j < k - 1) {
            st[(u64)j * channels + c] = from_f32<T>(win[j]);
        }
    }
}

#define CONV(T, S)                                                                                               \
    extern "C" __global__ void conv1d_##S(const T* x, const T* w, const T* bias, T* state_pool, const int* slots, \
                                          int num_slots, T* out, int seq, int channels, int k, int apply_silu) { \
        conv1d_impl<T>(x, w, bias, state_pool, slots, num_slots, out, seq, channels, k, apply_silu);            \
    }
CONV(float, f32)
CONV(bf16, bf16)
