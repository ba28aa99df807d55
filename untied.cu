// untied.cu - Untied Ulysses (--untied[=K], ladder stage 6; the talk at 09:57, and the
// chunk-size trade-off, K against memory and time, at 11:43; the UPipe method of the Untied
// Ulysses paper, arXiv 2602.21196).
//
// Plain Ulysses materializes, for all of a GPU's heads at once and each spanning the whole
// sequence, the projected q, k, v (token-sharded and head-sharded), the all-to-all staging and
// the attention output. Untied Ulysses walks a GPU's share of query heads (Hq/N) in chunks of K
// heads and reuses one small buffer set for every chunk:
//
//   for each chunk i (Hq / (N K) of them):
//     q for chunk i of every destination GPU j: one GEMM each, written straight into j's send
//       block [S/N, K d] (no pack), RoPE with global positions
//     k, v only when the chunk starts a new KV group (heads are walked in GQA order, so each KV
//       head crosses the network once per layer and direction)
//     all-to-all -> q [S, K d], k, v [S, kv d]; attention; lse of the chunk kept
//     all-to-all back, straight into the chunk's columns of the one attention output [S/N, Hq d]
//
// The backward repeats the chunks: it recomputes the projections, computes the chunk's d out
// (dres times the chunk's columns of Wo) straight into the send blocks, takes the chunk's delta =
// rowsum(d out * out) on the token-sharded side, runs the attention backward, sends dq back at
// once, and sums dK, dV over the chunks of a KV group in place (the kernel adds to them) before
// sending them back. Projection weight gradients and the gradient of the normalized input,
// dxn1, accumulate chunk by chunk (GEMMs with beta = 1).
//
// Memory per GPU (S tokens in the sequence, N GPUs, d head dim, q = Hq/N query heads and
// kv' = max(1, Hkv/N) KV heads per GPU, K heads per chunk with kv = max(1, K/group) KV heads;
// bf16 = 2 bytes; one layer's working set, since layers run one at a time under --ckpt):
//   attention category
//     plain:  2 S d (2 (q + 2 kv') + 3 q) + 8 S q   head-sharded qkv and its gradient, output
//                                                   and d out (head-sharded), the token-sharded
//                                                   output and its gradient, lse and delta
//     untied: 2 S d (q + 3 K + 4 kv) + 4 S (q + K)  the token-sharded output (Wo's input), the
//                                                   chunk's q, out/d out, dq, k|v, dk|dv; lse
//   all-to-all staging (comm category)
//     plain:  2 x 2 S d (q + 2 kv') (+ 12 S q for delta)
//     untied: 2 S d (2 K + 2 kv) + 4 S (q + K)
//   the gradient of the normalized input, 2 (S/N) D ("other"), and the fused backward's dQ sums,
//   4 S K d (--attention fused), each a buffer of its own (the input itself is recomputed a token
//   chunk at a time wherever a projection needs it).
// Llama 3.1 8B on 8 GPUs (q = 4, kv' = 1), K = 1: the attention term falls from 48 S d to 22 S d
// bytes. The cost: q/K all-to-alls per direction instead of one, projection GEMMs of K d
// columns, and the projections recomputed in the backward.
//
// Where --untied changes the step (train.cpp: it implies --ckpt):
//   untied_plan        q|k|v, their gradient, d att and delta leave the plain model's buffers
//                      (one head chunk's buffers here instead)
//   llama.cu           attention_block_forward calls untied_attention_forward instead of
//                      qkv_forward and self_attention_forward (so does checkpointing's rerun);
//                      layer_backward calls untied_attention_backward after the MLP's backward;
//                      mlp_backward leaves d att to it
//   llama.cu           attention_call_shape: the fused backward's dQ sums hold one head chunk
//   ulysses.cu         ulysses_plan stands down: none of plain Ulysses's buffers are declared
// Beyond the talk (stage 7, savings.cu): --grad-in-att-output keeps dxn1 in the attention
// output's memory, taking every chunk's delta first (untied_grad_in_att_output); --dq-sums-in-
// staging puts the fused backward's dQ sums in the send and receive blocks (no dq_sums_buffer).
#include <algorithm>

