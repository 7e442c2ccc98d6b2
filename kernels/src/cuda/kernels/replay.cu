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
//
// Speed: the checkpoint is the traffic (everything else is a few KiB per head that L1 / L2 serve), so the kernels are
// shaped like the recurrent step kernels, whose warps stream state rows with no block-wide barrier. One warp owns one
// (row, head) item: a short prologue (decay weights, the §5.4 key–query products and the ring's share of each output,
// in the warp's own slice of shared memory) runs while the first rows of the checkpoint are in flight, then the warp
// streams the head's state RP_CHUNK rows at a time, loading the next chunk (16-byte loads) before it reduces the
// current one. 8 lanes share a row (a 3-step shuffle reduction); the fold writes the new checkpoint from the same
// registers, so the checkpoint is read once and written at most once. Decay sums are accumulated backward from the
// query in the CPU twin's order. When rows × heads are few (small batches) each head's rows are split between
// `splits` warps, each running the (short) prologue for itself. Grid (ceil(heads · splits / warps per block), batch);
// each warp's scratch is `scratch` floats.

#define RP_META 8
#define RP_TMAX 16
#define RP_RPW 1                  // 4-row sweeps per chunk
#define RP_CHUNK (4 * RP_RPW)     // rows per chunk

__device__ __forceinline__ int rp_phys(int start, int j, int cap) { return (start + j) % cap; }

// Whether a row's counters describe a valid step; a bad row gets NaN outputs and writes nothing.
__device__ __forceinline__ bool rp_valid(const int* m, int num_slots, int ring_rows, int t) {
    const int slot = m[0], start = m[1], h = m[2], cap = m[3], fold = m[4];
    return slot >= 0 && slot < num_slots && cap > 0 && cap <= ring_rows && start >= 0 && start < cap && h >= 0 &&
           h + t <= cap && fold >= 0 && fold <= h + t;
}

// Sum over the 8 lanes that share a row; every one of them gets it.
__device__ __forceinline__ float rp_sum8(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    return v;
}

// Four state values from column c of a row (zeros past n); 16-byte loads when rows are 16-byte aligned.
__device__ __forceinline__ void rp_load4(const float* row, int c, int n, bool vec, float* o) {
    if (vec && c < n) {
        const float4 v = *reinterpret_cast<const float4*>(row + c);
        o[0] = v.x;
        o[1] = v.y;
        o[2] = v.z;
        o[3] = v.w;
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            o[e] = c + e < n ? row[c + e] : 0.0f;
        }
    }
}

__device__ __forceinline__ void rp_store4(float* row, int c, int n, bool vec, const float* v) {
    if (vec && c < n) {
        *reinterpret_cast<float4*>(row + c) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (c + e < n) {
                row[c + e] = v[e];
            }
        }
    }
}

// Chunk ch of a head's checkpoint into registers (zeros when the row reads no state): lane l holds row
// ch·RP_CHUNK + 4r + l / 8, columns 4·(l % 8 + 8k) .. + 3.
template <int NC>
__device__ __forceinline__ void rp_load_chunk(const float* S, int rows, int ch, int n, bool read, bool vec,
                                              float (&st)[RP_RPW][NC][4]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < RP_RPW; ++r) {
        const int i = ch * RP_CHUNK + r * 4 + (lane >> 3);
#pragma unroll
        for (int k = 0; k < NC; ++k) {
            const int c = 4 * ((lane & 7) + 8 * k);
            if (read && i < rows) {
                rp_load4(S + (u64)i * n, c, n, vec, st[r][k]);
            } else {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    st[r][k][e] = 0.0f;
                }
            }
        }
    }
}

template <int NC>
__device__ __forceinline__ void rp_move(float (&dst)[RP_RPW][NC][4], const float (&src)[RP_RPW][NC][4]) {
#pragma unroll
    for (int r = 0; r < RP_RPW; ++r) {
#pragma unroll
        for (int k = 0; k < NC; ++k) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                dst[r][k][e] = src[r][k][e];
            }
        }
    }
}

