// Token selection on the device: row argmax (greedy), the repetition penalty, and filtered sampling (temperature,
// top-k, top-p, min-p, inverse-CDF draw) with the CPU Sampler's semantics (engine/src/sample/mod.rs). One block per row.

// The running best of an argmax: the lowest index among the largest values (`i < 0`: nothing seen yet).
struct ArgBest {
    float v;
    int i;
};

__device__ __forceinline__ ArgBest arg_better(ArgBest a, ArgBest b) {
    if (b.i < 0) return a;
    if (a.i < 0) return b;
    return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

// Argmax of a row over the whole block; every thread gets the index, or −1 when the row holds a NaN. Equal values
// (−0 and +0 included) go to the lowest index, as `argmax` on the CPU.
__device__ int block_argmax(const float* __restrict__ row, int vocab) {
    __shared__ ArgBest part[32];
    __shared__ int result;
    ArgBest best = {0.0f, -1};
    int nan = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if (v != v) {
            nan = 1;
        } else if (best.i < 0 || v > best.v) {
            best.v = v;
            best.i = i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        ArgBest other;
        other.v = __shfl_xor_sync(0xffffffffu, best.v, o);
        other.i = __shfl_xor_sync(0xffffffffu, best.i, o);
        best = arg_better(best, other);
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    nan = __syncthreads_or(nan);
    if (lane == 0) part[warp] = best;
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        best = lane < warps ? part[lane] : ArgBest{0.0f, -1};
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            ArgBest other;
            other.v = __shfl_xor_sync(0xffffffffu, best.v, o);
            other.i = __shfl_xor_sync(0xffffffffu, best.i, o);
            best = arg_better(best, other);
        }
        if (lane == 0) result = nan ? -1 : best.i;
    }
    __syncthreads();
    return result;
}

extern "C" __global__ void argmax_rows(const float* logits, int vocab, int* out) {
    const int r = block_argmax(logits + (u64)blockIdx.x * vocab, vocab);
    if (threadIdx.x == 0) out[blockIdx.x] = r;
}

// HF repetition penalty over distinct (row, token) pairs: l = l > 0 ? l / p : l · p with p = penalty[row]. Pairs
// outside the logits are skipped.
extern "C" __global__ void repetition_penalty(float* logits, int rows, int vocab, const int* rows_of, const int* tokens,
                                              int n, const float* penalty) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int r = rows_of[i];
        const int t = tokens[i];
        if (r < 0 || r >= rows || t < 0 || t >= vocab) continue;
        float* l = logits + (u64)r * vocab + t;
        const float p = penalty[r];
        *l = *l > 0.0f ? *l / p : *l * p;
    }
}

// Additive logit bias over distinct (row, token) pairs: l += bias[i] (the presence / frequency penalties, logit_bias and
// the min_tokens mask, summed on the host so every device adds the same number). Pairs outside the logits are skipped.
extern "C" __global__ void logit_bias(float* logits, int rows, int vocab, const int* rows_of, const int* tokens, int n,
                                      const float* bias) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int r = rows_of[i];
        const int t = tokens[i];
        if (r < 0 || r >= rows || t < 0 || t >= vocab) continue;
        logits[(u64)r * vocab + t] += bias[i];
    }
}

// Token mask of constrained rows (structured outputs): logits[r, t] = FLT_MIN-of-f32 (-FLT_MAX) where bit t of row
// r's mask is clear; words[r] < 0 leaves row r as it is. Masks are `mask_words` u32 words a row, LSB first; ids past
// them are clear. -FLT_MAX rather than -inf keeps the row finite (a weight of exactly 0, never the argmax beside an
// allowed token), as the CPU twin `rewind_kernels::cpu::sample::apply_token_mask` does.
extern "C" __global__ void token_mask(float* logits, int rows, int vocab, const u32* masks, int mask_words,
                                      const int* words) {
    const u64 n = (u64)rows * vocab;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const int r = (int)(i / vocab);
        const int t = (int)(i % vocab);
        const int at = words[r];
        if (at < 0) continue;
        const int w = t >> 5;
        const u32 word = w < mask_words ? masks[(u64)at * mask_words + w] : 0u;
        if (((word >> (t & 31)) & 1u) == 0u) logits[i] = -3.402823466e+38f;
    }
}

