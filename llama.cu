// llama.cu - Llama 3 on one GPU: the tracked allocator, cuBLASLt matrix products, the kernels
// of every layer (embedding, RMSNorm, RoPE, SwiGLU, cross-entropy, AdamW), and one training
// step's forward and backward. Attention's kernels live in attention_hopper.cu (the fast ones,
// and attention_forward/_backward, which pick the kernels) and attention.cu (the reference).
//
// The step, for T = batch * seq tokens (shapes row-major, bf16 unless noted):
//
//   x = embed[tokens]                                   [T, D]
//   for each layer l:
//     xn1, rstd1 = rmsnorm(x)                           rstd fp32 [T]
//     qkv = xn1 @ Wqkv^T ; rope(q, k)                   [T, (Hq + 2 Hkv) d]
//     att, lse = flash_attention(q, k, v)               [T, Hq d], lse fp32 [B, Hq, S]
//     x_mid = x + att @ Wo^T                            (one GEMM with the residual as C)
//     xn2, rstd2 = rmsnorm(x_mid)
//     h13 = xn2 @ W13^T ; act = silu(gate) * up         [T, 2F], [T, F]
//     x = x_mid + act @ W2^T
//   logits = rmsnorm(x) @ Whead^T                       [T, V]
//   loss = mean cross-entropy; dlogits overwrite logits in the same kernel
//
// The embedding and the LM head come in units of vocabulary rows, each no larger than a layer
// (common.h param_layout): the lookup fills each token's row from its piece, and the head takes
// two passes over its pieces when there are several (lm_head_in_pieces), one when there is one.
//
// The backward walks the same path in reverse with one residual-gradient buffer `dres` that
// every branch adds into. Weight gradients accumulate in fp32 (GEMMs with beta = 1) into a flat
// gradient buffer zeroed at the start of the step; every reduction is deterministic (fixed
// order, no atomics), so the same seed gives the same losses.
//
// Every per-token piece of a layer is written over a token range [t0, t1), and the layers walk
// their tokens in chunks: one chunk of all T tokens in the plain step, chunks of C tokens under
// --chunked (chunked.cu). The plain step keeps every activation for the backward. The memory
// techniques are called through named hooks, each a no-op or the plain path when its flag is
// off; where they enter:
//
//   model_declare_buffers   each technique's *_plan (what is kept, and where), then its own
//                           buffers (fsdp_, ulysses_, untied_declare_buffers); declare_activations
//                           sizes qkv and lse for this GPU's heads (Ulysses) and the chunk rows;
//                           attention_call_shape: one call's heads (Ulysses, Untied)
//   model_allocate, model_free   offload_create / _destroy, fsdp_create / _destroy
//   model_init_weights, model_optimizer_step   this GPU's shards (fsdp_segments, --fsdp)
//   model_forward_backward  fsdp_* around each unit (fsdp.cu), offload_* around each layer
//                           (offload.cu)
//   layer_forward           untied_attention_forward (untied.cu) in place of the attention
//                           sub-block; offload_after_attention_forward
//   layer_backward          recompute_attention (checkpointing.cu); untied_attention_backward
//   qkv_of_tokens, dqkv_of_tokens, self_attention_*   Ulysses's staging and all-to-alls (ulysses.cu)
//   qkv_backward, mlp_backward   recompute_attention_norm, recompute_mlp_inputs (checkpointing.cu)
//   x_mid_rows              x_mid is the layer's own rows, or a shared chunk (checkpointing.cu)
//   model_memory_trace      the host bytes of --offload
// Each technique file's header lists the same places from its side.
#include <cublasLt.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>

#include "llama.h"

// =============================================================================================
// Errors
void cuda_check(cudaError_t err, const char* what, const char* file, int line) {
    if (err == cudaSuccess) return;
    std::string msg = std::string(what) + " failed at " + file + ":" + std::to_string(line) +
                      ": " + cudaGetErrorString(err);
    if (err == cudaErrorMemoryAllocation) throw Fatal(EXIT_OOM, "out of memory: " + msg);
    throw Fatal(EXIT_RUNTIME, msg);
}

static void cublas_check(cublasStatus_t st, const char* what, const char* file, int line) {
    if (st == CUBLAS_STATUS_SUCCESS) return;
    throw Fatal(EXIT_RUNTIME, std::string(what) + " failed at " + file + ":" +
                                  std::to_string(line) + ": cuBLAS status " + std::to_string(st));
}
#define CUBLAS_CHECK(call) cublas_check((call), #call, __FILE__, __LINE__)

// =============================================================================================
// Arena: the static memory plan (see llama.h).
static constexpr int64_t ARENA_ALIGN = 256;

void Arena::begin_real(char* base, int64_t capacity) {
    rewind();
    base_ = base;
    capacity_ = capacity;
}

void Arena::rewind() {
    offset_ = 0;
    for (auto& b : by_category_) b = 0;
    entries_.clear();
}

void* Arena::take_bytes(const std::string& name, MemCategory cat, int64_t bytes) {
    int64_t size = align_up(std::max<int64_t>(bytes, 1), ARENA_ALIGN);
    int64_t off = offset_;
    offset_ += size;
    by_category_[cat] += size;
    entries_.push_back({name, cat, off, size});
    if (!base_) return nullptr;  // dry run: only the plan
    if (offset_ > capacity_)
        throw std::logic_error("arena: real pass asked for more than the dry run planned");
    return base_ + off;
}

int64_t DeviceMemory::driver_used_bytes() const {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return -1;
    return (int64_t)(total_b - free_b);
}

void report_oom(const Arena& plan, int64_t runtime_bytes, int64_t cap_bytes,
                const std::string& what, const std::string& hint) {
    char buf[256];
    std::string msg = "out of memory: " + what + "\n";
    int largest = 0;
    for (int c = 0; c < MEM_NUM_CATEGORIES; c++) {
        if (plan.category_bytes(c) > plan.category_bytes(largest)) largest = c;
        snprintf(buf, sizeof buf, "    %-10s %9.2f GiB\n", mem_category_name(c),
                 plan.category_bytes(c) / GiB);
        msg += buf;
    }
    snprintf(buf, sizeof buf, "    %-10s %9.2f GiB (CUDA context, cuBLAS)\n", "runtime",
             runtime_bytes / GiB);
    msg += buf;
    snprintf(buf, sizeof buf,
             "  the step needs %.2f GiB per GPU; the card (cap) holds %.2f GiB. Largest "
             "category: %s.\n",
             (plan.total() + runtime_bytes) / GiB, cap_bytes / GiB, mem_category_name(largest));
    msg += buf;
    if (!hint.empty()) msg += "  next: " + hint;
    throw Fatal(EXIT_OOM, msg);
}

// =============================================================================================
// cuBLASLt matrix products.
//
// Row-major C[M,N] = op(A) op(B) is column-major C^T[N,M] = op(B)^T op(A)^T, and a row-major
// matrix with leading dimension ld is the column-major transpose with the same ld. So we ask
// cuBLASLt for m = N, n = M, with its "A" our B and its "B" our A, transpose flags kept.
static cublasLtHandle_t g_lt = nullptr;
static void* g_workspace = nullptr;
static size_t g_workspace_bytes = 0;

