// kernels/kernels.cu - the kernels of the model's layers, each next to its launcher, each with its math
// in one comment: the embedding lookup and its deterministic backward, RMSNorm, RoPE, SwiGLU, the
// fused cross-entropy (whole or in vocabulary pieces), deterministic sums, AdamW, fills and the
// seeded initialization. llama.cu calls them; attention's kernels live in attention.cu and
// attention_hopper.cu. Shapes are row-major [T, width], T tokens; bf16 in and out, fp32 math.
#include <cmath>

#include "kernels/kernels.h"
#include "kernels/documents.cuh"
// =============================================================================================
// Small device helpers.
namespace {

constexpr int WARP = 32;

__device__ inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ inline float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// 8 bf16 <-> 8 floats through one 16-byte access.
__device__ inline void load8(const bf16* p, float f[8]) {
    uint4 u = *(const uint4*)p;
    const __nv_bfloat162* h = (const __nv_bfloat162*)&u;
    for (int i = 0; i < 4; i++) {
        float2 t = __bfloat1622float2(h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}
__device__ inline void store8(bf16* p, const float f[8]) {
    uint4 u;
    __nv_bfloat162* h = (__nv_bfloat162*)&u;
    for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    *(uint4*)p = u;
}

inline unsigned grid_for(int64_t n, int block) {
    int64_t g = (n + block - 1) / block;
    return (unsigned)std::min<int64_t>(g, 1 << 30);
}

}  // namespace

// =============================================================================================
// Embedding
__global__ void embedding_forward_kernel(bf16* x, const int32_t* tokens, const bf16* rows, int64_t row0,
                                         int64_t n_rows, int64_t T, int D) {
    int64_t vec_per_row = D / 8;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < T * vec_per_row;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t t = i / vec_per_row, c = (i % vec_per_row) * 8, r = (int64_t)tokens[t] - row0;
        if (r >= 0 && r < n_rows) *(uint4*)(x + t * D + c) = *(const uint4*)(rows + r * D + c);
    }
}

void embedding_forward(bf16* x, const int32_t* tokens, const bf16* rows, int64_t row0, int64_t n_rows, int64_t T,
                       int D, cudaStream_t s) {
    embedding_forward_kernel<<<grid_for(T * D / 8, 256), 256, 0, s>>>(x, tokens, rows, row0, n_rows, T, D);
    CUDA_CHECK_LAUNCH();
}

void EmbeddingGroups::build(const int32_t* tokens, int64_t T) {
    // Counting sort by token id, stable, so positions stay ascending within each group.
    int32_t max_tok = 0;
    for (int64_t t = 0; t < T; t++) max_tok = std::max(max_tok, tokens[t]);
    std::vector<int64_t> count(max_tok + 2, 0);
    for (int64_t t = 0; t < T; t++) count[tokens[t] + 1]++;
    for (size_t i = 1; i < count.size(); i++) count[i] += count[i - 1];
    position.assign(T, 0);
    std::vector<int64_t> next(count.begin(), count.end() - 1);
    for (int64_t t = 0; t < T; t++) position[next[tokens[t]]++] = t;
    token.clear();
    begin.clear();
    for (int32_t v = 0; v <= max_tok; v++)
        if (count[v + 1] > count[v]) {
            token.push_back(v);
            begin.push_back(count[v]);
        }
    begin.push_back(T);
}

// One block per distinct token: sum its rows of dx in position order, add to the gradient.
__global__ void embedding_backward_kernel(float* drows, int64_t row0, const bf16* dx, const int32_t* tok,
                                          const int64_t* begin, const int64_t* pos, int D) {
    int64_t gi = blockIdx.x;
    float* out = drows + ((int64_t)tok[gi] - row0) * D;
    for (int c = threadIdx.x * 2; c < D; c += blockDim.x * 2) {
        float2 acc = {0.f, 0.f};
        for (int64_t j = begin[gi]; j < begin[gi + 1]; j++) {
            float2 v = __bfloat1622float2(*(const __nv_bfloat162*)(dx + pos[j] * D + c));
            acc.x += v.x;
            acc.y += v.y;
        }
        out[c] += acc.x;
        out[c + 1] += acc.y;
    }
}

void embedding_backward(float* drows, int64_t row0, const bf16* dx, const int32_t* group_token,
                        const int64_t* group_begin, const int64_t* positions, int64_t n_groups,
                        int D, cudaStream_t s) {
    if (n_groups == 0) return;
    embedding_backward_kernel<<<(unsigned)n_groups, 256, 0, s>>>(drows, row0, dx, group_token,
                                                                  group_begin, positions, D);
    CUDA_CHECK_LAUNCH();
}

// =============================================================================================
// RMSNorm: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps). One warp per row.
__global__ void rmsnorm_forward_kernel(bf16* y, float* rstd, const bf16* x, const bf16* w,
                                       int64_t T, int D, float eps) {
    int64_t row = blockIdx.x * (int64_t)(blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= T) return;
    const bf16* xr = x + row * D;
    float f[8], wf[8], ss = 0.f;
    for (int c = lane * 8; c < D; c += WARP * 8) {
        load8(xr + c, f);
        for (int i = 0; i < 8; i++) ss += f[i] * f[i];
    }
    float r = rsqrtf(warp_sum(ss) / D + eps);
    for (int c = lane * 8; c < D; c += WARP * 8) {
        load8(xr + c, f);
        load8(w + c, wf);
        for (int i = 0; i < 8; i++) f[i] = f[i] * r * wf[i];
        store8(y + row * D + c, f);
    }
    if (lane == 0) rstd[row] = r;
}

void rmsnorm_forward(bf16* y, float* rstd, const bf16* x, const bf16* w, int64_t T, int D,
                     float eps, cudaStream_t s) {
    rmsnorm_forward_kernel<<<grid_for(T, 8), 8 * WARP, 0, s>>>(y, rstd, x, w, T, D, eps);
    CUDA_CHECK_LAUNCH();
}

// dx_j = rstd * w_j dy_j - rstd^3 / D * x_j * sum_i(w_i dy_i x_i). One warp per row.
__global__ void rmsnorm_backward_dx_kernel(bf16* dx, const bf16* dy, const bf16* x,
                                           const bf16* w, const float* rstd, int64_t T, int D,
                                           bool accumulate) {
    int64_t row = blockIdx.x * (int64_t)(blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= T) return;
    const bf16 *dyr = dy + row * D, *xr = x + row * D;
    float fd[8], fx[8], fw[8], dot = 0.f;
    for (int c = lane * 8; c < D; c += WARP * 8) {
        load8(dyr + c, fd);
        load8(xr + c, fx);
        load8(w + c, fw);
        for (int i = 0; i < 8; i++) dot += fw[i] * fd[i] * fx[i];
    }
    dot = warp_sum(dot);
    float r = rstd[row], k = r * r * r * dot / D;
    for (int c = lane * 8; c < D; c += WARP * 8) {
        load8(dyr + c, fd);
        load8(xr + c, fx);
        load8(w + c, fw);
        float out[8], old[8];
        if (accumulate) load8(dx + row * D + c, old);
        for (int i = 0; i < 8; i++)
            out[i] = r * fw[i] * fd[i] - k * fx[i] + (accumulate ? old[i] : 0.f);
        store8(dx + row * D + c, out);
    }
}

// dw_i = sum_t dy_ti x_ti rstd_t, in two deterministic passes: NORM_CHUNKS row chunks write
// partial sums, then a fixed-order sum over the chunks.
static constexpr int NORM_CHUNKS = 256;
int64_t rmsnorm_partial_floats(int D) { return (int64_t)NORM_CHUNKS * D; }

__global__ void rmsnorm_backward_dw_partial_kernel(float* partial, const bf16* dy, const bf16* x,
                                                   const float* rstd, int64_t T, int D) {
    int c = (blockIdx.x * blockDim.x + threadIdx.x) * 2;
    if (c >= D) return;
    int64_t rows_per_chunk = (T + NORM_CHUNKS - 1) / NORM_CHUNKS;
    int64_t t0 = blockIdx.y * rows_per_chunk, t1 = min(T, t0 + rows_per_chunk);
    float2 acc = {0.f, 0.f};
    for (int64_t t = t0; t < t1; t++) {
        float2 d = __bfloat1622float2(*(const __nv_bfloat162*)(dy + t * D + c));
        float2 v = __bfloat1622float2(*(const __nv_bfloat162*)(x + t * D + c));
        float r = rstd[t];
        acc.x += d.x * v.x * r;
        acc.y += d.y * v.y * r;
    }
    partial[(int64_t)blockIdx.y * D + c] = acc.x;
    partial[(int64_t)blockIdx.y * D + c + 1] = acc.y;
}

__global__ void sum_chunks_kernel(float* out, const float* partial, int chunks, int D) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= D) return;
    float acc = 0.f;
    for (int k = 0; k < chunks; k++) acc += partial[(int64_t)k * D + c];
    out[c] += acc;
}

