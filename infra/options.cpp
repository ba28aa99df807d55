// infra/options.cpp - the program's flags: one table, which --help prints and parse_options
// reads, each flag with its help text and what it sets in Options (infra/train.h); the checks of
// what the flags imply and exclude; the model config they resolve to.
#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>

#include "infra/train.h"

// =============================================================================================
// Flags: one table, which --help prints and parse_options reads.
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

enum class Takes { NOTHING, VALUE, OPTIONAL_VALUE };
// A flag: its name, whether and how it takes a value (shown as `shape` in --help), its section
// of --help and its text there (lines after the first are continued below it), and what it sets
// (nullptr: a line of --help only, for a value of a flag listed elsewhere). A flag that names a
// path also says what the run does with it and where the path is kept (path_flag below):
// check_outputs reads every path flag through the table, so a flag that writes is checked
// because it says so.
struct Flag {
    const char* name;
    Takes takes;
    const char* shape;
    int section;
    const char* help;
    std::function<void(Options& o, const std::string& flag, const std::string& value)> set;
    PathRole role = PathRole::READS_FILE;
    std::string Options::*path_field = nullptr;
};

static const char* SECTIONS[] = {
    "Model and data",
    "Optimization (AdamW, fp32 master weights and moments, bf16 compute)",
    "GPUs",
    "The talk's memory techniques (ladder stages 1-6: docs/design.md; each computes the same loss and gradients)",
    "Beyond the talk (ladder stage 7, our memory savings: beyond/savings.cu; selective checkpointing: beyond/selective.cu)",
    "Kernels",
    "Files",
    "Memory and output",
};