struct GemmKey {
    bool ta, tb, c32, beta;
    int64_t M, N, K, lda, ldb, ldc;
    bool operator<(const GemmKey& o) const {
        return std::tie(ta, tb, c32, beta, M, N, K, lda, ldb, ldc) <
               std::tie(o.ta, o.tb, o.c32, o.beta, o.M, o.N, o.K, o.lda, o.ldb, o.ldc);
    }
};
struct GemmPlan {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
};
static std::map<GemmKey, GemmPlan> g_gemm_plans;

void gemm_init(size_t workspace_bytes, void* workspace) {
    if (!g_lt) CUBLAS_CHECK(cublasLtCreate(&g_lt));
    g_workspace = workspace;
    g_workspace_bytes = workspace_bytes;
    g_gemm_plans.clear();  // plans were chosen for the old workspace size
}

void gemm_destroy() {
    for (auto& kv : g_gemm_plans) {
        cublasLtMatmulDescDestroy(kv.second.op);
        cublasLtMatrixLayoutDestroy(kv.second.a);
        cublasLtMatrixLayoutDestroy(kv.second.b);
        cublasLtMatrixLayoutDestroy(kv.second.c);
    }
    g_gemm_plans.clear();
    if (g_lt) cublasLtDestroy(g_lt);
    g_lt = nullptr;
}

static const GemmPlan& gemm_plan(const GemmKey& k) {
    auto it = g_gemm_plans.find(k);
    if (it != g_gemm_plans.end()) return it->second;
    GemmPlan p;
    cublasOperation_t op_first = k.tb ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS "A" = our B
    cublasOperation_t op_second = k.ta ? CUBLAS_OP_T : CUBLAS_OP_N; // cuBLAS "B" = our A
    int64_t m = k.N, n = k.M, kk = k.K;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first,
                                                sizeof op_first));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second,
                                                sizeof op_second));
    // Stored shapes (column-major, before the op).
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, k.tb ? kk : m, k.tb ? m : kk, k.ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, k.ta ? n : kk, k.ta ? kk : n, k.lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, k.c32 ? CUDA_R_32F : CUDA_R_16BF, m, n, k.ldc));
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &g_workspace_bytes, sizeof(size_t)));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(g_lt, p.op, p.a, p.b, p.c, p.c, pref, 1, &res,
                                                &found));
    cublasLtMatmulPreferenceDestroy(pref);
    if (found == 0)
        runtime_error("cuBLASLt has no algorithm for a " + std::to_string(k.M) + "x" +
                      std::to_string(k.N) + "x" + std::to_string(k.K) + " product");
    p.algo = res.algo;
    return g_gemm_plans.emplace(k, p).first->second;
}

void gemm_rm(bool transA, bool transB, int64_t M, int64_t N, int64_t K, const bf16* A,
             int64_t lda, const bf16* B, int64_t ldb, void* C, int64_t ldc, bool c_fp32,
             float alpha, float beta, const void* Cin, cudaStream_t stream) {
    if (M == 0 || N == 0) return;
    GemmKey key{transA, transB, c_fp32, beta != 0.0f, M, N, K, lda, ldb, ldc};
    const GemmPlan& p = gemm_plan(key);
    const void* cin = Cin ? Cin : C;
    CUBLAS_CHECK(cublasLtMatmul(g_lt, p.op, &alpha, B, p.a, A, p.b, &beta, cin, p.c, C, p.c,
                                &p.algo, g_workspace, g_workspace_bytes, stream));
}

void linear_forward(bf16* y, const bf16* x, const bf16* W, const bf16* residual, int64_t T,
                    int64_t in, int64_t out, cudaStream_t s) {
    gemm_rm(false, true, T, out, in, x, in, W, in, y, out, false, 1.0f, residual ? 1.0f : 0.0f,
            residual, s);
}

void linear_backward_input(bf16* dx, const bf16* dy, const bf16* W, int64_t T, int64_t in,
                           int64_t out, cudaStream_t s) {
    gemm_rm(false, false, T, in, out, dy, out, W, in, dx, in, false, 1.0f, 0.0f, nullptr, s);
}

void linear_backward_weight(float* dW, const bf16* dy, const bf16* x, int64_t T, int64_t in,
                            int64_t out, cudaStream_t s) {
    gemm_rm(true, false, out, in, T, dy, out, x, in, dW, in, true, 1.0f, 1.0f, nullptr, s);
}

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
// RoPE, HF rotate-half layout: for i < d/2, (x_i, x_{i+d/2}) rotated by pos * inv_freq_i.
// The angle is formed in float64 and reduced modulo 2 pi before the float sine and cosine:
// at position 5M a float angle would be off by a whole radian.
__global__ void rope_kernel(bf16* x, int64_t n_rows, int64_t row0, int64_t seq, int64_t pos0,
                            int n_heads, int head_dim, int64_t ld, const double* inv_freq,
                            bool inverse) {
    int half = head_dim / 2;
    int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (idx >= n_rows * half) return;
    int64_t r = idx / half;
    int i = (int)(idx % half);
    double angle = fmod((double)(pos0 + (row0 + r) % seq) * inv_freq[i], 6.283185307179586);
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
                int head_dim, int64_t ld, const double* inv_freq, bool inverse, cudaStream_t s) {
    int64_t n = n_rows * (head_dim / 2);
    if (n == 0) return;
    rope_kernel<<<grid_for(n, 256), 256, 0, s>>>(x, n_rows, row0, seq, pos0, n_heads, head_dim,
                                                  ld, inv_freq, inverse);
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

// The cross-entropy of logits that come in pieces of columns (llama.cu lm_head_in_pieces).
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

__global__ void init_constant_kernel(float* x, int64_t n, float value) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = value;
}
void init_constant(float* x, int64_t n, float value, cudaStream_t s) {
    init_constant_kernel<<<grid_for(n, 256), 256, 0, s>>>(x, n, value);
    CUDA_CHECK_LAUNCH();
}

// HF LlamaForCausalLM init: every linear and the embedding N(0, 0.02); RMSNorm gains 1. Values
// [offset, offset + count) of tensor t, into f32 or (the other one null) bf16; each depends only
// on (seed, tensor, index), so any part of the model can be drawn on its own.
void init_param_values(const Model& m, const ParamTensor& t, int64_t offset, int64_t count, uint64_t seed,
                       float* f32, bf16* b16, cudaStream_t s) {
    const uint64_t tensor_seed = seed * 1000003ull + (uint64_t)(&t - m.layout.tensors.data());
    if (f32 && t.rows == 1) init_constant(f32, count, 1.0f, s);
    else if (f32) init_normal(f32, count, 0.02f, tensor_seed, s, offset);
    else if (t.rows == 1) fill_bf16(b16, count, 1.0f, s);
    else {
        init_normal_kernel<<<grid_for(count, 256), 256, 0, s>>>(b16, count, 0.02f, tensor_seed, offset);
        CUDA_CHECK_LAUNCH();
    }
}