// Dot products of one stored row (n values, read by one lane) with one or two shared f32 vectors; 16-byte loads
// when the row is aligned.
__device__ __forceinline__ void rp_dot2(const float* __restrict__ row, const float* v1, const float* v2, int n,
                                        float& a1, float& a2) {
    a1 = 0.0f;
    a2 = 0.0f;
    if ((n & 3) == 0 && ((u64)row & 15) == 0) {
        for (int c = 0; c < n; c += 4) {
            const float4 q = *reinterpret_cast<const float4*>(row + c);
            a1 += q.x * v1[c] + q.y * v1[c + 1] + q.z * v1[c + 2] + q.w * v1[c + 3];
            a2 += q.x * v2[c] + q.y * v2[c + 1] + q.z * v2[c + 2] + q.w * v2[c + 3];
        }
    } else {
        for (int c = 0; c < n; ++c) {
            a1 += row[c] * v1[c];
            a2 += row[c] * v2[c];
        }
    }
}

// Four values of a shared f32 vector from column c (zeros past n): one 16-byte load when n is a multiple of 4 (the
// vectors sit at 16-byte aligned offsets of the warp's scratch).
__device__ __forceinline__ void rp_smem4(const float* v, int c, int n, float* o) {
    if ((n & 3) == 0 && c < n) {
        const float4 q = *reinterpret_cast<const float4*>(v + c);
        o[0] = q.x;
        o[1] = q.y;
        o[2] = q.z;
        o[3] = q.w;
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            o[e] = c + e < n ? v[c + e] : 0.0f;
        }
    }
}

// Physical pool row (slot · R + ring row) of every committed entry, once per item: the modulo stays out of the loops.
__device__ __forceinline__ void rp_ring_rows(int* pj, int slot, int ring_rows, int start, int h, int cap) {
    for (int j = threadIdx.x & 31; j < h; j += 32) {
        pj[j] = slot * ring_rows + rp_phys(start, j, cap);
    }
}

__device__ __forceinline__ float rp_bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float rp_bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ void rp_dot2(const bf16* __restrict__ row, const float* v1, const float* v2, int n,
                                        float& a1, float& a2) {
    a1 = 0.0f;
    a2 = 0.0f;
    if ((n & 7) == 0 && ((u64)row & 15) == 0) {
        for (int c = 0; c < n; c += 8) {
            const uint4 q = *reinterpret_cast<const uint4*>(row + c);
            const float f[8] = {rp_bf16_lo(q.x), rp_bf16_hi(q.x), rp_bf16_lo(q.y), rp_bf16_hi(q.y),
                                rp_bf16_lo(q.z), rp_bf16_hi(q.z), rp_bf16_lo(q.w), rp_bf16_hi(q.w)};
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                a1 += f[e] * v1[c + e];
                a2 += f[e] * v2[c + e];
            }
        }
    } else {
        for (int c = 0; c < n; ++c) {
            a1 += to_f32(row[c]) * v1[c];
            a2 += to_f32(row[c]) * v2[c];
        }
    }
}

// Dot product of one stored row (read by one lane) with a shared f32 vector.
__device__ __forceinline__ float rp_dot1(const float* __restrict__ row, const float* v, int n) {
    float a = 0.0f;
    if ((n & 3) == 0 && ((u64)row & 15) == 0) {
        for (int c = 0; c < n; c += 4) {
            const float4 q = *reinterpret_cast<const float4*>(row + c);
            a += q.x * v[c] + q.y * v[c + 1] + q.z * v[c + 2] + q.w * v[c + 3];
        }
    } else {
        for (int c = 0; c < n; ++c) {
            a += row[c] * v[c];
        }
    }
    return a;
}

