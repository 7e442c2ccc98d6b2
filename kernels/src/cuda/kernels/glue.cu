// Glue between the big kernels of the GPU runner: column gathers, fused residual + RMSNorm, the dt / GDN gate
// activations, elementwise gate / bias / SwiGLU, vocab-parallel embedding, the MoE finish, and the Mamba-2
// gated norm split across tensor-parallel ranks. Every op computes in f32 whatever its storage type.

// out[r, j] = src[r, idx[j]]; j runs fastest so that writes are coalesced. An index outside the row gives NaN.
// Grid: x over the columns, y over the rows (grid-stride in both), so no thread divides by the width.
template <typename T>
__device__ void gather_cols_impl(const T* __restrict__ src, const int* __restrict__ idx, T* __restrict__ out,
                                 u64 rows, int src_width, int n) {
    for (u64 r = blockIdx.y; r < rows; r += gridDim.y) {
        const T* srow = src + r * (u64)src_width;
        T* orow = out + r * (u64)n;
        for (u64 j = blockIdx.x * (u64)blockDim.x + threadIdx.x; j < (u64)n; j += (u64)gridDim.x * blockDim.x) {
            const int c = idx[j];
            orow[j] = (c >= 0 && c < src_width) ? srow[c] : from_f32<T>(nan_f32());
        }
    }
}

// out[r, out_start + j] = src[r, start + j] for the n columns of a contiguous range, rows src_width / out_width
// apart, V elements a thread (the host checks that every offset, width and both pointers keep every vector 16-byte
// aligned when V > 1). Grid as gather_cols.
template <typename T, int V>
__device__ void copy_cols_impl(const T* __restrict__ src, T* __restrict__ out, u64 rows, int src_width, int start,
                               int n, int out_width, int out_start) {
    typedef Pack<T, V> P;
    const int nv = n / V;
    for (u64 r = blockIdx.y; r < rows; r += gridDim.y) {
        const P* srow = reinterpret_cast<const P*>(src + r * (u64)src_width + start);
        P* orow = reinterpret_cast<P*>(out + r * (u64)out_width + out_start);
        for (u64 j = blockIdx.x * (u64)blockDim.x + threadIdx.x; j < (u64)nv; j += (u64)gridDim.x * blockDim.x) {
            orow[j] = srow[j];
        }
    }
}

// dst[pairs[i].d, :] = src[pairs[i].s, :] for the n (s, d) row pairs, rows `width` wide: a row gather and scatter in
// one launch. A pair naming a row outside its matrix is skipped (the pairs are device data). One block per pair.
template <typename T>
__device__ void copy_rows_impl(const T* __restrict__ src, T* __restrict__ dst, const int* __restrict__ pairs, int width,
                               long long src_rows, long long dst_rows) {
    const long long s = pairs[2 * (u64)blockIdx.x];
    const long long d = pairs[2 * (u64)blockIdx.x + 1];
    if (s < 0 || s >= src_rows || d < 0 || d >= dst_rows) {
        return;
    }
    const T* srow = src + (u64)s * width;
    T* drow = dst + (u64)d * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        drow[i] = srow[i];
    }
}

// x += y (when y is given, written back to x), then out = x · rsqrt(mean(x²) + eps) · (offset + w), in the operation
// order of cpu::norm::rms_norm. One block per row.
template <typename T>
__device__ void add_rms_norm_impl(float* x, const float* __restrict__ y, const T* __restrict__ w, T* out, int dim,
                                  float eps, float offset) {
    float* xr = x + (u64)blockIdx.x * dim;
    const float* yr = y ? y + (u64)blockIdx.x * dim : nullptr;
    T* orow = out + (u64)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i];
        if (yr) {
            v += yr[i];
            xr[i] = v;
        }
        ss += v * v;
    }
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    // Each thread re-reads only the elements it wrote itself, so no barrier is needed for x.
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        orow[i] = from_f32<T>(xr[i] * inv * (offset + to_f32(w[i])));
    }
}

// torch.clamp: NaN stays NaN, and lo > hi gives hi.
__device__ __forceinline__ float clamp_torch(float x, float lo, float hi) {
    float r = x < lo ? lo : x;
    return r > hi ? hi : r;
}

// out[r, h] = clamp(softplus(src[r, col + h] + bias[h]), lo, hi).
template <typename T>
__device__ void dt_softplus_impl(const T* __restrict__ src, u64 rows, int src_width, int col,
                                 const float* __restrict__ bias, int n, float lo, float hi, float* __restrict__ out) {
    const u64 total = rows * (u64)n;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / (u64)n;
        const int h = (int)(i - r * (u64)n);
        const float v = to_f32(src[r * (u64)src_width + col + h]) + bias[h];
        out[i] = clamp_torch(softplus_f(v), lo, hi);
    }
}

