// llama.cu - Llama 3 on one GPU (ladder stage 0) and the training step that every technique of the
// talk plugs into. The kernels it calls are kernels/ (kernels.h, attention.h); the techniques are
// one file each, fsdp.cu to chunked.cu, and stage 7 beyond/.
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
// plain step keeps every activation for the backward. Each technique enters through its *_plan:
// where activations live (the ActivationPlan), and hooks at fixed places of the step (StepPlace,
// llama.h); attention is one sub-layer (ulysses.cu). docs/design.md lists where each flag changes
// the step, and a test keeps that list true.
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
// Where the techniques enter the step. Each technique's *_plan adds its hooks at the places of
// StepPlace (llama.h); a place runs its hooks in the ladder's order, the backward's in reverse.
void step_hook(Model& m, StepPlace place, StepHook hook) { m.hooks.at[place].push_back(hook); }

void setup_hook(Model& m, void (*create)(Model&), void (*destroy)(Model&)) {
    m.hooks.create.push_back(create);
    m.hooks.destroy.insert(m.hooks.destroy.begin(), destroy);  // the last made is the first freed
}

static void run_hooks(Model& m, StepPlace place, int l, cudaStream_t s) {
    const std::vector<StepHook>& hooks = m.hooks.at[place];
    if (place == LAYER_BACKWARD_BEGIN)
        for (auto h = hooks.rbegin(); h != hooks.rend(); ++h) (*h)(m, l, s);
    else
        for (StepHook h : hooks) h(m, l, s);
}

// A unit's weights (WEIGHTS) and its gradient (GRADIENTS) in use from unit_begin to unit_end:
// fsdp.cu gathers the weights and reduce-scatters the gradient (all-reduces it when replicated).
// `last`: the unit's last contribution to its gradient in the step.
enum UnitUse { WEIGHTS = 1, GRADIENTS = 2, WEIGHTS_AND_GRADIENTS = 3 };
static void unit_begin(Model& m, int u, int use, cudaStream_t s) {
    if (use & WEIGHTS) fsdp_acquire(m, u, s);
    if (use & GRADIENTS) fsdp_grad_begin(m, u, s);
}
static void unit_end(Model& m, int u, int use, cudaStream_t s, bool last = true) {
    if (use & GRADIENTS) fsdp_grad_end(m, u, last, s);
    if (use & WEIGHTS) fsdp_release(m, u, s);
}

// =============================================================================================
// Attention, one sub-layer of the layer (llama.cu calls it, checkpointing reruns it): plain
// attention over each sequence on one GPU, or Ulysses's, or Untied's, whichever the plan made.
// The token-wise pieces around the kernel, norm, projection, (Qwen3) per-head norms and RoPE,
// walk the token chunks (chunked.cu).

// The shape of one attention call: every head of each sequence, or this GPU's share of the
// heads over the whole sequence (Ulysses), or one head chunk (Untied Ulysses).
AttentionShape attention_call_shape(const Model& m) {
    if (m.untied) return untied_attention_shape(m);
    if (m.ulysses) return ulysses_attention_shape(m);
    return {m.shape.batch, m.shape.seq, m.cfg.n_heads, m.cfg.n_kv_heads, m.cfg.head_dim};
}

// Where layer l's projection writes q|k|v of this GPU's tokens, and where the backward finds
// their gradient: the layer's qkv and the step's dqkv, or under Ulysses its staging, from where
// the all-to-all sends them and where it brings them back.
static bf16* qkv_of_tokens(Model& m, int l) { return m.ulysses ? ulysses_token_qkv(m) : m.layers[l].qkv; }
static bf16* dqkv_of_tokens(Model& m) { return m.ulysses ? ulysses_token_dqkv(m) : m.dqkv; }

