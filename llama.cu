// llama.cu - Llama 3 on one GPU (ladder stage 0), and the training step into which each technique
// of the talk enters by name, where it acts. The kernels it calls are kernels/ (kernels.h,
// attention.h); the techniques live in fsdp.cu, ulysses.cu, offload.cu and chunked.cu, and stage 7
// in beyond/.
//
// The step, for T = batch * seq tokens (shapes row-major, bf16 unless noted):
//
//   x = embed[tokens]                                   [T, D]
//   for each layer l:
//     xn1, rstd1 = rmsnorm(x)                           rstd fp32 [T]
//     qkv = xn1 @ Wqkv^T ; rope(q, k)                   [T, (Hq + 2 Hkv) d]
//       (Qwen3: q, k = rmsnorm per head before RoPE)
//     att, lse = flash_attention(q, k, v)               [T, Hq d], lse fp32 [B, Hq, S]
//     x_mid = x + att @ Wo^T                            (one GEMM with the residual as C)
//     xn2, rstd2 = rmsnorm(x_mid)
//     h13 = xn2 @ W13^T ; act = silu(gate) * up         [T, 2F], [T, F]
//     x = x_mid + act @ W2^T
//   logits = rmsnorm(x) @ Whead^T                       [T, V]
//   loss = mean cross-entropy; dlogits overwrite logits in the same kernel
//
// The backward walks the same path in reverse with one residual-gradient buffer `dres` that
// every branch adds into. Weight gradients accumulate in fp32 (GEMMs with beta = 1) into a flat
// gradient buffer zeroed at the start of the step; every reduction is deterministic (fixed
// order, no atomics), so the same seed gives the same losses.
//
// Every per-token piece of a layer works on a token range [t0, t1): a layer walks its tokens in
// chunks, one chunk of all T tokens in the plain step, chunks of C tokens under --chunked. The
// plain step keeps every activation for the backward. A technique changes that in its *_plan
// (where each activation lives: the ActivationPlan of llama.h), and the step calls the
// technique's functions by name where it acts, under its flag or plan: `if (m.opt.offload)
// offload_save_block_input(m, l, s);`. docs/design.md lists every such call, and a test keeps
// that list true to this file.
#include <algorithm>

#include "llama.h"

// Rows from token t0 on of a full-length [T, width] buffer.
template <class P>
static P at(P base, int64_t t0, int64_t width) {
    return base + t0 * width;
}

// The token chunks a layer and the head walk: all T tokens at once, or (--chunked, chunked.cu)
// chunks of the plan's chunk_rows and loss_rows.
void for_each_token_chunk(const Model& m, const std::function<void(int64_t t0, int64_t t1)>& f) {
    const int64_t T = m.shape.tokens(), C = m.plan.chunk_rows;
    for (int64_t t0 = 0; t0 < T; t0 += C) f(t0, std::min(t0 + C, T));
}

void for_each_loss_chunk(const Model& m, const std::function<void(int64_t t0, int64_t n)>& f) {
    const int64_t T = m.shape.tokens(), C = m.plan.loss_rows;
    for (int64_t t0 = 0; t0 < T; t0 += C) f(t0, std::min(C, T - t0));
}

// =============================================================================================
// The token embedding, forward and backward, one unit of vocabulary rows at a time: the whole
// table is one unit, unless stage 7 cuts it into pieces (--vocab-pieces, beyond/savings.cu).
static void embedding_lookup(Model& m, cudaStream_t s) {
    const ParamLayout& lay = m.layout;
    for (int p = 0; p < lay.vocab_pieces(); p++) {
        unit_begin(m, lay.embed_unit(p), WEIGHTS, s);
        embedding_forward(m.layers[0].x_in, m.batch.tokens, m.w_piece(P_EMBED, p), lay.piece_row[p],
                          lay.piece_rows(p), m.shape.tokens(), m.cfg.dim, s);
        unit_end(m, lay.embed_unit(p), WEIGHTS, s);
    }
}

static void embedding_lookup_backward(Model& m, cudaStream_t s) {  // d loss / d x_in of layer 0 in m.dres
    const ParamLayout& lay = m.layout;
    const std::vector<int32_t>& group_token = m.batch.groups.token;  // ascending: a piece's groups are a range
    for (int p = 0; p < lay.vocab_pieces(); p++) {
        const int64_t g0 = std::lower_bound(group_token.begin(), group_token.end(), lay.piece_row[p]) - group_token.begin();
        const int64_t g1 = std::lower_bound(group_token.begin(), group_token.end(), lay.piece_row[p + 1]) - group_token.begin();
        unit_begin(m, lay.embed_unit(p), GRADIENTS, s);
        embedding_backward(m.g_piece(P_EMBED, p), lay.piece_row[p], m.dres, m.batch.group_token + g0,
                           m.batch.group_begin + g0, m.batch.positions, g1 - g0, m.cfg.dim, s);
        unit_end(m, lay.embed_unit(p), GRADIENTS, s);
    }
}

// =============================================================================================
// One layer's forward: x_in -> x_out, keeping what the backward reads. First the attention
// sub-layer, over the whole sequence; then the rest of the block, token chunk by token chunk.
// Ulysses (stage 2) and Untied Ulysses (stage 6) replace parts of the attention sub-layer
// (ulysses.cu); activation checkpointing (stage 3, offload.cu) runs these functions again in the
// backward.

// xn1 = rmsnorm(x_in) of tokens [t0, t1).
void attention_norm_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    rmsnorm_forward(a.xn1, a.rstd1, at(a.x_in, t0, c.dim), m.w(P_ATTN_NORM, l), t1 - t0, c.dim, c.norm_eps, s);
}

// Qwen3 (cfg.qk_norm()): q and k normalized per head before RoPE, in place: q_heads heads of each
// of n rows ldq apart, and (k not null) kv_heads of rows ldk apart. Nothing for Llama.
void qk_norm_forward(Model& m, int l, bf16* q, int64_t ldq, int q_heads, bf16* k, int64_t ldk, int kv_heads, int64_t n,
                     cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    if (!c.qk_norm()) return;
    head_rmsnorm_forward(q, ldq, m.w(P_Q_NORM, l), n, q_heads, c.head_dim, c.norm_eps, s);
    if (k) head_rmsnorm_forward(k, ldk, m.w(P_K_NORM, l), n, kv_heads, c.head_dim, c.norm_eps, s);
}

// Attention's inputs, q|k|v of layer l as the attention call reads them, token chunk by token
// chunk: xn1 = rmsnorm(x_in); q|k|v = xn1 Wqkv^T; (Qwen3) q and k normalized per head; RoPE on q
// and k (the positions of this GPU's tokens, or with packed documents their places in them).
void attention_inputs_forward(Model& m, int l, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    const int64_t QKV = c.qkv_dim();
    bf16* qkv = m.ulysses ? ulysses_token_qkv(m) : a.qkv;  // ulysses.cu: this GPU's tokens go to its staging
    for_each_token_chunk(m, [&](int64_t t0, int64_t t1) {
        bf16* x = qkv + t0 * QKV;
        attention_norm_forward(m, l, t0, t1, s);
        linear_forward(x, a.xn1, m.w(P_WQKV, l), nullptr, t1 - t0, c.dim, QKV, s);
        qk_norm_forward(m, l, x, QKV, c.n_heads, x + c.q_dim(), QKV, c.n_kv_heads, t1 - t0, s);
        rope_apply(x, t1 - t0, t0, m.shape.seq, m.shape.first_position(), c.n_heads + c.n_kv_heads, c.head_dim, QKV,
                   m.inv_freq, false, s, m.docs.positions);
    });
    if (m.ulysses) ulysses_qkv_to_heads(m, l, s);  // ulysses.cu: all-to-all, this GPU's tokens -> its heads
}

