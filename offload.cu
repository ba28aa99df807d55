// offload.cu - CPU offload of the kept activations (--offload, ladder stage 4; the talk at
// 07:48, with activation checkpointing, checkpointing.cu).
//
// Under --ckpt (which --offload implies) each layer keeps only its block input x_in, and under
// --ckpt=selective also its attention output and lse: for as many layers as the pinned host
// memory that --host-mem-gib allows per GPU holds after the block inputs, then for as many more
// as the device has room for under the cap; the other layers rerun attention in the backward.
// Everything else is recomputed. The kept tensors still grow with the depth: L x T x 2D bytes of
// block inputs. With --offload they go to pinned host memory as soon as they are produced, on a
// copy stream, and come back for the layer's backward. The device keeps one staging slot for
// them (=selective's layers kept on the device have slots of their own):
//   forward:  layer l reads its input from the slot while the copy of that input to the host
//             runs beside its attention; its MLP then writes the layer's output over the input,
//             chunk by chunk (the output's rows t0..t1 need only the input's rows t0..t1), after
//             that copy is done. The last layer's output, the head's input, ends in the slot too,
//             so every layer's input goes to the host, the last one included (but rebuilt ones);
//   backward: layer l's kept tensors are copied into the slot once layer l+1 is done with it.
// Rebuilt inputs (=selective, within --host-mem-gib): when the host holds every block input but
// not every attention output, leaving inputs off the host makes room for more attention outputs
// (2 D against 2 Hq d + 4 Hq bytes per token: about one for one in Llama). Layer l's input is
// layer l-1's output, x_in + att Wo^T + MLP(...), so where layer l-1 keeps both its input and its
// attention output, layer l's backward rebuilds its input from them: Wo and the MLP of layer l-1
// once more, where a layer without its attention output reruns attention, about 100 times the
// work at 5M. The plan leaves off the inputs of layers 1, 3, .., 2n-1, as few as keep the most
// attention outputs (--rebuild-inputs bounds n; 0: none). The rebuild runs the forward's kernels
// on the forward's inputs, so the step is the same bit for bit.
// Ordering is by CUDA events between the compute stream and the copy stream only; nothing
// synchronizes the device. Pinned memory is allocated once, since pinning is slow
// (docs/reference.md), and reused by every step.
//
// Memory per GPU, for T local tokens and L layers (bytes):
//   device: (L + 1) T 2D -> T 2D  (the residual stream: every layer's input and the last
//           output; =selective: and L T (2 Hq d + 4 Hq) -> one slot of T (2 Hq d + 4 Hq))
//           [+ D T (2 Hq d + 4 Hq)]  (=selective: D more layers' attention outputs kept on the
//           device, as many as the room the plan leaves under the cap holds, less 1 GiB)
//   host:   (L - n) T 2 D [+ K T (2 Hq d + 4 Hq)]  (=selective: K layers' attention outputs, as
//           many as --host-mem-gib holds, at most L - 1: the last layer's stays in its slot; n
//           inputs rebuilt; 8B at 3M on 8 GPUs: 96 + 94.5 GiB, all layers; at 5M with every input:
//           160 GiB leave 80 for 15 layers, and the 80 GiB cap has room for D = 5 more on the
//           device, layers 26-30; with n = 11 inputs rebuilt: 105 + 132 GiB for K = 26, and all
//           32 layers keep theirs)
// Cost: host-device traffic. In the forward it hides: a layer's input is 2 D bytes per token (8
// KiB for 8B), at a pinned copy's bandwidth (about 55 GB/s, docs/reference.md) 0.15 us per
// token, against about 3.3 us per token of the layer's GEMMs alone (6 FLOPs x 218 M parameters,
// at 400 TFLOP/s), before attention, which grows with the context. In the backward the copy back
// waits for the slot: 0.15 us per token and layer (=selective: about twice that) are exposed,
// under 0.2% of a layer's backward at 1M tokens and beyond, where attention dominates; a second
// slot would hide it for T 2D bytes more. A rebuilt input costs layer l-1's Wo and MLP forward,
// 2 T D (Hq d + 3 F) FLOPs (8B at 5M: 0.9% of a rerun of attention's), and one more fetch of
// layer l-1's attention output, exposed (layer l-1's input is fetched in place of layer l's).
//
// Where --offload changes the step:
//   offload_plan                  x_in (and a kept att, lse) move to the host, one device slot;
//                                 =selective: how many inputs are rebuilt (x_rebuilt_layers),
//                                 how many layers' att fit (att_host_layers), and how many more
//                                 keep theirs on the device (att_device_layers)
//   train.cpp device_attention_room  the room under the cap (--device-keep-gib bounds it); every
//                                 rank keeps the same layers (a rerun takes part in all-to-alls)
//   llama.cu declare_activations  the device-kept layers' own att, lse slots (offload_device_slot)
//   checkpointing.cu attention_kept   the other layers rerun attention in the backward
//   llama.cu model_allocate       offload_create: the pinned host buffers and the copy stream
//   llama.cu model_forward_backward
//                                 offload_save_block_input after the embedding;
//                                 offload_before/after_layer_forward around each layer;
//                                 offload_before_layer_backward before each layer's backward
//                                 (a rebuilt input: block_output_forward of the layer below, its
//                                 weights from fsdp_wait_gathered)
//   llama.cu layer_forward        offload_after_attention_forward: att, lse out (=selective);
//                                 the MLP's output may overwrite the input
//   llama.cu slot                 every layer's staging slot is the one slot (Hold::ON_HOST),
//                                 but for the layers kept on the device
//   llama.cu model_free           offload_destroy; model_memory_trace counts the host bytes
//   train.cpp                     --offload implies --ckpt; the plan prints the host bytes
// --timeline (timeline.cu) records each copy on the copy stream.
#include <algorithm>

