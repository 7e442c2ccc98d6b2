// Shared by the input-replay kernels (replay_mamba2.cu, replay_gdn.cu; placed before each by nvrtc.rs): the row
// layout, the checkpoint streaming and the ring dot products. Input-replay steps a batch of sequences, each in its own
// form (kernels/src/cpu/replay_mamba2.rs, kernels/src/cpu/replay_gdn.rs): the CPU twins are replay_decode,
// verify_replay, flush and compress.
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

// The GDN kernel is also templated on SB, the tokens of a step handled together: one accumulator each, so a verify's
// t products are independent chains rather than t passes over the same data (t > SB runs in blocks of SB). A decode
// uses SB = 1: unused accumulators would still take registers, which the 85 of __launch_bounds__(256, 3) cannot spare.

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

// Four values of a stored row from column c as f32 (the caller checks 4·sizeof(T)-byte alignment).
__device__ __forceinline__ void rp_row4(const float* __restrict__ r, int c, float* f) {
    const float4 q = *reinterpret_cast<const float4*>(r + c);
    f[0] = q.x;
    f[1] = q.y;
    f[2] = q.z;
    f[3] = q.w;
}
__device__ __forceinline__ void rp_row4(const bf16* __restrict__ r, int c, float* f) {
    const uint2 w = *reinterpret_cast<const uint2*>(r + c);
    f[0] = rp_bf16_lo(w.x);
    f[1] = rp_bf16_hi(w.x);
    f[2] = rp_bf16_lo(w.y);
    f[3] = rp_bf16_hi(w.y);
}

// Four values of a stored row from column c as f32 (zeros past n): one load when `vec` says n is a multiple of 4 and
// the row 4·sizeof(T)-byte aligned.
template <typename T>
__device__ __forceinline__ void rp_cols4(const T* __restrict__ r, int c, int n, bool vec, float* f) {
    if (vec) {
        rp_row4(r, c, f);
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            f[e] = c + e < n ? to_f32(r[c + e]) : 0.0f;
        }
    }
}


