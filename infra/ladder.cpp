// infra/ladder.cpp - the memory ladder of the talk (--ladder): stage k turns on the techniques of
// stages 1..k, and each stage's memory per GPU is planned (--ladder --plan, no GPU needed) or
// measured (--ladder: every stage runs as a child process of this same program, and what it
// allocated, how long its step took and how it failed are read from its log and exit code).
//
//   stage  flag        what changes
//   0      (none)      every GPU holds the whole model, trains on its own sequence, keeps everything
//   1      --fsdp      parameters, gradients and AdamW states sharded over the GPUs
//   2      --ulysses   one sequence split over the GPUs; all-to-all around attention
//   3      --ckpt      only block inputs kept; each layer recomputed in the backward
//   4      --offload   those block inputs live in pinned host memory
//   5      --chunked   MLP, element-wise work and loss in token chunks
//   6      --untied    attention in head chunks with one reused buffer set
//   7      (ours)      beyond the talk: our four memory savings (beyond/savings.cu), one flag each
// Stages 1-6 are the talk's techniques in their textbook form: for Llama 3.1 8B on the talk's
// node, stage 5 reaches 3M tokens and only stage 6 reaches 5M. Stage 7 shows where we go further.
//
// Unless --nproc or --sim-world says otherwise, the ladder is the talk's node: eight GPUs of
// 80 GB. Planned, that is eight GPUs; measured, eight real processes where eight GPUs are
// visible, and otherwise one GPU emulating rank 0 of eight (--sim-world 8).
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "train.h"

static const int TALK_GPUS = 8;
static const double TALK_GPU_GIB = 80.0;
static const int LADDER_STAGES = 8;  // 0 .. 7
static const char* STAGE_FLAGS[] = {"(none)", "--fsdp", "--ulysses", "--ckpt", "--offload", "--chunked", "--untied",
                                    "our savings"};
static const char* SAVINGS_FLAGS = "--vocab-pieces --one-offload-slot --grad-in-att-output --dq-sums-in-staging";

void apply_stage(StepOptions& s, int stage) {
    if (stage >= 1) s.fsdp = true;
    if (stage >= 2) s.ulysses = true;
    if (stage >= 3) s.ckpt = true;
    if (stage >= 4) s.offload = true;
    if (stage >= 5) s.chunked = true;
    if (stage >= 6 && !s.untied) s.untied = 1, s.ckpt = true;
    if (stage >= 7) {  // beyond the talk (beyond/savings.cu)
        s.vocab_pieces = 0;  // as few pieces as keep each within a layer
        s.one_offload_slot = s.grad_in_att_output = s.dq_sums_in_staging = true;
    }
}

int gpu_count(const Options& o) { return std::max(o.nproc, std::max(o.sim_world, 1)); }

static double ladder_cap(const Options& o) { return o.mem_cap_gib > 0 ? o.mem_cap_gib : TALK_GPU_GIB; }

// What the ladder runs on: the GPUs given, or the talk's node.
static Options on_ladder_gpus(Options o, bool measured) {
    if (o.gpus_given) return o;
    const bool emulated = measured && visible_gpus() < TALK_GPUS;
    (emulated ? o.sim_world : o.nproc) = TALK_GPUS;
    return o;
}

static std::string gpus_text(const Options& o) {
    const int n = gpu_count(o);
    std::string s = o.sim_world > 1 ? "rank 0 of " + std::to_string(n) + " GPUs, emulated on one"
                                     : std::to_string(n) + (n > 1 ? " GPUs" : " GPU");
    if (!o.gpus_given) s += " (the talk's node; --nproc N or --sim-world N for another)";
    return s;
}

std::vector<LadderRow> ladder_plan(const Options& base) {
    const LlamaConfig cfg = resolve_config(base);
    const int world = gpu_count(base);
    const double cap = ladder_cap(base), rt = runtime_estimate_gib(world);
    std::vector<LadderRow> rows;
    for (int k = 0; k < LADDER_STAGES; k++) {
        LadderRow r;
        r.stage = k;
        r.flags = STAGE_FLAGS[k];
        r.runtime_gib = rt;
        Options o = base;
        o.step = StepOptions();
        o.step.fused_attention = base.step.fused_attention;
        o.step.chunk_tokens = base.step.chunk_tokens;
        o.step.loss_chunk_tokens = base.step.loss_chunk_tokens;
        apply_stage(o.step, k);
        if (o.step.ulysses) {
            RunShape sh;
            sh.batch = o.batch, sh.seq = o.seq_len, sh.sp = world;
            try {
                ulysses_check(cfg, sh);
                untied_check(cfg, sh, o.step.untied);
            } catch (const Fatal& f) {
                r.refused = f.what();
                rows.push_back(r);
                continue;
            }
        }
        MemoryPlan p = plan_memory(cfg, o, o.seq_len);
        for (int c = 0; c < MEM_NUM_CATEGORIES; c++) r.gib[c] = p.arena.category_bytes(c) / GiB;
        r.total_gib = p.total_gib(rt);
        r.host_gib = p.host_bytes / GiB;
        r.fits = r.total_gib <= cap && p.host_bytes <= o.step.host_mem_gib * GiB;  // device and --host-mem-gib
        r.longest = longest_context(cfg, o, cap, rt);
        rows.push_back(r);
    }
    return rows;
}

