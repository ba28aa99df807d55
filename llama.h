// llama.h - what llama.cu and the technique files share: the run's shape and flags, how the step
// holds its activations (the ActivationPlan), the Model, the step's API, the layer's pieces that
// the techniques call again, and one section per technique file with the functions the step calls.
// Where each flag changes the step is one table, docs/design.md#where-each-flag-changes-the-step.
//
// The layers' kernels and the matrix products are declared in kernels/kernels.h, attention in
// kernels/attention.h; the arena and the error checks in infra/memory.h; the communicator in
// infra/comm.h; the timeline in infra/timeline.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "infra/comm.h"
#include "infra/common.h"
#include "infra/memory.h"
#include "infra/timeline.h"
#include "kernels/attention.h"
#include "kernels/kernels.h"

// ---------------------------------------------------------------------------------------------
// The run on one GPU.
struct RunShape {
    int batch = 1;     // sequences per step on this GPU
    int64_t seq = 0;   // tokens per sequence (the whole sequence, also under Ulysses)
    int sp = 1;        // Ulysses: GPUs one sequence is split over
    int sp_rank = 0;   // this GPU holds tokens [sp_rank * seq / sp, (sp_rank + 1) * seq / sp)
    int64_t tokens() const { return batch * seq / sp; }  // tokens on this GPU
    int64_t first_position() const { return sp_rank * (seq / sp); }
};

// The memory techniques, one flag each (the ladder: docs/design.md). Stages 1-6 are the talk's
// techniques in their textbook form; stage 7 adds our own memory savings (beyond/savings.cu),
// each a flag of its own; selective checkpointing within a host budget is one more
// (beyond/selective.cu).
struct StepOptions {
    // The talk: ladder stages 1-6.
    bool fsdp = false;     // --fsdp: parameters, gradients, AdamW states sharded over GPUs
    bool ulysses = false;  // --ulysses: one sequence split over GPUs, all-to-all around attention
    bool ckpt = false;     // --ckpt: keep only block inputs, recompute each layer
    bool offload = false;  // --offload: block inputs in pinned host memory (needs ckpt)
    bool chunked = false;  // --chunked: MLP, element-wise work and loss in token chunks
    int untied = 0;        // --untied[=K]: attention in chunks of K query heads per GPU (0: off)
    // Beyond the talk: ladder stage 7, our memory savings (beyond/savings.cu).
    int vocab_pieces = 1;             // --vocab-pieces[=N]: the embedding and LM head in N units of vocabulary
                                      // rows (1: whole, as in the talk; 0: as few as keep each within a layer)
    bool one_offload_slot = false;    // --one-offload-slot: block inputs staged through one device slot
    bool grad_in_att_output = false;  // --grad-in-att-output: Untied's normalized-input gradient in the
                                      // attention output's memory
    bool dq_sums_in_staging = false;  // --dq-sums-in-staging: Untied's fused-backward dQ sums in its staging
    // Beyond the talk: selective checkpointing within a host budget (beyond/selective.cu).
    bool selective = false;        // --ckpt=selective: also keep attention outputs and lse
    double host_mem_gib = 240;     // --host-mem-gib: pinned host memory per GPU that --offload may plan
    double device_keep_gib = -1;   // --device-keep-gib: device memory =selective --offload may fill with
                                   // attention outputs the host cannot hold (-1: what the cap leaves)
    int rebuild_inputs = -1;       // --rebuild-inputs: at most this many block inputs =selective --offload
                                   // rebuilds instead of keeping, for more attention outputs (-1: any)
    // Packed documents.
    bool doc_mask = false;           // --doc-mask: attention inside each document, RoPE positions from its start
    int64_t max_docs = 0;            // --doc-mask: the most documents this GPU's sequences of a step hold
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
    ON_HOST,     // kept per layer in pinned host memory, staged through device slots (offload.cu)
    RECOMPUTED,  // not kept: one slot for all layers, refilled for each layer's backward by
                 // running its forward again (offload.cu, activation checkpointing)
    ELSEWHERE,   // not in the plain model's buffers: a technique holds it in its own (Untied Ulysses)
};
struct ActivationPlan {
    Hold x_in = Hold::PER_LAYER;        // block inputs: the residual stream entering each layer
    int x_slots = 0;                    // x_in ON_HOST: the device slots they are staged through
    Hold qkv = Hold::PER_LAYER;         // q, k (after RoPE), v: attention's input
    Hold att = Hold::PER_LAYER;         // attention output and its log-sum-exp
    Hold x_mid = Hold::PER_LAYER;       // the residual stream between attention and MLP
    Hold norms_mlp = Hold::PER_LAYER;   // xn1, xn2 (norm outputs, their rstd), h13, act (MLP)
    // The step's working buffers for attention's gradients, one for all layers; false where a
    // technique holds them in its own buffers instead.
    bool dqkv_buffer = true;            // d q|k|v of this GPU's tokens (Ulysses: its staging; Untied: chunks)
    bool datt_buffer = true;            // d attention output and delta (Untied: per head chunk)
    bool dq_sums_buffer = true;         // the fused backward's fp32 dQ sums (stage 7: in Untied's staging)
    bool dxn1_buffer = true;            // Untied: the normalized input's gradient (stage 7: in the attention output)
    int64_t chunk_rows = 0;             // tokens a layer works on at once: all of them, or a chunk
    int64_t loss_rows = 0;              // tokens the LM head and loss work on at once
    // Selective checkpointing (beyond/selective.cu) with att ON_HOST: layers 0 .. att_host_layers - 1
    // keep their attention output on the host, the last layer's stays in its slot, the others rerun
    // attention except the last att_device_layers of them (before the last layer), which keep theirs
    // in device slots of their own; and layers 1, 3, .., 2 x_rebuilt_layers - 1 keep no block input:
    // the backward rebuilds it from layer l-1's.
    int att_host_layers = 0, att_device_layers = 0, x_rebuilt_layers = 0;
};
// Selective checkpointing's plan: whether layer l's block input is left off the host (rebuilt in
// the backward); how many of layers 0 .. n-1 leave theirs off.
inline bool input_rebuilt(const ActivationPlan& p, int l) {
    return p.x_in == Hold::ON_HOST && l % 2 == 1 && l < 2 * p.x_rebuilt_layers;
}
inline int inputs_rebuilt_below(const ActivationPlan& p, int n) { return std::clamp(n / 2, 0, p.x_rebuilt_layers); }

