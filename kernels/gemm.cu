// kernels/gemm.cu - the matrix products: cuBLASLt, row-major, bf16 in, fp32 accumulation; one
// plan per shape, chosen once by cuBLASLt's heuristic and reused; the three products of a linear
// layer on top.
#include <cublasLt.h>

#include <map>
#include <tuple>

#include "kernels/kernels.h"

static void cublas_check(cublasStatus_t st, const char* what, const char* file, int line) {
    if (st == CUBLAS_STATUS_SUCCESS) return;
    throw Fatal(EXIT_RUNTIME, std::string(what) + " failed at " + file + ":" +
                                  std::to_string(line) + ": cuBLAS status " + std::to_string(st));
}
#define CUBLAS_CHECK(call) cublas_check((call), #call, __FILE__, __LINE__)

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
    const GemmKey key{.ta = transA, .tb = transB, .c32 = c_fp32, .beta = beta != 0.0f, .M = M, .N = N, .K = K,
                      .lda = lda, .ldb = ldb, .ldc = ldc};
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
