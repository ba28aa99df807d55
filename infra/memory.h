// infra/memory.h - device memory as the step sees it: CUDA error checks, the tracked allocator
// (an arena with a static plan), the device's accounting, the out-of-memory report, and the live
// memory over a step (--mem-trace). infra/memory.cu implements them.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "infra/common.h"

// ---------------------------------------------------------------------------------------------
// Error checks. A failing CUDA call is a runtime failure (exit code 1) naming the call and place;
// an out-of-memory from the CUDA runtime becomes the out-of-memory exit code (3).
void cuda_check(cudaError_t err, const char* what, const char* file, int line);
#define CUDA_CHECK(call) cuda_check((call), #call, __FILE__, __LINE__)
#define CUDA_CHECK_LAUNCH() cuda_check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

// ---------------------------------------------------------------------------------------------
// Tracked device memory: an arena with a static plan.
//
// Every buffer of a step is declared once, by name and category, through Arena::take(). The
// declaring code runs twice: first as a dry run (nothing is allocated, only sizes are summed:
// that is the plan, available without a GPU for --plan), then for real, after one cudaMalloc of
// the planned total. So the peak is known before any compute starts, an out-of-memory is
// reported before the first kernel with the exact number of bytes the step needs, and the plan
// and the allocation cannot disagree: they are the same code.
struct ArenaEntry {
    std::string name;
    MemCategory category;
    int64_t offset, bytes;
};

class Arena {
  public:
    // Dry run: record sizes only. take() returns nullptr.
    Arena() = default;
    // Real: carve from [base, base + capacity) following the same sequence of take() calls.
    void begin_real(char* base, int64_t capacity);

    template <class T>
    T* take(const std::string& name, MemCategory cat, int64_t count) {
        return (T*)take_bytes(name, cat, count * (int64_t)sizeof(T));
    }
    void* take_bytes(const std::string& name, MemCategory cat, int64_t bytes);

    int64_t total() const { return offset_; }
    int64_t category_bytes(int cat) const { return by_category_[cat]; }
    const std::vector<ArenaEntry>& entries() const { return entries_; }
    // Restart the sequence of take() calls (for the real pass after a dry one).
    void rewind();

  private:
    char* base_ = nullptr;
    int64_t capacity_ = 0;
    int64_t offset_ = 0;
    int64_t by_category_[MEM_NUM_CATEGORIES] = {};
    std::vector<ArenaEntry> entries_;
};

// The device as the memory accounting sees it.
struct DeviceMemory {
    int device = 0;
    int sharing = 1;             // ranks on this GPU (--comm host): each counts its equal part
    int64_t total_bytes = 0;     // what the card has (cudaMemGetInfo)
    int64_t runtime_bytes = 0;   // used before our first allocation: CUDA context, cuBLAS
    int64_t emulated_bytes = 0;  // --sim-world: NCCL buffers rank 0 of a real node would hold
    int64_t cap_bytes = 0;       // --mem-cap-gib, or total_bytes without a cap
    char* slab = nullptr;        // the arena's one allocation
    int64_t slab_bytes = 0;
    int64_t driver_used_bytes() const;  // cudaMemGetInfo now: total - free (its part, if shared)
};

// The runtime's share of the device when no GPU is present to measure it (--plan): the CUDA
// context, cuBLAS handle and cuBLASLt on an H200 with CUDA 13.0, and on more than one GPU
// NCCL's buffers for our two communicators, as measured on two H200s (NCCL 2.28,
// NCCL_RUNTIME_CONNECT=0; docs/results.md). For other GPU counts the latter is an estimate.
constexpr double RUNTIME_OVERHEAD_ESTIMATE_GIB = 0.55;
constexpr double NCCL_OVERHEAD_ESTIMATE_GIB = 2.62;
inline double runtime_estimate_gib(int world) {
    return RUNTIME_OVERHEAD_ESTIMATE_GIB + (world > 1 ? NCCL_OVERHEAD_ESTIMATE_GIB : 0.0);
}

// Report an out-of-memory (category breakdown, what the step needs, next stage) and throw the
// exit-code-3 Fatal. `plan` holds what the step needs; `cap_bytes` what the card holds.
[[noreturn]] void report_oom(const Arena& plan, int64_t runtime_bytes, int64_t cap_bytes,
                             const std::string& what, const std::string& hint);

// ---------------------------------------------------------------------------------------------
// --mem-trace: live bytes per category over the last step, at its progress events.
struct Model;
struct MemTracePoint {
    std::string point;  // start, fwd, head, bwd
    int layer = -1;
    double t_ms = 0;    // since the step's start, on the GPU
    int64_t live[MEM_NUM_CATEGORIES] = {};
    int64_t host = 0;   // pinned host memory holding offloaded activations
};
std::vector<MemTracePoint> model_memory_trace(const Model& m, const Arena& arena);
