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

// [T][sp * w] <-> [sp][T][w]: a row's column block j is GPU j's (heads, or head deltas).
template <class E>
__global__ void columns_to_blocks_kernel(E* blocks_out, const E* cols, int64_t T, int sp, int64_t w) {
    const int64_t n = (int64_t)sp * T * w;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t x = i % w, t = (i / w) % T, j = i / (w * T);
        blocks_out[i] = cols[t * sp * w + j * w + x];
    }
}
template <class E>
__global__ void blocks_to_columns_kernel(E* cols, const E* blocks_in, int64_t T, int sp, int64_t w) {
    const int64_t n = (int64_t)sp * T * w;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t x = i % w, t = (i / w) % T, j = i / (w * T);
        cols[t * sp * w + j * w + x] = blocks_in[i];
    }
}

// delta[t][h] = sum over the head's d values of dout * out. One warp per (token, head).
__global__ void delta_kernel(float* delta, const bf16* dout, const bf16* out, int64_t T, int H, int d) {
    int64_t idx = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (idx >= T * H) return;
    const int64_t base = (idx / H) * (int64_t)H * d + (idx % H) * (int64_t)d;
    float acc = 0.f;
    for (int e = lane; e < d; e += 32) acc += __bfloat162float(dout[base + e]) * __bfloat162float(out[base + e]);
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) delta[idx] = acc;
}

// [S][q] -> [q][S]
__global__ void transpose_kernel(float* out, const float* in, int64_t S, int q) {
    const int64_t n = S * q;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[(i % q) * S + i / q] = in[i];
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
    blocks_to_columns_kernel<bf16><<<blocks(g.sp * g.T * qd), 256, 0, s>>>(a.att, m.a2a_recv, g.T, g.sp, qd);
    CUDA_CHECK_LAUNCH();
}

void ulysses_attention_backward(Model& m, int l, cudaStream_t s) {
    const Geometry g = geometry(m);
    LayerActivations& a = m.layers[l];
    const int64_t S = g.T * g.sp, qd = (int64_t)g.q * g.d;
    // delta on the token-sharded side, then d out and delta to head-sharded.
    delta_kernel<<<(unsigned)((g.T * g.Hq + 7) / 8), 256, 0, s>>>(m.delta_local, m.datt, a.att, g.T, g.Hq, g.d);
    CUDA_CHECK_LAUNCH();
    columns_to_blocks_kernel<bf16><<<blocks(g.sp * g.T * qd), 256, 0, s>>>(m.a2a_send, m.datt, g.T, g.sp, qd);
    CUDA_CHECK_LAUNCH();
    m.comm->all_to_all(m.datt_heads, m.a2a_send, g.T * qd, DType::BF16, s);
    columns_to_blocks_kernel<float><<<blocks(g.T * g.Hq), 256, 0, s>>>(m.delta_send, m.delta_local, g.T, g.sp, g.q);
    CUDA_CHECK_LAUNCH();
    m.comm->all_to_all(m.delta_recv, m.delta_send, g.T * g.q, DType::F32, s);
    transpose_kernel<<<blocks(S * g.q), 256, 0, s>>>(m.delta, m.delta_recv, S, g.q);
    CUDA_CHECK_LAUNCH();
    // Attention backward on S tokens x H/N heads; out = nullptr: delta is given.
    const int64_t kvd = (int64_t)g.kv * g.d;
    AttentionBackwardArgs ba{a.qkv, a.qkv + qd, a.qkv + qd + kvd, nullptr, m.datt_heads, g.W, g.W, g.W, 0, qd,
                             a.lse, m.dqkv_heads, m.dqkv_heads + qd, m.dqkv_heads + qd + kvd, g.W, g.W, g.W, m.delta};
    attention_backward(ba, {1, S, g.q, g.kv, g.d}, s);
    // Head-sharded dq, dk, dv -> token-sharded dqkv [T, QKV] (replicated KV heads summed).
    m.comm->all_to_all(m.a2a_recv, m.dqkv_heads, g.T * g.W, DType::BF16, s);
    unpack_dqkv_kernel<<<blocks(g.T * g.QKV), 256, 0, s>>>(m.dqkv, m.a2a_recv, g);
    CUDA_CHECK_LAUNCH();
}