// Layer l's activations. [T, ...] buffers are indexed by token; work buffers of the
// norms and the MLP hold one chunk's rows (all T tokens without --chunked). What a pointer
// points at follows from the plan: the layer's own slot, a staging slot, or the shared one.
struct LayerActivations {
    bf16* x_in;     // [T, D] block input (residual stream) = x_out of layer l-1
    bf16* x_out;    // [T, D] block output
    bf16* qkv;      // [T, qkv_dim], q and k after RoPE (Ulysses: [S, this GPU's heads])
    bf16* att;      // [T, Hq d] attention output
    float* lse;     // [B, Hq, S] (Ulysses: this GPU's heads)
    bf16* x_mid;    // [T, D] residual after attention, or one chunk's rows when recomputed
    int64_t x_mid_row_step;  // D when x_mid holds every token's row, 0 when it holds one chunk's
    bf16* xn1;      // [chunk, D] attention RMSNorm output
    float* rstd1;
    bf16* xn2;      // [chunk, D] MLP RMSNorm output
    float* rstd2;
    bf16* h13;      // [chunk, 2F] gate | up
    bf16* act;      // [chunk, F] silu(gate) * up
    bf16* x_mid_rows(int64_t t0) const { return x_mid + t0 * x_mid_row_step; }  // the chunk's rows from token t0
};

