// infra/timeline.h - the step's phases: --timeline FILE (when each part of the last step ran), the
// progress events of the watchdog and --mem-trace, the run's progress line (infra/timeline.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
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

// ---------------------------------------------------------------------------------------------
// The step's progress: an event as each phase ends (each layer's forward and backward turn, the
// head), which model_sync's watchdog and --mem-trace read, and the run's progress line.
typedef void (*ProgressFn)(void* ctx, const char* phase, int layer);  // phase "forward" or "backward"
struct Timeline;  // --timeline's events (infra/timeline.cu)
struct StepWatch {
    Timeline* timeline = nullptr;      // --timeline's, or none
    double timeout_s = 600;            // a wait that sees no progress for this long ends the run
    float* host_scalars = nullptr;     // pinned: the step's scalars, copied asynchronously (every wait
                                       // goes through the watchdog)
    std::vector<cudaEvent_t> step;     // the last step's: its start, then each phase's end (timed)
    int step_recorded = 0;
    std::vector<cudaEvent_t> forward;  // model_forward_loss's, apart: the last step's stay for --mem-trace
    int forward_recorded = 0;
    ProgressFn progress = nullptr;     // the caller's, told as each layer's turn ends
    void* progress_ctx = nullptr;
};
void watch_create(Model& m);
void watch_destroy(Model& m);
// A step begins (its timeline too), or with m.forward_only a forward alone; and ends.
void watch_step_begin(Model& m, cudaStream_t s, ProgressFn progress, void* ctx);
void watch_step_end(Model& m);
// One phase of the step, from its construction to the end of its scope: a timeline mark, then
// its progress event and (for a layer) the progress line.
class StepPhase {
  public:
    StepPhase(Model& m, cudaStream_t s, const char* what, int layer);
    ~StepPhase();
    StepPhase(const StepPhase&) = delete;
    StepPhase& operator=(const StepPhase&) = delete;

  private:
    Model& m_;
    cudaStream_t s_;
    const char* what_;
    int layer_;
    std::optional<TimelineMark> mark_;
};