void rmsnorm_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w,
                      const float* rstd, int64_t T, int D, bool accumulate_dx, float* partial,
                      cudaStream_t s) {
    rmsnorm_backward_dx_kernel<<<grid_for(T, 8), 8 * WARP, 0, s>>>(dx, dy, x, w, rstd, T, D,
                                                                    accumulate_dx);
    CUDA_CHECK_LAUNCH();
    dim3 grid(grid_for(D / 2, 128), NORM_CHUNKS);
    rmsnorm_backward_dw_partial_kernel<<<grid, 128, 0, s>>>(partial, dy, x, rstd, T, D);
    CUDA_CHECK_LAUNCH();
    sum_chunks_kernel<<<grid_for(D, 256), 256, 0, s>>>(dw, partial, NORM_CHUNKS, D);
    CUDA_CHECK_LAUNCH();
}

// =============================================================================================
// RMSNorm of each head (Qwen3's q_norm, k_norm): the same formulas over each head's d values,
// with one gain w [d] shared by the heads. One warp per (row, head); lane i holds the values
// 2i, 2i + 1 of every 64 (at most 8 values: d <= 256).
constexpr int HEAD_NORM_MAX = 8;

__device__ inline int head_norm_load(const bf16* p, int d, int lane, float v[HEAD_NORM_MAX]) {
    int n = 0;
    for (int c = 2 * lane; c < d; c += 2 * WARP, n += 2) {
        const float2 f = __bfloat1622float2(*(const __nv_bfloat162*)(p + c));
        v[n] = f.x, v[n + 1] = f.y;
    }
    return n;
}

