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
