// Shared by every rewind kernel: prepended to each .cu source before NVRTC compiles it (no #include needed).
//
// bf16 is carried as its 16 raw bits: conversions are written out here so that no CUDA header is needed at run
// time, and so that rounding (round to nearest even, NaN kept quiet) matches `half::bf16::from_f32` bit for bit.
// Every kernel computes in f32 whatever its storage type.

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __uint_as_float(((u32)x) << 16); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// V elements of T moved as one aligned load or store (16 bytes when V · sizeof(T) is 16: the vector kernels, whose
// hosts check that every address is aligned).
template <typename T, int V>
struct alignas(V * sizeof(T)) Pack {
    T v[V];
};

__device__ __forceinline__ float nan_f32() { return __uint_as_float(0x7fc00000u); }
__device__ __forceinline__ float neg_inf_f32() { return __uint_as_float(0xff800000u); }

// PyTorch's definitions (see kernels/src/cpu/act.rs).
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float relu2_f(float x) {
    float r = fmaxf(x, 0.0f);
    return r * r;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // an earlier call may still be reading partial[0]
    if (lane == 0) {
        partial[warp] = v;
    }
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        float t = lane < warps ? partial[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) {
            partial[0] = t;
        }
    }
    __syncthreads();
    return partial[0];
}

// The 8 bf16 of a 16-byte word, widened to f32 (the skinny GEMMs' loads).
__device__ __forceinline__ void bf16x8(const uint4 v, float f[8]) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// Each kernel file writes its body once as a template (`name_impl<T>`) and declares the `_f32` and `_bf16` entry
// points with a one-line macro `#define X(T, S) extern "C" __global__ void name_##S(...) { name_impl<T>(...); }`.