// The attention sub-layer's forward: att, lse of layer l from x_in. Untied Ulysses replaces all of
// it (its head chunks project their own q|k|v); Ulysses the attention call, on this GPU's share
// of the heads over the whole sequence.
void attention_block_forward(Model& m, int l, cudaStream_t s) {
    if (m.untied) return untied_attention_forward(m, l, s);    // ulysses.cu, stage 6: head chunk by head chunk
    attention_inputs_forward(m, l, s);
    if (m.ulysses) return ulysses_attention_forward(m, l, s);  // ulysses.cu, stage 2: output back to tokens
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    const int64_t QKV = c.qkv_dim();
    const AttentionForwardArgs fa{.q = a.qkv, .k = a.qkv + c.q_dim(), .v = a.qkv + c.q_dim() + c.kv_dim(),
                                  .ldq = QKV, .ldk = QKV, .ldv = QKV, .out = a.att, .ldo = c.q_dim(), .lse = a.lse,
                                  .docs = m.docs.attention};
    layer_attention_forward(m, l, fa, attention_call_shape(m), s);  // att, lse = flash attention(q, k, v)
}

// The shape of one attention call: every sequence of this GPU with the heads its attention
// takes: all of them, or under Ulysses this GPU's share over the whole sequence (Untied Ulysses
// takes one head chunk at a time: untied_attention_shape).
AttentionShape attention_call_shape(const Model& m) {
    const AttentionHeads h = attention_heads(m.cfg, m.shape.sp);
    return {m.shape.batch, m.shape.seq, h.q, h.kv, m.cfg.head_dim};
}

// Each of the sp GPUs that share a sequence takes Hq / sp query heads and the KV heads they read:
// Hkv / sp, or one KV head that several GPUs share (ulysses.cu).
AttentionHeads attention_heads(const LlamaConfig& c, int sp) {
    return {c.n_heads / sp, std::max(1, c.n_kv_heads / sp)};
}

// One attention call of layer l, marked on --timeline.
void layer_attention_forward(Model& m, int l, const AttentionForwardArgs& a, const AttentionShape& sh,
                             cudaStream_t s) {
    TimelineMark mark(m, s, "compute", "attention forward", l);
    attention_forward(a, sh, s);
}

void layer_attention_backward(Model& m, int l, const AttentionBackwardArgs& a, const AttentionShape& sh,
                              cudaStream_t s) {
    TimelineMark mark(m, s, "compute", "attention backward", l);
    attention_backward(a, sh, s);
}

// x_mid = x_in + att Wo^T of tokens [t0, t1) (one GEMM with the residual as C).
void attention_output_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    linear_forward(a.x_mid_rows(t0), at(a.att, t0, c.q_dim()), m.w(P_WO, l), at(a.x_in, t0, c.dim), t1 - t0,
                   c.q_dim(), c.dim, s);
}

// xn2 = rmsnorm(x_mid); h13 = xn2 W13^T; act = silu(gate) * up.
void mlp_input_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    const int64_t n = t1 - t0;
    rmsnorm_forward(a.xn2, a.rstd2, a.x_mid_rows(t0), m.w(P_MLP_NORM, l), n, c.dim, c.norm_eps, s);
    linear_forward(a.h13, a.xn2, m.w(P_W13, l), nullptr, n, c.dim, 2 * c.ffn_dim, s);
    swiglu_forward(a.act, a.h13, n, c.ffn_dim, s);
}

// Tokens [t0, t1) of the block after attention: x_mid = x_in + att Wo^T, xn2 = norm(x_mid),
// act = silu(xn2 W1^T) * (xn2 W3^T), x_out = x_mid + act W2^T.
void block_output_forward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    attention_output_forward(m, l, t0, t1, s);
    mlp_input_forward(m, l, t0, t1, s);
    linear_forward(at(a.x_out, t0, c.dim), a.act, m.w(P_W2, l), a.x_mid_rows(t0), t1 - t0, c.ffn_dim, c.dim, s);
}

static void layer_forward(Model& m, int l, cudaStream_t s) {
    attention_block_forward(m, l, s);                              // att, lse = attention(rope(norm(x_in) Wqkv^T))
    if (m.opt.offload) offload_before_layer_output(m, l, s);      // offload.cu: x_out's slot has sent its input out
    if (attention_on_host(m)) selective_after_attention(m, l, s);  // beyond/selective.cu: att, lse to the host
    TimelineMark mark(m, s, "compute", "wo and mlp forward", l);
    for_each_token_chunk(m, [&](int64_t t0, int64_t t1) { block_output_forward(m, l, t0, t1, s); });
}

// =============================================================================================
// One layer's backward. On entry m.dres holds d loss / d x_out of layer l; on exit d loss / d x_in.
// What the plan did not keep is made again from x_in first: the attention sub-layer (offload.cu,
// activation checkpointing), and each chunk's inputs before that chunk's backward.

// The MLP half, chunk by chunk. On entry dres[t0:t1] is d loss / d x_out; on exit d loss / d x_mid,
// and d att of the chunk is taken.
static void mlp_backward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    const int64_t n = t1 - t0, D = c.dim, F = c.ffn_dim, QD = c.q_dim();
    if (m.plan.x_mid == Hold::RECOMPUTED) attention_output_forward(m, l, t0, t1, s);  // x_mid again (--ckpt)
    if (m.plan.norms_mlp == Hold::RECOMPUTED) mlp_input_forward(m, l, t0, t1, s);    // xn2, h13, act (--ckpt, --chunked)
    bf16* dres = at(m.dres, t0, D);
    // x_out = x_mid + act W2^T
    linear_backward_input(m.chunk.dact, dres, m.w(P_W2, l), n, F, D, s);
    linear_backward_weight(m.g(P_W2, l), dres, a.act, n, F, D, s);
    swiglu_backward(m.chunk.dh13, m.chunk.dact, a.h13, n, F, s);
    linear_backward_input(m.chunk.dxn, m.chunk.dh13, m.w(P_W13, l), n, D, 2 * F, s);
    linear_backward_weight(m.g(P_W13, l), m.chunk.dh13, a.xn2, n, D, 2 * F, s);
    rmsnorm_backward(dres, m.g(P_MLP_NORM, l), m.chunk.dxn, a.x_mid_rows(t0), m.w(P_MLP_NORM, l), a.rstd2, n, D, true,
                     m.work.norm_partial, s);
    // x_mid = x_in + att Wo^T: d att = d x_mid Wo (Untied Ulysses takes it a head chunk at a time)
    if (m.plan.datt_buffer) linear_backward_input(at(m.datt, t0, QD), dres, m.w(P_WO, l), n, QD, D, s);
    linear_backward_weight(m.g(P_WO, l), dres, at(a.att, t0, QD), n, QD, D, s);
}