// ---------------------------------------------------------------------------------------------
// Unit u on this GPU (llama.cu): its model states are elements [local, local + count) of the
// master weights, gradients and moments, and hold the unit's elements [first, first + count); its
// bf16 slot holds `padded` elements. Every unit whole without --fsdp; with it, this GPU's shard
// (fsdp.cu).
struct UnitShard {
    int64_t local, count, first, padded;
};

// This GPU's parameters as pieces of tensors: local offset, count, the tensor, offset inside it.
struct ParamSegment {
    int64_t local, count;
    const ParamTensor* tensor;
    int64_t tensor_offset;
};

// Model states (category "model"; llama.cu): this GPU's parameters, all of them (param_layout
// offsets) or, under --fsdp, its shard of every unit (fsdp.cu); `count` elements each.
struct ModelStates {
    float *master = nullptr, *grad = nullptr, *adam_m = nullptr, *adam_v = nullptr;
    int64_t count = 0;
    std::vector<UnitShard> shards;       // where each unit's model states lie
    std::vector<ParamSegment> segments;  // what of each tensor they hold (param_segments)
};

// --vocab-pieces (stage 7, beyond/savings.cu): the LM head in vocabulary pieces keeps, per token,
// the running max of its logits (then their log-sum-exp), the running sum of exponentials, and
// the target's logit. [T] each; none with the vocabulary in one piece.
struct HeadPieces {
    float *token_lse = nullptr, *token_sumexp = nullptr, *target_logit = nullptr;
};

// The LM head and loss, m.plan.loss_rows tokens at a time.
struct HeadBuffers {
    bf16 *xnf = nullptr, *logits = nullptr;  // [loss_rows, D], [loss_rows, V] (one vocabulary piece's columns)
    float *rstdf = nullptr, *losses = nullptr;  // [loss_rows], and every token's loss [T]
    HeadPieces pieces;
};

// The backward's work buffers of one token chunk (all T tokens without --chunked).
struct ChunkGradients {
    bf16 *dxn = nullptr, *dh13 = nullptr, *dact = nullptr;  // d norm output [C, D], d h13, d act
    bf16* qk_raw = nullptr;  // Qwen3: q|k before their norms, projected again [C, (Hq+Hkv) d]
};

// Scratch of the reductions and the matrix products.
struct Workspace {
    float *norm_partial = nullptr, *reduce = nullptr;  // rmsnorm weight-gradient partials; sums
    void* gemm = nullptr;                              // cuBLASLt's
    size_t gemm_bytes = 32u << 20;
};

// The step's inputs on this GPU (model_set_batch): tokens and targets [T], and the embedding
// backward's grouping of the tokens (kernels/kernels.h), on the host and on the device.
struct StepBatch {
    int32_t *tokens = nullptr, *targets = nullptr;
    int64_t n_valid_targets = 0;  // targets != -1 in this step's batch (the loss is their mean)
    EmbeddingGroups groups;
    int32_t* group_token = nullptr;
    int64_t *group_begin = nullptr, *positions = nullptr;
};

// --doc-mask: the step's documents on the device (model_set_batch), in the flat [batch][seq] order
// of the sequences this GPU's attention sees (under Ulysses the whole sequence): where each
// starts and the position of its first token, as attention and RoPE take them (none without).
struct DeviceDocuments {
    int64_t *start = nullptr, *first_position = nullptr;  // [max_docs] each
    AttentionDocs attention;
    DocPositions positions;
};

struct UnitSlots;  // llama.cu
struct Fsdp;       // fsdp.cu
struct Ulysses;    // ulysses.cu
struct Untied;     // ulysses.cu
struct Offload;    // offload.cu
struct Selective;  // beyond/selective.cu