#include "llama.h"

// How a GPU's heads are walked, and one head chunk's buffers, reused by every chunk and layer.
// Chunk i of GPU j holds query heads j Hq/N + i K .. + K - 1 and their KV heads (kv of them,
// starting at the first's group). What a buffer holds changes over the step, in this order.
struct Untied {
    int sp, K, chunks, group, kv, q_per_gpu;
    int64_t T, S, d, D;
    int64_t batch, seq;  // the attention's view: B sequences of seq tokens (B = 1 under Ulysses)
    int q_first(int j, int i) const { return j * q_per_gpu + i * K; }
    int kv_first(int j, int i) const { return q_first(j, i) / group; }
    // Whether chunk i starts a new KV group (the same for every GPU: see untied_check).
    bool new_kv(int i) const { return i == 0 || (q_per_gpu >= group && (i * K) % group == 0); }
    bool last_of_kv(int i) const { return i == chunks - 1 || new_kv(i + 1); }

    bf16* dxn1 = nullptr;     // [T, D] d xn1 (the normalized input) of all tokens, summed over chunks
                              // (nullptr under --grad-in-att-output: the attention output's memory)
    bf16* send = nullptr;     // [N][T, K d] the chunk's q for each destination GPU; then its d out
    bf16* receive = nullptr;  // [N][T, K d] the chunk's output from each GPU; then its dq (right
                              // after send; --dq-sums-in-staging: both hold the fused backward's dQ sums)
    bf16* kv_send = nullptr;  // [N][T, 2 kv d] k|v for each destination GPU; then dk|dv received
    bf16* heads_q = nullptr;    // [S, K d] the chunk's q, head-sharded
    bf16* heads_kv = nullptr;   // [S, 2 kv d] its k|v, head-sharded
    bf16* heads_out = nullptr;  // [S, K d] its output, head-sharded; then its d out
    bf16* heads_dq = nullptr;   // [S, K d]
    bf16* heads_dkv = nullptr;  // [S, 2 kv d] summed over the chunks of a KV group
    float* delta_send = nullptr;     // [chunks][N][T, K] delta of every chunk's heads, by destination GPU
    float* delta_receive = nullptr;  // [N][T, K] by source GPU
    float* heads_delta = nullptr;    // [B, K, S] head-sharded, as the attention kernel reads it
};