// Qwen3: d q|k of n tokens (rows ld apart) back through the per-head norms, in place; nothing for
// Llama. The values before the norms are not kept: they are projected again from the normalized input xn.
static void qk_norm_backward(Model& m, int l, bf16* dqk, int64_t ld, const bf16* xn, int64_t n, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    if (!c.qk_norm()) return;
    const int64_t QK = c.q_dim() + c.kv_dim();  // Wqkv's first rows: q, then k
    linear_forward(m.chunk.qk_raw, xn, m.w(P_WQKV, l), nullptr, n, c.dim, QK, s);
    head_norm_backward(m, P_Q_NORM, l, dqk, ld, m.chunk.qk_raw, QK, c.n_heads, n, s);
    head_norm_backward(m, P_K_NORM, l, dqk + c.q_dim(), ld, m.chunk.qk_raw + c.q_dim(), QK, c.n_kv_heads, n, s);
}

void head_norm_backward(Model& m, ParamKind which, int l, bf16* dx, int64_t ld, const bf16* raw, int64_t ld_raw,
                        int heads, int64_t n, cudaStream_t s) {
    head_rmsnorm_backward(dx, ld, raw, ld_raw, m.w(which, l), m.g(which, l), n, heads, m.cfg.head_dim, m.cfg.norm_eps,
                          m.work.norm_partial, s);
}

// The attention sub-layer's backward: d q|k|v from d att through the attention call, then token
// chunk by token chunk back through RoPE, the projection and the norm: dres += d loss / d x_in.
void attention_block_backward(Model& m, int l, cudaStream_t s) {
    if (m.untied) return untied_attention_backward(m, l, s);  // ulysses.cu, stage 6: head chunk by head chunk
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    const int64_t QKV = c.qkv_dim(), Q = c.q_dim(), K = c.kv_dim();
    bf16* dqkv = m.dqkv;
    if (m.ulysses) {
        ulysses_attention_backward(m, l, s);  // ulysses.cu, stage 2: d att to heads, d q|k|v back to tokens
        dqkv = ulysses_token_dqkv(m);
    } else {
        const AttentionBackwardArgs ba{.q = a.qkv, .k = a.qkv + Q, .v = a.qkv + Q + K, .out = a.att, .dout = m.datt,
                                       .ldq = QKV, .ldk = QKV, .ldv = QKV, .ldo = Q, .lddo = Q, .lse = a.lse,
                                       .dq = m.dqkv, .dk = m.dqkv + Q, .dv = m.dqkv + Q + K, .lddq = QKV,
                                       .lddk = QKV, .lddv = QKV, .delta = m.delta, .dq_accum = m.dq_accum,
                                       .docs = m.docs.attention};
        layer_attention_backward(m, l, ba, attention_call_shape(m), s);
    }
    for_each_token_chunk(m, [&](int64_t t0, int64_t t1) {
        const int64_t n = t1 - t0;
        bf16* dx = dqkv + t0 * QKV;
        rope_apply(dx, n, t0, m.shape.seq, m.shape.first_position(), c.n_heads + c.n_kv_heads, c.head_dim, QKV,
                   m.inv_freq, true, s, m.docs.positions);  // RoPE undone
        if (m.plan.norms_mlp == Hold::RECOMPUTED) attention_norm_forward(m, l, t0, t1, s);  // xn1 again
        qk_norm_backward(m, l, dx, QKV, a.xn1, n, s);
        linear_backward_input(m.chunk.dxn, dx, m.w(P_WQKV, l), n, c.dim, QKV, s);
        linear_backward_weight(m.g(P_WQKV, l), dx, a.xn1, n, c.dim, QKV, s);
        rmsnorm_backward(m.dres + t0 * c.dim, m.g(P_ATTN_NORM, l), m.chunk.dxn, a.x_in + t0 * c.dim, m.w(P_ATTN_NORM, l),
                         a.rstd1, n, c.dim, true, m.work.norm_partial, s);
    });
}

static void layer_backward(Model& m, int l, cudaStream_t s) {
    if (m.opt.ckpt) recompute_attention(m, l, s);  // offload.cu: the attention sub-layer again, where not kept
    {
        TimelineMark mark(m, s, "compute", "wo and mlp backward", l);  // dres: d x_out -> d x_mid; d att
        for_each_token_chunk(m, [&](int64_t t0, int64_t t1) { mlp_backward(m, l, t0, t1, s); });
    }
    attention_block_backward(m, l, s);  // dres += d loss / d x_in through attention
}

// =============================================================================================
// The head: final norm, LM head, cross-entropy, forward and backward together.
void final_norm_forward(Model& m, int64_t t0, int64_t n, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    rmsnorm_forward(m.head.xnf, m.head.rstdf, at(m.x_final, t0, c.dim), m.w(P_FINAL_NORM), n, c.dim, c.norm_eps, s);
}

void final_norm_backward(Model& m, int64_t t0, int64_t n, const bf16* dxnf, cudaStream_t s) {
    const int D = m.cfg.dim;
    rmsnorm_backward(at(m.dres, t0, D), m.g(P_FINAL_NORM), dxnf, at(m.x_final, t0, D), m.w(P_FINAL_NORM), m.head.rstdf,
                     n, D, false, m.work.norm_partial, s);
}

float loss_grad_scale(const Model& m) { return m.batch.n_valid_targets > 0 ? 1.0f / (float)m.batch.n_valid_targets : 0.0f; }
ParamKind lm_head_kind(const Model& m) { return m.cfg.tied_embeddings ? P_EMBED : P_LM_HEAD; }

// The LM head in one unit, one pass per loss chunk (chunked.cu): the logits of a chunk are
// computed, turned into their gradient in place by the loss kernel, and used at once, so [T, V]
// logits never exist beyond one chunk. Leaves d loss / d x_final in m.dres; without `backward`,
// the per-token losses alone.
static void lm_head_whole(Model& m, bool backward, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    const int64_t D = c.dim, V = c.vocab;
    const int u = m.layout.head_unit(0);
    const int use = backward ? WEIGHTS_AND_GRADIENTS : WEIGHTS;
    unit_begin(m, u, use, s);
    const bf16* W = m.w_piece(lm_head_kind(m), 0);
    float* dW = m.g_piece(lm_head_kind(m), 0);
    for_each_loss_chunk(m, [&](int64_t t0, int64_t n) {
        final_norm_forward(m, t0, n, s);
        linear_forward(m.head.logits, m.head.xnf, W, nullptr, n, D, V, s);
        cross_entropy_forward_backward(m.head.logits, m.head.losses + t0, m.batch.targets + t0, n, (int)V,
                                       backward ? loss_grad_scale(m) : 0.0f, s);
        if (!backward) return;  // the loss alone (model_forward_loss)
        linear_backward_input(m.chunk.dxn, m.head.logits, W, n, D, V, s);  // logits now hold dlogits
        linear_backward_weight(dW, m.head.logits, m.head.xnf, n, D, V, s);
        final_norm_backward(m, t0, n, m.chunk.dxn, s);
    });
    unit_end(m, u, use, s, !c.tied_embeddings);  // tied: the lookup adds the rest at the end
}