#include "llama.h"

struct Offload {
    bf16* host_x = nullptr;     // [L - n, T, D] block inputs of every layer but the n rebuilt ones
    bf16* host_att = nullptr;   // [K, T, Hq d] attention outputs of the first K = att_host_layers (selective)
    float* host_lse = nullptr;  // [K, B Hq S]
    int64_t host_bytes = 0;
    cudaStream_t copy = nullptr;
    cudaEvent_t compute_mark = nullptr;    // recorded on the compute stream before each copy
    cudaEvent_t x_copied_out = nullptr;    // the slot's block input is on the host
    cudaEvent_t att_copied_out = nullptr;  // the slot's attention output and lse are on the host
    cudaEvent_t fetched = nullptr;         // the slot holds the layer's kept tensors again
    cudaEvent_t copy_idle = nullptr;
};

static int64_t tokens(const Model& m) { return m.shape.tokens(); }
static int64_t block_input_bytes(const Model& m) { return tokens(m) * m.cfg.dim * 2; }
static int64_t attention_bytes(const Model& m) { return tokens(m) * m.cfg.q_dim() * 2 + layer_lse_floats(m) * 4; }

// A rebuilt input: layer l-1's Wo and MLP forward. A rerun: one layer's attention forward.
static double rebuild_flops(const Model& m) {
    const LlamaConfig& c = m.cfg;
    return 2.0 * tokens(m) * c.dim * (c.q_dim() + 3.0 * c.ffn_dim);
}
static double rerun_flops(const Model& m) {
    const LlamaConfig& c = m.cfg;
    return attention_forward_flops({m.shape.batch, m.shape.seq, c.n_heads / m.shape.sp, c.n_kv_heads, c.head_dim});
}

void offload_plan(Model& m) {
    if (!m.opt.offload) return;
    m.plan.x_in = Hold::ON_HOST;
    if (m.plan.att != Hold::PER_LAYER) return;
    // --ckpt=selective: the attention outputs of as many layers as the pinned host memory left
    // by the block inputs holds (--host-mem-gib); the last layer's stays in its slot anyway.
    m.plan.att = Hold::ON_HOST;
    const int L = m.cfg.n_layers;
    // With n block inputs rebuilt (layers 1, 3, .., 2n - 1), the host holds L - n inputs and the
    // attention outputs of as many layers as the rest of the budget holds, at most L - 1.
    auto host_layers = [&](int n) {
        const int64_t left = (int64_t)(m.opt.host_mem_gib * GiB) - (L - n) * block_input_bytes(m);
        return (int)std::clamp<int64_t>(left / attention_bytes(m), 0, std::max(0, L - 1));
    };
    // Of the layers left to rerun attention, the last ones keep theirs on the device instead, as
    // many as the memory under the cap holds beyond the plan (train.cpp measures that room and sets
    // device_attention_layers; --device-keep-gib bounds it).
    auto device_layers = [&](int K) { return std::clamp(m.device_attention_layers, 0, std::max(0, L - 1 - K)); };
    auto kept = [&](int n) { return host_layers(n) + device_layers(host_layers(n)); };
    // Rebuild as few inputs as keep the most attention outputs. Layer l's input is rebuilt from
    // layer l-1's input and attention output, so layer l-1 keeps both on the host (2n - 2 < K);
    // the last layer's input is where the head's input was, never rebuilt (2n - 1 <= L - 2). By
    // default only where a rebuild (Wo and the MLP) costs less than the attention rerun it
    // saves: at long context (8B: beyond about 47K tokens), not at short.
    const int most = m.opt.rebuild_inputs >= 0 ? std::min(m.opt.rebuild_inputs, (L - 1) / 2)
                     : rebuild_flops(m) < rerun_flops(m) ? (L - 1) / 2
                                                         : 0;
    int n = 0;
    for (int c = 1; c <= most; c++)
        if (2 * c - 2 < host_layers(c) && kept(c) > kept(n)) n = c;
    m.plan.x_rebuilt_layers = n;
    m.plan.att_host_layers = host_layers(n);
    m.plan.att_device_layers = device_layers(m.plan.att_host_layers);
}