// ---- Filtered sampling -------------------------------------------------------------------------------------------
//
// The CPU Sampler sorts the row by (logit descending in total order, id ascending) and keeps: the first top_k; then
// the shortest prefix whose weight mass reaches top_p of the kept mass (weights w = exp((l − max) / t) in f32, masses
// in f64); then the tokens with w ≥ min_p. Both prefix filters therefore cut the sorted order at one position, which
// is a pair (K, n): every token whose order key is above K, and the first n (lowest ids) of those whose key is K. The
// kernel finds K by bisection over the 32-bit order key (count or mass of keys ≥ a probe, one pass each), n from the
// count or mass strictly above K, and the id of the n-th tie by an ordered scan; nothing is sorted. The draw is an
// ordered scan of the kept weights in id order (f64 running sum): the first kept id whose cumulative weight exceeds
// u · total, else the last kept id.

struct SumOp {
    template <typename V> __device__ V operator()(V a, V b) const { return a + b; }
};
struct MaxOp {
    template <typename V> __device__ V operator()(V a, V b) const { return a > b ? a : b; }
};
struct MinOp {
    template <typename V> __device__ V operator()(V a, V b) const { return a < b ? a : b; }
};

// Reduction over the whole block (blockDim.x a multiple of 32) with `identity` for the missing warps; every thread
// gets the result.
template <typename V, typename Op>
__device__ V block_reduce(V v, Op op, V identity) {
    __shared__ V part[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();  // an earlier call may still be reading part[0]
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        V t = lane < warps ? part[lane] : identity;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) t = op(t, __shfl_xor_sync(0xffffffffu, t, o));
        if (lane == 0) part[0] = t;
    }
    __syncthreads();
    return part[0];
}

// Exclusive prefix sum over the block in thread order; `total` gets the block's sum.
__device__ double block_exclusive_sum(double v, double* total) {
    __shared__ double part[33];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    double incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double up = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += up;
    }
    __syncthreads();
    if (lane == 31) part[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        double w = lane < warps ? part[lane] : 0.0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const double up = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += up;
        }
        if (lane < warps) part[lane] = w;  // inclusive over warps
        if (lane == 31) part[32] = w;
    }
    const double before_lane = __shfl_up_sync(0xffffffffu, incl, 1);
    __syncthreads();
    *total = part[32];
    return (warp > 0 ? part[warp - 1] : 0.0) + (lane > 0 ? before_lane : 0.0);
}

// The order key: unsigned order of keys equals f32 total order (−0 below +0).
__device__ __forceinline__ u32 order_key(float x) {
    const u32 b = __float_as_uint(x);
    return b ^ ((b >> 31) ? 0xffffffffu : 0x80000000u);
}

__device__ __forceinline__ float key_value(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
}

struct Row {
    const float* l;
    int vocab;
    float max;
    float t;
    __device__ __forceinline__ float weight(float v) const { return expf((v - max) / t); }
};

__device__ long long count_ge(const Row& row, u32 k) {
    long long c = 0;
    for (int i = threadIdx.x; i < row.vocab; i += blockDim.x) c += order_key(row.l[i]) >= k;
    return block_reduce(c, SumOp(), 0LL);
}

__device__ long long count_eq(const Row& row, u32 k) {
    long long c = 0;
    for (int i = threadIdx.x; i < row.vocab; i += blockDim.x) c += order_key(row.l[i]) == k;
    return block_reduce(c, SumOp(), 0LL);
}

__device__ double mass_ge(const Row& row, u32 k) {
    double m = 0.0;
    for (int i = threadIdx.x; i < row.vocab; i += blockDim.x) {
        const float v = row.l[i];
        if (order_key(v) >= k) m += (double)row.weight(v);
    }
    return block_reduce(m, SumOp(), 0.0);
}

// Mass of keys ≥ k among the tokens top-k keeps: keys above kk, and nk ties of weight wk at kk.
__device__ double topk_mass_ge(const Row& row, u32 k, u32 kk, long long nk, double wk) {
    const u32 from = k > kk + 1 ? k : kk + 1;
    return mass_ge(row, from) + (k <= kk ? (double)nk * wk : 0.0);
}