namespace {

void chunk_all_to_all(Model& m, const Untied& p, int l, void* out, const void* in, int64_t n, DType t, cudaStream_t s);

// Rows of the fused wqkv (and its gradient) that hold query head h, and KV head g's k and v.
int64_t q_row(const LlamaConfig& c, int h) { return (int64_t)h * c.head_dim; }
int64_t k_row(const LlamaConfig& c, int g) { return (int64_t)(c.n_heads + g) * c.head_dim; }
int64_t v_row(const LlamaConfig& c, int g) { return (int64_t)(c.n_heads + c.n_kv_heads + g) * c.head_dim; }

// The layer's normalized input, token chunk by token chunk (into the attention-norm chunk buffer
// xn1 / rstd1): with --chunked no full-width copy of it is kept (without, one chunk is the whole
// sequence). Calls f(t0, n, xn) for each chunk.
template <class F>
void for_each_normalized_chunk(Model& m, int l, F f, cudaStream_t s) {
    for_each_token_chunk(m, [&](int64_t t0, int64_t t1) {
        attention_norm_forward(m, l, t0, t1, s);
        f(t0, t1 - t0, m.layers[l].xn1);
    });
}

// q of chunk i for every destination (and k | v of its KV heads when the chunk starts a new KV
// group), projected straight into the send blocks, RoPE'd; then to head-sharded.
void untied_project(Model& m, const Untied& p, int l, int i, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    const int64_t w = p.K * p.d, kvw = p.kv * p.d;
    const bool kv = p.new_kv(i);
    const bf16* Wqkv = m.w(P_WQKV, l);
    for_each_normalized_chunk(m, l, [&](int64_t t0, int64_t n, const bf16* xn) {
        for (int j = 0; j < p.sp; j++) {
            bf16* q = p.send + (int64_t)j * p.T * w + t0 * w;
            linear_forward(q, xn, Wqkv + q_row(c, p.q_first(j, i)) * p.D, nullptr, n, p.D, w, s);
            if (!kv) continue;
            bf16* k = p.kv_send + (int64_t)j * p.T * 2 * kvw + t0 * 2 * kvw;
            const int g = p.kv_first(j, i);
            gemm_rm(false, true, n, kvw, p.D, xn, p.D, Wqkv + k_row(c, g) * p.D, p.D, k, 2 * kvw, false, 1.f, 0.f,
                    nullptr, s);
            gemm_rm(false, true, n, kvw, p.D, xn, p.D, Wqkv + v_row(c, g) * p.D, p.D, k + kvw, 2 * kvw, false, 1.f, 0.f,
                    nullptr, s);
        }
    }, s);
    for (int j = 0; j < p.sp; j++) {
        rope_apply(p.send + (int64_t)j * p.T * w, p.T, 0, m.shape.seq, m.shape.first_position(), p.K,
                   (int)p.d, w, m.inv_freq, false, s);
        if (kv)
            rope_apply(p.kv_send + (int64_t)j * p.T * 2 * kvw, p.T, 0, m.shape.seq, m.shape.first_position(),
                       p.kv, (int)p.d, 2 * kvw, m.inv_freq, false, s);
    }
    chunk_all_to_all(m, p, l, p.heads_q, p.send, p.T * w, DType::BF16, s);
    if (kv) chunk_all_to_all(m, p, l, p.heads_kv, p.kv_send, p.T * 2 * kvw, DType::BF16, s);
}

AttentionShape chunk_shape(const Untied& p) { return {(int)p.batch, p.seq, p.K, p.kv, (int)p.d}; }

// The chunk's all-to-all among the GPUs that share the sequence; without Ulysses (one GPU per
// sequence, data parallel or alone) it is a local copy, whatever the world is.
void chunk_all_to_all(Model& m, const Untied& p, int l, void* out, const void* in, int64_t n, DType t, cudaStream_t s) {
    if (p.sp > 1) return layer_all_to_all(m, l, out, in, n, t, s);
    CUDA_CHECK(cudaMemcpyAsync(out, in, n * (t == DType::BF16 ? 2 : 4), cudaMemcpyDeviceToDevice, s));
}

}  // namespace

void untied_check(const LlamaConfig& c, const RunShape& shape, int K) {
    if (K <= 0) return;
    const int sp = shape.sp, q = c.n_heads / sp, group = c.n_heads / c.n_kv_heads;
    if (q % K)
        usage_error("--untied=" + std::to_string(K) + ": each GPU's " + std::to_string(q) +
                    " query heads do not split into chunks of " + std::to_string(K));
    if (K % group && group % K)
        usage_error("--untied=" + std::to_string(K) + ": chunks must hold whole GQA groups of " +
                    std::to_string(group) + " query heads, or divide one");
    if (q > group && q % group)
        usage_error("--untied: each GPU's query heads must cover whole GQA groups");
}

void untied_plan(Model& m) {
    const int K = m.opt.untied;
    if (K <= 0) return;
    const LlamaConfig& c = m.cfg;
    m.untied = std::make_shared<Untied>();
    Untied& p = *m.untied;
    p.sp = m.shape.sp;
    p.K = K;
    p.q_per_gpu = c.n_heads / p.sp;
    p.chunks = p.q_per_gpu / p.K;
    p.group = c.n_heads / c.n_kv_heads;
    p.kv = std::max(1, p.K / p.group);
    p.T = m.shape.tokens();
    p.S = p.T * p.sp;
    p.batch = m.shape.batch;
    p.seq = m.shape.seq;
    p.d = c.head_dim;
    p.D = c.dim;
    // Attention's inputs and gradients live in the chunk buffers below, not in the plain model's.
    m.plan.qkv = Hold::ELSEWHERE;
    m.plan.dqkv_buffer = m.plan.datt_buffer = false;
}