// =============================================================================================
// The model: buffers, initialization, one step.
//
// model_declare_buffers first decides how the step holds each activation (the ActivationPlan
// of llama.h): the plain model keeps all of them, a slot per layer, and each memory technique
// changes that in its *_plan function. Then every buffer is declared from the plan. The plain
// step (ladder stage 0) keeps, per token and layer, in bytes:
//   other:     2 (4 D + 3 F) + 8          (x_in, xn1, x_mid, xn2, h13, act; two rstd)
//   attention: 2 (qkv_dim + Hq d) + 4 Hq  (qkv, att, lse)
// plus logits 2 V per token (per vocabulary piece: 2 V / k), and 16 bytes per parameter for model states (fp32 master, grad,
// two AdamW moments; the bf16 weights exist only for the two units in use, fsdp.cu).
static ActivationPlan plain_plan(const Model& m) {
    ActivationPlan p;  // every activation kept per layer
    p.chunk_rows = p.loss_rows = m.shape.tokens();  // every layer and the head take all tokens at once
    return p;
}

// Slots of a per-layer activation held as `h`, for `layers` layers.
static int64_t slot_count(Hold h, int64_t layers) {
    switch (h) {
        case Hold::PER_LAYER: return layers;
        case Hold::ON_HOST: return 1;  // staging: every layer uses the one slot
        case Hold::SHARED: return 1;
        case Hold::NONE: return 0;
    }
    return 0;
}
// Layer l's slot of an activation held as `h`, `size` elements a slot (the dry run has no base).
template <class T>
static T* slot(T* base, Hold h, int64_t l, int64_t size) {
    if (!base || h == Hold::NONE) return nullptr;
    const int64_t index = h == Hold::PER_LAYER ? l : 0;
    return base + index * size;
}

// An activation of every layer: its slots, and its bytes in the per-layer count of --mem-trace
// when each layer keeps its own on the device.
template <class T>
static T* take_activation(Model& m, Arena& A, const char* name, MemCategory cat, Hold h, int64_t layers,
                          int64_t per_slot) {
    if (h == Hold::PER_LAYER) m.saved_per_layer[cat] += per_slot * (int64_t)sizeof(T);
    return A.take<T>(name, cat, slot_count(h, layers) * per_slot);
}

static void declare_model_states(Model& m, Arena& A) {
    // 16 bytes per parameter: all of them, or (--fsdp) this GPU's shards. The bf16 weights that
    // compute reads exist only for the units in use (fsdp.cu).
    const int64_t P = m.local_params = fsdp_local_params(m.cfg, m.opt.fsdp, m.world);
    m.master = A.take<float>("master weights (fp32)", MEM_MODEL, P);
    m.grad = A.take<float>("gradients (fp32)", MEM_MODEL, P);
    m.adam_m = A.take<float>("AdamW first moment", MEM_MODEL, P);
    m.adam_v = A.take<float>("AdamW second moment", MEM_MODEL, P);
}

int64_t layer_lse_floats(const Model& m) {
    return (int64_t)m.shape.batch * ulysses_heads(m.cfg, m.shape.sp).q * m.shape.seq;
}

// Every layer's activations, as the plan holds them.
static void declare_activations(Model& m, Arena& A) {
    const LlamaConfig& c = m.cfg;
    const ActivationPlan& p = m.plan;
    const int64_t T = m.shape.tokens(), D = c.dim, F = c.ffn_dim, QD = c.q_dim(), L = c.n_layers;
    const int64_t C = p.chunk_rows, mid_rows = p.x_mid == Hold::PER_LAYER ? T : C;
    // Attention's view: the whole sequence, this GPU's heads (all of them without Ulysses).
    const UlyssesHeads heads = ulysses_heads(c, m.shape.sp);
    const int64_t S_rows = T * m.shape.sp, WH = heads.width(c.head_dim);
    const int64_t lse_n = layer_lse_floats(m);
    for (int64_t& b : m.saved_per_layer) b = 0;

    // The residual stream: every layer's input and the last layer's output (L + 1 slots).
    bf16* x = take_activation<bf16>(m, A, "block inputs (residual stream)", MEM_OTHER, p.x_in, L + 1, T * D);
    bf16* att = take_activation<bf16>(m, A, "attention output", MEM_ATTENTION, p.att, L, T * QD);
    float* lse = take_activation<float>(m, A, "attention lse", MEM_ATTENTION, p.att, L, lse_n);
    // =selective --offload: the layers the host cannot hold that keep theirs on the device (offload.cu).
    const int64_t att_dev_slots = p.att == Hold::ON_HOST ? p.att_device_layers : 0;
    bf16* att_dev = nullptr;
    float* lse_dev = nullptr;
    if (att_dev_slots > 0) {
        att_dev = A.take<bf16>("attention outputs kept on the device", MEM_ATTENTION, att_dev_slots * T * QD);
        lse_dev = A.take<float>("attention lse kept on the device", MEM_ATTENTION, att_dev_slots * lse_n);
    }
    bf16* qkv = take_activation<bf16>(m, A, "qkv", MEM_ATTENTION, p.qkv, L, S_rows * WH);  // [S, heads] = [T, QKV] without Ulysses
    bf16* x_mid = take_activation<bf16>(m, A, "x_mid (residual after attention)", MEM_OTHER, p.x_mid, L, mid_rows * D);
    // The norms' outputs and the MLP's intermediates hold one chunk's rows (all T when kept per layer).
    const Hold h = p.norms_mlp;
    bf16* xn1 = take_activation<bf16>(m, A, "xn1 (attention norm output)", MEM_OTHER, h, L, C * D);
    float* rstd1 = take_activation<float>(m, A, "rstd1", MEM_OTHER, h, L, C);
    bf16* xn2 = take_activation<bf16>(m, A, "xn2 (MLP norm output)", MEM_OTHER, h, L, C * D);
    float* rstd2 = take_activation<float>(m, A, "rstd2", MEM_OTHER, h, L, C);
    bf16* h13 = take_activation<bf16>(m, A, "h13 (gate | up)", MEM_OTHER, h, L, C * 2 * F);
    bf16* act = take_activation<bf16>(m, A, "act (silu(gate) * up)", MEM_OTHER, h, L, C * F);

    m.layers.assign(L, LayerActivations());
    for (int64_t l = 0; l < L; l++) {
        LayerActivations& a = m.layers[l];
        a.x_in = slot(x, p.x_in, l, T * D);
        a.x_out = slot(x, p.x_in, l + 1, T * D);
        a.att = slot(att, p.att, l, T * QD);
        a.lse = slot(lse, p.att, l, lse_n);
        if (const int d = offload_device_slot(m, l); d >= 0)
            a.att = slot(att_dev, Hold::PER_LAYER, d, T * QD), a.lse = slot(lse_dev, Hold::PER_LAYER, d, lse_n);
        a.qkv = slot(qkv, p.qkv, l, S_rows * WH);
        a.x_mid = slot(x_mid, p.x_mid, l, mid_rows * D);
        a.xn1 = slot(xn1, h, l, C * D), a.rstd1 = slot(rstd1, h, l, C);
        a.xn2 = slot(xn2, h, l, C * D), a.rstd2 = slot(rstd2, h, l, C);
        a.h13 = slot(h13, h, l, C * 2 * F), a.act = slot(act, h, l, C * F);
    }
    m.x_final = slot(x, p.x_in, L, T * D);
}

