// The chunked gated delta rule for one sequence (kernels/src/cpu/gdn.rs::gdn_chunked, the WY / UT form), in two
// launches:
//   1. gdn_chunk_prep (grid chunks × v_heads), independent of the state: with Γ[i,j] = exp(g_{j+1} + … + g_i) and
//      γ_i = exp(g_0 + … + g_i), T = (I + tril(diag(β) K Kᵀ ⊙ Γ, −1))⁻¹ by forward substitution, then
//      U = T·diag(β)·V and W = T·diag(β γ)·K, and the masked scores Q Kᵀ ⊙ tril(Γ), into the workspace;
//   2. gdn_chunk_scan (grid ceil(v_dim / 4) × v_heads, a warp per state row): the rows of S [v_dim, k_dim] evolve
//      independently, so each warp walks the chunks in order with its row in registers:
//      V' = U − W Sᵀ, O = diag(γ) Q Sᵀ + (Q Kᵀ ⊙ Γ) V', S ← γ_{C−1} S + V'ᵀ diag(Γ[C−1, ·]) K.
// q, k: [seq, k_heads, k_dim] (L2-normalised, q scaled); v, out: [seq, v_heads, v_dim]; g, beta: [seq, v_heads] f32;
// state [v_heads, v_dim, k_dim] f32. Workspace: U [seq, v_heads, v_dim], W [seq, v_heads, k_dim],
// scores [chunks, v_heads, C, C], all f32.

#define GDN_MAX_CHUNK 64
#define GDN_CHUNK_MAX_PER_LANE 8

template <typename T>
__device__ void gdn_chunk_prep_impl(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                    const float* __restrict__ g, const float* __restrict__ beta,
                                    float* __restrict__ u_ws, float* __restrict__ w_ws, float* __restrict__ s_ws,
                                    int seq, int k_heads, int v_heads, int k_dim, int v_dim, int chunk) {
    __shared__ float a[GDN_MAX_CHUNK * GDN_MAX_CHUNK];
    __shared__ float tm[GDN_MAX_CHUNK * GDN_MAX_CHUNK];
    __shared__ float gs[GDN_MAX_CHUNK];
    __shared__ float bs[GDN_MAX_CHUNK];
    __shared__ float fx[GDN_MAX_CHUNK];
    const int c = blockIdx.x;
    const int h = blockIdx.y;
    const int kh = h / (v_heads / k_heads);
    const int t0 = c * chunk;
    const int L = min(chunk, seq - t0);
    for (int i = threadIdx.x; i < L; i += blockDim.x) {
        gs[i] = g[(u64)(t0 + i) * v_heads + h];
        bs[i] = beta[(u64)(t0 + i) * v_heads + h];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float acc = 0.0f;
        for (int i = 0; i < L; ++i) {
            acc += gs[i];
            fx[i] = expf(acc);
        }
    }
    float* scores = s_ws + ((u64)c * v_heads + h) * chunk * chunk;
    for (int pair = threadIdx.x; pair < L * L; pair += blockDim.x) {
        const int i = pair / L;
        const int j = pair - i * L;
        float av = 0.0f, sv = 0.0f;
        if (j <= i) {
            float span = 0.0f;
            for (int r = i; r > j; --r) {
                span += gs[r];
            }
            const float decay = expf(span);
            const T* ki = k + ((u64)(t0 + i) * k_heads + kh) * k_dim;
            const T* qi = q + ((u64)(t0 + i) * k_heads + kh) * k_dim;
            const T* kj = k + ((u64)(t0 + j) * k_heads + kh) * k_dim;
            float kk = 0.0f, qk = 0.0f;
            for (int d = 0; d < k_dim; ++d) {
                const float kjd = to_f32(kj[d]);
                kk += to_f32(ki[d]) * kjd;
                qk += to_f32(qi[d]) * kjd;
            }
            if (j < i) {
                av = kk * (bs[i] * decay);
            }
            sv = qk * decay;
        }
        a[i * L + j] = av;
        scores[i * L + j] = sv;
    }
    __syncthreads();
    // Forward substitution, one row at a time: T[i, m] = δ_im − Σ_{m≤j<i} A[i, j]·T[j, m].
    for (int i = 0; i < L; ++i) {
        for (int mcol = threadIdx.x; mcol < L; mcol += blockDim.x) {
            float val = mcol == i ? 1.0f : 0.0f;
            if (mcol < i) {
                for (int j = mcol; j < i; ++j) {
                    val -= a[i * L + j] * tm[j * L + mcol];
                }
            }
            tm[i * L + mcol] = val;
        }
        __syncthreads();
    }
    for (int e = threadIdx.x; e < L * v_dim; e += blockDim.x) {
        const int i = e / v_dim;
        const int d = e - i * v_dim;
        float acc = 0.0f;
        for (int j = 0; j <= i; ++j) {
            acc += tm[i * L + j] * (bs[j] * to_f32(v[((u64)(t0 + j) * v_heads + h) * v_dim + d]));
        }
        u_ws[((u64)(t0 + i) * v_heads + h) * v_dim + d] = acc;
    }
    for (int e = threadIdx.x; e < L * k_dim; e += blockDim.x) {
        const int i = e / k_dim;
        const int d = e - i * k_dim;
        float acc = 0.0f;
        for (int j = 0; j <= i; ++j) {
            acc += tm[i * L + j] * ((bs[j] * fx[j]) * to_f32(k[((u64)(t0 + j) * k_heads + kh) * k_dim + d]));
        }
        w_ws[((u64)(t0 + i) * v_heads + h) * k_dim + d] = acc;
    }
}

