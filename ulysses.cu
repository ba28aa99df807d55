// ulysses.cu - DeepSpeed Ulysses context parallelism (--ulysses, ladder stage 2; the talk at
// 06:04; Jacobs et al., arXiv 2309.14509).
//
// One sequence of S tokens is split over N GPUs: GPU r holds tokens [r S/N, (r+1) S/N) and runs
// everything that works token by token (norms, projections, RoPE with global positions, MLP,
// loss) on those S/N tokens only. Attention is the one step that mixes tokens; there the split
// changes from tokens to heads with one all-to-all:
//
//   q, k, v  [S/N tokens, all heads]  --all-to-all-->  [S tokens, H/N heads]
//   attention over the whole sequence for H/N heads (the same attention kernels)
//   out      [S tokens, Hq/N heads]   --all-to-all-->  [S/N tokens, all Hq heads]
//
// and the backward mirrors it: d out goes to head-sharded, dq, dk, dv come back token-sharded.
// delta = rowsum(d out * out), which the attention backward needs, is computed on the
// token-sharded side (where out is kept anyway, for the Wo gradient) and sent along, so the
// head-sharded output never has to be kept.
//
// Grouped-query attention: GPU j gets query heads [j Hq/N, (j+1) Hq/N) and the KV heads they
// read. With Hkv >= N that is Hkv/N KV heads each; with N > Hkv (N a multiple of Hkv) a KV head
// is sent to the N/Hkv GPUs whose query heads use it, and their dk, dv are summed on the way
// back. Anything else (heads or sequence not divisible) is rejected at start.
//
// Memory per GPU: every activation that scales with tokens is divided by N (S/N tokens), and
// the attention block's kept buffers hold S tokens x H/N heads, the same bytes. On top of that,
// one layer's worth of working buffers (not multiplied by the depth): the head-sharded output
// and q|k|v gradient (category "attention"), and the all-to-all staging (category "comm"):
// 2 x (S/N) x max(N x head-sharded qkv width, Hq d) in bf16, plus three (S/N) x Hq fp32 arrays
// for delta. The staging also holds the token-sharded q|k|v before it is sent and d q|k|v after
// it arrives, so neither needs a buffer of its own. Traffic per layer: forward q|k|v and out,
// backward d out and d q|k|v, each (N-1)/N of the local tensor.
//
// Where --ulysses changes the step:
//   train.cpp        RunShape.sp = N: each GPU holds S/N tokens (data, RoPE positions, loss);
//                    one sequence for all GPUs (no data parallelism)
//   ulysses_plan     d q|k|v of this GPU's tokens is unpacked into the send staging (no dqkv
//                    buffer)
//   llama.cu         declare_activations sizes qkv and lse for S tokens of this GPU's heads;
//                    attention_call_shape: S tokens, H/N heads; model_step_flops: H/N heads;
//                    qkv_forward writes into the receive staging (qkv_of_tokens);
//                    self_attention_forward/backward call ulysses_attention_forward/backward;
//                    qkv_backward reads d q|k|v from the send staging (dqkv_of_tokens)
//   selective.cu     under --ckpt=selective the recomputed q|k|v goes head-sharded again
//                    (ulysses_qkv_to_heads) for the attention backward
// Untied Ulysses (untied.cu) replaces all of this with head chunks and buffers of its own.
#include <algorithm>

#include "llama.h"

// One layer's working buffers, reused by every layer. Each is named by the side of the
// all-to-all it stages; what it holds changes over the step, in this order.
struct Ulysses {
    bf16* send = nullptr;       // [T, max(N WH, Hq d)]: q|k|v packed by destination GPU; d out by
                                // destination; then d q|k|v of this GPU's tokens [T, qkv_dim]
    bf16* receive = nullptr;    // same size: q|k|v of this GPU's tokens [T, qkv_dim] as the projection
                                // writes it; the attention output by source GPU; d q|k|v by source
    bf16* heads_out = nullptr;  // [S, q d] attention output of this GPU's heads; then their d out
    bf16* heads_dqkv = nullptr; // [S, WH] d q|k|v of this GPU's heads
    float* delta_tokens = nullptr;   // [T, Hq] delta of this GPU's tokens, every head
    float* delta_send = nullptr;     // [N][T][q] the same, grouped by destination GPU
    float* delta_receive = nullptr;  // [N][T][q] this GPU's heads, grouped by source GPU
};

UlyssesHeads ulysses_heads(const LlamaConfig& c, int sp) {
    return {c.n_heads / sp, std::max(1, c.n_kv_heads / sp)};
}