// xn1 = rmsnorm(x_in); qkv = xn1 Wqkv^T; (Qwen3: q and k normalized per head); RoPE on q and k
// (positions of this GPU's tokens).
static void qkv_forward(Model& m, int l, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    const int64_t QKV = c.qkv_dim();
    for_each_token_chunk(m, [&](int64_t t0, int64_t t1) {
        bf16* qkv = qkv_of_tokens(m, l) + t0 * QKV;
        attention_norm_forward(m, l, t0, t1, s);
        linear_forward(qkv, m.layers[l].xn1, m.w(P_WQKV, l), nullptr, t1 - t0, c.dim, QKV, s);
        qk_norm_forward(m, l, qkv, QKV, c.n_heads, qkv + c.q_dim(), QKV, c.n_kv_heads, t1 - t0, s);
        rope_apply(qkv, t1 - t0, t0, m.shape.seq, m.shape.first_position(), c.n_heads + c.n_kv_heads, c.head_dim,
                   QKV, m.inv_freq, false, s, m.doc_positions);
    });
}

// Qwen3: d q|k of n tokens (rows ld apart) back through the per-head norms, in place; nothing for
// Llama. The values before the norms are not kept: they are projected again from the normalized input xn.
static void qk_norm_backward(Model& m, int l, bf16* dqk, int64_t ld, const bf16* xn, int64_t n, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    if (!c.qk_norm()) return;
    const int64_t QK = c.q_dim() + c.kv_dim();  // Wqkv's first rows: q, then k
    linear_forward(m.qk_raw, xn, m.w(P_WQKV, l), nullptr, n, c.dim, QK, s);
    head_norm_backward(m, P_Q_NORM, l, dqk, ld, m.qk_raw, QK, c.n_heads, n, s);
    head_norm_backward(m, P_K_NORM, l, dqk + c.q_dim(), ld, m.qk_raw + c.q_dim(), QK, c.n_kv_heads, n, s);
}

// Backward of qkv_forward for tokens [t0, t1): d qkv (RoPE undone) -> dWqkv, and d x_in added to dres.
static void qkv_backward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    const int64_t n = t1 - t0, QKV = c.qkv_dim();
    bf16* dqkv = dqkv_of_tokens(m) + t0 * QKV;
    rope_apply(dqkv, n, t0, m.shape.seq, m.shape.first_position(), c.n_heads + c.n_kv_heads, c.head_dim, QKV,
               m.inv_freq, true, s, m.doc_positions);
    recompute_attention_norm(m, l, t0, t1, s);  // offload.cu (checkpointing): xn1, if it was not kept
    qk_norm_backward(m, l, dqkv, QKV, a.xn1, n, s);  // Qwen3: through the per-head norms
    linear_backward_input(m.dxn, dqkv, m.w(P_WQKV, l), n, c.dim, QKV, s);
    linear_backward_weight(m.g(P_WQKV, l), dqkv, a.xn1, n, c.dim, QKV, s);
    rmsnorm_backward(m.dres + t0 * c.dim, m.g(P_ATTN_NORM, l), m.dxn, a.x_in + t0 * c.dim, m.w(P_ATTN_NORM, l),
                     a.rstd1, n, c.dim, true, m.norm_partial, s);
}

// att, lse of layer l from x_in.
void attention_block_forward(Model& m, int l, cudaStream_t s) {
    if (m.untied) return untied_attention_forward(m, l, s);  // head chunk by head chunk
    qkv_forward(m, l, s);
    if (m.ulysses) return ulysses_attention_forward(m, l, s);  // all-to-alls around it
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    const int64_t QKV = c.qkv_dim();
    const AttentionForwardArgs fa{.q = a.qkv, .k = a.qkv + c.q_dim(), .v = a.qkv + c.q_dim() + c.kv_dim(),
                                  .ldq = QKV, .ldk = QKV, .ldv = QKV, .out = a.att, .ldo = c.q_dim(), .lse = a.lse,
                                  .docs = m.docs};
    layer_attention_forward(m, l, fa, attention_call_shape(m), s);
}

// q|k|v again as attention's backward reads them, where the output and lse were kept (Untied's
// backward projects them per head chunk itself).
void attention_inputs_forward(Model& m, int l, cudaStream_t s) {
    if (m.untied) return;
    qkv_forward(m, l, s);
    if (m.ulysses) ulysses_qkv_to_heads(m, l, s);  // attention's backward reads them head-sharded
}

// d att of tokens [t0, t1) = d x_mid Wo (Untied Ulysses takes it a head chunk at a time instead).
void attention_dout(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    if (m.untied) return;
    const int64_t QD = m.cfg.q_dim(), D = m.cfg.dim;
    linear_backward_input(m.datt + t0 * QD, m.dres + t0 * D, m.w(P_WO, l), t1 - t0, QD, D, s);
}