// beta[r, h] = sigmoid(src[r, b_col + h]); g[r, h] = neg_a[h] · softplus(src[r, a_col + h] + dt_bias[h]).
template <typename T>
__device__ void gdn_gates_impl(const T* __restrict__ src, u64 rows, int src_width, int b_col, int a_col,
                               const float* __restrict__ dt_bias, const float* __restrict__ neg_a, int n,
                               float* __restrict__ beta, float* __restrict__ g) {
    const u64 total = rows * (u64)n;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / (u64)n;
        const int h = (int)(i - r * (u64)n);
        const T* row = src + r * (u64)src_width;
        beta[i] = sigmoid_f(to_f32(row[b_col + h]));
        g[i] = neg_a[h] * softplus_f(to_f32(row[a_col + h]) + dt_bias[h]);
    }
}

template <typename T>
__device__ void sigmoid_mul_impl(T* x, const T* __restrict__ gate, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        x[i] = from_f32<T>(to_f32(x[i]) * sigmoid_f(to_f32(gate[i])));
    }
}

// x [rows, 2·inter] (gate columns, then up) → out [rows, inter] = silu(gate) · up.
template <typename T>
__device__ void swiglu_split_impl(const T* __restrict__ x, T* __restrict__ out, u64 rows, int inter) {
    const u64 total = rows * (u64)inter;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / (u64)inter;
        const u64 j = i - r * (u64)inter;
        const T* row = x + r * 2 * (u64)inter;
        out[i] = from_f32<T>(silu_f(to_f32(row[j])) * to_f32(row[inter + j]));
    }
}

template <typename T>
__device__ void add_bias_impl(T* x, const float* __restrict__ bias, u64 n, int dim) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        x[i] = from_f32<T>(to_f32(x[i]) + bias[i % (u64)dim]);
    }
}

// Vocab-parallel embedding: this table holds ids vocab_start .. vocab_start + local_rows; other ids give zeros (the
// ranks' rows are summed afterwards). One block per id.
template <typename T>
__device__ void embed_rows_f32_impl(const T* __restrict__ table, const int* __restrict__ ids, float* __restrict__ out,
                                    int dim, long long vocab_start, long long local_rows) {
    const long long local = (long long)ids[blockIdx.x] - vocab_start;
    float* orow = out + (u64)blockIdx.x * dim;
    if (local < 0 || local >= local_rows) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            orow[i] = 0.0f;
        }
        return;
    }
    const T* src = table + (u64)local * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        orow[i] = to_f32(src[i]);
    }
}

// out = routed + s · shared, s = sigmoid(gate[r]) or 1; without shared, out = routed.
template <typename T>
__device__ void moe_finish_impl(const T* __restrict__ routed, const float* __restrict__ shared,
                                const float* __restrict__ gate, float* __restrict__ out, u64 n, int dim) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float v = to_f32(routed[i]);
        if (shared) {
            const float s = gate ? sigmoid_f(gate[i / (u64)dim]) : 1.0f;
            v += s * shared[i];
        }
        out[i] = v;
    }
}

// The local channels of global norm group g: [max(0, g·gs − first), min(di, (g + 1)·gs − first)).
__device__ __forceinline__ void group_range(int g, int first, int gs, int di, int* lo, int* hi) {
    const long long a = (long long)g * gs - first;
    const long long b = a + gs;
    *lo = (int)(a < 0 ? 0 : (a > di ? di : a));
    *hi = (int)(b < 0 ? 0 : (b > di ? di : b));
}

// sums[r, g] = Σ (y · silu(z))² over this rank's channels of group g; grid (rows, num_groups).
template <typename T>
__device__ void gated_sq_sums_impl(const T* __restrict__ y, const T* __restrict__ z, float* __restrict__ sums, int di,
                                   int first, int gs, int ng) {
    int lo, hi;
    group_range(blockIdx.y, first, gs, di, &lo, &hi);
    const u64 base = (u64)blockIdx.x * di;
    float ss = 0.0f;
    for (int c = lo + threadIdx.x; c < hi; c += blockDim.x) {
        const float v = to_f32(y[base + c]) * silu_f(to_f32(z[base + c]));
        ss += v * v;
    }
    ss = block_sum(ss);
    if (threadIdx.x == 0) {
        sums[(u64)blockIdx.x * ng + blockIdx.y] = ss;
    }
}

