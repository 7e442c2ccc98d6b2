// One-pass LM-head summaries (FlashSpec; CPU twin kernels/src/cpu/lm_head.rs). The head's logits exist only one
// bounded chunk of the vocabulary at a time; `head_summary_parts` folds a chunk into per-row partial summaries — the
// argmax and its logit, the log-sum-exp, and for a speculative row the LSE of logit/τ, the drafted token's scaled
// logit and a Gumbel-max candidate that skips the draft — and `head_summary_merge` folds a row's partials into its
// summary. Nothing of the vocabulary's size is written per row.
//
// A summary is 8 words: argmax (i32), max, lse, spec lse, drafted, has-drafted (i32), candidate (i32), score. A NaN
// anywhere in a row makes its max and lse NaN (the argmax is then over the other values, as on the CPU).
//
// Per row the spec words are 6: draft (i32: −2 not speculative, −1 speculative without a draft), 1/τ (f32 bits),
// seed (lo, hi), index (lo, hi).

#define HEAD_WORDS 8
#define SPEC_WORDS 6
#define HEAD_THREADS 256

struct HeadSum {
    int arg;      // the argmax (−1: nothing seen yet) and its logit
    float amax;
    float lm;     // log-sum-exp of the logits as a pair (max, Σ exp(v − max))
    float ls;
    int nan;
    float sm;     // spec: the same pair for v/τ
    float ss;
    float drafted;
    int has_draft;
    int cand;     // the Gumbel-max candidate (−1: none yet) and its score
    float score;
};

__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

// kernels/src/cpu/lm_head.rs::uniform_at: the same integer mixing, so the same 23 bits, centred in their cell (every
// centre is exact in f32, so the uniform is never 0 or 1 and the Gumbel value is finite).
__device__ __forceinline__ float uniform_at(u64 seed, u64 index, u32 id) {
    const u64 h = mix64(mix64(seed ^ mix64(index + 0x9e3779b97f4a7c15ULL)) ^ (u64)id);
    return ((float)(h >> 41) + 0.5f) * (1.0f / 8388608.0f);
}

// Merges the (max, Σ exp(v − max)) pairs of two disjoint sets; an empty set is (−∞, 0).
__device__ __forceinline__ void lse_pair_merge(float& m, float& s, float m2, float s2) {
    if (m2 == neg_inf_f32()) return;
    if (m == neg_inf_f32()) {
        m = m2;
        s = s2;
        return;
    }
    const float mm = fmaxf(m, m2);
    s = s * expf(m - mm) + s2 * expf(m2 - mm);
    m = mm;
}

// Adds one value to a pair with a single exp.
__device__ __forceinline__ void lse_pair_add(float& m, float& s, float v) {
    if (v == neg_inf_f32()) return;
    if (m == neg_inf_f32()) {
        m = v;
        s = 1.0f;
    } else if (v <= m) {
        s += expf(v - m);
    } else {
        s = s * expf(m - v) + 1.0f;
        m = v;
    }
}

__device__ __forceinline__ HeadSum head_sum_empty() {
    HeadSum s;
    s.arg = -1;
    s.amax = neg_inf_f32();
    s.lm = neg_inf_f32();
    s.ls = 0.0f;
    s.nan = 0;
    s.sm = neg_inf_f32();
    s.ss = 0.0f;
    s.drafted = 0.0f;
    s.has_draft = 0;
    s.cand = -1;
    s.score = neg_inf_f32();
    return s;
}

