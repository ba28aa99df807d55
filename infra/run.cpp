// infra/run.cpp - the run's machinery, which train.cpp's loop stands on: the memory plan without
// a GPU, the run's setup (input files, the GPU and the communicators, the attention kernels and
// the device's share of attention outputs chosen from free memory, the allocation on every rank,
// resume), and what the run prints and logs. infra/run.h lists what train.cpp calls.
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

// =============================================================================================
// The memory plan, without a GPU.
MemoryPlan plan_memory(const LlamaConfig& cfg, const Options& o, int64_t seq_len) {
    MemoryPlan p;
    Model m;
    m.cfg = cfg;
    m.opt = o.step;
    m.world = gpu_count(o);
    m.shape.batch = o.batch;
    m.shape.seq = seq_len;
    m.shape.sp = o.step.ulysses ? m.world : 1;
    model_declare_buffers(m, p.arena);
    p.host_bytes = model_host_bytes(m);
    return p;
}

int64_t longest_context(const LlamaConfig& cfg, const Options& o, double cap_gib, double runtime_gib,
                        int64_t granularity) {
    const int64_t sp = o.step.ulysses ? gpu_count(o) : 1;
    granularity = align_up(granularity, sp);  // Ulysses needs the sequence divisible by the GPUs
    auto fits = [&](int64_t seq) {
        MemoryPlan p = plan_memory(cfg, o, seq);
        return p.total_gib(runtime_gib) <= cap_gib && p.host_bytes <= o.step.host_mem_gib * GiB;
    };
    if (!fits(granularity)) return 0;
    int64_t lo = 1, hi = 2;  // in units of granularity: lo fits, hi is to be tested
    while (hi < (1LL << 32) / granularity * 256 && fits(hi * granularity)) lo = hi, hi *= 2;
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        (fits(mid * granularity) ? lo : hi) = mid;
    }
    return lo * granularity;
}

// The next stage of the ladder that is not on yet, for an out-of-memory's hint. On one GPU
// the stages that spread the step over GPUs cannot help.
static std::string next_stage_hint(const Options& o, int world) {
    struct Stage {
        const char* flag;
        bool on, helps;
    };
    const StepOptions& s = o.step;
    const bool savings = s.vocab_pieces != 1 && s.one_offload_slot && s.grad_in_att_output && s.dq_sums_in_staging;
    const Stage ladder[] = {{"--fsdp", s.fsdp, world > 1},       {"--ulysses", s.ulysses, world > 1},
                            {"--ckpt", s.ckpt, true},            {"--offload", s.offload, true},
                            {"--chunked", s.chunked, true},      {"--untied", s.untied > 0, true},
                            {"--stage 7 (our memory savings)", savings, true}};
    for (const Stage& st : ladder)
        if (!st.on && st.helps) return "add " + std::string(st.flag) + ", or reduce --seq-len, --batch or --layers";
    return world > 1 ? "reduce --seq-len, --batch or --layers"
                     : "reduce --seq-len, --batch or --layers, or spread the step over more GPUs (--nproc N)";
}

static std::string plan_text(const Arena& plan, int64_t host_bytes, double runtime_gib, bool runtime_measured) {
    std::ostringstream os;
    char buf[200];
    os << "memory plan per GPU:\n";
    for (int c = 0; c < MEM_NUM_CATEGORIES; c++) {
        snprintf(buf, sizeof buf, "  %-10s %10.3f GiB\n", mem_category_name(c), plan.category_bytes(c) / GiB);
        os << buf;
    }
    snprintf(buf, sizeof buf, "  %-10s %10.3f GiB (%s)\n", "runtime", runtime_gib,
             runtime_measured ? "measured: CUDA context, cuBLAS, NCCL" : "estimate: CUDA context, cuBLAS, NCCL");
    os << buf;
    snprintf(buf, sizeof buf, "  %-10s %10.3f GiB\n", "total", plan.total() / GiB + runtime_gib);
    os << buf;
    if (host_bytes > 0) {
        snprintf(buf, sizeof buf, "  %-10s %10.3f GiB (pinned host memory for offloaded activations)\n", "host",
                 host_bytes / GiB);
        os << buf;
    }
    return os.str();
}