void untied_declare_buffers(Model& m, Arena& A) {
    if (!m.untied) return;
    Untied& p = *m.untied;
    const int64_t w = p.K * p.d, kvw2 = 2 * p.kv * p.d, S = p.S;
    p.dxn1 = nullptr;
    if (!untied_grad_in_att_output(m)) p.dxn1 = A.take<bf16>("untied: d normalized input", MEM_OTHER, p.T * p.D);
    // The send and receive blocks are one buffer. Under --dq-sums-in-staging (savings.cu) it also
    // holds the fused backward's fp32 dQ sums: while attention's backward runs, neither block
    // holds anything (d out has gone to heads_out, dq comes back after it).
    const bool sums_here = m.opt.fused_attention && !m.plan.dq_sums_buffer;
    const int64_t dq_sums = sums_here ? 2 * attention_dq_accum_floats(chunk_shape(p)) : 0;  // in bf16s
    bf16* staging = A.take<bf16>(sums_here ? "untied: q / d out send, out / dq receive, dQ sums (fp32)"
                                           : "untied: q / d out send, out / dq receive",
                                 MEM_COMM, std::max(2 * S * w, dq_sums));
    p.send = staging;
    p.receive = staging ? staging + S * w : nullptr;
    if (sums_here) m.dq_accum = (float*)staging;
    p.kv_send = A.take<bf16>("untied: k|v send (and dk|dv receive)", MEM_COMM, S * kvw2);
    p.heads_q = A.take<bf16>("untied: q, head-sharded", MEM_ATTENTION, S * w);
    p.heads_kv = A.take<bf16>("untied: k|v, head-sharded", MEM_ATTENTION, S * kvw2);
    p.heads_out = A.take<bf16>("untied: out / d out, head-sharded", MEM_ATTENTION, S * w);
    p.heads_dq = A.take<bf16>("untied: dq, head-sharded", MEM_ATTENTION, S * w);
    p.heads_dkv = A.take<bf16>("untied: dk|dv of the KV group", MEM_ATTENTION, S * kvw2);
    p.delta_send = A.take<float>("untied: delta send, every chunk", MEM_COMM, (int64_t)p.chunks * S * p.K);
    p.delta_receive = A.take<float>("untied: delta receive", MEM_COMM, S * p.K);
    p.heads_delta = A.take<float>("untied: delta, head-sharded", MEM_ATTENTION, S * p.K);
}

AttentionShape untied_attention_shape(const Model& m) { return chunk_shape(*m.untied); }

void untied_attention_forward(Model& m, int l, cudaStream_t s) {
    Untied& p = *m.untied;
    LayerActivations& a = m.layers[l];
    const LlamaConfig& c = m.cfg;
    const int64_t w = p.K * p.d, kvw = p.kv * p.d;
    for (int i = 0; i < p.chunks; i++) {
        untied_project(m, p, l, i, s);
        const AttentionForwardArgs fa{.q = p.heads_q, .k = p.heads_kv, .v = p.heads_kv + kvw, .ldq = w, .ldk = 2 * kvw,
                                      .ldv = 2 * kvw, .out = p.heads_out, .ldo = w, .lse = a.lse + (int64_t)i * p.K * p.S};
        {
            TimelineMark mark(m, s, "compute", "attention forward", l);
            attention_forward(fa, chunk_shape(p), s);
        }
        // Back to token-sharded, into chunk i's columns of every GPU's share of the output.
        chunk_all_to_all(m, p, l, p.receive, p.heads_out, p.T * w, DType::BF16, s);
        ulysses_blocks_to_columns(a.att, p.receive, p.T, p.sp, w, c.q_dim(), (int64_t)i * w,
                                  (int64_t)p.q_per_gpu * p.d, s);
    }
}

