// kernels/kernels.h - the layers' kernels and the matrix products, as the step calls them: the
// cuBLASLt wrappers (kernels/gemm.cu) and the element-wise and reduction kernels (kernels/kernels.cu).
// Shapes are row-major [T, width] for T tokens; bf16 activations, fp32 math and accumulation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <vector>

#include "infra/memory.h"

typedef __nv_bfloat16 bf16;

// ---------------------------------------------------------------------------------------------
// cuBLASLt matrix products, row-major: C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * Cin.
// A and B bf16; C bf16 or fp32 (`c_fp32`); Cin may alias C or be another buffer of the same type
// (residual adds: out = residual + x W^T in one call). fp32 accumulation always.
struct Gemm;
void gemm_init(size_t workspace_bytes, void* workspace);
void gemm_destroy();
void gemm_rm(bool transA, bool transB, int64_t M, int64_t N, int64_t K, const bf16* A,
             int64_t lda, const bf16* B, int64_t ldb, void* C, int64_t ldc, bool c_fp32,
             float alpha, float beta, const void* Cin, cudaStream_t stream);

// The three products of a linear layer y = x W^T, W [out, in]:
void linear_forward(bf16* y, const bf16* x, const bf16* W, const bf16* residual, int64_t T,
                    int64_t in, int64_t out, cudaStream_t s);  // y = x W^T (+ residual)
void linear_backward_input(bf16* dx, const bf16* dy, const bf16* W, int64_t T, int64_t in,
                           int64_t out, cudaStream_t s);       // dx = dy W
void linear_backward_weight(float* dW, const bf16* dy, const bf16* x, int64_t T, int64_t in,
                            int64_t out, cudaStream_t s);      // dW += dy^T x (fp32)

// ---------------------------------------------------------------------------------------------
// Element-wise and reduction kernels of the model (kernels/kernels.cu). T = tokens, row-major [T, width].
// x[t] = rows[tokens[t] - row0] for the tokens in [row0, row0 + n_rows) (one vocabulary piece of
// the table); the other rows of x are left as they are.
void embedding_forward(bf16* x, const int32_t* tokens, const bf16* rows, int64_t row0, int64_t n_rows, int64_t T,
                       int D, cudaStream_t s);
// Deterministic embedding backward: tokens grouped on the host (EmbeddingGroups), each group's
// rows summed in a fixed order, added to the fp32 gradient. drows holds the table's rows from row0 on:
// the groups given must be those of tokens in that piece.
struct EmbeddingGroups {
    std::vector<int32_t> token;     // distinct tokens
    std::vector<int64_t> begin;     // positions of token[i] are position[begin[i] .. begin[i+1])
    std::vector<int64_t> position;  // token positions, grouped, ascending within a group
    void build(const int32_t* tokens, int64_t T);
};
void embedding_backward(float* drows, int64_t row0, const bf16* dx, const int32_t* group_token,
                        const int64_t* group_begin, const int64_t* positions, int64_t n_groups,
                        int D, cudaStream_t s);

void rmsnorm_forward(bf16* y, float* rstd, const bf16* x, const bf16* w, int64_t T, int D,
                     float eps, cudaStream_t s);
// dx (+)= d/dx; dw += d/dw (fp32). `partial` is scratch of rmsnorm_partial_floats(D) floats.
void rmsnorm_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w,
                      const float* rstd, int64_t T, int D, bool accumulate_dx, float* partial,
                      cudaStream_t s);
int64_t rmsnorm_partial_floats(int D);
// RMSNorm of each head (Qwen3's q_norm and k_norm): in each of n_rows rows (`ld` elements apart),
// `heads` heads of d values (d a multiple of 64, at most 256), each normalized over its d values
// and scaled by w [d], in place. The backward overwrites dy (rows `ld` apart) with dx, from the
// values before the norm x (rows `ldx` apart), and adds dw (fp32); `partial` is scratch of
// rmsnorm_partial_floats(d) floats.
void head_rmsnorm_forward(bf16* x, int64_t ld, const bf16* w, int64_t n_rows, int heads, int d, float eps,
                          cudaStream_t s);