// The largest buffers of the plan, largest first: where the memory goes, by name.
static std::string largest_buffers_text(const Arena& plan, size_t n) {
    std::vector<ArenaEntry> e = plan.entries();
    std::stable_sort(e.begin(), e.end(), [](const ArenaEntry& a, const ArenaEntry& b) { return a.bytes > b.bytes; });
    std::ostringstream os;
    char buf[200];
    os << "largest buffers:\n";
    for (size_t i = 0; i < std::min(n, e.size()); i++) {
        snprintf(buf, sizeof buf, "  %8.3f GiB  %-10s %s\n", e[i].bytes / GiB, mem_category_name(e[i].category),
                 e[i].name.c_str());
        os << buf;
    }
    return os.str();
}

// =============================================================================================
// Logs and reports.
std::string json_escape(const std::string& s) {
    std::string r;
    for (char ch : s) {
        if (ch == '"' || ch == '\\') r += '\\', r += ch;
        else if ((unsigned char)ch < 0x20) { char b[8]; snprintf(b, sizeof b, "\\u%04x", ch); r += b; }
        else r += ch;
    }
    return r;
}

// A JSON number, or null where the value is not finite (a diverged loss): JSON has no nan.
std::string json_number(double v, const char* fmt) {
    if (!std::isfinite(v)) return "null";
    char buf[64];
    snprintf(buf, sizeof buf, fmt, v);
    return buf;
}

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

// =============================================================================================
// The run: everything one process holds, and the steps that set it up, train and finish.
// Errors raised while flags and input files are checked are the same on every rank: rank 0
// alone reports them. Past that point a rank reports its own errors.
bool g_symmetric_phase = true;

const char* FUSED_NEEDS_FAST_KERNELS =
    "--attention fused needs the fast kernels (head dim 128 on an sm_90 GPU); this run would use kernels/attention.cu's";


// The data of a run (the synthetic task, or windows of the token file).
SyntheticData make_data(const Run& r) {
    SyntheticData data(r.o.task, r.o.task_vocab, r.o.seed ^ 0x5eedda7aull);
    data.file = r.token_file.get();
    data.doc_min = r.o.doc_min, data.doc_max = r.o.doc_max;
    return data;
}

// --doc-mask: the most documents this GPU's sequences of a step can hold, the room the plan
// keeps for their starts. A token file is read for it (its documents' starts).
static int64_t documents_per_step(Run& r) {
    if (!r.o.data_path.empty() && !r.token_file) r.token_file.reset(new TokenFile(r.o.data_path, r.cfg.vocab));
    if (!r.o.eval_path.empty() && !r.eval_file) r.eval_file.reset(new TokenFile(r.o.eval_path, r.cfg.vocab, "--eval-data"));
    SyntheticData eval = make_data(r);  // the held-out file's windows may hold more documents
    eval.file = r.eval_file.get(), eval.doc_min = 0;
    return std::max(make_data(r).max_docs_per_sequence(r.o.seq_len), r.eval_file ? eval.max_docs_per_sequence(r.o.seq_len) : 0) * r.o.batch;
}

// The model, its shape on this GPU and its memory plan (no GPU needed).
void plan_run(Run& r) {
    Options& o = r.o;
    r.cfg = resolve_config(o);
    if (o.task_vocab < 0) o.task_vocab = o.task == "induction" ? r.cfg.vocab : std::min(1024, r.cfg.vocab);
    const int64_t longest_doc = o.doc_min > 0 ? std::min(o.doc_max, o.seq_len + 1) : o.seq_len + 1;
    if (o.task == "induction" && o.data_path.empty() && o.task_vocab < longest_doc / 2)
        usage_error("--task induction draws the first half of a document, " + std::to_string(longest_doc / 2) +
                    " tokens, without repeats: --task-vocab " + std::to_string(o.task_vocab) + " is too few (" +
                    r.cfg.name + "'s vocabulary: " + std::to_string(r.cfg.vocab) + ")");
    r.simulated = r.launch.world == 1 && o.sim_world > 1;
    // --plan --nproc N plans for N GPUs without starting them.
    r.world = r.simulated ? o.sim_world : (r.launch.world > 1 ? r.launch.world : std::max(1, o.nproc));
    r.rank = r.launch.rank;
    r.lead = r.rank == 0;  // prints and writes files
    Model& m = r.m;
    m.cfg = r.cfg;
    m.opt = o.step;
    m.world = r.world;
    m.shape.batch = o.batch;
    m.shape.seq = o.seq_len;
    m.shape.sp = o.step.ulysses ? r.world : 1;
    m.shape.sp_rank = o.step.ulysses ? r.rank : 0;
    ulysses_check(r.cfg, m.shape);
    untied_check(r.cfg, m.shape, o.step.untied);
    if (o.step.doc_mask) m.opt.max_docs = o.step.max_docs = documents_per_step(r);
    model_declare_buffers(m, r.arena);
    r.host_bytes = model_host_bytes(m);
    r.dp = o.step.ulysses ? 1 : r.world;
    r.step_tokens = (int64_t)o.batch * r.dp * o.seq_len;
}

