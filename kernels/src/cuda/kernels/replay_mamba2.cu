// Input replay for Mamba-2 layers; the row layout and shared helpers are replay_common.cuh.

// Mamba-2 (ReplaySSM Alg. 2 / 4 and the fold). Per row b and head hd (group g), with m = h + t entries:
//   y_s = exp(seg(−1, h+s))·(S0·C_s) + Σ_{j ≤ h+s} dt_j·exp(seg(j, h+s))·(B_j·C_s)·x_j + D·x_s,
//   seg(i, p) = Σ_{i<r≤p} dt_r·A, accumulated backward from the query so only non-positive numbers are exponentiated.
// Pools: state [slots, heads, head_dim, state_dim] f32; ring_x [slots, R, heads, head_dim]; ring_dt [slots, R, heads]
// f32; ring_b [slots, R, groups, state_dim]. Inputs x [batch, t, heads, head_dim], dt [batch, t, heads],
// B, C [batch, t, groups, state_dim]; y as x. The warp's scratch: warp_scratch in ops/replay.rs.
// The ring's share of output (s, i): Σ_{j ≤ h+s} w_s[j]·x_j[i] in entry order (ws = w + s·max_m; x_h.. are the
// step's own inputs, `xi` pointing at token 0's element i and `xstep` elements a token).
template <typename T>
__device__ __forceinline__ float m2_ring_share(const T* __restrict__ ring_x, const T* __restrict__ xi, u64 xstep,
                                               const int* pj, const float* ws, int h, int jn, int heads, int hd, int p,
                                               int i) {
    float acc = 0.0f;
    const int hr = min(jn, h);
    rp_ring_each(ring_x, pj, (u64)heads * p, (u64)hd * p + i, hr, [&](int j, float v) { acc += ws[j] * v; });
    for (int j = hr; j < jn; ++j) {
        acc += ws[j] * to_f32(xi[(u64)(j - h) * xstep]);
    }
    return acc;
}

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
    const u64 xstep = (u64)heads * p;
    for (int s = 0; s < t; ++s) {
        for (int i = ch0 * RP_CHUNK + lane; i < min(p, ch1 * RP_CHUNK); i += 32) {
            const T* xi = x + ((u64)b * t * heads + hd) * p + i;
            const float acc = m2_ring_share(ring_x, xi, xstep, pj, w + s * max_m, h, h + s + 1, heads, hd, p, i);
            rv[s * p + i] = acc + dskip * to_f32(xi[(u64)s * xstep]);
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
            // B rows (ring and input) start 4·sizeof(T)-byte aligned when n is a multiple of 4 and both bases are.
            const bool bvec = (n & 3) == 0 && (((u64)ring_b | (u64)B) & (4 * sizeof(T) - 1)) == 0;
            // In the chunk's registers (st is not read again before rp_move replaces it).
#pragma unroll
            for (int r = 0; r < RP_RPW; ++r) {
                const int i = ch * RP_CHUNK + r * 4 + (lane >> 3);
                rp_fold_row<NC, false>(
                    st[r], i < p, kp, min(fold, h), fold, n, S + (u64)i * n, vec, ring_b + (u64)g * n,
                    (u64)groups * n, pj, bvec,
                    [&](int j) {  // dt_j·decay·x_j[i]
                        const T xj = j < h ? ring_x[((u64)pj[j] * heads + hd) * p + i]
                                           : x[(((u64)b * t + (j - h)) * heads + hd) * p + i];
                        return coef[j] * to_f32(xj);
                    },
                    [&](int j, int c, float* bv) {  // the step's own b_j: four columns in one load (zeros past n)
                        rp_cols4(B + (((u64)b * t + (j - h)) * groups + g) * n, c, n, bvec, bv);
                    });
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

// Entry points: storage type T (suffix S) and NC column groups of 32 per state row (key dims up to 32·NC):
// mamba2_replay_nc1, mamba2_replay_nc2, mamba2_replay_nc4, mamba2_replay_nc8, each _f32 and _bf16.
#define MAMBA2_REPLAY_NC(T, S, NC)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256, 3) mamba2_replay_nc##NC##_##S(                                   \
        float* state_pool, T* ring_x, float* ring_dt, T* ring_b, const int* meta, int num_slots, int ring_rows,        \
        const T* x, const float* dt, const float* A, const T* B, const T* C, const float* D, T* y, int t, int heads,   \
        int head_dim, int state_dim, int groups, int max_m, int scratch, int splits) {                                 \
        mamba2_replay_impl<T, NC>(state_pool, ring_x, ring_dt, ring_b, meta, num_slots, ring_rows, x, dt, A, B, C, D,  \
                                  y, t, heads, head_dim, state_dim, groups, max_m, scratch, splits);                   \
    }
#define MAMBA2_REPLAY(T, S) \
    MAMBA2_REPLAY_NC(T, S, 1) MAMBA2_REPLAY_NC(T, S, 2) MAMBA2_REPLAY_NC(T, S, 4) MAMBA2_REPLAY_NC(T, S, 8)
MAMBA2_REPLAY(float, f32)
MAMBA2_REPLAY(bf16, bf16)
