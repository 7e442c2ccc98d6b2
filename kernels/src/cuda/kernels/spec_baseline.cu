// The serial speculative baseline (ReplaySSM Alg. 3 for Mamba-2, Alg. 5 / 7 for Gated DeltaNet; CPU twins
// replay_mamba2::{verify_baseline, commit_baseline} and replay_gdn::{verify_baseline, commit_baseline}): what an
// engine without input replay does to verify t drafts of a recurrent sequence. Starting from the slot's state S0 the
// recurrence runs position by position, and the state after every position is written out in full as a snapshot, so
// that a later commit of `accepted` drafts can take snapshot accepted − 1. Those t full-state writes are the
// baseline's extra traffic, kept on purpose: this is what input replay is measured against.
//
// Layouts (as the recurrent step kernels, mamba2.cu / gdn.cu): state_pool [slots, state] f32 (Mamba-2 state
// [heads, head_dim, state_dim], GDN [v_heads, v_dim, k_dim]); snapshots [slots, snap_t, state] f32, snapshot s of a
// slot after its draft s (0-based), indexed by slot like the state so that the commit, a later step with another
// batch, finds them; inputs and outputs [batch, t, ...] (row b's token s at b * t + s). Row b reads slot slots[b];
// a slot out of range gives that row NaN outputs and writes nothing.
//
// Speed: every state value is read once and each snapshot written once, 16 bytes at a time where the layout allows
// (VEC = 4: the key dim a multiple of 4 and the pools 16-byte aligned). One warp owns one state row (a head_dim row
// of Mamba-2, a v_dim row of GDN): it loads the row into registers, then for each draft updates it, writes it as that
// draft's snapshot (a coalesced 512-byte store per warp) and reduces the row's output with shuffles. The per-draft
// inputs of the block's (row, head) are staged in shared memory as f32 once. Grid (heads · splits, batch): a head's
// rows are split between `splits` blocks of SB_WARPS warps, so small batches still fill the device.

#define SB_WARPS 4

// A state row's columns held by one lane: column (j·32 + lane)·VEC + e for j < NC, e < VEC.
template <int VEC, int NC>
__device__ __forceinline__ void sb_load_row(const float* __restrict__ row, int n, int lane, float (&v)[NC][VEC]) {
#pragma unroll
    for (int j = 0; j < NC; ++j) {
        const int c = (j * 32 + lane) * VEC;
        if (VEC == 4) {
            if (c < n) {
                const float4 q = *reinterpret_cast<const float4*>(row + c);
                v[j][0] = q.x;
                v[j][1] = q.y;
                v[j][2] = q.z;
                v[j][3] = q.w;
            } else {
#pragma unroll
                for (int e = 0; e < VEC; ++e) v[j][e] = 0.0f;
            }
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) v[j][e] = c + e < n ? row[c + e] : 0.0f;
        }
    }
}

template <int VEC, int NC>
__device__ __forceinline__ void sb_store_row(float* __restrict__ row, int n, int lane, const float (&v)[NC][VEC]) {
#pragma unroll
    for (int j = 0; j < NC; ++j) {
        const int c = (j * 32 + lane) * VEC;
        if (VEC == 4) {
            if (c < n) {
                *reinterpret_cast<float4*>(row + c) = make_float4(v[j][0], v[j][1], v[j][2], v[j][3]);
            }
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                if (c + e < n) row[c + e] = v[j][e];
            }
        }
    }
}

// VEC values of a staged vector from column c, zeros past n: one 16-byte shared load when VEC = 4 (the vectors are
// staged at 16-byte aligned offsets then, n being a multiple of 4), so the 32 lanes read without bank conflicts.
template <int VEC>
__device__ __forceinline__ void sb_get(const float* __restrict__ p, int c, int n, float (&o)[VEC]) {
    if (VEC == 4) {
        float4 q = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (c < n) q = *reinterpret_cast<const float4*>(p + c);
        o[0] = q.x;
        o[1] = q.y;
        o[2] = q.z;
        o[3] = q.w;
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) o[e] = c + e < n ? p[c + e] : 0.0f;
    }
}