// The run's ranks and how they exchange data, for the run line.
static std::string ranks_text(const Run& r) {
    const std::string n = std::to_string(r.world);
    if (r.simulated) return n + " GPUs simulated (--sim-world: this is rank 0's share)";
    if (r.world == 1) return "1 GPU";
    if (r.o.host_comm)
        return n + " ranks, one process each, sharing the visible GPUs (--comm host: collectives through host shared memory)";
    return n + " GPUs, one process each (NCCL)";
}

void print_run(const Run& r) {
    const LlamaConfig& c = r.cfg;
    const Options& o = r.o;
    printf("model %s: %d layers, dim %d, heads %d/%d x %d, ffn %d, vocab %d, %s embeddings, %.3f B parameters%s\n",
           c.name.c_str(), c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab,
           c.tied_embeddings ? "tied" : "untied", count_params(c) / 1e9,
           c.qk_norm() ? ", Qwen3 (q and k normalized per head)" : "");
    printf("run: %s; step: %lld tokens (%d x %lld per sequence), %lld on each GPU, %.3g FLOP per GPU\n",
           ranks_text(r).c_str(),
           (long long)r.step_tokens, o.batch * r.dp, (long long)o.seq_len, (long long)r.m.shape.tokens(),
           model_step_flops(c, r.m.shape));
    std::string flags = technique_flags(o.step);
    if (o.step.chunked)
        flags += " (chunks of " + std::to_string(r.m.plan.chunk_rows) + " tokens, loss " +
                 std::to_string(r.m.plan.loss_rows) + ")";
    printf("techniques: %s\n", flags.empty() ? "none (stage 0)" : flags.c_str());
}

// =selective --offload: which layers keep their attention output where, and which rerun it.
static void print_attention_plan(const Run& r) {
    if (r.m.plan.att != Hold::ON_HOST || !r.lead) return;
    printf("selective checkpointing within --host-mem-gib %.4g: %s\n", r.o.step.host_mem_gib,
           selective_plan_text(r.m).c_str());
}

// =selective --offload: the layers whose attention output the host cannot hold keep it on the
// device where the cap leaves room (offload.cu), at most --device-keep-gib of it. Planned last,
// once the backward's kernels are chosen, less a margin for what the libraries allocate later.
// The fused backward goes first: its fp32 dQ sums take about two layers' attention outputs (two
// more reruns, two attention forwards), and it saves about a tenth of every layer's attention
// backward (a quarter of a forward per layer), so it wins from about eight layers up.
constexpr double DEVICE_KEEP_MARGIN_GIB = 1.0;
static int device_attention_room(const Run& r, int64_t cap_bytes, int64_t runtime_bytes) {
    // The model's plan keeps none on the device yet (plan_run).
    return selective_device_layers(r.m, (double)(cap_bytes - runtime_bytes - r.arena.total()) - DEVICE_KEEP_MARGIN_GIB * GiB);
}
static void keep_attention_layers_on_device(Run& r, int layers) {
    if (layers == r.m.device_attention_layers) return;
    r.m.device_attention_layers = layers;  // selective_plan keeps at most those that would rerun
    r.arena = Arena();
    model_declare_buffers(r.m, r.arena);
    r.host_bytes = model_host_bytes(r.m);  // fewer inputs may be rebuilt now
}