void head_rmsnorm_backward(bf16* dy, int64_t ld, const bf16* x, int64_t ldx, const bf16* w, float* dw,
                           int64_t n_rows, int heads, int d, float eps, float* partial, cudaStream_t s);

// Packed documents' RoPE positions (--doc-mask): the ascending starts of the step's documents in
// its flat [batch][seq] tokens, and the position of each one's first token (0, or where the
// window cut into it); a token's position counts from its document's start.
struct DocPositions {
    const int64_t* start = nullptr;  // device memory
    const int64_t* first = nullptr;
    int64_t count = 0;
};
// RoPE in place on n_heads heads of head_dim values per row (row stride `ld` elements), for
// n_rows rows that are tokens row0 .. row0 + n_rows - 1 of the step; token t has position
// pos0 + t % seq, or with documents its place in its document. inv_freq: head_dim/2 doubles on
// the device. inverse = true is the backward.
void rope_apply(bf16* x, int64_t n_rows, int64_t row0, int64_t seq, int64_t pos0, int n_heads,
                int head_dim, int64_t ld, const double* inv_freq, bool inverse, cudaStream_t s,
                const DocPositions& docs = {});

void swiglu_forward(bf16* act, const bf16* h13, int64_t T, int F, cudaStream_t s);
void swiglu_backward(bf16* dh13, const bf16* dact, const bf16* h13, int64_t T, int F,
                     cudaStream_t s);

// Fused cross-entropy forward and backward: losses[t] = lse_t - logit[t, target_t] (0 when
// target -1); the logits are overwritten by d(loss_sum * grad_scale)/d logits.
void cross_entropy_forward_backward(bf16* logits, float* losses, const int32_t* targets,
                                    int64_t T, int V, float grad_scale, cudaStream_t s);
// The same over logits that come in pieces of V columns from col0 on, [T, V] each (targets count
// from column 0 of the whole vocabulary). Per piece: each row's running max and sum of
// exponentials (first: start them) and the target's logit where the piece has it; after the last
// piece the loss (max becomes lse); then per piece the gradient, in place, with that lse.
void cross_entropy_piece_stats(const bf16* logits, int64_t T, int V, int64_t col0, const int32_t* targets,
                               float* run_max, float* run_sum, float* target_logit, bool first, cudaStream_t s);
void cross_entropy_piece_loss(float* losses, float* max_to_lse, const float* run_sum, const float* target_logit,
                              const int32_t* targets, int64_t T, cudaStream_t s);
void cross_entropy_piece_backward(bf16* logits, int64_t T, int V, int64_t col0, const float* lse,
                                  const int32_t* targets, float grad_scale, cudaStream_t s);

// Deterministic sum of n floats (two passes). scratch: sum_scratch_floats() floats.
void sum_floats(float* out, const float* x, int64_t n, float* scratch, cudaStream_t s);
void sum_squares(float* out, const float* x, int64_t n, float* scratch, cudaStream_t s);
int64_t sum_scratch_floats();

// AdamW on n values (torch.optim.AdamW semantics), grads first multiplied by *grad_scale (a
// device value, so clipping needs no host round trip). The bf16 weights are made from the
// master when a unit is next used (fsdp.cu).
struct AdamW {
    float lr, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
    int step;  // counts from 1
};
void adamw_update(float* master, const float* grad, float* m, float* v,
                  int64_t n, const AdamW& opt, bool decay, const float* grad_scale,
                  cudaStream_t s);
// grad_scale = min(1, max_norm / (sqrt(*sumsq) + 1e-6)), on the device.
void clip_scale(float* grad_scale, const float* sumsq, float max_norm, cudaStream_t s);

void fill_bf16(bf16* x, int64_t n, float value, cudaStream_t s);
void convert_f32_to_bf16(bf16* out, const float* in, int64_t n, cudaStream_t s);
// Deterministic init: N(0, std) from a counter-based hash of (seed, index).
// Value i is that of index index0 + i of the whole tensor (a shard draws its part of it).
void init_normal(float* x, int64_t n, float stddev, uint64_t seed, cudaStream_t s, int64_t index0 = 0);
void init_normal_bf16(bf16* x, int64_t n, float stddev, uint64_t seed, cudaStream_t s, int64_t index0 = 0);
void init_constant(float* x, int64_t n, float value, cudaStream_t s);
