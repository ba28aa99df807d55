// kernels/attention_ptx.cuh - the PTX wrappers and constants both attention kernel files use
// (attention.cu on mma.sync, attention_hopper.cu on wgmma). Internal to each file that
// includes it.
#pragma once
#include <cstdint>

#include <cuda_bf16.h>

namespace {

constexpr float LOG2E = 1.4426950408889634f;  // exp(x) = exp2(x * LOG2E)
constexpr float LN2 = 0.6931471805599453f;

__device__ inline uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16-byte asynchronous copy into shared memory; with valid == false the destination is zero-filled.
__device__ inline void cp_async16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ inline void cp_async16(void* dst, const void* src, bool valid) { cp_async16(smem_u32(dst), src, valid); }
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ inline void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ inline uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t*)&v;
}

}  // namespace
