// Elementwise activations (kernels/src/cpu/act.rs): kind 0 SiLU, 1 sigmoid, 2 softplus, 3 relu², and SwiGLU.

template <typename T>
__device__ void act_impl(const T* __restrict__ x, T* __restrict__ out, u64 n, int kind) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float v = to_f32(x[i]);
        float r;
        switch (kind) {
            case 0: r = silu_f(v); break;
            case 1: r = sigmoid_f(v); break;
            case 2: r = softplus_f(v); break;
            case 3: r = relu2_f(v); break;
            default: r = nan_f32(); break;
        }
        out[i] = from_f32<T>(r);
    }
}

// out = silu(gate) · up; `out` may alias `gate`.
template <typename T>
__device__ void swiglu_impl(const T* gate, const T* __restrict__ up, T* out, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        out[i] = from_f32<T>(silu_f(to_f32(gate[i])) * to_f32(up[i]));
    }
}

#define ACT(T, S)                                                                                          \
    extern "C" __global__ void act_##S(const T* x, T* out, u64 n, int kind) { act_impl<T>(x, out, n, kind); } \
    extern "C" __global__ void swiglu_##S(const T* gate, const T* up, T* out, u64 n) {                     \
        swiglu_impl<T>(gate, up, out, n);                                                                    \
    }
ACT(float, f32)
ACT(bf16, bf16)
