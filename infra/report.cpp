// infra/report.cpp - what a run prints and logs: the GPU and its memory, rank 0's --log (the
// run's setup, then one JSON object per step and evaluation), the progress line of long steps,
// --dump, and every rank's last loss and memory at the end.
#include "infra/run.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>

std::string command_line(const Options& o) {
    std::string cmd;
    for (const std::string& a : o.argv) cmd += (cmd.empty() ? "" : " ") + a;
    return cmd;
}

// Wall-clock time (Unix seconds): a step record's end, so that other logs of the run (the GPU's
// clocks sampled by nvidia-smi in make throughput) can be placed against the step's marks.
static double unix_seconds() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

static std::string json_memory(const Arena& plan, int64_t host_bytes) {
    std::ostringstream os;
    os << "{";
    for (int c = 0; c < MEM_NUM_CATEGORIES; c++)
        os << (c ? ", " : "") << "\"" << mem_category_name(c) << "\": " << plan.category_bytes(c) / GiB;
    os << ", \"host_pinned\": " << host_bytes / GiB << "}";
    return os.str();
}

static double host_rss_gib(const char* key) {  // VmRSS (now) or VmHWM (peak) of this process
    std::ifstream f("/proc/self/status");
    std::string line;
    while (std::getline(f, line))
        if (line.rfind(key, 0) == 0) return std::atof(line.c_str() + strlen(key)) / (1024.0 * 1024.0);
    return 0;
}

void progress_callback(void* ctx, const char* phase, int layer) {
    Progress* p = (Progress*)ctx;
    model_sync(*p->model, p->stream);
    double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - p->start).count();
    bool fwd = phase[0] == 'f';
    // Backward work per layer is about twice the forward's.
    double done = fwd ? (layer + 1) / (3.0 * p->layers) : (1.0 + 2.0 * (p->layers - layer) / p->layers) / 3.0;
    double eta = done > 0 ? el / done - el : 0;
    fprintf(stderr, "\r  %s layer %3d/%d  %6.1f s elapsed, ETA %6.1f s   ", fwd ? "forward " : "backward",
            fwd ? layer + 1 : p->layers - layer, p->layers, el, eta);
    if (!fwd && layer == 0) fprintf(stderr, "\n");
}

static double gpu_peak_tflops(const Options& o, const cudaDeviceProp& prop) {
    if (o.peak_tflops > 0) return o.peak_tflops;
    std::string name = prop.name;
    if (name.find("H100") != std::string::npos || name.find("H200") != std::string::npos) return 989.4;
    return 0;  // unknown: MFU not shown
}

void print_gpu(const Run& r) {
    const Options& o = r.o;
    const DeviceMemory& dm = r.dm;
    const std::string shared = dm.sharing > 1 ? " (its part of a GPU shared by " + std::to_string(dm.sharing) + " ranks)" : "";
    printf("GPU: %s, %.1f GiB%s%s; runtime uses %.2f GiB before our first allocation (CUDA context and cuBLAS "
           "%.2f, NCCL %.2f)\n",
           r.prop.name, dm.total_bytes / GiB, shared.c_str(),
           o.mem_cap_gib > 0 ? (", capped at " + std::to_string(o.mem_cap_gib).substr(0, 6) + " GiB").c_str() : "",
           dm.runtime_bytes / GiB, dm.runtime_bytes / GiB - r.nccl_gib, r.nccl_gib);
    printf("%s", plan_text(r.arena, r.host_bytes, dm.runtime_bytes / GiB, true).c_str());
    if (r.simulated)
        printf("note: --sim-world %d runs rank 0's share on one GPU; its loss is meaningless; the cap also holds "
               "the %.2f GiB of NCCL buffers a real rank would have (estimate)\n", r.world, NCCL_OVERHEAD_ESTIMATE_GIB);
    if (!r.m.pin_host && r.host_bytes > 0)
        printf("note: --steps 0: the %.2f GiB of pinned host memory are planned, not allocated\n", r.host_bytes / GiB);
}

static const char* attention_kernels(const Run& r) {
    if (!r.fast_attention) return "kernels/attention.cu (reference)";
    if (!r.o.step.fused_attention) return "kernels/attention_hopper.cu (wgmma + TMA), lean backward";
    return "kernels/attention_hopper.cu (wgmma + TMA), fused backward";
}