// Attention's backward over the whole sequence (d q|k|v from d att), then the projection's:
// dres += d loss / d x_in through attention.
void attention_block_backward(Model& m, int l, cudaStream_t s) {
    if (m.untied) return untied_attention_backward(m, l, s);  // head chunk by head chunk
    if (m.ulysses) ulysses_attention_backward(m, l, s);       // all-to-alls around it
    else {
        const LlamaConfig& c = m.cfg;
        LayerActivations& a = m.layers[l];
        const int64_t QKV = c.qkv_dim(), Q = c.q_dim(), K = c.kv_dim();
        const AttentionBackwardArgs ba{.q = a.qkv, .k = a.qkv + Q, .v = a.qkv + Q + K, .out = a.att, .dout = m.datt,
                                       .ldq = QKV, .ldk = QKV, .ldv = QKV, .ldo = Q, .lddo = Q, .lse = a.lse,
                                       .dq = m.dqkv, .dk = m.dqkv + Q, .dv = m.dqkv + Q + K, .lddq = QKV,
                                       .lddk = QKV, .lddv = QKV, .delta = m.delta, .dq_accum = m.dq_accum,
                                       .docs = m.docs};
        layer_attention_backward(m, l, ba, attention_call_shape(m), s);
    }
    for_each_token_chunk(m, [&](int64_t t0, int64_t t1) { qkv_backward(m, l, t0, t1, s); });
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

// =============================================================================================
// One layer's forward: x_in -> x_out, keeping what the backward reads. Attention is one sub-layer
// (ulysses.cu: plain, Ulysses or Untied), which checkpointing reruns; the rest of the block walks
// the token chunks.
static void layer_forward(Model& m, int l, cudaStream_t s) {
    attention_block_forward(m, l, s);     // att, lse = attention(rope(norm(x_in) Wqkv^T))
    run_hooks(m, AFTER_ATTENTION, l, s);  // offload.cu: the output's slot is free; selective: att to the host
    TimelineMark mark(m, s, "compute", "mlp forward", l);
    for_each_token_chunk(m, [&](int64_t t0, int64_t t1) { block_output_forward(m, l, t0, t1, s); });
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

void head_norm_backward(Model& m, ParamKind which, int l, bf16* dx, int64_t ld, const bf16* raw, int64_t ld_raw,
                        int heads, int64_t n, cudaStream_t s) {
    head_rmsnorm_backward(dx, ld, raw, ld_raw, m.w(which, l), m.g(which, l), n, heads, m.cfg.head_dim, m.cfg.norm_eps,
                          m.norm_partial, s);
}

// x_mid = x_in + att Wo^T (one GEMM with the residual as C).
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

// =============================================================================================
// One layer's backward. On entry m.dres holds d loss / d x_out of layer l; on exit d loss / d x_in.
static void mlp_backward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s);

static void layer_backward(Model& m, int l, cudaStream_t s) {
    recompute_attention(m, l, s);  // offload.cu: what the plan did not keep of the attention sub-layer
    {
        TimelineMark mark(m, s, "compute", "mlp backward", l);  // dres: d x_out -> d x_mid; d att
        for_each_token_chunk(m, [&](int64_t t0, int64_t t1) { mlp_backward(m, l, t0, t1, s); });
    }
    attention_block_backward(m, l, s);  // dres += d loss / d x_in through attention
}

// The MLP half, chunk by chunk. On entry dres[t0:t1] is d loss / d x_out; on exit d loss / d x_mid,
// and d att of the chunk is taken.
static void mlp_backward(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    LayerActivations& a = m.layers[l];
    const int64_t n = t1 - t0, D = c.dim, F = c.ffn_dim, QD = c.q_dim();
    recompute_mlp_inputs(m, l, t0, t1, s);  // offload.cu (checkpointing): x_mid, xn2, h13, act, if not kept
    bf16* dres = at(m.dres, t0, D);
    // x_out = x_mid + act W2^T
    linear_backward_input(m.dact, dres, m.w(P_W2, l), n, F, D, s);
    linear_backward_weight(m.g(P_W2, l), dres, a.act, n, F, D, s);
    swiglu_backward(m.dh13, m.dact, a.h13, n, F, s);
    linear_backward_input(m.dxn, m.dh13, m.w(P_W13, l), n, D, 2 * F, s);
    linear_backward_weight(m.g(P_W13, l), m.dh13, a.xn2, n, D, 2 * F, s);
    rmsnorm_backward(dres, m.g(P_MLP_NORM, l), m.dxn, a.x_mid_rows(t0), m.w(P_MLP_NORM, l), a.rstd2, n, D, true,
                     m.norm_partial, s);
    // x_mid = x_in + att Wo^T
    attention_dout(m, l, t0, t1, s);  // ulysses.cu: d att = d x_mid Wo
    linear_backward_weight(m.g(P_WO, l), dres, at(a.att, t0, QD), n, QD, D, s);
}

// =============================================================================================
// The head: final norm, LM head, cross-entropy, forward and backward together.
void final_norm_forward(Model& m, int64_t t0, int64_t n, cudaStream_t s) {
    const LlamaConfig& c = m.cfg;
    rmsnorm_forward(m.xnf, m.rstdf, at(m.x_final, t0, c.dim), m.w(P_FINAL_NORM), n, c.dim, c.norm_eps, s);
}

void final_norm_backward(Model& m, int64_t t0, int64_t n, const bf16* dxnf, cudaStream_t s) {
    const int D = m.cfg.dim;
    rmsnorm_backward(at(m.dres, t0, D), m.g(P_FINAL_NORM), dxnf, at(m.x_final, t0, D), m.w(P_FINAL_NORM), m.rstdf,
                     n, D, false, m.norm_partial, s);
}

float loss_grad_scale(const Model& m) { return m.n_valid_targets > 0 ? 1.0f / (float)m.n_valid_targets : 0.0f; }
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
        linear_forward(m.logits, m.xnf, W, nullptr, n, D, V, s);
        cross_entropy_forward_backward(m.logits, m.losses + t0, m.targets + t0, n, (int)V,
                                       backward ? loss_grad_scale(m) : 0.0f, s);
        if (!backward) return;  // the loss alone (model_forward_loss)
        linear_backward_input(m.dxn, m.logits, W, n, D, V, s);  // logits now hold dlogits
        linear_backward_weight(dW, m.logits, m.xnf, n, D, V, s);
        final_norm_backward(m, t0, n, m.dxn, s);
    });
    unit_end(m, u, use, s, !c.tied_embeddings);  // tied: the lookup adds the rest at the end
}
static void lm_head_whole_units(const Model& m, std::vector<int>& order) { order.push_back(m.layout.head_unit(0)); }