// Merges the summaries of two disjoint id sets, with the CPU's tie rules: the lowest id among equal maxima and
// among equal scores.
__device__ __forceinline__ HeadSum head_sum_combine(HeadSum a, const HeadSum& b) {
    if (b.arg >= 0 && (a.arg < 0 || b.amax > a.amax || (b.amax == a.amax && b.arg < a.arg))) {
        a.arg = b.arg;
        a.amax = b.amax;
    }
    lse_pair_merge(a.lm, a.ls, b.lm, b.ls);
    a.nan |= b.nan;
    lse_pair_merge(a.sm, a.ss, b.sm, b.ss);
    if (b.has_draft) {
        a.drafted = b.drafted;
        a.has_draft = 1;
    }
    if (b.cand >= 0 && (a.cand < 0 || b.score > a.score || (b.score == a.score && b.cand < a.cand))) {
        a.cand = b.cand;
        a.score = b.score;
    }
    return a;
}

__device__ __forceinline__ HeadSum head_sum_shfl(const HeadSum& a, int o) {
    HeadSum b;
    b.arg = __shfl_xor_sync(0xffffffffu, a.arg, o);
    b.amax = __shfl_xor_sync(0xffffffffu, a.amax, o);
    b.lm = __shfl_xor_sync(0xffffffffu, a.lm, o);
    b.ls = __shfl_xor_sync(0xffffffffu, a.ls, o);
    b.nan = __shfl_xor_sync(0xffffffffu, a.nan, o);
    b.sm = __shfl_xor_sync(0xffffffffu, a.sm, o);
    b.ss = __shfl_xor_sync(0xffffffffu, a.ss, o);
    b.drafted = __shfl_xor_sync(0xffffffffu, a.drafted, o);
    b.has_draft = __shfl_xor_sync(0xffffffffu, a.has_draft, o);
    b.cand = __shfl_xor_sync(0xffffffffu, a.cand, o);
    b.score = __shfl_xor_sync(0xffffffffu, a.score, o);
    return b;
}

