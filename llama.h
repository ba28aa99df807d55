// llama.h - the GPU side shared by llama.cu, attention.cu, train.cpp and the tests:
// error checks, the tracked allocator (an arena with a static plan), the kernels' launchers,
// and the model/step structures.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "infra/common.h"

typedef __nv_bfloat16 bf16;

// ---------------------------------------------------------------------------------------------
// Error checks. A failing CUDA call is a runtime failure (exit code 1) naming the call and place;
// an out-of-memory from the CUDA runtime becomes the out-of-memory exit code (3).
void cuda_check(cudaError_t err, const char* what, const char* file, int line);
#define CUDA_CHECK(call) cuda_check((call), #call, __FILE__, __LINE__)
#define CUDA_CHECK_LAUNCH() cuda_check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

// ---------------------------------------------------------------------------------------------
// Tracked device memory: an arena with a static plan.
//
// Every buffer of a step is declared once, by name and category, through Arena::take(). The
// declaring code runs twice: first as a dry run (nothing is allocated, only sizes are summed:
// that is the plan, available without a GPU for --plan), then for real, after one cudaMalloc of
// the planned total. So the peak is known before any compute starts, an out-of-memory is
// reported before the first kernel with the exact number of bytes the step needs, and the plan
// and the allocation cannot disagree: they are the same code.
struct ArenaEntry {
    std::string name;
    MemCategory category;
    int64_t offset, bytes;
};

class Arena {
  public:
    // Dry run: record sizes only. take() returns nullptr.
    Arena() = default;
    // Real: carve from [base, base + capacity) following the same sequence of take() calls.
    void begin_real(char* base, int64_t capacity);

    template <class T>
    T* take(const std::string& name, MemCategory cat, int64_t count) {
        return (T*)take_bytes(name, cat, count * (int64_t)sizeof(T));
    }
    void* take_bytes(const std::string& name, MemCategory cat, int64_t bytes);

    int64_t total() const { return offset_; }
    int64_t category_bytes(int cat) const { return by_category_[cat]; }
    const std::vector<ArenaEntry>& entries() const { return entries_; }
    // Restart the sequence of take() calls (for the real pass after a dry one).
    void rewind();

  private:
    char* base_ = nullptr;
    int64_t capacity_ = 0;
    int64_t offset_ = 0;
    int64_t by_category_[MEM_NUM_CATEGORIES] = {};
    std::vector<ArenaEntry> entries_;
};

// The device as the memory accounting sees it.
struct DeviceMemory {
    int device = 0;
    int64_t total_bytes = 0;     // what the card has (cudaMemGetInfo)
    int64_t runtime_bytes = 0;   // used before our first allocation: CUDA context, cuBLAS
    int64_t emulated_bytes = 0;  // --sim-world: NCCL buffers rank 0 of a real node would hold
    int64_t cap_bytes = 0;       // --mem-cap-gib, or total_bytes without a cap
    char* slab = nullptr;        // the arena's one allocation
    int64_t slab_bytes = 0;
    int64_t driver_used_bytes() const;  // cudaMemGetInfo now: total - free
};

// The runtime's share of the device when no GPU is present to measure it (--plan): the CUDA
// context, cuBLAS handle and cuBLASLt on an H200 with CUDA 13.0, and on more than one GPU
// NCCL's buffers for our two communicators, as measured on two H200s (NCCL 2.28,
// NCCL_RUNTIME_CONNECT=0; docs/results.md). For other GPU counts the latter is an estimate.
constexpr double RUNTIME_OVERHEAD_ESTIMATE_GIB = 0.55;
constexpr double NCCL_OVERHEAD_ESTIMATE_GIB = 2.62;
inline double runtime_estimate_gib(int world) {
    return RUNTIME_OVERHEAD_ESTIMATE_GIB + (world > 1 ? NCCL_OVERHEAD_ESTIMATE_GIB : 0.0);
}

// Report an out-of-memory (category breakdown, what the step needs, next stage) and throw the
// exit-code-3 Fatal. `needed` is the arena total; `available` what the cap leaves for it.
[[noreturn]] void report_oom(const Arena& plan, int64_t runtime_bytes, int64_t cap_bytes,
                             const std::string& what, const std::string& hint);

// ---------------------------------------------------------------------------------------------
// cuBLASLt matrix products, row-major: C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * Cin.
// A and B bf16; C bf16 or fp32 (`c_fp32`); Cin may alias C or be another buffer of the same type
// (residual adds: out = residual + x W^T in one call). fp32 accumulation always.
struct Gemm;
void gemm_init(size_t workspace_bytes, void* workspace);
void gemm_destroy();
void gemm_rm(bool transA, bool transB, int64_t M, int64_t N, int64_t K, const bf16* A,
             int64_t lda, const bf16* B, int64_t ldb, void* C, int64_t ldc, bool c_fp32,
             float alpha, float beta, const void* Cin, cudaStream_t stream);

// The three products of a linear layer y = x W^T, W [out, in]:
void linear_forward(bf16* y, const bf16* x, const bf16* W, const bf16* residual, int64_t T,
                    int64_t in, int64_t out, cudaStream_t s);  // y = x W^T (+ residual)
void linear_backward_input(bf16* dx, const bf16* dy, const bf16* W, int64_t T, int64_t in,
                           int64_t out, cudaStream_t s);       // dx = dy W
void linear_backward_weight(float* dW, const bf16* dy, const bf16* x, int64_t T, int64_t in,
                            int64_t out, cudaStream_t s);      // dW += dy^T x (fp32)

// ---------------------------------------------------------------------------------------------
// Element-wise and reduction kernels of the model (kernels.cu). T = tokens, row-major [T, width].
// x[t] = rows[tokens[t] - row0] for the tokens in [row0, row0 + n_rows) (one vocabulary piece of
// the table); the other rows of x are left as they are.
void embedding_forward(bf16* x, const int32_t* tokens, const bf16* rows, int64_t row0, int64_t n_rows, int64_t T,
                       int D, cudaStream_t s);
