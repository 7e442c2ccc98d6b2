// Embedding gather: out[i] = table[ids[i]]; table [vocab, dim]. An id outside the vocabulary gives a NaN row.

template <typename T>
__device__ void embedding_impl(const T* __restrict__ table, const int* __restrict__ ids, T* __restrict__ out, int dim,
                               int vocab) {
    const int id = ids[blockIdx.x];
    T* orow = out + (u64)blockIdx.x * dim;
    if (id < 0 || id >= vocab) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            orow[i] = from_f32<T>(nan_f32());
        }
        return;
    }
    const T* src = table + (u64)id * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        orow[i] = src[i];
    }
}

#define EMBEDDING(T, S)                                                                                      \
    extern "C" __global__ void embedding_##S(const T* table, const int* ids, T* out, int dim, int vocab) {    \
        embedding_impl<T>(table, ids, out, dim, vocab);                                                      \
    }
EMBEDDING(float, f32)
EMBEDDING(bf16, bf16)