struct Model {
    LlamaConfig cfg;
    ParamLayout layout;
    RunShape shape;
    StepOptions opt;
    ActivationPlan plan;  // how the step holds its activations (set by model_declare_buffers)
    ModelStates states;
    // The weights and the gradient accumulation buffer of each unit as compute sees them: the
    // unit's bf16 slot from unit_begin to unit_end; a view into the gradients, or (--fsdp) a unit
    // gradient buffer.
    std::shared_ptr<UnitSlots> slots;
    std::vector<bf16*> unit_w;
    std::vector<float*> unit_g;
    // Communication: the world (identity on one GPU); the units' collectives (FSDP's gathers and
    // reduce-scatters, data parallel's all-reduces) run on their own communicator and stream,
    // Ulysses's on the compute stream.
    Comm* comm = nullptr;         // set by the caller, or a single-GPU one made by model_allocate
    Comm* comm_params = nullptr;  // made by model_allocate (split of comm), freed by model_free
    bool owns_comm = false;
    cudaStream_t comm_stream = nullptr;
    int world = 1;                // GPUs of the run (simulated ones included)
    bool pin_host = true;         // --offload's pinned host memory; a run of no steps plans it only
    int device_attention_layers = 0;  // =selective --offload: at most this many layers that the host
                                      // cannot hold keep attention on the device (the cap's room)
    uint64_t init_seed = 0;       // the seed the weights were drawn from (model_init_weights)
    StepWatch watch;              // the step's phases, the watchdog, --timeline (infra/timeline.h)
    int64_t saved_per_layer[MEM_NUM_CATEGORIES] = {};  // one layer's kept activations (--mem-trace)
    bool forward_only = false;  // within model_forward_loss: no backward follows the forward
    // The techniques' own state and buffers; null when the technique is off.
    std::shared_ptr<Fsdp> fsdp;        // the unit gradient buffers (fsdp.cu)
    std::shared_ptr<Ulysses> ulysses;  // all-to-all staging, head-sharded buffers (ulysses.cu)
    std::shared_ptr<Untied> untied;    // one head chunk's buffers (ulysses.cu, Untied Ulysses)
    Offload* offload = nullptr;        // pinned host copies of the block inputs and their stream (offload.cu)
    Selective* selective = nullptr;    // pinned host copies of attention outputs (beyond/selective.cu)
    // Activations
    std::vector<LayerActivations> layers;
    bf16* x_final = nullptr;  // [T, D] output of the last layer
    HeadBuffers head;
    // Backward. The residual gradient and attention's gradients span all tokens (attention's
    // backward needs all of them); the rest holds one chunk.
    bf16* dres = nullptr;                   // [T, D] d loss / d residual stream, which every branch adds into
    bf16 *dqkv = nullptr, *datt = nullptr;  // [T, qkv_dim], [T, Hq d]
    float* delta = nullptr;     // [B, Hq, S] rowsum(d out * out) (Ulysses: this GPU's heads)
    float* dq_accum = nullptr;  // --attention fused: the fp32 dQ sums of one attention call
    ChunkGradients chunk;
    Workspace work;
    float* scalars = nullptr;  // [0] loss sum, [1] grad sum of squares, [2] clip scale (watch.host_scalars: their copy)
    StepBatch batch;
    DeviceDocuments docs;
    double* inv_freq = nullptr;  // RoPE's frequencies [head_dim / 2]

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

// ---------------------------------------------------------------------------------------------
// The model and its step (llama.cu).
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
// The documents of a step (--doc-mask), in the flat [batch][seq] order of the sequences this
// GPU's attention sees: where each starts (every sequence's first token starts one; ascending)
// and the RoPE position of its first token (0, or where the window cut into it).
struct StepDocuments {
    std::vector<int64_t> start, first_position;
};
// Upload this step's tokens and targets (host arrays of shape.tokens(), this GPU's part), and with
// --doc-mask its documents. n_valid: targets != -1 over the whole step on all GPUs (the loss is
// their mean); -1: count here.
void model_set_batch(Model& m, const int32_t* tokens, const int32_t* targets, cudaStream_t s,
                     int64_t n_valid = -1, const StepDocuments* docs = nullptr);
// Forward and backward of one step. Returns nothing; the loss sum lands in m.scalars[0].
// progress (may be null) is called after each layer with (phase "forward"/"backward", layer index).
void model_forward_backward(Model& m, cudaStream_t s, ProgressFn progress = nullptr,
                            void* progress_ctx = nullptr);
// The forward and the loss alone (evaluation): per-token losses in m.head.losses, as a step's; no
// gradients (they are zeroed). Between steps only.
void model_forward_loss(Model& m, cudaStream_t s);
// Gradient clipping and AdamW over all parameters. Returns nothing (grad norm in scalars[1]).
void model_optimizer_step(Model& m, const AdamW& opt, float max_grad_norm, cudaStream_t s);
// FLOPs of one training step (forward + backward), for TFLOP/s and MFU. Model FLOPs: the
// recomputation of --ckpt is not counted (MFU's convention). attention_share: the share of causal
// attention's query-key pairs that the step's documents allow (1 without --doc-mask).
double model_step_flops(const LlamaConfig& cfg, const RunShape& shape, double attention_share = 1.0);
// That share for documents of these lengths in sequences of seq tokens (a document of n tokens:
// n^2 / 2 pairs, as causal attention's S^2 / 2).
double document_attention_share(const StepDocuments& docs, int64_t seq, int batch);
// The units (infra/common.h param_layout) in the order the step uses their weights.
std::vector<int> model_unit_order(const Model& m);
// This GPU's parameters as pieces of tensors (m.states.segments), from m.states.shards.
std::vector<ParamSegment> param_segments(const Model& m);
// The elements of a unit slot (the largest padded unit): bf16 weights or (--fsdp) fp32 gradients.
int64_t largest_unit_slot(const Model& m);

// The weights in use (llama.cu). Unit u's bf16 weights (m.w, m.w_piece) are readable on the compute
// stream from unit_begin(WEIGHTS) to unit_end; its gradient (m.g, m.g_piece) accumulates from
// unit_begin(GRADIENTS) to unit_end, and `last` marks the unit's last contribution of the step
// (the tied embedding gets two: the LM head and the lookup). A step uses the units in
// model_unit_order's order, from units_step_begin to units_step_end; a unit made ahead may be
// begun before its turn too (it ends once, in its turn).
enum UnitUse { WEIGHTS = 1, GRADIENTS = 2, WEIGHTS_AND_GRADIENTS = 3 };
void units_step_begin(Model& m, cudaStream_t s);
void unit_begin(Model& m, int u, int use, cudaStream_t s);
void unit_end(Model& m, int u, int use, cudaStream_t s, bool last = true);
void units_step_end(Model& m, cudaStream_t s);  // every unit used; their collectives done before the optimizer
// The unit whose weights the bf16 slot at `slot` holds or is being filled with; -1 if none (--sim-world).
int unit_in_weight_slot(const Model& m, const void* slot);
int64_t model_host_bytes(const Model& m);  // pinned host bytes of the step: offloaded activations
// Floats of one layer's lse: batch x this GPU's query heads (Ulysses: 1/N of them) x seq.
int64_t layer_lse_floats(const Model& m);

// The loops a layer and the head walk their tokens with: one chunk of all of them, or chunks of
// the plan's sizes (--chunked, chunked.cu). f(t0, t1) for each chunk [t0, t1) of
// m.plan.chunk_rows of this GPU's tokens; f(t0, n) for each chunk of m.plan.loss_rows tokens, n
// of them from t0 (the LM head's and the loss's).
void for_each_token_chunk(const Model& m, const std::function<void(int64_t t0, int64_t t1)>& f);
void for_each_loss_chunk(const Model& m, const std::function<void(int64_t t0, int64_t n)>& f);
// The pieces of a layer that the techniques call again. A per-token piece works on tokens
// [t0, t1) of this GPU; a layer walks its tokens in chunks (chunked.cu).
void attention_norm_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s);    // xn1 = norm(x_in)
// Qwen3 (cfg.qk_norm()): layer l's per-head RMSNorm of q and (k not null) k, in place on q_heads
// and kv_heads heads of each of n rows ldq and ldk apart; nothing for Llama. The backward's piece:
// one norm (P_Q_NORM or P_K_NORM) in place on the gradient, from the values before it (rows ld_raw apart).
void qk_norm_forward(Model& m, int l, bf16* q, int64_t ldq, int q_heads, bf16* k, int64_t ldk, int kv_heads, int64_t n,
                     cudaStream_t s);