// Deterministic embedding backward: tokens grouped on the host (EmbeddingGroups), each group's
// rows summed in a fixed order, added to the fp32 gradient. drows holds the table's rows from row0 on:
// the groups given must be those of tokens in that piece.
struct EmbeddingGroups {
    std::vector<int32_t> token;     // distinct tokens
    std::vector<int64_t> begin;     // positions of token[i] are position[begin[i] .. begin[i+1])
    std::vector<int64_t> position;  // token positions, grouped, ascending within a group
    void build(const int32_t* tokens, int64_t T);
};
void embedding_backward(float* drows, int64_t row0, const bf16* dx, const int32_t* group_token,
                        const int64_t* group_begin, const int64_t* positions, int64_t n_groups,
                        int D, cudaStream_t s);

void rmsnorm_forward(bf16* y, float* rstd, const bf16* x, const bf16* w, int64_t T, int D,
                     float eps, cudaStream_t s);
// dx (+)= d/dx; dw += d/dw (fp32). `partial` is scratch of rmsnorm_partial_floats(D) floats.
void rmsnorm_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w,
                      const float* rstd, int64_t T, int D, bool accumulate_dx, float* partial,
                      cudaStream_t s);
int64_t rmsnorm_partial_floats(int D);

// RoPE in place on n_heads heads of head_dim values per row (row stride `ld` elements), for
// n_rows rows that are tokens row0 .. row0 + n_rows - 1 of the step; token t has position
// pos0 + t % seq. inv_freq: head_dim/2 doubles on the device. inverse = true is the backward.
void rope_apply(bf16* x, int64_t n_rows, int64_t row0, int64_t seq, int64_t pos0, int n_heads,
                int head_dim, int64_t ld, const double* inv_freq, bool inverse, cudaStream_t s);

void swiglu_forward(bf16* act, const bf16* h13, int64_t T, int F, cudaStream_t s);
void swiglu_backward(bf16* dh13, const bf16* dact, const bf16* h13, int64_t T, int F,
                     cudaStream_t s);

// Fused cross-entropy forward and backward: losses[t] = lse_t - logit[t, target_t] (0 when
// target -1); the logits are overwritten by d(loss_sum * grad_scale)/d logits.
void cross_entropy_forward_backward(bf16* logits, float* losses, const int32_t* targets,
                                    int64_t T, int V, float grad_scale, cudaStream_t s);
// The same over logits that come in pieces of V columns from col0 on, [T, V] each (targets count
// from column 0 of the whole vocabulary). Per piece: each row's running max and sum of
// exponentials (first: start them) and the target's logit where the piece has it; after the last
// piece the loss (max becomes lse); then per piece the gradient, in place, with that lse.
void cross_entropy_piece_stats(const bf16* logits, int64_t T, int V, int64_t col0, const int32_t* targets,
                               float* run_max, float* run_sum, float* target_logit, bool first, cudaStream_t s);
void cross_entropy_piece_loss(float* losses, float* max_to_lse, const float* run_sum, const float* target_logit,
                              const int32_t* targets, int64_t T, cudaStream_t s);
void cross_entropy_piece_backward(bf16* logits, int64_t T, int V, int64_t col0, const float* lse,
                                  const int32_t* targets, float grad_scale, cudaStream_t s);

// Deterministic sum of n floats (two passes). scratch: sum_scratch_floats() floats.
void sum_floats(float* out, const float* x, int64_t n, float* scratch, cudaStream_t s);
void sum_squares(float* out, const float* x, int64_t n, float* scratch, cudaStream_t s);
int64_t sum_scratch_floats();

// AdamW on n values (torch.optim.AdamW semantics), grads first multiplied by *grad_scale (a
// device value, so clipping needs no host round trip). The bf16 weights are made from the
// master when a unit is next used (fsdp.cu).
struct AdamW {
    float lr, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
    int step;  // counts from 1
};
void adamw_update(float* master, const float* grad, float* m, float* v,
                  int64_t n, const AdamW& opt, bool decay, const float* grad_scale,
                  cudaStream_t s);
// grad_scale = min(1, max_norm / (sqrt(*sumsq) + 1e-6)), on the device.
void clip_scale(float* grad_scale, const float* sumsq, float max_norm, cudaStream_t s);