namespace {

// d out of chunk i for every destination GPU j, straight into j's send block: dres times the
// chunk's columns of Wo (Wo's input gradient, one head chunk at a time, so no full-width d out is
// kept).
void chunk_dout(Model& m, const Untied& p, int l, int i, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    const int64_t w = p.K * p.d;
    for (int j = 0; j < p.sp; j++) {
        const int64_t col = q_row(c, p.q_first(j, i));  // the chunk's first column of att and Wo
        gemm_rm(false, false, p.T, w, p.D, m.dres, p.D, m.w(P_WO, l) + col, c.q_dim(), p.send + (int64_t)j * p.T * w,
                w, false, 1.f, 0.f, nullptr, s);
    }
}

// delta = rowsum(d out * out) of chunk i's heads, on the token-sharded side, from the d out in
// the send blocks and the output's columns, into the chunk's delta send blocks.
void chunk_deltas(Model& m, const Untied& p, int l, int i, cudaStream_t s) {
    const int64_t w = p.K * p.d, QD = m.cfg.q_dim();
    for (int j = 0; j < p.sp; j++) {
        const int64_t col = q_row(m.cfg, p.q_first(j, i));
        ulysses_delta(p.delta_send + ((int64_t)i * p.sp + j) * p.T * p.K, p.send + (int64_t)j * p.T * w, w,
                      m.layers[l].att + col, QD, p.T, p.K, (int)p.d, s);
    }
}

// --grad-in-att-output (savings.cu): every chunk's delta first, the last read of the layer's
// attention output, whose memory then gathers dxn1 (each chunk's d out is computed again later).
void all_deltas(Model& m, const Untied& p, int l, cudaStream_t s) {
    for (int i = 0; i < p.chunks; i++) {
        chunk_dout(m, p, l, i, s);
        chunk_deltas(m, p, l, i, s);
    }
}

}  // namespace

namespace {

// Chunk i's attention backward: d out and delta to head-sharded, the kernel, dK and dV summed over
// the chunks of a KV group in place.
void chunk_attention_backward(Model& m, const Untied& p, int l, int i, cudaStream_t s) {
    const int64_t w = p.K * p.d, kvw = p.kv * p.d;
    chunk_all_to_all(m, p, l, p.heads_out, p.send, p.T * w, DType::BF16, s);  // d out [S, K d]
    chunk_all_to_all(m, p, l, p.delta_receive, p.delta_send + (int64_t)i * p.S * p.K, p.T * p.K, DType::F32, s);
    ulysses_transpose_delta(p.heads_delta, p.delta_receive, p.batch, p.seq, p.K, s);
    const AttentionBackwardArgs ba{.q = p.heads_q, .k = p.heads_kv, .v = p.heads_kv + kvw, .out = nullptr,
                                   .dout = p.heads_out, .ldq = w, .ldk = 2 * kvw, .ldv = 2 * kvw, .ldo = 0, .lddo = w,
                                   .lse = m.layers[l].lse + (int64_t)i * p.K * p.S, .dq = p.heads_dq,
                                   .dk = p.heads_dkv, .dv = p.heads_dkv + kvw, .lddq = w, .lddk = 2 * kvw,
                                   .lddv = 2 * kvw, .delta = p.heads_delta, .accumulate_dkv = !p.new_kv(i),
                                   .dq_accum = m.dq_accum};
    TimelineMark mark(m, s, "compute", "attention backward", l);
    attention_backward(ba, chunk_shape(p), s);
}

// dq of chunk i back to token-sharded, RoPE undone; with a complete KV group, dk | dv too
// (replicated heads add up). Then dxn1 += d q|k|v Wqkv, and the weight gradients token chunk by
// token chunk against the normalized input, recomputed. `written`: dxn1 holds a sum already.
void chunk_input_gradients(Model& m, const Untied& p, int l, int i, bf16* dxn1, bool& written, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    const int64_t w = p.K * p.d, kvw = p.kv * p.d;
    const bf16* Wqkv = m.w(P_WQKV, l);
    float* dW = m.g(P_WQKV, l);
    auto add_dxn1 = [&](const bf16* dy, int64_t ld, const bf16* Wrows, int64_t rows) {  // dxn1 += dy Wrows
        gemm_rm(false, false, p.T, p.D, rows, dy, ld, Wrows, p.D, dxn1, p.D, false, 1.f, written ? 1.f : 0.f, dxn1, s);
        written = true;
    };
    const bool kv_done = p.last_of_kv(i);
    chunk_all_to_all(m, p, l, p.receive, p.heads_dq, p.T * w, DType::BF16, s);
    if (kv_done) chunk_all_to_all(m, p, l, p.kv_send, p.heads_dkv, p.T * 2 * kvw, DType::BF16, s);
    for (int j = 0; j < p.sp; j++) {
        bf16* dq = p.receive + (int64_t)j * p.T * w;
        rope_apply(dq, p.T, 0, m.shape.seq, m.shape.first_position(), p.K, (int)p.d, w, m.inv_freq, true, s);
        add_dxn1(dq, w, Wqkv + q_row(c, p.q_first(j, i)) * p.D, w);
        if (!kv_done) continue;
        bf16* dkv = p.kv_send + (int64_t)j * p.T * 2 * kvw;
        const int g = p.kv_first(j, i);
        rope_apply(dkv, p.T, 0, m.shape.seq, m.shape.first_position(), p.kv, (int)p.d, 2 * kvw, m.inv_freq, true, s);
        add_dxn1(dkv, 2 * kvw, Wqkv + k_row(c, g) * p.D, kvw);
        add_dxn1(dkv + kvw, 2 * kvw, Wqkv + v_row(c, g) * p.D, kvw);
    }
    for_each_normalized_chunk(m, l, [&](int64_t t0, int64_t n, const bf16* xn) {
        for (int j = 0; j < p.sp; j++) {
            const bf16* dq = p.receive + (int64_t)j * p.T * w + t0 * w;
            linear_backward_weight(dW + q_row(c, p.q_first(j, i)) * p.D, dq, xn, n, p.D, w, s);
            if (!kv_done) continue;
            const bf16* dkv = p.kv_send + (int64_t)j * p.T * 2 * kvw + t0 * 2 * kvw;
            const int g = p.kv_first(j, i);
            gemm_rm(true, false, kvw, p.D, n, dkv, 2 * kvw, xn, p.D, dW + k_row(c, g) * p.D, p.D, true, 1.f, 1.f,
                    nullptr, s);
            gemm_rm(true, false, kvw, p.D, n, dkv + kvw, 2 * kvw, xn, p.D, dW + v_row(c, g) * p.D, p.D, true, 1.f,
                    1.f, nullptr, s);
        }
    }, s);
}

}  // namespace