__device__ __forceinline__ float rp_dot1(const bf16* __restrict__ row, const float* v, int n) {
    float a = 0.0f;
    if ((n & 7) == 0 && ((u64)row & 15) == 0) {
        for (int c = 0; c < n; c += 8) {
            const uint4 q = *reinterpret_cast<const uint4*>(row + c);
            a += rp_bf16_lo(q.x) * v[c] + rp_bf16_hi(q.x) * v[c + 1] + rp_bf16_lo(q.y) * v[c + 2] +
                 rp_bf16_hi(q.y) * v[c + 3] + rp_bf16_lo(q.z) * v[c + 4] + rp_bf16_hi(q.z) * v[c + 5] +
                 rp_bf16_lo(q.w) * v[c + 6] + rp_bf16_hi(q.w) * v[c + 7];
        }
    } else {
        for (int c = 0; c < n; ++c) {
            a += to_f32(row[c]) * v[c];
        }
    }
    return a;
}

// Mamba-2 (ReplaySSM Alg. 2 / 4 and the fold). Per row b and head hd (group g), with m = h + t entries:
//   y_s = exp(seg(−1, h+s))·(S0·C_s) + Σ_{j ≤ h+s} dt_j·exp(seg(j, h+s))·(B_j·C_s)·x_j + D·x_s,
//   seg(i, p) = Σ_{i<r≤p} dt_r·A, accumulated backward from the query so only non-positive numbers are exponentiated.
// Pools: state [slots, heads, head_dim, state_dim] f32; ring_x [slots, R, heads, head_dim]; ring_dt [slots, R, heads]
// f32; ring_b [slots, R, groups, state_dim]. Inputs x [batch, t, heads, head_dim], dt [batch, t, heads],
// B, C [batch, t, groups, state_dim]; y as x. The warp's scratch: mamba2_replay_scratch in ops/replay.rs.
template <typename T, int NC>
__device__ void mamba2_replay_impl(float* __restrict__ state_pool, T* __restrict__ ring_x, float* __restrict__ ring_dt,
                                   T* __restrict__ ring_b, const int* __restrict__ meta, int num_slots, int ring_rows,
                                   const T* __restrict__ x, const float* __restrict__ dt, const float* __restrict__ A,
                                   const T* __restrict__ B, const T* __restrict__ C, const float* __restrict__ D,
                                   T* __restrict__ y, int t, int heads, int head_dim, int state_dim, int groups,
                                   int max_m, int scratch, int splits) {
    extern __shared__ __align__(16) float smem[];
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hd = (blockIdx.x * warps + warp) / splits, part = (blockIdx.x * warps + warp) % splits;
    const int b = blockIdx.y;
    const int chunks = (head_dim + RP_CHUNK - 1) / RP_CHUNK, per = (chunks + splits - 1) / splits;
    const int ch0 = part * per, ch1 = min(chunks, ch0 + per);
    if (hd >= heads || ch0 >= ch1) {
        return;
    }
    const int hpg = heads / groups;
    const int g = hd / hpg;
    const int p = head_dim, n = state_dim;
    const int l8 = lane & 7;
    const int* mt = meta + (u64)b * RP_META;
    if (!rp_valid(mt, num_slots, ring_rows, t) || mt[2] + t > max_m) {
        for (int idx = lane; idx < t * p; idx += 32) {
            y[(((u64)b * t + idx / p) * heads + hd) * p + idx % p] = from_f32<T>(nan_f32());
        }
        return;
    }
    const int slot = mt[0], start = mt[1], h = mt[2], cap = mt[3], fold = mt[4];
    const bool read = mt[5] != 0;
    const int m = h + t;
    float* S = state_pool + ((u64)slot * heads + hd) * p * n;
    const bool vec = (n & 3) == 0 && ((u64)S & 15) == 0;
    float st[RP_RPW][NC][4], nx[RP_RPW][NC][4];
    rp_load_chunk<NC>(S, p, ch0, n, read, vec, st);

    float* Cs = smem + (u64)warp * scratch;   // [t, n], 16-byte aligned
    float* dts = Cs + t * n;                  // [max_m]
    int* pj = reinterpret_cast<int*>(dts + max_m);  // [max_m]: pool rows of the committed entries
    float* w = dts + 2 * max_m;               // [t, max_m]: dt_j·exp(seg(j, h+s))·(B_j·C_s)
    float* coef = w + t * max_m;              // [max_m]: fold weights
    float* decay = coef + max_m;              // [t]
    float* keep = decay + t;                  // [1]
    float* rv = keep + 1;                     // [t, p]: the ring's share of y plus D·x
    const u64 ring_row = (u64)slot * ring_rows;
    rp_ring_rows(pj, slot, ring_rows, start, h, cap);
    for (int j = lane; j < m; j += 32) {
        dts[j] = j < h ? ring_dt[(ring_row + rp_phys(start, j, cap)) * heads + hd] : dt[((u64)b * t + (j - h)) * heads + hd];
    }
    for (int idx = lane; idx < t * n; idx += 32) {
        Cs[idx] = to_f32(C[(((u64)b * t + idx / n) * groups + g) * n + idx % n]);
    }
    __syncwarp();
    const float a = A[hd];
    // The §5.4 products B_j·C_s and the decay weights, one lane per entry.
    for (int s = 0; s < t; ++s) {
        for (int j = lane; j <= h + s; j += 32) {
            const T* bj = j < h ? ring_b + ((u64)pj[j] * groups + g) * n : B + (((u64)b * t + (j - h)) * groups + g) * n;
            const float prod = rp_dot1(bj, Cs + s * n, n);
            float seg = 0.0f;
            for (int r = h + s; r > j; --r) {
                seg += dts[r] * a;
            }
            w[s * max_m + j] = prod * dts[j] * expf(seg);
        }
    }
    for (int s = lane; s < t; s += 32) {
        float seg = 0.0f;
        for (int r = h + s; r >= 0; --r) {
            seg += dts[r] * a;
        }
        decay[s] = expf(seg);
    }
    for (int j = lane; j < fold; j += 32) {
        float seg = 0.0f;
        for (int r = fold - 1; r > j; --r) {
            seg += dts[r] * a;
        }
        coef[j] = dts[j] * expf(seg);
    }
    if (lane == 0) {
        float seg = 0.0f;
        for (int r = fold - 1; r >= 0; --r) {
            seg += dts[r] * a;
        }
        keep[0] = expf(seg);
    }
    __syncwarp();
    const float dskip = D[hd];
    for (int s = 0; s < t; ++s) {
        for (int i = ch0 * RP_CHUNK + lane; i < min(p, ch1 * RP_CHUNK); i += 32) {
            float acc = 0.0f;
            for (int j = 0; j <= h + s; ++j) {
                const T xj = j < h ? ring_x[((u64)pj[j] * heads + hd) * p + i] : x[(((u64)b * t + (j - h)) * heads + hd) * p + i];
                acc += w[s * max_m + j] * to_f32(xj);
            }
            rv[s * p + i] = acc + dskip * to_f32(x[(((u64)b * t + s) * heads + hd) * p + i]);
        }
    }
    __syncwarp();
    for (int ch = ch0; ch < ch1; ++ch) {
        if (ch + 1 < ch1) {
            rp_load_chunk<NC>(S, p, ch + 1, n, read, vec, nx);
        }
        for (int s = 0; s < t; ++s) {
#pragma unroll
            for (int r = 0; r < RP_RPW; ++r) {
                const int i = ch * RP_CHUNK + r * 4 + (lane >> 3);
                float part = 0.0f;
#pragma unroll
                for (int k = 0; k < NC; ++k) {
                    float cv[4];
                    rp_smem4(Cs + s * n, 4 * (l8 + 8 * k), n, cv);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        part += st[r][k][e] * cv[e];
                    }
                }
                part = rp_sum8(part) * decay[s];
                if (l8 == 0 && i < p) {
                    y[(((u64)b * t + s) * heads + hd) * p + i] = from_f32<T>(part + rv[s * p + i]);
                }
            }
        }
        if (fold > 0) {
            const float kp = keep[0];
#pragma unroll
            for (int r = 0; r < RP_RPW; ++r) {
                const int i = ch * RP_CHUNK + r * 4 + (lane >> 3);
                if (i < p) {
#pragma unroll
                    for (int k = 0; k < NC; ++k) {
                        const int c = 4 * (l8 + 8 * k);
                        if (c < n) {
                            float v[4];
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                v[e] = kp * st[r][k][e];
                            }
                            for (int j = 0; j < fold; ++j) {
                                const bool ring = j < h;
                                const u64 jr = ring ? (u64)pj[j] : 0;
                                const u64 jt = (u64)b * t + (j - h);
                                const float xj =
                                    coef[j] * to_f32(ring ? ring_x[(jr * heads + hd) * p + i] : x[(jt * heads + hd) * p + i]);
                                const T* bj = ring ? ring_b + (jr * groups + g) * n : B + (jt * groups + g) * n;
#pragma unroll
                                for (int e = 0; e < 4; ++e) {
                                    if (c + e < n) {
                                        v[e] += xj * to_f32(bj[c + e]);
                                    }
                                }
                            }
                            rp_store4(S + (u64)i * n, c, n, vec, v);
                        }
                    }
                }
            }
        }
        rp_move<NC>(st, nx);
    }
    // The step's own entries (by the head's first warp), after every read of the ring above (other warps read only
    // entries j < h).
    if (part != 0) {
        return;
    }
    for (int idx = lane; idx < t * p; idx += 32) {
        const int s = idx / p, i = idx % p;
        const u64 r = ring_row + rp_phys(start, h + s, cap);
        ring_x[(r * heads + hd) * p + i] = x[(((u64)b * t + s) * heads + hd) * p + i];
    }
    for (int s = lane; s < t; s += 32) {
        ring_dt[(ring_row + rp_phys(start, h + s, cap)) * heads + hd] = dts[h + s];
    }
    if (hd % hpg == 0) {
        for (int idx = lane; idx < t * n; idx += 32) {
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
// The warp's scratch: gdn_replay_scratch in ops/replay.rs.
template <typename T, int NC>
__device__ void gdn_replay_impl(float* __restrict__ state_pool, T* __restrict__ ring_u, T* __restrict__ ring_k,
                                float* __restrict__ ring_g, const int* __restrict__ meta, int num_slots, int ring_rows,
                                const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                const float* __restrict__ g, const float* __restrict__ beta, T* __restrict__ out,
                                int t, int k_heads, int v_heads, int k_dim, int v_dim, int max_m, int scratch, int splits) {
    extern __shared__ __align__(16) float smem[];
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hd = (blockIdx.x * warps + warp) / splits, part = (blockIdx.x * warps + warp) % splits;
    const int b = blockIdx.y;
    const int chunks = (v_dim + RP_CHUNK - 1) / RP_CHUNK, per = (chunks + splits - 1) / splits;
    const int ch0 = part * per, ch1 = min(chunks, ch0 + per);
    if (hd >= v_heads || ch0 >= ch1) {
        return;
    }
    const int per_key = v_heads / k_heads;
    const int kh = hd / per_key;
    const int dk = k_dim, dv = v_dim;
    const int l8 = lane & 7;
    const int* mt = meta + (u64)b * RP_META;
    if (!rp_valid(mt, num_slots, ring_rows, t) || mt[2] + t > max_m) {
        for (int idx = lane; idx < t * dv; idx += 32) {
            out[(((u64)b * t + idx / dv) * v_heads + hd) * dv + idx % dv] = from_f32<T>(nan_f32());
        }
        return;
    }
    const int slot = mt[0], start = mt[1], h = mt[2], cap = mt[3], fold = mt[4];
    const bool read = mt[5] != 0;
    const int m = h + t;
    float* S = state_pool + ((u64)slot * v_heads + hd) * dv * dk;
    const bool vec = (dk & 3) == 0 && ((u64)S & 15) == 0;
    float st[RP_RPW][NC][4], nx[RP_RPW][NC][4];
    rp_load_chunk<NC>(S, dv, ch0, dk, read, vec, st);

    float* Qs = smem + (u64)warp * scratch;  // [t, dk]
    float* Kt = Qs + t * dk;                  // [t, dk]: the step's keys
    float* gs = Kt + t * dk;                  // [max_m]
    float* kk = gs + max_m;                   // [max_m, t]: K_j·k_s
    float* kq = kk + max_m * t;               // [max_m, t]: K_j·q_s
    float* wh = kq + max_m * t;               // [max_m]: decay from entry j to h
    float* coef = wh + max_m;                 // [max_m]: decay from entry j to F
    float* Am = coef + max_m;                 // [t, t]
    float* Ew = Am + t * t;                   // [t, t]: e^{G_s − G_s'}
    float* Es = Ew + t * t;                   // [t]: e^{G_s}
    float* bt = Es + t;                       // [t]
    float* sc = bt + t;                       // [2]: D_h, D_F
    int* pj = reinterpret_cast<int*>(sc + 2); // [max_m]: pool rows of the committed entries
    float* SK = sc + 2 + max_m;               // [t, RP_CHUNK]: S_h k_s of the chunk's rows
    float* SQ = SK + t * RP_CHUNK;            // [t, RP_CHUNK]: S_h q_s
    float* Us = SQ + t * RP_CHUNK;            // [t, RP_CHUNK]
    float* RK = Us + t * RP_CHUNK;            // [t, dv]: the ring's share of S_h k_s, Σ_{j<h} w_j u_j (k_j·k_s)
    float* RQ = RK + t * dv;                  // [t, dv]: the ring's share of S_h q_s
    float* Vs = RQ + t * dv;                  // [t, dv]: the step's values
    const u64 ring_row = (u64)slot * ring_rows;
    rp_ring_rows(pj, slot, ring_rows, start, h, cap);
    for (int idx = lane; idx < t * dk; idx += 32) {
        const u64 src = (((u64)b * t + idx / dk) * k_heads + kh) * dk + idx % dk;
        Qs[idx] = to_f32(q[src]);
        Kt[idx] = to_f32(k[src]);
    }
    for (int j = lane; j < m; j += 32) {
        gs[j] = j < h ? ring_g[(ring_row + rp_phys(start, j, cap)) * v_heads + hd] : g[((u64)b * t + (j - h)) * v_heads + hd];
    }
    for (int s = lane; s < t; s += 32) {
        bt[s] = beta[((u64)b * t + s) * v_heads + hd];
    }
    __syncwarp();
    // Key products and decay weights, one lane per entry.
    for (int j = lane; j < m; j += 32) {
        const T* kj = j < h ? ring_k + (((u64)slot * ring_rows + rp_phys(start, j, cap)) * k_heads + kh) * dk
                            : k + (((u64)b * t + (j - h)) * k_heads + kh) * dk;
        for (int s = 0; s < t; ++s) {
            rp_dot2(kj, Kt + s * dk, Qs + s * dk, dk, kk[j * t + s], kq[j * t + s]);
        }
        float seg = 0.0f;
        for (int r = h - 1; r > j; --r) {
            seg += gs[r];
        }
        wh[j] = expf(seg);
        seg = 0.0f;
        for (int r = fold - 1; r > j; --r) {
            seg += gs[r];
        }
        coef[j] = expf(seg);
    }
    if (lane == 0) {
        float seg = 0.0f;
        for (int r = h - 1; r >= 0; --r) {
            seg += gs[r];
        }
        sc[0] = expf(seg);
        seg = 0.0f;
        for (int r = fold - 1; r >= 0; --r) {
            seg += gs[r];
        }
        sc[1] = expf(seg);
    }
    __syncwarp();
    // e^{G_s − G_s'} as the exponential of the gates between them (never a difference of sums).
    for (int pr = lane; pr < t * t; pr += 32) {
        const int s = pr / t, s2 = pr % t;
        float seg = 0.0f;
        for (int i = s2 + 1; i <= s; ++i) {
            seg += gs[h + i];
        }
        Ew[pr] = s2 <= s ? expf(seg) : 0.0f;
        Am[pr] = s2 < s ? bt[s] * expf(seg) * kk[(h + s2) * t + s] : 0.0f;
    }
    for (int s = lane; s < t; s += 32) {
        float seg = 0.0f;
        for (int i = 0; i <= s; ++i) {
            seg += gs[h + i];
        }
        Es[s] = expf(seg);
    }
    // The ring's shares and the values, one lane per value row (coalesced), so the row loop below reads no memory
    // but the checkpoint.
    for (int row = ch0 * RP_CHUNK + lane; row < min(dv, ch1 * RP_CHUNK); row += 32) {
        for (int s = 0; s < t; ++s) {
            RK[s * dv + row] = 0.0f;
            RQ[s * dv + row] = 0.0f;
            Vs[s * dv + row] = to_f32(v[(((u64)b * t + s) * v_heads + hd) * dv + row]);
        }
        for (int j = 0; j < h; ++j) {
            const float uj = wh[j] * to_f32(ring_u[((u64)pj[j] * v_heads + hd) * dv + row]);
            for (int s = 0; s < t; ++s) {
                RK[s * dv + row] += uj * kk[j * t + s];
                RQ[s * dv + row] += uj * kq[j * t + s];
            }
        }
    }
    __syncwarp();
    const float dh = sc[0], kp = sc[1];
    for (int ch = ch0; ch < ch1; ++ch) {
        if (ch + 1 < ch1) {
            rp_load_chunk<NC>(S, dv, ch + 1, dk, read, vec, nx);
        }
        // S_h k_s and S_h q_s: the checkpoint's products from registers plus the ring's, 8 lanes per row.
        for (int s = 0; s < t; ++s) {
#pragma unroll
            for (int r = 0; r < RP_RPW; ++r) {
                const int li = r * 4 + (lane >> 3);
                const int row = min(ch * RP_CHUNK + li, dv - 1);
                float pk = 0.0f, pq = 0.0f;
#pragma unroll
                for (int kx = 0; kx < NC; ++kx) {
                    float kv[4], qv[4];
                    rp_smem4(Kt + s * dk, 4 * (l8 + 8 * kx), dk, kv);
                    rp_smem4(Qs + s * dk, 4 * (l8 + 8 * kx), dk, qv);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        pk += st[r][kx][e] * kv[e];
                        pq += st[r][kx][e] * qv[e];
                    }
                }
                pk = rp_sum8(pk);
                pq = rp_sum8(pq);
                if (l8 == 0) {
                    SK[s * RP_CHUNK + li] = dh * pk + RK[s * dv + row];
                    SQ[s * RP_CHUNK + li] = dh * pq + RQ[s * dv + row];
                }
            }
        }
        __syncwarp();
        // The triangular solve and the outputs, one lane per row of the chunk.
        const int row = ch * RP_CHUNK + lane;
        if (lane < RP_CHUNK && row < dv) {
            for (int s = 0; s < t; ++s) {
                const float vs = Vs[s * dv + row];
                float us = bt[s] * (vs - Es[s] * SK[s * RP_CHUNK + lane]);
                for (int s2 = 0; s2 < s; ++s2) {
                    us -= Am[s * t + s2] * Us[s2 * RP_CHUNK + lane];
                }
                Us[s * RP_CHUNK + lane] = us;
                float ys = Es[s] * SQ[s * RP_CHUNK + lane];
                for (int s2 = 0; s2 <= s; ++s2) {
                    ys += Ew[s * t + s2] * kq[(h + s2) * t + s] * Us[s2 * RP_CHUNK + lane];
                }
                out[(((u64)b * t + s) * v_heads + hd) * dv + row] = from_f32<T>(ys);
                // The step's own entries (other warps and this warp's fold read only entries j < h of the ring).
                ring_u[((ring_row + rp_phys(start, h + s, cap)) * v_heads + hd) * dv + row] = from_f32<T>(us);
            }
        }
        __syncwarp();
        if (fold > 0) {
#pragma unroll
            for (int r = 0; r < RP_RPW; ++r) {
                const int li = r * 4 + (lane >> 3);
                const int i = ch * RP_CHUNK + li;
                if (i < dv) {
#pragma unroll
                    for (int kx = 0; kx < NC; ++kx) {
                        const int c = 4 * (l8 + 8 * kx);
                        if (c < dk) {
                            float val[4];
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                val[e] = kp * st[r][kx][e];
                            }
                            for (int j = 0; j < fold; ++j) {
                                const u64 jr = j < h ? (u64)pj[j] : 0;
                                const float uj =
                                    coef[j] * (j < h ? to_f32(ring_u[(jr * v_heads + hd) * dv + i]) : Us[(j - h) * RP_CHUNK + li]);
#pragma unroll
                                for (int e = 0; e < 4; ++e) {
                                    if (c + e < dk) {
                                        const float kj = j < h ? to_f32(ring_k[(jr * k_heads + kh) * dk + c + e])
                                                               : Kt[(j - h) * dk + c + e];
                                        val[e] += uj * kj;
                                    }
                                }
                            }
                            rp_store4(S + (u64)i * dk, c, dk, vec, val);
                        }
                    }
                }
            }
        }
        __syncwarp();  // SK, SQ and Us are the next chunk's
        rp_move<NC>(st, nx);
    }
    if (part != 0) {
        return;
    }
    for (int s = lane; s < t; s += 32) {
        ring_g[(ring_row + rp_phys(start, h + s, cap)) * v_heads + hd] = gs[h + s];
    }
    if (hd % per_key == 0) {
        for (int idx = lane; idx < t * dk; idx += 32) {
            const int s = idx / dk, c = idx % dk;
            const u64 rr = ring_row + rp_phys(start, h + s, cap);
            ring_k[(rr * k_heads + kh) * dk + c] = k[(((u64)b * t + s) * k_heads + kh) * dk + c];
        }
    }
}