// Final RMSNorm, LM head, cross-entropy and (backward) their backward: dres = d loss / d x_final;
// the loss sum of this GPU's tokens in scalars[0].
static void head(Model& m, bool backward, cudaStream_t s) {
    const int u = m.layout.final_norm_unit();  // held through the head
    const int use = backward ? WEIGHTS_AND_GRADIENTS : WEIGHTS;
    unit_begin(m, u, use, s);
    if (m.layout.vocab_pieces() > 1) lm_head_in_pieces(m, backward, s);  // beyond/savings.cu, stage 7
    else lm_head_whole(m, backward, s);
    unit_end(m, u, use, s);
    if (backward) sum_floats(m.scalars + 0, m.head.losses, m.shape.tokens(), m.work.reduce, s);
}

// =============================================================================================
// One step: the forward through every layer, the head, the backward. Each layer's turn and the
// head are a phase of the step (infra/timeline.cu): a --timeline mark, and an event for the
// watchdog of model_sync, the times of --mem-trace and the run's progress line.
static void forward_turn(Model& m, int l, cudaStream_t s) {
    if (m.opt.offload) offload_save_block_input(m, l, s);  // offload.cu: x_in, complete now, to the host
    StepPhase phase(m, s, "forward", l);
    const int u = m.layout.layer_unit(l);
    unit_begin(m, u, WEIGHTS, s);
    if (attention_on_host(m)) selective_before_attention(m, l, s);  // beyond/selective.cu: att's slot is free
    layer_forward(m, l, s);
    unit_end(m, u, WEIGHTS, s);
}

static void backward_turn(Model& m, int l, cudaStream_t s) {
    StepPhase phase(m, s, "backward", l);
    const int u = m.layout.layer_unit(l);
    unit_begin(m, u, WEIGHTS_AND_GRADIENTS, s);
    if (attention_on_host(m)) selective_before_layer_backward(m, l, s);  // beyond/selective.cu: att back; x_in rebuilt
    if (m.opt.offload) offload_before_layer_backward(m, l, s);          // offload.cu: x_in back; l-1's on its way
    layer_backward(m, l, s);
    unit_end(m, u, WEIGHTS_AND_GRADIENTS, s);
}

// What each step starts from: the gradients zeroed, the units' order, and the techniques' own.
static void step_begin(Model& m, cudaStream_t s) {
    CUDA_CHECK(cudaMemsetAsync(m.states.grad, 0, m.states.count * sizeof(float), s));
    units_step_begin(m, s);
    if (m.opt.offload) offload_step_begin(m, s);  // offload.cu: the last step's copies are done
}

// The embedding, every layer's forward, the head (with its backward unless m.forward_only).
static void forward(Model& m, cudaStream_t s) {
    step_begin(m, s);
    embedding_lookup(m, s);
    for (int l = 0; l < m.cfg.n_layers; l++) forward_turn(m, l, s);
    StepPhase phase(m, s, "head", -1);
    head(m, !m.forward_only, s);  // dres = d loss / d x_final
}

void model_forward_backward(Model& m, cudaStream_t s, ProgressFn progress, void* ctx) {
    watch_step_begin(m, s, progress, ctx);  // infra/timeline.cu: the phases are timed from here
    forward(m, s);
    for (int l = m.cfg.n_layers - 1; l >= 0; l--) backward_turn(m, l, s);
    embedding_lookup_backward(m, s);  // the lookup needs no weights
    units_step_end(m, s);
    watch_step_end(m);
    // scalars[0] holds this GPU's sum of raw per-token losses (only their gradient was scaled by
    // 1 / the step's count of valid targets). Summed over the GPUs it is the step's total loss,
    // which the caller divides by that count.
    if (m.world > 1) m.comm->all_reduce(m.scalars + 0, 1, DType::F32, s);
}

// The forward alone, for evaluation: the step's forward (every technique's forward calls, the
// same kernels on the same inputs, so the same per-token losses in m.head.losses as a step's), then
// the head's loss without its backward. Gradients are zeroed, not computed: call it between
// steps, never between a step's backward and its optimizer step. Its progress events (the
// watchdog's, as a step's) are its own: the last step's stay as they are, for --mem-trace.
void model_forward_loss(Model& m, cudaStream_t s) {
    m.forward_only = true;  // the order of units: the forward's (model_unit_order)
    watch_step_begin(m, s, nullptr, nullptr);
    forward(m, s);
    units_step_end(m, s);
    watch_step_end(m);
    m.forward_only = false;
}

// The units in the order the step uses their weights (each is made ahead of its turn); a forward
// alone (model_forward_loss) stops after the head's loss.
std::vector<int> model_unit_order(const Model& m) {
    const ParamLayout& lay = m.layout;
    const int L = m.cfg.n_layers;
    std::vector<int> order;
    for (int p = 0; p < lay.vocab_pieces(); p++) order.push_back(lay.embed_unit(p));  // the lookup
    for (int l = 0; l < L; l++) order.push_back(lay.layer_unit(l));
    order.push_back(lay.final_norm_unit());  // held through the head
    if (lay.vocab_pieces() > 1) lm_head_pieces_order(m, order);  // beyond/savings.cu: every piece, twice
    else order.push_back(lay.head_unit(0));
    if (m.forward_only) return order;
    for (int l = L - 1; l >= 0; l--) order.push_back(lay.layer_unit(l));  // the backward's layers
    return order;
}

void model_optimizer_step(Model& m, const AdamW& opt, float max_grad_norm, cudaStream_t s) {
    // Global gradient norm: each GPU's sum of squares; summed over the shards under --fsdp
    // (replicated gradients are already the same everywhere).
    sum_squares(m.scalars + 1, m.states.grad, m.states.count, m.work.reduce, s);
    if (m.opt.fsdp && m.world > 1) m.comm->all_reduce(m.scalars + 1, 1, DType::F32, s);
    clip_scale(m.scalars + 2, m.scalars + 1, max_grad_norm, s);
    for (const ParamSegment& seg : m.states.segments)
        adamw_update(m.states.master + seg.local, m.states.grad + seg.local, m.states.adam_m + seg.local,
                     m.states.adam_v + seg.local, seg.count, opt, seg.tensor->decay, m.scalars + 2, s);
}

