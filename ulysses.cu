// ulysses.cu - DeepSpeed Ulysses context parallelism (--ulysses, ladder stage 2; the talk at
// 06:04; Jacobs et al., arXiv 2309.14509), then Untied Ulysses, the same in head chunks
// (--untied[=K], stage 6; the talk at 09:57, the chunk size at 11:43; UPipe, arXiv 2602.21196).
// llama.cu's attention sub-layer calls each where it replaces a part of the plain one: Ulysses the
// attention call (with its all-to-alls), Untied Ulysses the whole sub-layer.
//
// Stage 2, Ulysses. One sequence of S tokens is split over N GPUs: GPU r holds tokens
// [r S/N, (r+1) S/N) and runs everything that works token by token (norms, projections, RoPE
// with global positions, MLP, loss) on those S/N tokens only. Attention is the one step that mixes tokens; there the split
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
// Stage 6, Untied Ulysses. Plain Ulysses materializes, for all of a GPU's heads at once and each
// spanning the whole sequence, the projected q, k, v (token-sharded and head-sharded), the
// all-to-all staging and the attention output. Untied Ulysses walks a GPU's share of query heads (Hq/N) in chunks of K
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
//   4 S K d (--attention fused), each a buffer of its own (stage 7 finds their bytes elsewhere:
//   beyond/savings.cu). The normalized input itself is recomputed a token chunk at a time
//   wherever a projection needs it.
// Llama 3.1 8B on 8 GPUs (q = 4, kv' = 1), K = 1: the attention term falls from 48 S d to 22 S d
// bytes. The cost: q/K all-to-alls per direction instead of one, projection GEMMs of K d
// columns, and the projections recomputed in the backward.
#include <algorithm>

#include "llama.h"

// =============================================================================================
// Stage 2: DeepSpeed Ulysses.
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
    if (m.shape.sp <= 1 || m.opt.untied) return;  // --untied: Untied Ulysses holds its own (below)
    m.ulysses = std::make_shared<Ulysses>();
    m.plan.dqkv_buffer = false;  // it is unpacked into the send staging
}

void ulysses_declare_buffers(Model& m, Arena& A) {
    if (!m.ulysses) return;
    Ulysses& u = *m.ulysses;
    const LlamaConfig& c = m.cfg;
    const int sp = m.shape.sp;
    const AttentionHeads heads = attention_heads(c, sp);
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
    const AttentionHeads h = attention_heads(m.cfg, m.shape.sp);
    return {1, m.shape.tokens() * m.shape.sp, h.q, h.kv, m.cfg.head_dim};
}

// The projection writes q|k|v of this GPU's tokens into the receive staging, from where they are
// packed and sent; d q|k|v of its tokens comes back unpacked into the send staging.
bf16* ulysses_token_qkv(const Model& m) { return m.ulysses->receive; }
bf16* ulysses_token_dqkv(const Model& m) { return m.ulysses->send; }

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
    AttentionHeads h = attention_heads(c, g.sp);
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

// dst[t][col0 + j stride + x] = src[j][t][x] for x < w: the blocks that came from GPU j into their
// columns of rows of width ld.
static void blocks_to_columns(bf16* dst, const bf16* src, int64_t T, int sp, int64_t w, int64_t ld, int64_t col0,
                              int64_t stride, cudaStream_t s) {
    blocks_to_strided_kernel<bf16><<<blocks(sp * T * w), 256, 0, s>>>(dst, src, T, sp, w, ld, col0, stride);
    CUDA_CHECK_LAUNCH();
}

// delta[t][h] = rowsum over head h of dout * out, for H heads from each row's start.
static void token_deltas(float* delta, const bf16* dout, int64_t ld_dout, const bf16* out, int64_t ld_out, int64_t T,
                         int H, int d, cudaStream_t s) {
    delta_kernel<<<(unsigned)((T * H + 7) / 8), 256, 0, s>>>(delta, dout, ld_dout, out, ld_out, T, H, d);
    CUDA_CHECK_LAUNCH();
}