void ulysses_check(const LlamaConfig& c, const RunShape& sh) {
    if (sh.sp <= 1) return;
    const std::string n = std::to_string(sh.sp);
    if (sh.batch != 1) usage_error("--ulysses splits one sequence over the GPUs: use --batch 1");
    if (sh.seq % sh.sp)
        usage_error("--ulysses: --seq-len " + std::to_string(sh.seq) + " is not divisible by the " + n + " GPUs");
    if (c.n_heads % sh.sp)
        usage_error("--ulysses: " + std::to_string(c.n_heads) + " query heads do not divide over " + n + " GPUs");
    if (c.n_kv_heads % sh.sp && sh.sp % c.n_kv_heads)
        usage_error("--ulysses: " + std::to_string(c.n_kv_heads) + " KV heads neither divide over " + n +
                    " GPUs nor replicate evenly onto them");
}

void ulysses_plan(Model& m) {
    if (m.shape.sp <= 1 || m.opt.untied) return;  // --untied: untied.cu holds its own buffers
    m.ulysses = std::make_shared<Ulysses>();
    m.plan.dqkv_buffer = false;  // it is unpacked into the send staging
}

void ulysses_declare_buffers(Model& m, Arena& A) {
    if (!m.ulysses) return;
    Ulysses& u = *m.ulysses;
    const LlamaConfig& c = m.cfg;
    const int sp = m.shape.sp;
    const UlyssesHeads heads = ulysses_heads(c, sp);
    const int64_t T = m.shape.tokens(), S = T * sp, WH = heads.width(c.head_dim);
    const int64_t staging = T * std::max<int64_t>(sp * WH, c.q_dim());  // >= T * qkv_dim
    u.send = A.take<bf16>("Ulysses all-to-all send staging", MEM_COMM, staging);
    u.receive = A.take<bf16>("Ulysses all-to-all receive staging", MEM_COMM, staging);
    u.heads_out = A.take<bf16>("attention output / its gradient, head-sharded", MEM_ATTENTION,
                               S * heads.q * c.head_dim);
    u.heads_dqkv = A.take<bf16>("d qkv, head-sharded", MEM_ATTENTION, S * WH);
    u.delta_tokens = A.take<float>("delta, token-sharded", MEM_COMM, T * c.n_heads);
    u.delta_send = A.take<float>("delta all-to-all send", MEM_COMM, T * c.n_heads);
    u.delta_receive = A.take<float>("delta all-to-all receive", MEM_COMM, T * c.n_heads);
}

AttentionShape ulysses_attention_shape(const Model& m) {
    const UlyssesHeads h = ulysses_heads(m.cfg, m.shape.sp);
    return {1, m.shape.tokens() * m.shape.sp, h.q, h.kv, m.cfg.head_dim};
}

bf16* ulysses_qkv_of_tokens(Model& m) { return m.ulysses->receive; }
bf16* ulysses_dqkv_of_tokens(Model& m) { return m.ulysses->send; }

namespace {

struct Geometry {
    int64_t T;        // local tokens
    int sp, d, Hq, Hkv, q, kv;
    int64_t QKV, WH;  // row widths: local q|k|v (all heads), head-sharded q|k|v
    int replicas;     // GPUs sharing one KV head (1 when Hkv >= sp)
    __host__ __device__ int kv_first(int j) const { return replicas > 1 ? j / replicas : j * kv; }
};

Geometry geometry(const Model& m) {
    const LlamaConfig& c = m.cfg;
    Geometry g;
    g.T = m.shape.tokens();
    g.sp = m.shape.sp, g.d = c.head_dim, g.Hq = c.n_heads, g.Hkv = c.n_kv_heads;
    UlyssesHeads h = ulysses_heads(c, g.sp);
    g.q = h.q, g.kv = h.kv;
    g.QKV = c.qkv_dim(), g.WH = h.width(c.head_dim);
    g.replicas = g.Hkv >= g.sp ? 1 : g.sp / g.Hkv;
    return g;
}

inline unsigned blocks(int64_t n) { return (unsigned)std::min<int64_t>((n + 255) / 256, 1 << 30); }

// Local column (in a [T, QKV] row) of column x of destination j's head-sharded [WH] row.
__device__ inline int64_t qkv_column(const Geometry& g, int j, int64_t x) {
    int head = (int)(x / g.d), i = (int)(x % g.d);
    if (head < g.q) return (int64_t)(j * g.q + head) * g.d + i;
    int kvh = g.kv_first(j) + (head - g.q) % g.kv;
    int64_t base = head < g.q + g.kv ? (int64_t)g.Hq * g.d : (int64_t)(g.Hq + g.Hkv) * g.d;
    return base + (int64_t)kvh * g.d + i;
}

// send[j][t][x] = qkv[t][qkv_column(j, x)], in 8-element pieces (head_dim is a multiple of 8).
__global__ void pack_qkv_kernel(bf16* send, const bf16* qkv, Geometry g) {
    const int64_t WH8 = g.WH / 8, n = (int64_t)g.sp * g.T * WH8;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t x = (i % WH8) * 8, t = (i / WH8) % g.T;
        int j = (int)(i / (WH8 * g.T));
        *(uint4*)(send + i * 8) = *(const uint4*)(qkv + t * g.QKV + qkv_column(g, j, x));
    }
}

