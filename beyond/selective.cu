// beyond/selective.cu - selective checkpointing within a host budget (--ckpt=selective; beyond
// the talk, a flag of its own beside stage 7).
//
// Full checkpointing (offload.cu, stage 3) keeps only each layer's block input and reruns the whole
// layer's forward in the backward, attention included. At long context attention is most of a
// layer's compute (forward 1 unit, backward 2.5 units), so its rerun is close to a fifth of the
// step. --ckpt=selective also keeps each layer's attention output and log-sum-exp, 2 Hq d + 4 Hq
// bytes per token and layer, so the backward reruns only q|k|v (what attention's backward reads
// besides the output), not attention.
//
// Without --offload the outputs stay on the device, a slot per layer. With --offload they go to
// pinned host memory on offload.cu's copy stream, as many layers' as --host-mem-gib allows after
// the block inputs, and come back into one staging slot for the layer's backward; then the device
// keeps as many more in slots of its own as the room under the cap holds (less 1 GiB;
// --device-keep-gib bounds it; infra/plan.cpp measures the room); the last layer's stays in the staging
// slot; the other layers rerun attention.
//
// Rebuilt inputs: where the host holds every block input but not every attention output, leaving
// inputs off the host makes room for more attention outputs (2 D against 2 Hq d + 4 Hq bytes per
// token: about one for one in Llama). Layer l's input is layer l-1's output, x_in + att Wo^T +
// MLP(...), so where layer l-1 keeps both its input and its attention output, layer l's backward
// rebuilds its input from them: Wo and the MLP of layer l-1 once more, where a layer without its
// attention output reruns attention, about 100 times the work at 5M. The plan leaves off the
// inputs of layers 1, 3, .., 2n-1, as few as keep the most attention outputs (--rebuild-inputs
// bounds n; 0: none), and only where a rebuild costs less than the rerun it saves (8B: from about
// 47K tokens). The rebuild runs the forward's kernels on the forward's inputs, so the step is the
// same bit for bit.
//
// Memory per GPU, for T local tokens and L layers (bytes):
//   without --offload: device + L T (2 Hq d + 4 Hq)
//   with --offload:    host + K T (2 Hq d + 4 Hq) - n T 2 D   (K layers' outputs, at most L - 1, n
//                      inputs rebuilt); device + T (2 Hq d + 4 Hq) (the staging slot)
//                      + D T (2 Hq d + 4 Hq) (D more layers kept on the device)
// Cost: the outputs' copies. Each host layer's output and lse come back exposed before its
// backward, about twice a block input's copy (0.15 us per token and layer for 8B): under 0.2% of
// a layer's backward from 1M tokens. A rebuilt input costs layer l-1's Wo and MLP forward, 2 T D
// (Hq d + 3 F) FLOPs (8B at 5M: 0.9% of a rerun of attention), and one more fetch of layer l-1's
// input and attention output, exposed.
#include <algorithm>

#include "llama.h"

struct Selective {
    bf16* host_att = nullptr;   // [K, T, Hq d] attention outputs of the first K = att_host_layers
    float* host_lse = nullptr;  // [K, B Hq S]
    cudaEvent_t copied_out = nullptr;  // the staging slot's output and lse are on the host
    cudaEvent_t fetched = nullptr;     // what the backward fetched is in the slots
};

static int64_t block_input_bytes(const Model& m) { return m.shape.tokens() * m.cfg.dim * 2; }
static int64_t output_elements(const Model& m) { return m.shape.tokens() * m.cfg.q_dim(); }
int64_t selective_attention_bytes(const Model& m) { return output_elements(m) * 2 + layer_lse_floats(m) * 4; }

// A rebuilt input: layer l-1's Wo and MLP forward. A rerun: one layer's attention forward.
static double rebuild_flops(const Model& m) {
    const LlamaConfig& c = m.cfg;
    return 2.0 * m.shape.tokens() * c.dim * (c.q_dim() + 3.0 * c.ffn_dim);
}
static double rerun_flops(const Model& m) {
    const LlamaConfig& c = m.cfg;
    return attention_forward_flops({m.shape.batch, m.shape.seq, c.n_heads / m.shape.sp, c.n_kv_heads, c.head_dim});
}