// This block's share of a head's rows: [r0, r1).
__device__ __forceinline__ void sb_rows(int rows, int splits, int part, int* r0, int* r1) {
    const int per = (rows + splits - 1) / splits;
    *r0 = min(rows, part * per);
    *r1 = min(rows, *r0 + per);
}

// Mamba-2, per row b, head h (B/C group h / (heads / groups)) and draft s, with dA = exp(dt·A):
//   S_s = dA·S_{s−1} + dt·x ⊗ B;  y_s = S_s·C + D·x;  snapshot s = S_s.
// Shared memory: B, C [t, state_dim], x [t, rows of the block], dt and dA [t] (f32).
template <typename T, int VEC, int NC>
__device__ void sb_mamba2_impl(const float* __restrict__ state_pool, float* __restrict__ snaps,
                               const int* __restrict__ slots, int num_slots, int snap_t, const T* __restrict__ x,
                               const float* __restrict__ dt, const float* __restrict__ A, const T* __restrict__ B,
                               const T* __restrict__ C, const float* __restrict__ D, T* __restrict__ y, int t,
                               int heads, int head_dim, int n, int groups, int splits) {
    extern __shared__ float4 sb_smem4[];
    float* smem = reinterpret_cast<float*>(sb_smem4);
    const int b = blockIdx.y;
    const int h = blockIdx.x / splits;
    int r0, r1;
    sb_rows(head_dim, splits, blockIdx.x % splits, &r0, &r1);
    const int nr = r1 - r0;
    const int g = h / (heads / groups);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int slot = slots[b];
    if (slot < 0 || slot >= num_slots) {
        for (int k = threadIdx.x; k < t * nr; k += blockDim.x) {
            const int s = k / nr, i = r0 + k % nr;
            y[(((u64)b * t + s) * heads + h) * head_dim + i] = from_f32<T>(nan_f32());
        }
        return;
    }
    float* bs = smem;
    float* cs = bs + t * n;
    float* xs = cs + t * n;
    float* dts = xs + t * nr;
    float* das = dts + t;
    for (int k = threadIdx.x; k < t * n; k += blockDim.x) {
        const int s = k / n, c = k % n;
        const u64 at = (((u64)b * t + s) * groups + g) * n + c;
        bs[k] = to_f32(B[at]);
        cs[k] = to_f32(C[at]);
    }
    for (int k = threadIdx.x; k < t * nr; k += blockDim.x) {
        const int s = k / nr, i = r0 + k % nr;
        xs[k] = to_f32(x[(((u64)b * t + s) * heads + h) * head_dim + i]);
    }
    for (int s = threadIdx.x; s < t; s += blockDim.x) {
        const float d = dt[((u64)b * t + s) * heads + h];
        dts[s] = d;
        das[s] = expf(d * A[h]);
    }
    __syncthreads();
    const u64 sl = (u64)heads * head_dim * n;
    const u64 head_at = (u64)h * head_dim * n;
    const float* S0 = state_pool + (u64)slot * sl + head_at;
    float* snap0 = snaps + (u64)slot * snap_t * sl + head_at;
    const float dskip = D[h];
    for (int i = r0 + warp; i < r1; i += SB_WARPS) {
        float v[NC][VEC];
        sb_load_row<VEC, NC>(S0 + (u64)i * n, n, lane, v);
        for (int s = 0; s < t; ++s) {
            const float xi = xs[s * nr + (i - r0)];
            const float dtx = dts[s] * xi, da = das[s];
            const float* bv = bs + s * n;
            const float* cv = cs + s * n;
            // Columns past n hold zeros and stay zero (their B and C read as zeros), so they add nothing.
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < NC; ++j) {
                float bj[VEC], cj[VEC];
                sb_get<VEC>(bv, (j * 32 + lane) * VEC, n, bj);
                sb_get<VEC>(cv, (j * 32 + lane) * VEC, n, cj);
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    v[j][e] = da * v[j][e] + dtx * bj[e];
                    acc += v[j][e] * cj[e];
                }
            }
            sb_store_row<VEC, NC>(snap0 + (u64)s * sl + (u64)i * n, n, lane, v);
            acc = warp_sum(acc);
            if (lane == 0) {
                y[(((u64)b * t + s) * heads + h) * head_dim + i] = from_f32<T>(acc + dskip * xi);
            }
        }
    }
}