// Rank 0's log: the run's setup, then what the device holds once everything is allocated (the
// static plan's peak).
void open_log(Run& r) {
    if (!r.lead || r.o.log_path.empty()) return;
    r.log = open_output(r.o.log_path, "--log");
    const Options& o = r.o;
    const DeviceMemory& dm = r.dm;
    const std::string memory = json_memory(r.arena, r.host_bytes);
    fprintf(r.log,
            "{\"type\": \"setup\", \"command\": \"%s\", \"gpu\": \"%s\", \"config\": \"%s\", \"layers\": %d, "
            "\"seq_len\": %lld, \"batch\": %d, \"world\": %d, \"simulated\": %s, \"comm\": \"%s\", \"gpu_shared_by\": %d, "
            "\"local_tokens\": %lld, "
            "\"params\": %lld, \"attention\": \"%s\", \"plan_gib\": %s, \"runtime_gib\": %.4f, \"nccl_gib\": %.4f, "
            "\"cap_gib\": %.3f, \"attention_kept_on_host\": %d, \"attention_kept_on_device\": %d, "
            "\"inputs_rebuilt\": %d}\n",
            json_escape(command_line(o)).c_str(), r.prop.name, r.cfg.name.c_str(), r.cfg.n_layers, (long long)o.seq_len,
            o.batch, r.world, r.simulated ? "true" : "false", transport_name(r.m.comm->transport), dm.sharing,
            (long long)r.m.shape.tokens(),
            (long long)count_params(r.cfg),
            !r.fast_attention ? "reference" : o.step.fused_attention ? "hopper-fused" : "hopper", memory.c_str(),
            dm.runtime_bytes / GiB, r.nccl_gib, dm.cap_bytes / GiB, r.m.plan.att_host_layers, r.m.plan.att_device_layers,
            r.m.plan.x_rebuilt_layers);
    CUDA_CHECK(cudaDeviceSynchronize());
    std::string bytes;  // the same, exact: ranks and --sim-world compared byte for byte
    for (int c = 0; c < MEM_NUM_CATEGORIES; c++)
        bytes += std::string(c ? ", " : "") + "\"" + mem_category_name(c) + "\": " + std::to_string(r.arena.category_bytes(c));
    fprintf(r.log,
            "{\"type\": \"allocated\", \"memory_gib\": %s, \"memory_bytes\": {%s}, \"runtime_gib\": %.4f, "
            "\"driver_gib\": %.4f}\n",
            memory.c_str(), bytes.c_str(), dm.runtime_bytes / GiB, dm.driver_used_bytes() / GiB);
    fflush(r.log);
}

void print_training(const Run& r, const SyntheticData& data) {
    const Options& o = r.o;
    if (data.file) printf("training %d steps on %s (%llu tokens)\n", o.steps, o.data_path.c_str(),
                          (unsigned long long)data.file->count);
    else printf("training %d steps on the '%s' task (tokens < %d)\n", o.steps, o.task.c_str(), o.task_vocab);
    printf("  attention kernels: %s%s\n", attention_kernels(r),
           o.attention != "auto" || !r.fast_attention ? ""
           : o.step.fused_attention                   ? " (auto: its fp32 dQ sums fit)"
                                                      : " (auto: the fused backward's fp32 dQ sums would not fit on every GPU)");
    if (!data.file && o.task != "random")
        printf("  uniform guess = ln(%d) = %.3f\n", o.task_vocab, std::log((double)o.task_vocab));
}