// The shape of one attention call: every head of each sequence, or this GPU's share of the
// heads over the whole sequence (ulysses.cu), or one head chunk (untied.cu).
static AttentionShape attention_call_shape(const Model& m) {
    if (m.untied) return untied_attention_shape(m);
    if (m.ulysses) return ulysses_attention_shape(m);
    return {m.shape.batch, m.shape.seq, m.cfg.n_heads, m.cfg.n_kv_heads, m.cfg.head_dim};
}

static void declare_head_and_gradients(Model& m, Arena& A) {
    const LlamaConfig& c = m.cfg;
    const int64_t T = m.shape.tokens(), D = c.dim;
    // LM head and loss, m.plan.loss_rows tokens at a time.
    m.xnf = A.take<bf16>("final norm output", MEM_OTHER, m.plan.loss_rows * D);
    m.rstdf = A.take<float>("final rstd", MEM_OTHER, m.plan.loss_rows);
    // Logits of one vocabulary piece (the widest), and the running statistics of the head's
    // loss when it comes in several pieces (lm_head_in_pieces).
    const ParamLayout& lay = m.layout;
    int64_t piece_width = 0;
    for (int p = 0; p < lay.vocab_pieces(); p++) piece_width = std::max(piece_width, lay.piece_rows(p));
    m.logits = A.take<bf16>("logits", MEM_OTHER, m.plan.loss_rows * piece_width);
    m.losses = A.take<float>("per-token losses", MEM_OTHER, T);
    if (lay.vocab_pieces() > 1) {
        m.token_lse = A.take<float>("per-token max, then log-sum-exp, of the logits", MEM_OTHER, T);
        m.token_sumexp = A.take<float>("per-token sum of exp(logits)", MEM_OTHER, T);
        m.target_logit = A.take<float>("per-token target logit", MEM_OTHER, T);
    }
    // The residual gradient and attention's gradients span the sequence.
    m.dres = A.take<bf16>("d residual", MEM_OTHER, T * D);
    if (m.plan.dqkv != Hold::NONE) m.dqkv = A.take<bf16>("d qkv", MEM_ATTENTION, T * c.qkv_dim());
    if (m.plan.datt != Hold::NONE) {
        m.datt = A.take<bf16>("d attention output", MEM_ATTENTION, T * c.q_dim());
        m.delta = A.take<float>("attention delta", MEM_ATTENTION, layer_lse_floats(m));
    }
    m.dq_accum = nullptr;
    if (m.opt.fused_attention && m.plan.dq_sums != Hold::NONE)  // 4 bytes per dQ element of one call
        m.dq_accum = A.take<float>("attention dQ sums, fp32 (fused backward)", MEM_ATTENTION,
                                   attention_dq_accum_floats(attention_call_shape(m)));
}

// One chunk's work buffers of the backward, reductions, and the step's inputs.
static void declare_chunk_work_and_inputs(Model& m, Arena& A) {
    const LlamaConfig& c = m.cfg;
    const int64_t T = m.shape.tokens(), C = m.plan.chunk_rows, F = c.ffn_dim;
    m.dxn = A.take<bf16>("d norm output", MEM_OTHER, std::max(C, m.plan.loss_rows) * c.dim);
    m.dh13 = A.take<bf16>("d h13", MEM_OTHER, C * 2 * F);
    m.dact = A.take<bf16>("d act", MEM_OTHER, C * F);
    m.norm_partial = A.take<float>("rmsnorm dw partials", MEM_WORKSPACE, rmsnorm_partial_floats(c.dim));
    m.reduce_scratch = A.take<float>("reduction scratch", MEM_WORKSPACE, sum_scratch_floats());
    m.scalars = A.take<float>("step scalars", MEM_WORKSPACE, 4);

    m.tokens = A.take<int32_t>("tokens", MEM_OTHER, T);
    m.targets = A.take<int32_t>("targets", MEM_OTHER, T);
    const int64_t max_groups = std::min<int64_t>(T, c.vocab);
    m.emb_group_token = A.take<int32_t>("embedding groups", MEM_OTHER, max_groups);
    m.emb_group_begin = A.take<int64_t>("embedding group starts", MEM_OTHER, max_groups + 1);
    m.emb_positions = A.take<int64_t>("embedding positions", MEM_OTHER, T);
    m.inv_freq = A.take<double>("rope frequencies", MEM_OTHER, c.head_dim / 2);
    m.gemm_workspace = A.take_bytes("cuBLASLt workspace", MEM_WORKSPACE, m.gemm_workspace_bytes);
}

void model_declare_buffers(Model& m, Arena& A) {
    m.layout = param_layout(m.cfg);
    m.ulysses.reset(), m.untied.reset();  // their *_plan make them again when they are on
    // How the step holds its activations: the plain model's plan, then each technique's change.
    m.plan = plain_plan(m);
    ulysses_plan(m);        // --ulysses: d q|k|v arrives in Ulysses's staging
    checkpointing_plan(m);  // --ckpt: keep block inputs only (=selective: and attention output)
    offload_plan(m);        // --offload: what is kept lives on the host, staged through one slot
    chunked_plan(m);        // --chunked: layers and the head walk their tokens in chunks
    untied_plan(m);         // --untied: attention's inputs and gradients per head chunk, its own buffers

    declare_model_states(m, A);
    fsdp_declare_buffers(m, A);     // --fsdp: gathered units and unit gradients
    declare_activations(m, A);
    declare_head_and_gradients(m, A);
    untied_declare_buffers(m, A);   // --untied: one head chunk's buffers
    ulysses_declare_buffers(m, A);  // --ulysses: all-to-all staging and head-sharded buffers
    declare_chunk_work_and_inputs(m, A);
}

void model_allocate(Model& m, Arena& arena, DeviceMemory& dm, const std::string& oom_hint) {
    const int64_t runtime = dm.runtime_bytes + dm.emulated_bytes;
    if (arena.total() + runtime > dm.cap_bytes)
        report_oom(arena, runtime, dm.cap_bytes, "the memory plan does not fit", oom_hint);
    if (cudaMalloc(&dm.slab, arena.total()) != cudaSuccess) {
        cudaGetLastError();  // clear it: this failure is reported, not fatal to the context
        report_oom(arena, runtime, dm.cap_bytes, "cudaMalloc of the planned buffers failed", oom_hint);
    }
    dm.slab_bytes = arena.total();
    arena.begin_real(dm.slab, dm.slab_bytes);
    model_declare_buffers(m, arena);
    gemm_init(m.gemm_workspace_bytes, m.gemm_workspace);
    // Constant tables belong to the model's setup, not to its weights.
    std::vector<double> inv = rope_inv_freq(m.cfg);
    CUDA_CHECK(cudaMemcpy(m.inv_freq, inv.data(), inv.size() * sizeof(double), cudaMemcpyHostToDevice));
    if (m.pin_host) offload_create(m);  // --offload's pinned host memory, once for the whole run
    if (!m.comm) m.comm = comm_single(), m.owns_comm = true;
    if (!m.comm_fsdp) m.comm_fsdp = m.comm->split();
    if (!m.comm_stream) CUDA_CHECK(cudaStreamCreateWithFlags(&m.comm_stream, cudaStreamNonBlocking));
    m.progress.resize(2 * m.cfg.n_layers + 2);  // start, each forward, the head, each backward
    for (auto& e : m.progress) CUDA_CHECK(cudaEventCreate(&e));  // timed: --mem-trace reads them
    CUDA_CHECK(cudaMallocHost(&m.host_scalars, 4 * sizeof(float)));
    fsdp_create(m);
}