// Final RMSNorm, LM head, cross-entropy and (backward) their backward: dres = d loss / d x_final;
// the loss sum of this GPU's tokens in scalars[0]. The LM head is the plan's (m.hooks.lm_head).
static void head(Model& m, bool backward, cudaStream_t s) {
    const int u = m.layout.final_norm_unit();  // held through the head
    const int use = backward ? WEIGHTS_AND_GRADIENTS : WEIGHTS;
    unit_begin(m, u, use, s);
    m.hooks.lm_head(m, backward, s);
    unit_end(m, u, use, s);
    if (backward) sum_floats(m.scalars + 0, m.losses, m.shape.tokens(), m.reduce_scratch, s);
}

// The token embedding, forward and backward, one unit of vocabulary rows at a time: one, the
// whole table, unless --vocab-pieces cuts it.
static void embedding_lookup(Model& m, cudaStream_t s) {
    const ParamLayout& lay = m.layout;
    for (int p = 0; p < lay.vocab_pieces(); p++) {
        unit_begin(m, lay.embed_unit(p), WEIGHTS, s);
        embedding_forward(m.layers[0].x_in, m.tokens, m.w_piece(P_EMBED, p), lay.piece_row[p],
                          lay.piece_rows(p), m.shape.tokens(), m.cfg.dim, s);
        unit_end(m, lay.embed_unit(p), WEIGHTS, s);
    }
}

