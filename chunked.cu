// chunked.cu - chunked sequence training (--chunked, ladder stage 5; the talk at 09:33, and
// the chunk-size trade-off at 11:43): tiled MLP, chunked element-wise work, and a fused chunked
// LM head + cross-entropy.
//
// At millions of tokens per GPU the buffers that are as wide as the whole local sequence
// dominate what is left after checkpointing: the MLP intermediates (T x 2F for gate|up, T x F
// for the activation; 8B: F = 14336, so 86 KB per token) and above all the logits (T x V;
// V = 128256: 256 KB per token in bf16). None of them needs all tokens at once: the MLP and
// every element-wise operation (RMSNorm, RoPE, residual adds) work token by token, and so does
// the loss. So they run on chunks of C tokens and their buffers hold C rows:
//
//   per layer, for each chunk [t0, t1):   xn1 = norm(x_in); qkv[t0:t1] = xn1 Wqkv^T; RoPE
//   attention over the whole sequence     (it mixes tokens: qkv, att, lse stay full length)
//   per layer, for each chunk:            x_mid = x_in + att Wo^T; xn2 = norm(x_mid);
//                                         h13 = xn2 W13^T; act = silu(gate) up; x_out = x_mid + act W2^T
//   head, for each loss chunk:            logits = norm(x) Whead^T; loss and dlogits at once;
//                                         dx = dlogits Whead; dWhead += dlogits^T norm(x)
//
// The backward repeats each chunk's forward from the chunk's input (the tiled MLP of ALST,
// arXiv 2506.13996, keeps nothing but the block input) and accumulates weight gradients across
// chunks in fp32 (GEMMs with beta = 1), so they reach FSDP's reduce-scatter once per layer.
//
// Buffers that still span the local sequence (what the algorithm truly needs): the block
// inputs x_in (kept by checkpointing, on the host under --offload), qkv, att and lse (attention
// reads every key), their gradients dqkv, datt and delta, the residual gradient dres, and the
// per-token losses, tokens and targets. Everything else is C rows.
//
// Memory, per GPU, for T local tokens (bytes; the "other" category):
//   without --chunked: MLP work 2 T (2D + 3F) + 8 T and its gradients 2 T (D + 3F);
//                      logits 2 T V (their gradient overwrites them)
//   with --chunked:    the same with T replaced by C (MLP) and C_loss (logits)
// e.g. Llama 3.1 8B, T = 393216 (3M tokens over 8 GPUs): logits 94 GiB -> 1 GiB, MLP work and
// its gradients 72 GiB -> 0.75 GiB (C = 4096).
// Cost: the forward of the MLP (and norms) runs again in the backward, about 1/8 more FLOPs
// in the MLP, plus smaller GEMMs; the logits GEMM is not repeated (loss and its gradient are
// computed in one pass).
//
// Chunk sizes: C defaults to the hidden size (ALST's choice: a tile of D tokens keeps the MLP's
// GEMMs large enough to run at full speed); C_loss keeps one chunk's bf16 logits near 1 GiB
// (4096 tokens for a 128K vocabulary). Neither needs to divide T.
#include <algorithm>

#include "llama.h"

int64_t chunk_rows_for(const LlamaConfig& c, const StepOptions& o, int64_t T) {
    if (!o.chunked) return T;
    int64_t k = o.chunk_tokens > 0 ? o.chunk_tokens : c.dim;
    return std::max<int64_t>(1, std::min(k, T));
}

int64_t loss_chunk_rows_for(const LlamaConfig& c, const StepOptions& o, int64_t T) {
    if (!o.chunked) return T;
    int64_t k = o.loss_chunk_tokens;
    if (k <= 0) k = std::max<int64_t>(256, ((1LL << 30) / (2LL * c.vocab)) / 256 * 256);
    return std::max<int64_t>(1, std::min(k, T));
}

template <class P>
static P at(P base, int64_t t0, int64_t width) {
    return base + t0 * width;
}

// ---------------------------------------------------------------------------------------------
// The tail of a transformer block on tokens [t0, t1): attention output projection and the
// residual, then RMSNorm, SwiGLU MLP and the residual. Its input is the attention output, so
// under --ckpt the MLP block's own input x_mid is rebuilt from it in the backward.
static bf16* x_mid_rows(Model& m, int l, int64_t t0) {
    LayerActivations& a = m.layers[l];
    return m.keeps_attention() ? at(a.x_mid, t0, m.cfg.dim) : a.x_mid;  // kept, or chunk work
}