// dqkv[t][c] from recv[j][t][x]: query columns come from one GPU; KV columns are summed over the
// GPUs that shared the KV head.
__global__ void unpack_dqkv_kernel(bf16* dqkv, const bf16* recv, Geometry g) {
    const int64_t n = g.T * g.QKV;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t t = i / g.QKV, c = i % g.QKV;
        int head = (int)(c / g.d), e = (int)(c % g.d);
        float acc = 0.f;
        if (head < g.Hq) {  // query head: GPU head / q, its column
            int j = head / g.q;
            acc = __bfloat162float(recv[((int64_t)j * g.T + t) * g.WH + (int64_t)(head - j * g.q) * g.d + e]);
        } else {  // KV head kvh, in the k (section 0) or v (section 1) part
            int section = head < g.Hq + g.Hkv ? 0 : 1;
            int kvh = head - g.Hq - section * g.Hkv;
            int j0 = g.replicas > 1 ? kvh * g.replicas : kvh / g.kv;
            int j1 = g.replicas > 1 ? j0 + g.replicas : j0 + 1;
            for (int j = j0; j < j1; j++) {
                int local = kvh - g.kv_first(j);
                int64_t x = (int64_t)(g.q + section * g.kv + local) * g.d + e;
                acc += __bfloat162float(recv[((int64_t)j * g.T + t) * g.WH + x]);
            }
        }
        dqkv[i] = __float2bfloat16(acc);
    }
}

// dst[t][col0 + j * stride + x] <-> src[j][t][x] for x < w: GPU j's columns of a row of width ld
// (plain Ulysses: its block of heads, col0 = 0, stride = w; Untied: chunk i's heads of GPU j).
template <class E>
__global__ void blocks_to_strided_kernel(E* dst, const E* src, int64_t T, int sp, int64_t w, int64_t ld,
                                         int64_t col0, int64_t stride) {
    const int64_t n = (int64_t)sp * T * w;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t x = i % w, t = (i / w) % T, j = i / (w * T);
        dst[t * ld + col0 + j * stride + x] = src[i];
    }
}
template <class E>
__global__ void strided_to_blocks_kernel(E* dst, const E* src, int64_t T, int sp, int64_t w, int64_t ld,
                                         int64_t col0, int64_t stride) {
    const int64_t n = (int64_t)sp * T * w;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t x = i % w, t = (i / w) % T, j = i / (w * T);
        dst[i] = src[t * ld + col0 + j * stride + x];
    }
}

// delta[t][h] = sum over the head's d values of dout * out (rows ld_dout, ld_out apart), H heads
// from each row's start. One warp per (token, head).
__global__ void delta_kernel(float* delta, const bf16* dout, int64_t ld_dout, const bf16* out, int64_t ld_out,
                             int64_t T, int H, int d) {
    int64_t idx = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (idx >= T * H) return;
    const int64_t t = idx / H, h = idx % H;
    const bf16* a = dout + t * ld_dout + h * d;
    const bf16* b = out + t * ld_out + h * d;
    float acc = 0.f;
    for (int e = lane; e < d; e += 32) acc += __bfloat162float(a[e]) * __bfloat162float(b[e]);
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) delta[idx] = acc;
}

// [B][S][q] -> [B][q][S]
__global__ void transpose_kernel(float* out, const float* in, int64_t B, int64_t S, int q) {
    const int64_t n = B * S * q;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t b = i / (S * q), t = (i / q) % S, h = i % q;
        out[(b * q + h) * S + t] = in[i];
    }
}

}  // namespace

void ulysses_blocks_to_columns(bf16* dst, const bf16* src, int64_t T, int sp, int64_t w, int64_t ld,
                               int64_t col0, int64_t stride, cudaStream_t s) {
    blocks_to_strided_kernel<bf16><<<blocks(sp * T * w), 256, 0, s>>>(dst, src, T, sp, w, ld, col0, stride);
    CUDA_CHECK_LAUNCH();
}

void ulysses_delta(float* delta, const bf16* dout, int64_t ld_dout, const bf16* out, int64_t ld_out, int64_t T,
                   int H, int d, cudaStream_t s) {
    delta_kernel<<<(unsigned)((T * H + 7) / 8), 256, 0, s>>>(delta, dout, ld_dout, out, ld_out, T, H, d);
    CUDA_CHECK_LAUNCH();
}

