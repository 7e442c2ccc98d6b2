// Bandwidth probes for the kernel benchmarks (kernels/src/cuda/timing.rs).
//
// read_probe: every element of src read once, in 16-byte loads, four in flight a thread; nothing is written unless a
// thread's sum hits a value the probe's zeroed buffer never produces, so the loads stay live while the writes stay out
// of the measurement. The replay steps stream their checkpoints read-only, so this, not a copy's read + write rate, is
// the rate they can approach.
extern "C" __global__ void read_probe(const float4* __restrict__ src, u64 n4, float* __restrict__ out) {
    float acc = 0.0f;
    const u64 stride = (u64)gridDim.x * blockDim.x;
#pragma unroll 4
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        const float4 v = src[i];
        acc += (v.x + v.y) + (v.z + v.w);
    }
    if (acc == 1.0e30f) {
        out[0] = acc;
    }
}
