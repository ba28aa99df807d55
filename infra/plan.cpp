// infra/plan.cpp - the memory plan of one process's share, without a GPU (the run's model and
// shape, --plan with the longest context that fits, the out-of-memory's hint), and the choices a
// run makes from its GPU's free memory: the attention backward (--attention auto) and the
// attention outputs that =selective --offload keeps on the device.
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
std::string next_stage_hint(const Options& o, int world) {
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

std::string plan_text(const Arena& plan, int64_t host_bytes, double runtime_gib, bool runtime_measured) {
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
void print_attention_plan(const Run& r) {
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
void check_host_memory(const Run& r) {
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

// auto: the fused backward if its dQ sums fit on every rank (ranks agree, so they run the same
// kernels). Every rank takes part in the sum, whatever its kernels, so that the collectives pair up.
void choose_attention(Run& r) {
    const DeviceMemory& dm = r.dm;
    const bool fits = r.fast_attention && fused_backward_fits(r.m, dm.cap_bytes, dm.runtime_bytes + dm.emulated_bytes);
    const bool all_fit = r.launch.world > 1 ? sum_over_ranks(r.m.comm, fits ? 0.f : 1.f, r.stream, r.o.comm_timeout_s) == 0
                                            : fits;
    if (all_fit) plan_fused_backward(r);
}

// Attention outputs on the device where this GPU has room; every rank keeps the same layers, since a
// layer that reruns attention takes part in Ulysses's all-to-alls again.
void keep_attention_on_device(Run& r) {
    if (r.m.plan.att != Hold::ON_HOST) return;
    const DeviceMemory& dm = r.dm;
    int layers = device_attention_room(r, dm.cap_bytes, dm.runtime_bytes + dm.emulated_bytes);
    if (r.launch.world > 1) layers = min_over_ranks(r, layers);
    keep_attention_layers_on_device(r, layers);
}
