// train.cpp - the training program: flags, synthetic data, the memory plan, the training loop
// and its logs. One process, one GPU (multi-GPU launch comes with FSDP and Ulysses).
//
//   ./train --config llama3.2-3b --seq-len 8K --steps 20      train, print one line a step
//   ./train --config llama3.1-8b --seq-len 64K --plan         the memory plan, no GPU needed
//   ./train --help                                            every flag
#include "train.h"

#include <arpa/inet.h>
#include <cuda_runtime.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include "llama.h"

// =============================================================================================
// Flags
std::string usage_text() {
    return "usage: train [flags]\n"
           "\n"
           "Model and data\n"
           "  --config NAME        " + known_config_names() + " (default llama3.2-3b)\n"
           "  --layers N           override the number of transformer layers\n"
           "  --seq-len N          tokens per sequence; suffixes K (x1024) and M (x1024^2), e.g. 8K, 3M (default 8K)\n"
           "  --batch N            sequences per step (default 1)\n"
           "  --task copy|random   synthetic data: copy = second half repeats the first (learnable only by\n"
           "                       attending far back; only that half is scored), random = uniform tokens (default copy)\n"
           "  --task-vocab N       synthetic tokens are drawn from [0, N) (default min(1024, vocabulary))\n"
           "  --seed N             weights and data; the same seed gives the same losses (default 1234)\n"
           "\n"
           "Optimization (AdamW, fp32 master weights and moments, bf16 compute)\n"
           "  --steps N            training steps (default 10)\n"
           "  --lr X               peak learning rate (default 3e-4)\n"
           "  --min-lr-ratio X     cosine decay ends at lr * X (default 0.1)\n"
           "  --warmup N           linear warmup steps (default steps/10, at least 1)\n"
           "  --weight-decay X     decoupled, matrices only (default 0.1)\n"
           "  --grad-clip X        global gradient-norm clip, 0 = off (default 1.0)\n"
           "\n"
           "GPUs\n"
           "  --nproc N            start N processes, one per visible GPU (under mpirun/srun: leave out, ranks come from them)\n"
           "  --sim-world N        run rank 0's exact share of an N-GPU run on this one GPU (memory and compute per GPU;\n"
           "                       collectives become local copies, the loss is meaningless)\n"
           "  --comm-timeout-s X   a step waiting longer than this on its peers ends the run (default 600)\n"
           "\n"
           "Memory techniques (the ladder of DESIGN.md; each computes the same loss and gradients)\n"
           "  --stage N            turn on stages 1..N of the ladder: 1 --fsdp, 2 --ulysses, 3 --ckpt, 4 --offload, 5 --chunked,\n"
           "                       6 --untied\n"
           "  --ladder             every stage of the ladder: planned memory per GPU, fits or OOM, longest context under the\n"
           "                       cap; without --plan each stage also runs (--steps steps, as a child process) and its\n"
           "                       measured memory and step time are shown against the plan\n"
           "  --measure-layers N   with --ladder: run the stages' steps with N layers (full depth is planned)\n"
           "  --confirm-longest    with --ladder: allocate each stage's longest context (and see 1K more refused)\n"
           "  --fsdp               shard parameters, gradients and AdamW states over the GPUs (per layer, gathered when used)\n"
           "  --ulysses            split one sequence over the GPUs; all-to-all to head-sharded attention and back\n"
           "  --ckpt[=selective]   activation checkpointing: keep only block inputs and recompute each layer in\n"
           "                       the backward; =selective also keeps attention outputs (no attention rerun)\n"
           "  --offload            kept tensors live in pinned host memory, prefetched for the backward (implies --ckpt)\n"
           "  --chunked            MLP, element-wise ops and the LM head + loss in token chunks\n"
           "  --untied[=K]         Untied Ulysses: attention in chunks of K query heads per GPU, one reused buffer set\n"
           "                       (default K = 1; implies --ckpt)\n"
           "  --attention auto|fast|fused|reference  attention kernels: fast = attention_hopper.cu (wgmma + TMA; head\n"
           "                       dim 128 on an sm_90 GPU, else the reference) with the lean backward (two kernels, no\n"
           "                       extra buffer); fused = the same with dQ added in fp32 inside the dK/dV kernel (about\n"
           "                       10% faster backward from 16K tokens, 4 bytes per dQ element more); reference =\n"
           "                       attention.cu; auto (default) = fused where its dQ sums fit under the cap, else fast.\n"
           "                       All are bit-reproducible; auto's choice depends on the free memory, so give fast or\n"
           "                       fused to reproduce a run bit for bit elsewhere. --ladder plans and runs auto as fast\n"
           "  --chunk-tokens N     tokens per chunk of a layer (default: the hidden size)\n"
           "  --loss-chunk-tokens N  tokens per chunk of the LM head and loss (default: logits near 1 GiB)\n"
           "\n"
           "Files\n"
           "  --init-from PATH     start from a Hugging Face checkpoint (model.safetensors, a directory, or a sharded index)\n"
           "  --save-to DIR        at the end, write a Hugging Face checkpoint (model.safetensors + config.json) to DIR\n"
           "  --save-dtype bf16|fp32  dtype of --save-to (default bf16)\n"
           "  --data FILE          train on a token file (random windows; format in the README) instead of --task\n"
           "  --checkpoint-dir DIR the whole training state goes here, atomically, every --checkpoint-every steps\n"
           "  --checkpoint-every N save the training state every N steps (and at the last step)\n"
           "  --resume             continue from the latest training state in --checkpoint-dir (fresh start if none)\n"
           "\n"
           "Memory and output\n"
           "  --mem-cap-gib X      refuse what a card of X GiB could not hold (emulates an 80 GB H100 on an H200)\n"
           "  --plan               print the memory plan per category and exit (no GPU needed)\n"
           "  --log FILE           write one JSON object per step (plus one for the setup) to FILE\n"
           "  --dump FILE          write the first step's loss and every gradient (whole, float32) to FILE\n"
           "  --timeline FILE      write the last step's event timeline (compute per layer, each copy) as JSON (with --offload)\n"
           "  --mem-trace FILE     write live memory per category (and pinned host) over the last step, as JSON lines\n"
           "  --peak-tflops X      bf16 peak for MFU (default: 989 for H100/H200, else MFU is not shown)\n"
           "  --help               this text\n"
           "\n"
           "Exit codes: 0 ok, 1 runtime failure, 2 bad usage or input, 3 out of memory.\n";
}

std::vector<std::string> split_commas(const std::string& list) {
    std::vector<std::string> items;
    for (size_t pos = 0;;) {
        const size_t comma = list.find(',', pos);
        items.push_back(list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
        if (comma == std::string::npos) return items;
        pos = comma + 1;
    }
}

int64_t parse_tokens(const std::string& flag, const std::string& value) {
    if (value.empty()) usage_error(flag + " needs a value");
    std::string digits = value;
    int64_t mult = 1;
    char last = value.back();
    if (last == 'K' || last == 'k') mult = 1024, digits.pop_back();
    else if (last == 'M' || last == 'm') mult = 1024 * 1024, digits.pop_back();
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos)
        usage_error(flag + " expects a positive whole number with an optional K or M suffix, got '" + value + "'");
    if (digits.size() > 12) usage_error(flag + " value '" + value + "' is too large");
    int64_t v = std::stoll(digits) * mult;
    if (v <= 0) usage_error(flag + " must be positive, got '" + value + "'");
    return v;
}

static int64_t parse_int(const std::string& flag, const std::string& value, int64_t lo, int64_t hi) {
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || errno != 0)
        usage_error(flag + " expects a whole number, got '" + value + "'");
    if (v < lo || v > hi)
        usage_error(flag + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + value);
    return v;
}

static double parse_double(const std::string& flag, const std::string& value, double lo, double hi) {
    char* end = nullptr;
    double v = std::strtod(value.c_str(), &end);
    if (value.empty() || *end != '\0' || !std::isfinite(v))
        usage_error(flag + " expects a number, got '" + value + "'");
    if (v < lo || v > hi) {
        std::ostringstream os;
        os << flag << " must be in [" << lo << ", " << hi << "], got " << value;
        usage_error(os.str());
    }
    return v;
}