void model_free(Model& m, DeviceMemory& dm) {
    timeline_destroy(m);
    offload_destroy(m);
    fsdp_destroy(m);
    if (m.comm_stream) cudaStreamDestroy(m.comm_stream);
    m.comm_stream = nullptr;
    for (auto& e : m.progress) cudaEventDestroy(e);
    m.progress.clear();
    if (m.host_scalars) cudaFreeHost(m.host_scalars);
    m.host_scalars = nullptr;
    delete m.comm_fsdp;
    m.comm_fsdp = nullptr;
    if (m.owns_comm) delete m.comm, m.comm = nullptr;
    if (dm.slab) CUDA_CHECK(cudaFree(dm.slab));
    dm.slab = nullptr;
    dm.slab_bytes = 0;
}

void model_init_weights(Model& m, uint64_t seed, cudaStream_t s) {
    // A shard holds exactly its part of the single-GPU model's weights (init_param_values).
    m.init_seed = seed;
    CUDA_CHECK(cudaMemsetAsync(m.master, 0, m.local_params * sizeof(float), s));  // padding
    for (const ParamSegment& seg : fsdp_segments(m))
        init_param_values(m, *seg.tensor, seg.tensor_offset, seg.count, seed, m.master + seg.local, nullptr, s);
    CUDA_CHECK(cudaMemsetAsync(m.adam_m, 0, m.local_params * sizeof(float), s));
    CUDA_CHECK(cudaMemsetAsync(m.adam_v, 0, m.local_params * sizeof(float), s));
    CUDA_CHECK(cudaStreamSynchronize(s));
}

void model_set_batch(Model& m, const int32_t* tokens, const int32_t* targets, cudaStream_t s, int64_t n_valid) {
    const int64_t T = m.shape.tokens();
    CUDA_CHECK(cudaMemcpyAsync(m.tokens, tokens, T * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(m.targets, targets, T * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    EmbeddingGroups& g = m.emb_groups;
    g.build(tokens, T);
    CUDA_CHECK(cudaMemcpyAsync(m.emb_group_token, g.token.data(), g.token.size() * sizeof(int32_t),
                               cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(m.emb_group_begin, g.begin.data(), g.begin.size() * sizeof(int64_t),
                               cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(m.emb_positions, g.position.data(), T * sizeof(int64_t),
                               cudaMemcpyHostToDevice, s));
    m.n_valid_targets = n_valid;
    if (n_valid < 0) {
        m.n_valid_targets = 0;
        for (int64_t t = 0; t < T; t++) m.n_valid_targets += targets[t] >= 0;
    }
    // The copies above read host memory that the caller may reuse: finish them now.
    CUDA_CHECK(cudaStreamSynchronize(s));
}

// ---------------------------------------------------------------------------------------------
// One layer, in pieces. Each per-token piece works on tokens [t0, t1) of this GPU; a layer walks
// its tokens in chunks (FOR_EACH_CHUNK: one chunk of all T tokens unless --chunked). Full-length
// buffers are indexed by token; the norms' and the MLP's work buffers hold the chunk's rows.

// Rows from token t0 on of a full-length [T, width] buffer.
template <class P>
static P at(P base, int64_t t0, int64_t width) {
    return base + t0 * width;
}

// Where layer l's projection writes q|k|v of this GPU's tokens: the layer's qkv, or under
// Ulysses its receive staging, packed from there into the send staging for the all-to-all.
static bf16* qkv_of_tokens(Model& m, int l) { return m.ulysses ? ulysses_qkv_of_tokens(m) : m.layers[l].qkv; }
// Where the backward finds d q|k|v of this GPU's tokens: the step's dqkv, or under Ulysses the
// send staging, which it was unpacked into after its all-to-all.
static bf16* dqkv_of_tokens(Model& m) { return m.ulysses ? ulysses_dqkv_of_tokens(m) : m.dqkv; }

// xn1, rstd1 = rmsnorm(x_in)
void attention_norm_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    rmsnorm_forward(a.xn1, a.rstd1, at(a.x_in, t0, c.dim), m.w(P_ATTN_NORM, l), t1 - t0, c.dim, c.norm_eps, s);
}

// xn1 = rmsnorm(x_in); qkv = xn1 Wqkv^T; RoPE on q and k.
void qkv_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    const int64_t n = t1 - t0, QKV = c.qkv_dim();
    bf16* qkv = at(qkv_of_tokens(m, l), t0, QKV);
    attention_norm_forward(m, l, t0, t1, s);
    linear_forward(qkv, m.layers[l].xn1, m.w(P_WQKV, l), nullptr, n, c.dim, QKV, s);
    rope_apply(qkv, n, t0, m.shape.seq, m.shape.first_position(), c.n_heads + c.n_kv_heads, c.head_dim, QKV,
               m.inv_freq, false, s);
}

// Backward of qkv_forward: d qkv (RoPE undone) -> dWqkv, and d x_in added to dres.
static void qkv_backward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    const int64_t n = t1 - t0, QKV = c.qkv_dim();
    bf16* dqkv = at(dqkv_of_tokens(m), t0, QKV);
    rope_apply(dqkv, n, t0, m.shape.seq, m.shape.first_position(), c.n_heads + c.n_kv_heads, c.head_dim, QKV,
               m.inv_freq, true, s);
    recompute_attention_norm(m, l, t0, t1, s);  // checkpointing.cu: xn1, if it was not kept
    linear_backward_input(m.dxn, dqkv, m.w(P_WQKV, l), n, c.dim, QKV, s);
    linear_backward_weight(m.g(P_WQKV, l), dqkv, a.xn1, n, c.dim, QKV, s);
    rmsnorm_backward(at(m.dres, t0, c.dim), m.g(P_ATTN_NORM, l), m.dxn, at(a.x_in, t0, c.dim),
                     m.w(P_ATTN_NORM, l), a.rstd1, n, c.dim, true, m.norm_partial, s);
}

// Attention over the whole sequence: att, lse from qkv (through Ulysses's all-to-alls when the
// sequence is split over GPUs).
void self_attention_forward(Model& m, int l, cudaStream_t s) {
    if (m.ulysses) return ulysses_attention_forward(m, l, s);
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    const int64_t QKV = c.qkv_dim();
    AttentionForwardArgs fa{a.qkv, a.qkv + c.q_dim(), a.qkv + c.q_dim() + c.kv_dim(), QKV, QKV, QKV,
                            a.att, c.q_dim(), a.lse};
    int mark = timeline_begin(m, s);
    attention_forward(fa, attention_call_shape(m), s);
    timeline_end(m, mark, "compute", "attention forward", l, s);
}

static void self_attention_backward(Model& m, int l, cudaStream_t s) {
    if (m.ulysses) return ulysses_attention_backward(m, l, s);
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    const int64_t QKV = c.qkv_dim(), Q = c.q_dim(), K = c.kv_dim();
    AttentionBackwardArgs ba{a.qkv, a.qkv + Q, a.qkv + Q + K, a.att, m.datt, QKV, QKV, QKV, Q, Q, a.lse,
                             m.dqkv, m.dqkv + Q, m.dqkv + Q + K, QKV, QKV, QKV, m.delta};
    ba.dq_accum = m.dq_accum;
    int mark = timeline_begin(m, s);
    attention_backward(ba, attention_call_shape(m), s);
    timeline_end(m, mark, "compute", "attention backward", l, s);
}

// x_mid: the layer's own rows of it, or the shared chunk buffer.
static bf16* x_mid_rows(Model& m, int l, int64_t t0) {
    LayerActivations& a = m.layers[l];
    return m.plan.x_mid == Hold::PER_LAYER ? at(a.x_mid, t0, m.cfg.dim) : a.x_mid;
}

// x_mid = x_in + att Wo^T (one GEMM with the residual as C).
void attention_output_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    linear_forward(x_mid_rows(m, l, t0), at(a.att, t0, c.q_dim()), m.w(P_WO, l), at(a.x_in, t0, c.dim), t1 - t0,
                   c.q_dim(), c.dim, s);
}

// xn2 = rmsnorm(x_mid); h13 = xn2 W13^T; act = silu(gate) * up.
void mlp_input_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    const int64_t n = t1 - t0;
    rmsnorm_forward(a.xn2, a.rstd2, x_mid_rows(m, l, t0), m.w(P_MLP_NORM, l), n, c.dim, c.norm_eps, s);
    linear_forward(a.h13, a.xn2, m.w(P_W13, l), nullptr, n, c.dim, 2 * c.ffn_dim, s);
    swiglu_forward(a.act, a.h13, n, c.ffn_dim, s);
}