// The id of the n-th (1-based) token with key k in id order, or vocab when there are fewer.
__device__ int nth_with_key(const Row& row, u32 k, long long n) {
    __shared__ int warp_counts[32];
    __shared__ int result;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    long long seen = 0;
    if (threadIdx.x == 0) result = row.vocab;
    for (int base = 0; base < row.vocab; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const bool hit = i < row.vocab && order_key(row.l[i]) == k;
        const u32 mask = __ballot_sync(0xffffffffu, hit);
        __syncthreads();
        if (lane == 0) warp_counts[warp] = __popc(mask);
        __syncthreads();
        long long before = seen;
        for (int w = 0; w < warp; ++w) before += warp_counts[w];
        const long long rank = before + __popc(mask & ((1u << lane) - 1u)) + 1;
        if (hit && rank == n) result = i;
        for (int w = 0; w < warps; ++w) seen += warp_counts[w];
        if (seen >= n) break;  // uniform: every thread sums the same counts
    }
    __syncthreads();
    return result;
}

// One row: the sampled id, or −1 when the row holds a non-finite value.
__device__ int sample_row_block(const float* logits, int vocab, float t, float top_k_f, float top_p, float min_p,
                                float u) {
    if (!(t > 0.0f)) {
        return block_argmax(logits, vocab);
    }
    float mx = neg_inf_f32();
    u32 kmin = 0xffffffffu, kmax = 0u;
    int bad = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = logits[i];
        if (!isfinite(v)) bad = 1;
        mx = fmaxf(mx, v);
        const u32 k = order_key(v);
        kmin = min(kmin, k);
        kmax = max(kmax, k);
    }
    if (__syncthreads_or(bad)) return -1;
    const Row row = {logits, vocab, block_reduce(mx, MaxOp(), neg_inf_f32()), t};
    kmin = block_reduce(kmin, MinOp(), 0xffffffffu);
    kmax = block_reduce(kmax, MaxOp(), 0u);

    // Top-k: the largest key with at least k tokens at or above it; keep the first nk ties there.
    const long long top_k = (top_k_f >= 1.0f && top_k_f < (float)vocab) ? (long long)top_k_f : 0;
    u32 kc = 0;          // keep keys above kc ...
    long long nc = 0;    // ... and the first nc with key kc (kc 0, nc 0: keep everything finite)
    double wk = 0.0;
    if (top_k > 0) {
        u32 lo = kmin, hi = kmax;
        while (lo < hi) {
            const u32 mid = lo + (u32)(((u64)hi - lo + 1) >> 1);
            if (count_ge(row, mid) >= top_k) lo = mid; else hi = mid - 1;
        }
        kc = lo;
        nc = top_k - count_ge(row, kc + 1);
        wk = (double)row.weight(key_value(kc));
    }
    // Top-p over the top-k survivors: the largest key whose kept mass at or above it reaches the target.
    if (top_p < 1.0f) {
        const u32 kk = kc;
        const long long nk = nc;
        const double total = topk_mass_ge(row, 0u, kk, nk, wk);
        const double target = (double)top_p * total;
        u32 lo = top_k > 0 ? kk : kmin, hi = kmax;
        while (lo < hi) {
            const u32 mid = lo + (u32)(((u64)hi - lo + 1) >> 1);
            if (topk_mass_ge(row, mid, kk, nk, wk) >= target) lo = mid; else hi = mid - 1;
        }
        const u32 kp = lo;
        const double above = topk_mass_ge(row, kp + 1, kk, nk, wk);
        const double wp = (double)row.weight(key_value(kp));
        const long long ties = (top_k > 0 && kp == kk) ? nk : count_eq(row, kp);
        // Tie r (0-based, id order) is kept while the mass before it is below the target; r = 0 always is.
        long long np = ties;
        if (wp > 0.0) {
            const double est = ceil((target - above) / wp);
            if (est < (double)ties + 2.0) {
                long long r = est < 1.0 ? 1 : (long long)est;
                while (r > 1 && above + (double)(r - 1) * wp >= target) --r;
                while (r < ties && above + (double)r * wp < target) ++r;
                np = r < ties ? r : ties;
            }
        }
        kc = kp;
        nc = np;
    }
    // The id of the last kept tie at kc (−1: none; vocab: all of them).
    int idc = -1;
    if (nc > 0) idc = nth_with_key(row, kc, nc);

    // Total kept mass, with min-p on the weights.
    double total = 0.0;
    int last = -1;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = logits[i];
        const u32 k = order_key(v);
        const float w = row.weight(v);
        if ((k > kc || (k == kc && i <= idc)) && (min_p <= 0.0f || w >= min_p)) {
            total += (double)w;
            last = i;
        }
    }
    total = block_reduce(total, SumOp(), 0.0);
    last = block_reduce(last, MaxOp(), -1);
    const double x = (double)u * total;

    // Inverse CDF in id order, four consecutive ids per thread per tile.
    __shared__ int found;
    if (threadIdx.x == 0) found = 0x7fffffff;
    double base = 0.0;
    const int tile = blockDim.x * 4;
    for (int t0 = 0; t0 < vocab; t0 += tile) {
        const int i0 = t0 + threadIdx.x * 4;
        float wv[4];
        double local = 0.0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = i0 + j;
            wv[j] = -1.0f;
            if (i < vocab) {
                const float v = logits[i];
                const u32 k = order_key(v);
                const float w = row.weight(v);
                if ((k > kc || (k == kc && i <= idc)) && (min_p <= 0.0f || w >= min_p)) {
                    wv[j] = w;
                    local += (double)w;
                }
            }
        }
        double tile_total;
        double cum = base + block_exclusive_sum(local, &tile_total);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (wv[j] >= 0.0f) {
                cum += (double)wv[j];
                if (x < cum) {
                    atomicMin(&found, i0 + j);
                    break;
                }
            }
        }
        __syncthreads();
        if (found != 0x7fffffff) break;
        base += tile_total;
    }
    __syncthreads();
    return found != 0x7fffffff ? found : last;
}