Options parse_options(int argc, char** argv) {
    Options o;
    for (int i = 0; i < argc; i++) o.argv.push_back(argv[i]);
    for (int i = 1; i < argc; i++) {
        std::string arg = argv[i], value;
        bool has_value = false;
        size_t eq = arg.find('=');
        if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
            value = arg.substr(eq + 1);
            arg = arg.substr(0, eq);
            has_value = true;
        }
        auto need = [&]() -> std::string {
            if (has_value) return value;
            if (i + 1 >= argc) usage_error(arg + " needs a value");
            return argv[++i];
        };
        auto flag_only = [&]() {
            if (has_value) usage_error(arg + " takes no value");
        };
        if (arg == "--help" || arg == "-h") flag_only(), o.help = true;
        else if (arg == "--plan") flag_only(), o.plan = true;
        else if (arg == "--config") o.config = need();
        else if (arg == "--layers") o.layers = (int)parse_int(arg, need(), 1, 100000);
        else if (arg == "--seq-len") o.seq_len = parse_tokens(arg, need());
        else if (arg == "--batch") o.batch = (int)parse_int(arg, need(), 1, 1 << 20);
        else if (arg == "--steps") o.steps = (int)parse_int(arg, need(), 0, 1 << 30);
        else if (arg == "--lr") o.lr = parse_double(arg, need(), 0.0, 10.0);
        else if (arg == "--min-lr-ratio") o.min_lr_ratio = parse_double(arg, need(), 0.0, 1.0);
        else if (arg == "--warmup") o.warmup = (int)parse_int(arg, need(), 0, 1 << 30);
        else if (arg == "--weight-decay") o.weight_decay = parse_double(arg, need(), 0.0, 10.0);
        else if (arg == "--grad-clip") o.grad_clip = parse_double(arg, need(), 0.0, 1e9);
        else if (arg == "--seed") o.seed = (uint64_t)parse_int(arg, need(), 0, INT64_MAX);
        else if (arg == "--task") o.task = need();
        else if (arg == "--task-vocab") o.task_vocab = (int)parse_int(arg, need(), 2, 1 << 30);
        else if (arg == "--mem-cap-gib") o.mem_cap_gib = parse_double(arg, need(), 0.001, 1e6);
        else if (arg == "--peak-tflops") o.peak_tflops = parse_double(arg, need(), 0.001, 1e6);
        else if (arg == "--log") o.log_path = need();
        else if (arg == "--timeline") o.timeline_path = need();
        else if (arg == "--mem-trace") o.mem_trace_path = need();
        else if (arg == "--dump") o.dump_path = need();
        else if (arg == "--init-from") o.init_from = need();
        else if (arg == "--save-to") o.save_to = need();
        else if (arg == "--save-dtype") o.save_dtype = need();
        else if (arg == "--data") o.data_path = need();
        else if (arg == "--checkpoint-dir") o.checkpoint_dir = need();
        else if (arg == "--checkpoint-every") o.checkpoint_every = (int)parse_int(arg, need(), 1, 1 << 30);
        else if (arg == "--resume") flag_only(), o.resume = true;
        else if (arg == "--nproc") o.nproc = (int)parse_int(arg, need(), 1, 4096);
        else if (arg == "--sim-world") o.sim_world = (int)parse_int(arg, need(), 1, 1 << 20);
        else if (arg == "--comm-timeout-s") o.comm_timeout_s = parse_double(arg, need(), 1.0, 1e7);
        else if (arg == "--fsdp") flag_only(), o.step.fsdp = true;
        else if (arg == "--ulysses") flag_only(), o.step.ulysses = true;
        else if (arg == "--stage") o.stage = (int)parse_int(arg, need(), 0, 6);
        else if (arg == "--ladder") flag_only(), o.ladder = true;
        else if (arg == "--measure-layers") o.measure_layers = (int)parse_int(arg, need(), 1, 100000);
        else if (arg == "--confirm-longest") flag_only(), o.confirm_longest = true;
        else if (arg == "--ckpt") {
            if (has_value && value != "selective" && value != "full")
                usage_error("--ckpt takes no value, or =selective, or =full; got '" + value + "'");
            o.step.ckpt = true;
            o.step.selective = has_value && value == "selective";
        } else if (arg == "--offload") flag_only(), o.step.offload = true;
        else if (arg == "--chunked") flag_only(), o.step.chunked = true;
        else if (arg == "--untied") o.step.untied = has_value ? (int)parse_int(arg, value, 1, 1 << 16) : 1;
        else if (arg == "--attention") {
            o.attention = need();
            if (o.attention != "auto" && o.attention != "fast" && o.attention != "fused" && o.attention != "reference")
                usage_error("--attention must be 'auto', 'fast', 'fused' or 'reference', got '" + o.attention + "'");
            o.step.fused_attention = o.attention == "fused";
        } else if (arg == "--chunk-tokens") o.step.chunk_tokens = parse_tokens(arg, need());
        else if (arg == "--loss-chunk-tokens") o.step.loss_chunk_tokens = parse_tokens(arg, need());
        else usage_error("unknown flag '" + std::string(argv[i]) + "' (see --help)");
    }
    if (o.task != "copy" && o.task != "random")
        usage_error("--task must be 'copy' or 'random', got '" + o.task + "'");
    if (o.task == "copy" && o.seq_len < 4)
        usage_error("--task copy needs --seq-len of at least 4");
    if (o.seq_len > (int64_t)1 << 40) usage_error("--seq-len is beyond anything addressable");
    apply_stage(o.step, o.stage);
    if ((o.measure_layers || o.confirm_longest) && !o.ladder)
        usage_error("--measure-layers and --confirm-longest go with --ladder");
    if (o.nproc > 1 && o.sim_world > 1) usage_error("--nproc and --sim-world exclude each other");
    if (o.step.offload || o.step.untied) o.step.ckpt = true;  // both work on what checkpointing keeps
    if (o.save_dtype != "bf16" && o.save_dtype != "fp32") usage_error("--save-dtype must be bf16 or fp32");
    if ((o.resume || o.checkpoint_every) && o.checkpoint_dir.empty())
        usage_error("--resume and --checkpoint-every need --checkpoint-dir");
    if ((o.step.chunk_tokens || o.step.loss_chunk_tokens) && !o.step.chunked)
        usage_error("--chunk-tokens and --loss-chunk-tokens need --chunked");
    if (!o.timeline_path.empty() && !o.step.offload) usage_error("--timeline needs --offload");
    if (!o.mem_trace_path.empty() && o.steps < 1) usage_error("--mem-trace traces a step: it needs --steps 1 or more");
    return o;
}

LlamaConfig resolve_config(const Options& o) {
    LlamaConfig c = config_by_name(o.config);
    if (o.layers > 0) c.n_layers = o.layers;
    // What the kernels assume: 16-byte vector accesses along D, F and V; head dim 64 or 128.
    if (c.dim % 8 || c.ffn_dim % 8 || c.vocab % 8)
        usage_error(c.name + ": dim, ffn_dim and vocab must be multiples of 8");
    if (c.head_dim != 64 && c.head_dim != 128)
        usage_error(c.name + ": head_dim must be 64 or 128");
    if (c.n_kv_heads <= 0 || c.n_heads % c.n_kv_heads)
        usage_error(c.name + ": query heads must be a multiple of KV heads");
    if (o.task_vocab > c.vocab)  // -1 (the default) becomes min(1024, vocab) in run()
        usage_error("--task-vocab " + std::to_string(o.task_vocab) + " exceeds the vocabulary (" +
                    std::to_string(c.vocab) + ") of " + c.name);
    return c;
}

