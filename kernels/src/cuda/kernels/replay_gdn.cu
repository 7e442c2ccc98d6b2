// Input replay for Gated DeltaNet layers; the row layout and shared helpers are replay_common.cuh.

// Gated DeltaNet (ReplaySSM Alg. 6 / 8 and the fold). Per row b and value head hd (key head kh), the ring caches
// (u, k, g) with u the corrected value. With S_h = D_h·S0 + Σ_{j<h} w_j u_j k_jᵀ (w_j = Π_{j<i<h} e^{g_i}),
// G_s = Σ_{i≤s} g_{h+i} over the step's tokens, A[s, s'] = β_s e^{G_s − G_s'} (k_s·k_s') for s' < s and
// R_s = β_s (v_s − e^{G_s} S_h k_s): U solves (I + A) U = R by forward substitution, and
// y_s = e^{G_s} S_h q_s + Σ_{s' ≤ s} e^{G_s − G_s'} (k_s'·q_s) U_s'. S_h is never built: S_h k_s and S_h q_s come
// from the checkpoint's products and the ring's key products. Pools: state [slots, v_heads, v_dim, k_dim] f32;
// ring_u [slots, R, v_heads, v_dim]; ring_k [slots, R, k_heads, k_dim]; ring_g [slots, R, v_heads] f32. Inputs q, k
// [batch, t, k_heads, k_dim] (normalised, q scaled); v, out [batch, t, v_heads, v_dim]; g, beta [batch, t, v_heads].
// The warp's scratch: warp_scratch in ops/replay.rs.
//
// Tokens are handled SB at a time with one accumulator each (replay_common.cuh), and the ring key rows are read
// once for all of them. Without a fold the
// triangular solve runs once after the checkpoint's products, one lane per value row: S_h k_s, S_h q_s and U are
// kept in place of the ring's shares (RK, RQ), so a verify's solve keeps every lane busy instead of the 4 of a chunk.
// K_j·k_s and K_j·q_s of one stored key row (read by one lane) with each of the step's t tokens: the row is read once
// per SB tokens, each product an accumulator of its own, summed over the columns in order.
template <int SB, typename T>
__device__ __forceinline__ void gdn_key_products(const T* __restrict__ kj, const float* Kt, const float* Qs, int dk,
                                                 int t, float* kk, float* kq) {
    const bool vec = (dk & 3) == 0 && ((u64)kj & (4 * sizeof(T) - 1)) == 0;
    for (int s0 = 0; s0 < t; s0 += SB) {
        float a1[SB], a2[SB];
#pragma unroll
        for (int i = 0; i < SB; ++i) {
            a1[i] = 0.0f;
            a2[i] = 0.0f;
        }
        for (int c = 0; c < dk; c += 4) {
            float f[4];
            rp_cols4(kj, c, dk, vec, f);
#pragma unroll
            for (int i = 0; i < SB; ++i) {
                if (s0 + i < t) {
                    float kv[4], qv[4];
                    rp_smem4(Kt + (s0 + i) * dk, c, dk, kv);
                    rp_smem4(Qs + (s0 + i) * dk, c, dk, qv);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        a1[i] += f[e] * kv[e];
                        a2[i] += f[e] * qv[e];
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < SB; ++i) {
            if (s0 + i < t) {
                kk[s0 + i] = a1[i];
                kq[s0 + i] = a2[i];
            }
        }
    }
}

// The triangular solve and the outputs of value row `row` of row b: U_s = β_s (v_s − e^{G_s} S_h k_s) −
// Σ_{s'<s} A[s, s'] U_s', y_s = e^{G_s} S_h q_s + Σ_{s'≤s} e^{G_s − G_s'} (k_s'·q_s) U_s'. S_h k_s, S_h q_s and U_s
// are sk[s·stride], sq[s·stride], u[s·stride]; u may be sk (each S_h k_s is read before U_s replaces it). U_s also
// goes to the ring as the step's entry h + s (other warps read only entries j < h).
template <typename T>
__device__ __forceinline__ void gdn_solve_row(const float* sk, const float* sq, float* u, int stride, const T* v, T* out,
                                              T* ring_u, u64 ring_row, int start, int h, int cap, int b, int t,
                                              int v_heads, int hd, int dv, int row, const float* bt, const float* Es,
                                              const float* Am, const float* Ew, const float* kq) {
    for (int s = 0; s < t; ++s) {
        const float vs = to_f32(v[(((u64)b * t + s) * v_heads + hd) * dv + row]);
        float us = bt[s] * (vs - Es[s] * sk[s * stride]);
        for (int s2 = 0; s2 < s; ++s2) {
            us -= Am[s * t + s2] * u[s2 * stride];
        }
        u[s * stride] = us;
        float ys = Es[s] * sq[s * stride];
        for (int s2 = 0; s2 <= s; ++s2) {
            ys += Ew[s * t + s2] * kq[(h + s2) * t + s] * u[s2 * stride];
        }
        out[(((u64)b * t + s) * v_heads + hd) * dv + row] = from_f32<T>(ys);
        ring_u[((ring_row + rp_phys(start, h + s, cap)) * v_heads + hd) * dv + row] = from_f32<T>(us);
    }
}

template <typename T, int NC, int SB>
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
    float* wf = RQ + t * dv;                  // [max_m, RP_CHUNK]: the chunk's fold weights
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
        gdn_key_products<SB>(kj, Kt, Qs, dk, t, kk + j * t, kq + j * t);
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
    // The ring's shares, one lane per value row (coalesced), accumulated in registers, so the row loop below reads no
    // memory but the checkpoint.
    for (int row = ch0 * RP_CHUNK + lane; row < min(dv, ch1 * RP_CHUNK); row += 32) {
        for (int s0 = 0; s0 < t; s0 += SB) {
            float rk[SB], rq[SB];
#pragma unroll
            for (int i = 0; i < SB; ++i) {
                rk[i] = 0.0f;
                rq[i] = 0.0f;
            }
            rp_ring_each(ring_u, pj, (u64)v_heads * dv, (u64)hd * dv + row, h, [&](int j, float u) {
                const float uj = wh[j] * u;
#pragma unroll
                for (int i = 0; i < SB; ++i) {
                    if (s0 + i < t) {
                        rk[i] += uj * kk[j * t + s0 + i];
                        rq[i] += uj * kq[j * t + s0 + i];
                    }
                }
            });
#pragma unroll
            for (int i = 0; i < SB; ++i) {
                if (s0 + i < t) {
                    RK[(s0 + i) * dv + row] = rk[i];
                    RQ[(s0 + i) * dv + row] = rq[i];
                }
            }
        }
    }
    __syncwarp();
    const float dh = sc[0], kp = sc[1];
    // Ring key rows start 4·sizeof(T)-byte aligned when dk is a multiple of 4 and the pool is.
    const bool kvec = (dk & 3) == 0 && ((u64)ring_k & (4 * sizeof(T) - 1)) == 0;
    for (int ch = ch0; ch < ch1; ++ch) {
        if (ch + 1 < ch1) {
            rp_load_chunk<NC>(S, dv, ch + 1, dk, read, vec, nx);
        }
        // S_h k_s and S_h q_s: the checkpoint's products from registers plus the ring's, 8 lanes per row, SB
        // tokens at a time. With a fold they go to the chunk's SK / SQ (solved below, before the fold needs U);
        // without one, in place of the ring's shares (solved after the last chunk).
#pragma unroll
        for (int r = 0; r < RP_RPW; ++r) {
            const int li = r * 4 + (lane >> 3);
            const int row = min(ch * RP_CHUNK + li, dv - 1);
            const bool own = l8 == 0 && (fold > 0 || ch * RP_CHUNK + li < dv);
            for (int s0 = 0; s0 < t; s0 += SB) {
                float pk[SB], pq[SB];
#pragma unroll
                for (int i = 0; i < SB; ++i) {
                    pk[i] = 0.0f;
                    pq[i] = 0.0f;
                }
#pragma unroll
                for (int kx = 0; kx < NC; ++kx) {
#pragma unroll
                    for (int i = 0; i < SB; ++i) {
                        if (s0 + i < t) {
                            float kv[4], qv[4];
                            rp_smem4(Kt + (s0 + i) * dk, 4 * (l8 + 8 * kx), dk, kv);
                            rp_smem4(Qs + (s0 + i) * dk, 4 * (l8 + 8 * kx), dk, qv);
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                pk[i] += st[r][kx][e] * kv[e];
                                pq[i] += st[r][kx][e] * qv[e];
                            }
                        }
                    }
                }
#pragma unroll
                for (int i = 0; i < SB; ++i) {
                    if (s0 + i < t) {  // the same for every lane: the shuffles see the whole warp
                        const int s = s0 + i;
                        const float a = rp_sum8(pk[i]), c = rp_sum8(pq[i]);
                        if (own) {
                            const float sk = dh * a + RK[s * dv + row], sq = dh * c + RQ[s * dv + row];
                            if (fold > 0) {
                                SK[s * RP_CHUNK + li] = sk;
                                SQ[s * RP_CHUNK + li] = sq;
                            } else {
                                RK[s * dv + row] = sk;
                                RQ[s * dv + row] = sq;
                            }
                        }
                    }
                }
            }
        }
        __syncwarp();
        if (fold == 0) {
            rp_move<NC>(st, nx);
            continue;
        }
        // The triangular solve and the outputs, one lane per row of the chunk.
        const int row = ch * RP_CHUNK + lane;
        if (lane < RP_CHUNK && row < dv) {
            gdn_solve_row(SK + lane, SQ + lane, Us + lane, RP_CHUNK, v, out, ring_u, ring_row, start, h, cap, b, t,
                          v_heads, hd, dv, row, bt, Es, Am, Ew, kq);
        }
        __syncwarp();
        // The fold's weights c_j u_j[i] (the step's own entries' from the solve), one lane per (entry, row).
        rp_fold_weights(wf, 0, fold, ch, dv, [&](int j, int i, int li) {
            return coef[j] * (j < h ? to_f32(ring_u[((u64)pj[j] * v_heads + hd) * dv + i]) : Us[(j - h) * RP_CHUNK + li]);
        });
        __syncwarp();
        const int hr = min(fold, h);
        // The fold, S_F = D_F·S0 + Σ_j c_j u_j k_jᵀ, in the chunk's registers (st is not read again).
#pragma unroll
        for (int r = 0; r < RP_RPW; ++r) {
            const int li = r * 4 + (lane >> 3);
            const int i = ch * RP_CHUNK + li;
            rp_fold_row<NC, true>(
                st[r], i < dv, kp, hr, fold, dk, S + (u64)i * dk, vec, ring_k + (u64)kh * dk, (u64)k_heads * dk, pj,
                kvec, [&](int j) { return wf[j * RP_CHUNK + li]; },
                [&](int j, int c, float* kj) { rp_smem4(Kt + (j - h) * dk, c, dk, kj); });  // the step's own k_j
        }
        __syncwarp();  // SK, SQ, Us and wf are the next chunk's
        rp_move<NC>(st, nx);
    }
    if (fold == 0) {
        // The triangular solve and the outputs, one lane per value row; U_s replaces S_h k_s in RK once read.
        for (int row = ch0 * RP_CHUNK + lane; row < min(dv, ch1 * RP_CHUNK); row += 32) {
            gdn_solve_row(RK + row, RQ + row, RK + row, dv, v, out, ring_u, ring_row, start, h, cap, b, t, v_heads, hd,
                          dv, row, bt, Es, Am, Ew, kq);
        }
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

// Blocks of 256 threads an SM the register budget is sized for (ops/replay.rs, sm_warps): 3 (85 registers a thread)
// for one token at a time; 2 (128) for the 4-token variant, whose accumulators are short of registers at 85.
#define GDN_MIN_BLOCKS(SB) ((SB) == 1 ? 3 : 2)

// Entry points: storage type T (suffix S), NC column groups of 32 per state row (key dims up to 32·NC) and SB tokens
// handled together (1 for up to 2 tokens, 4 for longer steps; ops/replay.rs):
// gdn_replay_nc1_sb1, gdn_replay_nc2_sb1, gdn_replay_nc4_sb1, gdn_replay_nc8_sb1,
// gdn_replay_nc1_sb4, gdn_replay_nc2_sb4, gdn_replay_nc4_sb4, gdn_replay_nc8_sb4; each _f32 and _bf16.
#define GDN_REPLAY_NC(T, S, NC, SB)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256, GDN_MIN_BLOCKS(SB)) gdn_replay_nc##NC##_sb##SB##_##S(            \
        float* state_pool, T* ring_u, T* ring_k, float* ring_g, const int* meta, int num_slots, int ring_rows,         \
        const T* q, const T* k, const T* v, const float* g, const float* beta, T* out, int t, int k_heads,             \
        int v_heads, int k_dim, int v_dim, int max_m, int scratch, int splits) {                                       \
        gdn_replay_impl<T, NC, SB>(state_pool, ring_u, ring_k, ring_g, meta, num_slots, ring_rows, q, k, v, g, beta,   \
                                   out, t, k_heads, v_heads, k_dim, v_dim, max_m, scratch, splits);                    \
    }
#define GDN_REPLAY_SB(T, S, SB) \
    GDN_REPLAY_NC(T, S, 1, SB) GDN_REPLAY_NC(T, S, 2, SB) GDN_REPLAY_NC(T, S, 4, SB) GDN_REPLAY_NC(T, S, 8, SB)
#define GDN_REPLAY(T, S) GDN_REPLAY_SB(T, S, 1) GDN_REPLAY_SB(T, S, 4)
GDN_REPLAY(float, f32)
GDN_REPLAY(bf16, bf16)