static void check_head_norm_dim(int d) {
    if (d % 64 || d > 32 * HEAD_NORM_MAX) runtime_error("head_rmsnorm: head dim must be a multiple of 64, at most 256");
}

__global__ void head_rmsnorm_forward_kernel(bf16* x, int64_t ld, const bf16* w, int64_t n_rows, int heads, int d,
                                            float eps) {
    const int64_t pair = blockIdx.x * (int64_t)(blockDim.x / WARP) + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (pair >= n_rows * heads) return;
    bf16* p = x + (pair / heads) * ld + (pair % heads) * d;
    float v[HEAD_NORM_MAX], wf[HEAD_NORM_MAX], ss = 0.f;
    const int n = head_norm_load(p, d, lane, v);
    head_norm_load(w, d, lane, wf);
    for (int i = 0; i < n; i++) ss += v[i] * v[i];
    const float r = rsqrtf(warp_sum(ss) / d + eps);
    for (int i = 0, c = 2 * lane; i < n; i += 2, c += 2 * WARP)
        *(__nv_bfloat162*)(p + c) = __floats2bfloat162_rn(v[i] * r * wf[i], v[i + 1] * r * wf[i + 1]);
}

void head_rmsnorm_forward(bf16* x, int64_t ld, const bf16* w, int64_t n_rows, int heads, int d, float eps,
                          cudaStream_t s) {
    check_head_norm_dim(d);
    head_rmsnorm_forward_kernel<<<grid_for(n_rows * heads, 8), 8 * WARP, 0, s>>>(x, ld, w, n_rows, heads, d, eps);
    CUDA_CHECK_LAUNCH();
}

