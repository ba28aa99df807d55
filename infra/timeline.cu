// infra/timeline.cu - the step's phases: --timeline FILE (when each part of the last step ran, on
// which stream, as JSON), and the progress events and line (the end of this file).
//
// A measuring tool, not a technique: it changes nothing the step computes. Each mark is a pair
// of CUDA events recorded on the stream that does the work, so it times the work itself, not
// the host that queued it. A mark is one line, and covers the rest of its scope:
//
//     TimelineMark mark(m, s, "compute", "attention forward", l);
//     ... work queued on s ...
//
// Marks of one stream may nest (a layer's backward holds its attention's rerun, which holds the
// attention kernel). bench/throughput.py adds them up per layer.
//
// The marks: each layer's "forward" and "backward" turn and the "head" (the step's phases,
// StepPhase, llama.cu), inside them the attention kernels, the all-to-alls (with the bytes this GPU
// sends), the MLP and the attention rerun; FSDP's gathers and reduce-scatters on its stream
// ("fsdp"; the layer field holds the unit); offload's copies on the copy stream ("copy"). Each is
// one line where its work is queued (`grep -rn 'TimelineMark\|StepPhase'`). Under --sim-world the collectives are local copies (infra/comm.cu):
// their marks give their bytes, and their times are those of the copies, not of a network.
#include "llama.h"

struct Timeline {
    std::vector<cudaEvent_t> pool;  // reused every step; grows to the step's count of events
    size_t used = 0;
    int step_start = -1;
    bool in_step = false;  // marks are taken between timeline_step_begin and _end only
    struct Mark {
        const char* stream;  // string literals (llama.h)
        const char* what;
        int layer, begin, end;
        int64_t bytes;
    };
    std::vector<Mark> marks;
};

void timeline_enable(Model& m) {
    if (!m.watch.timeline) m.watch.timeline = new Timeline();
}

void timeline_destroy(Model& m) {
    if (!m.watch.timeline) return;
    for (cudaEvent_t e : m.watch.timeline->pool) cudaEventDestroy(e);
    delete m.watch.timeline;
    m.watch.timeline = nullptr;
}

// An event from the pool, recorded on s now.
static int record(Timeline& t, cudaStream_t s) {
    if (t.used == t.pool.size()) {
        t.pool.push_back(nullptr);
        CUDA_CHECK(cudaEventCreate(&t.pool.back()));
    }
    CUDA_CHECK(cudaEventRecord(t.pool[t.used], s));
    return (int)t.used++;
}

void timeline_step_begin(Model& m, cudaStream_t s) {
    if (!m.watch.timeline) return;
    Timeline& t = *m.watch.timeline;
    t.used = 0;
    t.marks.clear();
    t.step_start = record(t, s);
    t.in_step = true;
}

void timeline_step_end(Model& m) {
    if (m.watch.timeline) m.watch.timeline->in_step = false;
}

TimelineMark::TimelineMark(Model& m, cudaStream_t s, const char* stream, const char* what, int layer, int64_t bytes)
    : m_(m), s_(s), stream_(stream), what_(what), layer_(layer), begin_(-1), bytes_(bytes) {
    if (m.watch.timeline && m.watch.timeline->in_step) begin_ = record(*m.watch.timeline, s);
}

// The end is recorded as the scope closes, also when an error unwinds it; an error here is not
// thrown from a destructor: the next CUDA call of the step reports it.
TimelineMark::~TimelineMark() {
    if (begin_ < 0 || !m_.watch.timeline) return;
    Timeline& t = *m_.watch.timeline;
    if (t.used == t.pool.size()) {
        t.pool.push_back(nullptr);
        if (cudaEventCreate(&t.pool.back()) != cudaSuccess) {
            t.pool.pop_back();
            return;
        }
    }
    if (cudaEventRecord(t.pool[t.used], s_) != cudaSuccess) return;
    t.marks.push_back({stream_, what_, layer_, begin_, (int)t.used++, bytes_});
}

std::vector<TimelineEntry> timeline_read(Model& m) {
    std::vector<TimelineEntry> out;
    if (!m.watch.timeline || m.watch.timeline->step_start < 0) return out;
    Timeline& t = *m.watch.timeline;
    CUDA_CHECK(cudaDeviceSynchronize());  // reporting, after the step: not on the step's path
    cudaEvent_t t0 = t.pool[t.step_start];
    for (const Timeline::Mark& mk : t.marks) {
        float b = 0, e = 0;
        CUDA_CHECK(cudaEventElapsedTime(&b, t0, t.pool[mk.begin]));
        CUDA_CHECK(cudaEventElapsedTime(&e, t0, t.pool[mk.end]));
        out.push_back({mk.stream, mk.what, mk.layer, b, e, mk.bytes});
    }
    return out;
}

// =============================================================================================
// The step's progress.
void watch_create(Model& m) {
    StepWatch& w = m.watch;
    w.step.resize(2 * m.cfg.n_layers + 2);  // start, each forward, the head, each backward
    for (auto& e : w.step) CUDA_CHECK(cudaEventCreate(&e));  // timed: --mem-trace reads them
    w.forward.resize(m.cfg.n_layers + 1);  // model_forward_loss: each layer, the head
    for (auto& e : w.forward) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CUDA_CHECK(cudaMallocHost(&w.host_scalars, 4 * sizeof(float)));
}

void watch_destroy(Model& m) {  // --timeline's own are timeline_destroy's
    StepWatch& w = m.watch;
    for (auto& e : w.step) cudaEventDestroy(e);
    for (auto& e : w.forward) cudaEventDestroy(e);
    w.step.clear(), w.forward.clear();
    w.step_recorded = w.forward_recorded = 0;
    if (w.host_scalars) cudaFreeHost(w.host_scalars);
    w.host_scalars = nullptr;
}

// Records the next event of the step's (or the forward's) list, while it has room. An error is
// not thrown here (a destructor calls it): the next CUDA call of the step reports it.
static void progress_event(Model& m, cudaStream_t s) {
    StepWatch& w = m.watch;
    std::vector<cudaEvent_t>& events = m.forward_only ? w.forward : w.step;
    int& recorded = m.forward_only ? w.forward_recorded : w.step_recorded;
    if (recorded < (int)events.size()) cudaEventRecord(events[recorded++], s);
}

void watch_step_begin(Model& m, cudaStream_t s, ProgressFn progress, void* ctx) {
    StepWatch& w = m.watch;
    w.progress = progress, w.progress_ctx = ctx;
    if (m.forward_only) {
        w.forward_recorded = 0;
        return;
    }
    timeline_step_begin(m, s);  // --timeline: the marks are times from here
    w.step_recorded = 0;
    progress_event(m, s);  // the step's start
}

void watch_step_end(Model& m) {
    if (!m.forward_only) timeline_step_end(m);
    m.watch.progress = nullptr;
}

StepPhase::StepPhase(Model& m, cudaStream_t s, const char* what, int layer)
    : m_(m), s_(s), what_(what), layer_(layer) {
    mark_.emplace(m, s, "compute", what, layer);
}

// Nothing more while an error unwinds the step.
StepPhase::~StepPhase() {
    mark_.reset();  // the mark ends before the phase's event
    if (std::uncaught_exceptions() > 0) return;
    progress_event(m_, s_);
    if (m_.watch.progress && layer_ >= 0) m_.watch.progress(m_.watch.progress_ctx, what_, layer_);
}