// The rest of the block after attention: Wo and the residual, the MLP and the residual.
static void mlp_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    attention_output_forward(m, l, t0, t1, s);
    mlp_input_forward(m, l, t0, t1, s);
    linear_forward(at(a.x_out, t0, c.dim), a.act, m.w(P_W2, l), x_mid_rows(m, l, t0), t1 - t0, c.ffn_dim, c.dim, s);
}

// The rest of the block after attention, chunk by chunk: x_out from x_in and att.
void block_output_forward(Model& m, int l, cudaStream_t s) { FOR_EACH_CHUNK(m, t0, t1) mlp_forward(m, l, t0, t1, s); }

// On entry dres[t0:t1] is d loss / d x_out; on exit d loss / d x_mid, and datt[t0:t1] is filled.
static void mlp_backward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    const int64_t n = t1 - t0, D = c.dim, F = c.ffn_dim, QD = c.q_dim();
    recompute_mlp_inputs(m, l, t0, t1, s);  // checkpointing.cu: x_mid, xn2, h13, act, if not kept
    bf16* x_mid = x_mid_rows(m, l, t0);
    bf16* dres = at(m.dres, t0, D);
    // x_out = x_mid + act W2^T
    linear_backward_input(m.dact, dres, m.w(P_W2, l), n, F, D, s);
    linear_backward_weight(m.g(P_W2, l), dres, a.act, n, F, D, s);
    swiglu_backward(m.dh13, m.dact, a.h13, n, F, s);
    linear_backward_input(m.dxn, m.dh13, m.w(P_W13, l), n, D, 2 * F, s);
    linear_backward_weight(m.g(P_W13, l), m.dh13, a.xn2, n, D, 2 * F, s);
    rmsnorm_backward(dres, m.g(P_MLP_NORM, l), m.dxn, x_mid, m.w(P_MLP_NORM, l), a.rstd2, n, D, true,
                     m.norm_partial, s);
    // x_mid = x_in + att Wo^T (untied.cu takes d att a head chunk at a time instead)
    if (m.plan.datt != Hold::NONE) linear_backward_input(at(m.datt, t0, QD), dres, m.w(P_WO, l), n, QD, D, s);
    linear_backward_weight(m.g(P_WO, l), dres, at(a.att, t0, QD), n, QD, D, s);
}

static void layer_forward(Model& m, int l, cudaStream_t s) {
    if (m.untied) {
        untied_attention_forward(m, l, s);  // untied.cu: norm, projections, attention per head chunk
    } else {
        FOR_EACH_CHUNK(m, t0, t1) qkv_forward(m, l, t0, t1, s);
        self_attention_forward(m, l, s);
    }
    offload_after_attention_forward(m, l, s);  // offload.cu: att, lse out; the input saved before the MLP overwrites it
    int mark = timeline_begin(m, s);
    block_output_forward(m, l, s);
    timeline_end(m, mark, "compute", "mlp forward", l, s);
}

// On entry m.dres holds d loss / d x_out of layer l; on exit d loss / d x_in.
static void layer_backward(Model& m, int l, cudaStream_t s) {
    int mark = timeline_begin(m, s);
    recompute_attention(m, l, s);  // checkpointing.cu: q, k, v and attention's output, if not kept
    timeline_end(m, mark, "compute", "attention rerun", l, s);
    mark = timeline_begin(m, s);
    FOR_EACH_CHUNK(m, t0, t1) mlp_backward(m, l, t0, t1, s);
    timeline_end(m, mark, "compute", "mlp backward", l, s);
    if (m.untied) return untied_attention_backward(m, l, s);  // untied.cu: per head chunk
    self_attention_backward(m, l, s);                          // fills dqkv
    FOR_EACH_CHUNK(m, t0, t1) qkv_backward(m, l, t0, t1, s);
}

// The final norm of tokens [t0, t0 + n) into xnf, rstdf.
static void final_norm_forward(Model& m, int64_t t0, int64_t n, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    rmsnorm_forward(m.xnf, m.rstdf, at(m.x_final, t0, c.dim), m.w(P_FINAL_NORM), n, c.dim, c.norm_eps, s);
}

// Calls f(t0, n) for each chunk of the head's tokens, m.plan.loss_rows at a time (all of them
// unless --chunked), with the chunk's final norm in xnf, rstdf.
template <class F>
static void for_each_loss_chunk(Model& m, F f, cudaStream_t s) {
    const int64_t T = m.shape.tokens(), rows = m.plan.loss_rows;
    for (int64_t t0 = 0; t0 < T; t0 += rows) {
        const int64_t n = std::min(rows, T - t0);
        final_norm_forward(m, t0, n, s);
        f(t0, n);
    }
}

// 1 / the step's count of valid targets: the loss is their mean, counted on the host.
static float loss_grad_scale(const Model& m) {
    return m.n_valid_targets > 0 ? 1.0f / (float)m.n_valid_targets : 0.0f;
}
static ParamKind lm_head_kind(const Model& m) { return m.cfg.tied_embeddings ? P_EMBED : P_LM_HEAD; }