// Under --offload: how many inputs are rebuilt (n), how many layers keep their attention output
// on the host (K) and how many more on the device (D).
static void plan_host_and_device(Model& m) {
    const int L = m.cfg.n_layers;
    // With n inputs rebuilt (layers 1, 3, .., 2n - 1), the host holds L - n inputs and the
    // attention outputs of as many layers as the rest of the budget holds, at most L - 1.
    auto host_layers = [&](int n) {
        const int64_t left = (int64_t)(m.opt.host_mem_gib * GiB) - (L - n) * block_input_bytes(m);
        return (int)std::clamp<int64_t>(left / selective_attention_bytes(m), 0, std::max(0, L - 1));
    };
    // Of the layers left to rerun attention, the last ones keep theirs on the device instead, as
    // many as the room under the cap holds (device_attention_layers).
    auto device_layers = [&](int K) { return std::clamp(m.device_attention_layers, 0, std::max(0, L - 1 - K)); };
    auto kept = [&](int n) { return host_layers(n) + device_layers(host_layers(n)); };
    // Layer l's input is rebuilt from layer l-1's input and attention output, so layer l-1 keeps
    // both on the host (2n - 2 < K); the last layer's input is never rebuilt (2n - 1 <= L - 2).
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

// The plan. With --offload the outputs move (attention_on_host), and the step calls the functions
// below: before a layer's attention its staging slot is free, after it the output goes to the
// host, before the layer's backward it comes back (and a rebuilt input is rebuilt).
void selective_plan(Model& m) {
    if (!m.opt.selective) return;
    m.plan.att = Hold::PER_LAYER;  // kept, not recomputed
    if (m.plan.x_in != Hold::ON_HOST) return;
    m.plan.att = Hold::ON_HOST;
    plan_host_and_device(m);
}

// The layers kept on the device are the ones just before the last: L-1-D .. L-2.
int selective_device_slot(const Model& m, int l) {
    const int first = m.cfg.n_layers - 1 - m.plan.att_device_layers;
    return m.plan.att == Hold::ON_HOST && l >= first && l < m.cfg.n_layers - 1 ? l - first : -1;
}

int64_t selective_host_bytes(const Model& m) {
    return m.plan.att == Hold::ON_HOST ? m.plan.att_host_layers * selective_attention_bytes(m) : 0;
}

int selective_device_layers(const Model& m, double room_bytes) {
    if (m.plan.att != Hold::ON_HOST) return 0;
    if (m.opt.device_keep_gib >= 0) room_bytes = std::min(room_bytes, m.opt.device_keep_gib * GiB);
    return (int)std::clamp(room_bytes / (double)selective_attention_bytes(m), 0.0, (double)m.cfg.n_layers);
}

void selective_declare_buffers(Model& m, Arena& A) {
    const int D = m.plan.att == Hold::ON_HOST ? m.plan.att_device_layers : 0;
    if (D == 0) return;
    const int64_t lse_n = layer_lse_floats(m);
    bf16* att = A.take<bf16>("attention outputs kept on the device", MEM_ATTENTION, D * output_elements(m));
    float* lse = A.take<float>("attention lse kept on the device", MEM_ATTENTION, D * lse_n);
    if (!att) return;  // the dry run
    for (int l = 0; l < m.cfg.n_layers; l++)
        if (const int d = selective_device_slot(m, l); d >= 0)
            m.layers[l].att = att + d * output_elements(m), m.layers[l].lse = lse + d * lse_n;
}

// "attention kept for 28 of 32 layers (0-14 on the host, 26-30 on the device, 31 in its slot),
// rerun for layers 15-25; block inputs rebuilt for layers 1, 3, .., 21"
std::string selective_plan_text(const Model& m) {
    const ActivationPlan& p = m.plan;
    const int L = m.cfg.n_layers, K = p.att_host_layers, D = p.att_device_layers, n = p.x_rebuilt_layers;
    auto layers = [](int a, int b) {  // layers a..b
        return a > b ? std::string("none") : a == b ? std::to_string(a) : std::to_string(a) + "-" + std::to_string(b);
    };
    const std::string on_device = D > 0 ? layers(L - 1 - D, L - 2) + " on the device, " : "";
    const int rerun = L - 1 - D - K;
    const std::string rebuilt = n == 0   ? ""
                                : n == 1 ? "; block input rebuilt for layer 1"
                                : n == 2 ? "; block inputs rebuilt for layers 1 and 3"
                                         : "; block inputs rebuilt for layers 1, 3, .., " + std::to_string(2 * n - 1);
    return "attention kept for " + std::to_string(K + D + 1) + " of " + std::to_string(L) + " layers (" +
           layers(0, K - 1) + " on the host, " + on_device + std::to_string(L - 1) + " in its slot), rerun for " +
           (rerun > 1 ? "layers " : rerun == 1 ? "layer " : "") + layers(K, L - 2 - D) + rebuilt;
}

void selective_create(Model& m) {
    if (!m.pin_host) return;  // a run of no steps plans the pinned memory only
    Selective* sel = m.selective = new Selective();
    const int64_t K = m.plan.att_host_layers;
    auto pin = [&](void** p, int64_t bytes, const char* what) {
        if (bytes == 0) return;
        if (cudaHostAlloc(p, bytes, cudaHostAllocDefault) != cudaSuccess) {
            cudaGetLastError();
            throw Fatal(EXIT_OOM, "out of memory: pinned host memory for the kept " + std::string(what) + " (" +
                                      std::to_string(bytes / GiB) + " GiB; with the block inputs " +
                                      std::to_string(model_host_bytes(m) / GiB) + " GiB) could not be allocated");
        }
    };
    pin((void**)&sel->host_att, K * output_elements(m) * 2, "attention outputs");
    pin((void**)&sel->host_lse, K * layer_lse_floats(m) * 4, "attention lse");
    CUDA_CHECK(cudaEventCreateWithFlags(&sel->copied_out, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&sel->fetched, cudaEventDisableTiming));
}

void selective_destroy(Model& m) {
    Selective* sel = m.selective;
    if (!sel) return;
    if (m.offload) cudaStreamSynchronize(offload_copy_stream(m));
    cudaFreeHost(sel->host_att), cudaFreeHost(sel->host_lse);
    cudaEventDestroy(sel->copied_out), cudaEventDestroy(sel->fetched);
    delete sel;
    m.selective = nullptr;
}

void selective_before_attention(Model& m, int l, cudaStream_t s) {
    // Layer l's attention output goes into the staging slot that held layer l-1's.
    if (l >= 1) CUDA_CHECK(cudaStreamWaitEvent(s, m.selective->copied_out, 0));
}

void selective_after_attention(Model& m, int l, cudaStream_t s) {
    if (l >= m.plan.att_host_layers) return;
    Selective& sel = *m.selective;
    const int64_t n = output_elements(m), nl = layer_lse_floats(m);
    offload_copy(m, sel.host_att + l * n, m.layers[l].att, n * 2, cudaMemcpyDeviceToHost, "att to host", l, s);
    offload_copy(m, sel.host_lse + l * nl, m.layers[l].lse, nl * 4, cudaMemcpyDeviceToHost, "lse to host", l, s);
    CUDA_CHECK(cudaEventRecord(sel.copied_out, offload_copy_stream(m)));
}

// Layer p's attention output (and lse: not for a rebuild, which reads none) back into the
// staging slot, once the compute stream is here; then the compute stream waits for it (and for
// what the copy stream did before it). Nothing for a layer whose output never left the device.
static void fetch_attention(Model& m, int p, bool lse, cudaStream_t s) {
    Selective& sel = *m.selective;
    if (p >= m.plan.att_host_layers) return;  // on the device, or in the staging slot (the last layer)
    const int64_t n = output_elements(m), nl = layer_lse_floats(m);
    offload_copy(m, m.layers[p].att, sel.host_att + p * n, n * 2, cudaMemcpyHostToDevice, "att to device", p, s);
    if (lse) offload_copy(m, m.layers[p].lse, sel.host_lse + p * nl, nl * 4, cudaMemcpyHostToDevice, "lse to device", p, s);
    CUDA_CHECK(cudaEventRecord(sel.fetched, offload_copy_stream(m)));
    CUDA_CHECK(cudaStreamWaitEvent(s, sel.fetched, 0));
}

// Layer l's input is layer l-1's output: layer l-1's input and attention output into the slots,
// then the rest of its block again (Wo, the MLP; as in the forward, so the same bits).
static void rebuild_input(Model& m, int l, cudaStream_t s) {
    offload_fetch_input(m, l - 1, s);
    fetch_attention(m, l - 1, false, s);  // layer l-1 < K: the wait covers its input's copy too
    unit_begin(m, m.layout.layer_unit(l - 1), WEIGHTS, s);  // made ahead; it ends once, in its own turn
    TimelineMark mark(m, s, "compute", "input rebuild", l);
    for_each_token_chunk(m, [&](int64_t t0, int64_t t1) { block_output_forward(m, l - 1, t0, t1, s); });
}

void selective_before_layer_backward(Model& m, int l, cudaStream_t s) {
    if (input_rebuilt(m.plan, l)) rebuild_input(m, l, s), offload_input_written(m, l);
    fetch_attention(m, l, true, s);  // layer l's attention output (over layer l-1's, after a rebuild)
}