bool offload_input_rebuilt(const Model& m, int l) {
    return m.plan.x_in == Hold::ON_HOST && l % 2 == 1 && l < 2 * m.plan.x_rebuilt_layers;
}

// The block inputs on the host among layers 0 .. n-1 (the rebuilt ones are not there).
int offload_host_inputs(const Model& m, int n) {
    return n - std::clamp(n / 2, 0, m.plan.x_rebuilt_layers);
}

int64_t offload_attention_bytes(const Model& m) { return attention_bytes(m); }

// The layers kept on the device are the ones just before the last: L-1-D .. L-2.
int offload_device_slot(const Model& m, int l) {
    const int first = m.cfg.n_layers - 1 - m.plan.att_device_layers;
    return m.plan.att == Hold::ON_HOST && l >= first && l < m.cfg.n_layers - 1 ? l - first : -1;
}

static bool attention_on_host(const Model& m) { return m.plan.att == Hold::ON_HOST; }

// Layers whose attention output goes to the host: the first att_host_layers.
static int64_t host_attention_layers(const Model& m) {
    return attention_on_host(m) ? m.plan.att_host_layers : 0;
}

int64_t offload_host_bytes(const Model& m) {
    if (m.plan.x_in != Hold::ON_HOST) return 0;
    return offload_host_inputs(m, m.cfg.n_layers) * block_input_bytes(m) + host_attention_layers(m) * attention_bytes(m);
}
void offload_create(Model& m) {
    if (m.plan.x_in != Hold::ON_HOST) return;
    Offload* o = new Offload();
    m.offload = o;
    const int64_t T = tokens(m), kept_att = host_attention_layers(m);
    o->host_bytes = offload_host_bytes(m);
    auto pin = [&](void** p, int64_t bytes, const char* what) {
        if (bytes == 0) return;
        if (cudaHostAlloc(p, bytes, cudaHostAllocDefault) != cudaSuccess) {
            cudaGetLastError();
            throw Fatal(EXIT_OOM, "out of memory: pinned host memory for the offloaded " + std::string(what) + " (" +
                                      std::to_string(bytes / GiB) + " GiB; all offloaded tensors need " +
                                      std::to_string(o->host_bytes / GiB) + " GiB) could not be allocated");
        }
    };
    pin((void**)&o->host_x, offload_host_inputs(m, m.cfg.n_layers) * T * m.cfg.dim * 2, "block inputs");
    pin((void**)&o->host_att, kept_att * T * m.cfg.q_dim() * 2, "attention outputs");
    pin((void**)&o->host_lse, kept_att * layer_lse_floats(m) * 4, "attention lse");
    CUDA_CHECK(cudaStreamCreateWithFlags(&o->copy, cudaStreamNonBlocking));
    auto event = [](cudaEvent_t* e) { CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming)); };
    event(&o->compute_mark);
    event(&o->copy_idle);
    event(&o->x_copied_out), event(&o->att_copied_out), event(&o->fetched);
}

void offload_destroy(Model& m) {
    Offload* o = m.offload;
    if (!o) return;
    cudaStreamSynchronize(o->copy);
    cudaFreeHost(o->host_x), cudaFreeHost(o->host_att), cudaFreeHost(o->host_lse);
    cudaEventDestroy(o->compute_mark), cudaEventDestroy(o->copy_idle);
    cudaEventDestroy(o->x_copied_out), cudaEventDestroy(o->att_copied_out), cudaEventDestroy(o->fetched);
    cudaStreamDestroy(o->copy);
    delete o;
    m.offload = nullptr;
}

// Copy on the copy stream once the compute stream has reached this point.
static void copy_after_compute(Model& m, void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind,
                               const char* what, int layer, cudaStream_t compute) {
    Offload& o = *m.offload;
    CUDA_CHECK(cudaEventRecord(o.compute_mark, compute));
    CUDA_CHECK(cudaStreamWaitEvent(o.copy, o.compute_mark, 0));
    int begin = timeline_begin(m, o.copy);
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, o.copy));
    timeline_end(m, begin, "copy", what, layer, o.copy, bytes);
}

// Layer l's block input on the host.
static bf16* host_input(Model& m, int l) {
    return m.offload->host_x + offload_host_inputs(m, l) * tokens(m) * m.cfg.dim;
}