static std::string json_memory_gib(const LadderRow& r) {
    char buf[256];
    snprintf(buf, sizeof buf,
             "{\"model\": %.4f, \"attention\": %.4f, \"other\": %.4f, \"comm\": %.4f, \"workspace\": %.4f, "
             "\"runtime\": %.4f}",
             r.gib[MEM_MODEL], r.gib[MEM_ATTENTION], r.gib[MEM_OTHER], r.gib[MEM_COMM], r.gib[MEM_WORKSPACE],
             r.runtime_gib);
    return buf;
}

// ---------------------------------------------------------------------------------------------
// --ladder --plan: the table, from the plan alone.
static int print_ladder(const Options& o) {
    const LlamaConfig cfg = resolve_config(o);
    const int world = gpu_count(o);
    const double cap = ladder_cap(o);
    std::vector<LadderRow> rows = ladder_plan(o);
    printf("the memory ladder, planned: %s, %d layers, %lld tokens per sequence (%.2fM), %s, cap %.0f GiB per GPU\n",
           cfg.name.c_str(), cfg.n_layers, (long long)o.seq_len, o.seq_len / 1048576.0, gpus_text(o).c_str(), cap);
    printf("runtime estimate per GPU %.2f GiB (CUDA context and cuBLAS%s); measured figures come from running a step\n",
           rows[0].runtime_gib, world > 1 ? ", NCCL's buffers as measured on two H200s" : "");
    printf("%-5s %-11s %9s %10s %9s %8s %10s %9s  %-24s %s\n", "stage", "adds", "model", "attention", "other", "comm",
           "total GiB", "host GiB", "under the cap", "longest context");
    FILE* log = open_output(o.log_path, "--log");
    for (const LadderRow& r : rows) {
        if (!r.refused.empty()) {
            printf("%-5d %-11s (%s)\n", r.stage, r.flags.c_str(), r.refused.c_str());
            continue;
        }
        char verdict[64];
        if (r.fits) snprintf(verdict, sizeof verdict, "fits");
        else if (r.total_gib <= cap) snprintf(verdict, sizeof verdict, "OOM, host %.0f GiB", r.host_gib);
        else snprintf(verdict, sizeof verdict, "OOM, needs %.1f GiB", r.total_gib);
        printf("%-5d %-11s %9.2f %10.2f %9.2f %8.2f %10.2f %9.2f  %-24s %lld (%.2fM)\n", r.stage, r.flags.c_str(),
               r.gib[MEM_MODEL], r.gib[MEM_ATTENTION], r.gib[MEM_OTHER], r.gib[MEM_COMM], r.total_gib, r.host_gib,
               verdict, (long long)r.longest, r.longest / 1048576.0);
        if (log)
            fprintf(log,
                    "{\"type\": \"ladder_plan\", \"config\": \"%s\", \"layers\": %d, \"seq_len\": %lld, \"gpus\": %d, "
                    "\"cap_gib\": %.1f, \"stage\": %d, \"adds\": \"%s\", \"memory_gib\": %s, \"total_gib\": %.4f, "
                    "\"host_gib\": %.4f, \"fits\": %s, \"longest_context\": %lld}\n",
                    cfg.name.c_str(), cfg.n_layers, (long long)o.seq_len, world, cap, r.stage, r.flags.c_str(),
                    json_memory_gib(r).c_str(), r.total_gib, r.host_gib, r.fits ? "true" : "false",
                    (long long)r.longest);
    }
    if (log) fclose(log);
    printf("stages 1-6 are the talk's techniques; stage 7 adds ours: %s (beyond/savings.cu)\n", SAVINGS_FLAGS);
    if (cfg.name == "llama3.1-8b")
        printf("the Untied Ulysses paper, Llama3-8B at 3M tokens on 8 x H100: 64.6 GiB per GPU with the ALST stack "
               "(stage 5), 51.1 with UPipe (stage 6)\n");
    if (cfg.name == "qwen3-32b")
        printf("the Untied Ulysses paper, Qwen3-32B on 16 x H100 (two nodes, Ulysses 8 x ring 2): Ulysses out of memory "
               "at 3M, UPipe's longest 4M (out of memory at 5M)\n");
    return EXIT_OK;
}