// The whole block's merge of every thread's `s`; thread 0's return value is the result.
__device__ HeadSum head_sum_block(HeadSum s) {
    __shared__ HeadSum part[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s = head_sum_combine(s, head_sum_shfl(s, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < (int)((blockDim.x + 31) >> 5) ? part[lane] : head_sum_empty();
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s = head_sum_combine(s, head_sum_shfl(s, o));
    }
    return s;
}

__device__ __forceinline__ float pair_lse(float m, float s) { return isfinite(m) ? m + logf(s) : m; }

// The stored form of a summary: 8 words, the pairs turned into log-sum-exps.
__device__ void head_sum_store(const HeadSum& s, u32* out) {
    out[0] = (u32)(s.arg < 0 ? 0 : s.arg);
    out[1] = __float_as_uint(s.nan ? nan_f32() : s.amax);
    out[2] = __float_as_uint(s.nan ? nan_f32() : pair_lse(s.lm, s.ls));
    out[3] = __float_as_uint(pair_lse(s.sm, s.ss));
    out[4] = __float_as_uint(s.drafted);
    out[5] = (u32)s.has_draft;
    out[6] = (u32)(s.cand < 0 ? 0 : s.cand);
    out[7] = __float_as_uint(s.score);
}

// Back from the stored form: a log-sum-exp `l` is the pair (l, 1). A NaN row keeps its argmax over the other
// values; its sums no longer matter.
__device__ HeadSum head_sum_load(const u32* in) {
    HeadSum s = head_sum_empty();
    const float amax = __uint_as_float(in[1]);
    const float lse = __uint_as_float(in[2]);
    s.nan = amax != amax;
    if (!s.nan && amax != neg_inf_f32()) {
        s.arg = (int)in[0];
        s.amax = amax;
    }
    if (!s.nan && lse != neg_inf_f32()) {
        s.lm = lse;
        s.ls = 1.0f;
    }
    const float slse = __uint_as_float(in[3]);
    if (slse == slse && slse != neg_inf_f32()) {
        s.sm = slse;
        s.ss = 1.0f;
    }
    s.drafted = __uint_as_float(in[4]);
    s.has_draft = (int)in[5];
    s.score = __uint_as_float(in[7]);
    s.cand = s.score == neg_inf_f32() ? -1 : (int)in[6];
    return s;
}

// Grid (parts of this chunk, rows), HEAD_THREADS threads. Block (p, r) folds logits[r · ld + lo .. hi) — ids
// first_id + lo .. — where lo = p · width, into parts[(r · total_parts + part_offset + p) · 8].
extern "C" __global__ void head_summary_parts(const float* __restrict__ logits, int ld, int len, int first_id,
                                              int width, const u32* __restrict__ spec, u32* __restrict__ parts,
                                              int total_parts, int part_offset) {
    const int p = blockIdx.x, r = blockIdx.y;
    const int lo = p * width;
    const int hi = min(len, lo + width);
    const float* row = logits + (u64)r * ld;
    const u32* sp = spec + (u64)r * SPEC_WORDS;
    const int draft = (int)sp[0];
    const bool speculative = draft >= -1;
    const float inv = __uint_as_float(sp[1]);
    const u64 seed = (u64)sp[2] | ((u64)sp[3] << 32);
    const u64 index = (u64)sp[4] | ((u64)sp[5] << 32);
    HeadSum s = head_sum_empty();
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float v = row[i];
        const int id = first_id + i;
        if (v != v) {
            s.nan = 1;
            continue;
        }
        if (s.arg < 0 || v > s.amax) {
            s.arg = id;
            s.amax = v;
        }
        lse_pair_add(s.lm, s.ls, v);
        if (speculative) {
            const float sv = v * inv;
            lse_pair_add(s.sm, s.ss, sv);
            if (id == draft) {
                s.drafted = sv;
                s.has_draft = 1;
            } else {
                const float score = sv - logf(-logf(uniform_at(seed, index, (u32)id)));
                if (s.cand < 0 || score > s.score) {
                    s.cand = id;
                    s.score = score;
                }
            }
        }
    }
    s = head_sum_block(s);
    if (threadIdx.x == 0) head_sum_store(s, parts + ((u64)r * total_parts + part_offset + p) * HEAD_WORDS);
}

// One block per row: folds its `seen` partials (of total_parts) into out[r · 8].
extern "C" __global__ void head_summary_merge(const u32* __restrict__ parts, int total_parts, int seen,
                                              u32* __restrict__ out) {
    const int r = blockIdx.x;
    HeadSum s = head_sum_empty();
    for (int p = threadIdx.x; p < seen; p += blockDim.x) {
        s = head_sum_combine(s, head_sum_load(parts + ((u64)r * total_parts + p) * HEAD_WORDS));
    }
    s = head_sum_block(s);
    if (threadIdx.x == 0) head_sum_store(s, out + (u64)r * HEAD_WORDS);
}

// Judges each sequence's speculative verify from its rows' summaries on the device, so that the accepted count and
// the next token need not travel to the host (CPU twin: kernels/src/cpu/accept.rs, judge). Sequence q's verify has
// t = drafts + 1 rows, q·t … q·t + t − 1 of `gathered` ([world, seqs · t, 8], rank order; one rank: its own
// summaries), merged over the ranks with head_sum_combine. Greedy: accept while the argmax is the draft, else the
// argmax replaces it; sampled: accept while uniform_at(seed, index + i, ACCEPT_ID) < exp(drafted − LSE of ℓ/τ), else
// the Gumbel-max candidate replaces it; the last row gives the bonus. params [seqs, 5]: sampled flag, seed (lo, hi),
// index of row 0's output (lo, hi); drafts [seqs, t − 1]. out [seqs, 2]: accepted count and token; token −1 when the
// replacing row had nothing left to resample (sampled) or any row of the verify held a NaN (the host fails that
// verify; the CPU twin never sees such rows, which the host rejects before judging). A row whose maximum is −∞ (no
// finite logit) has no argmax here. One thread a sequence.
extern "C" __global__ void spec_accept(const u32* __restrict__ gathered, int world, int seqs, int t,
                                       const int* __restrict__ drafts, const u32* __restrict__ params,
                                       int* __restrict__ out) {
    const int q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= seqs) return;
    const u64 rows = (u64)seqs * t;
    const u32* pw = params + (u64)q * 5;
    const bool sampled = pw[0] != 0;
    const u64 seed = (u64)pw[1] | ((u64)pw[2] << 32);
    const u64 index = (u64)pw[3] | ((u64)pw[4] << 32);
    int accepted = t - 1, token = -1;
    for (int i = 0; i < t; ++i) {
        const u64 r = (u64)q * t + i;
        HeadSum s = head_sum_load(gathered + r * HEAD_WORDS);
        for (int k = 1; k < world; ++k) {
            s = head_sum_combine(s, head_sum_load(gathered + ((u64)k * rows + r) * HEAD_WORDS));
        }
        bool accept = false;
        if (i < t - 1) {
            const int d = drafts[(u64)q * (t - 1) + i];
            if (sampled) {
                const float p = s.has_draft ? expf(s.drafted - pair_lse(s.sm, s.ss)) : 0.0f;
                accept = uniform_at(seed, index + (u64)i, 0xffffffffu) < p;
            } else {
                accept = s.arg == d;
            }
        }
        if (!accept) {
            accepted = i;
            token = sampled ? s.cand : s.arg;
            break;
        }
    }
    // A NaN in any row of the verify (a rank's max word is NaN then) fails it, as the host fails a step with a NaN
    // row before judging it: the token is −1 whichever row held it.
    for (u64 k = 0; k < (u64)world && token >= 0; ++k) {
        for (int i = 0; i < t; ++i) {
            const float m = __uint_as_float(gathered[(k * rows + (u64)q * t + i) * HEAD_WORDS + 1]);
            if (m != m) {
                token = -1;
                break;
            }
        }
    }
    out[2 * q] = accepted;
    out[2 * q + 1] = token;
}