using V = const std::string&;  // a flag's value, as given
// A flag naming a path that the run uses as `role`, kept in o.*field. An empty value would read
// as "not given" (no file, synthetic data, random weights): a usage error.
static Flag path_flag(const char* name, const char* shape, int section, const char* help, PathRole role,
                      std::string Options::*field) {
    auto set = [field](Options& o, V flag, V value) {
        if (value.empty()) usage_error(flag + " needs a path, got an empty one");
        o.*field = value;
    };
    return {name, Takes::VALUE, shape, section, help, set, role, field};
}
static const std::vector<Flag> FLAGS = {
    {"--config", Takes::VALUE, " NAME", 0, "known: see below (default llama3.2-3b)", [](Options& o, V, V v) { o.config = v; }},
    {"--layers", Takes::VALUE, " N", 0, "override the number of transformer layers",
     [](Options& o, V f, V v) { o.layers = (int)parse_int(f, v, 1, 100000); }},
    {"--seq-len", Takes::VALUE, " N", 0, "tokens per sequence; suffixes K (x1024) and M (x1024^2), e.g. 8K, 3M (default 8K)",
     [](Options& o, V f, V v) { o.seq_len = parse_tokens(f, v); }},
    {"--batch", Takes::VALUE, " N", 0, "sequences per step (default 1)", [](Options& o, V f, V v) { o.batch = (int)parse_int(f, v, 1, 1 << 20); }},
    {"--task", Takes::VALUE, " copy|induction|random", 0,
     "synthetic data: copy = the second half repeats the first (only that half is scored);\n"
     "induction = the same with the first half's tokens all different, so each one of the\n"
     "second half is found by looking up the token before it in the first half, however far\n"
     "back (an induction head); random = uniform tokens (default copy)",
     [](Options& o, V, V v) { o.task = v; }},
    {"--task-vocab", Takes::VALUE, " N", 0,
     "synthetic tokens are drawn from [0, N) (default min(1024, vocabulary); induction: the vocabulary)",
     [](Options& o, V f, V v) { o.task_vocab = (int)parse_int(f, v, 2, 1 << 30); }},
    {"--doc-lengths", Takes::VALUE, " MIN,MAX", 0,
     "the synthetic task in documents of MIN to MAX tokens (uniform; suffixes K, M), each its own\n"
     "copy or induction problem; without it a sequence is one",
     [](Options& o, V f, V v) {
         const std::vector<std::string> mm = split_commas(v);
         if (mm.size() != 2) usage_error(f + " takes MIN,MAX, got '" + v + "'");
         o.doc_min = parse_tokens(f, mm[0]), o.doc_max = parse_tokens(f, mm[1]);
     }},
    {"--doc-mask", Takes::NOTHING, "", 0,
     "packed documents: a token attends only to earlier tokens of its own document, RoPE\n"
     "positions count from the document's start, and a document's last token is not scored on\n"
     "the next one's first (the documents of --data's version-2 file, or of --doc-lengths)",
     [](Options& o, V, V) { o.step.doc_mask = true; }},
    {"--seed", Takes::VALUE, " N", 0, "weights and data; the same seed gives the same losses (default 1234)",
     [](Options& o, V f, V v) { o.seed = (uint64_t)parse_int(f, v, 0, INT64_MAX); }},
    {"--steps", Takes::VALUE, " N", 1, "training steps (default 10)", [](Options& o, V f, V v) { o.steps = (int)parse_int(f, v, 0, 1 << 30); }},
    {"--lr", Takes::VALUE, " X", 1, "peak learning rate (default 3e-4)", [](Options& o, V f, V v) { o.lr = parse_double(f, v, 0.0, 10.0); }},
    {"--min-lr-ratio", Takes::VALUE, " X", 1, "cosine decay ends at lr * X (default 0.1)",
     [](Options& o, V f, V v) { o.min_lr_ratio = parse_double(f, v, 0.0, 1.0); }},
    {"--warmup", Takes::VALUE, " N", 1, "linear warmup steps (default steps/10, at least 1)",
     [](Options& o, V f, V v) { o.warmup = (int)parse_int(f, v, 0, 1 << 30); }},
    {"--weight-decay", Takes::VALUE, " X", 1, "decoupled, matrices only (default 0.1)",
     [](Options& o, V f, V v) { o.weight_decay = parse_double(f, v, 0.0, 10.0); }},
    {"--grad-clip", Takes::VALUE, " X", 1, "global gradient-norm clip, 0 = off (default 1.0)",
     [](Options& o, V f, V v) { o.grad_clip = parse_double(f, v, 0.0, 1e9); }},
    {"--nproc", Takes::VALUE, " N", 2, "start N processes, one per visible GPU (under mpirun/srun: leave out, ranks come from them)",
     [](Options& o, V f, V v) { o.nproc = (int)parse_int(f, v, 1, 4096), o.gpus_given = true; }},
    {"--comm", Takes::VALUE, " nccl|host", 2,
     "how --nproc's processes exchange data: nccl (default), one GPU each; or host, through shared\n"
     "host memory, so that the processes share the visible GPUs, each given an equal part of its\n"
     "GPU (the multi-process path on a machine with one GPU; slow, bit-reproducible)",
     [](Options& o, V f, V v) {
         if (v != "nccl" && v != "host") usage_error(f + " must be nccl or host, got '" + v + "'");
         o.host_comm = v == "host";
     }},
    {"--sim-world", Takes::VALUE, " N", 2,
     "run rank 0's exact share of an N-GPU run on this one GPU (memory and compute per GPU;\n"
     "collectives become local copies, the loss is meaningless)",
     [](Options& o, V f, V v) { o.sim_world = (int)parse_int(f, v, 1, 1 << 20), o.gpus_given = true; }},
    {"--comm-timeout-s", Takes::VALUE, " X", 2, "a step waiting longer than this on its peers ends the run (default 600)",
     [](Options& o, V f, V v) { o.comm_timeout_s = parse_double(f, v, 1.0, 1e7); }},
    {"--stage", Takes::VALUE, " N", 3,
     "turn on stages 1..N of the ladder: 1 --fsdp, 2 --ulysses, 3 --ckpt, 4 --offload, 5 --chunked,\n"
     "6 --untied (the talk), 7 our memory savings (below)",
     [](Options& o, V f, V v) { o.stage = (int)parse_int(f, v, 0, 7); }},
    {"--ladder", Takes::NOTHING, "", 3,
     "every stage of the ladder: planned memory per GPU, fits or OOM, longest context under the\n"
     "cap (default 80 GiB); without --plan each stage also runs (--steps steps, as a child\n"
     "process) and its measured memory and step time are shown against the plan. Runs on the\n"
     "talk's node unless --nproc or --sim-world says otherwise: 8 GPUs planned; measured, 8\n"
     "processes where 8 GPUs are visible, else one GPU as rank 0 of 8 (--sim-world 8)",
     [](Options& o, V, V) { o.ladder = true; }},
    {"--measure-layers", Takes::VALUE, " N", 3, "with --ladder: run the stages' steps with N layers (full depth is planned)",
     [](Options& o, V f, V v) { o.measure_layers = (int)parse_int(f, v, 1, 100000); }},
    {"--confirm-longest", Takes::NOTHING, "", 3, "with --ladder: allocate each stage's longest context (and see 1K more refused)",
     [](Options& o, V, V) { o.confirm_longest = true; }},
    {"--fsdp", Takes::NOTHING, "", 3, "shard parameters, gradients and AdamW states over the GPUs (per layer, gathered when used)",
     [](Options& o, V, V) { o.step.fsdp = true; }},
    {"--ulysses", Takes::NOTHING, "", 3, "split one sequence over the GPUs; all-to-all to head-sharded attention and back",
     [](Options& o, V, V) { o.step.ulysses = true; }},
    {"--ckpt", Takes::OPTIONAL_VALUE, "[=full]", 3,
     "activation checkpointing: keep only block inputs and recompute each layer in the backward",
     [](Options& o, V f, V v) {
         if (!v.empty() && v != "selective" && v != "full")
             usage_error(f + " takes no value, or =selective, or =full; got '" + v + "'");
         o.step.ckpt = true, o.step.selective = v == "selective";
     }},
    {"--offload", Takes::NOTHING, "", 3, "block inputs live in pinned host memory, prefetched for the backward (implies --ckpt)",
     [](Options& o, V, V) { o.step.offload = true; }},
    {"--chunked", Takes::NOTHING, "", 3, "MLP, element-wise ops and the LM head + loss in token chunks",
     [](Options& o, V, V) { o.step.chunked = true; }},
    {"--untied", Takes::OPTIONAL_VALUE, "[=K]", 3,
     "Untied Ulysses: attention in chunks of K query heads per GPU, one reused buffer set\n"
     "(default K = 1; implies --ckpt)",
     [](Options& o, V f, V v) { o.step.untied = v.empty() ? 1 : (int)parse_int(f, v, 1, 1 << 16); }},
    {"--chunk-tokens", Takes::VALUE, " N", 3, "tokens per chunk of a layer (default: the hidden size)",
     [](Options& o, V f, V v) { o.step.chunk_tokens = parse_tokens(f, v); }},
    {"--loss-chunk-tokens", Takes::VALUE, " N", 3, "tokens per chunk of the LM head and loss (default: logits near 1 GiB)",
     [](Options& o, V f, V v) { o.step.loss_chunk_tokens = parse_tokens(f, v); }},
    {"--vocab-pieces", Takes::OPTIONAL_VALUE, "[=N]", 4,
     "the embedding and LM head in N units of vocabulary rows (default: as few as keep each\n"
     "within about a layer's size, 3 for Llama 3.1 8B); FSDP's slots then hold a layer, and the\n"
     "head takes two passes. Without it (or with N = 1) they are whole units, as in the talk",
     [](Options& o, V f, V v) { o.step.vocab_pieces = v.empty() ? 0 : (int)parse_int(f, v, 1, 1 << 20), o.vocab_pieces_given = true; }},
    {"--one-offload-slot", Takes::NOTHING, "", 4,
     "with --offload: the block inputs staged through one device slot, not two; the MLP writes a\n"
     "layer's output over its input, and the backward cannot fetch the next input ahead",
     [](Options& o, V, V) { o.step.one_offload_slot = true; }},
    {"--grad-in-att-output", Takes::NOTHING, "", 4,
     "with --untied: the gradient of the normalized input in the attention output's memory\n"
     "(every head chunk's delta taken first)",
     [](Options& o, V, V) { o.step.grad_in_att_output = true; }},
    {"--dq-sums-in-staging", Takes::NOTHING, "", 4,
     "with --untied and the fused backward: its fp32 dQ sums in the all-to-all staging",
     [](Options& o, V, V) { o.step.dq_sums_in_staging = true; }},
    {"--ckpt=selective", Takes::NOTHING, "", 4,
     "selective checkpointing: also keep each layer's attention output and lse, so the backward\n"
     "reruns q|k|v but not attention; with --offload on the host within --host-mem-gib, then on\n"
     "the device in the room the cap leaves, and the other layers rerun attention", nullptr},
    {"--host-mem-gib", Takes::VALUE, " X", 4,
     "pinned host memory per GPU that --offload may plan (default 240: one GPU's share of an\n"
     "8-GPU node's 2 TB)",
     [](Options& o, V f, V v) { o.step.host_mem_gib = parse_double(f, v, 0.0, 1e9); }},
    {"--device-keep-gib", Takes::VALUE, " X", 4,
     "device memory that --ckpt=selective --offload may fill with attention outputs the host\n"
     "cannot hold (default: all the cap leaves, less 1 GiB; 0: none)",
     [](Options& o, V f, V v) { o.step.device_keep_gib = parse_double(f, v, 0.0, 1e6); }},
    {"--rebuild-inputs", Takes::VALUE, " N", 4,
     "at most N block inputs that --ckpt=selective --offload leaves off the host, to keep more\n"
     "attention outputs there: the backward rebuilds each from the layer below's input and\n"
     "attention output (default: as many as keep more; 0: none)",
     [](Options& o, V f, V v) { o.step.rebuild_inputs = (int)parse_int(f, v, 0, 1 << 20); }},
    {"--attention", Takes::VALUE, " auto|fast|fused|reference", 5,
     "fast = kernels/attention_hopper.cu (wgmma + TMA; head dim 128 on an\n"
     "sm_90 GPU, else the reference) with the lean backward (two kernels, no extra buffer);\n"
     "fused = the same with dQ added in fp32 inside the dK/dV kernel (about 10% faster backward\n"
     "from 16K tokens, 4 bytes per dQ element more); reference = kernels/attention.cu; auto (default) =\n"
     "fused where its dQ sums fit under the cap, else fast. All are bit-reproducible; auto's\n"
     "choice depends on the free memory, so give fast or fused to reproduce a run bit for bit\n"
     "elsewhere. --ladder plans and runs auto as fast",
     [](Options& o, V f, V v) {
         if (v != "auto" && v != "fast" && v != "fused" && v != "reference")
             usage_error(f + " must be 'auto', 'fast', 'fused' or 'reference', got '" + v + "'");
         o.attention = v, o.step.fused_attention = v == "fused";
     }},
    path_flag("--init-from", " PATH", 6, "start from a Hugging Face checkpoint (model.safetensors, a directory, or a sharded index)",
     PathRole::READS_CHECKPOINT, &Options::init_from),
    path_flag("--save-to", " DIR", 6, "at the end, write a Hugging Face checkpoint (model.safetensors + config.json) to DIR",
     PathRole::WRITES_CHECKPOINT, &Options::save_to),
    {"--save-dtype", Takes::VALUE, " bf16|fp32", 6, "dtype of --save-to (default bf16)", [](Options& o, V, V v) { o.save_dtype = v; }},
    path_flag("--data", " FILE", 6, "train on a token file (random windows; format in the README) instead of --task",
     PathRole::READS_FILE, &Options::data_path),
    path_flag("--eval-data", " FILE", 6,
     "held-out token file: after the last step (and every --eval-every), the mean loss over\n"
     "--eval-windows fixed windows and the loss by position in the context (1-1K, 1K-2K, ...)",
     PathRole::READS_FILE, &Options::eval_path),
    {"--eval-every", Takes::VALUE, " N", 6, "evaluate after every N steps too", [](Options& o, V f, V v) { o.eval_every = (int)parse_int(f, v, 1, 1 << 30); }},
    {"--eval-windows", Takes::VALUE, " K", 6, "windows of --seq-len tokens, evenly spaced over the file (default 8)",
     [](Options& o, V f, V v) { o.eval_windows = (int)parse_int(f, v, 1, 1 << 20), o.eval_windows_given = true; }},
    {"--eval-only", Takes::NOTHING, "", 6, "evaluate the weights (--init-from, else the seed's) and stop", [](Options& o, V, V) { o.eval_only = true; }},
    path_flag("--state-dir", " DIR", 6, "the whole training state goes here, atomically, every --state-every steps",
     PathRole::WRITES_STATE, &Options::state_dir),
    {"--state-every", Takes::VALUE, " N", 6, "save the training state every N steps (and at the last step)",
     [](Options& o, V f, V v) { o.state_every = (int)parse_int(f, v, 1, 1 << 30); }},
    {"--resume", Takes::NOTHING, "", 6, "continue from the latest training state in --state-dir (fresh start if none)",
     [](Options& o, V, V) { o.resume = true; }},
    {"--mem-cap-gib", Takes::VALUE, " X", 7, "refuse what a card of X GiB could not hold (emulates an 80 GB H100 on an H200)",
     [](Options& o, V f, V v) { o.mem_cap_gib = parse_double(f, v, 0.001, 1e6); }},
    {"--plan", Takes::NOTHING, "", 7, "print the memory plan per category and exit (no GPU needed)", [](Options& o, V, V) { o.plan = true; }},
    path_flag("--log", " FILE", 7, "write one JSON object per step (plus one for the setup) to FILE",
     PathRole::WRITES_FILE, &Options::log_path),
    path_flag("--dump", " FILE", 7, "write the first step's loss and every gradient (whole, float32) to FILE",
     PathRole::WRITES_FILE, &Options::dump_path),
    path_flag("--timeline", " FILE", 7,
     "write the last step's event timeline as JSON: each layer's forward and backward,\n"
     "its attention kernels, all-to-alls and MLP, FSDP's collectives, offload's copies",
     PathRole::WRITES_FILE, &Options::timeline_path),
    path_flag("--trace", " FILE", 7,
     "write the last step as a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing):\n"
     "each layer's phases on the compute stream, all-to-alls with their bytes, FSDP's gathers and\n"
     "reduce-scatters, offload's copies, and the memory per category at each layer",
     PathRole::WRITES_FILE, &Options::trace_path),
    path_flag("--mem-trace", " FILE", 7, "write live memory per category (and pinned host) over the last step, as JSON lines",
     PathRole::WRITES_FILE, &Options::mem_trace_path),
    {"--peak-tflops", Takes::VALUE, " X", 7, "bf16 peak for MFU (default: 989 for H100/H200, else MFU is not shown)",
     [](Options& o, V f, V v) { o.peak_tflops = parse_double(f, v, 0.001, 1e6); }},
    {"--help", Takes::NOTHING, "", 7, "this text", [](Options& o, V, V) { o.help = true; }},
};

