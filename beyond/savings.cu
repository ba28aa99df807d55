// beyond/savings.cu - beyond the talk (ladder stage 7): four memory savings of our own on top of
// the talk's six techniques, one flag each. --stage 7 turns all four on. None changes what the step
// computes but the head's rounding (below); each takes a buffer the textbook stack holds and
// finds its bytes elsewhere.
//
// 1. --vocab-pieces[=N]: the embedding and the LM head in units of vocabulary rows.
//    The talk's FSDP gathers each table whole, so its two gathered slots and two unit gradients,
//    sized by the largest unit, hold a table: 12 bytes x V D. Cut into N pieces of about a
//    layer's size (N = 3 for Llama 3.1 8B, infra/common.h param_layout), they hold a layer:
//        comm:   12 V D -> 12 x the largest unit      (8B: 5.87 -> 2.44 GiB)
//        other:  logits 2 C_loss V -> 2 C_loss V / N  (8B: 1.00 -> 0.33 GiB under --chunked)
//    Cost: a token's loss needs all its logits (their log-sum-exp), so the head takes two
//    passes over the pieces (lm_head_in_pieces, below): the logits GEMM twice, 2 T D V FLOPs
//    more per step (0.04% of an 8B step at 3M tokens, 2% at 8K), and d norm(x) summed over the
//    pieces in bf16, rounded once per piece. The head's pieces come into FSDP's order of units
//    twice (lm_head_pieces_order).
//
// 2. --one-offload-slot: the block inputs staged through one device slot instead of two.
//    A layer's MLP writes the layer's output over its input, chunk by chunk (the output's rows
//    t0..t1 need only the input's rows t0..t1), once the input's copy to the host is done; the
//    last layer's output, the head's input, ends in the slot too.
//        other:  2 T 2D -> T 2D                       (8B at 3M on 8 GPUs: 6 -> 3 GiB)
//    Cost: the backward cannot fetch the next layer's input ahead: each input's copy back waits
//    for the slot, T 2D bytes at about 55 GB/s exposed per layer (8B at 3M: 58 ms against about a
//    minute of the layer's backward), and every layer's input, the last one's too, is fetched.
//
// 3. --grad-in-att-output: Untied Ulysses's gradient of the normalized input, T x D, in the
//    memory of the layer's attention output (T x Hq d, at least as wide for Llama).
//    Untied's backward sums dxn1 = d q|k|v Wqkv over the head chunks into a buffer of its own.
//    The attention output is read only for the deltas, rowsum(d out * out); taking every chunk's
//    delta before the first chunk frees its memory for dxn1:
//        other:  T 2D -> 0                            (8B at 3M on 8 GPUs: 3 GiB)
//    Cost: each chunk's d out is computed twice, for its delta first and again for its backward,
//    2 T D Hq d FLOPs per layer (8B at 3M: 13 TFLOP, about 20 ms of a layer's minute).
//
// 4. --dq-sums-in-staging: the fused backward's fp32 dQ sums (--attention fused) in Untied's
//    all-to-all staging. While a head chunk's attention backward runs, its send and receive
//    blocks hold nothing (d out has gone to head-sharded, dq comes back after), and the sums,
//    4 S K d bytes, are the blocks' size:
//        attention: 4 S K d -> 0                      (8B at 3M, K = 1: 1.5 GiB)
//    Cost: none.
#include "llama.h"

// The plan (the LM head in pieces where the vocabulary is cut: llama.cu's head calls
// lm_head_in_pieces); offload.cu stages the inputs
// through one slot (its slot of layer l is l % 1); Untied's normalized-input gradient and the
// fused dQ sums get no buffers of their own.
void savings_plan(Model& m) {
    if (m.opt.one_offload_slot && m.plan.x_in == Hold::ON_HOST) m.plan.x_slots = 1;
    if (m.untied && m.opt.dq_sums_in_staging) m.plan.dq_sums_buffer = false;
    if (untied_grad_in_att_output(m)) m.plan.dxn1_buffer = false;
}

bool untied_grad_in_att_output(const Model& m) {
    return m.untied && m.opt.grad_in_att_output && m.cfg.q_dim() >= m.cfg.dim;
}