// On entry m.dres holds d loss / d x_mid (the MLP's backward is done; Wo's weight gradient too)
// and a.att, a.lse the layer's forward. Adds d loss / d x_in into m.dres and the projection and
// norm gradients into the unit. m.dres stays d loss / d x_mid until the end (every chunk's d out
// is taken from it), so the attention side's input gradient gathers in dxn1 first.
void untied_attention_backward(Model& m, int l, cudaStream_t s) {
    Untied& p = *m.untied;
    LayerActivations& a = m.layers[l];
    if (!p.dxn1) all_deltas(m, p, l, s);  // --grad-in-att-output: the output's memory then gathers dxn1
    bf16* dxn1 = p.dxn1 ? p.dxn1 : a.att;
    bool written = false;
    for (int i = 0; i < p.chunks; i++) {
        untied_project(m, p, l, i, s);
        chunk_dout(m, p, l, i, s);
        if (p.dxn1) chunk_deltas(m, p, l, i, s);
        chunk_attention_backward(m, p, l, i, s);
        chunk_input_gradients(m, p, l, i, dxn1, written, s);
    }
    // The attention norm's backward, chunk by chunk (its rstd recomputed): dres += d/dx_in.
    const int64_t D = p.D;
    for_each_normalized_chunk(m, l, [&](int64_t t0, int64_t n, const bf16*) {
        rmsnorm_backward(m.dres + t0 * D, m.g(P_ATTN_NORM, l), dxn1 + t0 * D, a.x_in + t0 * D,
                         m.w(P_ATTN_NORM, l), a.rstd1, n, (int)D, true, m.norm_partial, s);
    }, s);
}