// Final RMSNorm, LM head, cross-entropy and their backward, with the LM head in one unit (a
// vocabulary small enough for one piece): one pass per loss chunk. The logits of a chunk are
// computed, turned into their gradient in place by the loss kernel, and used at once, so [T, V]
// logits never exist beyond one chunk. Leaves d loss / d x_final in m.dres.
static void lm_head_whole(Model& m, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    const int64_t D = c.dim, V = c.vocab;
    const bf16* W = m.w_piece(lm_head_kind(m), 0);
    float* dW = m.g_piece(lm_head_kind(m), 0);
    for_each_loss_chunk(m, [&](int64_t t0, int64_t n) {
        linear_forward(m.logits, m.xnf, W, nullptr, n, D, V, s);
        cross_entropy_forward_backward(m.logits, m.losses + t0, m.targets + t0, n, (int)V, loss_grad_scale(m), s);
        linear_backward_input(m.dxn, m.logits, W, n, D, V, s);  // logits now hold dlogits
        linear_backward_weight(dW, m.logits, m.xnf, n, D, V, s);
        rmsnorm_backward(at(m.dres, t0, D), m.g(P_FINAL_NORM), m.dxn, at(m.x_final, t0, D), m.w(P_FINAL_NORM),
                         m.rstdf, n, D, false, m.norm_partial, s);
    }, s);
}

// The same with the LM head in k units of vocabulary rows (common.h: each fits a slot that holds
// a layer), one at a time. A token's loss needs all its logits (their log-sum-exp), so the head
// takes two passes over the pieces:
//   the loss:     per piece and loss chunk, logits = norm(x) W_p^T, and per token the running
//                 max and sum of exponentials, and its target's logit in the piece that has it;
//                 then per token lse and the loss
//   the backward: per piece and chunk, the logits again, turned into d logits in place with the
//                 lse; d norm(x) += d logits W_p, summed over the pieces in dres (bf16), and
//                 dW_p += d logits^T norm(x) (fp32, the piece's gradient unit)
// then the final norm's backward turns d norm(x) into d x_final, chunk by chunk.
// Cost: the logits GEMM twice, 2 T D V FLOPs more per step (about 2% of an 8B step at 8K tokens,
// 0.04% at 3M), and d norm(x) rounded to bf16 once per piece. Every piece's unit is acquired here
// (FSDP: gathered; the final norm's unit is held by the caller).
static void lm_head_in_pieces(Model& m, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    const ParamLayout& lay = m.layout;
    const int64_t D = c.dim;
    const int k = lay.vocab_pieces();
    const ParamKind head = lm_head_kind(m);
    for (int p = 0; p < k; p++) {  // the loss
        const int64_t v0 = lay.piece_row[p], V = lay.piece_rows(p);
        fsdp_acquire(m, m.piece_unit(head, p), s);
        for_each_loss_chunk(m, [&](int64_t t0, int64_t n) {
            linear_forward(m.logits, m.xnf, m.w_piece(head, p), nullptr, n, D, V, s);
            cross_entropy_piece_stats(m.logits, n, (int)V, v0, m.targets + t0, m.token_lse + t0, m.token_sumexp + t0,
                                      m.target_logit + t0, p == 0, s);
        }, s);
        fsdp_release(m, m.piece_unit(head, p), s);
    }
    cross_entropy_piece_loss(m.losses, m.token_lse, m.token_sumexp, m.target_logit, m.targets, m.shape.tokens(), s);
    for (int p = 0; p < k; p++) {  // the backward
        const int64_t v0 = lay.piece_row[p], V = lay.piece_rows(p);
        const int u = m.piece_unit(head, p);
        fsdp_acquire(m, u, s);
        fsdp_grad_begin(m, u, s);
        for_each_loss_chunk(m, [&](int64_t t0, int64_t n) {
            bf16* dxn = at(m.dres, t0, D);  // d norm(x) of the chunk, summed over the pieces
            linear_forward(m.logits, m.xnf, m.w_piece(head, p), nullptr, n, D, V, s);
            cross_entropy_piece_backward(m.logits, n, (int)V, v0, m.token_lse + t0, m.targets + t0,
                                         loss_grad_scale(m), s);
            gemm_rm(false, false, n, D, V, m.logits, V, m.w_piece(head, p), D, dxn, D, false, 1.f, p == 0 ? 0.f : 1.f,
                    dxn, s);
            linear_backward_weight(m.g_piece(head, p), m.logits, m.xnf, n, D, V, s);
        }, s);
        fsdp_grad_end(m, u, !c.tied_embeddings, s);  // tied: the lookup adds the rest at the end
        fsdp_release(m, u, s);
    }
    for_each_loss_chunk(m, [&](int64_t t0, int64_t n) {  // dres: d norm(x) -> d x_final
        CUDA_CHECK(cudaMemcpyAsync(m.dxn, at(m.dres, t0, D), n * D * sizeof(bf16), cudaMemcpyDeviceToDevice, s));
        rmsnorm_backward(at(m.dres, t0, D), m.g(P_FINAL_NORM), m.dxn, at(m.x_final, t0, D), m.w(P_FINAL_NORM),
                         m.rstdf, n, D, false, m.norm_partial, s);
    }, s);
}

// Final RMSNorm, LM head, cross-entropy and their backward: dres = d loss / d x_final.
static void head_forward_backward(Model& m, cudaStream_t s) {
    const ParamLayout& lay = m.layout;
    fsdp_acquire(m, lay.final_norm_unit(), s);  // held through the head
    fsdp_grad_begin(m, lay.final_norm_unit(), s);
    if (lay.vocab_pieces() > 1) {
        lm_head_in_pieces(m, s);
    } else {
        const int u = lay.head_unit(0);
        fsdp_acquire(m, u, s);
        fsdp_grad_begin(m, u, s);
        lm_head_whole(m, s);
        fsdp_grad_end(m, u, !m.cfg.tied_embeddings, s);  // tied: the lookup adds the rest at the end
        fsdp_release(m, u, s);
    }
    fsdp_grad_end(m, lay.final_norm_unit(), true, s);
    fsdp_release(m, lay.final_norm_unit(), s);
}

// The token embedding, forward and backward, one vocabulary piece (unit) at a time.
static void embedding_lookup(Model& m, cudaStream_t s) {
    const ParamLayout& lay = m.layout;
    for (int p = 0; p < lay.vocab_pieces(); p++) {
        fsdp_acquire(m, lay.embed_unit(p), s);
        embedding_forward(m.layers[0].x_in, m.tokens, m.w_piece(P_EMBED, p), lay.piece_row[p],
                          lay.piece_rows(p), m.shape.tokens(), m.cfg.dim, s);
        fsdp_release(m, lay.embed_unit(p), s);
    }
}