// Gated DeltaNet, per row b, value head h (key head h / (v_heads / k_heads)) and draft s, row by row of the state
// (each row only meets its own channel of v):
//   S ← exp(g)·S;  u = β·(v − S k);  S ← S + u kᵀ;  o = S q;  snapshot s = S.
// Shared memory: q, k [t, k_dim], v [t, rows of the block], exp(g) and β [t] (f32).
template <typename T, int VEC, int NC>
__device__ void sb_gdn_impl(const float* __restrict__ state_pool, float* __restrict__ snaps,
                            const int* __restrict__ slots, int num_slots, int snap_t, const T* __restrict__ q,
                            const T* __restrict__ k, const T* __restrict__ v, const float* __restrict__ g,
                            const float* __restrict__ beta, T* __restrict__ out, int t, int k_heads, int v_heads,
                            int dk, int dv, int splits) {
    extern __shared__ float4 sb_smem4[];
    float* smem = reinterpret_cast<float*>(sb_smem4);
    const int b = blockIdx.y;
    const int h = blockIdx.x / splits;
    int r0, r1;
    sb_rows(dv, splits, blockIdx.x % splits, &r0, &r1);
    const int nr = r1 - r0;
    const int kh = h / (v_heads / k_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int slot = slots[b];
    if (slot < 0 || slot >= num_slots) {
        for (int i = threadIdx.x; i < t * nr; i += blockDim.x) {
            const int s = i / nr, r = r0 + i % nr;
            out[(((u64)b * t + s) * v_heads + h) * dv + r] = from_f32<T>(nan_f32());
        }
        return;
    }
    float* qs = smem;
    float* ks = qs + t * dk;
    float* vs = ks + t * dk;
    float* decays = vs + t * nr;
    float* betas = decays + t;
    for (int i = threadIdx.x; i < t * dk; i += blockDim.x) {
        const int s = i / dk, c = i % dk;
        const u64 at = (((u64)b * t + s) * k_heads + kh) * dk + c;
        qs[i] = to_f32(q[at]);
        ks[i] = to_f32(k[at]);
    }
    for (int i = threadIdx.x; i < t * nr; i += blockDim.x) {
        const int s = i / nr, r = r0 + i % nr;
        vs[i] = to_f32(v[(((u64)b * t + s) * v_heads + h) * dv + r]);
    }
    for (int s = threadIdx.x; s < t; s += blockDim.x) {
        const u64 at = ((u64)b * t + s) * v_heads + h;
        decays[s] = expf(g[at]);
        betas[s] = beta[at];
    }
    __syncthreads();
    const u64 sl = (u64)v_heads * dv * dk;
    const u64 head_at = (u64)h * dv * dk;
    const float* S0 = state_pool + (u64)slot * sl + head_at;
    float* snap0 = snaps + (u64)slot * snap_t * sl + head_at;
    for (int r = r0 + warp; r < r1; r += SB_WARPS) {
        float w[NC][VEC];
        sb_load_row<VEC, NC>(S0 + (u64)r * dk, dk, lane, w);
        for (int s = 0; s < t; ++s) {
            const float decay = decays[s];
            const float* kv = ks + s * dk;
            const float* qv = qs + s * dk;
            // Columns past dk hold zeros and stay zero (their q and k read as zeros), so they add nothing.
            float kj[NC][VEC];
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < NC; ++j) {
                sb_get<VEC>(kv, (j * 32 + lane) * VEC, dk, kj[j]);
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    w[j][e] *= decay;
                    dot += w[j][e] * kj[j][e];
                }
            }
            dot = warp_sum(dot);
            const float u = betas[s] * (vs[s * nr + (r - r0)] - dot);
            float o = 0.0f;
#pragma unroll
            for (int j = 0; j < NC; ++j) {
                float qj[VEC];
                sb_get<VEC>(qv, (j * 32 + lane) * VEC, dk, qj);
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    w[j][e] += u * kj[j][e];
                    o += w[j][e] * qj[e];
                }
            }
            sb_store_row<VEC, NC>(snap0 + (u64)s * sl + (u64)r * dk, dk, lane, w);
            o = warp_sum(o);
            if (lane == 0) {
                out[(((u64)b * t + s) * v_heads + h) * dv + r] = from_f32<T>(o);
            }
        }
    }
}