static void embedding_lookup_backward(Model& m, cudaStream_t s) {  // d loss / d x_in of layer 0 in m.dres
    const ParamLayout& lay = m.layout;
    const std::vector<int32_t>& group_token = m.emb_groups.token;  // ascending: a piece's groups are a range
    for (int p = 0; p < lay.vocab_pieces(); p++) {
        const int64_t g0 = std::lower_bound(group_token.begin(), group_token.end(), lay.piece_row[p]) - group_token.begin();
        const int64_t g1 = std::lower_bound(group_token.begin(), group_token.end(), lay.piece_row[p + 1]) - group_token.begin();
        unit_begin(m, lay.embed_unit(p), GRADIENTS, s);
        embedding_backward(m.g_piece(P_EMBED, p), lay.piece_row[p], m.dres, m.emb_group_token + g0,
                           m.emb_group_begin + g0, m.emb_positions, g1 - g0, m.cfg.dim, s);
        unit_end(m, lay.embed_unit(p), GRADIENTS, s);
    }
}

// =============================================================================================
// One step: the forward through every layer, the head, the backward. Each layer's turn and the
// head are a phase of the step (infra/timeline.cu): a --timeline mark, and an event for the
// watchdog of model_sync, the times of --mem-trace and the run's progress line.
static void forward_turn(Model& m, int l, cudaStream_t s) {
    StepPhase phase(m, s, "forward", l);
    const int u = m.layout.layer_unit(l);
    unit_begin(m, u, WEIGHTS, s);
    run_hooks(m, LAYER_FORWARD_BEGIN, l, s);  // selective: the attention output's staging slot is free
    layer_forward(m, l, s);
    unit_end(m, u, WEIGHTS, s);
    run_hooks(m, BLOCK_INPUT_READY, l + 1, s);  // offload.cu: x_out is layer l+1's input, to the host
}

static void backward_turn(Model& m, int l, cudaStream_t s) {
    StepPhase phase(m, s, "backward", l);
    const int u = m.layout.layer_unit(l);
    unit_begin(m, u, WEIGHTS_AND_GRADIENTS, s);
    run_hooks(m, LAYER_BACKWARD_BEGIN, l, s);  // offload.cu: the block input back in its slot
    layer_backward(m, l, s);
    unit_end(m, u, WEIGHTS_AND_GRADIENTS, s);
}

// The embedding, every layer's forward, the head (with its backward unless m.forward_only).
static void forward(Model& m, cudaStream_t s) {
    run_hooks(m, STEP_BEGIN, -1, s);  // fsdp.cu zeroes the gradients
    embedding_lookup(m, s);
    run_hooks(m, BLOCK_INPUT_READY, 0, s);
    for (int l = 0; l < m.cfg.n_layers; l++) forward_turn(m, l, s);
    StepPhase phase(m, s, "head", -1);
    head(m, !m.forward_only, s);  // dres = d loss / d x_final
}

void model_forward_backward(Model& m, cudaStream_t s, ProgressFn progress, void* ctx) {
    watch_step_begin(m, s, progress, ctx);  // infra/timeline.cu: the phases are timed from here
    forward(m, s);
    for (int l = m.cfg.n_layers - 1; l >= 0; l--) backward_turn(m, l, s);
    embedding_lookup_backward(m, s);  // the lookup needs no weights
    run_hooks(m, STEP_END, -1, s);
    watch_step_end(m);
    // scalars[0] holds this GPU's sum of raw per-token losses (only their gradient was scaled by
    // 1 / the step's count of valid targets). Summed over the GPUs it is the step's total loss,
    // which the caller divides by that count.
    if (m.world > 1) m.comm->all_reduce(m.scalars + 0, 1, DType::F32, s);
}

// The forward alone, for evaluation: the step's forward (every technique's forward hooks, the
// same kernels on the same inputs, so the same per-token losses in m.losses as a step's), then
// the head's loss without its backward. Gradients are zeroed, not computed: call it between
// steps, never between a step's backward and its optimizer step. Its progress events (the
// watchdog's, as a step's) are its own: the last step's stay as they are, for --mem-trace.
void model_forward_loss(Model& m, cudaStream_t s) {
    m.forward_only = true;  // FSDP's order of units: the forward's (model_unit_order)
    watch_step_begin(m, s, nullptr, nullptr);
    forward(m, s);
    run_hooks(m, STEP_END, -1, s);
    watch_step_end(m);
    m.forward_only = false;
}