// =============================================================================================
// Synthetic data and the learning-rate schedule.
uint64_t SyntheticData::next_u64() {  // splitmix64: small, fast, reproducible everywhere
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void SyntheticData::next(int32_t* tokens, int32_t* targets, int batch, int64_t seq) {
    if (file) {  // windows of a token file
        for (int b = 0; b < batch; b++) {
            uint64_t offset = next_u64() % (file->count - (uint64_t)seq);
            for (int64_t i = 0; i < seq; i++) {
                tokens[b * seq + i] = (int32_t)file->tokens[offset + i];
                targets[b * seq + i] = (int32_t)file->tokens[offset + i + 1];
            }
        }
        return;
    }
    // Each sequence is seq + 1 tokens z; inputs z[0..seq-1], targets z[1..seq].
    std::vector<int32_t> z(seq + 1);
    for (int b = 0; b < batch; b++) {
        int64_t half = (seq + 1) / 2;
        for (int64_t i = 0; i <= seq; i++) {
            bool copied = task == "copy" && i >= half && i < 2 * half;
            z[i] = copied ? z[i - half] : (int32_t)(next_u32() % (uint32_t)vocab);
        }
        for (int64_t i = 0; i < seq; i++) {
            tokens[b * seq + i] = z[i];
            bool scored = task != "copy" || (i + 1 >= half && i + 1 < 2 * half);
            targets[b * seq + i] = scored ? z[i + 1] : -1;
        }
    }
}

double lr_at(const Options& o, int step) {
    int warmup = o.warmup >= 0 ? o.warmup : std::max(1, o.steps / 10);
    if (step < warmup) return o.lr * (step + 1) / warmup;
    int decay_steps = std::max(1, o.steps - warmup);
    double progress = std::min(1.0, (double)(step - warmup) / decay_steps);
    double min_lr = o.lr * o.min_lr_ratio;
    return min_lr + 0.5 * (o.lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

void apply_stage(StepOptions& s, int stage) {
    if (stage >= 1) s.fsdp = true;
    if (stage >= 2) s.ulysses = true;
    if (stage >= 3) s.ckpt = true;
    if (stage >= 4) s.offload = true;
    if (stage >= 5) s.chunked = true;
    if (stage >= 6 && !s.untied) s.untied = 1, s.ckpt = true;
}

std::vector<LadderRow> ladder_plan(const Options& base) {
    static const char* flags[] = {"(none)", "--fsdp", "--ulysses", "--ckpt", "--offload", "--chunked", "--untied"};
    const LlamaConfig cfg = resolve_config(base);
    const int world = std::max(base.nproc, std::max(base.sim_world, 1));
    const double cap = base.mem_cap_gib > 0 ? base.mem_cap_gib : 80.0, rt = runtime_estimate_gib(world);
    std::vector<LadderRow> rows;
    for (int k = 0; k <= 6; k++) {
        LadderRow r;
        r.stage = k;
        r.flags = flags[k];
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
        r.fits = r.total_gib <= cap;
        r.longest = longest_context(cfg, o, cap, rt);
        rows.push_back(r);
    }
    return rows;
}

// ---------------------------------------------------------------------------------------------
// The measured ladder: every stage is run by this same program in a child process (its own
// CUDA context, its own NCCL), and what it allocated, how long its step took and how it failed
// are read from its log and its exit code, then set against the plan.
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

// A JSON number, or null where the value is not finite (a diverged loss): JSON has no nan.
std::string json_number(double v, const char* fmt) {
    if (!std::isfinite(v)) return "null";
    char buf[64];
    snprintf(buf, sizeof buf, fmt, v);
    return buf;
}

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
        unlink(log_path.c_str());
    }
    return r;
}

static std::string json_escape(const std::string& s);

// The command line as typed, for logs.
static std::string command_line(const Options& o) {
    std::string cmd;
    for (const std::string& a : o.argv) cmd += (cmd.empty() ? "" : " ") + a;
    return cmd;
}

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
                                  "--mem-cap-gib", std::to_string(o.mem_cap_gib > 0 ? o.mem_cap_gib : 80.0),
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

static const char* FUSED_NEEDS_FAST_KERNELS =
    "--attention fused needs the fast kernels (head dim 128 on an sm_90 GPU); this run would use attention.cu's";

static int measure_ladder(const Options& o) {
    const LlamaConfig cfg = resolve_config(o);
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        cudaGetLastError();
        fprintf(stderr, "error: the measured ladder runs steps and needs a GPU; `--ladder --plan` needs none\n");
        return EXIT_RUNTIME;
    }
    // Said once here, not by every stage's child run.
    if (o.step.fused_attention && !attention_uses_hopper({1, o.seq_len, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim}))
        usage_error(FUSED_NEEDS_FAST_KERNELS);
    const int layers = o.measure_layers > 0 ? o.measure_layers : cfg.n_layers;
    const double cap = o.mem_cap_gib > 0 ? o.mem_cap_gib : 80.0;
    std::vector<LadderRow> full = ladder_plan(o);  // the config's depth: the ladder's verdicts
    Options shallow = o;
    shallow.layers = layers;
    std::vector<LadderRow> at_depth = ladder_plan(shallow);  // what the child runs allocate
    const std::string tmp = "/tmp/train_ladder_" + std::to_string(getpid()) + ".jsonl";
    FILE* log = o.log_path.empty() ? nullptr : fopen(o.log_path.c_str(), "w");
    if (!o.log_path.empty() && !log) usage_error("cannot write --log file '" + o.log_path + "'");
    if (log) {  // what ran where: the command, the GPU, the commit (TRAIN_COMMIT, set by make ladder)
        cudaDeviceProp prop;
        CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
        const std::string cmd = command_line(o);
        const char* commit = getenv("TRAIN_COMMIT");
        fprintf(log,
                "{\"type\": \"ladder_run\", \"command\": \"%s\", \"gpu\": \"%s\", \"commit\": \"%s\", \"config\": \"%s\", "
                "\"seq_len\": %lld, \"gpus\": %d, \"emulated\": %s, \"cap_gib\": %.1f, \"measure_layers\": %d, "
                "\"layers\": %d, \"steps\": %d}\n",
                json_escape(cmd).c_str(), prop.name, json_escape(commit && *commit ? commit : "unknown").c_str(),
                cfg.name.c_str(), (long long)o.seq_len, std::max(o.nproc, std::max(o.sim_world, 1)),
                o.sim_world > 1 ? "true" : "false", cap, layers, cfg.n_layers, o.steps);
    }
    printf("the memory ladder, measured: %s, %lld tokens per sequence, %s, cap %.0f GiB; steps run with %d of %d layers\n",
           cfg.name.c_str(), (long long)o.seq_len,
           o.sim_world > 1 ? ("rank 0 of " + std::to_string(o.sim_world) + " GPUs, emulated").c_str()
                           : (std::to_string(std::max(1, o.nproc)) + " GPU(s)").c_str(),
           cap, layers, cfg.n_layers);
    printf("%-5s %-10s | %-22s | %8s %9s %8s %7s %7s | %9s %9s %7s %9s | %-26s\n", "stage", "adds", "full depth (plan)",
           "model", "attention", "other", "comm", "host", "plan GiB", "measured", "diff", "step s",
           "longest context (confirmed)");
    for (size_t k = 0; k < full.size(); k++) {
        const LadderRow &f = full[k], &d = at_depth[k];
        if (!f.refused.empty()) {
            printf("%-5zu %-10s | (%s)\n", k, f.flags.c_str(), f.refused.c_str());
            if (log)
                fprintf(log, "{\"type\": \"ladder_measured\", \"stage\": %zu, \"adds\": \"%s\", \"refused\": \"%s\"}\n", k,
                        f.flags.c_str(), json_escape(f.refused).c_str());
            continue;
        }
        char verdict[64];
        snprintf(verdict, sizeof verdict, f.fits ? "fits %.1f GiB" : "OOM, needs %.1f GiB", f.total_gib);
        // A step at the measurement depth, or the out-of-memory it must end in.
        StageRun r = run_child(stage_args(o, (int)k, layers, o.seq_len, o.steps), tmp);
        double planned = NAN, measured = NAN, step_s = NAN;
        std::string outcome;
        if (r.code == 0) {
            double runtime = last_number(r.log, "runtime_gib");
            planned = d.total_gib - d.runtime_gib + runtime;  // the plan with the measured runtime
            measured = last_number(r.log, "driver_gib");      // after the last step, or allocation alone
            step_s = o.steps > 0 ? last_number(r.log, "step_time_s") : NAN;
        } else if (r.code == 3 && r.output.find("out of memory: pinned host memory") != std::string::npos) {
            outcome = "device fits; this machine lacks the pinned host memory";
        } else if (r.code == 3) {
            size_t p = r.output.find("the step needs ");
            outcome = p == std::string::npos ? "OOM" : "OOM (needs " + r.output.substr(p + 15, r.output.find(" GiB", p) - p - 15) + " GiB)";
        } else {
            outcome = "failed (exit " + std::to_string(r.code) + ")";
        }
        // The longest context at full depth: the plan's, allocated (1K more must not be).
        std::string longest = std::to_string(f.longest) + " planned";
        if (f.longest > 0 && o.confirm_longest) {
            StageRun a = run_child(stage_args(o, (int)k, cfg.n_layers, f.longest, 0), "");
            StageRun b = run_child(stage_args(o, (int)k, cfg.n_layers, f.longest + 1024, 0), "");
            if (a.code == 0 && b.code == 3) longest = std::to_string(f.longest) + " (allocated; +1K refused)";
            else if (a.code == 0 && b.code == 0)  // the plan's runtime estimate is a little above this GPU's
                longest = std::to_string(f.longest) + " (allocated; +1K allocates too: the plan's runtime estimate "
                          "is above this GPU's measured runtime)";
            else if (a.code == 3 && a.output.find("out of memory: pinned host memory") != std::string::npos)
                longest = std::to_string(f.longest) + " (device fits; this machine lacks the pinned host memory)";
            else longest = std::to_string(f.longest) + " (not confirmed: exits " + std::to_string(a.code) + ", " +
                           std::to_string(b.code) + ")";
        }
        char step[32] = "-";
        if (std::isfinite(step_s)) snprintf(step, sizeof step, "%.3f", step_s);
        printf("%-5zu %-10s | %-22s | %8.2f %9.2f %8.2f %7.2f %7.2f | ", k, f.flags.c_str(), verdict, f.gib[MEM_MODEL],
               f.gib[MEM_ATTENTION], f.gib[MEM_OTHER], f.gib[MEM_COMM], f.host_gib);
        if (r.code == 0)
            printf("%9.2f %9.2f %6.1f%% %9s | %s\n", planned, measured, 100.0 * (measured - planned) / planned, step,
                   longest.c_str());
        else
            printf("%-37s | %s\n", outcome.c_str(), longest.c_str());
        fflush(stdout);
        if (log) {  // JSON has no NaN: what was not measured is null
            auto num = [](double v) { return std::isfinite(v) ? std::to_string(v) : std::string("null"); };
            fprintf(log,
                    "{\"type\": \"ladder_measured\", \"config\": \"%s\", \"seq_len\": %lld, \"stage\": %zu, \"adds\": \"%s\", "
                    "\"measure_layers\": %d, \"layers\": %d, \"memory_gib\": {\"model\": %.4f, \"attention\": %.4f, "
                    "\"other\": %.4f, \"comm\": %.4f, \"workspace\": %.4f, \"runtime\": %.4f}, \"total_gib\": %.4f, "
                    "\"full_depth_plan_gib\": %.4f, \"host_gib\": %.4f, \"fits\": %s, \"exit_code\": %d, \"outcome\": \"%s\", "
                    "\"plan_gib_at_measured_depth\": %s, \"driver_gib\": %s, \"step_time_s\": %s, "
                    "\"longest_context\": %lld, \"longest_confirmed\": \"%s\"}\n",
                    cfg.name.c_str(), (long long)o.seq_len, k, f.flags.c_str(), layers, cfg.n_layers, f.gib[MEM_MODEL],
                    f.gib[MEM_ATTENTION], f.gib[MEM_OTHER], f.gib[MEM_COMM], f.gib[MEM_WORKSPACE], f.runtime_gib,
                    f.total_gib, f.total_gib, f.host_gib, f.fits ? "true" : "false", r.code,
                    json_escape(r.code == 0 ? "ran" : outcome).c_str(), num(planned).c_str(), num(measured).c_str(),
                    num(step_s).c_str(), (long long)f.longest, json_escape(longest).c_str());
            fflush(log);
        }
    }
    if (log) fclose(log);
    return EXIT_OK;
}