// Pinned host memory beyond --host-mem-gib is an out-of-memory, reported before a GPU is touched.
static void check_host_memory(const Run& r) {
    const double budget = r.o.step.host_mem_gib;
    if (r.host_bytes <= budget * GiB) return;
    char msg[400];
    snprintf(msg, sizeof msg,
             "out of memory: the plan pins %.4g GiB of host memory per GPU for --offload; --host-mem-gib allows %.4g "
             "(raise it on a machine that has the memory, or reduce --seq-len, --batch or --layers)",
             r.host_bytes / GiB, budget);
    throw Fatal(EXIT_OOM, msg);
}

// --attention auto (the default): does the plan still fit under the cap with the fused
// backward's fp32 dQ sums (attention_dq_accum_floats) added? The model's plan is left as it was.
static bool fused_backward_fits(Model& m, int64_t cap_bytes, int64_t runtime_bytes) {
    const bool was = m.opt.fused_attention;
    m.opt.fused_attention = true;
    Arena with_fused;
    model_declare_buffers(m, with_fused);
    m.opt.fused_attention = was;
    Arena as_was;
    model_declare_buffers(m, as_was);  // the model's sizes (chunk rows, per-layer bytes) as they were
    return with_fused.total() + runtime_bytes <= cap_bytes;
}

// Switch the plan to the fused backward (auto chose it).
static void plan_fused_backward(Run& r) {
    r.o.step.fused_attention = r.m.opt.fused_attention = true;
    r.arena = Arena();
    model_declare_buffers(r.m, r.arena);
}

// --plan: the memory per category, whether it fits under the cap, the longest context that does.
int print_plan(Run& r) {
    const Options& o = r.o;
    const double rt = runtime_estimate_gib(r.world);
    // auto: with a cap, what a run would choose (on an sm_90 GPU, where the fused backward runs).
    if (o.attention == "auto" && r.cfg.head_dim == 128 && o.mem_cap_gib > 0) {
        const bool fits = fused_backward_fits(r.m, (int64_t)(o.mem_cap_gib * GiB), (int64_t)(rt * GiB));
        const bool lean_fits = r.arena.total() / GiB + rt <= o.mem_cap_gib;
        if (fits) plan_fused_backward(r);
        if (r.lead)
            printf("attention auto: %s\n", fits        ? "the fused backward (on an sm_90 GPU): its fp32 dQ sums fit under the cap"
                                           : lean_fits ? "the lean backward: the fused one's fp32 dQ sums would not fit under the cap"
                                                       : "planned with the lean backward; neither fits under the cap");
    } else if (o.attention == "auto" && r.cfg.head_dim == 128 && r.lead) {
        printf("attention auto: planned with the lean backward; a run on an sm_90 GPU takes the fused one if its "
               "fp32 dQ sums also fit (give --mem-cap-gib to see which)\n");
    }
    // The device's room: under the cap, or without one, what --device-keep-gib gives (a run
    // without either fills the GPU it finds).
    if (o.mem_cap_gib > 0) keep_attention_layers_on_device(r, device_attention_room(r, (int64_t)(o.mem_cap_gib * GiB), (int64_t)(rt * GiB)));
    else if (o.step.device_keep_gib >= 0) keep_attention_layers_on_device(r, device_attention_room(r, INT64_MAX / 2, 0));
    print_attention_plan(r);
    if (r.m.plan.att == Hold::ON_HOST && o.mem_cap_gib <= 0 && o.step.device_keep_gib < 0 &&
        r.m.plan.att_host_layers < r.cfg.n_layers - 1 && r.lead)
        printf("note: a run also keeps attention outputs on the device where the GPU has room (give --mem-cap-gib "
               "or --device-keep-gib to see which layers)\n");
    printf("%s", plan_text(r.arena, r.host_bytes, rt, false).c_str());
    printf("%s", largest_buffers_text(r.arena, 30).c_str());
    if (r.host_bytes > 0)
        printf("host %.2f GiB (--host-mem-gib): %s\n", o.step.host_mem_gib,
               r.host_bytes <= o.step.host_mem_gib * GiB ? "fits" : "OOM");
    if (o.mem_cap_gib > 0) {
        double need = r.arena.total() / GiB + rt;
        if (need <= o.mem_cap_gib) printf("cap %.2f GiB: fits\n", o.mem_cap_gib);
        else printf("cap %.2f GiB: OOM, needs %.2f GiB (next: %s)\n", o.mem_cap_gib, need,
                    next_stage_hint(o, r.world).c_str());
        Options lean = o;  // at the longest context, auto falls back to the lean backward
        if (o.attention == "auto") lean.step.fused_attention = false;
        int64_t longest = longest_context(r.cfg, lean, o.mem_cap_gib, rt);
        printf("longest context under %.2f GiB with these flags: %lld tokens (%.2fM)", o.mem_cap_gib,
               (long long)longest, longest / 1048576.0);
        Options device_only = lean;  // what the device alone would hold
        device_only.step.host_mem_gib = 1e9;  // the flag's largest value: no bound
        const int64_t device_longest = longest_context(r.cfg, device_only, o.mem_cap_gib, rt);
        if (device_longest > longest)
            printf("; host memory binds (%.0f GiB): the device alone holds %lld (%.2fM)", o.step.host_mem_gib,
                   (long long)device_longest, device_longest / 1048576.0);
        printf("\n");
    }
    return EXIT_OK;
}