// The units in the order the step acquires them (FSDP gathers each ahead of its turn); a
// forward alone (model_forward_loss) stops after the head's loss.
std::vector<int> model_unit_order(const Model& m) {
    const ParamLayout& lay = m.layout;
    const int L = m.cfg.n_layers;
    std::vector<int> order;
    for (int p = 0; p < lay.vocab_pieces(); p++) order.push_back(lay.embed_unit(p));  // the lookup
    for (int l = 0; l < L; l++) order.push_back(lay.layer_unit(l));
    order.push_back(lay.final_norm_unit());  // held through the head
    m.hooks.lm_head_units(m, order);         // the LM head's units, once or twice
    if (m.forward_only) return order;
    for (int l = L - 1; l >= 0; l--) order.push_back(lay.layer_unit(l));  // the backward's layers
    return order;
}

void model_optimizer_step(Model& m, const AdamW& opt, float max_grad_norm, cudaStream_t s) {
    // Global gradient norm: each GPU's sum of squares; summed over the shards under --fsdp
    // (replicated gradients are already the same everywhere).
    sum_squares(m.scalars + 1, m.grad, m.local_params, m.reduce_scratch, s);
    if (m.opt.fsdp && m.world > 1) m.comm->all_reduce(m.scalars + 1, 1, DType::F32, s);
    clip_scale(m.scalars + 2, m.scalars + 1, max_grad_norm, s);
    for (const ParamSegment& seg : m.segments)
        adamw_update(m.master + seg.local, m.grad + seg.local, m.adam_m + seg.local,
                     m.adam_v + seg.local, seg.count, opt, seg.tensor->decay, m.scalars + 2, s);
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
// two AdamW moments; the bf16 weights exist only for the two units in use, fsdp.cu).
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
    m.xnf = A.take<bf16>("final norm output", MEM_OTHER, m.plan.loss_rows * D);
    m.rstdf = A.take<float>("final rstd", MEM_OTHER, m.plan.loss_rows);
    // Logits of one vocabulary piece (the widest: the whole vocabulary in one piece), and the
    // running statistics of the head's loss when it comes in several pieces (beyond/savings.cu).
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
    if (m.plan.dqkv_buffer) m.dqkv = A.take<bf16>("d qkv", MEM_ATTENTION, T * c.qkv_dim());
    if (m.plan.datt_buffer) {
        m.datt = A.take<bf16>("d attention output", MEM_ATTENTION, T * c.q_dim());
        m.delta = A.take<float>("attention delta", MEM_ATTENTION, layer_lse_floats(m));
    }
    m.dq_accum = nullptr;
    if (m.opt.fused_attention && m.plan.dq_sums_buffer)  // 4 bytes per dQ element of one call
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
    m.norm_partial =  // the model's norms (D values) and Qwen3's per-head ones (d values) share them
        A.take<float>("rmsnorm dw partials", MEM_WORKSPACE, rmsnorm_partial_floats(std::max(c.dim, c.head_dim)));
    if (c.qk_norm())  // Qwen3: q|k before their norms, projected again for the norms' backward
        m.qk_raw = A.take<bf16>("q|k before their norms (Qwen3)", MEM_OTHER, C * (c.q_dim() + c.kv_dim()));
    m.reduce_scratch = A.take<float>("reduction scratch", MEM_WORKSPACE, sum_scratch_floats());
    m.scalars = A.take<float>("step scalars", MEM_WORKSPACE, 4);

    m.tokens = A.take<int32_t>("tokens", MEM_OTHER, T);
    m.targets = A.take<int32_t>("targets", MEM_OTHER, T);
    const int64_t max_groups = std::min<int64_t>(T, c.vocab);
    m.emb_group_token = A.take<int32_t>("embedding groups", MEM_OTHER, max_groups);
    m.emb_group_begin = A.take<int64_t>("embedding group starts", MEM_OTHER, max_groups + 1);
    m.emb_positions = A.take<int64_t>("embedding positions", MEM_OTHER, T);
    m.inv_freq = A.take<double>("rope frequencies", MEM_OTHER, c.head_dim / 2);
    if (m.opt.doc_mask) {  // the step's documents: their starts and first positions
        m.doc_start = A.take<int64_t>("document starts", MEM_OTHER, m.opt.max_docs);
        m.doc_first_position = A.take<int64_t>("document first positions", MEM_OTHER, m.opt.max_docs);
    }
    m.gemm_workspace = A.take_bytes("cuBLASLt workspace", MEM_WORKSPACE, m.gemm_workspace_bytes);
}