// What one step measured, for its line and its log.
void report_step(const Run& r, const StepReport& s, const SyntheticData& data) {
    const Options& o = r.o;
    const int64_t T = r.m.shape.tokens();
    const double tflops = model_step_flops(r.cfg, r.m.shape, s.attention_share) / s.seconds / 1e12;
    const double peak = gpu_peak_tflops(o, r.prop);
    const double driver = r.dm.driver_used_bytes() / GiB, host = host_rss_gib("VmHWM:");  // includes pinned
    const Arena& a = r.arena;
    printf("step %4d/%d  loss %8.4f%s  lr %.2e  grad norm %7.3f | %9.0f tok/s", s.step, o.steps, s.loss,
           r.simulated ? " (simulated)" : "", s.lr, s.grad_norm, r.step_tokens / s.seconds);
    if (r.world > 1) printf(" (%.0f per GPU)", T / s.seconds);
    printf("  %6.1f TFLOP/s%s", tflops, r.world > 1 ? " per GPU" : "");
    if (peak > 0) printf("  MFU %4.1f%%", 100.0 * tflops / peak);
    printf("  %7.3f s | GiB model %.2f attention %.2f other %.2f comm %.2f workspace %.2f, driver %.2f, host %.2f\n",
           s.seconds, a.category_bytes(MEM_MODEL) / GiB, a.category_bytes(MEM_ATTENTION) / GiB,
           a.category_bytes(MEM_OTHER) / GiB, a.category_bytes(MEM_COMM) / GiB, a.category_bytes(MEM_WORKSPACE) / GiB,
           driver, host);
    fflush(stdout);
    if (!r.log) return;
    std::string windows;  // --data: where each of the step's sequences starts in the token file
    for (uint64_t w : data.offsets) windows += (windows.empty() ? "" : ", ") + std::to_string(w);
    fprintf(r.log,
            "{\"type\": \"step\", \"step\": %d, \"loss\": %s, \"lr\": %.6g, \"grad_norm\": %s, "
            "\"step_time_s\": %.6f, \"tokens_per_s\": %.2f, \"tokens_per_s_per_gpu\": %.2f, \"tflops\": %.3f, "
            "\"mfu\": %.5f, \"memory_gib\": %s, \"driver_gib\": %.4f, \"host_gib\": %.4f, \"end_unix_s\": %.3f%s%s%s}\n",
            s.step, json_number(s.loss, "%.9g").c_str(), s.lr, json_number(s.grad_norm, "%.6g").c_str(), s.seconds,
            r.step_tokens / s.seconds, T / s.seconds, tflops, peak > 0 ? tflops / peak : 0.0,
            json_memory(a, r.host_bytes).c_str(), driver, host, unix_seconds(), data.file ? ", \"windows\": [" : "",
            windows.c_str(), data.file ? "]" : "");
    fflush(r.log);
}

// --dump: the first step's loss and every gradient, whole (a collective under --fsdp).
void dump_first_step(Run& r, int64_t n_valid) {
    Model& m = r.m;
    CUDA_CHECK(cudaMemcpyAsync(m.watch.host_scalars, m.scalars, 4, cudaMemcpyDeviceToHost, r.stream));
    model_sync(m, r.stream);
    const float loss_sum = m.watch.host_scalars[0];
    std::vector<float> grads = fsdp_full_gradients(m, r.stream);
    if (r.lead) write_dump(r.o.dump_path, loss_sum / (double)n_valid, grads);
}

// --eval-data: the held-out loss after `step` steps, one line and one log record.
void run_eval(Run& r, int step) {
    const PositionLosses p = evaluate(r.m, r.eval, r.rank, r.stream);
    if (!r.lead) return;
    printf("%s\n", eval_line(step, r.eval, p).c_str());
    fflush(stdout);
    if (r.log) fprintf(r.log, "%s\n", eval_json(step, r.eval, p).c_str()), fflush(r.log);
}

// Several processes: each rank's last loss and memory, from its own process, in one table that
// rank 0 prints (each rank writes its row of a table summed over the ranks).
void print_ranks(Run& r) {
    if (r.world == 1 || r.simulated || std::isnan(r.last_loss)) return;  // no step ran (--eval-only, --steps 0)
    constexpr int COLUMNS = 3 + MEM_NUM_CATEGORIES;
    std::vector<float> table((size_t)r.world * COLUMNS, 0.f);
    float* row = &table[(size_t)r.rank * COLUMNS];
    row[0] = (float)getpid(), row[1] = (float)r.last_loss, row[2] = (float)(r.dm.driver_used_bytes() / GiB);
    for (int c = 0; c < MEM_NUM_CATEGORIES; c++) row[3 + c] = (float)(r.arena.category_bytes(c) / GiB);
    sum_over_ranks(r.m.comm, table, r.stream, r.o.comm_timeout_s);
    if (!r.lead) return;
    printf("ranks (GiB; driver: the GPU's used memory%s):\n  rank  process  last loss", r.dm.sharing > 1 ? ", its part" : "");
    for (int c = 0; c < MEM_NUM_CATEGORIES; c++) printf(" %9s", mem_category_name(c));
    printf("    driver\n");
    for (int k = 0; k < r.world; k++) {
        const float* x = &table[(size_t)k * COLUMNS];
        printf("  %4d %8.0f %10.4f", k, x[0], x[1]);
        for (int c = 0; c < MEM_NUM_CATEGORIES; c++) printf(" %9.3f", x[3 + c]);
        printf(" %9.3f\n", x[2]);
    }
    fflush(stdout);
}