// Input files, checked before any GPU work: a bad one is a usage error (exit code 2).
static void open_inputs(Run& r) {
    const Options& o = r.o;
    if (!o.init_from.empty()) check_hf_checkpoint(r.m, o.init_from);
    if (!o.eval_path.empty()) {
        if (!r.eval_file) r.eval_file.reset(new TokenFile(o.eval_path, r.cfg.vocab, "--eval-data"));
        if (r.eval_file->count < (uint64_t)o.seq_len + 1)
            usage_error("--eval-data '" + o.eval_path + "' holds " + std::to_string(r.eval_file->count) +
                        " tokens; a window of --seq-len " + std::to_string(o.seq_len) + " needs " + std::to_string(o.seq_len + 1));
        r.eval = EvalSet{r.eval_file.get(), eval_offsets(r.eval_file->count, o.seq_len, o.eval_windows), o.seq_len,
                         o.batch * r.dp, o.step.doc_mask};
    }
    if (o.data_path.empty()) return;
    if (!r.token_file) r.token_file.reset(new TokenFile(o.data_path, r.cfg.vocab));
    const uint64_t count = r.token_file->count, need = (uint64_t)o.seq_len + 1;
    if (count < need)
        usage_error("--data '" + o.data_path + "' holds " + std::to_string(count) + " tokens; a sequence of --seq-len " +
                    std::to_string(o.seq_len) + " needs " + std::to_string(need));
    // A window starts at any of count - seq_len offsets: fewer than a step's sequences would
    // make every step train on copies of the same window.
    const uint64_t windows = count - (uint64_t)o.seq_len, sequences = (uint64_t)o.batch * r.dp;
    if (windows < sequences)
        usage_error("--data '" + o.data_path + "' holds " + std::to_string(windows) + " distinct window" +
                    (windows > 1 ? "s" : "") + " of --seq-len + 1 tokens, fewer than the " +
                    std::to_string(sequences) + " sequences of one step (--batch x data-parallel GPUs)");
}

// Collectives on every communicator before memory is measured, small and large (NCCL picks
// other kernels and protocols by size, and loads each kernel at its first use): NCCL's memory
// then belongs to the runtime's share, measured, not hidden in our figures.
static void warm_up(Comm* comm, cudaStream_t s, double timeout_s) {
    if (comm->transport != Transport::NCCL) return;
    for (int64_t n : {(int64_t)1024, (int64_t)1 << 24}) {
        float* buf = nullptr;
        const int64_t w = comm->world;
        CUDA_CHECK(cudaMalloc(&buf, 2 * n * w * sizeof(float)));
        CUDA_CHECK(cudaMemset(buf, 0, 2 * n * w * sizeof(float)));
        for (DType t : {DType::F32, DType::BF16}) {
            comm->all_reduce(buf, n, t, s);
            comm->all_gather(buf + n * w, buf, n, t, s);
            comm->reduce_scatter(buf, buf + n * w, n, t, s);
            comm->all_to_all(buf + n * w, buf, n, t, s);
        }
        comm_sync(comm, s, timeout_s);
        CUDA_CHECK(cudaFree(buf));
    }
}