// Log-probability rows (CPU twin: kernels/src/cpu/lm_head.rs, TopK and LogprobSummary): per asking row its k ≤ 20
// largest logits, best first with ties to the lower id (NaNs never entries), and the logit of a target id. A stored
// top list is TOPK_WORDS words: count, ids[20], logits[20] (f32 bits), has-target, target logit. Rows that ask for
// nothing are not launched over: `lp_rows` lists the asking rows' indices among the chunk's rows.
#define TOPK_MAX 20
#define TOPK_WORDS (2 * TOPK_MAX + 3)

// Whether (v, id) ranks before (w, jd): larger value, then lower id; id −1 is no entry and ranks last.
__device__ __forceinline__ bool topk_before(float v, int id, float w, int jd) {
    if (id < 0) return false;
    if (jd < 0) return true;
    return v > w || (v == w && id < jd);
}

// The block's best candidate (each thread offers one; id −1: none); every thread gets it.
__device__ void topk_block_best(float& v, int& id) {
    __shared__ float sv[32];
    __shared__ int sid[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        const int jd = __shfl_xor_sync(0xffffffffu, id, o);
        if (topk_before(w, jd, v, id)) {
            v = w;
            id = jd;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        sv[warp] = v;
        sid[warp] = id;
    }
    __syncthreads();
    const int warps = (int)((blockDim.x + 31) >> 5);
    v = neg_inf_f32();
    id = -1;
    for (int w = 0; w < warps; ++w) {
        if (topk_before(sv[w], sid[w], v, id)) {
            v = sv[w];
            id = sid[w];
        }
    }
}

// Grid (parts of this chunk, asking rows), HEAD_THREADS threads. Block (p, j) takes row lp_rows[j] of the chunk's
// logits (ids first_id + lo .. first_id + hi, lo = p · width) and writes its top list into
// parts[(j · total_parts + part_offset + p) · TOPK_WORDS]. req [asking rows, 2]: k, target id (i32, −1: none).
// k rounds, each the block's best entry ranking after the last one taken.
extern "C" __global__ void head_topk_parts(const float* __restrict__ logits, int ld, int len, int first_id, int width,
                                           const int* __restrict__ lp_rows, const int* __restrict__ req,
                                           u32* __restrict__ parts, int total_parts, int part_offset) {
    const int p = blockIdx.x, j = blockIdx.y;
    const int lo = p * width;
    const int hi = min(len, lo + width);
    const float* row = logits + (u64)lp_rows[j] * ld;
    const int k = min(req[2 * j], TOPK_MAX);
    const int target = req[2 * j + 1];
    u32* out = parts + ((u64)j * total_parts + part_offset + p) * TOPK_WORDS;
    float last_v = 0.0f;
    int last_id = -1;
    int n = 0;
    for (; n < k; ++n) {
        float v = neg_inf_f32();
        int id = -1;
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            const float x = row[i];
            const int xid = first_id + i;
            if (x != x) continue;
            if (last_id >= 0 && !topk_before(last_v, last_id, x, xid)) continue;
            if (topk_before(x, xid, v, id)) {
                v = x;
                id = xid;
            }
        }
        topk_block_best(v, id);
        if (id < 0) break;
        if (threadIdx.x == 0) {
            out[1 + n] = (u32)id;
            out[1 + TOPK_MAX + n] = __float_as_uint(v);
        }
        last_v = v;
        last_id = id;
    }
    if (threadIdx.x == 0) {
        out[0] = (u32)n;
        const bool here = target >= first_id + lo && target < first_id + hi;
        out[1 + 2 * TOPK_MAX] = here ? 1u : 0u;
        out[2 + 2 * TOPK_MAX] = here ? __float_as_uint(row[target - first_id]) : 0u;
    }
}