void head_norm_backward(Model& m, ParamKind which, int l, bf16* dx, int64_t ld, const bf16* raw, int64_t ld_raw,
                        int heads, int64_t n, cudaStream_t s);
void attention_output_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s);  // x_mid = x_in + att Wo^T
void mlp_input_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s);         // xn2, h13, act
void block_output_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s);     // x_mid .. x_out of the chunk
// The head's pieces.
void final_norm_forward(Model& m, int64_t t0, int64_t n, cudaStream_t s);  // xnf, rstdf of tokens [t0, t0 + n)
// dres rows [t0, t0 + n) = d loss / d x_final from dxnf = d loss / d norm(x_final) of those rows.
void final_norm_backward(Model& m, int64_t t0, int64_t n, const bf16* dxnf, cudaStream_t s);
float loss_grad_scale(const Model& m);  // 1 / the step's count of valid targets (the loss is their mean)
ParamKind lm_head_kind(const Model& m);  // P_LM_HEAD, or P_EMBED with tied embeddings

// The attention sub-layer: att, lse from x_in (Ulysses and Untied Ulysses replace parts of it).
void attention_block_forward(Model& m, int l, cudaStream_t s);
void attention_block_backward(Model& m, int l, cudaStream_t s);  // dres += d loss / d x_in through it
void attention_inputs_forward(Model& m, int l, cudaStream_t s);  // q|k|v as the attention call reads them
AttentionShape attention_call_shape(const Model& m);            // one attention call (not Untied's)
// The heads one GPU's attention takes when sp GPUs share each sequence (Ulysses): q query and kv
// KV heads (kv = 1 with KV heads replicated when sp > Hkv); all of them when sp = 1.
struct AttentionHeads {
    int q, kv;
    int64_t width(int head_dim) const { return (int64_t)(q + 2 * kv) * head_dim; }
};
AttentionHeads attention_heads(const LlamaConfig& c, int sp);
// One attention call of layer l, marked on --timeline.
void layer_attention_forward(Model& m, int l, const AttentionForwardArgs& a, const AttentionShape& sh, cudaStream_t s);
void layer_attention_backward(Model& m, int l, const AttentionBackwardArgs& a, const AttentionShape& sh, cudaStream_t s);