// The GPU, the communicators, and what the runtime holds before our first allocation.
static void open_gpu(Run& r) {
    const Options& o = r.o;
    Model& m = r.m;
    DeviceMemory& dm = r.dm;
    g_symmetric_phase = false;
    const int n_dev = visible_gpus();
    if (n_dev == 0) no_gpu_error("this program trains on NVIDIA GPUs; `./train --plan ...` prints the memory plan without one");
    dm.device = r.launch.local_rank % n_dev;
    CUDA_CHECK(cudaSetDevice(dm.device));
    CUDA_CHECK(cudaFree(0));  // create the context now, so its memory is counted as runtime
    CUDA_CHECK(cudaGetDeviceProperties(&r.prop, dm.device));
    attention_use_reference(o.attention == "reference");
    r.fast_attention = attention_uses_hopper({1, o.seq_len, r.cfg.n_heads, r.cfg.n_kv_heads, r.cfg.head_dim});
    if (o.step.fused_attention && !r.fast_attention) usage_error(FUSED_NEEDS_FAST_KERNELS);
    gemm_init(0, nullptr);  // the cuBLASLt handle; workspace attached after allocation
    CUDA_CHECK(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
    size_t free_before_comm = 0, free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_before_comm, &total_b));
    if (r.launch.world > 1 && o.host_comm)
        m.comm = comm_host(r.rank, r.world, r.launch.host_comm_fd, o.comm_timeout_s);
    else if (r.launch.world > 1)
        m.comm = comm_nccl(r.rank, r.world, r.launch.listen_fd, r.launch.master_addr, r.launch.master_port,
                           o.comm_timeout_s);
    else
        m.comm = r.simulated ? comm_fake(r.world, &m) : comm_single();
    m.owns_comm = true;
    m.comm_params = m.comm->split();
    m.watch.timeout_s = o.comm_timeout_s;
    CUDA_CHECK(cudaStreamCreateWithFlags(&m.comm_stream, cudaStreamNonBlocking));
    warm_up(m.comm, r.stream, o.comm_timeout_s);  // each on the stream the step uses it on
    warm_up(m.comm_params, m.comm_stream, o.comm_timeout_s);
    // Ranks that share this GPU (--comm host, the ranks dealt to the GPUs in turn) each count an
    // equal part of it, measured while every rank's context is up and none has allocated yet.
    dm.sharing = o.host_comm ? (r.world - dm.device + n_dev - 1) / n_dev : 1;
    if (dm.sharing > 1) m.comm->barrier();
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    if (dm.sharing > 1) m.comm->barrier();
    r.nccl_gib = ((double)free_before_comm - (double)free_b) / GiB;  // NCCL's buffers
    if (m.comm->transport != Transport::NCCL) r.nccl_gib = 0;
    dm.total_bytes = (int64_t)total_b / dm.sharing;
    dm.runtime_bytes = (int64_t)(total_b - free_b) / dm.sharing;
    dm.cap_bytes = o.mem_cap_gib > 0 ? std::min<int64_t>((int64_t)(o.mem_cap_gib * GiB), dm.total_bytes)
                                     : dm.total_bytes;
    // Emulating rank 0 of N: the cap also holds the NCCL buffers that rank would have (the
    // plan's estimate), so what fits here fits there.
    if (r.simulated) dm.emulated_bytes = (int64_t)(NCCL_OVERHEAD_ESTIMATE_GIB * GiB);
    m.pin_host = o.steps > 0 || !o.eval_path.empty();  // a run of no steps shows the allocation; pinned memory is planned only
}