void fill_bf16(bf16* x, int64_t n, float value, cudaStream_t s);
void convert_f32_to_bf16(bf16* out, const float* in, int64_t n, cudaStream_t s);
// Deterministic init: N(0, std) from a counter-based hash of (seed, index).
// Value i is that of index index0 + i of the whole tensor (a shard draws its part of it).
void init_normal(float* x, int64_t n, float stddev, uint64_t seed, cudaStream_t s, int64_t index0 = 0);
void init_normal_bf16(bf16* x, int64_t n, float stddev, uint64_t seed, cudaStream_t s, int64_t index0 = 0);
void init_constant(float* x, int64_t n, float value, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// Flash attention (attention.cu): causal, grouped-query, bf16 in/out, fp32 accumulation and
// log-sum-exp. Never materializes the S x S matrix; all offsets 64-bit.
//
// q, k, v: rows of B*S tokens; head h of token t is at q[t*ldq + h*head_dim] (so q, k, v can be
// column slices of one fused QKV buffer). out likewise with ldo. lse: [B, Hq, S] fp32 natural log.
struct AttentionShape {
    int batch;
    int64_t seq;
    int n_heads, n_kv_heads, head_dim;
};
struct AttentionForwardArgs {
    const bf16 *q, *k, *v;
    int64_t ldq, ldk, ldv;
    bf16* out;
    int64_t ldo;
    float* lse;
};
struct AttentionBackwardArgs {
    const bf16 *q, *k, *v, *out, *dout;  // out = nullptr: delta is given, not computed
    int64_t ldq, ldk, ldv, ldo, lddo;
    const float* lse;
    bf16 *dq, *dk, *dv;
    int64_t lddq, lddk, lddv;
    float* delta;  // [B, Hq, S]: rowsum(dout * out), computed here unless out is nullptr
    bool accumulate_dkv = false;  // dk, dv += this call's (Untied Ulysses sums a KV group's chunks)
    // Fused backward (--attention fused): attention_dq_accum_floats(shape) floats of fp32 workspace.
    // Given, the fast kernels add dQ inside the dK/dV kernel (5 products instead of 7; the adds go
    // in a fixed order, so still bit-reproducible); nullptr, they run the dK/dV and dQ kernels.
    float* dq_accum = nullptr;
};
int64_t attention_dq_accum_floats(const AttentionShape& sh);  // the fused backward's workspace
// The training step calls these two: the fast Hopper kernels (attention_hopper.cu: head dim
// 128 on an sm_90 GPU, 16-byte aligned inputs) unless the reference ones are selected or the
// call is outside what the fast ones do; then attention.cu's kernels.
void attention_forward(const AttentionForwardArgs& a, const AttentionShape& sh, cudaStream_t s);
void attention_backward(const AttentionBackwardArgs& a, const AttentionShape& sh, cudaStream_t s);
// Select attention.cu's kernels for every call (--attention reference; tests and benches).
void attention_use_reference(bool on);
bool attention_uses_hopper(const AttentionShape& sh);  // what the dispatch picks for this shape
// The FLOPs of causal attention, the convention of docs/reference.md: forward 4*S*S*d*Hq/2 per sequence,
// backward 2.5 x forward.
double attention_forward_flops(const AttentionShape& sh);
// attention.cu: the readable reference kernels (mma.sync; head dim 64 or 128; any GPU since
// sm_80) and the test oracle on the GPU; delta = rowsum(dout * out) alone.
void attention_forward_reference(const AttentionForwardArgs& a, const AttentionShape& sh, cudaStream_t s);
void attention_backward_reference(const AttentionBackwardArgs& a, const AttentionShape& sh, cudaStream_t s);
void attention_delta(const AttentionBackwardArgs& a, const AttentionShape& sh, cudaStream_t s);
// attention_hopper.cu: wgmma + TMA, warp-specialized (head dim 128, sm_90; the backward needs
// delta given, out == nullptr). The backward's options say what it runs and how; the dispatch
// above takes the defaults, benches and tests set them.
struct HopperBackwardOptions {
    int parts = 3;                    // bit 0: the dK/dV kernel, bit 1: the dQ kernel (with dq_accum: the
                                      // fused kernel, then the conversion of its sums)
    int64_t kv_major_from_tiles = 0;  // blocks KV head by KV head from sequences of this many 128-row tiles,
                                      // else tile by tile across the heads (0: 128 tiles, 16K tokens)
    bool unreachable_dq_counts = false;  // the fused kernel's counts of dQ adds start at -1, a value its
                                         // order never reaches: its blocks wait until the waits' time limit
                                         // ends the launch with an error (what a test checks)
};
void attention_forward_hopper(const AttentionForwardArgs& a, const AttentionShape& sh, cudaStream_t s);
void attention_backward_hopper(const AttentionBackwardArgs& a, const AttentionShape& sh, cudaStream_t s,
                               const HopperBackwardOptions& opt = {});

// ---------------------------------------------------------------------------------------------
// The model on one GPU (llama.cu).
struct RunShape {
    int batch = 1;     // sequences per step on this GPU
    int64_t seq = 0;   // tokens per sequence (the whole sequence, also under Ulysses)
    int sp = 1;        // Ulysses: GPUs one sequence is split over
    int sp_rank = 0;   // this GPU holds tokens [sp_rank * seq / sp, (sp_rank + 1) * seq / sp)
    int64_t tokens() const { return batch * seq / sp; }  // tokens on this GPU
    int64_t first_position() const { return sp_rank * (seq / sp); }
};

// The memory techniques, one flag each (the ladder: docs/design.md). Stages 1-6 are the talk's
// techniques in their textbook form; stage 7 adds our own memory savings (savings.cu), each a
// flag of its own; selective checkpointing within a host budget is one more (selective.cu).
struct StepOptions {
    // The talk: ladder stages 1-6.
    bool fsdp = false;     // --fsdp: parameters, gradients, AdamW states sharded over GPUs
    bool ulysses = false;  // --ulysses: one sequence split over GPUs, all-to-all around attention
    bool ckpt = false;     // --ckpt: keep only block inputs, recompute each layer
    bool offload = false;  // --offload: block inputs in pinned host memory (needs ckpt)
    bool chunked = false;  // --chunked: MLP, element-wise work and loss in token chunks
    int untied = 0;        // --untied[=K]: attention in chunks of K query heads per GPU (0: off)
    // Beyond the talk: ladder stage 7, our memory savings (savings.cu).
    int vocab_pieces = 1;             // --vocab-pieces[=N]: the embedding and LM head in N units of vocabulary
                                      // rows (1: whole, as in the talk; 0: as few as keep each within a layer)
    bool one_offload_slot = false;    // --one-offload-slot: block inputs staged through one device slot
    bool grad_in_att_output = false;  // --grad-in-att-output: Untied's normalized-input gradient in the
                                      // attention output's memory
    bool dq_sums_in_staging = false;  // --dq-sums-in-staging: Untied's fused-backward dQ sums in its staging
    // Beyond the talk: selective checkpointing within a host budget (selective.cu).
    bool selective = false;        // --ckpt=selective: also keep attention outputs and lse
    double host_mem_gib = 240;     // --host-mem-gib: pinned host memory per GPU that --offload may plan
    double device_keep_gib = -1;   // --device-keep-gib: device memory =selective --offload may fill with
                                   // attention outputs the host cannot hold (-1: what the cap leaves)
    int rebuild_inputs = -1;       // --rebuild-inputs: at most this many block inputs =selective --offload
                                   // rebuilds instead of keeping, for more attention outputs (-1: any)
    // Kernels and chunk sizes.
    bool fused_attention = false;    // --attention fused: attention's backward adds dQ in an fp32 buffer
    int64_t chunk_tokens = 0;        // --chunk-tokens; 0: the hidden size (ALST's tile)
    int64_t loss_chunk_tokens = 0;   // 0: as many tokens as keep a chunk's logits near 1 GiB
};

// How the step holds each kind of activation. The plain model keeps every activation of every
// layer for the backward; each memory technique changes that in its own *_plan function, called
// once from model_declare_buffers, and the buffers are then declared from the plan alone.
enum class Hold {
    PER_LAYER,   // one slot per layer, kept from the layer's forward to its backward
    ON_HOST,     // kept per layer in pinned host memory, staged through device slots (offload.cu,
                 // selective.cu)
    RECOMPUTED,  // not kept: one slot for all layers, refilled for each layer's backward by
                 // running its forward again (checkpointing.cu)
    ELSEWHERE,   // not in the plain model's buffers: a technique holds it in its own (untied.cu)
};
struct ActivationPlan {
    Hold x_in = Hold::PER_LAYER;        // block inputs: the residual stream entering each layer
    int x_slots = 0;                    // x_in ON_HOST: the device slots they are staged through (offload.cu)
    Hold qkv = Hold::PER_LAYER;         // q, k (after RoPE), v: attention's input
    Hold att = Hold::PER_LAYER;         // attention output and its log-sum-exp
    int att_host_layers = 0;            // att ON_HOST (selective.cu): layers 0 .. this - 1 keep theirs on the
                                        // host, the last layer's stays in its slot, the others rerun attention,
    int att_device_layers = 0;          // except these last of them (before the last layer): they keep
                                        // theirs in their own device slots
    int x_rebuilt_layers = 0;           // x_in ON_HOST, selective: layers 1, 3, .., 2n - 1 keep no block
                                        // input; the backward rebuilds it from layer l-1's (selective.cu)
    Hold x_mid = Hold::PER_LAYER;       // the residual stream between attention and MLP
    Hold norms_mlp = Hold::PER_LAYER;   // xn1, xn2 (norm outputs, their rstd), h13, act (MLP)
    // The step's working buffers for attention's gradients, one for all layers; false where a
    // technique holds them in its own buffers instead.
    bool dqkv_buffer = true;            // d q|k|v of this GPU's tokens (Ulysses: its staging; Untied: chunks)
    bool datt_buffer = true;            // d attention output and delta (Untied: per head chunk)
    bool dq_sums_buffer = true;         // the fused backward's fp32 dQ sums (--dq-sums-in-staging: Untied's staging)
    int64_t chunk_rows = 0;             // tokens a layer works on at once: all of them, or a chunk
    int64_t loss_rows = 0;              // tokens the LM head and loss work on at once
};

// Layer l's activations. [T, ...] buffers are indexed by token; work buffers of the
// norms and the MLP hold one chunk's rows (all T tokens without --chunked). What a pointer
// points at follows from the plan: the layer's own slot, a staging slot, or the shared one.
struct LayerActivations {
    bf16* x_in;     // [T, D] block input (residual stream) = x_out of layer l-1
    bf16* x_out;    // [T, D] block output
    bf16* qkv;      // [T, qkv_dim], q and k after RoPE (Ulysses: [S, this GPU's heads])
    bf16* att;      // [T, Hq d] attention output
    float* lse;     // [B, Hq, S] (Ulysses: this GPU's heads)
    bf16* x_mid;    // [T, D] residual after attention, or one chunk's rows when shared
    bf16* xn1;      // [chunk, D] attention RMSNorm output
    float* rstd1;
    bf16* xn2;      // [chunk, D] MLP RMSNorm output
    float* rstd2;
    bf16* h13;      // [chunk, 2F] gate | up
    bf16* act;      // [chunk, F] silu(gate) * up
};

struct Offload;   // offload.cu
struct Selective;  // selective.cu
struct Timeline;  // timeline.cu
struct Fsdp;      // fsdp.cu
struct Ulysses;   // ulysses.cu
struct Untied;    // untied.cu
class Comm;       // comm.cu

struct Model {
    LlamaConfig cfg;
    ParamLayout layout;
    RunShape shape;
    StepOptions opt;
    ActivationPlan plan;          // how the step holds its activations (set by model_declare_buffers)
    // Model states (category "model"): this GPU's parameters, all of them (param_layout offsets)
    // or, under --fsdp, its shard of every unit (fsdp.cu). local_params elements each.
    float *master = nullptr, *grad = nullptr, *adam_m = nullptr, *adam_v = nullptr;
    int64_t local_params = 0;
    // The weights and the gradient accumulation buffer of each unit as compute sees them: the
    // unit's bf16 slot while it is acquired (fsdp.cu); a view into grad, or (--fsdp) a per-unit
    // gradient buffer.
    std::vector<bf16*> unit_w;
    std::vector<float*> unit_g;
    // Communication: the world (identity on one GPU); FSDP's collectives run on their own
    // communicator and stream, Ulysses's on the compute stream.
    Comm* comm = nullptr;         // set by the caller, or a single-GPU one made by model_allocate
    Comm* comm_fsdp = nullptr;    // made by model_allocate (split of comm), freed by model_free
    bool owns_comm = false;
    bool pin_host = true;  // --offload's pinned host memory; a run of no steps plans it only
    int device_attention_layers = 0;  // =selective --offload: at most this many layers that the host
                                      // cannot hold keep attention on the device (the cap's room, selective.cu)
    cudaStream_t comm_stream = nullptr;
    int world = 1;                // GPUs of the run (simulated ones included)
    uint64_t init_seed = 0;       // model_init_weights' seed: under --sim-world, comm.cu draws the
                                  // other ranks' shards from it
    double comm_timeout_s = 600;  // a wait that sees no progress for this long ends the run
    // Watchdog: an event per layer and phase of the step; a wait resets its timeout whenever one
    // more has completed, so a long step is not a hung one. Host-pinned scalars: copies of them
    // are asynchronous, so every wait goes through the watchdog.
    std::vector<cudaEvent_t> progress;  // start, each layer's forward, the head, each backward
    int64_t saved_per_layer[MEM_NUM_CATEGORIES] = {};  // one layer's kept activations (--mem-trace)
    int progress_recorded = 0;
    float* host_scalars = nullptr;
    // The techniques' own state and buffers; null when the technique is off.
    std::shared_ptr<Fsdp> fsdp;        // shards and gathered slots (fsdp.cu; also the replicated bookkeeping)
    std::shared_ptr<Ulysses> ulysses;  // all-to-all staging, head-sharded buffers (ulysses.cu)
    std::shared_ptr<Untied> untied;    // one head chunk's buffers (untied.cu)
    Offload* offload = nullptr;        // pinned host copies of the block inputs and their stream (offload.cu)
    Selective* selective = nullptr;    // pinned host copies of attention outputs (selective.cu)
    Timeline* timeline = nullptr;      // --timeline's events (timeline.cu)
    // Activations
    std::vector<LayerActivations> layers;
    bf16* x_final = nullptr;      // [T, D] output of the last layer
    bf16 *xnf = nullptr, *logits = nullptr;   // [loss_rows, D], [loss_rows, V] (one vocabulary piece's columns)
    float *rstdf = nullptr, *losses = nullptr;
    // The LM head in vocabulary pieces: per token, the running max of its logits (then their
    // log-sum-exp), the running sum of exponentials, and the target's logit. [T] each.
    float *token_lse = nullptr, *token_sumexp = nullptr, *target_logit = nullptr;
    // Backward. The residual gradient and attention's gradients span all tokens (attention's
    // backward needs all of them); the rest holds one chunk.
    bf16 *dres = nullptr;         // [T, D] d loss / d residual stream, which every branch adds into
    bf16 *dqkv = nullptr, *datt = nullptr;  // [T, qkv_dim], [T, Hq d]
    float* delta = nullptr;       // [B, Hq, S] rowsum(d out * out) (Ulysses: this GPU's heads)
    float* dq_accum = nullptr;    // --attention fused: the fp32 dQ sums of one attention call
    bf16 *dxn = nullptr, *dh13 = nullptr, *dact = nullptr;
    float *norm_partial = nullptr, *reduce_scratch = nullptr;
    float *scalars = nullptr;     // [0] loss sum, [1] grad sum of squares, [2] clip scale
    // Inputs
    int32_t *tokens = nullptr, *targets = nullptr;
    int64_t n_valid_targets = 0;  // targets != -1 in this step's batch (the loss is their mean)
    EmbeddingGroups emb_groups;   // host side of the embedding backward's grouping
    int32_t* emb_group_token = nullptr;
    int64_t *emb_group_begin = nullptr, *emb_positions = nullptr;
    double* inv_freq = nullptr;
    void* gemm_workspace = nullptr;
    size_t gemm_workspace_bytes = 32u << 20;

    const ParamTensor& param(ParamKind k, int layer = -1) const { return layout.find(k, layer); }
    // A tensor that lies in one unit (the embedding and LM head in several pieces: w_piece).
    const ParamTensor& whole(ParamKind k, int layer) const {
        const ParamTensor& t = param(k, layer);
        if (t.offset + t.numel() > layout.unit_begin[t.unit + 1])
            throw std::logic_error(std::string(param_kind_name(k)) + " spans several units: use w_piece / g_piece");
        return t;
    }
    bf16* w(ParamKind k, int layer = -1) const {
        const ParamTensor& t = whole(k, layer);
        return unit_w[t.unit] + (t.offset - layout.unit_begin[t.unit]);
    }
    float* g(ParamKind k, int layer = -1) const {
        const ParamTensor& t = whole(k, layer);
        return unit_g[t.unit] + (t.offset - layout.unit_begin[t.unit]);
    }
    // Vocabulary piece p of the embedding (P_EMBED) or the untied LM head (P_LM_HEAD): its rows
    // layout.piece_row[p] .. are one unit, whose start they are.
    int piece_unit(ParamKind k, int p) const { return k == P_EMBED ? layout.embed_unit(p) : layout.head_unit(p); }
    bf16* w_piece(ParamKind k, int p) const { return unit_w[piece_unit(k, p)]; }
    float* g_piece(ParamKind k, int p) const { return unit_g[piece_unit(k, p)]; }
};

// Floats of one layer's lse: batch x this GPU's query heads (Ulysses: 1/N of them) x seq.
int64_t layer_lse_floats(const Model& m);
// Declare every buffer of a step in the arena (dry run or real; see Arena).
void model_declare_buffers(Model& m, Arena& arena);
// Allocate the planned buffers: `arena` holds the dry run's plan. Checks plan + runtime against
// dm.cap_bytes first and reports an out-of-memory (exit code 3) naming what does not fit, with
// `oom_hint` as the suggested next step. Then one cudaMalloc, the real pass, cuBLASLt workspace.
void model_allocate(Model& m, Arena& arena, DeviceMemory& dm, const std::string& oom_hint);
void model_free(Model& m, DeviceMemory& dm);
// Initialize weights (HF's scheme: N(0, 0.02), norm gains 1) from a seed; zero AdamW moments.
void model_init_weights(Model& m, uint64_t seed, cudaStream_t s);
// The initial values [offset, offset + count) of tensor t for a seed, into f32 or (f32 null) bf16.
void init_param_values(const Model& m, const ParamTensor& t, int64_t offset, int64_t count, uint64_t seed,
                       float* f32, bf16* b16, cudaStream_t s);
// Upload this step's tokens and targets (host arrays of shape.tokens(), this GPU's part).
// n_valid: targets != -1 over the whole step on all GPUs (the loss is their mean); -1: count here.
void model_set_batch(Model& m, const int32_t* tokens, const int32_t* targets, cudaStream_t s,
                     int64_t n_valid = -1);
// Forward and backward of one step. Returns nothing; the loss sum lands in m.scalars[0].
// progress (may be null) is called after each layer with (phase "fwd"/"bwd", layer index).
typedef void (*ProgressFn)(void* ctx, const char* phase, int layer);
void model_forward_backward(Model& m, cudaStream_t s, ProgressFn progress = nullptr,
                            void* progress_ctx = nullptr);
// Live bytes per category over the last step, at its progress events (--mem-trace; llama.cu).
struct MemTracePoint {
    std::string point;  // start, fwd, head, bwd
    int layer = -1;
    double t_ms = 0;    // since the step's start, on the GPU
    int64_t live[MEM_NUM_CATEGORIES] = {};
    int64_t host = 0;   // pinned host memory holding offloaded activations
};
std::vector<MemTracePoint> model_memory_trace(const Model& m, const Arena& arena);
// Gradient clipping and AdamW over all parameters. Returns nothing (grad norm in scalars[1]).
void model_optimizer_step(Model& m, const AdamW& opt, float max_grad_norm, cudaStream_t s);
// FLOPs of one training step (forward + backward), for TFLOP/s and MFU. Model FLOPs: the
// recomputation of --ckpt is not counted (MFU's convention).
double model_step_flops(const LlamaConfig& cfg, const RunShape& shape);

// The pieces of a layer that the techniques call again (llama.cu). Each per-token piece works on
// tokens [t0, t1) of this GPU; a layer walks its tokens in chunks (chunked.cu).
void attention_norm_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s);  // xn1 = norm(x_in)
void qkv_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s);   // xn1, then q|k|v, RoPE
void self_attention_forward(Model& m, int l, cudaStream_t s);  // att, lse from q, k, v: the whole sequence
// The attention sub-block's forward: att, lse from x_in (q|k|v chunk by chunk, then attention; under
// --untied, head chunk by head chunk: untied.cu).
void attention_block_forward(Model& m, int l, cudaStream_t s);
void attention_output_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s);  // x_mid = x_in + att Wo^T
void mlp_input_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s);  // xn2, h13, act from x_mid
void block_output_forward(Model& m, int l, cudaStream_t s);  // x_out from x_in and att: Wo, the MLP, every chunk
// The head's pieces that its vocabulary pieces (savings.cu) call too.
void final_norm_forward(Model& m, int64_t t0, int64_t n, cudaStream_t s);  // xnf, rstdf of tokens [t0, t0 + n)
// dres rows [t0, t0 + n) = d loss / d x_final from dxnf = d loss / d norm(x_final) of those rows.
void final_norm_backward(Model& m, int64_t t0, int64_t n, const bf16* dxnf, cudaStream_t s);
float loss_grad_scale(const Model& m);  // 1 / the step's count of valid targets (the loss is their mean)
ParamKind lm_head_kind(const Model& m);  // P_LM_HEAD, or P_EMBED with tied embeddings