static int print_ladder(const Options& o) {
    const LlamaConfig cfg = resolve_config(o);
    const int world = std::max(o.nproc, std::max(o.sim_world, 1));
    const double cap = o.mem_cap_gib > 0 ? o.mem_cap_gib : 80.0;
    std::vector<LadderRow> rows = ladder_plan(o);
    printf("the memory ladder, planned: %s, %d layers, %lld tokens per sequence (%.2fM), %d GPU%s, cap %.0f GiB per GPU\n",
           cfg.name.c_str(), cfg.n_layers, (long long)o.seq_len, o.seq_len / 1048576.0, world, world > 1 ? "s" : "", cap);
    printf("runtime estimate per GPU %.2f GiB (CUDA context and cuBLAS%s); measured figures come from running a step\n",
           rows[0].runtime_gib, world > 1 ? ", NCCL's buffers as measured on two H200s" : "");
    printf("%-5s %-10s %9s %10s %9s %8s %10s %9s  %-24s %s\n", "stage", "adds", "model", "attention", "other", "comm",
           "total GiB", "host GiB", "under the cap", "longest context");
    FILE* log = o.log_path.empty() ? nullptr : fopen(o.log_path.c_str(), "w");
    for (const LadderRow& r : rows) {
        if (!r.available || !r.refused.empty()) {
            printf("%-5d %-10s %s\n", r.stage, r.flags.c_str(),
                   !r.available ? "(not in this build yet)" : ("(" + r.refused + ")").c_str());
            continue;
        }
        char verdict[64];
        if (r.fits) snprintf(verdict, sizeof verdict, "fits");
        else snprintf(verdict, sizeof verdict, "OOM, needs %.1f GiB", r.total_gib);
        printf("%-5d %-10s %9.2f %10.2f %9.2f %8.2f %10.2f %9.2f  %-24s %lld (%.2fM)\n", r.stage, r.flags.c_str(),
               r.gib[MEM_MODEL], r.gib[MEM_ATTENTION], r.gib[MEM_OTHER], r.gib[MEM_COMM], r.total_gib, r.host_gib,
               verdict, (long long)r.longest, r.longest / 1048576.0);
        if (log)
            fprintf(log,
                    "{\"type\": \"ladder_plan\", \"config\": \"%s\", \"layers\": %d, \"seq_len\": %lld, \"gpus\": %d, "
                    "\"cap_gib\": %.1f, \"stage\": %d, \"adds\": \"%s\", \"memory_gib\": {\"model\": %.4f, "
                    "\"attention\": %.4f, \"other\": %.4f, \"comm\": %.4f, \"workspace\": %.4f, \"runtime\": %.4f}, "
                    "\"total_gib\": %.4f, \"host_gib\": %.4f, \"fits\": %s, \"longest_context\": %lld}\n",
                    cfg.name.c_str(), cfg.n_layers, (long long)o.seq_len, world, cap, r.stage, r.flags.c_str(),
                    r.gib[MEM_MODEL], r.gib[MEM_ATTENTION], r.gib[MEM_OTHER], r.gib[MEM_COMM], r.gib[MEM_WORKSPACE],
                    r.runtime_gib, r.total_gib, r.host_gib, r.fits ? "true" : "false", (long long)r.longest);
    }
    if (log) fclose(log);
    return EXIT_OK;
}

// =============================================================================================
// Reporting helpers.
static double host_rss_gib(const char* key) {  // VmRSS (now) or VmHWM (peak) of this process
    std::ifstream f("/proc/self/status");
    std::string line;
    while (std::getline(f, line))
        if (line.rfind(key, 0) == 0) return std::atof(line.c_str() + strlen(key)) / (1024.0 * 1024.0);
    return 0;
}

// The ladder of DESIGN.md, in order; `available` marks the stages this build implements.
static std::string next_stage_hint(const Options& o) {
    struct Stage { const char* flag; bool on, available; };
    const Stage ladder[] = {{"--fsdp", o.step.fsdp, true},     {"--ulysses", o.step.ulysses, true},
                            {"--ckpt", o.step.ckpt, true},     {"--offload", o.step.offload, true},
                            {"--chunked", o.step.chunked, true}, {"--untied", o.step.untied > 0, true}};
    std::string missing;
    for (const Stage& st : ladder) {
        if (st.on) continue;
        if (st.available) return "add " + std::string(st.flag) + (missing.empty() ? "" : " (" + missing + " not in this build yet)") +
                                 ", or reduce --seq-len, --batch or --layers";
        missing += (missing.empty() ? "" : ", ") + std::string(st.flag);
    }
    return "reduce --seq-len, --batch or --layers (" + missing + " not in this build yet)";
}