// VEC 4 with NC 2, or VEC 1 with NC 8: key dims up to 256 either way. Entry points are named in full (nvrtc.rs
// lists them).
#define SB_MAMBA2(NAME, T, VEC, NC)                                                                                \
    extern "C" __global__ void __launch_bounds__(32 * SB_WARPS)                                                    \
        NAME(const float* state_pool, float* snaps, const int* slots, int num_slots, int snap_t, const T* x,       \
             const float* dt, const float* A, const T* B, const T* C, const float* D, T* y, int t, int heads,      \
             int head_dim, int n, int groups, int splits) {                                                        \
        sb_mamba2_impl<T, VEC, NC>(state_pool, snaps, slots, num_slots, snap_t, x, dt, A, B, C, D, y, t, heads,    \
                                   head_dim, n, groups, splits);                                                   \
    }
SB_MAMBA2(spec_mamba2_verify_v4_f32, float, 4, 2)
SB_MAMBA2(spec_mamba2_verify_v4_bf16, bf16, 4, 2)
SB_MAMBA2(spec_mamba2_verify_v1_f32, float, 1, 8)
SB_MAMBA2(spec_mamba2_verify_v1_bf16, bf16, 1, 8)

#define SB_GDN(NAME, T, VEC, NC)                                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * SB_WARPS)                                                    \
        NAME(const float* state_pool, float* snaps, const int* slots, int num_slots, int snap_t, const T* q,       \
             const T* k, const T* v, const float* g, const float* beta, T* out, int t, int k_heads, int v_heads,   \
             int dk, int dv, int splits) {                                                                         \
        sb_gdn_impl<T, VEC, NC>(state_pool, snaps, slots, num_slots, snap_t, q, k, v, g, beta, out, t, k_heads,    \
                                v_heads, dk, dv, splits);                                                          \
    }
SB_GDN(spec_gdn_verify_v4_f32, float, 4, 2)
SB_GDN(spec_gdn_verify_v4_bf16, bf16, 4, 2)
SB_GDN(spec_gdn_verify_v1_f32, float, 1, 8)
SB_GDN(spec_gdn_verify_v1_bf16, bf16, 1, 8)

// The baseline's commit: per row, commits[2·row] = slot, commits[2·row + 1] = accepted; the slot's state becomes its
// snapshot accepted − 1 (a copy of one state, 16 bytes at a time when `vec`); accepted = 0 leaves it. A slot out of
// range, or an accepted count outside 0..=snap_t, writes nothing (the host checks them first). Grid (blocks, rows).
extern "C" __global__ void spec_commit(float* state_pool, const float* snaps, const int* commits, int num_slots,
                                       int snap_t, u64 state_len, int vec) {
    const int row = blockIdx.y;
    const int slot = commits[2 * row], accepted = commits[2 * row + 1];
    if (slot < 0 || slot >= num_slots || accepted <= 0 || accepted > snap_t) {
        return;
    }
    const float* src = snaps + ((u64)slot * snap_t + (accepted - 1)) * state_len;
    float* dst = state_pool + (u64)slot * state_len;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec) {
        const float4* s4 = reinterpret_cast<const float4*>(src);
        float4* d4 = reinterpret_cast<float4*>(dst);
        for (u64 i = first; i < state_len / 4; i += stride) {
            d4[i] = s4[i];
        }
    } else {
        for (u64 i = first; i < state_len; i += stride) {
            dst[i] = src[i];
        }
    }
}