// params [rows, 4] = (temperature, top_k, top_p, min_p); uniforms [rows] in [0, 1).
extern "C" __global__ void sample_rows(const float* logits, int vocab, const float* params, const float* uniforms,
                                       int* out) {
    const float* p = params + 4 * (u64)blockIdx.x;
    const int id = sample_row_block(logits + (u64)blockIdx.x * vocab, vocab, p[0], p[1], p[2], p[3],
                                    uniforms[blockIdx.x]);
    if (threadIdx.x == 0) out[blockIdx.x] = id;
}

// One link of a chain of decode steps run without a host round trip (engine/src/gpu/chain.rs), per row: the next
// step's input token, and a copy of this rank's summary of the row (`words` u32 each) and its sampled id into the
// chain's log at this step's offset. The token is the sampled id when the step sampled; else the argmax over the
// ranks' summaries `gathered` (`[world, rows, words]`, rank order; with one rank this rank's own): the largest max
// logit (word 1) wins and the first rank on ties, whose slice holds the lower ids (engine/src/rank/vocab.rs,
// merge_rows). An id outside 0 .. vocab (a NaN anywhere, a sampled −1) feeds token 0: the NaN in the logged summary
// fails the chain on the host, and the embedding never reads out of bounds. CPU twin: `chain_pick` in
// kernels/src/cpu/sample.rs.
extern "C" __global__ void chain_pick(const unsigned* local, const unsigned* gathered, int world, int words,
                                      const int* sampled, int from_sampled, int rows, int vocab, int* tokens,
                                      unsigned* log_words, int* log_ids) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const unsigned* s = local + (size_t)r * words;
    unsigned* l = log_words + (size_t)r * words;
    for (int w = 0; w < words; ++w) l[w] = s[w];
    int id = -1;
    if (from_sampled) {
        id = sampled[r];
    } else {
        float best = 0.0f;
        int nan = 0;
        for (int k = 0; k < world; ++k) {
            const unsigned* g = gathered + ((size_t)k * rows + r) * words;
            const float v = __uint_as_float(g[1]);
            if (v != v) {
                nan = 1;
            } else if (id < 0 || v > best) {
                best = v;
                id = (int)g[0];
            }
        }
        if (nan) id = -1;
    }
    log_ids[r] = from_sampled ? sampled[r] : -1;
    tokens[r] = (id < 0 || id >= vocab) ? 0 : id;
}