// [B][S][q] -> [B][q][S]: per-token delta to the attention kernel's per-head layout.
static void delta_to_heads(float* out, const float* in, int64_t B, int64_t S, int q, cudaStream_t s) {
    transpose_kernel<<<blocks(B * S * q), 256, 0, s>>>(out, in, B, S, q);
    CUDA_CHECK_LAUNCH();
}

// Token-sharded q, k, v -> head-sharded, straight into the layer's qkv [S, WH].
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
    const AttentionForwardArgs fa{.q = a.qkv, .k = a.qkv + qd, .v = a.qkv + qd + (int64_t)g.kv * g.d, .ldq = g.WH,
                                  .ldk = g.WH, .ldv = g.WH, .out = u.heads_out, .ldo = qd, .lse = a.lse,
                                  .docs = m.docs.attention};
    layer_attention_forward(m, l, fa, ulysses_attention_shape(m), s);
    // Head-sharded output -> token-sharded a.att [T, Hq d]: rows of GPU j's tokens go to GPU j.
    layer_all_to_all(m, l, u.receive, u.heads_out, g.T * qd, DType::BF16, s);
    blocks_to_columns(a.att, u.receive, g.T, g.sp, qd, g.sp * qd, 0, qd, s);
}

void ulysses_attention_backward(Model& m, int l, cudaStream_t s) {
    const Geometry g = geometry(m);
    Ulysses& u = *m.ulysses;
    LayerActivations& a = m.layers[l];
    const int64_t S = g.T * g.sp, qd = (int64_t)g.q * g.d;
    // delta on the token-sharded side, then d out and delta to head-sharded.
    token_deltas(u.delta_tokens, m.datt, (int64_t)g.Hq * g.d, a.att, (int64_t)g.Hq * g.d, g.T, g.Hq, g.d, s);
    strided_to_blocks_kernel<bf16><<<blocks(g.sp * g.T * qd), 256, 0, s>>>(u.send, m.datt, g.T, g.sp, qd, g.sp * qd, 0, qd);
    CUDA_CHECK_LAUNCH();
    layer_all_to_all(m, l, u.heads_out, u.send, g.T * qd, DType::BF16, s);  // d out of this GPU's heads
    strided_to_blocks_kernel<float><<<blocks(g.T * g.Hq), 256, 0, s>>>(u.delta_send, u.delta_tokens, g.T, g.sp, g.q, g.Hq, 0, g.q);
    CUDA_CHECK_LAUNCH();
    layer_all_to_all(m, l, u.delta_receive, u.delta_send, g.T * g.q, DType::F32, s);
    delta_to_heads(m.delta, u.delta_receive, 1, S, g.q, s);
    // Attention backward on S tokens x H/N heads; out = nullptr: delta is given.
    const int64_t kvd = (int64_t)g.kv * g.d;
    const AttentionBackwardArgs ba{.q = a.qkv, .k = a.qkv + qd, .v = a.qkv + qd + kvd, .out = nullptr,
                                   .dout = u.heads_out, .ldq = g.WH, .ldk = g.WH, .ldv = g.WH, .ldo = 0, .lddo = qd,
                                   .lse = a.lse, .dq = u.heads_dqkv, .dk = u.heads_dqkv + qd,
                                   .dv = u.heads_dqkv + qd + kvd, .lddq = g.WH, .lddk = g.WH, .lddv = g.WH,
                                   .delta = m.delta, .dq_accum = m.dq_accum, .docs = m.docs.attention};
    layer_attention_backward(m, l, ba, ulysses_attention_shape(m), s);
    // Head-sharded dq, dk, dv -> token-sharded d q|k|v [T, QKV] in the send staging (replicated
    // KV heads summed), where llama.cu's attention_block_backward reads it (ulysses_token_dqkv).
    layer_all_to_all(m, l, u.receive, u.heads_dqkv, g.T * g.WH, DType::BF16, s);
    unpack_dqkv_kernel<<<blocks(g.T * g.QKV), 256, 0, s>>>(u.send, u.receive, g);
    CUDA_CHECK_LAUNCH();
}