// =============================================================================================
// The weights in use. The model is its fp32 master weights (and their gradients and AdamW
// moments, 16 bytes per parameter); the GEMMs read bf16. A unit's bf16 weights are made just
// before the unit is used, into one of two slots (the unit in use and the next), on the
// communication stream while compute runs, in the order model_unit_order lists: this GPU's master
// of the unit converted, then under --fsdp, where it holds one shard of each unit, the slot
// all-gathered (fsdp.cu). A slot is refilled only after the compute stream has released it.
// Gradients accumulate in fp32 straight into the gradient array (--fsdp: into a unit buffer,
// reduce-scattered at the unit's end). Where several GPUs each train on their own sequences (data
// parallel), a unit's gradient is summed over them (all-reduce) once it is final, while the
// backward goes on.
struct UnitSlots {
    bf16* weights[2] = {};  // the bf16 weights of the unit in use and of the next
    struct Slot {
        int unit = -1;
        bool free = true, used = false;
        cudaEvent_t filled = nullptr, released = nullptr;
    } slot[2];
    std::vector<int> order;  // the step's units in the order it uses their weights
    size_t next_fill = 0;
    cudaEvent_t mark = nullptr;
};

// The communication stream continues once the compute stream has reached this point.
static void comm_after_compute(Model& m, cudaStream_t s) {
    CUDA_CHECK(cudaEventRecord(m.slots->mark, s));
    CUDA_CHECK(cudaStreamWaitEvent(m.comm_stream, m.slots->mark, 0));
}

void units_step_begin(Model& m, cudaStream_t s) {
    UnitSlots& w = *m.slots;
    w.order = model_unit_order(m);
    w.next_fill = 0;
    for (auto& k : w.slot) k.free = true, k.unit = -1;
    comm_after_compute(m, s);  // the optimizer has written the master weights about to be converted
}

// Fill slot k with unit u's bf16 weights, on the communication stream: this GPU's fp32 master of
// the unit (under --fsdp its shard, in the shard's place of the slot) converted, then gathered.
static void fill_slot(Model& m, int k, int u) {
    const UnitShard& sh = m.states.shards[u];
    bf16* slot = m.slots->weights[k];
    convert_f32_to_bf16(slot + sh.first, m.states.master + sh.local, sh.count, m.comm_stream);
    if (m.opt.fsdp) fsdp_gather(m, slot, u);  // fsdp.cu: every GPU's shard into its place of the slot
}

// Start filling the next units of the order into free slots.
static void fill_ahead(Model& m) {
    UnitSlots& w = *m.slots;
    for (int k = 0; k < 2 && w.next_fill < w.order.size(); k++) {
        UnitSlots::Slot& slot = w.slot[k];
        if (!slot.free) continue;
        const int u = w.order[w.next_fill++];
        if (slot.used) CUDA_CHECK(cudaStreamWaitEvent(m.comm_stream, slot.released, 0));
        slot.unit = u, slot.free = false, slot.used = true;
        fill_slot(m, k, u);
        CUDA_CHECK(cudaEventRecord(slot.filled, m.comm_stream));
    }
}

static int slot_holding(const UnitSlots& w, int u) {
    for (int k = 0; k < 2; k++)
        if (!w.slot[k].free && w.slot[k].unit == u) return k;
    throw std::logic_error("unit " + std::to_string(u) + " used out of the planned order");
}

// Unit u's gradient summed over the GPUs that each hold all of it, once final (`last`); under
// --fsdp reduce-scattered, each GPU keeping the sum of its shard.
static void reduce_gradient(Model& m, int u, bool last, cudaStream_t s) {
    if (m.opt.fsdp) return fsdp_reduce_scatter(m, u, s);  // fsdp.cu
    if (m.world == 1 || !last) return;
    comm_after_compute(m, s);
    // A ring all-reduce sends 2 (N - 1) / N of the buffer from each GPU.
    TimelineMark mark(m, m.comm_stream, "fsdp", "all-reduce", u, 2 * (m.world - 1) * m.layout.unit_size(u) * 4 / m.world);
    m.comm_params->all_reduce(m.states.grad + m.layout.unit_begin[u], m.layout.unit_size(u), DType::F32, m.comm_stream);
}

void unit_begin(Model& m, int u, int use, cudaStream_t s) {
    if (use & WEIGHTS) {  // wait for its slot; start filling the next units into free ones
        fill_ahead(m);
        const int k = slot_holding(*m.slots, u);
        CUDA_CHECK(cudaStreamWaitEvent(s, m.slots->slot[k].filled, 0));
        m.unit_w[u] = m.slots->weights[k];
    }
    if ((use & GRADIENTS) && m.opt.fsdp) fsdp_grad_begin(m, u, s);  // fsdp.cu: the unit's gradient buffer
}

void unit_end(Model& m, int u, int use, cudaStream_t s, bool last) {
    if (use & GRADIENTS) reduce_gradient(m, u, last, s);
    if (use & WEIGHTS) {
        UnitSlots& w = *m.slots;
        const int k = slot_holding(w, u);
        CUDA_CHECK(cudaEventRecord(w.slot[k].released, s));
        w.slot[k].free = true;
        m.unit_w[u] = nullptr;
        fill_ahead(m);
    }
}

// Every unit of the order used and released; the gradients' traffic done before the optimizer
// writes what the slots were made from.
void units_step_end(Model& m, cudaStream_t s) {
    UnitSlots& w = *m.slots;
    if (w.next_fill != w.order.size() || !w.slot[0].free || !w.slot[1].free)
        throw std::logic_error("the step did not use and release every unit of units_step_begin's order");
    CUDA_CHECK(cudaEventRecord(w.mark, m.comm_stream));
    CUDA_CHECK(cudaStreamWaitEvent(s, w.mark, 0));
}

int unit_in_weight_slot(const Model& m, const void* slot) {
    for (int k = 0; k < 2; k++)
        if (m.slots->weights[k] == slot && !m.slots->slot[k].free) return m.slots->slot[k].unit;
    return -1;
}

double model_step_flops(const LlamaConfig& c, const RunShape& shape, double attention_share) {  // per GPU
    double matmul = 6.0 * (double)count_matmul_params(c) * (double)shape.tokens();
    AttentionShape sh{shape.batch, shape.seq, c.n_heads / shape.sp, c.n_kv_heads, c.head_dim};
    double attn = 3.5 * attention_forward_flops(sh) * c.n_layers * attention_share;
    return matmul + attn;
}

double document_attention_share(const StepDocuments& docs, int64_t seq, int batch) {
    const int64_t n = (int64_t)docs.start.size(), end = (int64_t)batch * seq;
    double pairs = 0;
    for (int64_t i = 0; i < n; i++) {
        const double len = (double)((i + 1 < n ? docs.start[i + 1] : end) - docs.start[i]);
        pairs += len * len / 2;
    }
    return n ? pairs / (batch * (double)seq * seq / 2) : 1.0;
}

int64_t model_host_bytes(const Model& m) { return offload_host_bytes(m) + selective_host_bytes(m); }