MemoryPlan plan_memory(const LlamaConfig& cfg, const Options& o, int64_t seq_len) {
    MemoryPlan p;
    Model m;
    m.cfg = cfg;
    m.opt = o.step;
    m.world = std::max(o.nproc, std::max(o.sim_world, 1));
    m.shape.batch = o.batch;
    m.shape.seq = seq_len;
    m.shape.sp = o.step.ulysses ? m.world : 1;
    model_declare_buffers(m, p.arena);
    p.host_bytes = offload_host_bytes(m);
    return p;
}

int64_t longest_context(const LlamaConfig& cfg, const Options& o, double cap_gib, double runtime_gib,
                        int64_t granularity) {
    const int64_t sp = o.step.ulysses ? std::max(o.nproc, std::max(o.sim_world, 1)) : 1;
    granularity = align_up(granularity, sp);  // Ulysses needs the sequence divisible by the GPUs
    auto fits = [&](int64_t seq) { return plan_memory(cfg, o, seq).total_gib(runtime_gib) <= cap_gib; };
    if (!fits(granularity)) return 0;
    int64_t lo = 1, hi = 2;  // in units of granularity: lo fits, hi is to be tested
    while (hi < (1LL << 32) / granularity * 256 && fits(hi * granularity)) lo = hi, hi *= 2;
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        (fits(mid * granularity) ? lo : hi) = mid;
    }
    return lo * granularity;
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

static std::string json_escape(const std::string& s) {
    std::string r;
    for (char ch : s) {
        if (ch == '"' || ch == '\\') r += '\\', r += ch;
        else if ((unsigned char)ch < 0x20) { char b[8]; snprintf(b, sizeof b, "\\u%04x", ch); r += b; }
        else r += ch;
    }
    return r;
}

static std::string json_memory(const Arena& plan, int64_t host_bytes) {
    std::ostringstream os;
    os << "{";
    for (int c = 0; c < MEM_NUM_CATEGORIES; c++)
        os << (c ? ", " : "") << "\"" << mem_category_name(c) << "\": " << plan.category_bytes(c) / GiB;
    os << ", \"host_pinned\": " << host_bytes / GiB << "}";
    return os.str();
}

static void write_timeline(const std::string& path, const std::vector<TimelineEntry>& tl) {
    FILE* f = fopen(path.c_str(), "w");
    if (!f) usage_error("cannot write --timeline file '" + path + "'");
    fprintf(f, "[\n");
    for (size_t i = 0; i < tl.size(); i++)
        fprintf(f, "  {\"stream\": \"%s\", \"what\": \"%s\", \"layer\": %d, \"start_ms\": %.4f, \"end_ms\": %.4f}%s\n",
                tl[i].stream.c_str(), tl[i].what.c_str(), tl[i].layer, tl[i].start_ms, tl[i].end_ms,
                i + 1 < tl.size() ? "," : "");
    fprintf(f, "]\n");
    fclose(f);
}

// --mem-trace: one JSON line for the run, then one per progress event of the last step.
static void write_mem_trace(const Options& o, const char* gpu, const Model& m, const Arena& arena,
                            double driver_gib) {
    FILE* f = fopen(o.mem_trace_path.c_str(), "w");
    if (!f) usage_error("cannot write --mem-trace file '" + o.mem_trace_path + "'");
    const std::string cmd = command_line(o);
    std::string flags;
    const StepOptions& s = m.opt;
    if (s.fsdp) flags += " --fsdp";
    if (s.ulysses) flags += " --ulysses";
    if (s.ckpt) flags += s.selective ? " --ckpt=selective" : " --ckpt";
    if (s.offload) flags += " --offload";
    if (s.chunked) flags += " --chunked";
    if (s.untied) flags += " --untied=" + std::to_string(s.untied);
    fprintf(f, "{\"type\": \"mem_trace_run\", \"command\": \"%s\", \"gpu\": \"%s\", \"config\": \"%s\", "
               "\"layers\": %d, \"seq_len\": %lld, \"flags\": \"%s\"}\n",
            json_escape(cmd).c_str(), gpu, m.cfg.name.c_str(), m.cfg.n_layers, (long long)o.seq_len,
            flags.empty() ? "" : flags.c_str() + 1);
    for (const MemTracePoint& p : model_memory_trace(m, arena)) {
        fprintf(f, "{\"type\": \"mem_trace\", \"point\": \"%s\", \"layer\": %d, \"t_ms\": %.3f, \"live_gib\": {",
                p.point.c_str(), p.layer, p.t_ms);
        for (int c = 0; c < MEM_NUM_CATEGORIES; c++)
            fprintf(f, "%s\"%s\": %.4f", c ? ", " : "", mem_category_name(c), p.live[c] / GiB);
        fprintf(f, "}, \"host_gib\": %.4f, \"arena_gib\": %.4f, \"driver_gib\": %.4f}\n", p.host / GiB,
                arena.total() / GiB, driver_gib);
    }
    fclose(f);
}

struct Progress {  // per-layer progress with ETA, for long steps
    std::chrono::steady_clock::time_point start;
    int layers;
    cudaStream_t stream;
    Model* model;
};

static void progress_callback(void* ctx, const char* phase, int layer) {
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
// The run.
// Errors raised while flags and input files are checked are the same on every rank: rank 0
// alone reports them. Past that point a rank reports its own errors.
static bool g_symmetric_phase = true;

// ---------------------------------------------------------------------------------------------
// How this process was started: alone, by ./train --nproc N (our launcher), or by mpirun/srun.
struct Launch {
    int rank = 0, world = 1, local_rank = 0;
    int listen_fd = -1;  // rank 0 under ./train --nproc: the rendezvous socket, already listening
    std::string master_addr = "127.0.0.1";
    int master_port = 29500;
};

static int env_int(const char* name, int fallback) {
    const char* v = getenv(name);
    return v && *v ? atoi(v) : fallback;
}

static Launch launch_from_env() {
    Launch l;
    // Ours first, then Open MPI, MPICH/Hydra, Slurm.
    const char* vars[][3] = {{"TRAIN_RANK", "TRAIN_WORLD", "TRAIN_LOCAL_RANK"},
                             {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
                             {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
                             {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"}};
    for (auto& v : vars)
        if (getenv(v[0]) && getenv(v[1]) && env_int(v[1], 1) > 1) {
            l.rank = env_int(v[0], 0);
            l.world = env_int(v[1], 1);
            l.local_rank = env_int(v[2], l.rank);
            break;
        }
    l.listen_fd = env_int("TRAIN_LISTEN_FD", -1);
    if (getenv("MASTER_ADDR")) l.master_addr = getenv("MASTER_ADDR");
    l.master_port = env_int("MASTER_PORT", 29500);
    return l;
}

// ./train --nproc N: start N copies of this program, one per GPU, and wait for them. Rank 0
// inherits a socket already listening on a free port, so the NCCL id needs no shared file and
// no fixed port. If any rank fails, the others are stopped at once: no rank waits forever for
// a peer that is gone. The exit code is the first failing rank's.
static int launch_local(int n, char** argv) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (sockaddr*)&a, sizeof a) != 0 || listen(fd, n) != 0 ||
        getsockname(fd, (sockaddr*)&a, &len) != 0)
        runtime_error("--nproc: cannot open the rendezvous socket: " + std::string(strerror(errno)));
    std::vector<pid_t> pids;
    for (int r = 0; r < n; r++) {
        pid_t pid = fork();
        if (pid < 0) runtime_error("--nproc: fork failed: " + std::string(strerror(errno)));
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);  // the ranks end with their launcher
            setenv("TRAIN_RANK", std::to_string(r).c_str(), 1);
            setenv("TRAIN_WORLD", std::to_string(n).c_str(), 1);
            setenv("TRAIN_LOCAL_RANK", std::to_string(r).c_str(), 1);
            setenv("MASTER_ADDR", "127.0.0.1", 1);
            setenv("MASTER_PORT", std::to_string(ntohs(a.sin_port)).c_str(), 1);
            setenv("TRAIN_LISTEN_FD", std::to_string(r == 0 ? fd : -1).c_str(), 1);
            if (r != 0) close(fd);
            execv("/proc/self/exe", argv);
            fprintf(stderr, "error: --nproc: cannot start rank %d: %s\n", r, strerror(errno));
            _exit(EXIT_RUNTIME);
        }
        pids.push_back(pid);
    }
    close(fd);
    // The first rank to fail sets the exit code. The others get a moment to end by themselves
    // (an error every rank sees is reported by rank 0 alone, which may still be writing it);
    // whoever is still running after that, waiting on a dead peer, is stopped.
    int result = 0;
    std::vector<bool> alive(pids.size(), true);
    auto failed_at = std::chrono::steady_clock::time_point::max();
    bool stopped = false;
    for (size_t left = pids.size(); left > 0;) {
        const bool grace = result != 0 && !stopped;
        if (grace && std::chrono::steady_clock::now() - failed_at > std::chrono::seconds(2)) {
            for (size_t i = 0; i < pids.size(); i++)
                if (alive[i]) kill(pids[i], SIGTERM);
            stopped = true;
            continue;
        }
        int st = 0;
        pid_t p = waitpid(-1, &st, grace ? WNOHANG : 0);
        if (p == 0) {  // none ended yet, within the grace period
            usleep(10000);
            continue;
        }
        if (p < 0) {
            if (errno == EINTR) continue;
            break;
        }
        for (size_t i = 0; i < pids.size(); i++)
            if (pids[i] == p && alive[i]) alive[i] = false, left--;
        int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (code != 0 && result == 0) result = code, failed_at = std::chrono::steady_clock::now();
    }
    return result;
}