// Plan queries, for the techniques that move activations: whether layer l's backward finds its
// attention output and lse kept from the forward (no rerun; selective checkpointing keeps them on
// the host, on the device, or in the staging slot, the last layer); whether layer l's block input
// goes to the host (under --offload; selective checkpointing rebuilds some instead); how many of
// layers 0 .. n-1 do.
inline bool attention_kept(const Model& m, int l) {
    const ActivationPlan& p = m.plan;
    if (p.att == Hold::ON_HOST) return l < p.att_host_layers || l >= m.cfg.n_layers - 1 - p.att_device_layers;
    return p.att == Hold::PER_LAYER;
}
inline bool block_input_on_host(const Model& m, int l) {
    return m.plan.x_in == Hold::ON_HOST && l < m.cfg.n_layers && !input_rebuilt(m.plan, l);
}
inline int block_inputs_on_host(const Model& m, int n) {
    return m.plan.x_in == Hold::ON_HOST ? n - inputs_rebuilt_below(m.plan, n) : 0;
}
// Whether attention outputs go to the host (--ckpt=selective with --offload: beyond/selective.cu).
inline bool attention_on_host(const Model& m) { return m.plan.att == Hold::ON_HOST; }

// ---------------------------------------------------------------------------------------------
// Stage 1 (fsdp.cu): fully sharded data parallel, --fsdp. Each GPU keeps one shard of every unit
// (a piece of the embedding, a layer, the final norm or a piece of the LM head: infra/common.h
// param_layout); the step gathers a unit's weights before its use and reduce-scatters its gradient.
std::vector<UnitShard> fsdp_shards(const ParamLayout& lay, int world, int rank);  // shard `rank` of every unit
void fsdp_declare_buffers(Model& m, Arena& A);  // the two unit gradient buffers (comm)
void fsdp_create(Model& m);
void fsdp_destroy(Model& m);
// Unit u's bf16 slot, this GPU's shard in its place, all-gathered in place on the communication stream.
void fsdp_gather(Model& m, bf16* slot, int u);
// Unit u's gradient accumulates in a unit buffer from fsdp_grad_begin; fsdp_reduce_scatter sums it
// over the GPUs, each adding its shard's sum to its gradient shard.
void fsdp_grad_begin(Model& m, int u, cudaStream_t s);
void fsdp_reduce_scatter(Model& m, int u, cudaStream_t s);
// Unit u of a parameter-sized array (master weights, gradients), whole, on the host: gathered
// from the shards under --fsdp (a collective: every rank calls it).
std::vector<float> fsdp_gather_unit(Model& m, const float* local, int u, cudaStream_t s);
// Every gradient, whole, on the host: for tests and --dump.
std::vector<float> fsdp_full_gradients(Model& m, cudaStream_t s);