// Copy layer p's kept tensors into the staging slot, once the compute stream is here (the last
// layer's attention output never left it; a rebuilt input never went; a rebuild reads no lse).
static void fetch_layer(Model& m, int p, cudaStream_t s, bool input = true, bool lse = true) {
    Offload& o = *m.offload;
    const int64_t n = tokens(m) * m.cfg.dim;
    if (input) copy_after_compute(m, m.layers[p].x_in, host_input(m, p), n * 2, cudaMemcpyHostToDevice, "x_in to device", p, s);
    if (p < host_attention_layers(m)) {
        const int64_t na = tokens(m) * m.cfg.q_dim(), nl = layer_lse_floats(m);
        copy_after_compute(m, m.layers[p].att, o.host_att + p * na, na * 2, cudaMemcpyHostToDevice, "att to device", p, s);
        if (lse) copy_after_compute(m, m.layers[p].lse, o.host_lse + p * nl, nl * 4, cudaMemcpyHostToDevice, "lse to device", p, s);
    }
    CUDA_CHECK(cudaEventRecord(o.fetched, o.copy));
}

void offload_step_begin(Model& m, cudaStream_t s) {
    if (m.plan.x_in != Hold::ON_HOST) return;
    if (!m.offload)  // --steps 0 plans the pinned memory without allocating it
        runtime_error("--offload without its pinned host memory: this run was set up to take no steps");
    Offload& o = *m.offload;
    // The previous step's copies are done before this step reuses the slots.
    CUDA_CHECK(cudaEventRecord(o.copy_idle, o.copy));
    CUDA_CHECK(cudaStreamWaitEvent(s, o.copy_idle, 0));
}

void offload_save_block_input(Model& m, int l, cudaStream_t s) {
    if (!m.offload || l >= m.cfg.n_layers) return;  // the last layer's output is the head's input
    if (offload_input_rebuilt(m, l)) return;        // rebuilt in the backward instead
    Offload& o = *m.offload;
    const int64_t n = tokens(m) * m.cfg.dim;
    copy_after_compute(m, host_input(m, l), m.layers[l].x_in, n * 2, cudaMemcpyDeviceToHost, "x_in to host", l, s);
    CUDA_CHECK(cudaEventRecord(o.x_copied_out, o.copy));
}

void offload_before_layer_forward(Model& m, int l, cudaStream_t s) {
    if (!m.offload) return;
    Offload& o = *m.offload;
    // Layer l's attention output goes into the slot that held layer l-1's.
    if (attention_on_host(m) && l >= 1) CUDA_CHECK(cudaStreamWaitEvent(s, o.att_copied_out, 0));
}

void offload_after_attention_forward(Model& m, int l, cudaStream_t s) {
    if (!m.offload) return;
    Offload& o = *m.offload;
    if (l < host_attention_layers(m)) {
        const int64_t n = tokens(m) * m.cfg.q_dim(), nl = layer_lse_floats(m);
        copy_after_compute(m, o.host_att + l * n, m.layers[l].att, n * 2, cudaMemcpyDeviceToHost, "att to host", l, s);
        copy_after_compute(m, o.host_lse + l * nl, m.layers[l].lse, nl * 4, cudaMemcpyDeviceToHost, "lse to host", l, s);
        CUDA_CHECK(cudaEventRecord(o.att_copied_out, o.copy));
    }
    // The MLP writes the layer's output over its input: the input must be on the host first.
    CUDA_CHECK(cudaStreamWaitEvent(s, o.x_copied_out, 0));
}

void offload_after_layer_forward(Model& m, int l, cudaStream_t s) {
    if (m.offload) offload_save_block_input(m, l + 1, s);  // layer l's output is layer l+1's input
}

void offload_before_layer_backward(Model& m, int l, cudaStream_t s) {
    if (!m.offload) return;
    Offload& o = *m.offload;
    if (offload_input_rebuilt(m, l)) {
        // Layer l's input is layer l-1's output: layer l-1's input and attention output into the
        // slots, the rest of its block again (Wo, the MLP; as in the forward, so the same bits),
        // then layer l's attention output over layer l-1's.
        fetch_layer(m, l - 1, s, true, false);
        CUDA_CHECK(cudaStreamWaitEvent(s, o.fetched, 0));
        fsdp_wait_gathered(m, m.layout.layer_unit(l - 1), s);
        int mark = timeline_begin(m, s);
        block_output_forward(m, l - 1, s);
        timeline_end(m, mark, "compute", "input rebuild", l, s);
        fetch_layer(m, l, s, false);
    } else {
        fetch_layer(m, l, s);  // the slot is free: layer l+1 (or the head) is done with it
    }
    CUDA_CHECK(cudaStreamWaitEvent(s, o.fetched, 0));
}
