// The Mamba-2 chunked (SSD) prefill scan for one sequence (kernels/src/cpu/mamba2.rs::mamba2_chunked), in three
// launches:
//   1. ssd_chunk_state (grid chunks × heads): each chunk's own contribution to the state,
//      dS_c = Σ_s dt_s·exp(seg(L−1, s))·x_s ⊗ B_s, and its total decay exp(Σ a_r), into the workspace;
//   2. ssd_state_scan (grid-stride over heads · P · N): the short sequential pass over chunks, replacing each dS_c by
//      the state entering chunk c and leaving the final state in `state`;
//   3. ssd_chunk_out (grid chunks × heads): y_t = Σ_{s≤t} exp(seg(t,s))·(C_t·B_s)·dt_s·x_s
//      + exp(seg(t,−1))·S_c·C_t + D·x_t.
// Every exponent is a sum of a_r = dt_r·A ≤ 0 over a span inside one chunk, accumulated directly (not as a difference of
// prefix sums), as the CPU twin does. x, y: [seq, heads, P]; dt: [seq, heads] f32; A, D: [heads] f32; B, C:
// [seq, groups, N]; state [heads, P, N] f32; workspace: states [chunks, heads, P, N] then decays [chunks, heads].

#define SSD_MAX_CHUNK 64

template <typename T>
__device__ void ssd_chunk_state_impl(const T* __restrict__ x, const float* __restrict__ dt, const float* __restrict__ A,
                                     const T* __restrict__ B, float* __restrict__ ws, float* __restrict__ decay,
                                     int seq, int heads, int P, int N, int groups, int chunk) {
    __shared__ float adt[SSD_MAX_CHUNK];
    __shared__ float w[SSD_MAX_CHUNK];
    const int c = blockIdx.x;
    const int h = blockIdx.y;
    const int t0 = c * chunk;
    const int L = min(chunk, seq - t0);
    const int g = h / (heads / groups);
    for (int s = threadIdx.x; s < L; s += blockDim.x) {
        adt[s] = dt[(u64)(t0 + s) * heads + h] * A[h];
    }
    __syncthreads();
    for (int s = threadIdx.x; s < L; s += blockDim.x) {
        float seg = 0.0f;
        for (int r = L - 1; r > s; --r) {
            seg += adt[r];
        }
        w[s] = dt[(u64)(t0 + s) * heads + h] * expf(seg);
    }
    if (threadIdx.x == 0) {
        float tot = 0.0f;
        for (int r = L - 1; r >= 0; --r) {
            tot += adt[r];
        }
        decay[(u64)c * heads + h] = expf(tot);
    }
    __syncthreads();
    float* out = ws + ((u64)c * heads + h) * P * N;
    for (int e = threadIdx.x; e < P * N; e += blockDim.x) {
        const int p = e / N;
        const int n = e - p * N;
        float acc = 0.0f;
        for (int s = 0; s < L; ++s) {
            const float xs = to_f32(x[((u64)(t0 + s) * heads + h) * P + p]) * w[s];
            acc += xs * to_f32(B[((u64)(t0 + s) * groups + g) * N + n]);
        }
        out[e] = acc;
    }
}

// Storage-independent; declared once per storage type so that the module's kernels all come in both.
__device__ void ssd_state_scan_impl(float* __restrict__ state, float* __restrict__ ws, const float* __restrict__ decay,
                                    int chunks, int heads, int per_head) {
    const u64 total = (u64)heads * per_head;
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < total; e += (u64)gridDim.x * blockDim.x) {
        const int h = (int)(e / per_head);
        float s = state[e];
        for (int c = 0; c < chunks; ++c) {
            const u64 i = (u64)c * total + e;
            const float d = ws[i];
            ws[i] = s;
            s = decay[(u64)c * heads + h] * s + d;
        }
        state[e] = s;
    }
}

