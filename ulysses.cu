// ulysses.cu - DeepSpeed Ulysses context parallelism (--ulysses, ladder stage 2; the talk at
// 06:04; Jacobs et al., arXiv 2309.14509).
//
// One sequence of S tokens is split over N GPUs: GPU r holds tokens [r S/N, (r+1) S/N) and runs
// everything that works token by token (norms, projections, RoPE with global positions, MLP,
// loss) on those S/N tokens only. Attention is the one step that mixes tokens; there the split
// changes from tokens to heads with one all-to-all:
//
//   q, k, v  [S/N tokens, all heads]  --all-to-all-->  [S tokens, H/N heads]
//   attention over the whole sequence for H/N heads (our flash kernels, unchanged)
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
// one layer's worth of working buffers (not multiplied by the depth): the token-sharded qkv
// before its all-to-all, the head-sharded output and the head-sharded gradients (category
// "attention"), and the all-to-all staging (category "comm"): 2 x (S/N) x max(N x head-sharded
// qkv width, Hq d) in bf16, plus three (S/N) x Hq fp32 arrays for delta. Traffic per layer: forward qkv + out, backward d out + dqkv, each (N-1)/N of
// the local tensor.
#include <algorithm>

#include "llama.h"

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

namespace {

struct Geometry {
    int64_t T;        // local tokens
    int sp, d, Hq, Hkv, q, kv;
    int64_t QKV, W;   // local row width, head-sharded row width
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
    g.QKV = c.qkv_dim(), g.W = h.width(c.head_dim);
    g.replicas = g.Hkv >= g.sp ? 1 : g.sp / g.Hkv;
    return g;
}

inline unsigned blocks(int64_t n) { return (unsigned)std::min<int64_t>((n + 255) / 256, 1 << 30); }

// Local column (in a [T, QKV] row) of column x of destination j's head-sharded [W] row.
__device__ inline int64_t qkv_column(const Geometry& g, int j, int64_t x) {
    int head = (int)(x / g.d), i = (int)(x % g.d);
    if (head < g.q) return (int64_t)(j * g.q + head) * g.d + i;
    int kvh = g.kv_first(j) + (head - g.q) % g.kv;
    int64_t base = head < g.q + g.kv ? (int64_t)g.Hq * g.d : (int64_t)(g.Hq + g.Hkv) * g.d;
    return base + (int64_t)kvh * g.d + i;
}

// send[j][t][x] = qkv[t][qkv_column(j, x)], in 8-element pieces (head_dim is a multiple of 8).
__global__ void pack_qkv_kernel(bf16* send, const bf16* qkv, Geometry g) {
    const int64_t W8 = g.W / 8, n = (int64_t)g.sp * g.T * W8;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t x = (i % W8) * 8, t = (i / W8) % g.T;
        int j = (int)(i / (W8 * g.T));
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
            acc = __bfloat162float(recv[((int64_t)j * g.T + t) * g.W + (int64_t)(head - j * g.q) * g.d + e]);
        } else {  // KV head kvh, in the k (section 0) or v (section 1) part
            int section = head < g.Hq + g.Hkv ? 0 : 1;
            int kvh = head - g.Hq - section * g.Hkv;
            int j0 = g.replicas > 1 ? kvh * g.replicas : kvh / g.kv;
            int j1 = g.replicas > 1 ? j0 + g.replicas : j0 + 1;
            for (int j = j0; j < j1; j++) {
                int local = kvh - g.kv_first(j);
                int64_t x = (int64_t)(g.q + section * g.kv + local) * g.d + e;
                acc += __bfloat162float(recv[((int64_t)j * g.T + t) * g.W + x]);
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

// Token-sharded q, k, v -> head-sharded, straight into the layer's qkv [S, W]. Also the
// backward's first step under --ckpt=selective (q, k, v are recomputed, attention is not).
void ulysses_qkv_to_heads(Model& m, int l, cudaStream_t s) {
    const Geometry g = geometry(m);
    pack_qkv_kernel<<<blocks(g.sp * g.T * g.W / 8), 256, 0, s>>>(m.a2a_send, m.qkv_local, g);
    CUDA_CHECK_LAUNCH();
    m.comm->all_to_all(m.layers[l].qkv, m.a2a_send, g.T * g.W, DType::BF16, s);
}

void ulysses_attention_forward(Model& m, int l, cudaStream_t s) {
    const Geometry g = geometry(m);
    LayerActivations& a = m.layers[l];
    const int64_t S = g.T * g.sp, qd = (int64_t)g.q * g.d;
    ulysses_qkv_to_heads(m, l, s);
    AttentionForwardArgs fa{a.qkv, a.qkv + qd, a.qkv + qd + (int64_t)g.kv * g.d, g.W, g.W, g.W, m.att_heads, qd, a.lse};
    attention_forward(fa, {1, S, g.q, g.kv, g.d}, s);
    // Head-sharded output -> token-sharded a.att [T, Hq d]: rows of GPU j's tokens go to GPU j.
    m.comm->all_to_all(m.a2a_recv, m.att_heads, g.T * qd, DType::BF16, s);
    blocks_to_strided_kernel<bf16><<<blocks(g.sp * g.T * qd), 256, 0, s>>>(a.att, m.a2a_recv, g.T, g.sp, qd, g.sp * qd, 0, qd);
    CUDA_CHECK_LAUNCH();
}

void ulysses_attention_backward(Model& m, int l, cudaStream_t s) {
    const Geometry g = geometry(m);
    LayerActivations& a = m.layers[l];
    const int64_t S = g.T * g.sp, qd = (int64_t)g.q * g.d;
    // delta on the token-sharded side, then d out and delta to head-sharded.
    delta_kernel<<<(unsigned)((g.T * g.Hq + 7) / 8), 256, 0, s>>>(m.delta_local, m.datt, (int64_t)g.Hq * g.d, a.att,
                                                                  (int64_t)g.Hq * g.d, g.T, g.Hq, g.d);
    CUDA_CHECK_LAUNCH();
    strided_to_blocks_kernel<bf16><<<blocks(g.sp * g.T * qd), 256, 0, s>>>(m.a2a_send, m.datt, g.T, g.sp, qd, g.sp * qd, 0, qd);
    CUDA_CHECK_LAUNCH();
    m.comm->all_to_all(m.datt_heads, m.a2a_send, g.T * qd, DType::BF16, s);
    strided_to_blocks_kernel<float><<<blocks(g.T * g.Hq), 256, 0, s>>>(m.delta_send, m.delta_local, g.T, g.sp, g.q, g.Hq, 0, g.q);
    CUDA_CHECK_LAUNCH();
    m.comm->all_to_all(m.delta_recv, m.delta_send, g.T * g.q, DType::F32, s);
    transpose_kernel<<<blocks(S * g.q), 256, 0, s>>>(m.delta, m.delta_recv, 1, S, g.q);
    CUDA_CHECK_LAUNCH();
    // Attention backward on S tokens x H/N heads; out = nullptr: delta is given.
    const int64_t kvd = (int64_t)g.kv * g.d;
    AttentionBackwardArgs ba{a.qkv, a.qkv + qd, a.qkv + qd + kvd, nullptr, m.datt_heads, g.W, g.W, g.W, 0, qd,
                             a.lse, m.dqkv_heads, m.dqkv_heads + qd, m.dqkv_heads + qd + kvd, g.W, g.W, g.W, m.delta};
    ba.dq_accum = m.dq_accum;
    attention_backward(ba, {1, S, g.q, g.kv, g.d}, s);
    // Head-sharded dq, dk, dv -> token-sharded dqkv [T, QKV] (replicated KV heads summed).
    m.comm->all_to_all(m.a2a_recv, m.dqkv_heads, g.T * g.W, DType::BF16, s);
    unpack_dqkv_kernel<<<blocks(g.T * g.QKV), 256, 0, s>>>(m.dqkv, m.a2a_recv, g);
    CUDA_CHECK_LAUNCH();
}

// =============================================================================================
// Untied Ulysses (--untied[=K], ladder stage 6; the talk at 09:57; the UPipe method of the
// Untied Ulysses paper, arXiv 2602.21196).
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
// (dres times the chunk's columns of Wo) and delta straight into the send blocks, runs the
// attention backward, sends dq back at once, and sums dK, dV over the chunks of a KV group in
// place (the kernel adds to them) before sending them back. Projection weight gradients and the
// gradient of the normalized input accumulate chunk by chunk (GEMMs with beta = 1).
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
//     untied: 2 S d (2 K + 2 kv) + 8 S K
//   and untied keeps the gradient of the normalized input, 2 (S/N) D (other category; the
//   input itself is recomputed a token chunk at a time wherever a projection needs it).
// Llama 3.1 8B on 8 GPUs (q = 4, kv' = 1), K = 1: the attention term falls from 48 S d to 22 S d
// bytes (6.0 to 2.8 GiB at S = 1M; results/untied_sweep_*.json has the measured figures). The
// cost: q/K all-to-alls per direction instead of one, and projection GEMMs of K d columns.

namespace {

// How the heads of a GPU are walked. Chunk i of GPU j holds query heads
// j Hq/N + i K .. + K - 1 and their KV heads (kv of them, starting at the first's group).
struct UntiedPlan {
    int sp, K, chunks, group, kv, q_per_gpu;
    int64_t T, S, d, D;
    int64_t batch, seq;  // the attention's view: B sequences of seq tokens (B = 1 under Ulysses)
    int q_first(int j, int i) const { return j * q_per_gpu + i * K; }
    int kv_first(int j, int i) const { return q_first(j, i) / group; }
    // Whether chunk i starts a new KV group (the same for every GPU: see untied_check).
    bool new_kv(int i) const { return i == 0 || (q_per_gpu >= group && (i * K) % group == 0); }
    bool last_of_kv(int i) const { return i == chunks - 1 || new_kv(i + 1); }
};

UntiedPlan untied_plan(const Model& m) {
    const LlamaConfig& c = m.cfg;
    UntiedPlan p;
    p.sp = m.shape.sp;
    p.K = m.opt.untied;
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
    return p;
}

void chunk_all_to_all(Model& m, const UntiedPlan& p, void* out, const void* in, int64_t n, DType t, cudaStream_t s);

// Rows of the fused wqkv (and its gradient) that hold query head h, and KV head g's k and v.
int64_t q_row(const LlamaConfig& c, int h) { return (int64_t)h * c.head_dim; }
int64_t k_row(const LlamaConfig& c, int g) { return (int64_t)(c.n_heads + g) * c.head_dim; }
int64_t v_row(const LlamaConfig& c, int g) { return (int64_t)(c.n_heads + c.n_kv_heads + g) * c.head_dim; }

// The layer's normalized input, token chunk by token chunk (m.chunk_rows rows at a time, into
// the attention-norm chunk buffer xn1 / rstd1, which Untied Ulysses does not otherwise use): with
// --chunked no full-width copy of it is kept (without, one chunk is the whole sequence). Calls
// f(t0, n, xn) for each chunk.
template <class F>
void for_each_normalized_chunk(Model& m, int l, F f, cudaStream_t s) {
    const LayerActivations& a = m.layers[l];
    const int64_t T = m.shape.tokens(), D = m.cfg.dim;
    for (int64_t t0 = 0; t0 < T; t0 += m.chunk_rows) {
        const int64_t n = std::min(m.chunk_rows, T - t0);
        rmsnorm_forward(a.xn1, a.rstd1, a.x_in + t0 * D, m.w(P_ATTN_NORM, l), n, (int)D, m.cfg.norm_eps, s);
        f(t0, n, a.xn1);
    }
}

// q of chunk i for every destination (and k | v of its KV heads when the chunk starts a new KV
// group), projected straight into the send blocks, RoPE'd; then to head-sharded.
void untied_project(Model& m, const UntiedPlan& p, int l, int i, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    const int64_t w = p.K * p.d, kvw = p.kv * p.d;
    const bool kv = p.new_kv(i);
    const bf16* W = m.w(P_WQKV, l);
    for_each_normalized_chunk(m, l, [&](int64_t t0, int64_t n, const bf16* xn) {
        for (int j = 0; j < p.sp; j++) {
            bf16* q = m.untied_q_send + (int64_t)j * p.T * w + t0 * w;
            linear_forward(q, xn, W + q_row(c, p.q_first(j, i)) * p.D, nullptr, n, p.D, w, s);
            if (!kv) continue;
            bf16* k = m.untied_kv_send + (int64_t)j * p.T * 2 * kvw + t0 * 2 * kvw;
            const int g = p.kv_first(j, i);
            gemm_rm(false, true, n, kvw, p.D, xn, p.D, W + k_row(c, g) * p.D, p.D, k, 2 * kvw, false, 1.f, 0.f,
                    nullptr, s);
            gemm_rm(false, true, n, kvw, p.D, xn, p.D, W + v_row(c, g) * p.D, p.D, k + kvw, 2 * kvw, false, 1.f, 0.f,
                    nullptr, s);
        }
    }, s);
    for (int j = 0; j < p.sp; j++) {
        rope_apply(m.untied_q_send + (int64_t)j * p.T * w, p.T, 0, m.shape.seq, m.shape.first_position(), p.K,
                   (int)p.d, w, m.inv_freq, false, s);
        if (kv)
            rope_apply(m.untied_kv_send + (int64_t)j * p.T * 2 * kvw, p.T, 0, m.shape.seq, m.shape.first_position(),
                       p.kv, (int)p.d, 2 * kvw, m.inv_freq, false, s);
    }
    chunk_all_to_all(m, p, m.untied_q, m.untied_q_send, p.T * w, DType::BF16, s);
    if (kv) chunk_all_to_all(m, p, m.untied_kv, m.untied_kv_send, p.T * 2 * kvw, DType::BF16, s);
}

AttentionShape chunk_shape(const UntiedPlan& p) { return {(int)p.batch, p.seq, p.K, p.kv, (int)p.d}; }

// The chunk's all-to-all among the GPUs that share the sequence; without Ulysses (one GPU per
// sequence, data parallel or alone) it is a local copy, whatever the world is.
void chunk_all_to_all(Model& m, const UntiedPlan& p, void* out, const void* in, int64_t n, DType t, cudaStream_t s) {
    if (p.sp > 1) return m.comm->all_to_all(out, in, n, t, s);
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

void untied_forward(Model& m, int l, cudaStream_t s) {
    const UntiedPlan p = untied_plan(m);
    LayerActivations& a = m.layers[l];
    const LlamaConfig& c = m.cfg;
    const int64_t w = p.K * p.d, kvw = p.kv * p.d;
    for (int i = 0; i < p.chunks; i++) {
        untied_project(m, p, l, i, s);
        AttentionForwardArgs fa{m.untied_q, m.untied_kv, m.untied_kv + kvw, w, 2 * kvw, 2 * kvw, m.untied_o, w,
                                a.lse + (int64_t)i * p.K * p.S};
        attention_forward(fa, chunk_shape(p), s);
        // Back to token-sharded, into chunk i's columns of every GPU's share of the output.
        chunk_all_to_all(m, p, m.untied_o_recv, m.untied_o, p.T * w, DType::BF16, s);
        blocks_to_strided_kernel<bf16><<<blocks(p.sp * p.T * w), 256, 0, s>>>(
            a.att, m.untied_o_recv, p.T, p.sp, w, c.q_dim(), (int64_t)i * w, (int64_t)p.q_per_gpu * p.d);
        CUDA_CHECK_LAUNCH();
    }
}

// On entry m.dres holds d loss / d x_mid (the MLP's backward is done; Wo's weight gradient too)
// and a.att, a.lse the layer's forward. Adds d loss / d x_in into m.dres and the projection and
// norm gradients into the unit. m.dres stays d loss / d x_mid until the end (every chunk's d out
// is taken from it), so the attention side's input gradient gathers in m.untied_dxn.
void untied_backward(Model& m, int l, cudaStream_t s) {
    const UntiedPlan p = untied_plan(m);
    LayerActivations& a = m.layers[l];
    const LlamaConfig& c = m.cfg;
    const int64_t w = p.K * p.d, kvw = p.kv * p.d, QD = c.q_dim();
    const bf16* W = m.w(P_WQKV, l);
    const bf16* Wo = m.w(P_WO, l);
    float* dW = m.g(P_WQKV, l);
    bool dxn_written = false;
    auto add_dxn = [&](const bf16* dy, int64_t ld, const bf16* Wrows, int64_t rows) {  // dxn += dy Wrows
        gemm_rm(false, false, p.T, p.D, rows, dy, ld, Wrows, p.D, m.untied_dxn, p.D, false, 1.f,
                dxn_written ? 1.f : 0.f, m.untied_dxn, s);
        dxn_written = true;
    };
    for (int i = 0; i < p.chunks; i++) {
        untied_project(m, p, l, i, s);
        // d out of the chunk for every destination, straight into its send block: dres times the
        // chunk's columns of Wo (Wo's input gradient, one head chunk at a time, so no full-width
        // d out is kept), and delta = rowsum(d out * out) beside it, on the token-sharded side.
        for (int j = 0; j < p.sp; j++) {
            bf16* dout = m.untied_q_send + (int64_t)j * p.T * w;
            const int64_t col = q_row(c, p.q_first(j, i));  // the chunk's first column of att and Wo
            gemm_rm(false, false, p.T, w, p.D, m.dres, p.D, Wo + col, QD, dout, w, false, 1.f, 0.f, nullptr, s);
            delta_kernel<<<(unsigned)((p.T * p.K + 7) / 8), 256, 0, s>>>(m.untied_delta_send + (int64_t)j * p.T * p.K,
                                                                        dout, w, a.att + col, QD, p.T, p.K, (int)p.d);
            CUDA_CHECK_LAUNCH();
        }
        chunk_all_to_all(m, p, m.untied_o, m.untied_q_send, p.T * w, DType::BF16, s);  // d out [S, K d]
        chunk_all_to_all(m, p, m.untied_delta_recv, m.untied_delta_send, p.T * p.K, DType::F32, s);
        transpose_kernel<<<blocks(p.S * p.K), 256, 0, s>>>(m.untied_delta_heads, m.untied_delta_recv, p.batch, p.seq, p.K);
        CUDA_CHECK_LAUNCH();
        // Attention backward of the chunk; dK, dV summed over the chunks of a KV group in place.
        AttentionBackwardArgs ba{m.untied_q, m.untied_kv, m.untied_kv + kvw, nullptr, m.untied_o, w, 2 * kvw, 2 * kvw,
                                 0, w, a.lse + (int64_t)i * p.K * p.S, m.untied_dq, m.untied_dkv,
                                 m.untied_dkv + kvw, w, 2 * kvw, 2 * kvw, m.untied_delta_heads};
        ba.accumulate_dkv = !p.new_kv(i);
        ba.dq_accum = m.dq_accum;
        attention_backward(ba, chunk_shape(p), s);
        // dq back to token-sharded at once, RoPE undone; with a complete KV group, dk | dv too
        // (replicated heads add up). Then the input gradient, and the weight gradients token chunk
        // by token chunk against the normalized input, recomputed.
        const bool kv_done = p.last_of_kv(i);
        chunk_all_to_all(m, p, m.untied_o_recv, m.untied_dq, p.T * w, DType::BF16, s);
        if (kv_done) chunk_all_to_all(m, p, m.untied_kv_send, m.untied_dkv, p.T * 2 * kvw, DType::BF16, s);
        for (int j = 0; j < p.sp; j++) {
            bf16* dq = m.untied_o_recv + (int64_t)j * p.T * w;
            rope_apply(dq, p.T, 0, m.shape.seq, m.shape.first_position(), p.K, (int)p.d, w, m.inv_freq, true, s);
            add_dxn(dq, w, W + q_row(c, p.q_first(j, i)) * p.D, w);
            if (!kv_done) continue;
            bf16* dkv = m.untied_kv_send + (int64_t)j * p.T * 2 * kvw;
            const int g = p.kv_first(j, i);
            rope_apply(dkv, p.T, 0, m.shape.seq, m.shape.first_position(), p.kv, (int)p.d, 2 * kvw, m.inv_freq, true, s);
            add_dxn(dkv, 2 * kvw, W + k_row(c, g) * p.D, kvw);
            add_dxn(dkv + kvw, 2 * kvw, W + v_row(c, g) * p.D, kvw);
        }
        for_each_normalized_chunk(m, l, [&](int64_t t0, int64_t n, const bf16* xn) {
            for (int j = 0; j < p.sp; j++) {
                const bf16* dq = m.untied_o_recv + (int64_t)j * p.T * w + t0 * w;
                linear_backward_weight(dW + q_row(c, p.q_first(j, i)) * p.D, dq, xn, n, p.D, w, s);
                if (!kv_done) continue;
                const bf16* dkv = m.untied_kv_send + (int64_t)j * p.T * 2 * kvw + t0 * 2 * kvw;
                const int g = p.kv_first(j, i);
                gemm_rm(true, false, kvw, p.D, n, dkv, 2 * kvw, xn, p.D, dW + k_row(c, g) * p.D, p.D, true, 1.f, 1.f,
                        nullptr, s);
                gemm_rm(true, false, kvw, p.D, n, dkv + kvw, 2 * kvw, xn, p.D, dW + v_row(c, g) * p.D, p.D, true, 1.f,
                        1.f, nullptr, s);
            }
        }, s);
    }
    // The attention norm's backward, chunk by chunk (its rstd recomputed): dres += d/dx_in.
    const int64_t D = p.D;
    for_each_normalized_chunk(m, l, [&](int64_t t0, int64_t n, const bf16*) {
        rmsnorm_backward(m.dres + t0 * D, m.g(P_ATTN_NORM, l), m.untied_dxn + t0 * D, a.x_in + t0 * D,
                         m.w(P_ATTN_NORM, l), a.rstd1, n, (int)D, true, m.norm_partial, s);
    }, s);
}