std::string usage_text() {
    std::string out = "usage: train [flags]\n";
    for (int section = 0; section < (int)(sizeof SECTIONS / sizeof SECTIONS[0]); section++) {
        out += std::string("\n") + SECTIONS[section] + "\n";
        for (const Flag& f : FLAGS) {
            if (f.section != section) continue;
            std::string left = std::string("  ") + f.name + f.shape, text = f.help;
            if (f.name == std::string("--config")) text = known_config_names() + " (default llama3.2-3b)";
            left += left.size() < 23 ? std::string(23 - left.size(), ' ') : "  ";
            for (size_t p = 0; (p = text.find('\n', p)) != std::string::npos; p += 24) text.insert(p + 1, 23, ' ');
            out += left + text + "\n";
        }
    }
    return out + "\nExit codes: 0 ok, 1 runtime failure, 2 bad usage or input, 3 out of memory.\n";
}

std::vector<PathFlag> path_flags(const Options& o) {
    std::vector<PathFlag> flags;
    for (const Flag& f : FLAGS)
        if (f.path_field) flags.push_back({f.name, f.role, o.*f.path_field});
    return flags;
}

static const Flag& find_flag(const std::string& name, const char* as_typed) {
    for (const Flag& f : FLAGS)
        if (f.set && name == f.name) return f;
    if (name == "-h") return find_flag("--help", as_typed);
    usage_error("unknown flag '" + std::string(as_typed) + "' (see --help)");
}

