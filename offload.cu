// offload.cu - activation checkpointing (--ckpt, ladder stage 3), then CPU offload of its
// checkpoints (--offload, stage 4): one section of the talk, at 07:48.
//
// Stage 3, activation checkpointing. A plain step keeps every activation of every layer from the
// forward until that layer's backward. With --ckpt a layer keeps only its input x_in (the
// residual stream entering the block). Its backward first recomputes the layer's forward from
// x_in (norm, QKV, RoPE, attention, Wo, MLP), then runs the backward on it. The recomputed
// activations go into one set of buffers, which every layer reuses in turn.
//
//   kept per token and layer (bytes)  plain                         --ckpt
//     "other"                         2 (4D + 3F) + 8               2 D
//     "attention"                     2 (qkv_dim + Hq d) + 4 Hq     0
//   Llama 3.1 8B:                     139,400                       8,192
// plus one layer's worth of the buffers that are recomputed (not multiplied by L).
// Cost: one more forward of every layer (about a third more compute: forward 1, backward 2).
//
//   kept per layer      x_in
//   recomputed          xn1 (attention norm), q|k|v, att and lse, x_mid, xn2, h13, act (the
//                       MLP's inputs)
// --chunked (chunked.cu) also drops the MLP's inputs (it keeps one chunk of them), and Untied
// Ulysses implies --ckpt. Where the step reads them (llama.cu): before layer l's backward,
// recompute_attention (below) reruns the attention sub-layer; then each token chunk's backward
// first rebuilds the chunk's x_mid, xn2, h13, act and xn1, where the plan says they were not kept.
//
// Stage 4, CPU offload of the block inputs. Checkpointing's inputs still grow with the depth:
// (L + 1) x T x 2D bytes. With --offload (which implies --ckpt) each goes to pinned host memory
// as soon as it is complete, on a copy stream beside the compute, and comes back for the
// layer's backward. The device keeps two slots, used in turn: layer l reads its input from slot
// l % 2 and writes its output, layer l+1's input, into the other.
//   forward:  layer l's input is copied out while the layer runs; before its MLP writes the
//             output over slot (l+1) % 2, that slot's previous input (layer l-1's) is on the host;
//   backward: layer l's input is in its slot (the last layer's never left; the others were
//             fetched ahead), and layer l-1's comes back into the other slot while layer l's
//             backward runs, once the layer above (or the head) is done with that slot.
// Events order the compute and copy streams; nothing synchronizes the device. Pinned memory is
// allocated once, since pinning is slow (docs/reference.md), and reused by every step.
//
//   device: (L + 1) T 2D -> 2 T 2D   (8B at 3M on 8 GPUs, T = 393216: 99 GiB -> 6 GiB)
//   host:   L T 2D                    (96 GiB)
// Cost: copies hidden behind compute. A layer's input is 2 D bytes per token (8 KiB for 8B): at a
// pinned copy's 55 GB/s (docs/reference.md) 0.15 us per token, against about 3.3 us per token of
// the layer's GEMMs alone (6 FLOPs x 218 M parameters at 400 TFLOP/s), before attention.
//
// The slots and the inputs on the host are what the plan says (x_slots, block_input_on_host):
// stage 7 may plan one slot, and selective checkpointing leave some inputs off the host (beyond/).
#include "llama.h"

// =============================================================================================
// Stage 3: activation checkpointing.
void checkpointing_plan(Model& m) {
    if (!m.opt.ckpt) return;
    ActivationPlan& p = m.plan;
    p.qkv = p.att = p.x_mid = p.norms_mlp = Hold::RECOMPUTED;
}

// Before layer l's backward: the attention sub-layer's forward again, from x_in, where the plan
// kept no output (its backward reads q, k, v, the output and its lse); where it kept the output
// but not q|k|v, those alone.
void recompute_attention(Model& m, int l, cudaStream_t s) {
    TimelineMark mark(m, s, "compute", "attention rerun", l);
    if (!attention_kept(m, l)) attention_block_forward(m, l, s);
    else if (m.plan.qkv == Hold::RECOMPUTED) attention_inputs_forward(m, l, s);
}

// =============================================================================================
// Stage 4: the checkpoints in pinned host memory.
struct Offload {
    bf16* host_x = nullptr;  // the block inputs on the host, layer by layer
    cudaStream_t copy = nullptr;
    cudaEvent_t compute_mark = nullptr;              // recorded on the compute stream before each copy
    cudaEvent_t copied_out[2] = {nullptr, nullptr};  // the input a slot holds is on the host
    cudaEvent_t fetched = nullptr;                   // the last input fetched is in its slot
    cudaEvent_t copy_idle = nullptr;
    int slot_input[2] = {-1, -1};                    // the layer whose input each slot holds now
};

static int64_t block_input_elements(const Model& m) { return m.shape.tokens() * m.cfg.dim; }
static int slot_of(const Model& m, int l) { return l % m.plan.x_slots; }
static bf16* host_input(Model& m, int l) {
    return m.offload->host_x + block_inputs_on_host(m, l) * block_input_elements(m);
}

