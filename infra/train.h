// infra/train.h - the training program's options and pieces that tests call directly.
#pragma once

#include "io/json.h"

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "infra/common.h"
#include "infra/timeline.h"
#include "io/data.h"
#include "io/files.h"
#include "llama.h"

struct Options {
    std::string config = "llama3.2-3b";
    int layers = -1;            // -1: the config's depth
    int64_t seq_len = 8192;     // tokens per sequence
    int batch = 1;              // sequences per step
    int steps = 10;
    double lr = 3e-4;
    double min_lr_ratio = 0.1;  // cosine decays to lr * min_lr_ratio
    int warmup = -1;            // -1: steps / 10, at least 1
    double weight_decay = 0.1;
    double grad_clip = 1.0;
    uint64_t seed = 1234;
    std::string task = "copy";  // copy | induction | random
    int task_vocab = -1;        // synthetic tokens are drawn from [0, task_vocab); -1: min(1024, vocab)
    int64_t doc_min = 0, doc_max = 0;  // --doc-lengths: the synthetic task in documents of these lengths (0: one)
    double mem_cap_gib = 0;     // 0: no cap beyond the card
    double peak_tflops = 0;     // MFU denominator; 0: from the GPU's name
    StepOptions step;           // the memory techniques, stage 7's savings, chunk sizes
    std::string attention = "auto";  // --attention: auto | fast | fused | reference (see --help)
    std::string timeline_path;  // --timeline: event timeline of the last step (timeline.cu)
    std::string trace_path;     // --trace: the same, with memory, as a Chrome trace (io/outputs.cpp)
    std::string dump_path;      // --dump: the first step's loss and every gradient
    int nproc = 1;              // --nproc: processes (GPUs) to start
    int sim_world = 0;          // --sim-world: emulate rank 0 of this many GPUs
    bool gpus_given = false;    // --nproc or --sim-world was given (else --ladder takes the talk's 8)
    bool vocab_pieces_given = false;  // --vocab-pieces was given (its count beats --stage 7's default)
    double comm_timeout_s = 600;
    bool host_comm = false;     // --comm host: collectives through host shared memory, not NCCL
    int stage = -1;             // --stage N
    bool ladder = false;        // --ladder: the memory ladder, stage by stage
    int measure_layers = 0;     // --ladder: layers of the measured steps (0: the config's)
    bool confirm_longest = false;  // --ladder: allocate each stage's longest context
    std::string init_from;      // --init-from: a Hugging Face checkpoint (file or directory)
    std::string save_to;        // --save-to: write a Hugging Face checkpoint at the end
    std::string save_dtype = "bf16";
    std::string data_path;      // --data: a token file (else synthetic data)
    std::string state_dir;      // --state-dir: training state, every --state-every steps
    int state_every = 0;
    bool resume = false;        // --resume: continue from the latest state in --state-dir
    bool plan = false;
    bool help = false;
    std::string log_path;
    std::string mem_trace_path; // --mem-trace: live memory per category over the last step
    std::string eval_path;      // --eval-data: a held-out token file (infra/evaluate.cpp)
    int eval_every = 0;         // --eval-every: evaluate after every N steps (and after the last)
    int eval_windows = 8;       // --eval-windows: the fixed windows of every evaluation
    bool eval_windows_given = false;
    bool eval_only = false;     // --eval-only: evaluate the weights (--init-from) and stop
    std::vector<std::string> argv;  // the command line, for logs
};