void mlp_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    const int64_t n = t1 - t0, D = c.dim, F = c.ffn_dim;
    bf16* x_mid = x_mid_rows(m, l, t0);
    linear_forward(x_mid, at(a.att, t0, c.q_dim()), m.w(P_WO, l), at(a.x_in, t0, D), n, c.q_dim(), D, s);
    rmsnorm_forward(a.xn2, a.rstd2, x_mid, m.w(P_MLP_NORM, l), n, D, c.norm_eps, s);
    linear_forward(a.h13, a.xn2, m.w(P_W13, l), nullptr, n, D, 2 * F, s);
    swiglu_forward(a.act, a.h13, n, F, s);
    linear_forward(at(a.x_out, t0, D), a.act, m.w(P_W2, l), x_mid, n, F, D, s);
}

// On entry dres[t0:t1] is d loss / d x_out; on exit d loss / d x_mid, and datt[t0:t1] is filled
// (except under Untied Ulysses, which takes d att a head chunk at a time).
void mlp_backward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    const int64_t n = t1 - t0, D = c.dim, F = c.ffn_dim, QD = c.q_dim();
    bf16* x_mid = x_mid_rows(m, l, t0);
    // Recompute what this chunk did not keep.
    if (!m.keeps_attention())
        linear_forward(x_mid, at(a.att, t0, QD), m.w(P_WO, l), at(a.x_in, t0, D), n, QD, D, s);
    if (!m.keeps_mlp()) {
        rmsnorm_forward(a.xn2, a.rstd2, x_mid, m.w(P_MLP_NORM, l), n, D, c.norm_eps, s);
        linear_forward(a.h13, a.xn2, m.w(P_W13, l), nullptr, n, D, 2 * F, s);
        swiglu_forward(a.act, a.h13, n, F, s);
    }
    bf16* dres = at(m.dres, t0, D);
    // x_out = x_mid + act W2^T
    linear_backward_input(m.dact, dres, m.w(P_W2, l), n, F, D, s);
    linear_backward_weight(m.g(P_W2, l), dres, a.act, n, F, D, s);
    swiglu_backward(m.dh13, m.dact, a.h13, n, F, s);
    linear_backward_input(m.dxn, m.dh13, m.w(P_W13, l), n, D, 2 * F, s);
    linear_backward_weight(m.g(P_W13, l), m.dh13, a.xn2, n, D, 2 * F, s);
    rmsnorm_backward(dres, m.g(P_MLP_NORM, l), m.dxn, x_mid, m.w(P_MLP_NORM, l), a.rstd2, n, D, true,
                     m.norm_partial, s);
    // x_mid = x_in + att Wo^T. Untied Ulysses takes d att one head chunk at a time (ulysses.cu).
    if (!m.opt.untied) linear_backward_input(at(m.datt, t0, QD), dres, m.w(P_WO, l), n, QD, D, s);
    linear_backward_weight(m.g(P_WO, l), dres, at(a.att, t0, QD), n, QD, D, s);
}

// ---------------------------------------------------------------------------------------------
// LM head and loss, fused per chunk: the [T, V] logits never exist, only [C_loss, V].
void head_forward_backward(Model& m, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    const int64_t T = m.shape.tokens(), D = c.dim, V = c.vocab;
    const ParamKind head = c.tied_embeddings ? P_EMBED : P_LM_HEAD;
    // The loss is the mean over valid targets of the whole step, counted on the host.
    const float grad_scale = m.n_valid_targets > 0 ? 1.0f / (float)m.n_valid_targets : 0.0f;
    for (int64_t t0 = 0; t0 < T; t0 += m.loss_rows) {
        const int64_t n = std::min(m.loss_rows, T - t0);
        const bf16* x = at(m.x_final, t0, D);
        rmsnorm_forward(m.xnf, m.rstdf, x, m.w(P_FINAL_NORM), n, D, c.norm_eps, s);
        linear_forward(m.logits, m.xnf, m.w(head), nullptr, n, D, V, s);
        cross_entropy_forward_backward(m.logits, m.losses + t0, m.targets + t0, n, (int)V, grad_scale, s);
        linear_backward_input(m.dxn, m.logits, m.w(head), n, D, V, s);  // logits now hold dlogits
        linear_backward_weight(m.g(head), m.logits, m.xnf, n, D, V, s);
        rmsnorm_backward(at(m.dres, t0, D), m.g(P_FINAL_NORM), m.dxn, x, m.w(P_FINAL_NORM), m.rstdf, n, D,
                         false, m.norm_partial, s);
    }
}