// ---------------------------------------------------------------------------------------------
// --ladder: every stage measured in a child process.
struct StageRun {
    int code = -1;
    std::string output, log;
};

// One word for /bin/sh, whatever it holds: inside '...' nothing is special but ' itself, which
// becomes '\'' (close, an escaped quote, reopen).
std::string shell_quote(const std::string& s) {
    std::string q = "'";
    for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
}

// This program with `args`, its output and (with a log path) its log read back.
static StageRun run_child(const std::vector<std::string>& args, const std::string& log_path) {
    // This program's own path: /proc/self/exe read here, since inside popen's shell it would
    // name the shell.
    char self[4096];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) runtime_error("--ladder: cannot find this program's path (/proc/self/exe)");
    self[len] = 0;
    std::string cmd = shell_quote(self);
    for (const std::string& a : args) cmd += " " + shell_quote(a);
    if (!log_path.empty()) cmd += " --log " + shell_quote(log_path);
    StageRun r;
    FILE* p = popen((cmd + " 2>&1").c_str(), "r");
    if (!p) runtime_error("--ladder: cannot start a child run");
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
    int st = pclose(p);
    r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (!log_path.empty()) {
        std::ifstream f(log_path);
        std::stringstream ss;
        ss << f.rdbuf();
        r.log = ss.str();
        if (truncate(log_path.c_str(), 0) != 0)  // a child that fails before its log opens leaves none
            runtime_error("--ladder: cannot empty its child runs' log '" + log_path + "': " + strerror(errno));
    }
    return r;
}

// The child runs' log: a new file of this run's own in $TMPDIR (else /tmp), made before any GPU
// work (a folder that cannot take it is a usage error) and removed when the ladder ends.
struct ChildLog {
    std::string path;
    ChildLog() {
        const char* tmp = getenv("TMPDIR");
        const std::string folder = tmp && *tmp ? tmp : "/tmp";
        path = folder + "/train_ladder_XXXXXX.jsonl";
        const int fd = mkstemps(&path[0], 6);
        if (fd < 0)
            usage_error("--ladder: cannot make its child runs' log in '" + folder + "' (TMPDIR names the folder): " +
                        strerror(errno));
        close(fd);
    }
    ~ChildLog() { unlink(path.c_str()); }
    ChildLog(const ChildLog&) = delete;
    ChildLog& operator=(const ChildLog&) = delete;
};

// The number after "key": in the last line of `text` that has it (NAN if none).
static double last_number(const std::string& text, const std::string& key) {
    size_t p = text.rfind("\"" + key + "\": ");
    return p == std::string::npos ? NAN : std::atof(text.c_str() + p + key.size() + 4);
}

// The flags of stage k, for a child run of `layers` layers at `seq` tokens.
static std::vector<std::string> stage_args(const Options& o, int k, int layers, int64_t seq, int steps) {
    std::vector<std::string> a = {"--config", o.config, "--layers", std::to_string(layers), "--seq-len",
                                  std::to_string(seq), "--batch", std::to_string(o.batch), "--steps",
                                  std::to_string(steps), "--task", o.task, "--seed", std::to_string(o.seed),
                                  "--mem-cap-gib", std::to_string(ladder_cap(o)),
                                  "--host-mem-gib", std::to_string(o.step.host_mem_gib),
                                  "--comm-timeout-s", std::to_string(o.comm_timeout_s)};
    if (k > 0) a.push_back("--stage"), a.push_back(std::to_string(k));
    if (o.sim_world > 1) a.push_back("--sim-world"), a.push_back(std::to_string(o.sim_world));
    if (o.nproc > 1) a.push_back("--nproc"), a.push_back(std::to_string(o.nproc));
    // The ladder's stages plan the lean backward, so auto runs them with it too (auto could pick
    // the fused one in some stages and not others, and the measurement would leave the plan).
    a.push_back("--attention"), a.push_back(o.attention == "auto" ? "fast" : o.attention);
    if (o.step.chunk_tokens) a.push_back("--chunk-tokens"), a.push_back(std::to_string(o.step.chunk_tokens));
    if (o.step.loss_chunk_tokens)
        a.push_back("--loss-chunk-tokens"), a.push_back(std::to_string(o.step.loss_chunk_tokens));
    return a;
}

