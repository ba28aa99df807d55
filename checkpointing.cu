// checkpointing.cu - activation checkpointing (--ckpt, ladder stage 3; the talk at 07:48, with
// CPU offload, offload.cu).
//
// A plain step keeps every activation of every layer from the forward until that layer's
// backward. With --ckpt a layer keeps only its input x_in (the residual stream entering the
// block). Its backward first recomputes the layer's forward from x_in (norm, QKV, RoPE,
// attention, Wo, MLP), then runs the backward on it. The recomputed activations go into one
// set of buffers, which every layer reuses in turn.
//
// Memory per GPU, for T local tokens and L layers (bytes):
//   kept per token and layer          plain                         --ckpt
//     "other"                         2 (4D + 3F) + 8               2 D
//     "attention"                     2 (qkv_dim + Hq d) + 4 Hq     0
//   Llama 3.1 8B:                     139,400                       8,192
// plus one layer's worth of the buffers that are recomputed (not multiplied by L).
// Cost: one more forward of every layer (about a third more compute: forward 1, backward 2).
//
// What is kept and what is recomputed:
//   kept per layer      x_in
//   recomputed          xn1 (attention norm), q|k|v, att and lse, x_mid, xn2, h13, act (the
//                       MLP's inputs)
// --chunked (chunked.cu) also drops the MLP's inputs (it keeps one chunk of them), and Untied
// Ulysses (untied.cu) implies --ckpt; the functions below rebuild whatever the plan says was not
// kept, whichever technique dropped it.
//
// Where --ckpt changes the step:
//   checkpointing_plan        qkv, att, lse, x_mid and the norms' and MLP's buffers become one
//                             set, recomputed (Hold::RECOMPUTED)
//   llama.cu layer_backward   recompute_attention: the attention sub-block before the backward
//   llama.cu mlp_backward     recompute_mlp_inputs: x_mid, xn2, h13, act of the chunk
//   llama.cu qkv_backward     recompute_attention_norm: xn1 of the chunk
//   llama.cu x_mid_rows       x_mid is one recomputed chunk, not the layer's own [T, D] rows
//   train.cpp                 --offload and --untied turn --ckpt on
// With --offload (stage 4) the kept block inputs move to pinned host memory (offload.cu).
// Selective checkpointing (--ckpt=selective, selective.cu, beyond the talk) keeps attention's
// output too and reruns only q|k|v before the backward.
#include "llama.h"

void checkpointing_plan(Model& m) {
    if (!m.opt.ckpt) return;
    ActivationPlan& p = m.plan;
    p.qkv = p.att = p.x_mid = p.norms_mlp = Hold::RECOMPUTED;
}

// Before layer l's backward: the attention sub-block's forward again, from x_in. Its backward
// reads q, k, v, the output and its lse.
void recompute_attention(Model& m, int l, cudaStream_t s) {
    if (m.plan.att == Hold::RECOMPUTED) attention_block_forward(m, l, s);
}

// Before the backward of the chunk's q|k|v projection: its input xn1.
void recompute_attention_norm(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    if (m.plan.norms_mlp == Hold::RECOMPUTED) attention_norm_forward(m, l, t0, t1, s);
}

// Before the chunk's MLP backward: x_mid = x_in + att Wo^T, then xn2, h13 and act from it.
void recompute_mlp_inputs(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    if (m.plan.x_mid == Hold::RECOMPUTED) attention_output_forward(m, l, t0, t1, s);
    if (m.plan.norms_mlp == Hold::RECOMPUTED) mlp_input_forward(m, l, t0, t1, s);
}