// =============================================================================================
// Stage 6: Untied Ulysses.
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
// group), projected straight into the send blocks, normalized per head (Qwen3), RoPE'd; then to
// head-sharded.
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
        bf16* q = p.send + (int64_t)j * p.T * w;
        bf16* k = p.kv_send + (int64_t)j * p.T * 2 * kvw;
        qk_norm_forward(m, l, q, w, p.K, kv ? k : nullptr, 2 * kvw, p.kv, p.T, s);  // Qwen3: per head, before RoPE
        rope_apply(q, p.T, 0, m.shape.seq, m.shape.first_position(), p.K, (int)p.d, w, m.inv_freq, false, s,
                   m.docs.positions);
        if (kv)
            rope_apply(k, p.T, 0, m.shape.seq, m.shape.first_position(), p.kv, (int)p.d, 2 * kvw, m.inv_freq, false,
                       s, m.docs.positions);
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
    p.dxn1 = m.plan.dxn1_buffer ? A.take<bf16>("untied: d normalized input", MEM_OTHER, p.T * p.D) : nullptr;
    // The send and receive blocks are one buffer.
    bf16* staging = A.take<bf16>("untied: q / d out send, out / dq receive", MEM_COMM,
                                 std::max(2 * S * w, dq_sums_staging_bf16s(m)));  // stage 7: room for the dQ sums
    p.send = staging;
    p.receive = staging ? staging + S * w : nullptr;
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
                                      .ldv = 2 * kvw, .out = p.heads_out, .ldo = w, .lse = a.lse + (int64_t)i * p.K * p.S,
                                      .docs = m.docs.attention};
        layer_attention_forward(m, l, fa, chunk_shape(p), s);
        // Back to token-sharded, into chunk i's columns of every GPU's share of the output.
        chunk_all_to_all(m, p, l, p.receive, p.heads_out, p.T * w, DType::BF16, s);
        blocks_to_columns(a.att, p.receive, p.T, p.sp, w, c.q_dim(), (int64_t)i * w,
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
        token_deltas(p.delta_send + ((int64_t)i * p.sp + j) * p.T * p.K, p.send + (int64_t)j * p.T * w, w,
                      m.layers[l].att + col, QD, p.T, p.K, (int)p.d, s);
    }
}


// Chunk i's attention backward: d out and delta to head-sharded, the kernel, dK and dV summed over
// the chunks of a KV group in place.
void chunk_attention_backward(Model& m, const Untied& p, int l, int i, cudaStream_t s) {
    const int64_t w = p.K * p.d, kvw = p.kv * p.d;
    chunk_all_to_all(m, p, l, p.heads_out, p.send, p.T * w, DType::BF16, s);  // d out [S, K d]
    chunk_all_to_all(m, p, l, p.delta_receive, p.delta_send + (int64_t)i * p.S * p.K, p.T * p.K, DType::F32, s);
    delta_to_heads(p.heads_delta, p.delta_receive, p.batch, p.seq, p.K, s);
    const AttentionBackwardArgs ba{.q = p.heads_q, .k = p.heads_kv, .v = p.heads_kv + kvw, .out = nullptr,
                                   .dout = p.heads_out, .ldq = w, .ldk = 2 * kvw, .ldv = 2 * kvw, .ldo = 0, .lddo = w,
                                   .lse = m.layers[l].lse + (int64_t)i * p.K * p.S, .dq = p.heads_dq,
                                   .dk = p.heads_dkv, .dv = p.heads_dkv + kvw, .lddq = w, .lddk = 2 * kvw,
                                   .lddv = 2 * kvw, .delta = p.heads_delta, .accumulate_dkv = !p.new_kv(i),
                                   .dq_accum = m.dq_accum, .docs = m.docs.attention};
    layer_attention_backward(m, l, ba, chunk_shape(p), s);
}