// =============================================================================================
// The step's buffers.
//
// model_declare_buffers first decides how the step holds each activation (the ActivationPlan
// of llama.h): the plain model keeps all of them, a slot per layer, and each memory technique
// changes that in its *_plan function. Then every buffer is declared from the plan. The plain
// step (ladder stage 0) keeps, per token and layer, in bytes:
//   other:     2 (4 D + 3 F) + 8          (x_in, xn1, x_mid, xn2, h13, act; two rstd)
//   attention: 2 (qkv_dim + Hq d) + 4 Hq  (qkv, att, lse)
// plus logits 2 V per token, and 16 bytes per parameter for model states (fp32 master, grad,
// two AdamW moments; the bf16 weights exist only for the two units in use: UnitSlots, above).
static ActivationPlan plain_plan(const Model& m) {
    ActivationPlan p;  // every activation kept per layer
    p.chunk_rows = p.loss_rows = m.shape.tokens();  // every layer and the head take all tokens at once
    return p;
}

// Slots of a per-layer activation held as `h`, for `layers` layers; an activation kept on the
// host goes through `staging` device slots.
static int64_t slot_count(Hold h, int64_t layers, int staging) {
    switch (h) {
        case Hold::PER_LAYER: return layers;
        case Hold::ON_HOST: return staging;
        case Hold::RECOMPUTED: return 1;
        case Hold::ELSEWHERE: return 0;
    }
    return 0;
}
// Layer l's slot of an activation held as `h`, `size` elements a slot (the dry run has no base).
template <class T>
static T* slot(T* base, Hold h, int64_t l, int64_t size, int staging = 1) {
    if (!base || h == Hold::ELSEWHERE) return nullptr;
    const int64_t index = h == Hold::PER_LAYER ? l : h == Hold::ON_HOST ? l % staging : 0;
    return base + index * size;
}

// An activation of every layer: its slots, and its bytes in the per-layer count of --mem-trace
// when each layer keeps its own on the device.
template <class T>
static T* take_activation(Model& m, Arena& A, const char* name, MemCategory cat, Hold h, int64_t layers,
                          int64_t per_slot, int staging = 1) {
    if (h == Hold::PER_LAYER) m.saved_per_layer[cat] += per_slot * (int64_t)sizeof(T);
    return A.take<T>(name, cat, slot_count(h, layers, staging) * per_slot);
}

// Model states, 16 bytes per parameter: every unit whole, or (--fsdp) this GPU's shard of each
// (fsdp.cu); and what each of their pieces holds of each tensor (init, AdamW, the files).
static void declare_model_states(Model& m, Arena& A) {
    const ParamLayout& lay = m.layout;
    if (m.opt.fsdp) {
        m.states.shards = fsdp_shards(lay, m.world, m.comm ? m.comm->rank : 0);  // fsdp.cu
    } else {
        m.states.shards.clear();
        for (int u = 0; u < lay.num_units(); u++)
            m.states.shards.push_back({.local = lay.unit_begin[u], .count = lay.unit_size(u), .first = 0,
                                .padded = lay.unit_size(u)});
    }
    int64_t P = 0;
    for (const UnitShard& sh : m.states.shards) P = std::max(P, sh.local + sh.count);
    m.states.count = P;
    m.states.master = A.take<float>("master weights (fp32)", MEM_MODEL, P);
    m.states.grad = A.take<float>("gradients (fp32)", MEM_MODEL, P);
    m.states.adam_m = A.take<float>("AdamW first moment", MEM_MODEL, P);
    m.states.adam_v = A.take<float>("AdamW second moment", MEM_MODEL, P);
    m.states.segments = param_segments(m);
}

int64_t largest_unit_slot(const Model& m) {
    int64_t largest = 0;
    for (const UnitShard& sh : m.states.shards) largest = std::max(largest, sh.padded);
    return largest;
}

// The bf16 weights of two units (gathered under --fsdp: category comm) and the gradients' views.
static void declare_weight_slots(Model& m, Arena& A) {
    if (!m.slots) m.slots = std::make_shared<UnitSlots>();
    const int64_t largest = largest_unit_slot(m);
    const MemCategory category = m.opt.fsdp ? MEM_COMM : MEM_MODEL;
    for (int k = 0; k < 2; k++)
        m.slots->weights[k] = A.take<bf16>((m.opt.fsdp ? "FSDP gathered unit " : "bf16 weights, unit slot ") +
                                               std::to_string(k), category, largest);
    const int U = m.layout.num_units();
    m.unit_w.assign(U, nullptr);
    m.unit_g.assign(U, nullptr);
    if (!m.opt.fsdp && m.states.grad)  // gradients accumulate in this GPU's whole array (--fsdp: unit buffers)
        for (int u = 0; u < U; u++) m.unit_g[u] = m.states.grad + m.layout.unit_begin[u];
}

static void create_weight_slots(Model& m) {
    UnitSlots& w = *m.slots;
    auto event = [](cudaEvent_t* e) { CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming)); };
    event(&w.mark);  // orders the communication stream after compute
    const int64_t largest = largest_unit_slot(m);
    for (int k = 0; k < 2; k++) {
        event(&w.slot[k].filled), event(&w.slot[k].released);
        // Zero once: the gaps between tensors are never read, but no byte of a slot is left
        // uninitialized, whichever elements a gather writes.
        CUDA_CHECK(cudaMemset(w.weights[k], 0, largest * sizeof(bf16)));
    }
}

static void destroy_weight_slots(Model& m) {
    if (!m.slots) return;
    UnitSlots& w = *m.slots;
    for (auto& k : w.slot)
        if (k.filled) cudaEventDestroy(k.filled), cudaEventDestroy(k.released);
    if (w.mark) cudaEventDestroy(w.mark);
    m.slots.reset();
}

// This GPU's parameters as pieces of tensors: for each tensor, the part of it that each unit's
// shard holds (every unit whole: the tensor in one piece), in local coordinates.
std::vector<ParamSegment> param_segments(const Model& m) {
    std::vector<ParamSegment> out;
    const ParamLayout& lay = m.layout;
    for (const ParamTensor& t : lay.tensors) {
        if (!m.opt.fsdp) {
            out.push_back({t.offset, t.numel(), &t, 0});
            continue;
        }
        // The embedding and LM head span several units.
        for (int u = t.unit; u < lay.num_units() && lay.unit_begin[u] < t.offset + t.numel(); u++) {
            const UnitShard& sh = m.states.shards[u];
            const int64_t lo = lay.unit_begin[u] + sh.first;
            const int64_t hi = std::min(lo + sh.count, lay.unit_begin[u + 1]);  // the shard's padding is no tensor's
            const int64_t a = std::max(lo, t.offset), b = std::min(hi, t.offset + t.numel());
            if (a < b) out.push_back({sh.local + (a - lo), b - a, &t, a - t.offset});
        }
    }
    return out;
}

int64_t layer_lse_floats(const Model& m) {
    return (int64_t)m.shape.batch * attention_heads(m.cfg, m.shape.sp).q * m.shape.seq;
}