// Parse and validate; throws Fatal(EXIT_USAGE) with a clear message on bad input.
Options parse_options(int argc, char** argv);
// "8192", "8K" (x 1024), "3M" (x 1024^2). Throws Fatal(EXIT_USAGE) on anything else.
int64_t parse_tokens(const std::string& flag, const std::string& value);
// "a,b,c" -> {"a", "b", "c"}; empty items are kept, for the caller to refuse (the benches' lists).
std::vector<std::string> split_commas(const std::string& list);
// The config after --layers, validated against what the kernels support.
LlamaConfig resolve_config(const Options& o);
std::string usage_text();
// One /bin/sh word holding s exactly (the ladder's child runs); the command line as typed, for
// logs (written as JSON through io/json.h's json_escape and json_number).
std::string shell_quote(const std::string& s);
std::string command_line(const Options& o);
// What a run does with the path a flag names. The flags table (infra/options.cpp) gives each
// path flag its role; path_flags lists them all with their values in o ("" where not given).
enum class PathRole { READS_FILE, READS_CHECKPOINT, WRITES_FILE, WRITES_CHECKPOINT, WRITES_STATE };
struct PathFlag {
    std::string name;
    PathRole role;
    std::string value;
};
std::vector<PathFlag> path_flags(const Options& o);
// Every path the run writes, checked before any work (io/outputs.cpp, io/output_paths.h): each
// flag's that writes (rank 0's; --state-dir on every rank, with lead false that alone), and
// none of them a file another flag reads or writes. A usage error (exit 2) names the flags.
// open_output opens one for writing (nullptr for no path).
void check_outputs(const Options& o, bool lead);
FILE* open_output(const std::string& path, const char* flag);
// The files of io/outputs.cpp, and the technique flags of a step as typed (logs and traces).
std::string technique_flags(const StepOptions& s);
void write_timeline(const std::string& path, const std::vector<TimelineEntry>& tl);
// --trace: the timeline's marks as complete events ("X") on one track per stream, the memory per
// category at each progress point as counters ("C"), in Chrome's trace-event JSON.
void write_trace(const std::string& path, const std::string& title, const std::vector<TimelineEntry>& tl,
                 const std::vector<MemTracePoint>& memory);
void write_mem_trace(const Options& o, const char* gpu, const Model& m, const Arena& arena, double driver_gib);
void write_dump(const std::string& path, double loss, const std::vector<float>& grads);
extern const char* FUSED_NEEDS_FAST_KERNELS;

// The memory plan of a run (dry run of the arena): per category, plus pinned host bytes.
struct MemoryPlan {
    Arena arena;
    int64_t host_bytes = 0;
    double total_gib(double runtime_gib) const { return arena.total() / GiB + runtime_gib; }
};
MemoryPlan plan_memory(const LlamaConfig& cfg, const Options& o, int64_t seq_len);
// The longest sequence (a multiple of `granularity` tokens) whose plan fits under cap_gib.
int64_t longest_context(const LlamaConfig& cfg, const Options& o, double cap_gib, double runtime_gib,
                        int64_t granularity = 1024);

// GPUs of the run: --nproc or --sim-world (1 without either).
int gpu_count(const Options& o);

// The ladder (ladder.cpp): stage k turns on the techniques of stages 1..k.
void apply_stage(StepOptions& s, int stage);
struct LadderRow {
    int stage;
    std::string flags;
    std::string refused;            // why the stage cannot run this shape (e.g. Ulysses divisibility)
    double gib[MEM_NUM_CATEGORIES] = {};
    double runtime_gib = 0, total_gib = 0, host_gib = 0;
    bool fits = false;
    int64_t longest = 0;            // the longest context that fits under the cap, tokens
};
// Planned memory per GPU of stages 0..7 for o's config, --seq-len, GPUs (--nproc/--sim-world)
// and cap (--mem-cap-gib, default 80).
std::vector<LadderRow> ladder_plan(const Options& o);
// --ladder: the planned table (--plan) or every stage measured; on the talk's node by default.
int ladder_main(const Options& o);

// How this process was started (launch.cpp): alone, by ./train --nproc N, or by mpirun/srun.
struct Launch {
    int rank = 0, world = 1, local_rank = 0;
    int listen_fd = -1;  // rank 0 under ./train --nproc: the rendezvous socket, already listening
    int host_comm_fd = -1;  // under ./train --nproc N --comm host: the ranks' shared memory (infra/comm.cu)
    bool by_launcher = false;  // started by ./train --nproc N, which checked the run's outputs once for all
    std::string master_addr = "127.0.0.1";
    int master_port = 29500;
};
Launch launch_from_env();
// ./train --nproc N: N processes of this program, one per GPU (host_comm: --comm host, N processes
// on the visible GPUs in turn); the first failing rank's exit code.
int launch_local(int n, char** argv, bool host_comm);
int visible_gpus();  // 0 without a usable GPU
// Why there is no GPU here, in one line, then `what` (a runtime failure, exit code 1).
[[noreturn]] void no_gpu_error(const std::string& what);

// Learning rate at 0-based step: linear warmup to lr, then cosine to lr * min_lr_ratio.
double lr_at(const Options& o, int step);

int train_main(int argc, char** argv);
