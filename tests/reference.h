// tests/reference.h - the float64 CPU reference of the model: the oracle of every GPU test.
//
// Written independently of the GPU code (it shares only the parameter layout and the configs of
// infra/common.h): plain loops, float64, no tiling, no fusion. Every function is the textbook
// definition, so a disagreement with the GPU points at the GPU side.
//
// Conventions:
//   * Tensors are dense, row-major, float64. T = B * S tokens; token t is position t % S of
//     sequence t / S.
//   * "forward" functions overwrite their outputs; "backward" functions overwrite input gradients
//     (dx, dq, ...) and ACCUMULATE (+=) parameter gradients (dw), as the GPU code does.
//   * Targets equal to -1 are ignored by the loss; the loss is the mean over the other tokens.
#pragma once

#include <cstdint>
#include <vector>

#include "../infra/common.h"

namespace ref {

// Packed documents (--doc-mask): for each token t of the B * S, the first key of its document
// in its sequence (first_key[t] <= t % S: it attends to keys first_key[t] .. t % S of its
// sequence), and its RoPE position. Without them: one document per sequence, every first key 0,
// position t % S.
struct Documents {
    std::vector<int64_t> first_key, position;
};

// RMSNorm: y = x / sqrt(mean(x^2) + eps) * w. rstd[t] = 1/sqrt(mean(x_t^2) + eps).
void rmsnorm_forward(const double* x, const double* w, double* y, double* rstd, int64_t T, int D,
                     double eps);
void rmsnorm_backward(const double* dy, const double* x, const double* w, const double* rstd,
                      double* dx, double* dw, int64_t T, int D);

// Llama 3 inverse frequencies (head_dim/2 values), with the config's "llama3" rope scaling.
std::vector<double> rope_inv_freq(const LlamaConfig& c);

// RoPE in HF's rotate-half layout, in place, on n_heads heads of head_dim values per token:
// x[t*row_stride + h*head_dim + i]. Position of token t is t % S, or positions[t]. For i < head_dim/2, with
// angle a = pos * inv_freq[i]:
//   x1' = x1 cos a - x2 sin a,  x2' = x2 cos a + x1 sin a   (x1 = x[i], x2 = x[i + head_dim/2])
// inverse = true rotates by -a (that is the backward: the gradient of a rotation is the
// inverse rotation).
void rope_apply(double* x, int64_t T, int64_t S, int n_heads, int head_dim, int64_t row_stride,
                const std::vector<double>& inv_freq, bool inverse, const int64_t* positions = nullptr);

// Causal grouped-query attention of B sequences of S tokens.
//   q [T, Hq*d], k [T, Hkv*d], v [T, Hkv*d], out [T, Hq*d], lse [B, Hq, S] (natural log of the
//   softmax denominator of the scaled scores). Query head h uses KV head h / (Hq/Hkv).
//   scale = 1/sqrt(d). first_key (per token, may be null): query row i of a sequence attends to
//   keys first_key .. i only (packed documents).
void attention_forward(const double* q, const double* k, const double* v, double* out,
                       double* lse, int B, int64_t S, int Hq, int Hkv, int d, const int64_t* first_key = nullptr);
void attention_backward(const double* q, const double* k, const double* v, const double* dout,
                        double* dq, double* dk, double* dv, int B, int64_t S, int Hq, int Hkv,
                        int d, const int64_t* first_key = nullptr);

// SwiGLU: h13 [T, 2F] holds gate (first F columns) then up; act = silu(gate) * up, [T, F].
void swiglu_forward(const double* h13, double* act, int64_t T, int F);
void swiglu_backward(const double* dact, const double* h13, double* dh13, int64_t T, int F);

// Mean cross-entropy over non-ignored tokens. logits [T, V]. Returns the loss; dlogits (if not
// null) receives d loss / d logits.
double cross_entropy(const double* logits, const int32_t* targets, double* dlogits, int64_t T,
                     int V);

// y = x W^T with W [out, in]:  y [T, out]. Backward: dx = dy W (overwrite), dW += dy^T x.
void linear_forward(const double* x, const double* W, double* y, int64_t T, int in, int out);
void linear_backward(const double* dy, const double* x, const double* W, double* dx, double* dW,
                     int64_t T, int in, int out);

// The whole model: embedding, L x (RMSNorm, QKV, (Qwen3: RMSNorm of each head of q and k),
// RoPE, attention, O, residual, RMSNorm, SwiGLU MLP, residual), final RMSNorm, LM head (tied: the embedding), mean cross-entropy.
// params and grads use param_layout(cfg) offsets; grads is overwritten (zeroed first).
// Returns the loss. If logits_out is not null it receives the [T, V] logits.
// docs (may be null): packed documents, each attending within itself, positions from its start.
double model_forward_backward(const LlamaConfig& cfg, const double* params,
                              const int32_t* tokens, const int32_t* targets, int B, int64_t S,
                              double* grads, std::vector<double>* logits_out = nullptr,
                              const Documents* docs = nullptr);

// Loss only (no gradients), for finite differences.
double model_loss(const LlamaConfig& cfg, const double* params, const int32_t* tokens,
                  const int32_t* targets, int B, int64_t S, const Documents* docs = nullptr);

// One AdamW step as torch.optim.AdamW does it (decoupled weight decay, bias correction),
// applied to n values: p *= (1 - lr*wd) if decay; m, v updated; p -= lr * mhat/(sqrt(vhat)+eps).
// step counts from 1. grad_scale multiplies the gradient first (global-norm clipping).
void adamw_step(double* p, const double* g, double* m, double* v, int64_t n, double lr,
                double beta1, double beta2, double eps, double weight_decay, bool decay,
                int step, double grad_scale);

}  // namespace ref