// Collectives on every communicator before memory is measured, small and large (NCCL picks
// other kernels and protocols by size, and loads each kernel at its first use): NCCL's memory
// then belongs to the runtime's share, measured, not hidden in our figures.
static void warm_up(Comm* comm, cudaStream_t s, double timeout_s) {
    if (comm->simulated || comm->world == 1) return;
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

static void write_dump(const std::string& path, double loss, const std::vector<float>& grads) {
    FILE* f = fopen(path.c_str(), "wb");
    if (!f) usage_error("cannot write --dump file '" + path + "'");
    const char magic[8] = {'L', 'L', 'G', 'R', 'A', 'D', '0', '1'};
    int64_t n = (int64_t)grads.size();
    bool ok = fwrite(magic, 8, 1, f) == 1 && fwrite(&loss, 8, 1, f) == 1 && fwrite(&n, 8, 1, f) == 1 &&
              fwrite(grads.data(), 4, grads.size(), f) == grads.size();
    if (fclose(f) != 0 || !ok) runtime_error("writing --dump file '" + path + "' failed");
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
static void plan_fused_backward(Model& m, Options& o, Arena& arena) {
    o.step.fused_attention = m.opt.fused_attention = true;
    arena = Arena();
    model_declare_buffers(m, arena);
}

// The sum over all ranks of one number per rank (a flag, a count), on the device.
static float sum_over_ranks(Comm* comm, float mine, cudaStream_t s, double timeout_s) {
    float* buf = nullptr;
    float sum = 0;
    CUDA_CHECK(cudaMalloc(&buf, sizeof(float)));
    CUDA_CHECK(cudaMemcpy(buf, &mine, sizeof(float), cudaMemcpyHostToDevice));
    comm->all_reduce(buf, 1, DType::F32, s);
    comm_sync(comm, s, timeout_s);
    CUDA_CHECK(cudaMemcpy(&sum, buf, sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaFree(buf));
    return sum;
}

static int run(Options o, const Launch& launch) {
    LlamaConfig cfg = resolve_config(o);
    if (o.task_vocab < 0) o.task_vocab = std::min(1024, cfg.vocab);
    const bool simulated = launch.world == 1 && o.sim_world > 1;
    // --plan --nproc N plans for N GPUs without starting them.
    const int world = simulated ? o.sim_world : (launch.world > 1 ? launch.world : std::max(1, o.nproc));
    const int rank = launch.rank;
    const bool lead = rank == 0;  // prints and writes files
    Model m;
    m.cfg = cfg;
    m.opt = o.step;
    m.world = world;
    m.shape.batch = o.batch;
    m.shape.seq = o.seq_len;
    m.shape.sp = o.step.ulysses ? world : 1;
    m.shape.sp_rank = o.step.ulysses ? rank : 0;
    ulysses_check(cfg, m.shape);
    untied_check(cfg, m.shape, o.step.untied);

    Arena arena;  // dry run: the plan
    model_declare_buffers(m, arena);
    const int64_t host_bytes = offload_host_bytes(m);
    const int dp = o.step.ulysses ? 1 : world;  // GPUs that train on different sequences
    const int64_t step_tokens = (int64_t)o.batch * dp * o.seq_len;

    if (lead) {
        printf("model %s: %d layers, dim %d, heads %d/%d x %d, ffn %d, vocab %d, %s embeddings, %.3f B parameters\n",
               cfg.name.c_str(), cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim,
               cfg.vocab, cfg.tied_embeddings ? "tied" : "untied", count_params(cfg) / 1e9);
        printf("run: %d GPU%s%s; step: %lld tokens (%d x %lld per sequence), %lld on each GPU, %.3g FLOP per GPU\n",
               world, world > 1 ? "s" : "", simulated ? " simulated (--sim-world: this is rank 0's share)" : "",
               (long long)step_tokens, o.batch * dp, (long long)o.seq_len, (long long)m.shape.tokens(),
               model_step_flops(cfg, m.shape));
        printf("techniques:%s%s%s%s%s%s%s\n", o.step.fsdp ? " fsdp" : "", o.step.ulysses ? " ulysses" : "",
           o.step.untied ? (" untied(" + std::to_string(o.step.untied) + ")").c_str() : "",
               o.step.ckpt ? (o.step.selective ? " ckpt(selective)" : " ckpt") : "", o.step.offload ? " offload" : "",
               o.step.chunked ? (" chunked(" + std::to_string(m.plan.chunk_rows) + ", loss " + std::to_string(m.plan.loss_rows) + ")").c_str() : "",
               (o.step.fsdp || o.step.ulysses || o.step.ckpt || o.step.chunked) ? "" : " none (stage 0)");
    }
    if (o.plan) {
        const double rt = runtime_estimate_gib(world);
        // auto: with a cap, what a run would choose (on an sm_90 GPU, where the fused backward runs).
        if (o.attention == "auto" && cfg.head_dim == 128 && o.mem_cap_gib > 0) {
            const bool fits = fused_backward_fits(m, (int64_t)(o.mem_cap_gib * GiB), (int64_t)(rt * GiB));
            const bool lean_fits = arena.total() / GiB + rt <= o.mem_cap_gib;
            if (fits) plan_fused_backward(m, o, arena);
            if (lead)
                printf("attention auto: %s\n", fits        ? "the fused backward (on an sm_90 GPU): its fp32 dQ sums fit under the cap"
                                               : lean_fits ? "the lean backward: the fused one's fp32 dQ sums would not fit under the cap"
                                                           : "planned with the lean backward; neither fits under the cap");
        } else if (o.attention == "auto" && cfg.head_dim == 128 && lead) {
            printf("attention auto: planned with the lean backward; a run on an sm_90 GPU takes the fused one if its "
                   "fp32 dQ sums also fit (give --mem-cap-gib to see which)\n");
        }
        printf("%s", plan_text(arena, host_bytes, rt, false).c_str());
        if (o.mem_cap_gib > 0) {
            double need = arena.total() / GiB + rt;
            if (need <= o.mem_cap_gib) printf("cap %.2f GiB: fits\n", o.mem_cap_gib);
            else printf("cap %.2f GiB: OOM, needs %.2f GiB (next: %s)\n", o.mem_cap_gib, need, next_stage_hint(o).c_str());
            Options lean = o;  // at the longest context, auto falls back to the lean backward
            if (o.attention == "auto") lean.step.fused_attention = false;
            int64_t longest = longest_context(cfg, lean, o.mem_cap_gib, rt);
            printf("longest context under %.2f GiB with these flags: %lld tokens (%.2fM)\n", o.mem_cap_gib,
                   (long long)longest, longest / 1048576.0);
        }
        return EXIT_OK;
    }

    // Input files are checked before any GPU work: a bad one is a usage error (exit code 2).
    if (!o.init_from.empty()) check_hf_checkpoint(m, o.init_from);
    std::unique_ptr<TokenFile> token_file;
    if (!o.data_path.empty()) {
        token_file.reset(new TokenFile(o.data_path, cfg.vocab));
        if (token_file->count < (uint64_t)o.seq_len + 1)
            usage_error("--data '" + o.data_path + "' holds " + std::to_string(token_file->count) +
                        " tokens; a sequence of --seq-len " + std::to_string(o.seq_len) + " needs " +
                        std::to_string(o.seq_len + 1));
    }

    // The GPU, the communicator, and what the runtime holds before our first allocation.
    g_symmetric_phase = false;
    int n_dev = 0;
    cudaError_t err = cudaGetDeviceCount(&n_dev);
    if (err != cudaSuccess || n_dev == 0) {
        fprintf(stderr,
                "error: no CUDA GPU is usable here (%s). This program trains on NVIDIA GPUs;\n"
                "       `./train --plan ...` prints the memory plan without one.\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "no device found");
        return EXIT_RUNTIME;
    }
    DeviceMemory dm;
    dm.device = launch.local_rank % n_dev;
    CUDA_CHECK(cudaSetDevice(dm.device));
    CUDA_CHECK(cudaFree(0));  // create the context now, so its memory is counted as runtime
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dm.device));
    attention_use_reference(o.attention == "reference");
    const bool fast_attention = attention_uses_hopper({1, o.seq_len, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim});
    if (o.step.fused_attention && !fast_attention) usage_error(FUSED_NEEDS_FAST_KERNELS);
    gemm_init(0, nullptr);  // the cuBLASLt handle; workspace attached after allocation
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    size_t free_before_comm = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_before_comm, &total_b));
    if (launch.world > 1)
        m.comm = comm_nccl(rank, world, launch.listen_fd, launch.master_addr, launch.master_port, o.comm_timeout_s);
    else
        m.comm = simulated ? comm_fake(world) : comm_single();
    m.owns_comm = true;
    m.comm_fsdp = m.comm->split();
    CUDA_CHECK(cudaStreamCreateWithFlags(&m.comm_stream, cudaStreamNonBlocking));
    warm_up(m.comm, stream, o.comm_timeout_s);          // each on the stream the step uses it on
    warm_up(m.comm_fsdp, m.comm_stream, o.comm_timeout_s);
    size_t free_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const double nccl_gib = ((double)free_before_comm - (double)free_b) / GiB;  // NCCL's buffers
    dm.total_bytes = (int64_t)total_b;
    dm.runtime_bytes = (int64_t)(total_b - free_b);
    dm.cap_bytes = o.mem_cap_gib > 0 ? std::min<int64_t>((int64_t)(o.mem_cap_gib * GiB), dm.total_bytes)
                                     : dm.total_bytes;
    // Emulating rank 0 of N: the cap also holds the NCCL buffers that rank would have (the
    // plan's estimate), so what fits here fits there.
    if (simulated) dm.emulated_bytes = (int64_t)(NCCL_OVERHEAD_ESTIMATE_GIB * GiB);
    // auto: the fused backward if its dQ sums fit on every rank (ranks agree, so they run the same
    // kernels).
    // Every rank takes part in the sum, whatever its kernels, so that the collectives pair up.
    if (o.attention == "auto") {
        const bool fits = fast_attention && fused_backward_fits(m, dm.cap_bytes, dm.runtime_bytes + dm.emulated_bytes);
        const bool all_fit =
            launch.world > 1 ? sum_over_ranks(m.comm, fits ? 0.f : 1.f, stream, o.comm_timeout_s) == 0 : fits;
        if (all_fit) plan_fused_backward(m, o, arena);
    }
    const char* attention_name = !fast_attention ? "reference" : o.step.fused_attention ? "hopper-fused" : "hopper";
    // A run of no steps shows the allocation; the pinned host memory of --offload is planned only.
    m.pin_host = o.steps > 0;
    if (lead) {
        printf("GPU: %s, %.1f GiB%s; runtime uses %.2f GiB before our first allocation (CUDA context and cuBLAS "
               "%.2f, NCCL %.2f)\n",
               prop.name, dm.total_bytes / GiB,
               o.mem_cap_gib > 0 ? (", capped at " + std::to_string(o.mem_cap_gib).substr(0, 6) + " GiB").c_str() : "",
               dm.runtime_bytes / GiB, dm.runtime_bytes / GiB - nccl_gib, nccl_gib);
        printf("%s", plan_text(arena, host_bytes, dm.runtime_bytes / GiB, true).c_str());
        if (simulated)
            printf("note: --sim-world %d runs rank 0's share on one GPU; its loss is meaningless; the cap also holds "
                   "the %.2f GiB of NCCL buffers a real rank would have (estimate)\n", world, NCCL_OVERHEAD_ESTIMATE_GIB);
        if (!m.pin_host && host_bytes > 0)
            printf("note: --steps 0: the %.2f GiB of pinned host memory are planned, not allocated\n", host_bytes / GiB);
    }

    // Allocate, and agree: an out-of-memory on one rank (a fuller GPU, pinned host memory that
    // ran out) ends the run on every rank, reported by the ranks it happened on (once if all).
    m.comm_timeout_s = o.comm_timeout_s;
    std::string alloc_error;
    int alloc_code = 0;
    try {
        model_allocate(m, arena, dm, next_stage_hint(o));
    } catch (const Fatal& f) {
        alloc_error = f.what(), alloc_code = f.code;
    }
    if (launch.world > 1) {
        const float failed = sum_over_ranks(m.comm, alloc_code ? 1.f : 0.f, stream, o.comm_timeout_s);
        if (failed > 0) {
            if (alloc_code && (failed < world || rank == 0))
                fprintf(stderr, "%s%s\n", failed < world ? ("[rank " + std::to_string(rank) + "] ").c_str() : "",
                        alloc_error.c_str());
            return alloc_code ? alloc_code : EXIT_OOM;
        }
    } else if (alloc_code) {
        throw Fatal(alloc_code, alloc_error);
    }
    if (!o.timeline_path.empty()) offload_enable_timeline(m, true);
    if (!o.init_from.empty()) load_hf_checkpoint(m, o.init_from, stream);
    else model_init_weights(m, o.seed, stream);

    FILE* log = nullptr;
    if (lead && !o.log_path.empty()) {
        log = fopen(o.log_path.c_str(), "w");
        if (!log) usage_error("cannot write --log file '" + o.log_path + "'");
        const std::string cmd = command_line(o);
        fprintf(log,
                "{\"type\": \"setup\", \"command\": \"%s\", \"gpu\": \"%s\", \"config\": \"%s\", \"layers\": %d, "
                "\"seq_len\": %lld, \"batch\": %d, \"world\": %d, \"simulated\": %s, \"local_tokens\": %lld, "
                "\"params\": %lld, \"attention\": \"%s\", \"plan_gib\": %s, \"runtime_gib\": %.4f, \"nccl_gib\": %.4f, "
                "\"cap_gib\": %.3f}\n",
                json_escape(cmd).c_str(), prop.name, cfg.name.c_str(), cfg.n_layers, (long long)o.seq_len, o.batch,
                world, simulated ? "true" : "false", (long long)m.shape.tokens(), (long long)count_params(cfg),
                attention_name,
                json_memory(arena, host_bytes).c_str(), dm.runtime_bytes / GiB, nccl_gib, dm.cap_bytes / GiB);
        fflush(log);
    }

    // Every GPU draws the whole step's data (the same seed) and keeps its part: its sequences,
    // or under Ulysses its slice of the one sequence. Either way rank r's tokens start at r T.
    if (log) {  // what the device holds once everything is allocated (the static plan's peak)
        CUDA_CHECK(cudaDeviceSynchronize());
        fprintf(log, "{\"type\": \"allocated\", \"memory_gib\": %s, \"runtime_gib\": %.4f, \"driver_gib\": %.4f}\n",
                json_memory(arena, host_bytes).c_str(), dm.runtime_bytes / GiB, dm.driver_used_bytes() / GiB);
        fflush(log);
    }
    SyntheticData data(o.task, o.task_vocab, o.seed ^ 0x5eedda7aull);
    data.file = token_file.get();
    int first_step = 0;
    if (o.resume) {
        int64_t st = 0;
        uint64_t ds = 0;
        if (load_train_state(m, o.checkpoint_dir, &st, &ds, stream)) {
            first_step = (int)st, data.state = ds;
            if (lead) printf("resumed from %s at step %d\n", o.checkpoint_dir.c_str(), first_step);
        } else if (lead) {
            printf("no training state in %s yet: starting at step 0\n", o.checkpoint_dir.c_str());
        }
    }
    const int64_t T = m.shape.tokens();
    std::vector<int32_t> all_tokens(step_tokens), all_targets(step_tokens);
    const double flops = model_step_flops(cfg, m.shape), peak = gpu_peak_tflops(o, prop);
    cudaEvent_t ev0, ev1;
    CUDA_CHECK(cudaEventCreate(&ev0));
    CUDA_CHECK(cudaEventCreate(&ev1));
    double last_step_s = flops / 150e12;  // guess for the first step: 150 TFLOP/s
    if (lead) {
        if (data.file) printf("training %d steps on %s (%llu tokens)\n", o.steps, o.data_path.c_str(),
                              (unsigned long long)data.file->count);
        else printf("training %d steps on the '%s' task (tokens < %d)\n", o.steps, o.task.c_str(), o.task_vocab);
        printf("  attention kernels: %s%s\n",
               !fast_attention          ? "attention.cu (reference)"
               : o.step.fused_attention ? "attention_hopper.cu (wgmma + TMA), fused backward"
                                        : "attention_hopper.cu (wgmma + TMA), lean backward",
               o.attention != "auto" || !fast_attention ? ""
               : o.step.fused_attention                 ? " (auto: its fp32 dQ sums fit)"
                                                        : " (auto: the fused backward's fp32 dQ sums would not fit on every GPU)");
        if (!data.file && o.task == "copy")
            printf("  uniform guess = ln(%d) = %.3f\n", o.task_vocab, std::log((double)o.task_vocab));
    }

    for (int step = first_step; step < o.steps; step++) {
        data.next(all_tokens.data(), all_targets.data(), o.batch * dp, o.seq_len);
        int64_t n_valid = 0;
        for (int32_t t : all_targets) n_valid += t >= 0;
        model_set_batch(m, all_tokens.data() + rank * T, all_targets.data() + rank * T, stream, n_valid);
        Progress prog{std::chrono::steady_clock::now(), cfg.n_layers, stream, &m};
        bool show_progress = lead && last_step_s > 10.0;  // long steps show per-layer progress
        AdamW opt;
        opt.lr = (float)lr_at(o, step);
        opt.weight_decay = (float)o.weight_decay;
        opt.step = step + 1;

        CUDA_CHECK(cudaEventRecord(ev0, stream));
        model_forward_backward(m, stream, show_progress ? progress_callback : nullptr, &prog);
        if (step == first_step && !o.dump_path.empty()) {  // the first step's loss and every gradient
            CUDA_CHECK(cudaMemcpyAsync(m.host_scalars, m.scalars, 4, cudaMemcpyDeviceToHost, stream));
            model_sync(m, stream);
            const float loss_sum = m.host_scalars[0];
            std::vector<float> grads = fsdp_full_gradients(m, stream);
            if (lead) write_dump(o.dump_path, loss_sum / (double)n_valid, grads);
            CUDA_CHECK(cudaEventRecord(ev0, stream));  // the dump is not part of the step's time
        }
        model_optimizer_step(m, opt, (float)o.grad_clip, stream);
        CUDA_CHECK(cudaEventRecord(ev1, stream));
        CUDA_CHECK(cudaMemcpyAsync(m.host_scalars, m.scalars, 3 * sizeof(float), cudaMemcpyDeviceToHost, stream));
        model_sync(m, stream);  // host-pinned target: the copy is asynchronous, the wait is watched
        const float* scalars = m.host_scalars;
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, ev0, ev1));
        double step_s = ms / 1000.0;
        last_step_s = step_s;
        double loss = n_valid > 0 ? scalars[0] / n_valid : 0.0;
        double tflops = flops / step_s / 1e12;
        double driver = dm.driver_used_bytes() / GiB, host = host_rss_gib("VmHWM:");  // includes pinned
        if (!std::isfinite(loss) && !simulated) runtime_error("loss is not finite at step " + std::to_string(step + 1));
        if (o.checkpoint_every && ((step + 1) % o.checkpoint_every == 0 || step + 1 == o.steps))
            save_train_state(m, o.checkpoint_dir, step + 1, data.state, stream, o.comm_timeout_s);
        if (!lead) continue;
        printf("step %4d/%d  loss %8.4f%s  lr %.2e  grad norm %7.3f | %9.0f tok/s", step + 1, o.steps, loss,
               simulated ? " (simulated)" : "", opt.lr, std::sqrt(scalars[1]), step_tokens / step_s);
        if (world > 1) printf(" (%.0f per GPU)", T / step_s);
        printf("  %6.1f TFLOP/s%s", tflops, world > 1 ? " per GPU" : "");
        if (peak > 0) printf("  MFU %4.1f%%", 100.0 * tflops / peak);
        printf("  %7.3f s | GiB model %.2f attention %.2f other %.2f comm %.2f workspace %.2f, driver %.2f, host %.2f\n",
               step_s, arena.category_bytes(MEM_MODEL) / GiB, arena.category_bytes(MEM_ATTENTION) / GiB,
               arena.category_bytes(MEM_OTHER) / GiB, arena.category_bytes(MEM_COMM) / GiB,
               arena.category_bytes(MEM_WORKSPACE) / GiB, driver, host);
        fflush(stdout);
        if (log) {
            fprintf(log,
                    "{\"type\": \"step\", \"step\": %d, \"loss\": %s, \"lr\": %.6g, \"grad_norm\": %s, "
                    "\"step_time_s\": %.6f, \"tokens_per_s\": %.2f, \"tokens_per_s_per_gpu\": %.2f, \"tflops\": %.3f, "
                    "\"mfu\": %.5f, \"memory_gib\": %s, \"driver_gib\": %.4f, \"host_gib\": %.4f}\n",
                    step + 1, json_number(loss, "%.9g").c_str(), opt.lr,
                    json_number(std::sqrt(scalars[1]), "%.6g").c_str(), step_s, step_tokens / step_s, T / step_s, tflops,
                    peak > 0 ? tflops / peak : 0.0, json_memory(arena, host_bytes).c_str(), driver, host);
            fflush(log);
        }
    }
    if (log) fclose(log);
    if (lead && !o.timeline_path.empty()) write_timeline(o.timeline_path, offload_timeline(m));
    if (lead && !o.mem_trace_path.empty()) write_mem_trace(o, prop.name, m, arena, dm.driver_used_bytes() / GiB);
    if (!o.save_to.empty()) {
        save_hf_checkpoint(m, o.save_to, o.save_dtype == "bf16", stream);
        if (lead) printf("saved a Hugging Face checkpoint (%s) to %s\n", o.save_dtype.c_str(), o.save_to.c_str());
    }
    gemm_destroy();
    model_free(m, dm);
    return EXIT_OK;
}