static bool lacks_pinned_memory(const StageRun& r) {
    return r.code == EXIT_OOM && r.output.find("out of memory: pinned host memory") != std::string::npos;
}

// A stage's measured step: what the child allocated against the plan at the same depth.
struct StageMeasure {
    int code = -1;
    std::string outcome = "ran";
    double planned = NAN, measured = NAN, step_s = NAN;
};

static StageMeasure measure_stage(const Options& o, int k, int layers, const LadderRow& at_depth,
                                  const std::string& tmp_log) {
    StageRun r = run_child(stage_args(o, k, layers, o.seq_len, o.steps), tmp_log);
    StageMeasure s;
    s.code = r.code;
    if (r.code == 0) {
        double runtime = last_number(r.log, "runtime_gib");
        s.planned = at_depth.total_gib - at_depth.runtime_gib + runtime;  // the plan with the measured runtime
        s.measured = last_number(r.log, "driver_gib");  // after the last step, or allocation alone
        s.step_s = o.steps > 0 ? last_number(r.log, "step_time_s") : NAN;
    } else if (lacks_pinned_memory(r)) {
        s.outcome = "device fits; this machine lacks the pinned host memory";
    } else if (r.code == EXIT_OOM) {
        size_t p = r.output.find("the step needs ");
        s.outcome = p == std::string::npos
                        ? "OOM"
                        : "OOM (needs " + r.output.substr(p + 15, r.output.find(" GiB", p) - p - 15) + " GiB)";
    } else {
        s.outcome = "failed (exit " + std::to_string(r.code) + ")";
    }
    return s;
}

// The longest context at full depth: the plan's, allocated, and 1K more refused.
static std::string confirm_longest(const Options& o, int k, int layers, int64_t longest) {
    const std::string n = std::to_string(longest);
    if (longest <= 0 || !o.confirm_longest) return n + " planned";
    StageRun a = run_child(stage_args(o, k, layers, longest, 0), "");
    StageRun b = run_child(stage_args(o, k, layers, longest + 1024, 0), "");
    const bool host_refused = b.output.find("--host-mem-gib allows") != std::string::npos;
    if (a.code == 0 && b.code == EXIT_OOM) return n + (host_refused ? " (allocated; +1K refused: --host-mem-gib)" : " (allocated; +1K refused)");
    if (a.code == 0 && b.code == 0)  // the plan's runtime estimate is a little above this GPU's
        return n + " (allocated; +1K allocates too: the plan's runtime estimate is above this GPU's measured runtime)";
    if (lacks_pinned_memory(a)) return n + " (device fits; this machine lacks the pinned host memory)";
    return n + " (not confirmed: exits " + std::to_string(a.code) + ", " + std::to_string(b.code) + ")";
}

static void log_ladder_run(FILE* log, const Options& o, const LlamaConfig& cfg, int layers) {
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const char* commit = getenv("TRAIN_COMMIT");  // set by make ladder
    fprintf(log,
            "{\"type\": \"ladder_run\", \"command\": \"%s\", \"gpu\": \"%s\", \"commit\": \"%s\", \"config\": \"%s\", "
            "\"seq_len\": %lld, \"gpus\": %d, \"emulated\": %s, \"cap_gib\": %.1f, \"measure_layers\": %d, "
            "\"layers\": %d, \"steps\": %d}\n",
            json_escape(command_line(o)).c_str(), prop.name, json_escape(commit && *commit ? commit : "unknown").c_str(),
            cfg.name.c_str(), (long long)o.seq_len, gpu_count(o), o.sim_world > 1 ? "true" : "false", ladder_cap(o),
            layers, cfg.n_layers, o.steps);
}

