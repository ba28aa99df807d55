// infra/memory.cu - the CUDA error checks, the arena (the static memory plan: infra/memory.h),
// the out-of-memory report, and --mem-trace's live memory over a step.
#include <algorithm>

#include "llama.h"

void cuda_check(cudaError_t err, const char* what, const char* file, int line) {
    if (err == cudaSuccess) return;
    std::string msg = std::string(what) + " failed at " + file + ":" + std::to_string(line) +
                      ": " + cudaGetErrorString(err);
    if (err == cudaErrorMemoryAllocation) throw Fatal(EXIT_OOM, "out of memory: " + msg);
    throw Fatal(EXIT_RUNTIME, msg);
}

// =============================================================================================
// Arena: the static memory plan (infra/memory.h).
static constexpr int64_t ARENA_ALIGN = 256;

void Arena::begin_real(char* base, int64_t capacity) {
    rewind();
    base_ = base;
    capacity_ = capacity;
}

void Arena::rewind() {
    offset_ = 0;
    for (auto& b : by_category_) b = 0;
    entries_.clear();
}

void* Arena::take_bytes(const std::string& name, MemCategory cat, int64_t bytes) {
    int64_t size = align_up(std::max<int64_t>(bytes, 1), ARENA_ALIGN);
    int64_t off = offset_;
    offset_ += size;
    by_category_[cat] += size;
    entries_.push_back({name, cat, off, size});
    if (!base_) return nullptr;  // dry run: only the plan
    if (offset_ > capacity_)
        throw std::logic_error("arena: real pass asked for more than the dry run planned");
    return base_ + off;
}

int64_t DeviceMemory::driver_used_bytes() const {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return -1;
    return (int64_t)(total_b - free_b) / sharing;
}

void report_oom(const Arena& plan, int64_t runtime_bytes, int64_t cap_bytes,
                const std::string& what, const std::string& hint) {
    char buf[256];
    std::string msg = "out of memory: " + what + "\n";
    int largest = 0;
    for (int c = 0; c < MEM_NUM_CATEGORIES; c++) {
        if (plan.category_bytes(c) > plan.category_bytes(largest)) largest = c;
        snprintf(buf, sizeof buf, "    %-10s %9.2f GiB\n", mem_category_name(c),
                 plan.category_bytes(c) / GiB);
        msg += buf;
    }
    snprintf(buf, sizeof buf, "    %-10s %9.2f GiB (CUDA context, cuBLAS)\n", "runtime",
             runtime_bytes / GiB);
    msg += buf;
    snprintf(buf, sizeof buf,
             "  the step needs %.2f GiB per GPU; the card (cap) holds %.2f GiB. Largest "
             "category: %s.\n",
             (plan.total() + runtime_bytes) / GiB, cap_bytes / GiB, mem_category_name(largest));
    msg += buf;
    if (!hint.empty()) msg += "  next: " + hint;
    throw Fatal(EXIT_OOM, msg);
}

// =============================================================================================
// --mem-trace. The arena is allocated once, so the device's total is flat by design; what
// changes over a step is which of its bytes hold live data. Model states, communication slots and
// workspace are live throughout; the activations each layer keeps in a slot of its own fill up
// over the forward and empty over the backward, and so does the pinned host memory of --offload.
// (The attention outputs =selective --offload keeps on the device count as live throughout.)
// Each point is one progress event of the last step, timed on the GPU.
std::vector<MemTracePoint> model_memory_trace(const Model& m, const Arena& arena) {
    const int L = m.cfg.n_layers;
    // The host holds the block inputs of every layer but the rebuilt ones (and with
    // --ckpt=selective the attention outputs and lse of the first att_host_layers): input l+1 is
    // copied out right after layer l's forward, the attention output of layer l with it; the
    // backward frees them from the last layer down.
    const int64_t T = m.shape.tokens();
    const int64_t host_x = m.plan.x_in == Hold::ON_HOST ? T * m.cfg.dim * 2 : 0;
    const int64_t host_att = m.plan.att == Hold::ON_HOST ? selective_attention_bytes(m) : 0;
    auto host_at = [&](int inputs, int atts) {
        const int n = std::min(inputs, L);
        return host_x * (n - inputs_rebuilt_below(m.plan, n)) + host_att * std::min(atts, m.plan.att_host_layers);
    };
    std::vector<MemTracePoint> pts;
    auto add = [&](const char* point, int layer, int event, int held, int64_t host) {
        if (event >= m.watch.step_recorded) return;
        MemTracePoint p;
        p.point = point, p.layer = layer;
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, m.watch.step[0], m.watch.step[event]));
        p.t_ms = ms;
        for (int c = 0; c < MEM_NUM_CATEGORIES; c++)
            p.live[c] = arena.category_bytes(c) - (int64_t)(L - held) * m.saved_per_layer[c];
        p.host = host;
        pts.push_back(p);
    };
    add("start", -1, 0, 0, 0);
    for (int l = 0; l < L; l++) add("fwd", l, 1 + l, l + 1, host_at(l + 2, l + 1));
    add("head", -1, 1 + L, L, host_at(L, L));
    for (int l = L - 1; l >= 0; l--) add("bwd", l, 2 + L + (L - 1 - l), l, host_at(l, l));
    return pts;
}