// dx_j = r w_j dy_j - r^3 / d * x_j * sum_i(w_i dy_i x_i), dw_j += dy_j x_j r (r recomputed from x).
// Deterministic: NORM_CHUNKS blocks each take a fixed range of (row, head) pairs, its warps the
// pairs in turn; each block sums its warps' dw in a fixed order into its partial row, and
// sum_chunks_kernel adds the rows in order. dx goes over dy in place (read first).
__global__ void head_rmsnorm_backward_kernel(bf16* dy, int64_t ld, const bf16* x, int64_t ldx, const bf16* w,
                                             float* partial, int64_t n_rows, int heads, int d, float eps) {
    __shared__ float warp_dw[8][32 * HEAD_NORM_MAX];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, warps = blockDim.x / WARP;
    const int64_t pairs = n_rows * heads, per_chunk = (pairs + gridDim.x - 1) / gridDim.x;
    const int64_t p0 = blockIdx.x * per_chunk, p1 = min(pairs, p0 + per_chunk);
    float wf[HEAD_NORM_MAX], acc[HEAD_NORM_MAX] = {};
    const int n = head_norm_load(w, d, lane, wf);
    for (int64_t pair = p0 + warp; pair < p1; pair += warps) {
        const int64_t row = pair / heads, h = pair % heads;
        bf16* g = dy + row * ld + h * d;
        float xv[HEAD_NORM_MAX], gv[HEAD_NORM_MAX], ss = 0.f, dot = 0.f;
        head_norm_load(x + row * ldx + h * d, d, lane, xv);
        head_norm_load(g, d, lane, gv);
        for (int i = 0; i < n; i++) ss += xv[i] * xv[i], dot += wf[i] * gv[i] * xv[i];
        const float r = rsqrtf(warp_sum(ss) / d + eps), k = r * r * r * warp_sum(dot) / d;
        for (int i = 0; i < n; i++) acc[i] += gv[i] * xv[i] * r;
        for (int i = 0, c = 2 * lane; i < n; i += 2, c += 2 * WARP)
            *(__nv_bfloat162*)(g + c) =
                __floats2bfloat162_rn(r * wf[i] * gv[i] - k * xv[i], r * wf[i + 1] * gv[i + 1] - k * xv[i + 1]);
    }
    for (int i = 0, c = 2 * lane; i < n; i += 2, c += 2 * WARP) warp_dw[warp][c] = acc[i], warp_dw[warp][c + 1] = acc[i + 1];
    __syncthreads();
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float sum = 0.f;
        for (int k = 0; k < warps; k++) sum += warp_dw[k][c];
        partial[(int64_t)blockIdx.x * d + c] = sum;
    }
}

void head_rmsnorm_backward(bf16* dy, int64_t ld, const bf16* x, int64_t ldx, const bf16* w, float* dw,
                           int64_t n_rows, int heads, int d, float eps, float* partial, cudaStream_t s) {
    check_head_norm_dim(d);
    head_rmsnorm_backward_kernel<<<NORM_CHUNKS, 8 * WARP, 0, s>>>(dy, ld, x, ldx, w, partial, n_rows, heads, d, eps);
    CUDA_CHECK_LAUNCH();
    sum_chunks_kernel<<<grid_for(d, 256), 256, 0, s>>>(dw, partial, NORM_CHUNKS, d);
    CUDA_CHECK_LAUNCH();
}

// =============================================================================================
// RoPE, HF rotate-half layout: for i < d/2, (x_i, x_{i+d/2}) rotated by pos * inv_freq_i.
// The angle is formed in float64 and reduced modulo 2 pi before the float sine and cosine:
// at position 5M a float angle would be off by a whole radian.
// A token's position: its place in its sequence, or with packed documents its document's first
// position plus its distance from the document's start (the last start at or before it).
__device__ inline int64_t rope_position(int64_t flat, int64_t in_seq, const DocPositions& docs) {
    if (!docs.start) return in_seq;
    const int64_t d = document_index(docs.start, docs.count, flat);
    return docs.first[d] + flat - docs.start[d];
}

__global__ void rope_kernel(bf16* x, int64_t n_rows, int64_t row0, int64_t seq, int64_t pos0,
                            int n_heads, int head_dim, int64_t ld, const double* inv_freq,
                            bool inverse, DocPositions docs) {
    int half = head_dim / 2;
    int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (idx >= n_rows * half) return;
    int64_t r = idx / half;
    int i = (int)(idx % half);
    const int64_t t = row0 + r, in_seq = pos0 + t % seq, flat = t / seq * seq + in_seq;
    double angle = fmod((double)rope_position(flat, in_seq, docs) * inv_freq[i], 6.283185307179586);
    float sn, cs;
    sincosf((float)angle, &sn, &cs);
    if (inverse) sn = -sn;
    bf16* row = x + r * ld;
    for (int h = 0; h < n_heads; h++) {
        bf16* p = row + (int64_t)h * head_dim;
        float x1 = __bfloat162float(p[i]), x2 = __bfloat162float(p[i + half]);
        p[i] = __float2bfloat16(x1 * cs - x2 * sn);
        p[i + half] = __float2bfloat16(x2 * cs + x1 * sn);
    }
}