static void log_stage(FILE* log, const Options& o, const LlamaConfig& cfg, int k, int layers, const LadderRow& f,
                      const StageMeasure& s, const std::string& longest) {
    fprintf(log,
            "{\"type\": \"ladder_measured\", \"config\": \"%s\", \"seq_len\": %lld, \"stage\": %d, \"adds\": \"%s\", "
            "\"measure_layers\": %d, \"layers\": %d, \"memory_gib\": %s, \"total_gib\": %.4f, "
            "\"full_depth_plan_gib\": %.4f, \"host_gib\": %.4f, \"fits\": %s, \"exit_code\": %d, \"outcome\": \"%s\", "
            "\"plan_gib_at_measured_depth\": %s, \"driver_gib\": %s, \"step_time_s\": %s, "
            "\"longest_context\": %lld, \"longest_confirmed\": \"%s\"}\n",
            cfg.name.c_str(), (long long)o.seq_len, k, f.flags.c_str(), layers, cfg.n_layers, json_memory_gib(f).c_str(),
            f.total_gib, f.total_gib, f.host_gib, f.fits ? "true" : "false", s.code, json_escape(s.outcome).c_str(),
            json_number(s.planned, "%.6f").c_str(), json_number(s.measured, "%.6f").c_str(),
            json_number(s.step_s, "%.6f").c_str(), (long long)f.longest, json_escape(longest).c_str());
    fflush(log);
}

static int measure_ladder(const Options& o) {
    const LlamaConfig cfg = resolve_config(o);
    const ChildLog tmp;
    if (visible_gpus() == 0) no_gpu_error("the measured ladder runs steps; `--ladder --plan` needs none");
    // Said once here, not by every stage's child run.
    if (o.step.fused_attention && !attention_uses_hopper({1, o.seq_len, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim}))
        usage_error(FUSED_NEEDS_FAST_KERNELS);
    const int layers = o.measure_layers > 0 ? o.measure_layers : cfg.n_layers;
    std::vector<LadderRow> full = ladder_plan(o);  // the config's depth: the ladder's verdicts
    Options shallow = o;
    shallow.layers = layers;
    std::vector<LadderRow> at_depth = ladder_plan(shallow);  // what the child runs allocate
    FILE* log = open_output(o.log_path, "--log");
    if (log) log_ladder_run(log, o, cfg, layers);
    printf("the memory ladder, measured: %s, %lld tokens per sequence, %s, cap %.0f GiB; steps run with %d of %d layers\n",
           cfg.name.c_str(), (long long)o.seq_len, gpus_text(o).c_str(), ladder_cap(o), layers, cfg.n_layers);
    printf("%-5s %-11s | %-22s | %8s %9s %8s %7s %7s | %9s %9s %7s %9s | %-26s\n", "stage", "adds", "full depth (plan)",
           "model", "attention", "other", "comm", "host", "plan GiB", "measured", "diff", "step s",
           "longest context (confirmed)");
    for (int k = 0; k < (int)full.size(); k++) {
        const LadderRow& f = full[k];
        if (!f.refused.empty()) {
            printf("%-5d %-11s | (%s)\n", k, f.flags.c_str(), f.refused.c_str());
            if (log)
                fprintf(log, "{\"type\": \"ladder_measured\", \"stage\": %d, \"adds\": \"%s\", \"refused\": \"%s\"}\n", k,
                        f.flags.c_str(), json_escape(f.refused).c_str());
            continue;
        }
        const StageMeasure s = measure_stage(o, k, layers, at_depth[k], tmp.path);
        const std::string longest = confirm_longest(o, k, cfg.n_layers, f.longest);
        char verdict[64], step[32] = "-";
        if (!f.fits && f.total_gib <= ladder_cap(o)) snprintf(verdict, sizeof verdict, "OOM, host %.0f GiB", f.host_gib);
        else snprintf(verdict, sizeof verdict, f.fits ? "fits %.1f GiB" : "OOM, needs %.1f GiB", f.total_gib);
        if (std::isfinite(s.step_s)) snprintf(step, sizeof step, "%.3f", s.step_s);
        printf("%-5d %-11s | %-22s | %8.2f %9.2f %8.2f %7.2f %7.2f | ", k, f.flags.c_str(), verdict, f.gib[MEM_MODEL],
               f.gib[MEM_ATTENTION], f.gib[MEM_OTHER], f.gib[MEM_COMM], f.host_gib);
        if (s.code == 0)
            printf("%9.2f %9.2f %6.1f%% %9s | %s\n", s.planned, s.measured, 100.0 * (s.measured - s.planned) / s.planned,
                   step, longest.c_str());
        else
            printf("%-37s | %s\n", s.outcome.c_str(), longest.c_str());
        fflush(stdout);
        if (log) log_stage(log, o, cfg, k, layers, f, s, longest);
    }
    if (log) fclose(log);
    return EXIT_OK;
}

int ladder_main(const Options& given) {
    const Options o = on_ladder_gpus(given, !given.plan);
    return o.plan ? print_ladder(o) : measure_ladder(o);
}
