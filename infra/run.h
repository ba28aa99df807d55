// infra/run.h - the run's machinery, which train.cpp's loop stands on (infra/run.cpp): the plan
// of one process's share, the GPU and the communicators, the choices that depend on free memory,
// the allocation on every rank, resume, and everything the run prints and logs.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>

#include "infra/evaluate.h"
#include "infra/train.h"

// Everything one process holds.
struct Run {
    Options o;
    Launch launch;
    LlamaConfig cfg;
    int world = 1, rank = 0, dp = 1;  // dp: GPUs that train on different sequences
    bool lead = true, simulated = false;
    int64_t step_tokens = 0, host_bytes = 0;
    Model m;
    Arena arena;  // the plan (dry run), then the allocation
    DeviceMemory dm;
    cudaDeviceProp prop{};
    cudaStream_t stream = nullptr;
    double nccl_gib = 0;
    bool fast_attention = false;
    double last_loss = NAN;  // the last step's
    std::unique_ptr<TokenFile> token_file, eval_file;
    EvalSet eval;  // --eval-data's windows
    FILE* log = nullptr;
};

// Errors raised while flags and input files are checked are the same on every rank: rank 0
// alone reports them. Past that point (open_gpu) a rank reports its own errors.
extern bool g_symmetric_phase;

// The model, its shape on this GPU and its memory plan (no GPU needed); the run line.
void plan_run(Run& r);
void print_run(const Run& r);
int print_plan(Run& r);  // --plan: the memory per category, whether it fits, the longest context
// ./train --nproc N: what every rank would refuse alike (flags, shapes, input files), said once.
void check_before_launch(const Options& o);
// Input files checked, the GPU and the communicators opened, the kernels and the device's share
// of attention outputs chosen, every rank's buffers allocated (an out-of-memory on any rank ends
// all of them: its exit code, else 0), the weights, the log opened.
int open_run(Run& r);
// The data of a run (the synthetic task, or windows of the token file); where training starts
// (step 0, or the saved state of --resume).
SyntheticData make_data(const Run& r);
int resume_or_start(Run& r, SyntheticData& data);
void print_training(const Run& r, const SyntheticData& data);

// One step's numbers, printed and logged by rank 0.
struct StepReport {
    int step;
    double loss, lr, grad_norm, seconds;
    double attention_share;  // of causal attention's pairs, the ones the step's documents allow
};
void report_step(const Run& r, const StepReport& s, const SyntheticData& data);
// Per-layer progress with ETA, for long steps (model_forward_backward's callback).
struct Progress {
    std::chrono::steady_clock::time_point start;
    int layers;
    cudaStream_t stream;
    Model* model;
};
void progress_callback(void* ctx, const char* phase, int layer);
void dump_first_step(Run& r, int64_t n_valid);  // --dump: the first step's loss and every gradient
void run_eval(Run& r, int step);                // --eval-data: the held-out loss after `step` steps
// After the last step: every rank's loss and memory, the files asked for, the GPU's resources back.
void finish(Run& r);

// ---------------------------------------------------------------------------------------------
// What the run's parts call of each other: infra/plan.cpp (the plan and the choices made from
// free memory), infra/run.cpp (setup and end), infra/report.cpp (what it prints and logs).
void check_host_memory(const Run& r);                  // plan.cpp: --host-mem-gib, before a GPU is touched
std::string next_stage_hint(const Options& o, int world);  // plan.cpp: for an out-of-memory
std::string plan_text(const Arena& plan, int64_t host_bytes, double runtime_gib, bool runtime_measured);
void print_attention_plan(const Run& r);               // plan.cpp: selective checkpointing's layers
void choose_attention(Run& r);                         // plan.cpp: --attention auto, from free memory
void keep_attention_on_device(Run& r);                 // plan.cpp: =selective --offload's device layers
void sum_over_ranks(Comm* comm, std::vector<float>& x, cudaStream_t s, double timeout_s);  // run.cpp
float sum_over_ranks(Comm* comm, float mine, cudaStream_t s, double timeout_s);
int min_over_ranks(const Run& r, int mine);
void print_gpu(const Run& r);                          // report.cpp: the GPU, what the runtime holds
void open_log(Run& r);                                 // report.cpp: rank 0's --log, its setup line
void print_ranks(Run& r);                              // report.cpp: every rank's last loss and memory