void rope_apply(bf16* x, int64_t n_rows, int64_t row0, int64_t seq, int64_t pos0, int n_heads,
                int head_dim, int64_t ld, const double* inv_freq, bool inverse, cudaStream_t s,
                const DocPositions& docs) {
    int64_t n = n_rows * (head_dim / 2);
    if (n == 0) return;
    rope_kernel<<<grid_for(n, 256), 256, 0, s>>>(x, n_rows, row0, seq, pos0, n_heads, head_dim,
                                                  ld, inv_freq, inverse, docs);
    CUDA_CHECK_LAUNCH();
}

// =============================================================================================
// SwiGLU: act = silu(gate) * up, h13 = [gate | up] per row.
__global__ void swiglu_forward_kernel(bf16* act, const bf16* h13, int64_t T, int F) {
    int64_t n = T * F / 2;  // pairs
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t t = (2 * i) / F, c = (2 * i) % F;
        float2 g = __bfloat1622float2(*(const __nv_bfloat162*)(h13 + t * 2 * F + c));
        float2 u = __bfloat1622float2(*(const __nv_bfloat162*)(h13 + t * 2 * F + F + c));
        float a0 = g.x / (1.f + __expf(-g.x)) * u.x, a1 = g.y / (1.f + __expf(-g.y)) * u.y;
        *(__nv_bfloat162*)(act + t * F + c) = __floats2bfloat162_rn(a0, a1);
    }
}

__device__ inline void swiglu_grad(float g, float u, float da, float& dg, float& du) {
    float sg = 1.f / (1.f + __expf(-g));
    du = da * g * sg;
    dg = da * u * sg * (1.f + g * (1.f - sg));
}

__global__ void swiglu_backward_kernel(bf16* dh13, const bf16* dact, const bf16* h13, int64_t T,
                                       int F) {
    int64_t n = T * F / 2;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t t = (2 * i) / F, c = (2 * i) % F;
        float2 g = __bfloat1622float2(*(const __nv_bfloat162*)(h13 + t * 2 * F + c));
        float2 u = __bfloat1622float2(*(const __nv_bfloat162*)(h13 + t * 2 * F + F + c));
        float2 d = __bfloat1622float2(*(const __nv_bfloat162*)(dact + t * F + c));
        float dg0, du0, dg1, du1;
        swiglu_grad(g.x, u.x, d.x, dg0, du0);
        swiglu_grad(g.y, u.y, d.y, dg1, du1);
        *(__nv_bfloat162*)(dh13 + t * 2 * F + c) = __floats2bfloat162_rn(dg0, dg1);
        *(__nv_bfloat162*)(dh13 + t * 2 * F + F + c) = __floats2bfloat162_rn(du0, du1);
    }
}

void swiglu_forward(bf16* act, const bf16* h13, int64_t T, int F, cudaStream_t s) {
    swiglu_forward_kernel<<<grid_for(T * F / 2, 256), 256, 0, s>>>(act, h13, T, F);
    CUDA_CHECK_LAUNCH();
}

void swiglu_backward(bf16* dh13, const bf16* dact, const bf16* h13, int64_t T, int F,
                     cudaStream_t s) {
    swiglu_backward_kernel<<<grid_for(T * F / 2, 256), 256, 0, s>>>(dh13, dact, h13, T, F);
    CUDA_CHECK_LAUNCH();
}

// =============================================================================================
// Cross-entropy, forward and backward fused: one block per row. Pass 1: online max and sum of
// exponentials; pass 2: dlogits = (softmax - onehot) * grad_scale, written over the logits.
static constexpr int CE_THREADS = 512;