template <typename T>
__device__ void ssd_chunk_out_impl(const T* __restrict__ x, const float* __restrict__ dt, const float* __restrict__ A,
                                   const T* __restrict__ B, const T* __restrict__ C, const float* __restrict__ D,
                                   const float* __restrict__ ws, T* __restrict__ y, int seq, int heads, int P, int N,
                                   int groups, int chunk) {
    __shared__ float m[SSD_MAX_CHUNK * SSD_MAX_CHUNK];
    __shared__ float adt[SSD_MAX_CHUNK];
    __shared__ float fs[SSD_MAX_CHUNK];
    const int c = blockIdx.x;
    const int h = blockIdx.y;
    const int t0 = c * chunk;
    const int L = min(chunk, seq - t0);
    const int g = h / (heads / groups);
    for (int s = threadIdx.x; s < L; s += blockDim.x) {
        adt[s] = dt[(u64)(t0 + s) * heads + h] * A[h];
    }
    __syncthreads();
    for (int s = threadIdx.x; s < L; s += blockDim.x) {
        float seg = 0.0f;
        for (int r = s; r >= 0; --r) {
            seg += adt[r];
        }
        fs[s] = expf(seg);
    }
    for (int pair = threadIdx.x; pair < L * L; pair += blockDim.x) {
        const int t = pair / L;
        const int s = pair - t * L;
        float v = 0.0f;
        if (s <= t) {
            float seg = 0.0f;
            for (int r = t; r > s; --r) {
                seg += adt[r];
            }
            const T* cr = C + ((u64)(t0 + t) * groups + g) * N;
            const T* br = B + ((u64)(t0 + s) * groups + g) * N;
            float cb = 0.0f;
            for (int n = 0; n < N; ++n) {
                cb += to_f32(cr[n]) * to_f32(br[n]);
            }
            v = cb * expf(seg) * dt[(u64)(t0 + s) * heads + h];
        }
        m[t * L + s] = v;
    }
    __syncthreads();
    const float* S = ws + ((u64)c * heads + h) * P * N;
    const float dskip = D[h];
    for (int e = threadIdx.x; e < L * P; e += blockDim.x) {
        const int t = e / P;
        const int p = e - t * P;
        float acc = 0.0f;
        for (int s = 0; s <= t; ++s) {
            acc += m[t * L + s] * to_f32(x[((u64)(t0 + s) * heads + h) * P + p]);
        }
        const T* cr = C + ((u64)(t0 + t) * groups + g) * N;
        const float* sr = S + (u64)p * N;
        float off = 0.0f;
        for (int n = 0; n < N; ++n) {
            off += to_f32(cr[n]) * sr[n];
        }
        const u64 xo = ((u64)(t0 + t) * heads + h) * P + p;
        y[xo] = from_f32<T>(acc + fs[t] * off + dskip * to_f32(x[xo]));
    }
}

#define SSD(T, S)                                                                                                  \
    extern "C" __global__ void ssd_chunk_state_##S(const T* x, const float* dt, const float* A, const T* B,        \
                                                   float* ws, float* decay, int seq, int heads, int P, int N,      \
                                                   int groups, int chunk) {                                        \
        ssd_chunk_state_impl<T>(x, dt, A, B, ws, decay, seq, heads, P, N, groups, chunk);                          \
    }                                                                                                              \
    extern "C" __global__ void ssd_chunk_out_##S(const T* x, const float* dt, const float* A, const T* B,          \
                                                 const T* C, const float* D, const float* ws, T* y, int seq,       \
                                                 int heads, int P, int N, int groups, int chunk) {                 \
        ssd_chunk_out_impl<T>(x, dt, A, B, C, D, ws, y, seq, heads, P, N, groups, chunk);                          \
    }                                                                                                              \
    extern "C" __global__ void ssd_state_scan_##S(float* state, float* ws, const float* decay, int chunks,         \
                                                  int heads, int per_head) {                                       \
        ssd_state_scan_impl(state, ws, decay, chunks, heads, per_head);                                            \
    }
SSD(float, f32)
SSD(bf16, bf16)
