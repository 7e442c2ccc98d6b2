// RMSNorm variants and row L2 norm (kernels/src/cpu/norm.rs). One block per row (or per row and group).

// out = x / rms(x) · (offset + w); offset 0 plain, 1 zero-centred. `out` may alias `x`.
template <typename T>
__device__ void rms_norm_impl(const T* x, const T* __restrict__ w, T* out, int dim, float eps, float offset) {
    const T* xr = x + (u64)blockIdx.x * dim;
    T* orow = out + (u64)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = to_f32(xr[i]);
        ss += v * v;
    }
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        orow[i] = from_f32<T>(to_f32(xr[i]) * inv * (offset + to_f32(w[i])));
    }
}

// Grouped gated RMSNorm; grid (rows, dim / group). gate_before: rms(x·silu(z))·w (Mamba-2), else rms(x)·w·silu(z)
// (Gated DeltaNet). z's rows are z_stride apart (z read in place out of the projection).
template <typename T>
__device__ void gated_rms_norm_impl(const T* x, const T* __restrict__ z, const T* __restrict__ w, T* out, int dim,
                                    int z_stride, int group, float eps, int gate_before) {
    const u64 base = (u64)blockIdx.x * dim + (u64)blockIdx.y * group;
    const T* xr = x + base;
    const T* zr = z + (u64)blockIdx.x * z_stride + (u64)blockIdx.y * group;
    const T* wr = w + (u64)blockIdx.y * group;
    T* orow = out + base;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        float v = to_f32(xr[i]);
        if (gate_before) {
            v *= silu_f(to_f32(zr[i]));
        }
        ss += v * v;
    }
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)group + eps);
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        const float v = to_f32(xr[i]);
        const float g = silu_f(to_f32(zr[i]));
        const float r = gate_before ? (v * g) * inv * to_f32(wr[i]) : v * inv * (to_f32(wr[i]) * g);
        orow[i] = from_f32<T>(r);
    }
}

// out = x / sqrt(Σx² + eps) · scale per head row (fla's l2norm, then the query scale). Block r reads head r % heads
// of input row r / heads, whose heads start x_stride apart (x read in place out of the conv output); out is
// contiguous. `out` may alias `x` when x_stride = heads · dim.
template <typename T>
__device__ void l2_norm_impl(const T* x, T* out, int dim, int heads, int x_stride, float eps, float scale) {
    const T* xr = x + (u64)(blockIdx.x / heads) * x_stride + (u64)(blockIdx.x % heads) * dim;
    T* orow = out + (u64)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = to_f32(xr[i]);
        ss += v * v;
    }
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        orow[i] = from_f32<T>(to_f32(xr[i]) * inv * scale);
    }
}

#define NORM(T, S)                                                                                              \
    extern "C" __global__ void rms_norm_##S(const T* x, const T* w, T* out, int dim, float eps, float offset) {  \
        rms_norm_impl<T>(x, w, out, dim, eps, offset);                                                           \
    }                                                                                                            \
    extern "C" __global__ void gated_rms_norm_##S(const T* x, const T* z, const T* w, T* out, int dim,            \
                                                 int z_stride, int group, float eps, int gate_before) {         \
        gated_rms_norm_impl<T>(x, z, w, out, dim, z_stride, group, eps, gate_before);                            \
    }                                                                                                            \
    extern "C" __global__ void l2_norm_##S(const T* x, T* out, int dim, int heads, int x_stride, float eps,       \
                                           float scale) {                                                       \
        l2_norm_impl<T>(x, out, dim, heads, x_stride, eps, scale);                                               \
    }
NORM(float, f32)
NORM(bf16, bf16)