// A row's max and sum of exp(x - max), over a block of CE_THREADS threads; every thread
// returns them (blockwise online softmax).
__device__ void row_max_sumexp(const bf16* lr, int V, float* row_max, float* row_sum) {
    float m = -INFINITY, sum = 0.f, f[8];
    for (int c = threadIdx.x * 8; c < V; c += blockDim.x * 8) {
        load8(lr + c, f);
        float mx = f[0];
        for (int i = 1; i < 8; i++) mx = fmaxf(mx, f[i]);
        float mnew = fmaxf(m, mx);
        sum *= __expf(m - mnew);
        for (int i = 0; i < 8; i++) sum += __expf(f[i] - mnew);
        m = mnew;
    }
    // Combine (m, sum) over the block: warps first, then the warps' results. A thread (or a
    // whole warp) that saw no element has m = -inf and contributes nothing; exp(m - max) is
    // never evaluated for it (it would be exp(-inf + inf) = NaN).
    __shared__ float sm[CE_THREADS / WARP], ss[CE_THREADS / WARP];
    __shared__ float block_max, block_sum;
    float wm = warp_max(m);
    sum = warp_sum(m == -INFINITY ? 0.f : sum * __expf(m - wm));
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (lane == 0) sm[warp] = wm, ss[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        float M = sm[0], S = 0.f;
        for (int w = 1; w < (int)blockDim.x / WARP; w++) M = fmaxf(M, sm[w]);
        for (int w = 0; w < (int)blockDim.x / WARP; w++)
            if (sm[w] != -INFINITY) S += ss[w] * __expf(sm[w] - M);
        block_max = M, block_sum = S;
    }
    __syncthreads();
    *row_max = block_max, *row_sum = block_sum;
}

// d logits = (softmax - one-hot(target)) * scale, in place, for columns col0 .. col0 + V - 1 of
// the row (target counted from column 0 of the whole vocabulary).
__device__ void row_softmax_gradient(bf16* lr, int V, int64_t col0, float lse, int target, float scale) {
    float f[8];
    for (int c = threadIdx.x * 8; c < V; c += blockDim.x * 8) {
        load8(lr + c, f);
        for (int i = 0; i < 8; i++) f[i] = (__expf(f[i] - lse) - (col0 + c + i == target)) * scale;
        store8(lr + c, f);
    }
}

__global__ void cross_entropy_kernel(bf16* logits, float* losses, const int32_t* targets, int V,
                                     float grad_scale) {
    int64_t row = blockIdx.x;
    bf16* lr = logits + row * V;
    int target = targets[row];
    float M, S;
    row_max_sumexp(lr, V, &M, &S);
    float lse = M + logf(S);
    if (threadIdx.x == 0) losses[row] = target < 0 ? 0.f : lse - __bfloat162float(lr[target]);
    __syncthreads();  // the loss has read its logit before the gradient overwrites it
    row_softmax_gradient(lr, V, 0, lse, target, target < 0 ? 0.f : grad_scale);
}

void cross_entropy_forward_backward(bf16* logits, float* losses, const int32_t* targets,
                                    int64_t T, int V, float grad_scale, cudaStream_t s) {
    if (T == 0) return;
    cross_entropy_kernel<<<(unsigned)T, CE_THREADS, 0, s>>>(logits, losses, targets, V,
                                                            grad_scale);
    CUDA_CHECK_LAUNCH();
}

// The cross-entropy of logits that come in pieces of columns (beyond/savings.cu lm_head_in_pieces).
// Piece by piece: each row's running max and sum of exponentials, and its target's logit.
__global__ void cross_entropy_piece_stats_kernel(const bf16* logits, int V, int64_t col0, const int32_t* targets,
                                                 float* run_max, float* run_sum, float* target_logit, bool first) {
    int64_t row = blockIdx.x;
    const bf16* lr = logits + row * V;
    float M, S;
    row_max_sumexp(lr, V, &M, &S);
    if (threadIdx.x != 0) return;
    if (first) {
        run_max[row] = M, run_sum[row] = S;
    } else {
        float m0 = run_max[row], m1 = fmaxf(m0, M);
        run_sum[row] = run_sum[row] * __expf(m0 - m1) + S * __expf(M - m1);
        run_max[row] = m1;
    }
    int64_t t = (int64_t)targets[row] - col0;
    if (t >= 0 && t < V) target_logit[row] = __bfloat162float(lr[t]);
}