// ---------------------------------------------------------------------------------------------
// Stage 2 (ulysses.cu): DeepSpeed Ulysses, --ulysses. Attention over the whole sequence with a
// 1/sp share of the heads (attention_heads).
// Rejects shapes Ulysses cannot split, with a message naming what does not divide.
void ulysses_check(const LlamaConfig& c, const RunShape& shape);
void ulysses_plan(Model& m);
void ulysses_declare_buffers(Model& m, Arena& A);
AttentionShape ulysses_attention_shape(const Model& m);  // one attention call: S tokens, this GPU's heads
bf16* ulysses_token_qkv(const Model& m);   // where the projection writes q|k|v of this GPU's tokens
bf16* ulysses_token_dqkv(const Model& m);  // where the backward finds d q|k|v of this GPU's tokens
void ulysses_qkv_to_heads(Model& m, int l, cudaStream_t s);  // token-sharded q|k|v -> the layer's qkv
// The attention call on this GPU's heads, then the output back to this GPU's tokens (a.att).
void ulysses_attention_forward(Model& m, int l, cudaStream_t s);
// d att to this GPU's heads, the attention backward, d q|k|v back to its tokens (ulysses_token_dqkv).
void ulysses_attention_backward(Model& m, int l, cudaStream_t s);

// Stage 6 (ulysses.cu): Untied Ulysses, --untied[=K]. The attention sub-block in chunks of K
// query heads. Rejects K that do not fit the heads.
void untied_check(const LlamaConfig& c, const RunShape& shape, int K);
void untied_plan(Model& m);
void untied_declare_buffers(Model& m, Arena& A);
AttentionShape untied_attention_shape(const Model& m);  // one attention call: one head chunk
// The attention sub-block of layer l: forward fills att and lse from x_in; backward (d loss /
// d x_mid in m.dres) adds d loss / d x_in into m.dres and the projections' gradients.
void untied_attention_forward(Model& m, int l, cudaStream_t s);
void untied_attention_backward(Model& m, int l, cudaStream_t s);
// What stage 7 takes part of: the head chunks, chunk i's d out and its delta, the staging.
int untied_chunks(const Model& m);
void untied_chunk_dout(Model& m, int l, int i, cudaStream_t s);
void untied_chunk_deltas(Model& m, int l, int i, cudaStream_t s);
bf16* untied_staging(const Model& m);