int train_main(int argc, char** argv) {
    const Launch launch = launch_from_env();
    // A usage error or an out-of-memory is the same on every rank: rank 0 alone reports it.
    auto report = [&](int code, const char* what) {
        if (launch.world > 1 && launch.rank != 0 && g_symmetric_phase) return;
        std::string prefix = launch.world > 1 ? "[rank " + std::to_string(launch.rank) + "] " : "";
        fprintf(stderr, "%s%s%s\n", prefix.c_str(), code == EXIT_OOM ? "" : "error: ", what);
    };
    try {
        Options o = parse_options(argc, argv);
        if (o.help) {
            printf("%s", usage_text().c_str());
            return EXIT_OK;
        }
        if (o.nproc > 1 && launch.world > 1 && o.nproc != launch.world)
            usage_error("--nproc " + std::to_string(o.nproc) + " but the launcher started " +
                        std::to_string(launch.world) + " processes; under mpirun or srun leave --nproc out");
        if (o.ladder) return o.plan ? print_ladder(o) : measure_ladder(o);
        if (o.nproc > 1 && launch.world == 1 && !o.plan) return launch_local(o.nproc, argv);
        return run(o, launch);
    } catch (const Fatal& f) {
        report(f.code, f.what());
        return f.code;
    } catch (const std::exception& e) {
        report(EXIT_RUNTIME, e.what());
        return EXIT_RUNTIME;
    }
}

#ifndef TRAIN_NO_MAIN
int main(int argc, char** argv) { return train_main(argc, argv); }
#endif