void cross_entropy_piece_stats(const bf16* logits, int64_t T, int V, int64_t col0, const int32_t* targets,
                               float* run_max, float* run_sum, float* target_logit, bool first, cudaStream_t s) {
    if (T == 0) return;
    cross_entropy_piece_stats_kernel<<<(unsigned)T, CE_THREADS, 0, s>>>(logits, V, col0, targets, run_max, run_sum,
                                                                        target_logit, first);
    CUDA_CHECK_LAUNCH();
}

// After the last piece: lse = max + log(sum) (in place of the max), and the loss.
__global__ void cross_entropy_piece_loss_kernel(float* losses, float* max_to_lse, const float* run_sum,
                                                const float* target_logit, const int32_t* targets, int64_t T) {
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < T; t += (int64_t)gridDim.x * blockDim.x) {
        float lse = max_to_lse[t] + logf(run_sum[t]);
        max_to_lse[t] = lse;
        losses[t] = targets[t] < 0 ? 0.f : lse - target_logit[t];
    }
}

void cross_entropy_piece_loss(float* losses, float* max_to_lse, const float* run_sum, const float* target_logit,
                              const int32_t* targets, int64_t T, cudaStream_t s) {
    if (T == 0) return;
    cross_entropy_piece_loss_kernel<<<grid_for(T, 256), 256, 0, s>>>(losses, max_to_lse, run_sum, target_logit,
                                                                      targets, T);
    CUDA_CHECK_LAUNCH();
}

__global__ void cross_entropy_piece_backward_kernel(bf16* logits, int V, int64_t col0, const float* lse,
                                                    const int32_t* targets, float grad_scale) {
    int64_t row = blockIdx.x;
    int target = targets[row];
    row_softmax_gradient(logits + row * V, V, col0, lse[row], target, target < 0 ? 0.f : grad_scale);
}

void cross_entropy_piece_backward(bf16* logits, int64_t T, int V, int64_t col0, const float* lse,
                                  const int32_t* targets, float grad_scale, cudaStream_t s) {
    if (T == 0) return;
    cross_entropy_piece_backward_kernel<<<(unsigned)T, CE_THREADS, 0, s>>>(logits, V, col0, lse, targets, grad_scale);
    CUDA_CHECK_LAUNCH();
}

// =============================================================================================
// Deterministic reductions: SUM_BLOCKS fixed-stride partial sums, then one block sums them.
static constexpr int SUM_BLOCKS = 512, SUM_THREADS = 256;
int64_t sum_scratch_floats() { return SUM_BLOCKS; }

template <bool SQUARE>
__global__ void sum_partial_kernel(float* partial, const float* x, int64_t n) {
    float acc = 0.f;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        acc += SQUARE ? x[i] * x[i] : x[i];
    __shared__ float sh[SUM_THREADS / WARP];
    acc = warp_sum(acc);
    if (threadIdx.x % WARP == 0) sh[threadIdx.x / WARP] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.f;
        for (int w = 0; w < SUM_THREADS / WARP; w++) t += sh[w];
        partial[blockIdx.x] = t;
    }
}

__global__ void sum_final_kernel(float* out, const float* partial, int n) {
    __shared__ float sh[SUM_THREADS];
    float acc = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
    sh[threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.f;
        for (int i = 0; i < (int)blockDim.x; i++) t += sh[i];
        *out = t;
    }
}

template <bool SQUARE>
static void reduce_floats(float* out, const float* x, int64_t n, float* scratch, cudaStream_t s) {
    sum_partial_kernel<SQUARE><<<SUM_BLOCKS, SUM_THREADS, 0, s>>>(scratch, x, n);
    CUDA_CHECK_LAUNCH();
    sum_final_kernel<<<1, SUM_THREADS, 0, s>>>(out, scratch, SUM_BLOCKS);
    CUDA_CHECK_LAUNCH();
}
void sum_floats(float* out, const float* x, int64_t n, float* scratch, cudaStream_t s) {
    reduce_floats<false>(out, x, n, scratch, s);
}
void sum_squares(float* out, const float* x, int64_t n, float* scratch, cudaStream_t s) {
    reduce_floats<true>(out, x, n, scratch, s);
}