void ulysses_transpose_delta(float* out, const float* in, int64_t B, int64_t S, int q, cudaStream_t s) {
    transpose_kernel<<<blocks(B * S * q), 256, 0, s>>>(out, in, B, S, q);
    CUDA_CHECK_LAUNCH();
}

// Token-sharded q, k, v -> head-sharded, straight into the layer's qkv [S, WH]. Also the
// backward's first step under --ckpt=selective (q, k, v are recomputed, attention is not).
void ulysses_qkv_to_heads(Model& m, int l, cudaStream_t s) {
    const Geometry g = geometry(m);
    Ulysses& u = *m.ulysses;
    pack_qkv_kernel<<<blocks(g.sp * g.T * g.WH / 8), 256, 0, s>>>(u.send, u.receive, g);
    CUDA_CHECK_LAUNCH();
    layer_all_to_all(m, l, m.layers[l].qkv, u.send, g.T * g.WH, DType::BF16, s);
}

void ulysses_attention_forward(Model& m, int l, cudaStream_t s) {
    const Geometry g = geometry(m);
    Ulysses& u = *m.ulysses;
    LayerActivations& a = m.layers[l];
    const int64_t qd = (int64_t)g.q * g.d;
    ulysses_qkv_to_heads(m, l, s);
    const AttentionForwardArgs fa{.q = a.qkv, .k = a.qkv + qd, .v = a.qkv + qd + (int64_t)g.kv * g.d, .ldq = g.WH,
                                  .ldk = g.WH, .ldv = g.WH, .out = u.heads_out, .ldo = qd, .lse = a.lse};
    {
        TimelineMark mark(m, s, "compute", "attention forward", l);
        attention_forward(fa, ulysses_attention_shape(m), s);
    }
    // Head-sharded output -> token-sharded a.att [T, Hq d]: rows of GPU j's tokens go to GPU j.
    layer_all_to_all(m, l, u.receive, u.heads_out, g.T * qd, DType::BF16, s);
    ulysses_blocks_to_columns(a.att, u.receive, g.T, g.sp, qd, g.sp * qd, 0, qd, s);
}

void ulysses_attention_backward(Model& m, int l, cudaStream_t s) {
    const Geometry g = geometry(m);
    Ulysses& u = *m.ulysses;
    LayerActivations& a = m.layers[l];
    const int64_t S = g.T * g.sp, qd = (int64_t)g.q * g.d;
    // delta on the token-sharded side, then d out and delta to head-sharded.
    ulysses_delta(u.delta_tokens, m.datt, (int64_t)g.Hq * g.d, a.att, (int64_t)g.Hq * g.d, g.T, g.Hq, g.d, s);
    strided_to_blocks_kernel<bf16><<<blocks(g.sp * g.T * qd), 256, 0, s>>>(u.send, m.datt, g.T, g.sp, qd, g.sp * qd, 0, qd);
    CUDA_CHECK_LAUNCH();
    layer_all_to_all(m, l, u.heads_out, u.send, g.T * qd, DType::BF16, s);  // d out of this GPU's heads
    strided_to_blocks_kernel<float><<<blocks(g.T * g.Hq), 256, 0, s>>>(u.delta_send, u.delta_tokens, g.T, g.sp, g.q, g.Hq, 0, g.q);
    CUDA_CHECK_LAUNCH();
    layer_all_to_all(m, l, u.delta_receive, u.delta_send, g.T * g.q, DType::F32, s);
    ulysses_transpose_delta(m.delta, u.delta_receive, 1, S, g.q, s);
    // Attention backward on S tokens x H/N heads; out = nullptr: delta is given.
    const int64_t kvd = (int64_t)g.kv * g.d;
    const AttentionBackwardArgs ba{.q = a.qkv, .k = a.qkv + qd, .v = a.qkv + qd + kvd, .out = nullptr,
                                   .dout = u.heads_out, .ldq = g.WH, .ldk = g.WH, .ldv = g.WH, .ldo = 0, .lddo = qd,
                                   .lse = a.lse, .dq = u.heads_dqkv, .dk = u.heads_dqkv + qd,
                                   .dv = u.heads_dqkv + qd + kvd, .lddq = g.WH, .lddk = g.WH, .lddv = g.WH,
                                   .delta = m.delta, .dq_accum = m.dq_accum};
    {
        TimelineMark mark(m, s, "compute", "attention backward", l);
        attention_backward(ba, ulysses_attention_shape(m), s);
    }
    // Head-sharded dq, dk, dv -> token-sharded d q|k|v [T, QKV] in the send staging (replicated
    // KV heads summed), where qkv_backward reads it.
    layer_all_to_all(m, l, u.receive, u.heads_dqkv, g.T * g.WH, DType::BF16, s);
    unpack_dqkv_kernel<<<blocks(g.T * g.QKV), 256, 0, s>>>(u.send, u.receive, g);
    CUDA_CHECK_LAUNCH();
}
