// infra/timeline.h - --timeline FILE: when each part of the last step ran (infra/timeline.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

struct Model;

// ---------------------------------------------------------------------------------------------
// Marks of the last step, per stream, in ms from its start; each call does nothing unless
// timeline_enable was called.
struct TimelineEntry {
    std::string stream, what;
    int layer;  // the layer, or for "fsdp" marks the unit
    double start_ms, end_ms;
    int64_t bytes;  // what a copy or a collective moved (0 for compute)
};
void timeline_enable(Model& m);
void timeline_destroy(Model& m);
void timeline_step_begin(Model& m, cudaStream_t s);
void timeline_step_end(Model& m);
// A mark from its construction to the end of its scope: the work queued on s in between, which
// does `what` for layer l (fsdp marks: the unit) and moves `bytes`. `stream` and `what` are kept
// until the timeline is read: string literals. Without a timeline, or outside a step, nothing.
class TimelineMark {
  public:
    TimelineMark(Model& m, cudaStream_t s, const char* stream, const char* what, int layer, int64_t bytes = 0);
    ~TimelineMark();
    TimelineMark(const TimelineMark&) = delete;
    TimelineMark& operator=(const TimelineMark&) = delete;

  private:
    Model& m_;
    cudaStream_t s_;
    const char *stream_, *what_;
    int layer_, begin_;
    int64_t bytes_;
};
std::vector<TimelineEntry> timeline_read(Model& m);