static void embedding_lookup_backward(Model& m, cudaStream_t s) {  // d loss / d x_in of layer 0 in m.dres
    const ParamLayout& lay = m.layout;
    const std::vector<int32_t>& group_token = m.emb_groups.token;  // ascending: a piece's groups are a range
    for (int p = 0; p < lay.vocab_pieces(); p++) {
        const int64_t g0 = std::lower_bound(group_token.begin(), group_token.end(), lay.piece_row[p]) - group_token.begin();
        const int64_t g1 = std::lower_bound(group_token.begin(), group_token.end(), lay.piece_row[p + 1]) - group_token.begin();
        fsdp_grad_begin(m, lay.embed_unit(p), s);
        embedding_backward(m.g_piece(P_EMBED, p), lay.piece_row[p], m.dres, m.emb_group_token + g0,
                           m.emb_group_begin + g0, m.emb_positions, g1 - g0, m.cfg.dim, s);
        fsdp_grad_end(m, lay.embed_unit(p), true, s);
    }
}

void model_forward_backward(Model& m, cudaStream_t s, ProgressFn progress, void* ctx) {
    const LlamaConfig& c = m.cfg;
    const int64_t T = m.shape.tokens();
    const int L = c.n_layers;
    auto layer_unit = [&](int l) { return m.layout.layer_unit(l); };
    timeline_step_begin(m, s);  // --timeline: the marks are times from here
    fsdp_step_begin(m, s);      // zeroes the gradients
    offload_step_begin(m, s);
    m.progress_recorded = 0;
    auto progressed = [&]() {  // for the watchdog of model_sync, and the times of --mem-trace
        if (m.progress_recorded < (int)m.progress.size())
            CUDA_CHECK(cudaEventRecord(m.progress[m.progress_recorded++], s));
    };
    progressed();  // the step's start

    // Forward.
    embedding_lookup(m, s);
    offload_save_block_input(m, 0, s);
    for (int l = 0; l < L; l++) {
        int mark = timeline_begin(m, s);
        fsdp_acquire(m, layer_unit(l), s);
        offload_before_layer_forward(m, l, s);
        layer_forward(m, l, s);
        fsdp_release(m, layer_unit(l), s);
        offload_after_layer_forward(m, l, s);  // x_out is layer l+1's input: to the host
        timeline_end(m, mark, "compute", "forward", l, s);
        progressed();
        if (progress) progress(ctx, "fwd", l);
    }

    // LM head and loss, forward and backward together: dres = d loss / d x_final.
    int mark = timeline_begin(m, s);
    head_forward_backward(m, s);
    sum_floats(m.scalars + 0, m.losses, T, m.reduce_scratch, s);
    timeline_end(m, mark, "compute", "head", -1, s);
    progressed();

    // Backward through the layers, then the embedding (its lookup needs no weights).
    for (int l = L - 1; l >= 0; l--) {
        mark = timeline_begin(m, s);
        fsdp_acquire(m, layer_unit(l), s);
        fsdp_grad_begin(m, layer_unit(l), s);
        offload_before_layer_backward(m, l, s);  // layer l's kept tensors back in the slot
        layer_backward(m, l, s);
        fsdp_grad_end(m, layer_unit(l), true, s);
        fsdp_release(m, layer_unit(l), s);
        timeline_end(m, mark, "compute", "backward", l, s);
        progressed();
        if (progress) progress(ctx, "bwd", l);
    }
    embedding_lookup_backward(m, s);
    fsdp_step_end(m, s);
    timeline_step_end(m);
    // scalars[0] holds this GPU's sum of raw per-token losses (only their gradient was scaled by
    // 1 / the step's count of valid targets). Summed over the GPUs it is the step's total loss,
    // which the caller divides by that count.
    if (m.world > 1) m.comm->all_reduce(m.scalars + 0, 1, DType::F32, s);
}

// --mem-trace. The arena is allocated once, so the device's total is flat by design; what
// changes over a step is which of its bytes hold live data. Model states, communication slots and
// workspace are live throughout; the activations each layer keeps in a slot of its own fill up
// over the forward and empty over the backward, and so does the pinned host memory of --offload.
// (The attention outputs =selective --offload keeps on the device count as live throughout.)
// Each point is one progress event of the last step, timed on the GPU.
std::vector<MemTracePoint> model_memory_trace(const Model& m, const Arena& arena) {
    const int L = m.cfg.n_layers;
    // The host holds the block inputs of every layer but the rebuilt ones (and with
    // --ckpt=selective the attention outputs and lse of the first att_host_layers): input l+1 is
    // copied out right after layer l's forward, the attention output of layer l with it; the
    // backward frees them from the last layer down.
    const int64_t T = m.shape.tokens();
    const int64_t host_x = m.plan.x_in == Hold::ON_HOST ? T * m.cfg.dim * 2 : 0;
    const int64_t host_att = m.plan.att == Hold::ON_HOST ? T * m.cfg.q_dim() * 2 + layer_lse_floats(m) * 4 : 0;
    auto host_at = [&](int inputs, int atts) {
        return host_x * offload_host_inputs(m, std::min(inputs, L)) + host_att * std::min(atts, m.plan.att_host_layers);
    };
    std::vector<MemTracePoint> pts;
    auto add = [&](const char* point, int layer, int event, int held, int64_t host) {
        if (event >= m.progress_recorded) return;
        MemTracePoint p;
        p.point = point, p.layer = layer;
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, m.progress[0], m.progress[event]));
        p.t_ms = ms;
        for (int c = 0; c < MEM_NUM_CATEGORIES; c++)
            p.live[c] = arena.category_bytes(c) - (int64_t)(L - held) * m.saved_per_layer[c];
        p.host = host;
        pts.push_back(p);
    };
    add("start", -1, 0, 0, 0);
    for (int l = 0; l < L; l++) add("fwd", l, 1 + l, l + 1, host_at(l + 2, l + 1));
    add("head", -1, 1 + L, L, host_at(L, L));
    for (int l = L - 1; l >= 0; l--) add("bwd", l, 2 + L + (L - 1 - l), l, host_at(l, l));
    return pts;
}

void model_optimizer_step(Model& m, const AdamW& opt, float max_grad_norm, cudaStream_t s) {
    // Global gradient norm: each GPU's sum of squares; summed over the shards under --fsdp
    // (replicated gradients are already the same everywhere).
    sum_squares(m.scalars + 1, m.grad, m.local_params, m.reduce_scratch, s);
    if (m.opt.fsdp && m.world > 1) m.comm->all_reduce(m.scalars + 1, 1, DType::F32, s);
    clip_scale(m.scalars + 2, m.scalars + 1, max_grad_norm, s);
    for (const ParamSegment& seg : fsdp_segments(m))
        adamw_update(m.master + seg.local, m.grad + seg.local, m.adam_m + seg.local,
                     m.adam_v + seg.local, seg.count, opt, seg.tensor->decay, m.scalars + 2, s);
}

double model_step_flops(const LlamaConfig& c, const RunShape& shape) {  // per GPU
    double matmul = 6.0 * (double)count_matmul_params(c) * (double)shape.tokens();
    AttentionShape sh{shape.batch, shape.seq, c.n_heads / shape.sp, c.n_kv_heads, c.head_dim};
    double attn = 3.5 * attention_forward_flops(sh) * c.n_layers;
    return matmul + attn;
}
