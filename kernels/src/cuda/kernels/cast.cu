// Conversions between f32 and bf16 storage (round to nearest even).

extern "C" __global__ void cast_f32_bf16(const float* __restrict__ x, bf16* __restrict__ out, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        out[i] = from_f32<bf16>(x[i]);
    }
}

extern "C" __global__ void cast_bf16_f32(const bf16* __restrict__ x, float* __restrict__ out, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        out[i] = to_f32(x[i]);
    }
}