// What the flags imply and what they cannot be given with; a usage error names the conflict.
static void check_data_options(const Options& o) {
    if (o.doc_min > 0) {
        if (!o.data_path.empty()) usage_error("--doc-lengths makes synthetic documents: --data brings its own");
        if (o.task != "copy" && o.task != "induction")
            usage_error("--doc-lengths cuts the copy or induction task into documents, not --task " + o.task);
        if (o.doc_min < 2 || o.doc_max < o.doc_min)
            usage_error("--doc-lengths MIN,MAX needs 2 <= MIN <= MAX, got " + std::to_string(o.doc_min) + "," +
                        std::to_string(o.doc_max));
    }
    if (o.step.doc_mask && o.data_path.empty() && o.doc_min == 0 && !(o.eval_only && !o.eval_path.empty()))
        usage_error("--doc-mask needs documents: a --data file, --doc-lengths MIN,MAX, or --eval-only's --eval-data");
    if (o.step.doc_mask && o.ladder) usage_error("--ladder plans the talk's runs on one document a sequence: leave out --doc-mask");
    if ((o.eval_every || o.eval_only || o.eval_windows_given) && o.eval_path.empty())
        usage_error("--eval-every, --eval-windows and --eval-only need --eval-data");
    for (const PathFlag& f : path_flags(o))  // the stages' child runs get none of these but their own logs
        if (o.ladder && !f.value.empty() && f.name != "--log") usage_error("--ladder runs its own steps: leave out " + f.name);
    if (o.eval_only && (!o.dump_path.empty() || !o.timeline_path.empty() || !o.trace_path.empty() ||
                        !o.mem_trace_path.empty()))
        usage_error("--dump, --timeline, --trace and --mem-trace record a training step: --eval-only takes none");
    if (!o.eval_path.empty() && o.sim_world > 1) usage_error("--sim-world's losses are meaningless: leave out --eval-data");
}