// Each rank's numbers summed over all ranks, in place, on the device (setup only).
static void sum_over_ranks(Comm* comm, std::vector<float>& x, cudaStream_t s, double timeout_s) {
    float* buf = nullptr;
    const size_t bytes = x.size() * sizeof(float);
    CUDA_CHECK(cudaMalloc(&buf, bytes));
    // On s, in order: cudaMemcpy runs on the legacy stream, which s (non-blocking) does not wait for.
    CUDA_CHECK(cudaMemcpyAsync(buf, x.data(), bytes, cudaMemcpyHostToDevice, s));
    comm->all_reduce(buf, (int64_t)x.size(), DType::F32, s);
    CUDA_CHECK(cudaMemcpyAsync(x.data(), buf, bytes, cudaMemcpyDeviceToHost, s));
    comm_sync(comm, s, timeout_s);
    CUDA_CHECK(cudaFree(buf));
}
// The sum over all ranks of one number per rank (a flag, a count).
static float sum_over_ranks(Comm* comm, float mine, cudaStream_t s, double timeout_s) {
    std::vector<float> x{mine};
    sum_over_ranks(comm, x, s, timeout_s);
    return x[0];
}

// auto: the fused backward if its dQ sums fit on every rank (ranks agree, so they run the same
// kernels). Every rank takes part in the sum, whatever its kernels, so that the collectives pair up.
static void choose_attention(Run& r) {
    const DeviceMemory& dm = r.dm;
    const bool fits = r.fast_attention && fused_backward_fits(r.m, dm.cap_bytes, dm.runtime_bytes + dm.emulated_bytes);
    const bool all_fit = r.launch.world > 1 ? sum_over_ranks(r.m.comm, fits ? 0.f : 1.f, r.stream, r.o.comm_timeout_s) == 0
                                            : fits;
    if (all_fit) plan_fused_backward(r);
}

// The smallest of one count per rank (each rank's in its own entry, summed).
static int min_over_ranks(const Run& r, int mine) {
    std::vector<float> counts(r.world, 0.f);
    counts[r.rank] = (float)mine;
    sum_over_ranks(r.m.comm, counts, r.stream, r.o.comm_timeout_s);
    return (int)*std::min_element(counts.begin(), counts.end());
}

// Attention outputs on the device where this GPU has room; every rank keeps the same layers, since a
// layer that reruns attention takes part in Ulysses's all-to-alls again.
static void keep_attention_on_device(Run& r) {
    if (r.m.plan.att != Hold::ON_HOST) return;
    const DeviceMemory& dm = r.dm;
    int layers = device_attention_room(r, dm.cap_bytes, dm.runtime_bytes + dm.emulated_bytes);
    if (r.launch.world > 1) layers = min_over_ranks(r, layers);
    keep_attention_layers_on_device(r, layers);
}

