// Input-replay steps for a batch of sequences, each in its own form (kernels/src/cpu/replay_mamba2.rs,
// kernels/src/cpu/replay_gdn.rs): the CPU twins are replay_decode, verify_replay, flush and compress.
//
// Every row b of a launch appends its t tokens (t = 1: a decode; t > 1: a verify's drafts or a kv-only prompt piece;
// t = 0: a fold alone) after its h committed ring entries and reads their outputs from its checkpoint and ring without
// materialising a state. What differs between rows is data, in meta[b * 8 + ...] (see ReplayRow in ops/replay.rs):
//   0 slot        state / ring slot (out of range: NaN outputs, nothing written)
//   1 ring_start  physical row of logical entry 0
//   2 ring_len    h, committed entries
//   3 ring_cap    the slot's logical capacity (kv-only rings are longer); physical row of j = (start + j) % cap
//   4 fold        F: after the readout, the checkpoint becomes the state after logical entries 0 .. F − 1
//                 (0: the checkpoint is not written; h + 1 for a decode's flush, h for a verify's, h for a compress)
//   5 read_state  1: the checkpoint holds the state before entry 0; 0: a zero state (kv-only), never read
//   6 conv_head   physical row of the oldest conv history row (conv1d_ring)
// The host moves the counters afterwards (commit: len += accepted; fold: start += F, len −= F), so a launch never
// changes where another row's entries are. Entries j ≥ h (the step's own) are read from the inputs, never from the
// ring they are appended to, so blocks of one row can run in any order.

#define RP_META 8
#define RP_TMAX 16
#define RP_MAX_PER_LANE 8

__device__ __forceinline__ int rp_phys(int start, int j, int cap) { return (start + j) % cap; }

// Whether a row's counters describe a valid step; a bad row gets NaN outputs and writes nothing.
__device__ __forceinline__ bool rp_valid(const int* m, int num_slots, int ring_rows, int t) {
    const int slot = m[0], start = m[1], h = m[2], cap = m[3], fold = m[4];
    return slot >= 0 && slot < num_slots && cap > 0 && cap <= ring_rows && start >= 0 && start < cap && h >= 0 &&
           h + t <= cap && fold >= 0 && fold <= h + t;
}