template <typename T>
__device__ void gdn_chunk_scan_impl(const T* __restrict__ q, const T* __restrict__ k, const float* __restrict__ g,
                                    const float* __restrict__ u_ws, const float* __restrict__ w_ws,
                                    const float* __restrict__ s_ws, float* __restrict__ state, T* __restrict__ out,
                                    int seq, int k_heads, int v_heads, int k_dim, int v_dim, int chunk) {
    __shared__ float fx[GDN_MAX_CHUNK];
    __shared__ float ex[GDN_MAX_CHUNK];
    __shared__ float vp[4][GDN_MAX_CHUNK];
    __shared__ float qr[4][GDN_MAX_CHUNK];
    __shared__ float chunk_decay;
    const int h = blockIdx.y;
    const int kh = h / (v_heads / k_heads);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int r = blockIdx.x * 4 + warp;
    const bool active = r < v_dim;
    float* row = state + ((u64)h * v_dim + (active ? r : 0)) * k_dim;
    float s[GDN_CHUNK_MAX_PER_LANE];
#pragma unroll
    for (int j = 0; j < GDN_CHUNK_MAX_PER_LANE; ++j) {
        const int cc = lane + 32 * j;
        s[j] = (active && cc < k_dim) ? row[cc] : 0.0f;
    }
    const int chunks = (seq + chunk - 1) / chunk;
    for (int c = 0; c < chunks; ++c) {
        const int t0 = c * chunk;
        const int L = min(chunk, seq - t0);
        __syncthreads();
        if (threadIdx.x == 0) {
            float acc = 0.0f;
            for (int i = 0; i < L; ++i) {
                acc += g[(u64)(t0 + i) * v_heads + h];
                fx[i] = expf(acc);
            }
            chunk_decay = expf(acc);
            acc = 0.0f;
            for (int i = L - 1; i >= 0; --i) {
                ex[i] = expf(acc);
                acc += g[(u64)(t0 + i) * v_heads + h];
            }
        }
        __syncthreads();
        if (!active) {
            continue;
        }
        for (int i = 0; i < L; ++i) {
            const float* wr = w_ws + ((u64)(t0 + i) * v_heads + h) * k_dim;
            const T* qi = q + ((u64)(t0 + i) * k_heads + kh) * k_dim;
            float wd = 0.0f, qd = 0.0f;
#pragma unroll
            for (int j = 0; j < GDN_CHUNK_MAX_PER_LANE; ++j) {
                const int cc = lane + 32 * j;
                if (cc < k_dim) {
                    wd += wr[cc] * s[j];
                    qd += (fx[i] * to_f32(qi[cc])) * s[j];
                }
            }
            wd = warp_sum(wd);
            qd = warp_sum(qd);
            if (lane == 0) {
                vp[warp][i] = u_ws[((u64)(t0 + i) * v_heads + h) * v_dim + r] - wd;
                qr[warp][i] = qd;
            }
        }
        __syncwarp();
        const float* sc = s_ws + ((u64)c * v_heads + h) * chunk * chunk;
        for (int i = lane; i < L; i += 32) {
            float o = 0.0f;
            for (int j = 0; j <= i; ++j) {
                o += sc[i * L + j] * vp[warp][j];
            }
            out[((u64)(t0 + i) * v_heads + h) * v_dim + r] = from_f32<T>(o + qr[warp][i]);
        }
#pragma unroll
        for (int j = 0; j < GDN_CHUNK_MAX_PER_LANE; ++j) {
            const int cc = lane + 32 * j;
            if (cc < k_dim) {
                float acc = 0.0f;
                for (int i = 0; i < L; ++i) {
                    acc += vp[warp][i] * (ex[i] * to_f32(k[((u64)(t0 + i) * k_heads + kh) * k_dim + cc]));
                }
                s[j] = chunk_decay * s[j] + acc;
            }
        }
        __syncwarp();
    }
    if (active) {
#pragma unroll
        for (int j = 0; j < GDN_CHUNK_MAX_PER_LANE; ++j) {
            const int cc = lane + 32 * j;
            if (cc < k_dim) {
                row[cc] = s[j];
            }
        }
    }
}

#define GDN_CHUNK(T, S)                                                                                             \
    extern "C" __global__ void gdn_chunk_prep_##S(const T* q, const T* k, const T* v, const float* g,              \
                                                  const float* beta, float* u_ws, float* w_ws, float* s_ws,        \
                                                  int seq, int k_heads, int v_heads, int k_dim, int v_dim,         \
                                                  int chunk) {                                                     \
        gdn_chunk_prep_impl<T>(q, k, v, g, beta, u_ws, w_ws, s_ws, seq, k_heads, v_heads, k_dim, v_dim, chunk);   \
    }                                                                                                               \
    extern "C" __global__ void gdn_chunk_scan_##S(const T* q, const T* k, const float* g, const float* u_ws,       \
                                                  const float* w_ws, const float* s_ws, float* state, T* out,      \
                                                  int seq, int k_heads, int v_heads, int k_dim, int v_dim,         \
                                                  int chunk) {                                                     \
        gdn_chunk_scan_impl<T>(q, k, g, u_ws, w_ws, s_ws, state, out, seq, k_heads, v_heads, k_dim, v_dim, chunk); \
    }
GDN_CHUNK(float, f32)
GDN_CHUNK(bf16, bf16)