// Qwen3: chunk i's dq (and with a complete KV group dk), RoPE undone, back through the per-head
// norms, in place (nothing for Llama). The values before the norms are projected again, token
// chunk by token chunk, into the step's qk_raw.
void chunk_qk_norm_backward(Model& m, const Untied& p, int l, int i, bool kv_done, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    if (!c.qk_norm()) return;
    const int64_t w = p.K * p.d, kvw = p.kv * p.d;
    const bf16* Wqkv = m.w(P_WQKV, l);
    for_each_normalized_chunk(m, l, [&](int64_t t0, int64_t n, const bf16* xn) {
        for (int j = 0; j < p.sp; j++) {
            linear_forward(m.chunk.qk_raw, xn, Wqkv + q_row(c, p.q_first(j, i)) * p.D, nullptr, n, p.D, w, s);
            head_norm_backward(m, P_Q_NORM, l, p.receive + ((int64_t)j * p.T + t0) * w, w, m.chunk.qk_raw, w, p.K, n, s);
            if (!kv_done) continue;
            linear_forward(m.chunk.qk_raw, xn, Wqkv + k_row(c, p.kv_first(j, i)) * p.D, nullptr, n, p.D, kvw, s);
            head_norm_backward(m, P_K_NORM, l, p.kv_send + ((int64_t)j * p.T + t0) * 2 * kvw, 2 * kvw, m.chunk.qk_raw, kvw,
                               p.kv, n, s);
        }
    }, s);
}

// dq of chunk i back to token-sharded, RoPE undone; with a complete KV group, dk | dv too
// (replicated heads add up); Qwen3's norms undone. Then dxn1 += d q|k|v Wqkv, and the weight
// gradients token chunk by token chunk against the normalized input, recomputed. `written`: dxn1 holds a sum already.
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
        rope_apply(p.receive + (int64_t)j * p.T * w, p.T, 0, m.shape.seq, m.shape.first_position(), p.K, (int)p.d, w,
                   m.inv_freq, true, s, m.docs.positions);
        if (kv_done)
            rope_apply(p.kv_send + (int64_t)j * p.T * 2 * kvw, p.T, 0, m.shape.seq, m.shape.first_position(), p.kv,
                       (int)p.d, 2 * kvw, m.inv_freq, true, s, m.docs.positions);
    }
    chunk_qk_norm_backward(m, p, l, i, kv_done, s);  // Qwen3: through the per-head norms
    for (int j = 0; j < p.sp; j++) {
        add_dxn1(p.receive + (int64_t)j * p.T * w, w, Wqkv + q_row(c, p.q_first(j, i)) * p.D, w);
        if (!kv_done) continue;
        bf16* dkv = p.kv_send + (int64_t)j * p.T * 2 * kvw;
        const int g = p.kv_first(j, i);
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
    bf16* dxn1 = p.dxn1 ? p.dxn1 : deltas_first_in_att_output(m, l, s);  // stage 7: beyond/savings.cu
    bool written = false;
    for (int i = 0; i < p.chunks; i++) {
        untied_project(m, p, l, i, s);
        chunk_dout(m, p, l, i, s);
        if (p.dxn1) chunk_deltas(m, p, l, i, s);  // (else all taken first)
        chunk_attention_backward(m, p, l, i, s);
        chunk_input_gradients(m, p, l, i, dxn1, written, s);
    }
    // The attention norm's backward, chunk by chunk (its rstd recomputed): dres += d/dx_in.
    const int64_t D = p.D;
    for_each_normalized_chunk(m, l, [&](int64_t t0, int64_t n, const bf16*) {
        rmsnorm_backward(m.dres + t0 * D, m.g(P_ATTN_NORM, l), dxn1 + t0 * D, a.x_in + t0 * D,
                         m.w(P_ATTN_NORM, l), a.rstd1, n, (int)D, true, m.work.norm_partial, s);
    }, s);
}

int untied_chunks(const Model& m) { return m.untied->chunks; }
void untied_chunk_dout(Model& m, int l, int i, cudaStream_t s) { chunk_dout(m, *m.untied, l, i, s); }
void untied_chunk_deltas(Model& m, int l, int i, cudaStream_t s) { chunk_deltas(m, *m.untied, l, i, s); }
bf16* untied_staging(const Model& m) { return m.untied->send; }