// out[r, c] = (y · silu(z)) · rsqrt(sums[r, g] / gs + eps) · w[c], g = (first + c) / gs.
template <typename T>
__device__ void gated_norm_apply_impl(const T* __restrict__ y, const T* __restrict__ z, const float* __restrict__ sums,
                                      const T* __restrict__ w, T* __restrict__ out, u64 rows, int di, int first,
                                      int gs, int ng, float eps) {
    const u64 total = rows * (u64)di;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / (u64)di;
        const int c = (int)(i - r * (u64)di);
        const int g = (first + c) / gs;
        const float v = to_f32(y[i]) * silu_f(to_f32(z[i]));
        const float ms = sums[r * ng + g] / (float)gs;
        out[i] = from_f32<T>(v * (1.0f / sqrtf(ms + eps)) * to_f32(w[c]));
    }
}

#define GLUE(T, S)                                                                                                   \
    extern "C" __global__ void gather_cols_##S(const T* src, const int* idx, T* out, u64 rows, int src_width,        \
                                               int n) {                                                             \
        gather_cols_impl<T>(src, idx, out, rows, src_width, n);                                                     \
    }                                                                                                                \
    extern "C" __global__ void copy_cols_##S(const T* src, T* out, u64 rows, int src_width, int start, int n,        \
                                             int out_width, int out_start) {                                        \
        copy_cols_impl<T, 1>(src, out, rows, src_width, start, n, out_width, out_start);                            \
    }                                                                                                                \
    extern "C" __global__ void copy_cols_vec_##S(const T* src, T* out, u64 rows, int src_width, int start, int n,    \
                                                 int out_width, int out_start) {                                    \
        copy_cols_impl<T, 16 / sizeof(T)>(src, out, rows, src_width, start, n, out_width, out_start);               \
    }                                                                                                                \
    extern "C" __global__ void copy_rows_##S(const T* src, T* dst, const int* pairs, int width, long long src_rows,   \
                                             long long dst_rows) {                                                  \
        copy_rows_impl<T>(src, dst, pairs, width, src_rows, dst_rows);                                              \
    }                                                                                                                \
    extern "C" __global__ void add_rms_norm_##S(float* x, const float* y, const T* w, T* out, int dim, float eps,    \
                                                float offset) {                                                     \
        add_rms_norm_impl<T>(x, y, w, out, dim, eps, offset);                                                       \
    }                                                                                                                \
    extern "C" __global__ void dt_softplus_##S(const T* src, u64 rows, int src_width, int col, const float* bias,   \
                                               int n, float lo, float hi, float* out) {                             \
        dt_softplus_impl<T>(src, rows, src_width, col, bias, n, lo, hi, out);                                       \
    }                                                                                                                \
    extern "C" __global__ void gdn_gates_##S(const T* src, u64 rows, int src_width, int b_col, int a_col,           \
                                             const float* dt_bias, const float* neg_a, int n, float* beta,          \
                                             float* g) {                                                            \
        gdn_gates_impl<T>(src, rows, src_width, b_col, a_col, dt_bias, neg_a, n, beta, g);                          \
    }                                                                                                                \
    extern "C" __global__ void sigmoid_mul_##S(T* x, const T* gate, u64 n) { sigmoid_mul_impl<T>(x, gate, n); }     \
    extern "C" __global__ void swiglu_split_##S(const T* x, T* out, u64 rows, int inter) {                          \
        swiglu_split_impl<T>(x, out, rows, inter);                                                                  \
    }                                                                                                                \
    extern "C" __global__ void add_bias_##S(T* x, const float* bias, u64 n, int dim) {                              \
        add_bias_impl<T>(x, bias, n, dim);                                                                          \
    }                                                                                                                \
    extern "C" __global__ void embed_rows_f32_##S(const T* table, const int* ids, float* out, int dim,              \
                                                  long long vocab_start, long long local_rows) {                    \
        embed_rows_f32_impl<T>(table, ids, out, dim, vocab_start, local_rows);                                      \
    }                                                                                                                \
    extern "C" __global__ void moe_finish_##S(const T* routed, const float* shared, const float* gate, float* out,  \
                                              u64 n, int dim) {                                                     \
        moe_finish_impl<T>(routed, shared, gate, out, n, dim);                                                      \
    }                                                                                                                \
    extern "C" __global__ void gated_sq_sums_##S(const T* y, const T* z, float* sums, int di, int first, int gs,    \
                                                 int ng) {                                                          \
        gated_sq_sums_impl<T>(y, z, sums, di, first, gs, ng);                                                       \
    }                                                                                                                \
    extern "C" __global__ void gated_norm_apply_##S(const T* y, const T* z, const float* sums, const T* w, T* out,  \
                                                    u64 rows, int di, int first, int gs, int ng, float eps) {       \
        gated_norm_apply_impl<T>(y, z, sums, w, out, rows, di, first, gs, ng, eps);                                 \
    }
GLUE(float, f32)
GLUE(bf16, bf16)