void model_declare_buffers(Model& m, Arena& A) {
    m.layout = param_layout(m.cfg, m.opt.vocab_pieces);  // --vocab-pieces: units of vocabulary rows (beyond/savings.cu)
    m.ulysses.reset(), m.untied.reset();  // their *_plan make them again when they are on
    // How the step holds its activations and where each technique enters it: the plain model's
    // plan and step, then each technique's changes and hooks.
    m.plan = plain_plan(m);
    m.hooks = StepHooks();
    m.hooks.lm_head = lm_head_whole, m.hooks.lm_head_units = lm_head_whole_units;
    fsdp_plan(m);           // the units' weights and gradients, gathered and reduced around their use
    ulysses_plan(m);        // --ulysses: d q|k|v arrives in Ulysses's staging
    checkpointing_plan(m);  // --ckpt: keep block inputs only
    offload_plan(m);        // --offload: the block inputs live on the host, staged through two slots
    chunked_plan(m);        // --chunked: layers and the head walk their tokens in chunks
    untied_plan(m);         // --untied: attention's inputs and gradients per head chunk, its own buffers
    savings_plan(m);        // stage 7's savings (beyond/savings.cu): one staging slot, Untied's buffers shared
    selective_plan(m);      // --ckpt=selective: attention outputs kept too, within the host budget

    fsdp_declare_buffers(m, A);       // model states (--fsdp: this GPU's shards), the two bf16 unit slots
    declare_activations(m, A);
    selective_declare_buffers(m, A);  // --ckpt=selective: the device's own slots for attention outputs
    declare_head_and_gradients(m, A);
    untied_declare_buffers(m, A);     // --untied: one head chunk's buffers
    savings_declare_buffers(m, A);    // stage 7 (beyond/savings.cu): Untied's staging holds the fused dQ sums
    ulysses_declare_buffers(m, A);    // --ulysses: all-to-all staging and head-sharded buffers
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
    if (!m.comm) m.comm = comm_single(), m.owns_comm = true;
    if (!m.comm_fsdp) m.comm_fsdp = m.comm->split();
    if (!m.comm_stream) CUDA_CHECK(cudaStreamCreateWithFlags(&m.comm_stream, cudaStreamNonBlocking));
    watch_create(m);
    CUDA_CHECK(cudaMallocHost(&m.host_scalars, 4 * sizeof(float)));
    for (auto create : m.hooks.create) create(m);  // the techniques' streams, events, pinned host memory
}

void model_free(Model& m, DeviceMemory& dm) {
    timeline_destroy(m);
    for (auto destroy : m.hooks.destroy) destroy(m);
    if (m.comm_stream) cudaStreamDestroy(m.comm_stream);
    m.comm_stream = nullptr;
    watch_destroy(m);
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
    for (const ParamSegment& seg : m.segments)
        init_param_values(m, *seg.tensor, seg.tensor_offset, seg.count, seed, m.master + seg.local, nullptr, s);
    CUDA_CHECK(cudaMemsetAsync(m.adam_m, 0, m.local_params * sizeof(float), s));
    CUDA_CHECK(cudaMemsetAsync(m.adam_v, 0, m.local_params * sizeof(float), s));
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
    m.n_docs = n;
    m.docs = {m.doc_start, n}, m.doc_positions = {m.doc_start, m.doc_first_position, n};
    CUDA_CHECK(cudaMemcpyAsync(m.doc_start, docs->start.data(), n * 8, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(m.doc_first_position, docs->first_position.data(), n * 8, cudaMemcpyHostToDevice, s));
}

void model_set_batch(Model& m, const int32_t* tokens, const int32_t* targets, cudaStream_t s, int64_t n_valid,
                     const StepDocuments* docs) {
    const int64_t T = m.shape.tokens();
    if (m.opt.doc_mask) set_documents(m, docs, s);
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