static void check_options(Options& o) {
    if (o.task != "copy" && o.task != "induction" && o.task != "random")
        usage_error("--task must be 'copy', 'induction' or 'random', got '" + o.task + "'");
    const bool synthetic = o.data_path.empty() && !(o.eval_only && !o.eval_path.empty());
    if (synthetic && o.task != "random" && o.seq_len < 4)
        usage_error("--seq-len " + std::to_string(o.seq_len) + ": the synthetic task " + o.task +
                    " needs at least 4 (--task random takes any; --data trains on a token file)");
    if (o.seq_len > (int64_t)1 << 40) usage_error("--seq-len is beyond anything addressable");
    const StepOptions& s = o.step;
    const bool techniques = o.stage >= 0 || s.fsdp || s.ulysses || s.ckpt || s.offload || s.chunked || s.untied ||
                            o.vocab_pieces_given || s.one_offload_slot || s.grad_in_att_output || s.dq_sums_in_staging;
    if (o.ladder && techniques)
        usage_error("--ladder runs every stage itself (0 to 7): leave out --stage and the techniques' flags");
    const int pieces = o.step.vocab_pieces;
    apply_stage(o.step, o.stage);
    if (o.vocab_pieces_given) o.step.vocab_pieces = pieces;  // a count given beats stage 7's default
    if ((o.measure_layers || o.confirm_longest) && !o.ladder)
        usage_error("--measure-layers and --confirm-longest go with --ladder");
    if (o.nproc > 1 && o.sim_world > 1) usage_error("--nproc and --sim-world exclude each other");
    if (o.host_comm && o.sim_world > 1) usage_error("--comm host runs real ranks: --sim-world emulates them");
    if (o.sim_world > 1 && (!o.save_to.empty() || !o.dump_path.empty()))
        usage_error("--sim-world runs rank 0's share alone: the other ranks' weights and gradients do not exist, "
                    "so --save-to and --dump have nothing whole to write");
    if (o.step.offload || o.step.untied) o.step.ckpt = true;  // both work on what checkpointing keeps
    if (o.save_dtype != "bf16" && o.save_dtype != "fp32") usage_error("--save-dtype must be bf16 or fp32");
    if ((o.resume || o.state_every) && o.state_dir.empty()) usage_error("--resume and --state-every need --state-dir");
    if ((o.step.chunk_tokens || o.step.loss_chunk_tokens) && !o.step.chunked)
        usage_error("--chunk-tokens and --loss-chunk-tokens need --chunked");
    if ((!o.mem_trace_path.empty() || !o.trace_path.empty()) && o.steps < 1)
        usage_error("--trace and --mem-trace trace a step: they need --steps 1 or more");
    check_data_options(o);
}