// =============================================================================================
// AdamW (torch.optim.AdamW): decoupled decay, bias-corrected moments, bf16 copy written.
__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n,
                             AdamW o, bool decay, const float* grad_scale, float bc1,
                             float bc2_sqrt) {
    float gs = *grad_scale;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float gi = g[i] * gs;
        float mi = o.beta1 * m[i] + (1.f - o.beta1) * gi;
        float vi = o.beta2 * v[i] + (1.f - o.beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float pi = p[i];
        if (decay) pi *= 1.f - o.lr * o.weight_decay;
        pi -= (o.lr / bc1) * mi / (sqrtf(vi) / bc2_sqrt + o.eps);
        p[i] = pi;
    }
}

void adamw_update(float* master, const float* grad, float* m, float* v,
                  int64_t n, const AdamW& o, bool decay, const float* grad_scale,
                  cudaStream_t s) {
    float bc1 = 1.f - std::pow(o.beta1, (float)o.step);
    float bc2_sqrt = std::sqrt(1.f - std::pow(o.beta2, (float)o.step));
    adamw_kernel<<<grid_for(n, 256), 256, 0, s>>>(master, grad, m, v, n, o, decay,
                                                   grad_scale, bc1, bc2_sqrt);
    CUDA_CHECK_LAUNCH();
}

__global__ void clip_scale_kernel(float* scale, const float* sumsq, float max_norm) {
    float norm = sqrtf(*sumsq);
    *scale = (max_norm > 0.f && norm > max_norm) ? max_norm / (norm + 1e-6f) : 1.f;
}

void clip_scale(float* grad_scale, const float* sumsq, float max_norm, cudaStream_t s) {
    clip_scale_kernel<<<1, 1, 0, s>>>(grad_scale, sumsq, max_norm);
    CUDA_CHECK_LAUNCH();
}

// =============================================================================================
// Fills and deterministic initialization.
__global__ void fill_bf16_kernel(bf16* x, int64_t n, float value) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = __float2bfloat16(value);
}
void fill_bf16(bf16* x, int64_t n, float value, cudaStream_t s) {
    fill_bf16_kernel<<<grid_for(n, 256), 256, 0, s>>>(x, n, value);
    CUDA_CHECK_LAUNCH();
}

__global__ void f32_to_bf16_kernel(bf16* out, const float* in, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16(in[i]);
}
void convert_f32_to_bf16(bf16* out, const float* in, int64_t n, cudaStream_t s) {
    f32_to_bf16_kernel<<<grid_for(n, 256), 256, 0, s>>>(out, in, n);
    CUDA_CHECK_LAUNCH();
}

__device__ inline uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Value i depends only on (seed, i): the same weights whatever the launch shape. In bf16 it is
// the fp32 value rounded, as convert_f32_to_bf16 rounds the fp32 master.
template <typename T>
__global__ void init_normal_kernel(T* x, int64_t n, float stddev, uint64_t seed, int64_t index0) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint64_t r = splitmix64(seed ^ splitmix64((uint64_t)(index0 + i)));
        float u1 = ((r >> 40) + 1) * (1.0f / 16777217.0f);  // (0, 1]
        float u2 = ((r >> 16) & 0xffffff) * (1.0f / 16777216.0f);
        x[i] = (T)(stddev * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
    }
}
void init_normal(float* x, int64_t n, float stddev, uint64_t seed, cudaStream_t s, int64_t index0) {
    init_normal_kernel<<<grid_for(n, 256), 256, 0, s>>>(x, n, stddev, seed, index0);
    CUDA_CHECK_LAUNCH();
}
void init_normal_bf16(bf16* x, int64_t n, float stddev, uint64_t seed, cudaStream_t s, int64_t index0) {
    init_normal_kernel<<<grid_for(n, 256), 256, 0, s>>>(x, n, stddev, seed, index0);
    CUDA_CHECK_LAUNCH();
}

__global__ void init_constant_kernel(float* x, int64_t n, float value) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = value;
}
void init_constant(float* x, int64_t n, float value, cudaStream_t s) {
    init_constant_kernel<<<grid_for(n, 256), 256, 0, s>>>(x, n, value);
    CUDA_CHECK_LAUNCH();
}