// 1. The LM head in k pieces of vocabulary rows, one unit at a time, in two passes:
//   the loss:     per piece and loss chunk, logits = norm(x) W_p^T, and per token the running
//                 max and sum of exponentials, and its target's logit in the piece that has it;
//                 then per token lse and the loss
//   the backward: per piece and chunk, the logits again, turned into d logits in place with the
//                 lse; d norm(x) += d logits W_p, summed over the pieces in dres (bf16), and
//                 dW_p += d logits^T norm(x) (fp32, the piece's gradient unit)
// then the final norm's backward turns d norm(x) into d x_final, chunk by chunk. Every piece's
// unit is used here (unit_begin: under FSDP gathered; the final norm's unit is held by the caller).
static void head_loss_pass(Model& m, cudaStream_t s) {
    const ParamLayout& lay = m.layout;
    const ParamKind head = lm_head_kind(m);
    for (int p = 0; p < lay.vocab_pieces(); p++) {
        const int64_t v0 = lay.piece_row[p], V = lay.piece_rows(p);
        unit_begin(m, m.piece_unit(head, p), WEIGHTS, s);
        for_each_loss_chunk(m, [&](int64_t t0, int64_t n) {
            final_norm_forward(m, t0, n, s);
            linear_forward(m.head.logits, m.head.xnf, m.w_piece(head, p), nullptr, n, m.cfg.dim, V, s);
            cross_entropy_piece_stats(m.head.logits, n, (int)V, v0, m.batch.targets + t0, m.head.pieces.token_lse + t0, m.head.pieces.token_sumexp + t0,
                                      m.head.pieces.target_logit + t0, p == 0, s);
        });
        unit_end(m, m.piece_unit(head, p), WEIGHTS, s);
    }
    cross_entropy_piece_loss(m.head.losses, m.head.pieces.token_lse, m.head.pieces.token_sumexp, m.head.pieces.target_logit, m.batch.targets, m.shape.tokens(), s);
}

static void head_backward_pass(Model& m, cudaStream_t s) {
    const ParamLayout& lay = m.layout;
    const ParamKind head = lm_head_kind(m);
    const int64_t D = m.cfg.dim;
    for (int p = 0; p < lay.vocab_pieces(); p++) {
        const int64_t v0 = lay.piece_row[p], V = lay.piece_rows(p);
        const int u = m.piece_unit(head, p);
        unit_begin(m, u, WEIGHTS_AND_GRADIENTS, s);
        for_each_loss_chunk(m, [&](int64_t t0, int64_t n) {
            bf16* dxn = m.dres + t0 * D;  // d norm(x) of the chunk, summed over the pieces
            final_norm_forward(m, t0, n, s);
            linear_forward(m.head.logits, m.head.xnf, m.w_piece(head, p), nullptr, n, D, V, s);
            cross_entropy_piece_backward(m.head.logits, n, (int)V, v0, m.head.pieces.token_lse + t0, m.batch.targets + t0,
                                         loss_grad_scale(m), s);
            gemm_rm(false, false, n, D, V, m.head.logits, V, m.w_piece(head, p), D, dxn, D, false, 1.f, p == 0 ? 0.f : 1.f,
                    dxn, s);
            linear_backward_weight(m.g_piece(head, p), m.head.logits, m.head.xnf, n, D, V, s);
        });
        unit_end(m, u, WEIGHTS_AND_GRADIENTS, s, !m.cfg.tied_embeddings);  // tied: the lookup adds the rest at the end
    }
}

void lm_head_in_pieces(Model& m, bool backward, cudaStream_t s) {
    head_loss_pass(m, s);
    if (!backward) return;  // the loss alone (model_forward_loss)
    head_backward_pass(m, s);
    const int64_t D = m.cfg.dim;
    for_each_loss_chunk(m, [&](int64_t t0, int64_t n) {  // dres: d norm(x) -> d x_final
        final_norm_forward(m, t0, n, s);
        CUDA_CHECK(cudaMemcpyAsync(m.chunk.dxn, m.dres + t0 * D, n * D * sizeof(bf16), cudaMemcpyDeviceToDevice, s));
        final_norm_backward(m, t0, n, m.chunk.dxn, s);
    });
}

// The units the head uses, in order: every piece for the loss, then every piece for the backward (a
// forward alone: the loss's only).
void lm_head_pieces_order(const Model& m, std::vector<int>& order) {
    for (int pass = 0; pass < (m.forward_only ? 1 : 2); pass++)
        for (int p = 0; p < m.layout.vocab_pieces(); p++) order.push_back(m.layout.head_unit(p));
}

// 3. Every head chunk's delta first, the last read of the layer's attention output, whose memory
// then gathers dxn1 (each chunk's d out is computed again in its turn).
bf16* deltas_first_in_att_output(Model& m, int l, cudaStream_t s) {
    for (int i = 0; i < untied_chunks(m); i++) {
        untied_chunk_dout(m, l, i, s);
        untied_chunk_deltas(m, l, i, s);
    }
    return m.layers[l].att;
}

// 4. The dQ sums in Untied's staging: while a head chunk's attention backward runs, its send and
// receive blocks hold nothing (d out has gone to head-sharded, dq comes back after it). The sums
// also hold a count per query tile, so the staging takes the larger of the two sizes.
static bool dq_sums_in_staging(const Model& m) { return m.untied && m.opt.fused_attention && !m.plan.dq_sums_buffer; }

int64_t dq_sums_staging_bf16s(const Model& m) {
    return dq_sums_in_staging(m) ? 2 * attention_dq_accum_floats(untied_attention_shape(m)) : 0;
}

void savings_declare_buffers(Model& m, Arena&) {
    if (dq_sums_in_staging(m)) m.dq_accum = (float*)untied_staging(m);
}