Options parse_options(int argc, char** argv) {
    Options o;
    for (int i = 0; i < argc; i++) o.argv.push_back(argv[i]);
    for (int i = 1; i < argc; i++) {
        std::string name = argv[i], value;
        const size_t eq = name.find('=');
        const bool has_value = name.rfind("--", 0) == 0 && eq != std::string::npos;
        if (has_value) value = name.substr(eq + 1), name = name.substr(0, eq);
        const Flag& f = find_flag(name, argv[i]);
        if (f.takes == Takes::NOTHING && has_value) usage_error(name + " takes no value");
        if (f.takes == Takes::VALUE && !has_value) {
            if (i + 1 >= argc) usage_error(name + " needs a value");
            value = argv[++i];
        }
        const bool count_follows = i + 1 < argc && argv[i + 1][0] && std::string(argv[i + 1]).find_first_not_of("0123456789") == std::string::npos;
        if (f.takes == Takes::OPTIONAL_VALUE && !has_value && count_follows) value = argv[++i];  // --untied 2
        f.set(o, name, value);
    }
    check_options(o);
    return o;
}

LlamaConfig resolve_config(const Options& o) {
    LlamaConfig c = config_by_name(o.config);
    if (o.layers > 0) c.n_layers = o.layers;
    if (o.step.vocab_pieces > c.vocab / PIECE_ROWS)
        usage_error("--vocab-pieces " + std::to_string(o.step.vocab_pieces) + ": a piece holds at least " +
                    std::to_string(PIECE_ROWS) + " of the " + std::to_string(c.vocab) + " vocabulary rows");
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

