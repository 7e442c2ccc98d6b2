// Depthwise causal conv1d with a carried history in a ring (kernels/src/cpu/conv.rs::causal_conv1d; the ring rules
// are engine/src/decode/ssm.rs's), batched over state slots.
//
// x: rows (batch · seq of them) of x_stride elements, the row's channels first (a column range of the projection, so
// the conv reads it in place); out: [batch, seq, channels]; w: [channels, k]; bias: [channels] or null; state_pool: [slots, cap, channels] with
// cap ≥ k − 1 rows per slot. Row b reads slot meta[b * 8] (see replay_common.cuh) whose k − 1 history rows, oldest first, are
// at physical rows (head + j) % cap, head = meta[b * 8 + 6]. With `append` (decode, verify) the row's own inputs are
// written after the history, at logical k − 1 .. k − 2 + seq (the host moves the head by the accepted count, so a
// rejected draft is never part of the history); without it (a prompt chunk) the last k − 1 inputs replace the history
// in place. One thread per (row, channel, run of t_chunk tokens; grid z the runs) walks its run with a sliding window
// in registers, started from the inputs (or the history) before the run: a prompt chunk is one row of many tokens,
// and one thread walking all of them serially would leave the GPU nearly idle. The host keeps t_chunk ≥ k − 1, so
// only the first run reads the history (and, for a prompt chunk, rewrites it). A row whose slot is out of range, or
// whose appended rows would not fit, gets NaN outputs and no state update.

#define CONV_MAX_K 8

template <typename T>
__device__ void conv1d_impl(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                            T* __restrict__ state_pool, const int* __restrict__ meta, int num_slots, int cap,
                            T* __restrict__ out, int seq, int channels, int x_stride, int k, int apply_silu,
                            int append, int t_chunk) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = blockIdx.y;
    const int t0 = blockIdx.z * t_chunk;
    const int t1 = min(seq, t0 + t_chunk);
    if (c >= channels || t0 >= seq) {
        return;
    }
    const T* xb = x + (u64)b * seq * x_stride;
    T* ob = out + (u64)b * seq * channels;
    const int slot = meta[(u64)b * 8];
    const int head = meta[(u64)b * 8 + 6];
    if (slot < 0 || slot >= num_slots || head < 0 || head >= cap || (append && k - 1 + seq > cap)) {
        for (int t = t0; t < t1; ++t) {
            ob[(u64)t * channels + c] = from_f32<T>(nan_f32());
        }
        return;
    }
    T* st = state_pool + (u64)slot * cap * channels;
    float win[CONV_MAX_K];  // win[j]: input at time t − (k − 1) + j
    float wr[CONV_MAX_K];
#pragma unroll
    for (int j = 0; j < CONV_MAX_K; ++j) {
        // Time t0 − (k − 1) + j: an input of the row, or history row (k − 1) + that time (only the first run).
        const int tau = t0 - (k - 1) + j;
        win[j] = (j >= k - 1)  ? 0.0f
                 : (tau >= 0) ? to_f32(xb[(u64)tau * x_stride + c])
                              : to_f32(st[(u64)((head + (k - 1) + tau) % cap) * channels + c]);
        wr[j] = (j < k) ? to_f32(w[(u64)c * k + j]) : 0.0f;
    }
    const float bv = bias ? to_f32(bias[c]) : 0.0f;
    for (int t = t0; t < t1; ++t) {
        const T xraw = xb[(u64)t * x_stride + c];
        const float xt = to_f32(xraw);
        float acc = bv;
#pragma unroll
        for (int j = 0; j < CONV_MAX_K; ++j) {
            if (j < k) {
                acc += wr[j] * (j == k - 1 ? xt : win[j]);
            }
        }
        ob[(u64)t * channels + c] = from_f32<T>(apply_silu ? silu_f(acc) : acc);
        if (append) {
            st[(u64)((head + k - 1 + t) % cap) * channels + c] = xraw;
        }
#pragma unroll
        for (int j = 0; j < CONV_MAX_K - 1; ++j) {
            if (j < k - 2) {
                win[j] = win[j + 1];
            } else if (j == k - 2) {
                win[j] = xt;
            }
        }
    }
    // A prompt chunk's last k − 1 inputs become the history, written by the first run, the only one that read it.
    // When that run covers the row, its final window is exactly those (the old history included when seq < k − 1);
    // otherwise seq > t_chunk ≥ k − 1, so they are all inputs of the row.
    if (!append && t0 == 0) {
#pragma unroll
        for (int j = 0; j < CONV_MAX_K - 1; ++j) {
            if (j < k - 1) {
                const T v = (t1 == seq) ? from_f32<T>(win[j]) : xb[(u64)(seq - (k - 1) + j) * x_stride + c];
                st[(u64)((head + j) % cap) * channels + c] = v;
            }
        }
    }
}

