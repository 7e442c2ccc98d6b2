// NeoX-style rotary embedding on the leading rotary_dim channels of each head, in place
// (kernels/src/cpu/rope.rs::apply_rope). x: [rows, heads, head_dim]; positions: [rows]; inv_freq: [rotary_dim / 2],
// computed on the host exactly as transformers does. One thread per (row, head, frequency).

template <typename T>
__device__ void rope_impl(T* x, const int* __restrict__ positions, const float* __restrict__ inv_freq, int rows,
                          int heads, int head_dim, int rotary_dim) {
    const int half = rotary_dim / 2;
    const u64 total = (u64)rows * heads * half;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const int j = (int)(i % half);
        const u64 rh = i / half;  // row · heads + head
        const int row = (int)(rh / heads);
        const float angle = (float)positions[row] * inv_freq[j];
        const float c = cosf(angle);
        const float s = sinf(angle);
        T* head = x + rh * head_dim;
        const float a = to_f32(head[j]);
        const float b = to_f32(head[j + half]);
        head[j] = from_f32<T>(a * c - b * s);
        head[j + half] = from_f32<T>(b * c + a * s);
    }
}

#define ROPE(T, S)                                                                                         \
    extern "C" __global__ void rope_##S(T* x, const int* positions, const float* inv_freq, int rows, int heads, \
                                        int head_dim, int rotary_dim) {                                    \
        rope_impl<T>(x, positions, inv_freq, rows, heads, head_dim, rotary_dim);                           \
    }
ROPE(float, f32)
ROPE(bf16, bf16)