// ---------------------------------------------------------------------------------------------
// Stage 3 (offload.cu): activation checkpointing, --ckpt.
void checkpointing_plan(Model& m);
// Backward, before layer l's: the attention sub-layer's forward again where its output was not
// kept, or q|k|v alone where they were not.
void recompute_attention(Model& m, int l, cudaStream_t s);

// Stage 4 (offload.cu): the block inputs in pinned host memory, --offload.
void offload_plan(Model& m);
int64_t offload_host_bytes(const Model& m);  // pinned host bytes of the block inputs (0 without --offload)
void offload_create(Model& m);    // pinned buffers (once), copy stream, events
void offload_destroy(Model& m);
// Where the step calls it.
void offload_step_begin(Model& m, cudaStream_t s);
void offload_save_block_input(Model& m, int l, cudaStream_t s);      // layer l's x_in is complete: copy it out
void offload_before_layer_output(Model& m, int l, cudaStream_t s);   // the slot of layer l's x_out holds no
                                                                     // input still on its way to the host;
                                                                     // it takes layer l+1's input
void offload_before_layer_backward(Model& m, int l, cudaStream_t s);  // l's x_in in its slot, l-1's on its way
// A copy on the copy stream, once the compute stream has reached this point, marked on --timeline.
void offload_copy(Model& m, void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind, const char* what,
                  int layer, cudaStream_t s);
cudaStream_t offload_copy_stream(const Model& m);
void offload_fetch_input(Model& m, int l, cudaStream_t s);  // layer l's input from the host into its slot
void offload_input_written(Model& m, int l);                // layer l's input is in its slot (written there)

// ---------------------------------------------------------------------------------------------
// Stage 5 (chunked.cu): chunked sequence training, --chunked. The plan's chunk sizes, which the
// loops of the layer and the head walk (for_each_token_chunk, for_each_loss_chunk).
void chunked_plan(Model& m);

// ---------------------------------------------------------------------------------------------
// Stage 7 (beyond/savings.cu): our memory savings, beyond the talk.
void savings_plan(Model& m);
void savings_declare_buffers(Model& m, Arena& A);
bool untied_grad_in_att_output(const Model& m);  // --grad-in-att-output, where the output is wide enough
// --dq-sums-in-staging: bf16 values Untied's staging needs to hold the fused backward's dQ sums (0: none).
int64_t dq_sums_staging_bf16s(const Model& m);
// --grad-in-att-output: every head chunk's delta of layer l; returns the attention output's memory,
// free now for the normalized input's gradient.
bf16* deltas_first_in_att_output(Model& m, int l, cudaStream_t s);
// --vocab-pieces: the LM head and loss (backward: and their backward), one piece at a time; the
// units it uses, in order.
void lm_head_in_pieces(Model& m, bool backward, cudaStream_t s);
void lm_head_pieces_order(const Model& m, std::vector<int>& order);

// Selective checkpointing within a host budget (beyond/selective.cu): --ckpt=selective.
void selective_plan(Model& m);
int64_t selective_host_bytes(const Model& m);       // pinned host bytes of the attention outputs kept there
int64_t selective_attention_bytes(const Model& m);  // one layer's attention output and lse
// The layers whose attention outputs fit in `room_bytes` of the device beyond the plan (at most --device-keep-gib).
int selective_device_layers(const Model& m, double room_bytes);
std::string selective_plan_text(const Model& m);  // which layers keep their attention output where
void selective_declare_buffers(Model& m, Arena& A);  // the device's own slots of attention outputs
void selective_create(Model& m);  // pinned host memory of the attention outputs (once), events
void selective_destroy(Model& m);
// Where the step calls it, with --offload (attention_on_host).
void selective_before_attention(Model& m, int l, cudaStream_t s);   // the attention output's staging slot is free
void selective_after_attention(Model& m, int l, cudaStream_t s);    // att, lse to the host
void selective_before_layer_backward(Model& m, int l, cudaStream_t s);  // att, lse back; a rebuilt input