// ---------------------------------------------------------------------------------------------
// Communicator (comm.cu): all traffic between GPUs. Three implementations: NCCL (one process
// per GPU), a fake one for --sim-world N (rank 0's exact share of an N-GPU run: the same
// buffers and kernels, with collectives replaced by local copies), and the single-GPU identity.
enum class DType { BF16, F32 };
class Comm {
  public:
    int rank = 0, world = 1;
    bool simulated = false;  // --sim-world: numbers are rank 0's share, the loss is meaningless
    virtual ~Comm() = default;
    // out[world * n] = the in[n] of every rank, in rank order
    virtual void all_gather(void* out, const void* in, int64_t n, DType t, cudaStream_t s) = 0;
    // out[n] = sum over ranks of their in[rank * n .. (rank + 1) * n)
    virtual void reduce_scatter(void* out, const void* in, int64_t n, DType t, cudaStream_t s) = 0;
    virtual void all_reduce(void* buf, int64_t n, DType t, cudaStream_t s) = 0;  // sum, in place
    // out block i (n elements) = block `rank` of rank i's in
    virtual void all_to_all(void* out, const void* in, int64_t n, DType t, cudaStream_t s) = 0;
    // Another communicator over the same ranks, for collectives issued on another stream.
    virtual Comm* split() = 0;
    // Throws Fatal (exit code 1) if the communicator failed asynchronously.
    virtual void check() {}
    virtual void abort() {}
};
Comm* comm_single();
Comm* comm_fake(int world);
// --sim-world: a gather into `slot` brought only this rank's shard of unit u (shard elements at
// rank x shard). The other ranks' shards get what a real gather would bring at the start of
// training, unit u's initial weights drawn from the seed (comm.cu, with the emulated communicator).
void sim_world_draw_other_shards(const Model& m, bf16* slot, int u, int64_t shard, int rank, cudaStream_t s);
// NCCL over `world` processes. Rank 0 serves the unique id over TCP: on listen_fd if >= 0 (a
// socket inherited from ./train --nproc), else on master_port; the others connect to
// master_addr:master_port. Waits at most timeout_s for its peers.
Comm* comm_nccl(int rank, int world, int listen_fd, const std::string& master_addr, int master_port,
                double timeout_s);