// The fold of one state row held in registers (the lane's columns, as rp_load_chunk laid them out): row ← keep·row +
// Σ_{j<fold} weight(j) · (entry j's columns), then stored to s_row. The ring's entries j < hr read their columns from
// the pool row pj[j] (`ring` points at pool row 0 of the head's key / B group, `stride` elements a pool row); the
// step's own entries hr ≤ j < fold from cols(j, c, v). Every element sums keep·row then the entries in order. `own`
// is whether the lane's row exists. When every lane owns all NC column groups the ring's loop has no bounds tests and
// one address computation per entry.
//
// The folds are latency-bound (bench/results/gpu-ncu-2026-11-26.md), so the per-entry weight loads are taken out of
// the chain, in one of two ways (STAGED), chosen per family by measurement (bench/results/gpu-replay-fold-2026-11-27.md:
// each family's plain replay steps lose 5–45 % to the other way, through the registers it takes in that kernel):
// - STAGED (GDN): weight(j) reads the chunk's weights from shared memory, written by rp_fold_weights beforehand with
//   one lane per (entry, row);
// - shuffled (Mamba-2): weight(j) is a global load; the 8 lanes of a row load 8 entries' weights at once, one each, and
//   each entry's weight is a shuffle from its lane. Every lane of the warp must call it then (own or not).
template <int NC, bool STAGED, typename T, typename W, typename C>
__device__ __forceinline__ void rp_fold_row(float (&row)[NC][4], bool own, float keep, int hr, int fold, int n,
                                            float* s_row, bool vec, const T* __restrict__ ring, u64 stride,
                                            const int* pj, bool rvec, W weight, C cols) {
    const int lane = threadIdx.x & 31, l8 = lane & 7;
    if (STAGED && !own) {
        return;
    }
#pragma unroll
    for (int k = 0; k < NC; ++k) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            row[k][e] *= keep;
        }
    }
    const bool full = rvec && n == 32 * NC;  // no bounds tests on the ring's columns
    const T* base = ring + 4 * l8;
    // A ring entry's columns (all NC groups, from pool row r) added with weight w.
    auto add_ring = [&](const T* r, float w) {
#pragma unroll
        for (int k = 0; k < NC; ++k) {
            float v[4];
            rp_row4(r, 32 * k, v);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                row[k][e] += w * v[e];
            }
        }
    };
    // Any entry's columns, with bounds tests, added with weight w.
    auto add_any = [&](int j, float w) {
#pragma unroll
        for (int k = 0; k < NC; ++k) {
            const int c = 4 * (l8 + 8 * k);
            if (c < n) {
                float v[4];
                if (j < hr) {
                    rp_cols4(ring + (u64)pj[j] * stride, c, n, rvec, v);
                } else {
                    cols(j, c, v);
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    row[k][e] += w * v[e];
                }
            }
        }
    };
    if constexpr (STAGED) {
        int j = 0;
        if (full) {
#pragma unroll 1
            for (; j < hr; ++j) {
                add_ring(base + (u64)pj[j] * stride, weight(j));
            }
        }
        for (; j < fold; ++j) {
            add_any(j, weight(j));
        }
    } else {
        for (int jb = 0; jb < fold; jb += 8) {
            const float wl = own && jb + l8 < fold ? weight(jb + l8) : 0.0f;
            const int je = min(8, fold - jb);
#pragma unroll 1
            for (int u = 0; u < je; ++u) {
                const float w = __shfl_sync(0xffffffffu, wl, (lane & ~7) | u);
                const int j = jb + u;
                if (!own) {
                    continue;
                }
                if (full && j < hr) {
                    add_ring(base + (u64)pj[j] * stride, w);
                } else {
                    add_any(j, w);
                }
            }
        }
        if (!own) {
            return;
        }
    }
#pragma unroll
    for (int k = 0; k < NC; ++k) {
        const int c = 4 * (l8 + 8 * k);
        if (c < n) {
            rp_store4(s_row, c, n, vec, row[k]);
        }
    }
}

// The fold weights of a chunk's rows for entries j0 ≤ j < j1: wts[j·RP_CHUNK + li] = weight(j, row, li) with row =
// ch·RP_CHUNK + li (zero past `rows`), one lane per (entry, row), so the per-entry loads are spread over the warp and
// in flight at once instead of one chain per row inside the fold. The caller syncs the warp before rp_fold_row.
template <typename W>
__device__ __forceinline__ void rp_fold_weights(float* wts, int j0, int j1, int ch, int rows, W weight) {
    for (int it = j0 * RP_CHUNK + (threadIdx.x & 31); it < j1 * RP_CHUNK; it += 32) {
        const int j = it / RP_CHUNK, li = it % RP_CHUNK, i = ch * RP_CHUNK + li;
        wts[it] = i < rows ? weight(j, i, li) : 0.0f;
    }
}

// add(j, v_j) for the ring's entries j < h in order, v_j = ring[pj[j]·stride + off] as f32: the rows are loaded 8 at
// a time, so that a lane has them in flight together instead of one per dependent step of the sum it feeds (1.05×
// on a Mamba-2 replay step of L = 16 at batch 256, 1.18× at L = 32: bench/results/gpu-replay-stream-2026-11-27.md).
template <typename T, typename F>
__device__ __forceinline__ void rp_ring_each(const T* __restrict__ ring, const int* pj, u64 stride, u64 off, int h,
                                             F add) {
    int j = 0;
    for (; j + 8 <= h; j += 8) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            v[u] = to_f32(ring[(u64)pj[j + u] * stride + off]);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            add(j + u, v[u]);
        }
    }
    for (; j < h; ++j) {
        add(j, to_f32(ring[(u64)pj[j] * stride + off]));
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