// Every layer's activations, as the plan holds them.
static void declare_activations(Model& m, Arena& A) {
    const LlamaConfig& c = m.cfg;
    const ActivationPlan& p = m.plan;
    const int64_t T = m.shape.tokens(), D = c.dim, F = c.ffn_dim, QD = c.q_dim(), L = c.n_layers;
    const int64_t C = p.chunk_rows, mid_rows = p.x_mid == Hold::PER_LAYER ? T : C;
    // Attention's view: the whole sequence, this GPU's heads (all of them without Ulysses).
    const AttentionHeads heads = attention_heads(c, m.shape.sp);
    const int64_t S_rows = T * m.shape.sp, WH = heads.width(c.head_dim);
    const int64_t lse_n = layer_lse_floats(m);
    for (int64_t& b : m.saved_per_layer) b = 0;

    // The residual stream: every layer's input and the last layer's output (L + 1 slots, or the
    // staging slots of offload.cu).
    bf16* x = take_activation<bf16>(m, A, "block inputs (residual stream)", MEM_OTHER, p.x_in, L + 1, T * D, p.x_slots);
    bf16* att = take_activation<bf16>(m, A, "attention output", MEM_ATTENTION, p.att, L, T * QD);
    float* lse = take_activation<float>(m, A, "attention lse", MEM_ATTENTION, p.att, L, lse_n);
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
        a.x_in = slot(x, p.x_in, l, T * D, p.x_slots);
        a.x_out = slot(x, p.x_in, l + 1, T * D, p.x_slots);
        a.att = slot(att, p.att, l, T * QD);
        a.lse = slot(lse, p.att, l, lse_n);
        a.qkv = slot(qkv, p.qkv, l, S_rows * WH);
        a.x_mid = slot(x_mid, p.x_mid, l, mid_rows * D);
        a.x_mid_row_step = mid_rows == T ? D : 0;  // one chunk's buffer: every chunk's rows from its start
        a.xn1 = slot(xn1, h, l, C * D), a.rstd1 = slot(rstd1, h, l, C);
        a.xn2 = slot(xn2, h, l, C * D), a.rstd2 = slot(rstd2, h, l, C);
        a.h13 = slot(h13, h, l, C * 2 * F), a.act = slot(act, h, l, C * F);
    }
    m.x_final = slot(x, p.x_in, L, T * D, p.x_slots);
}

static void declare_head_and_gradients(Model& m, Arena& A) {
    const LlamaConfig& c = m.cfg;
    const int64_t T = m.shape.tokens(), D = c.dim;
    // LM head and loss, m.plan.loss_rows tokens at a time.
    m.head.xnf = A.take<bf16>("final norm output", MEM_OTHER, m.plan.loss_rows * D);
    m.head.rstdf = A.take<float>("final rstd", MEM_OTHER, m.plan.loss_rows);
    // Logits of one vocabulary piece (the widest: the whole vocabulary in one piece), and the
    // running statistics of the head's loss when it comes in several pieces (beyond/savings.cu).
    const ParamLayout& lay = m.layout;
    int64_t piece_width = 0;
    for (int p = 0; p < lay.vocab_pieces(); p++) piece_width = std::max(piece_width, lay.piece_rows(p));
    m.head.logits = A.take<bf16>("logits", MEM_OTHER, m.plan.loss_rows * piece_width);
    m.head.losses = A.take<float>("per-token losses", MEM_OTHER, T);
    if (lay.vocab_pieces() > 1) {
        m.head.pieces.token_lse = A.take<float>("per-token max, then log-sum-exp, of the logits", MEM_OTHER, T);
        m.head.pieces.token_sumexp = A.take<float>("per-token sum of exp(logits)", MEM_OTHER, T);
        m.head.pieces.target_logit = A.take<float>("per-token target logit", MEM_OTHER, T);
    }
    // The residual gradient and attention's gradients span the sequence.
    m.dres = A.take<bf16>("d residual", MEM_OTHER, T * D);
    if (m.plan.dqkv_buffer) m.dqkv = A.take<bf16>("d qkv", MEM_ATTENTION, T * c.qkv_dim());
    if (m.plan.datt_buffer) {
        m.datt = A.take<bf16>("d attention output", MEM_ATTENTION, T * c.q_dim());
        m.delta = A.take<float>("attention delta", MEM_ATTENTION, layer_lse_floats(m));
    }
    m.dq_accum = nullptr;
    if (m.opt.fused_attention && m.plan.dq_sums_buffer)  // 4 bytes per dQ element of one call
        m.dq_accum = A.take<float>("attention dQ sums, fp32 (fused backward)", MEM_ATTENTION,
                                   attention_dq_accum_floats(m.untied ? untied_attention_shape(m) : attention_call_shape(m)));
}

// One chunk's work buffers of the backward, reductions, and the step's inputs.
static void declare_chunk_work_and_inputs(Model& m, Arena& A) {
    const LlamaConfig& c = m.cfg;
    const int64_t T = m.shape.tokens(), C = m.plan.chunk_rows, F = c.ffn_dim;
    m.chunk.dxn = A.take<bf16>("d norm output", MEM_OTHER, std::max(C, m.plan.loss_rows) * c.dim);
    m.chunk.dh13 = A.take<bf16>("d h13", MEM_OTHER, C * 2 * F);
    m.chunk.dact = A.take<bf16>("d act", MEM_OTHER, C * F);
    m.work.norm_partial =  // the model's norms (D values) and Qwen3's per-head ones (d values) share them
        A.take<float>("rmsnorm dw partials", MEM_WORKSPACE, rmsnorm_partial_floats(std::max(c.dim, c.head_dim)));
    if (c.qk_norm())  // Qwen3: q|k before their norms, projected again for the norms' backward
        m.chunk.qk_raw = A.take<bf16>("q|k before their norms (Qwen3)", MEM_OTHER, C * (c.q_dim() + c.kv_dim()));
    m.work.reduce = A.take<float>("reduction scratch", MEM_WORKSPACE, sum_scratch_floats());
    m.scalars = A.take<float>("step scalars", MEM_WORKSPACE, 4);

    m.batch.tokens = A.take<int32_t>("tokens", MEM_OTHER, T);
    m.batch.targets = A.take<int32_t>("targets", MEM_OTHER, T);
    const int64_t max_groups = std::min<int64_t>(T, c.vocab);
    m.batch.group_token = A.take<int32_t>("embedding groups", MEM_OTHER, max_groups);
    m.batch.group_begin = A.take<int64_t>("embedding group starts", MEM_OTHER, max_groups + 1);
    m.batch.positions = A.take<int64_t>("embedding positions", MEM_OTHER, T);
    m.inv_freq = A.take<double>("rope frequencies", MEM_OTHER, c.head_dim / 2);
    if (m.opt.doc_mask) {  // the step's documents: their starts and first positions
        m.docs.start = A.take<int64_t>("document starts", MEM_OTHER, m.opt.max_docs);
        m.docs.first_position = A.take<int64_t>("document first positions", MEM_OTHER, m.opt.max_docs);
    }
    m.work.gemm = A.take_bytes("cuBLASLt workspace", MEM_WORKSPACE, m.work.gemm_bytes);
}

