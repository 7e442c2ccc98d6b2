// MoE routing (kernels/src/cpu/moe.rs) and the grouping of assignments by expert. f32 logits; one block per token.
// Picks are ordered by decreasing selection score, ties towards the lower expert id, as the CPU twin orders them.

#define ROUTE_MAX_GROUPS 64

// The better of two (value, index) candidates: larger value, then lower index.
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// Block-wide argmax over vals[0..n) (blockDim.x a multiple of 32); every thread gets the winner's index.
__device__ int block_argmax(const float* vals, int n) {
    __shared__ float wv[32];
    __shared__ int wi[32];
    float v = neg_inf_f32();
    int i = 0x7fffffff;
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        better(v, i, vals[e], e);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        better(v, i, ov, oi);
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        wv[warp] = v;
        wi[warp] = i;
    }
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x >> 5;
        v = lane < warps ? wv[lane] : neg_inf_f32();
        i = lane < warps ? wi[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, v, o);
            const int oi = __shfl_xor_sync(0xffffffffu, i, o);
            better(v, i, ov, oi);
        }
        if (lane == 0) {
            wi[0] = i;
        }
    }
    __syncthreads();
    return wi[0];
}

__device__ float block_max(float v) {
    __shared__ float partial[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        partial[warp] = v;
    }
    __syncthreads();
    float r = neg_inf_f32();
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
        r = fmaxf(r, partial[w]);
    }
    return r;
}

// Picks top_k entries of `choice` (destroyed), writing ids and the matching `value` entries into sel.
__device__ void pick_top_k(float* choice, const float* value, int n, int top_k, int* ids, float* sel) {
    for (int kk = 0; kk < top_k; ++kk) {
        const int best = block_argmax(choice, n);
        if (threadIdx.x == 0) {
            ids[kk] = best;
            sel[kk] = value[best];
            choice[best] = neg_inf_f32();
        }
        __syncthreads();
    }
}

// Dynamic shared memory: 2 · experts + top_k floats.
extern "C" __global__ void route_softmax(const float* __restrict__ logits, int* __restrict__ ids,
                                         float* __restrict__ weights, int experts, int top_k, int norm_topk) {
    extern __shared__ float smem[];
    float* probs = smem;
    float* work = smem + experts;
    float* sel = work + experts;
    const u64 t = blockIdx.x;
    const float* row = logits + t * experts;
    float mx = neg_inf_f32();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        mx = fmaxf(mx, row[e]);
    }
    mx = block_max(mx);
    float part = 0.0f;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        const float p = expf(row[e] - mx);
        probs[e] = p;
        part += p;
    }
    const float sum = block_sum(part);
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        probs[e] /= sum;
        work[e] = probs[e];
    }
    __syncthreads();
    pick_top_k(work, probs, experts, top_k, ids + t * top_k, sel);
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int kk = 0; kk < top_k; ++kk) {
            total += sel[kk];
        }
        for (int kk = 0; kk < top_k; ++kk) {
            weights[t * top_k + kk] = norm_topk ? sel[kk] / total : sel[kk];
        }
    }
}

// Dynamic shared memory: 2 · experts + top_k floats. Groups (consecutive experts) are scored by the sum of their two
// best biased scores; experts outside the best topk_group groups are masked before the top_k pick.
extern "C" __global__ void route_sigmoid_grouped(const float* __restrict__ logits, const float* __restrict__ bias,
                                                 int* __restrict__ ids, float* __restrict__ weights, int experts,
                                                 int top_k, int n_group, int topk_group, int norm_topk,
                                                 float scaling) {
    extern __shared__ float smem[];
    __shared__ float group_score[ROUTE_MAX_GROUPS];
    __shared__ int kept[ROUTE_MAX_GROUPS];
    float* scores = smem;
    float* choice = smem + experts;
    float* sel = choice + experts;
    const u64 t = blockIdx.x;
    const float* row = logits + t * experts;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        const float s = 1.0f / (1.0f + expf(-row[e]));
        scores[e] = s;
        choice[e] = s + bias[e];
    }
    __syncthreads();
    if (topk_group < n_group) {
        const int per_group = experts / n_group;
        for (int gi = threadIdx.x; gi < n_group; gi += blockDim.x) {
            const float* c = choice + gi * per_group;
            float v0 = neg_inf_f32(), v1 = neg_inf_f32();
            int i0 = 0x7fffffff, i1 = 0x7fffffff;
            for (int e = 0; e < per_group; ++e) {
                float v = c[e];
                int i = e;
                if (v > v0 || (v == v0 && i < i0)) {
                    const float tv = v0;
                    const int ti = i0;
                    v0 = v;
                    i0 = i;
                    v = tv;
                    i = ti;
                }
                better(v1, i1, v, i);
            }
            group_score[gi] = v0 + v1;
            kept[gi] = 0;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int kk = 0; kk < topk_group; ++kk) {
                float bv = neg_inf_f32();
                int bi = 0x7fffffff;
                for (int gi = 0; gi < n_group; ++gi) {
                    if (!kept[gi]) {
                        better(bv, bi, group_score[gi], gi);
                    }
                }
                kept[bi] = 1;
            }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < experts; e += blockDim.x) {
            if (!kept[e / per_group]) {
                choice[e] = neg_inf_f32();
            }
        }
        __syncthreads();
    }
    pick_top_k(choice, scores, experts, top_k, ids + t * top_k, sel);
    if (threadIdx.x == 0) {
        float den = 0.0f;
        for (int kk = 0; kk < top_k; ++kk) {
            den += sel[kk];
        }
        den += 1e-20f;
        for (int kk = 0; kk < top_k; ++kk) {
            float w = norm_topk ? sel[kk] / den : sel[kk];
            weights[t * top_k + kk] = w * scaling;
        }
    }
}

// Groups the n = tokens · top_k assignments by expert in one block: a shared-memory histogram, its exclusive scan
// (offsets [experts + 1]), then each assignment's place in its expert's run: rows[p] = its token, pos[a] = p. Within an
// expert the order of rows is whatever the shared-memory counters hand out; nothing downstream depends on it (every
// row's GEMM is independent and moe_combine reads through pos). Ids out of range get pos −1 and no row. Dynamic shared
// memory: experts ints.
extern "C" __global__ void moe_align(const int* __restrict__ ids, int n, int top_k, int experts,
                                     int* __restrict__ offsets, int* __restrict__ rows, int* __restrict__ pos) {
    extern __shared__ int counts[];
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        counts[e] = 0;
    }
    __syncthreads();
    for (int a = threadIdx.x; a < n; a += blockDim.x) {
        const int e = ids[a];
        if (e >= 0 && e < experts) {
            atomicAdd(&counts[e], 1);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0;
        for (int e = 0; e < experts; ++e) {
            const int c = counts[e];
            counts[e] = run;
            offsets[e] = run;
            run += c;
        }
        offsets[experts] = run;
    }
    __syncthreads();
    for (int a = threadIdx.x; a < n; a += blockDim.x) {
        const int e = ids[a];
        if (e >= 0 && e < experts) {
            const int p = atomicAdd(&counts[e], 1);
            rows[p] = a / top_k;
            pos[a] = p;
        } else {
            pos[a] = -1;
        }
    }
}