// Entry points: storage type T (suffix S) and NC column groups of 32 per state row (key dims up to 32·NC):
// mamba2_replay_nc1, mamba2_replay_nc2, mamba2_replay_nc4, mamba2_replay_nc8, gdn_replay_nc1, gdn_replay_nc2,
// gdn_replay_nc4, gdn_replay_nc8, each _f32 and _bf16.
#define REPLAY_NC(T, S, NC)                                                                                            \
    extern "C" __global__ void __launch_bounds__(256, 3) mamba2_replay_nc##NC##_##S(                                   \
        float* state_pool, T* ring_x, float* ring_dt, T* ring_b, const int* meta, int num_slots, int ring_rows,        \
        const T* x, const float* dt, const float* A, const T* B, const T* C, const float* D, T* y, int t, int heads,   \
        int head_dim, int state_dim, int groups, int max_m, int scratch, int splits) {                                 \
        mamba2_replay_impl<T, NC>(state_pool, ring_x, ring_dt, ring_b, meta, num_slots, ring_rows, x, dt, A, B, C, D,  \
                                  y, t, heads, head_dim, state_dim, groups, max_m, scratch, splits);                   \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256, 3) gdn_replay_nc##NC##_##S(                                      \
        float* state_pool, T* ring_u, T* ring_k, float* ring_g, const int* meta, int num_slots, int ring_rows,         \
        const T* q, const T* k, const T* v, const float* g, const float* beta, T* out, int t, int k_heads,             \
        int v_heads, int k_dim, int v_dim, int max_m, int scratch, int splits) {                                       \
        gdn_replay_impl<T, NC>(state_pool, ring_u, ring_k, ring_g, meta, num_slots, ring_rows, q, k, v, g, beta, out,  \
                               t, k_heads, v_heads, k_dim, v_dim, max_m, scratch, splits);                             \
    }
#define REPLAY(T, S) REPLAY_NC(T, S, 1) REPLAY_NC(T, S, 2) REPLAY_NC(T, S, 4) REPLAY_NC(T, S, 8)
REPLAY(float, f32)
REPLAY(bf16, bf16)