void offload_plan(Model& m) {
    if (!m.opt.offload) return;
    m.plan.x_in = Hold::ON_HOST, m.plan.x_slots = 2;
}

int64_t offload_host_bytes(const Model& m) {
    if (m.plan.x_in != Hold::ON_HOST) return 0;
    return block_inputs_on_host(m, m.cfg.n_layers) * block_input_elements(m) * 2;
}

void offload_create(Model& m) {
    if (!m.pin_host) return;  // a run of no steps plans the pinned memory only
    Offload* o = m.offload = new Offload();
    const int64_t bytes = offload_host_bytes(m);
    if (bytes > 0 && cudaHostAlloc((void**)&o->host_x, bytes, cudaHostAllocDefault) != cudaSuccess) {
        cudaGetLastError();
        throw Fatal(EXIT_OOM, "out of memory: pinned host memory for the offloaded block inputs (" +
                                  std::to_string(bytes / GiB) + " GiB) could not be allocated");
    }
    CUDA_CHECK(cudaStreamCreateWithFlags(&o->copy, cudaStreamNonBlocking));
    for (cudaEvent_t* e : {&o->compute_mark, &o->copied_out[0], &o->copied_out[1], &o->fetched, &o->copy_idle})
        CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
}

void offload_destroy(Model& m) {
    Offload* o = m.offload;
    if (!o) return;
    cudaStreamSynchronize(o->copy);
    cudaFreeHost(o->host_x);
    for (cudaEvent_t e : {o->compute_mark, o->copied_out[0], o->copied_out[1], o->fetched, o->copy_idle})
        cudaEventDestroy(e);
    cudaStreamDestroy(o->copy);
    delete o;
    m.offload = nullptr;
}

void offload_copy(Model& m, void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind, const char* what,
                  int layer, cudaStream_t s) {
    Offload& o = *m.offload;
    CUDA_CHECK(cudaEventRecord(o.compute_mark, s));
    CUDA_CHECK(cudaStreamWaitEvent(o.copy, o.compute_mark, 0));
    TimelineMark mark(m, o.copy, "copy", what, layer, bytes);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, o.copy));
}

cudaStream_t offload_copy_stream(const Model& m) { return m.offload->copy; }

void offload_step_begin(Model& m, cudaStream_t s) {
    if (!m.offload)  // --steps 0 plans the pinned memory without allocating it
        runtime_error("--offload without its pinned host memory: this run was set up to take no steps");
    Offload& o = *m.offload;
    // The previous step's copies are done before this step reuses the slots.
    CUDA_CHECK(cudaEventRecord(o.copy_idle, o.copy));
    CUDA_CHECK(cudaStreamWaitEvent(s, o.copy_idle, 0));
    o.slot_input[0] = o.slot_input[1] = -1;
}

void offload_input_written(Model& m, int l) { m.offload->slot_input[slot_of(m, l)] = l; }

// Layer l's input is complete (the embedding's output, or layer l-1's): copy it out.
void offload_save_block_input(Model& m, int l, cudaStream_t s) {
    offload_input_written(m, l);
    if (!block_input_on_host(m, l)) return;
    const int64_t bytes = block_input_elements(m) * 2;
    offload_copy(m, host_input(m, l), m.layers[l].x_in, bytes, cudaMemcpyDeviceToHost, "x_in to host", l, s);
    CUDA_CHECK(cudaEventRecord(m.offload->copied_out[slot_of(m, l)], m.offload->copy));
}

// Before layer l's MLP writes its output, layer l+1's input (l+1 = L: the head's), over the slot
// that held layer l-1's (or with one slot, layer l's own): that input is on the host.
void offload_before_layer_output(Model& m, int l, cudaStream_t s) {
    CUDA_CHECK(cudaStreamWaitEvent(s, m.offload->copied_out[slot_of(m, l + 1)], 0));
    offload_input_written(m, l + 1);
}

void offload_fetch_input(Model& m, int l, cudaStream_t s) {
    const int64_t bytes = block_input_elements(m) * 2;
    offload_copy(m, m.layers[l].x_in, host_input(m, l), bytes, cudaMemcpyHostToDevice, "x_in to device", l, s);
    CUDA_CHECK(cudaEventRecord(m.offload->fetched, m.offload->copy));
    offload_input_written(m, l);
}

void offload_before_layer_backward(Model& m, int l, cudaStream_t s) {
    Offload& o = *m.offload;
    if (o.slot_input[slot_of(m, l)] != l) offload_fetch_input(m, l, s);  // not fetched ahead
    CUDA_CHECK(cudaStreamWaitEvent(s, o.fetched, 0));
    // Layer l-1's input into the other slot while layer l's backward runs.
    const int k = l - 1;
    if (k >= 0 && slot_of(m, k) != slot_of(m, l) && o.slot_input[slot_of(m, k)] != k && block_input_on_host(m, k))
        offload_fetch_input(m, k, s);
}