// One block per asking row: merges its `seen` top lists (of total_parts) into out[j · TOPK_WORDS], k rounds over the
// lists' entries as the parts kernel runs over logits.
extern "C" __global__ void head_topk_merge(const u32* __restrict__ parts, int total_parts, int seen,
                                           const int* __restrict__ req, u32* __restrict__ out) {
    const int j = blockIdx.x;
    const int k = min(req[2 * j], TOPK_MAX);
    const u32* base = parts + (u64)j * total_parts * TOPK_WORDS;
    u32* o = out + (u64)j * TOPK_WORDS;
    float last_v = 0.0f;
    int last_id = -1;
    int n = 0;
    for (; n < k; ++n) {
        float v = neg_inf_f32();
        int id = -1;
        for (int c = threadIdx.x; c < seen * TOPK_MAX; c += blockDim.x) {
            const u32* part = base + (u64)(c / TOPK_MAX) * TOPK_WORDS;
            const int e = c % TOPK_MAX;
            if (e >= (int)part[0]) continue;
            const int xid = (int)part[1 + e];
            const float x = __uint_as_float(part[1 + TOPK_MAX + e]);
            if (last_id >= 0 && !topk_before(last_v, last_id, x, xid)) continue;
            if (topk_before(x, xid, v, id)) {
                v = x;
                id = xid;
            }
        }
        topk_block_best(v, id);
        if (id < 0) break;
        if (threadIdx.x == 0) {
            o[1 + n] = (u32)id;
            o[1 + TOPK_MAX + n] = __float_as_uint(v);
        }
        last_v = v;
        last_id = id;
    }
    if (threadIdx.x == 0) {
        o[0] = (u32)n;
        o[1 + 2 * TOPK_MAX] = 0u;
        o[2 + 2 * TOPK_MAX] = 0u;
        for (int p = 0; p < seen; ++p) {
            const u32* part = base + (u64)p * TOPK_WORDS;
            if (part[1 + 2 * TOPK_MAX]) {
                o[1 + 2 * TOPK_MAX] = 1u;
                o[2 + 2 * TOPK_MAX] = part[2 + 2 * TOPK_MAX];
                break;
            }
        }
    }
}
