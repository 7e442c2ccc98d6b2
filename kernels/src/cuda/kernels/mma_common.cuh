// Tensor-core building blocks shared by the modules that use them (attention_flash, moe_tc, ssd_tc): placed after
// common.cuh and before the module's own source. Only mma.sync / ldmatrix / cp.async: these run on sm_80 and later,
// Hopper (sm_90) and Blackwell (sm_100 / sm_103) alike.
//
// Fragment layout of mma.sync m16n8k16 (bf16 in, f32 accumulate), used throughout: lane = 4·g + c4; accumulator e of
// an m16n8 tile is row g + 8·(e / 2), column 2·c4 + e % 2. Operand tiles live in shared memory as rows of 16-byte
// chunks (8 bf16), swizzled by swz<> below.

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16 bytes global → shared, asynchronously; src_bytes 0 writes zeros (padding past a range must be zeros, not stale
// data: its weight in the product is 0, but 0 · NaN would poison the accumulator).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// d += a · b for one m16n8k16 tile (bf16 operands, f32 accumulators).
__device__ __forceinline__ void mma_bf16(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 → bf16x2, round to nearest even; lo lands in the low half (the lower column of an mma fragment).
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Element offset of 16-byte chunk c of row r in a [rows][D] bf16 tile. The chunk index is XORed with the row so that
// the 8 rows one ldmatrix phase reads sit in 8 different bank groups (rows are multiples of 128 bytes apart).
template <int D> __device__ __forceinline__ int swz(int r, int c) {
    constexpr int CPR = D / 8;
    constexpr int MASK = (CPR < 8 ? CPR : 8) - 1;
    return r * D + ((c ^ (r & MASK)) << 3);
}
