// kernels/attention_hopper_ptx.cuh - the Hopper (sm_90a) PTX that attention_hopper.cu's kernels are
// written in: mbarriers, TMA copies, register reallocation, wgmma descriptors and products,
// stmatrix and named barriers, one small wrapper each. Only attention_hopper.cu includes it.
#pragma once
#include <cuda.h>  // the CUtensorMap type
#include <cuda_bf16.h>

#include <cstdint>

namespace hopper {

constexpr int HD = 128;  // the head dim of every tile

__device__ inline void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ inline void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival that also announces `bytes` of copies that will complete on this barrier.
__device__ inline void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ inline void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Wait until the barrier's phase with this parity has completed.
__device__ inline void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// One box of a 3-D tensor map (column, row, batch) into shared memory, completing on `bar`.
__device__ inline void tma_load(uint32_t dst, const CUtensorMap* map, uint32_t bar, int col, int row, int batch) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
        "[%2];\n" ::"r"(dst),
        "l"((uint64_t)map), "r"(bar), "r"(col), "r"(row), "r"(batch)
        : "memory");
}
// A [rows][128] tile of head `head`: two boxes of 64 columns.
__device__ inline void tma_tile(uint32_t dst, const CUtensorMap* map, uint32_t bar, int head, int64_t row, int batch,
                                int rows) {
    tma_load(dst, map, bar, head * HD, (int)row, batch);
    tma_load(dst + rows * 128, map, bar, head * HD + 64, (int)row, batch);
}
template <int N>
__device__ inline void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ inline void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }

__device__ inline float exp2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// wgmma shared-memory descriptors, 128-byte swizzle (see the header): bits 0-13 the start
// address / 16, 16-29 the leading byte offset / 16, 32-45 the stride byte offset / 16, 62-63 the
// swizzle mode. A k-slice's descriptor is its tile's plus the slice's offset / 16 in the low word
// (shared addresses are below 256 KB, so the address field does not carry over): one add per
// product instead of rebuilding every field, which takes several instructions per descriptor on
// the path between one product and the next.
__device__ inline uint64_t desc_bits(uint32_t addr, uint32_t offset, uint32_t lead_bytes, uint32_t stride_bytes) {
    const uint32_t lo = ((addr & 0x3FFFF) >> 4 | (lead_bytes >> 4) << 16) + (offset >> 4);
    return (uint64_t)((stride_bytes >> 4) | 1u << 30) << 32 | lo;
}
// K-major: the k-slice 16j..16j+15 of a [R][128] tile (the leading offset is unused).
__device__ inline uint64_t kmajor_desc(uint32_t tile, int j, int R) {
    return desc_bits(tile, (uint32_t)((j >> 2) * R * 128 + (j & 3) * 32), 16, 1024);
}
// MN-major: k-rows 16j..16j+15 of a [R][128] tile read as a 16 x 128 operand (n = columns).
__device__ inline uint64_t mnmajor_desc(uint32_t tile, int j, int R) {
    return desc_bits(tile, (uint32_t)(j * 16 * 128), (uint32_t)(R * 128), 1024);
}

__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ inline void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Keep the compiler from moving accumulator reads and writes across the asynchronous products.
template <int N>
__device__ inline void fence_regs(float* r) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}

// d (64 x 128, fp32) (+)= A (registers, 64 x 16 bf16) * B (shared); MN = 0: B K-major, MN = 1:
// B MN-major (the transpose bit).
template <int MN>
__device__ inline void wgmma_128_rs(float* d, const uint32_t* a, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(MN));
}

// d (64 x 64, fp32) (+)= A (shared) * B (shared); MN = 0: both K-major, MN = 1: both MN-major
// (A's m and B's n contiguous: the transpose bits).
template <int MN = 0>
__device__ inline void wgmma_64_ss(float* d, uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %35;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(scale_d), "n"(MN));
}

// Two floats to shared memory in one 8-byte store (addr a multiple of 8).
__device__ inline void st_shared_v2(uint32_t addr, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}

// Four 8 x 8 bf16 matrices to shared memory (stmatrix): register i of every lane holds row
// lane / 4, columns 2 (lane % 4), +1 of matrix i, and lane l gives the address of row l % 8 of
// matrix l / 8 (16 bytes).
__device__ inline void stmatrix_x4(uint32_t addr, const uint32_t* r) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
                 "r"(r[2]), "r"(r[3])
                 : "memory");
}

// Named barriers (0 is __syncthreads): `count` threads of the consumer warpgroups meet.
__device__ inline void named_barrier(int id, int count) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
// Arrive at a named barrier without waiting for it (the threads that sync on it wait).
__device__ inline void named_arrive(int id, int count) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }

}  // namespace hopper