// Wait for a stream while watching the communicator: a failed or hung peer ends in Fatal after
// timeout_s, never in a hang.
void comm_sync(Comm* comm, cudaStream_t s, double timeout_s);
struct Model;
// The step's wait: both communicators watched, the timeout counted from the last progress event.
void model_sync(Model& m, cudaStream_t s);
// Ulysses's and Untied's all-to-all over m.comm on the compute stream, marked as layer l's on
// --timeline with the bytes this GPU sends to the others.
void layer_all_to_all(Model& m, int l, void* out, const void* in, int64_t n, DType t, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// Parameters across GPUs (fsdp.cu): replicated (gradients all-reduced) or sharded (--fsdp).
// A unit is a piece of the embedding, a layer, the final norm or a piece of the LM head
// (common.h param_layout).
int64_t fsdp_local_params(const ParamLayout& lay, bool sharded, int world);  // elements per GPU
void fsdp_declare_buffers(Model& m, Arena& A);  // the two bf16 unit slots (comm under --fsdp, else model), gradient slots
void fsdp_create(Model& m);
void fsdp_destroy(Model& m);
std::vector<int> fsdp_unit_order(const Model& m);  // the units in the order a step acquires them
void fsdp_step_begin(Model& m, cudaStream_t s);
// Weights of unit u usable on the compute stream after acquire, until release.
void fsdp_acquire(Model& m, int u, cudaStream_t s);
void fsdp_release(Model& m, int u, cudaStream_t s);
// Weights of unit u, already gathered ahead into its slot, usable on the compute stream before
// its turn (selective.cu's rebuilt inputs read layer l-1's during layer l's); acquire still follows.
void fsdp_wait_gathered(Model& m, int u, cudaStream_t s);
// Gradients of unit u accumulate between grad_begin and grad_end; `last` marks the unit's last
// contribution of the step (the tied embedding gets two: the LM head and the lookup).
void fsdp_grad_begin(Model& m, int u, cudaStream_t s);
void fsdp_grad_end(Model& m, int u, bool last, cudaStream_t s);
void fsdp_step_end(Model& m, cudaStream_t s);  // all gradient traffic done before the optimizer
// This GPU's parameters as pieces of tensors: local offset, count, the tensor, offset inside it.
struct ParamSegment {
    int64_t local, count;
    const ParamTensor* tensor;
    int64_t tensor_offset;
};
std::vector<ParamSegment> fsdp_segments(const Model& m);
// Unit u of a parameter-sized array (master weights, gradients), whole, on the host: gathered
// from the shards under --fsdp (a collective: every rank calls it).
std::vector<float> fsdp_gather_unit(Model& m, const float* local, int u, cudaStream_t s);
// Every gradient, whole, on the host: for tests and --dump.
std::vector<float> fsdp_full_gradients(Model& m, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// DeepSpeed Ulysses (ulysses.cu): --ulysses. Attention over the whole sequence with a 1/sp
// share of the heads.
struct UlyssesHeads {
    int q, kv;  // query and KV heads per GPU (kv = 1 with KV heads replicated when sp > Hkv)
    int64_t width(int head_dim) const { return (int64_t)(q + 2 * kv) * head_dim; }
};
UlyssesHeads ulysses_heads(const LlamaConfig& c, int sp);
// Rejects shapes Ulysses cannot split, with a message naming what does not divide.
void ulysses_check(const LlamaConfig& c, const RunShape& shape);
void ulysses_plan(Model& m);
void ulysses_declare_buffers(Model& m, Arena& A);
AttentionShape ulysses_attention_shape(const Model& m);  // one attention call: S tokens, this GPU's heads
bf16* ulysses_qkv_of_tokens(Model& m);   // where the projection writes q|k|v before the all-to-all
bf16* ulysses_dqkv_of_tokens(Model& m);  // where d q|k|v of this GPU's tokens arrives
void ulysses_qkv_to_heads(Model& m, int l, cudaStream_t s);  // token-sharded q|k|v -> the layer's qkv
void ulysses_attention_forward(Model& m, int l, cudaStream_t s);
void ulysses_attention_backward(Model& m, int l, cudaStream_t s);
// Kernels untied.cu uses too. dst[t][col0 + j stride + x] = src[j][t][x] for x < w: the blocks
// that came from GPU j into their columns of rows of width ld.
void ulysses_blocks_to_columns(bf16* dst, const bf16* src, int64_t T, int sp, int64_t w, int64_t ld,
                               int64_t col0, int64_t stride, cudaStream_t s);
// delta[t][h] = rowsum over head h of dout * out, for H heads from each row's start.
void ulysses_delta(float* delta, const bf16* dout, int64_t ld_dout, const bf16* out, int64_t ld_out,
                   int64_t T, int H, int d, cudaStream_t s);
// [B][S][q] -> [B][q][S]: per-token delta to the attention kernel's per-head layout.
void ulysses_transpose_delta(float* out, const float* in, int64_t B, int64_t S, int q, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// Activation checkpointing (checkpointing.cu): --ckpt.
void checkpointing_plan(Model& m);
// Backward, before layer l's: the attention sub-block's forward again, where its output was not kept.
void recompute_attention(Model& m, int l, cudaStream_t s);
// Backward, per chunk: rebuild what the chunk's backward reads and the plan did not keep.
void recompute_attention_norm(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s);
void recompute_mlp_inputs(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// CPU offload of the block inputs (offload.cu): --offload.
void offload_plan(Model& m);
int64_t offload_host_bytes(const Model& m);  // pinned host bytes of the block inputs (0 without --offload)
void offload_create(Model& m);    // pinned buffers (once), copy stream, events
void offload_destroy(Model& m);
// The step's hooks; each does nothing without --offload.
void offload_step_begin(Model& m, cudaStream_t s);
void offload_save_block_input(Model& m, int l, cudaStream_t s);      // layer l's x_in is complete: copy it out
void offload_before_layer_output(Model& m, int l, cudaStream_t s);   // the slot of layer l's x_out holds no
                                                                     // input still on its way to the host
void offload_after_layer_forward(Model& m, int l, cudaStream_t s);   // x_out is the next x_in: copy it out
void offload_before_layer_backward(Model& m, int l, cudaStream_t s);  // l's x_in in its slot (two slots:
                                                                      // l-1's on its way)
// For selective.cu: copies on the copy stream, once the compute stream has reached this point;
// layer l's block input from the host into its slot (s waits for it in offload_before_layer_backward),
// or rebuilt there on the device.
void offload_copy(Model& m, void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind, const char* what,
                  int layer, cudaStream_t s);
cudaStream_t offload_copy_stream(const Model& m);
void offload_fetch_input(Model& m, int l, cudaStream_t s);
void offload_input_written(Model& m, int l);

// ---------------------------------------------------------------------------------------------
// Selective checkpointing within a host budget (selective.cu): --ckpt=selective. Beyond the talk.
void selective_plan(Model& m);
// Whether layer l's backward finds its attention output and lse kept from the forward (no rerun).
bool attention_kept(const Model& m, int l);
// Layer l's own device slot for its kept attention output (att_device_layers), or -1.
int selective_device_slot(const Model& m, int l);
// Whether layer l's block input stays off the host, rebuilt in the backward from layer l-1's; how
// many of layers 0 .. n-1 leave theirs off the host.
bool selective_input_rebuilt(const Model& m, int l);
int selective_inputs_rebuilt_below(const Model& m, int n);
int64_t selective_host_bytes(const Model& m);       // pinned host bytes of the attention outputs kept there
int64_t selective_attention_bytes(const Model& m);  // one layer's attention output and lse
// The layers whose attention outputs fit in `room_bytes` of the device beyond the plan (at most --device-keep-gib).
int selective_device_layers(const Model& m, double room_bytes);
std::string selective_plan_text(const Model& m);  // which layers keep their attention output where
void selective_declare_buffers(Model& m, Arena& A);  // the device's own slots of attention outputs
void selective_create(Model& m);  // pinned host memory of the attention outputs (once), events
void selective_destroy(Model& m);
// The step's hooks; each does nothing without --ckpt=selective.
void selective_before_attention(Model& m, int l, cudaStream_t s);   // the attention output's staging slot is free
void selective_after_attention(Model& m, int l, cudaStream_t s);    // att, lse to the host
void selective_recompute_attention(Model& m, int l, cudaStream_t s);  // q|k|v again; attention where not kept
void selective_before_layer_backward(Model& m, int l, cudaStream_t s);  // att, lse back; a rebuilt input

// ---------------------------------------------------------------------------------------------
// Stage 7's memory savings (savings.cu), beyond the talk.
void savings_plan(Model& m);
bool untied_grad_in_att_output(const Model& m);  // --grad-in-att-output, where the output is wide enough
void lm_head_in_pieces(Model& m, cudaStream_t s);  // --vocab-pieces: the LM head and loss, one piece at a time

// Pinned host bytes of the step: offloaded block inputs and kept attention outputs.
int64_t model_host_bytes(const Model& m);

// ---------------------------------------------------------------------------------------------
// The event timeline (timeline.cu): --timeline FILE. Marks of the last step, per stream, in ms
// from its start; each call does nothing unless timeline_enable was called.
struct TimelineEntry {
    std::string stream, what;
    int layer;  // the layer, or for "fsdp" marks the unit
    double start_ms, end_ms;
    int64_t bytes;  // what a copy or a collective moved (0 for compute)
};
void timeline_enable(Model& m);
void timeline_destroy(Model& m);
void timeline_step_begin(Model& m, cudaStream_t s);
void timeline_step_end(Model& m);
// A mark from its construction to the end of its scope: the work queued on s in between, which
// does `what` for layer l (fsdp marks: the unit) and moves `bytes`. `stream` and `what` are kept
// until the timeline is read: string literals. Without a timeline, or outside a step, nothing.
class TimelineMark {
  public:
    TimelineMark(Model& m, cudaStream_t s, const char* stream, const char* what, int layer, int64_t bytes = 0);
    ~TimelineMark();
    TimelineMark(const TimelineMark&) = delete;
    TimelineMark& operator=(const TimelineMark&) = delete;

  private:
    Model& m_;
    cudaStream_t s_;
    const char *stream_, *what_;
    int layer_, begin_;
    int64_t bytes_;
};
std::vector<TimelineEntry> timeline_read(Model& m);

// ---------------------------------------------------------------------------------------------
// Chunked sequence training (chunked.cu): --chunked. The loops a layer and the head walk their
// tokens with: one chunk of all of them without --chunked.
void chunked_plan(Model& m);
// f(t0, t1) for each chunk [t0, t1) of m.plan.chunk_rows of this GPU's tokens.
void for_each_token_chunk(const Model& m, const std::function<void(int64_t t0, int64_t t1)>& f);
// f(t0, n) for each chunk of m.plan.loss_rows tokens, n of them from t0: the LM head's and the loss's.
void for_each_loss_chunk(const Model& m, const std::function<void(int64_t t0, int64_t n)>& f);

// ---------------------------------------------------------------------------------------------
// Untied Ulysses (untied.cu): --untied[=K]. The attention sub-block in chunks of K query heads.
// Rejects K that do not fit the heads.
void untied_check(const LlamaConfig& c, const RunShape& shape, int K);
void untied_plan(Model& m);
void untied_declare_buffers(Model& m, Arena& A);
AttentionShape untied_attention_shape(const Model& m);  // one attention call: one head chunk
// The attention sub-block of layer l: forward fills att and lse from x_in; backward (d loss /
// d x_mid in m.dres) adds d loss / d x_in into m.dres and the projections' gradients.
void untied_attention_forward(Model& m, int l, cudaStream_t s);
void untied_attention_backward(Model& m, int l, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// Files (files.cu): Hugging Face checkpoints, token files, the training state.
// The config.json of a save: c, and the dtype its weights were written in (bf16 or fp32).
std::string hf_config_json(const LlamaConfig& c, bool bf16);
// check_hf_config, the check of a config.json, is in input_files.h with the other readers.
// This GPU's parameters from a HF checkpoint (a .safetensors file, or a directory with
// model.safetensors or model.safetensors.index.json): every tensor's name and shape checked.
std::vector<float> read_hf_weights(const Model& m, const std::string& path);
void check_hf_checkpoint(const Model& m, const std::string& path);  // the same checks, no data read
void load_hf_checkpoint(Model& m, const std::string& path, cudaStream_t s);  // + bf16, zero moments
void write_hf_checkpoint(const std::string& dir, const LlamaConfig& c, const ParamLayout& lay, bool bf16, bool lead,
                         const std::function<std::vector<float>(int)>& unit_data);
void save_hf_checkpoint(Model& m, const std::string& dir, bool bf16, cudaStream_t s);

struct Mapped;
struct TokenFile {  // "LLTOKENS", uint32 version 1, uint32 4, uint64 count, count x uint32
    const uint32_t* tokens = nullptr;
    uint64_t count = 0;
    Mapped* map = nullptr;
    TokenFile(const std::string& path, int vocab);  // every token checked against the vocabulary
    ~TokenFile();
    TokenFile(const TokenFile&) = delete;
    TokenFile& operator=(const TokenFile&) = delete;
};
void write_token_file(const std::string& path, const std::vector<uint32_t>& tokens);

// The whole training state of every GPU (collective). load returns false if dir has none.
void save_train_state(Model& m, const std::string& dir, int64_t step, uint64_t data_state, cudaStream_t s,
                      double timeout_s);
bool load_train_state(Model& m, const std::string& dir, int64_t* step, uint64_t* data_state, cudaStream_t s);
