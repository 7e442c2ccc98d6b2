// Elementwise activations (kernels/src/cpu/act.rs): kind 0 SiLU, 1 sigmoid, 2 softplus, 3 relu², and SwiGLU.

// Both kernels run V elements a thread (V = 1, or a 16-byte vector when the host finds n and the pointers aligned):
// one element a thread leaves each thread a single short load in flight, too few to keep HBM busy.

__device__ __forceinline__ float act_f(float v, int kind) {
    switch (kind) {
        case 0: return silu_f(v);
        case 1: return sigmoid_f(v);
        case 2: return softplus_f(v);
        case 3: return relu2_f(v);
        default: return nan_f32();
    }
}

template <typename T, int V>
__device__ void act_impl(const T* __restrict__ x, T* __restrict__ out, u64 n, int kind) {
    typedef Pack<T, V> P;
    const P* xp = reinterpret_cast<const P*>(x);
    P* op = reinterpret_cast<P*>(out);
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n / V; i += (u64)gridDim.x * blockDim.x) {
        const P a = xp[i];
        P r;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            r.v[j] = from_f32<T>(act_f(to_f32(a.v[j]), kind));
        }
        op[i] = r;
    }
}

// out = silu(gate) · up; `out` may alias `gate`.
template <typename T, int V>
__device__ void swiglu_impl(const T* gate, const T* __restrict__ up, T* out, u64 n) {
    typedef Pack<T, V> P;
    const P* gp = reinterpret_cast<const P*>(gate);
    const P* up_p = reinterpret_cast<const P*>(up);
    P* op = reinterpret_cast<P*>(out);
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n / V; i += (u64)gridDim.x * blockDim.x) {
        const P g = gp[i];
        const P u = up_p[i];
        P r;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            r.v[j] = from_f32<T>(silu_f(to_f32(g.v[j])) * to_f32(u.v[j]));
        }
        op[i] = r;
    }
}

#define ACT(T, S)                                                                                           \
    extern "C" __global__ void act_##S(const T* x, T* out, u64 n, int kind) { act_impl<T, 1>(x, out, n, kind); } \
    extern "C" __global__ void act_vec_##S(const T* x, T* out, u64 n, int kind) {                             \
        act_impl<T, 16 / sizeof(T)>(x, out, n, kind);                                                         \
    }                                                                                                         \
    extern "C" __global__ void swiglu_##S(const T* gate, const T* up, T* out, u64 n) {                        \
        swiglu_impl<T, 1>(gate, up, out, n);                                                                  \
    }                                                                                                         \
    extern "C" __global__ void swiglu_vec_##S(const T* gate, const T* up, T* out, u64 n) {                    \
        swiglu_impl<T, 16 / sizeof(T)>(gate, up, out, n);                                                     \
    }
ACT(float, f32)
ACT(bf16, bf16)