// Mamba-2 (ReplaySSM Alg. 2 / 4 and the fold). Per row b and head hd (group g), with m = h + t entries:
//   y_s = exp(seg(−1, h+s))·(S0·C_s) + Σ_{j ≤ h+s} dt_j·exp(seg(j, h+s))·(B_j·C_s)·x_j + D·x_s,
//   seg(i, p) = Σ_{i<r≤p} dt_r·A, accumulated backward from the query so only non-positive numbers are exponentiated.
// Pools: state [slots, heads, head_dim, state_dim] f32; ring_x [slots, R, heads, head_dim]; ring_dt [slots, R, heads]
// f32; ring_b [slots, R, groups, state_dim]. Inputs x [batch, t, heads, head_dim], dt [batch, t, heads],
// B, C [batch, t, groups, state_dim]; y as x. Grid (heads, batch); shared memory sized by the host for max_m.
template <typename T>
__device__ void mamba2_replay_impl(float* __restrict__ state_pool, T* __restrict__ ring_x, float* __restrict__ ring_dt,
                                   T* __restrict__ ring_b, const int* __restrict__ meta, int num_slots, int ring_rows,
                                   const T* __restrict__ x, const float* __restrict__ dt, const float* __restrict__ A,
                                   const T* __restrict__ B, const T* __restrict__ C, const float* __restrict__ D,
                                   T* __restrict__ y, int t, int heads, int head_dim, int state_dim, int groups,
                                   int max_m) {
    extern __shared__ float smem[];
    const int hd = blockIdx.x;
    const int b = blockIdx.y;
    const int hpg = heads / groups;
    const int g = hd / hpg;
    const int p = head_dim, n = state_dim;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int* mt = meta + (u64)b * RP_META;
    if (!rp_valid(mt, num_slots, ring_rows, t) || mt[2] + t > max_m) {
        for (int i = threadIdx.x; i < t * p; i += blockDim.x) {
            const int s = i / p;
            y[(((u64)b * t + s) * heads + hd) * p + (i % p)] = from_f32<T>(nan_f32());
        }
        return;
    }
    const int slot = mt[0], start = mt[1], h = mt[2], cap = mt[3], fold = mt[4], rs = mt[5];
    const int m = h + t;
    float* Bs = smem;                 // [max_m, n]
    float* Xs = Bs + max_m * n;       // [max_m, p]
    float* Cs = Xs + max_m * p;       // [t, n]
    float* dts = Cs + t * n;          // [max_m]
    float* w = dts + max_m;           // [t, max_m]
    float* coef = w + t * max_m;      // [max_m]
    float* decay = coef + max_m;      // [t]
    float* total = decay + t;         // [1]
    const u64 ring_row = (u64)slot * ring_rows;
    for (int idx = threadIdx.x; idx < m * n; idx += blockDim.x) {
        const int j = idx / n, c = idx % n;
        Bs[idx] = j < h ? to_f32(ring_b[((ring_row + rp_phys(start, j, cap)) * groups + g) * n + c])
                        : to_f32(B[(((u64)b * t + (j - h)) * groups + g) * n + c]);
    }
    for (int idx = threadIdx.x; idx < m * p; idx += blockDim.x) {
        const int j = idx / p, i = idx % p;
        Xs[idx] = j < h ? to_f32(ring_x[((ring_row + rp_phys(start, j, cap)) * heads + hd) * p + i])
                        : to_f32(x[(((u64)b * t + (j - h)) * heads + hd) * p + i]);
    }
    for (int j = threadIdx.x; j < m; j += blockDim.x) {
        dts[j] = j < h ? ring_dt[(ring_row + rp_phys(start, j, cap)) * heads + hd] : dt[((u64)b * t + (j - h)) * heads + hd];
    }
    for (int idx = threadIdx.x; idx < t * n; idx += blockDim.x) {
        const int s = idx / n, c = idx % n;
        Cs[idx] = to_f32(C[(((u64)b * t + s) * groups + g) * n + c]);
    }
    __syncthreads();
    // The §5.4 products B_j·C_s, one warp per (s, j) with j ≤ h + s.
    for (int pr = warp; pr < t * m; pr += warps) {
        const int s = pr / m, j = pr % m;
        float acc = 0.0f;
        if (j <= h + s) {
            for (int c = lane; c < n; c += 32) {
                acc += Bs[j * n + c] * Cs[s * n + c];
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            w[s * max_m + j] = acc;
        }
    }
    __syncthreads();
    const float a = A[hd];
    if (threadIdx.x < t) {
        const int s = threadIdx.x;
        float seg = 0.0f;
        for (int j = h + s; j >= 0; --j) {
            w[s * max_m + j] *= dts[j] * expf(seg);
            seg += dts[j] * a;
        }
        decay[s] = expf(seg);
    }
    if (threadIdx.x == blockDim.x - 1) {
        float seg = 0.0f;
        for (int j = fold - 1; j >= 0; --j) {
            coef[j] = dts[j] * expf(seg);
            seg += dts[j] * a;
        }
        total[0] = expf(seg);
    }
    __syncthreads();
    const float dskip = D[hd];
    float* S = state_pool + ((u64)slot * heads + hd) * p * n;
    for (int i = warp; i < p; i += warps) {
        float s0[RP_MAX_PER_LANE];
#pragma unroll
        for (int k = 0; k < RP_MAX_PER_LANE; ++k) {
            const int c = lane + 32 * k;
            s0[k] = (rs && c < n) ? S[(u64)i * n + c] : 0.0f;
        }
        for (int s = 0; s < t; ++s) {
            float ck = 0.0f;
#pragma unroll
            for (int k = 0; k < RP_MAX_PER_LANE; ++k) {
                const int c = lane + 32 * k;
                if (c < n) {
                    ck += s0[k] * Cs[s * n + c];
                }
            }
            float acc = 0.0f;
            for (int j = lane; j <= h + s; j += 32) {
                acc += w[s * max_m + j] * Xs[j * p + i];
            }
            const float total_s = warp_sum(decay[s] * ck + acc);
            if (lane == 0) {
                y[(((u64)b * t + s) * heads + hd) * p + i] = from_f32<T>(total_s + dskip * Xs[(h + s) * p + i]);
            }
        }
        if (fold > 0) {
            const float keep = total[0];
#pragma unroll
            for (int k = 0; k < RP_MAX_PER_LANE; ++k) {
                const int c = lane + 32 * k;
                if (c < n) {
                    float v = rs ? keep * s0[k] : 0.0f;
                    for (int j = 0; j < fold; ++j) {
                        v += coef[j] * Xs[j * p + i] * Bs[j * n + c];
                    }
                    S[(u64)i * n + c] = v;
                }
            }
        }
    }
    // The step's own entries, after every read of the ring above (other blocks read only entries j < h).
    for (int idx = threadIdx.x; idx < t * p; idx += blockDim.x) {
        const int s = idx / p, i = idx % p;
        const u64 r = ring_row + rp_phys(start, h + s, cap);
        ring_x[(r * heads + hd) * p + i] = x[(((u64)b * t + s) * heads + hd) * p + i];
    }
    for (int s = threadIdx.x; s < t; s += blockDim.x) {
        ring_dt[(ring_row + rp_phys(start, h + s, cap)) * heads + hd] = dts[h + s];
    }
    if (hd % hpg == 0) {
        for (int idx = threadIdx.x; idx < t * n; idx += blockDim.x) {
            const int s = idx / n, c = idx % n;
            const u64 r = ring_row + rp_phys(start, h + s, cap);
            ring_b[(r * groups + g) * n + c] = B[(((u64)b * t + s) * groups + g) * n + c];
        }
    }
}

// Gated DeltaNet (ReplaySSM Alg. 6 / 8 and the fold). Per row b and value head hd (key head kh), the ring caches
// (u, k, g) with u the corrected value. With S_h = D_h·S0 + Σ_{j<h} w_j u_j k_jᵀ (w_j = Π_{j<i<h} e^{g_i}),
// G_s = Σ_{i≤s} g_{h+i} over the step's tokens, A[s, s'] = β_s e^{G_s − G_s'} (k_s·k_s') for s' < s and
// R_s = β_s (v_s − e^{G_s} S_h k_s): U solves (I + A) U = R by forward substitution, and
// y_s = e^{G_s} S_h q_s + Σ_{s' ≤ s} e^{G_s − G_s'} (k_s'·q_s) U_s'. S_h is never built: S_h k_s and S_h q_s come
// from the checkpoint's products and the ring's key products. Pools: state [slots, v_heads, v_dim, k_dim] f32;
// ring_u [slots, R, v_heads, v_dim]; ring_k [slots, R, k_heads, k_dim]; ring_g [slots, R, v_heads] f32. Inputs q, k
// [batch, t, k_heads, k_dim] (normalised, q scaled); v, out [batch, t, v_heads, v_dim]; g, beta [batch, t, v_heads].
template <typename T>
__device__ void gdn_replay_impl(float* __restrict__ state_pool, T* __restrict__ ring_u, T* __restrict__ ring_k,
                                float* __restrict__ ring_g, const int* __restrict__ meta, int num_slots, int ring_rows,
                                const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                const float* __restrict__ g, const float* __restrict__ beta, T* __restrict__ out,
                                int t, int k_heads, int v_heads, int k_dim, int v_dim, int max_m) {
    extern __shared__ float smem[];
    const int hd = blockIdx.x;
    const int b = blockIdx.y;
    const int per_key = v_heads / k_heads;
    const int kh = hd / per_key;
    const int dk = k_dim, dv = v_dim;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int* mt = meta + (u64)b * RP_META;
    if (!rp_valid(mt, num_slots, ring_rows, t) || mt[2] + t > max_m) {
        for (int i = threadIdx.x; i < t * dv; i += blockDim.x) {
            const int s = i / dv;
            out[(((u64)b * t + s) * v_heads + hd) * dv + (i % dv)] = from_f32<T>(nan_f32());
        }
        return;
    }
    const int slot = mt[0], start = mt[1], h = mt[2], cap = mt[3], fold = mt[4], rs = mt[5];
    const int m = h + t;
    float* Ks = smem;                 // [max_m, dk]
    float* Qs = Ks + max_m * dk;      // [t, dk]
    float* gs = Qs + t * dk;          // [max_m]
    float* kk = gs + max_m;           // [max_m, t]: K_j·k_s
    float* kq = kk + max_m * t;       // [max_m, t]: K_j·q_s
    float* wh = kq + max_m * t;       // [max_m]: decay from entry j to h
    float* coef = wh + max_m;         // [max_m]: decay from entry j to F
    float* Us = coef + max_m;         // [t, dv]
    float* s0k = Us + t * dv;         // [t, dv]
    float* s0q = s0k + t * dv;        // [t, dv]
    float* Am = s0q + t * dv;         // [t, t]
    float* Ew = Am + t * t;           // [t, t]: e^{G_s − G_s'}
    float* Es = Ew + t * t;           // [t]: e^{G_s}
    float* bt = Es + t;               // [t]
    float* sc = bt + t;               // [2]: D_h, D_F
    const u64 ring_row = (u64)slot * ring_rows;
    for (int idx = threadIdx.x; idx < m * dk; idx += blockDim.x) {
        const int j = idx / dk, c = idx % dk;
        Ks[idx] = j < h ? to_f32(ring_k[((ring_row + rp_phys(start, j, cap)) * k_heads + kh) * dk + c])
                        : to_f32(k[(((u64)b * t + (j - h)) * k_heads + kh) * dk + c]);
    }
    for (int idx = threadIdx.x; idx < t * dk; idx += blockDim.x) {
        const int s = idx / dk, c = idx % dk;
        Qs[idx] = to_f32(q[(((u64)b * t + s) * k_heads + kh) * dk + c]);
    }
    for (int j = threadIdx.x; j < m; j += blockDim.x) {
        gs[j] = j < h ? ring_g[(ring_row + rp_phys(start, j, cap)) * v_heads + hd] : g[((u64)b * t + (j - h)) * v_heads + hd];
    }
    for (int s = threadIdx.x; s < t; s += blockDim.x) {
        bt[s] = beta[((u64)b * t + s) * v_heads + hd];
    }
    __syncthreads();
    for (int pr = warp; pr < m * t; pr += warps) {
        const int j = pr / t, s = pr % t;
        float a1 = 0.0f, a2 = 0.0f;
        for (int c = lane; c < dk; c += 32) {
            a1 += Ks[j * dk + c] * Ks[(h + s) * dk + c];
            a2 += Ks[j * dk + c] * Qs[s * dk + c];
        }
        a1 = warp_sum(a1);
        a2 = warp_sum(a2);
        if (lane == 0) {
            kk[j * t + s] = a1;
            kq[j * t + s] = a2;
        }
    }
    if (threadIdx.x == 0) {
        float seg = 0.0f;
        for (int j = h - 1; j >= 0; --j) {
            wh[j] = expf(seg);
            seg += gs[j];
        }
        sc[0] = expf(seg);
    }
    if (threadIdx.x == 32 % blockDim.x) {
        float seg = 0.0f;
        for (int j = fold - 1; j >= 0; --j) {
            coef[j] = expf(seg);
            seg += gs[j];
        }
        sc[1] = expf(seg);
    }
    __syncthreads();
    // e^{G_s − G_s'} as the exponential of the gates between them (never a difference of sums); needs kk above.
    for (int pr = threadIdx.x; pr < t * t; pr += blockDim.x) {
        const int s = pr / t, s2 = pr % t;
        float seg = 0.0f;
        for (int i = s2 + 1; i <= s; ++i) {
            seg += gs[h + i];
        }
        Ew[pr] = s2 <= s ? expf(seg) : 0.0f;
        Am[pr] = s2 < s ? bt[s] * expf(seg) * kk[(h + s2) * t + s] : 0.0f;
    }
    for (int s = threadIdx.x; s < t; s += blockDim.x) {
        float seg = 0.0f;
        for (int i = 0; i <= s; ++i) {
            seg += gs[h + i];
        }
        Es[s] = expf(seg);
    }
    float* S = state_pool + ((u64)slot * v_heads + hd) * dv * dk;
    // The checkpoint's products, one warp per state row.
    for (int r = warp; r < dv; r += warps) {
        float row[RP_MAX_PER_LANE];
#pragma unroll
        for (int kx = 0; kx < RP_MAX_PER_LANE; ++kx) {
            const int c = lane + 32 * kx;
            row[kx] = (rs && c < dk) ? S[(u64)r * dk + c] : 0.0f;
        }
        for (int s = 0; s < t; ++s) {
            float a1 = 0.0f, a2 = 0.0f;
#pragma unroll
            for (int kx = 0; kx < RP_MAX_PER_LANE; ++kx) {
                const int c = lane + 32 * kx;
                if (c < dk) {
                    a1 += row[kx] * Ks[(h + s) * dk + c];
                    a2 += row[kx] * Qs[s * dk + c];
                }
            }
            a1 = warp_sum(a1);
            a2 = warp_sum(a2);
            if (lane == 0) {
                s0k[s * dv + r] = a1;
                s0q[s * dv + r] = a2;
            }
        }
    }
    __syncthreads();
    const float dh = sc[0];
    // One thread per value row: S_h k_s, S_h q_s from the ring, then the triangular solve and the outputs.
    for (int r = threadIdx.x; r < dv; r += blockDim.x) {
        float sk[RP_TMAX], sq[RP_TMAX], uu[RP_TMAX];
#pragma unroll
        for (int s = 0; s < RP_TMAX; ++s) {
            sk[s] = s < t ? dh * s0k[s * dv + r] : 0.0f;
            sq[s] = s < t ? dh * s0q[s * dv + r] : 0.0f;
        }
        for (int j = 0; j < h; ++j) {
            const float uj = wh[j] * to_f32(ring_u[((ring_row + rp_phys(start, j, cap)) * v_heads + hd) * dv + r]);
#pragma unroll
            for (int s = 0; s < RP_TMAX; ++s) {
                if (s < t) {
                    sk[s] += uj * kk[j * t + s];
                    sq[s] += uj * kq[j * t + s];
                }
            }
        }
#pragma unroll
        for (int s = 0; s < RP_TMAX; ++s) {
            if (s < t) {
                const float vs = to_f32(v[(((u64)b * t + s) * v_heads + hd) * dv + r]);
                float us = bt[s] * (vs - Es[s] * sk[s]);
                for (int s2 = 0; s2 < s; ++s2) {
                    us -= Am[s * t + s2] * uu[s2];
                }
                uu[s] = us;
                float ys = Es[s] * sq[s];
                for (int s2 = 0; s2 <= s; ++s2) {
                    ys += Ew[s * t + s2] * kq[(h + s2) * t + s] * uu[s2];
                }
                out[(((u64)b * t + s) * v_heads + hd) * dv + r] = from_f32<T>(ys);
                Us[s * dv + r] = us;
            }
        }
    }
    __syncthreads();
    if (fold > 0) {
        const float keep = sc[1];
        for (int r = warp; r < dv; r += warps) {
#pragma unroll
            for (int kx = 0; kx < RP_MAX_PER_LANE; ++kx) {
                const int c = lane + 32 * kx;
                if (c < dk) {
                    float val = rs ? keep * S[(u64)r * dk + c] : 0.0f;
                    for (int j = 0; j < fold; ++j) {
                        const float uj = j < h
                            ? to_f32(ring_u[((ring_row + rp_phys(start, j, cap)) * v_heads + hd) * dv + r])
                            : Us[(j - h) * dv + r];
                        val += coef[j] * uj * Ks[j * dk + c];
                    }
                    S[(u64)r * dk + c] = val;
                }
            }
        }
    }
    // The step's own entries, after every read of the ring above.
    for (int idx = threadIdx.x; idx < t * dv; idx += blockDim.x) {
        const int s = idx / dv, r = idx % dv;
        ring_u[((ring_row + rp_phys(start, h + s, cap)) * v_heads + hd) * dv + r] = from_f32<T>(Us[idx]);
    }
    for (int s = threadIdx.x; s < t; s += blockDim.x) {
        ring_g[(ring_row + rp_phys(start, h + s, cap)) * v_heads + hd] = gs[h + s];
    }
    if (hd % per_key == 0) {
        for (int idx = threadIdx.x; idx < t * dk; idx += blockDim.x) {
            const int s = idx / dk, c = idx % dk;
            const u64 rr = ring_row + rp_phys(start, h + s, cap);
            ring_k[(rr * k_heads + kh) * dk + c] = k[(((u64)b * t + s) * k_heads + kh) * dk + c];
        }
    }
}

#define REPLAY(T, S)                                                                                                   \
    extern "C" __global__ void mamba2_replay_##S(float* state_pool, T* ring_x, float* ring_dt, T* ring_b,              \
                                                 const int* meta, int num_slots, int ring_rows, const T* x,            \
                                                 const float* dt, const float* A, const T* B, const T* C,              \
                                                 const float* D, T* y, int t, int heads, int head_dim, int state_dim,  \
                                                 int groups, int max_m) {                                              \
        mamba2_replay_impl<T>(state_pool, ring_x, ring_dt, ring_b, meta, num_slots, ring_rows, x, dt, A, B, C, D, y, t, \
                              heads, head_dim, state_dim, groups, max_m);                                              \
    }                                                                                                                  \
    extern "C" __global__ void gdn_replay_##S(float* state_pool, T* ring_u, T* ring_k, float* ring_g, const int* meta, \
                                              int num_slots, int ring_rows, const T* q, const T* k, const T* v,        \
                                              const float* g, const float* beta, T* out, int t, int k_heads,           \
                                              int v_heads, int k_dim, int v_dim, int max_m) {                          \
        gdn_replay_impl<T>(state_pool, ring_u, ring_k, ring_g, meta, num_slots, ring_rows, q, k, v, g, beta, out, t,   \
                           k_heads, v_heads, k_dim, v_dim, max_m);                                                     \
    }
REPLAY(float, f32)
REPLAY(bf16, bf16)