// The same conv for decode and verify rows (append), V channels a thread through 16-byte loads and stores, for kernel
// widths up to CONV_VEC_K (the real models' 4). The host takes it when channels, x_stride and the pointers allow the
// vectors and the batch gives enough threads; prompt chunks (one row of many tokens) take the scalar kernel, spread
// over runs of tokens. A launch outside those terms (no append, a wider kernel) gets NaN outputs.
#define CONV_VEC_K 4
template <typename T, int V>
__device__ void conv1d_vec_impl(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                                T* __restrict__ state_pool, const int* __restrict__ meta, int num_slots, int cap,
                                T* __restrict__ out, int seq, int channels, int x_stride, int k, int apply_silu,
                                int append) {
    typedef Pack<T, V> P;
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * V;
    const int b = blockIdx.y;
    if (c >= channels) {
        return;
    }
    const T* xb = x + (u64)b * seq * x_stride + c;
    T* ob = out + (u64)b * seq * channels + c;
    const int slot = meta[(u64)b * 8];
    const int head = meta[(u64)b * 8 + 6];
    if (slot < 0 || slot >= num_slots || head < 0 || head >= cap || !append || k > CONV_VEC_K || k - 1 + seq > cap) {
        P nan_pack;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            nan_pack.v[i] = from_f32<T>(nan_f32());
        }
        for (int t = 0; t < seq; ++t) {
            *reinterpret_cast<P*>(ob + (u64)t * channels) = nan_pack;
        }
        return;
    }
    T* st = state_pool + (u64)slot * cap * channels + c;
    float win[CONV_VEC_K - 1][V];  // win[j][i]: channel c + i's input at time t − (k − 1) + j
    float wr[CONV_VEC_K][V];
    float bv[V];
#pragma unroll
    for (int j = 0; j < CONV_VEC_K - 1; ++j) {
        if (j < k - 1) {
            const P p = *reinterpret_cast<const P*>(st + (u64)((head + j) % cap) * channels);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                win[j][i] = to_f32(p.v[i]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < V; ++i) {
                win[j][i] = 0.0f;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < V; ++i) {
#pragma unroll
        for (int j = 0; j < CONV_VEC_K; ++j) {
            wr[j][i] = (j < k) ? to_f32(w[(u64)(c + i) * k + j]) : 0.0f;
        }
        bv[i] = bias ? to_f32(bias[c + i]) : 0.0f;
    }
    for (int t = 0; t < seq; ++t) {
        const P xp = *reinterpret_cast<const P*>(xb + (u64)t * x_stride);
        P op;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const float xt = to_f32(xp.v[i]);
            float acc = bv[i];
#pragma unroll
            for (int j = 0; j < CONV_VEC_K; ++j) {
                if (j < k) {
                    acc += wr[j][i] * (j == k - 1 ? xt : win[j][i]);
                }
            }
            op.v[i] = from_f32<T>(apply_silu ? silu_f(acc) : acc);
#pragma unroll
            for (int j = 0; j < CONV_VEC_K - 1; ++j) {
                if (j < k - 2) {
                    win[j][i] = win[j + 1][i];
                } else if (j == k - 2) {
                    win[j][i] = xt;
                }
            }
        }
        *reinterpret_cast<P*>(ob + (u64)t * channels) = op;
        *reinterpret_cast<P*>(st + (u64)((head + k - 1 + t) % cap) * channels) = xp;
    }
}

#define CONV(T, S, V)                                                                                             \
    extern "C" __global__ void conv1d_##S(const T* x, const T* w, const T* bias, T* state_pool, const int* meta,   \
                                          int num_slots, int cap, T* out, int seq, int channels, int x_stride,     \
                                          int k, int apply_silu, int append, int t_chunk) {                        \
        conv1d_impl<T>(x, w, bias, state_pool, meta, num_slots, cap, out, seq, channels, x_stride, k, apply_silu,  \
                       append, t_chunk);                                                                           \
    }                                                                                                              \
    extern "C" __global__ void conv1d_vec_##S(const T* x, const T* w, const T* bias, T* state_pool,                \
                                              const int* meta, int num_slots, int cap, T* out, int seq,            \
                                              int channels, int x_stride, int k, int apply_silu, int append) {     \
        conv1d_vec_impl<T, V>(x, w, bias, state_pool, meta, num_slots, cap, out, seq, channels, x_stride, k,       \
                              apply_silu, append);                                                                 \
    }
CONV(float, f32, 4)
CONV(bf16, bf16, 8)