static void print_gpu(const Run& r) {
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

// Allocate, and agree: an out-of-memory on one rank (a fuller GPU, pinned host memory that ran
// out) ends the run on every rank, reported by the ranks it happened on (once if all).
static int allocate_on_every_rank(Run& r) {
    std::string alloc_error;
    int alloc_code = 0;
    try {
        const std::string hint = r.m.plan.att_device_layers > 0
                                     ? "lower --device-keep-gib (attention outputs kept on the device: " +
                                           std::to_string(r.m.plan.att_device_layers) + " layers)"
                                     : next_stage_hint(r.o, r.world);
        model_allocate(r.m, r.arena, r.dm, hint);
    } catch (const Fatal& f) {
        alloc_error = f.what(), alloc_code = f.code;
    }
    if (r.launch.world == 1) {
        if (alloc_code) throw Fatal(alloc_code, alloc_error);
        return 0;
    }
    const float failed = sum_over_ranks(r.m.comm, alloc_code ? 1.f : 0.f, r.stream, r.o.comm_timeout_s);
    if (failed == 0) return 0;
    if (alloc_code && (failed < r.world || r.rank == 0))
        fprintf(stderr, "%s%s\n", failed < r.world ? ("[rank " + std::to_string(r.rank) + "] ").c_str() : "",
                alloc_error.c_str());
    return alloc_code ? alloc_code : EXIT_OOM;
}

static const char* attention_kernels(const Run& r) {
    if (!r.fast_attention) return "kernels/attention.cu (reference)";
    if (!r.o.step.fused_attention) return "kernels/attention_hopper.cu (wgmma + TMA), lean backward";
    return "kernels/attention_hopper.cu (wgmma + TMA), fused backward";
}

// Rank 0's log: the run's setup, then what the device holds once everything is allocated (the
// static plan's peak).
static void open_log(Run& r) {
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

int open_run(Run& r) {
    const Options& o = r.o;
    check_host_memory(r);
    open_inputs(r);
    if (!o.state_dir.empty()) train_state_file(r.m, o.state_dir, r.rank, o.resume, o.steps);  // before the GPU opens
    open_gpu(r);
    if (o.attention == "auto") choose_attention(r);
    keep_attention_on_device(r);
    check_host_memory(r);  // the device's layers may leave fewer inputs to rebuild
    print_attention_plan(r);
    if (r.lead) print_gpu(r);
    if (int code = allocate_on_every_rank(r)) return code;
    if (!o.timeline_path.empty() || !o.trace_path.empty()) timeline_enable(r.m);
    r.m.init_seed = o.seed;  // under --sim-world, also what the other ranks' shards are drawn from
    if (!o.init_from.empty()) load_hf_checkpoint(r.m, o.init_from, r.stream);
    else model_init_weights(r.m, o.seed, r.stream);
    open_log(r);
    return EXIT_OK;
}

// Where training starts: step 0, or the saved state of --resume.
int resume_or_start(Run& r, SyntheticData& data) {
    if (!r.o.resume) return 0;
    int64_t step = 0;
    uint64_t data_state = 0;
    if (!load_train_state(r.m, r.o.state_dir, r.o.steps, &step, &data_state, r.stream)) {
        if (r.lead) printf("no training state in %s yet: starting at step 0\n", r.o.state_dir.c_str());
        return 0;
    }
    data.state = data_state;
    if (r.lead) printf("resumed from %s at step %d\n", r.o.state_dir.c_str(), (int)step);
    return (int)step;
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
static void print_ranks(Run& r) {
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

// After the last step: the files asked for, then the GPU's resources back.
void finish(Run& r) {
    const Options& o = r.o;
    print_ranks(r);
    if (r.log) fclose(r.log);
    if (r.lead && !o.timeline_path.empty()) write_timeline(o.timeline_path, timeline_read(r.m));
    if (r.lead && !o.trace_path.empty())
        write_trace(o.trace_path, command_line(o) + " (" + r.prop.name + ")", timeline_read(r.m),
                    model_memory_trace(r.m, r.arena));
    if (r.lead && !o.mem_trace_path.empty())
        write_mem_trace(o, r.prop.name, r.m, r.arena, r.dm.driver_used_bytes() / GiB);
    if (!o.save_to.empty()) {
        save_hf_checkpoint(r.m, o.save_to, o.save_dtype == "bf16", r.stream);
        if (r.lead) printf("saved a Hugging Face checkpoint (%s) to %s\n", o.save_dtype.c_str(), o.save_to.c_str());
    }
    gemm_destroy();
    model_free(r.m, r.dm);
}

// ./train --nproc N: what every rank would refuse alike (flags, shapes, input files) is said once,
// here, before any process starts.
void check_before_launch(const Options& o) {
    Run r;
    r.o = o;
    r.launch.world = o.nproc;
    plan_run(r);
    check_host_memory(r);
    open_inputs(r);
    if (!o.state_dir.empty())  // every rank's file, before any process starts
        for (int rank = 0; rank < o.nproc; rank++) train_state_file(r.m, o.state_dir, rank, o.resume, o.steps);
    const int visible = visible_gpus();  // none: each process says so in one line (no_gpu_error)
    if (visible > 0 && visible < o.nproc && !o.host_comm)
        usage_error("--nproc " + std::to_string(o.nproc) + " starts one process per GPU, but this machine shows " +
                    std::to_string(visible) + " GPU" + (visible > 1 ? "s" : "") +
                    " (CUDA_VISIBLE_DEVICES); --comm host runs the processes on fewer GPUs, --sim-world " +
                    std::to_string(o.nproc) + " runs rank 0's share of that many on one");
    if (o.host_comm && o.nproc > HOST_COMM_MAX_RANKS)
        usage_error("--comm host runs at most " + std::to_string(HOST_COMM_MAX_RANKS) + " processes");
}

