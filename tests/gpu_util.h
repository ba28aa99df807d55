// tests/gpu_util.h - device buffers for the GPU tests: upload float64 test data as bf16/fp32,
// download results as float64, poison outputs so unwritten elements show up as NaN.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "../llama.h"
#include "test_util.h"

template <class T>
struct DeviceBuffer {
    T* ptr = nullptr;
    int64_t n = 0;
    explicit DeviceBuffer(int64_t n_) : n(n_) { CUDA_CHECK(cudaMalloc(&ptr, std::max<int64_t>(n, 1) * sizeof(T))); }
    ~DeviceBuffer() { cudaFree(ptr); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    operator T*() const { return ptr; }
};

inline double bf16_round(double x) { return (double)__bfloat162float(__float2bfloat16((float)x)); }

// Round to bf16 in place: the reference then sees exactly the GPU's inputs.
inline std::vector<double> rounded_bf16(std::vector<double> v) {
    for (auto& x : v) x = bf16_round(x);
    return v;
}

inline void upload(bf16* dst, const std::vector<double>& v) {
    std::vector<bf16> h(v.size());
    for (size_t i = 0; i < v.size(); i++) h[i] = __float2bfloat16((float)v[i]);
    CUDA_CHECK(cudaMemcpy(dst, h.data(), h.size() * sizeof(bf16), cudaMemcpyHostToDevice));
}
inline void upload(float* dst, const std::vector<double>& v) {
    std::vector<float> h(v.begin(), v.end());
    CUDA_CHECK(cudaMemcpy(dst, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
}
inline void upload(int32_t* dst, const std::vector<int32_t>& v) {
    CUDA_CHECK(cudaMemcpy(dst, v.data(), v.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
}

inline std::vector<double> download(const bf16* src, int64_t n) {
    std::vector<bf16> h(n);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(h.data(), src, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    std::vector<double> v(n);
    for (int64_t i = 0; i < n; i++) v[i] = __bfloat162float(h[i]);
    return v;
}
inline std::vector<double> download(const float* src, int64_t n) {
    std::vector<float> h(n);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(h.data(), src, n * sizeof(float), cudaMemcpyDeviceToHost));
    return std::vector<double>(h.begin(), h.end());
}

// Fill with NaN (0xFFFF in bf16, 0xFFFFFFFF in fp32): any element a kernel fails to write fails
// the comparison.
template <class T>
inline void poison(T* p, int64_t n) {
    CUDA_CHECK(cudaMemset(p, 0xFF, n * sizeof(T)));
}

// Columns [c0, c0 + w) of a row-major [rows, ld] matrix.
inline std::vector<double> columns(const std::vector<double>& m, int64_t rows, int64_t ld, int64_t c0, int64_t w) {
    std::vector<double> out(rows * w);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < w; c++) out[r * w + c] = m[r * ld + c0 + c];
    return out;
}

// The tolerances of docs/design.md against float64: fp32 results under 1e-5, bf16 results under 1e-2.
constexpr double TOL_FP32 = 1e-5;
constexpr double TOL_BF16 = 1e-2;

// Plan and allocate a model's buffers with the whole GPU as its cap (the tests' models).
inline void allocate_on_whole_gpu(Model& m, DeviceMemory& dm) {
    Arena arena;
    model_declare_buffers(m, arena);
    size_t free_b, total_b;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    dm.cap_bytes = dm.total_bytes = (int64_t)total_b;
    dm.runtime_bytes = (int64_t)(total_b - free_b);
    model_allocate(m, arena, dm, "");
}