void model_declare_buffers(Model& m, Arena& A) {
    m.layout = param_layout(m.cfg, m.opt.vocab_pieces);  // --vocab-pieces: units of vocabulary rows (beyond/savings.cu)
    m.ulysses.reset(), m.untied.reset();  // their *_plan make them again when they are on
    // How the step holds its activations: the plain model's plan, then each technique's changes.
    m.plan = plain_plan(m);
    if (m.opt.ulysses) ulysses_plan(m);                    // ulysses.cu: d q|k|v arrives in its staging
    if (m.opt.ckpt) checkpointing_plan(m);                 // offload.cu: keep block inputs only
    if (m.opt.offload) offload_plan(m);                    // offload.cu: block inputs on the host, two device slots
    if (m.opt.chunked) chunked_plan(m);                    // chunked.cu: layers and the head walk token chunks
    if (m.opt.untied > 0) untied_plan(m);                  // ulysses.cu: attention's inputs and gradients per head chunk
    savings_plan(m);                                       // beyond/savings.cu, stage 7: its flags' buffers elsewhere
    if (m.opt.selective) selective_plan(m);                // beyond/selective.cu: attention outputs kept too

    declare_model_states(m, A);                   // every unit whole, or (--fsdp) this GPU's shards
    declare_weight_slots(m, A);                   // the two units' bf16 weights
    if (m.opt.fsdp) fsdp_declare_buffers(m, A);   // fsdp.cu: the two unit gradient buffers
    declare_activations(m, A);
    if (attention_on_host(m)) selective_declare_buffers(m, A);  // beyond/selective.cu: attention outputs' device slots
    declare_head_and_gradients(m, A);
    if (m.untied) untied_declare_buffers(m, A);   // ulysses.cu: one head chunk's buffers
    savings_declare_buffers(m, A);                // beyond/savings.cu: Untied's staging holds the fused dQ sums
    if (m.ulysses) ulysses_declare_buffers(m, A); // ulysses.cu: all-to-all staging and head-sharded buffers
    declare_chunk_work_and_inputs(m, A);
}

// The techniques' streams, events and pinned host memory, made once for the run after its
// buffers; freed in the reverse order.
static void create_techniques(Model& m) {
    create_weight_slots(m);
    if (m.opt.fsdp) fsdp_create(m);
    if (m.opt.offload) offload_create(m);
    if (attention_on_host(m)) selective_create(m);
}

static void destroy_techniques(Model& m) {
    selective_destroy(m);
    offload_destroy(m);
    fsdp_destroy(m);
    destroy_weight_slots(m);
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
    gemm_init(m.work.gemm_bytes, m.work.gemm);
    // Constant tables belong to the model's setup, not to its weights.
    std::vector<double> inv = rope_inv_freq(m.cfg);
    CUDA_CHECK(cudaMemcpy(m.inv_freq, inv.data(), inv.size() * sizeof(double), cudaMemcpyHostToDevice));
    if (!m.comm) m.comm = comm_single(), m.owns_comm = true;
    if (!m.comm_params) m.comm_params = m.comm->split();
    if (!m.comm_stream) CUDA_CHECK(cudaStreamCreateWithFlags(&m.comm_stream, cudaStreamNonBlocking));
    watch_create(m);
    create_techniques(m);
}

void model_free(Model& m, DeviceMemory& dm) {
    timeline_destroy(m);
    destroy_techniques(m);
    if (m.comm_stream) cudaStreamDestroy(m.comm_stream);
    m.comm_stream = nullptr;
    watch_destroy(m);
    delete m.comm_params;
    m.comm_params = nullptr;
    if (m.owns_comm) delete m.comm, m.comm = nullptr;
    if (dm.slab) CUDA_CHECK(cudaFree(dm.slab));
    dm.slab = nullptr;
    dm.slab_bytes = 0;
}

void model_init_weights(Model& m, uint64_t seed, cudaStream_t s) {
    // A shard holds exactly its part of the single-GPU model's weights (init_param_values).
    m.init_seed = seed;
    CUDA_CHECK(cudaMemsetAsync(m.states.master, 0, m.states.count * sizeof(float), s));  // padding
    for (const ParamSegment& seg : m.states.segments)
        init_param_values(m, *seg.tensor, seg.tensor_offset, seg.count, seed, m.states.master + seg.local, nullptr, s);
    CUDA_CHECK(cudaMemsetAsync(m.states.adam_m, 0, m.states.count * sizeof(float), s));
    CUDA_CHECK(cudaMemsetAsync(m.states.adam_v, 0, m.states.count * sizeof(float), s));
    CUDA_CHECK(cudaStreamSynchronize(s));
}

// The step's documents to the device, checked: ascending starts within the sequences this GPU's
// attention sees, every sequence's first token one of them, no more than the plan has room for.
static void set_documents(Model& m, const StepDocuments* docs, cudaStream_t s) {
    const int64_t end = (int64_t)m.shape.batch * m.shape.seq;
    if (!docs || docs->start.empty() || docs->start.size() != docs->first_position.size())
        runtime_error("--doc-mask: a step without its documents");
    const int64_t n = (int64_t)docs->start.size();
    if (n > m.opt.max_docs)
        runtime_error("--doc-mask: " + std::to_string(n) + " documents in a step planned for " +
                      std::to_string(m.opt.max_docs));
    for (int64_t i = 0, b = 0; i < n; i++) {
        const int64_t x = docs->start[i];
        if (x < 0 || x >= end || (i > 0 && x <= docs->start[i - 1]) || docs->first_position[i] < 0)
            runtime_error("--doc-mask: document starts must ascend within the step's sequences");
        if (x > b * m.shape.seq) runtime_error("--doc-mask: every sequence's first token starts a document");
        if (x == b * m.shape.seq) b++;
    }
    m.docs.attention = {m.docs.start, n}, m.docs.positions = {m.docs.start, m.docs.first_position, n};
    CUDA_CHECK(cudaMemcpyAsync(m.docs.start, docs->start.data(), n * 8, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(m.docs.first_position, docs->first_position.data(), n * 8, cudaMemcpyHostToDevice, s));
}

void model_set_batch(Model& m, const int32_t* tokens, const int32_t* targets, cudaStream_t s, int64_t n_valid,
                     const StepDocuments* docs) {
    const int64_t T = m.shape.tokens();
    if (m.opt.doc_mask) set_documents(m, docs, s);
    CUDA_CHECK(cudaMemcpyAsync(m.batch.tokens, tokens, T * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(m.batch.targets, targets, T * sizeof(int32_t), cudaMemcpyHostToDevice, s));
    EmbeddingGroups& g = m.batch.groups;
    g.build(tokens, T);
    CUDA_CHECK(cudaMemcpyAsync(m.batch.group_token, g.token.data(), g.token.size() * sizeof(int32_t),
                               cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(m.batch.group_begin, g.begin.data(), g.begin.size() * sizeof(int64_t),
                               cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(m.batch.positions, g.position.data(), T * sizeof(int64_t),
                               cudaMemcpyHostToDevice, s));
    m.batch.n_valid_targets = n_valid;
    if (n_valid < 0) {
        m.batch.n_valid_targets = 0;
        for (int64_t t = 0; t < T; t++) m.batch.n_valid_targets += targets[t] >= 0;
    }
    // The copies above read host memory that the caller may reuse: finish them now.
    CUDA_CHECK(cudaStreamSynchronize(s));
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
    else init_normal_bf16(b16, count, 0.02f, tensor_seed, s, offset);
}
