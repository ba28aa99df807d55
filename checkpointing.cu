// checkpointing.cu - activation checkpointing (--ckpt, ladder stage 3; the talk at 07:48, with
// CPU offload, offload.cu).
//
// A plain step keeps every activation of every layer from the forward until that layer's
// backward. With --ckpt a layer keeps only its input x_in (the residual stream entering the
// block). Its backward first recomputes the layer's forward from x_in (norm, QKV, RoPE,
// attention, Wo, MLP), then runs the backward on it. The recomputed activations go into one
// shared set of buffers, which every layer reuses in turn.
//
// --ckpt=selective also keeps each layer's attention output and log-sum-exp, so the backward
// never reruns the attention forward. At long context attention is most of a layer's compute
// (forward 1 unit, backward 2.5 units), so skipping its rerun saves close to a fifth of the
// step, for 2 Hq d + 4 Hq more bytes per token and layer. With --offload those bytes go to the
// host, as many layers' as --host-mem-gib allows (more where block inputs are rebuilt instead of
// kept), then stay on the device for as many more as the cap has room for (offload.cu); the other
// layers rerun attention.
//
// Memory per GPU, for T local tokens and L layers (bytes):
//   kept per token and layer          plain                         --ckpt   --ckpt=selective
//     "other"                         2 (4D + 3F) + 8               2 D      2 D
//     "attention"                     2 (qkv_dim + Hq d) + 4 Hq     0        2 Hq d + 4 Hq
//   Llama 3.1 8B:                     139,400                       8,192    16,512
// plus one layer's worth of the buffers that are recomputed (not multiplied by L).
// Cost: one more forward of every layer (about a third more compute: forward 1, backward 2),
// less the attention forward under =selective.
//
// What is kept and what is recomputed:
//   kept per layer      x_in (=selective: and att, lse)
//   recomputed          xn1 (attention norm), q|k|v, att and lse (unless selective), x_mid,
//                       xn2, h13, act (the MLP's inputs)
// --chunked (chunked.cu) also drops the MLP's inputs (it keeps one chunk of them), and Untied
// Ulysses (untied.cu) implies --ckpt; the functions below rebuild whatever the plan says was not
// kept, whichever technique dropped it.
//
// Where --ckpt changes the step:
//   checkpointing_plan        qkv, x_mid and the norms' and MLP's buffers become one shared
//                             set; att and lse too unless =selective
//   llama.cu layer_backward   recompute_attention: q|k|v (and att, lse) before the backward
//   llama.cu mlp_backward     recompute_mlp_inputs: x_mid, xn2, h13, act of the chunk
//   llama.cu qkv_backward     recompute_attention_norm: xn1 of the chunk
//   llama.cu x_mid_rows       x_mid is one shared chunk, not the layer's own [T, D] rows
//   train.cpp                 --offload and --untied turn --ckpt on
// With --offload (stage 4) what is kept moves to pinned host memory (offload.cu).
#include "llama.h"

void checkpointing_plan(Model& m) {
    if (!m.opt.ckpt) return;
    ActivationPlan& p = m.plan;
    p.qkv = p.x_mid = p.norms_mlp = Hold::SHARED;
    p.att = m.opt.selective ? Hold::PER_LAYER : Hold::SHARED;
}

bool attention_kept(const Model& m, int l) {
    switch (m.plan.att) {
        case Hold::PER_LAYER: return true;
        case Hold::ON_HOST:  // offload.cu: on the host, in the staging slot (the last layer), on the device
            return l < m.plan.att_host_layers || l >= m.cfg.n_layers - 1 - m.plan.att_device_layers;
        default: return false;
    }
}

// Before layer l's backward: the attention sub-block's forward again, from x_in. Under full
// checkpointing that is q|k|v and attention itself; under =selective attention's output was kept,
// but its backward still reads q, k and v.
void recompute_attention(Model& m, int l, cudaStream_t s) {
    if (!attention_kept(m, l)) {
        if (m.untied) return untied_attention_forward(m, l, s);  // head chunk by head chunk
        FOR_EACH_CHUNK(m, t0, t1) qkv_forward(m, l, t0, t1, s);
        return self_attention_forward(m, l, s);
    }
    if (m.plan.qkv != Hold::SHARED) return;  // kept, or (untied) rebuilt per head chunk there
    FOR_EACH_CHUNK(m, t0, t1) qkv_forward(m, l, t0, t1, s);
    if (m.ulysses) ulysses_qkv_to_heads(m, l, s);  // attention reads them head-sharded
}

// Before the backward of the chunk's q|k|v projection: its input xn1.
void recompute_attention_norm(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    if (m.plan.norms_mlp == Hold::SHARED) attention_norm_forward(m, l, t0, t1, s);
}

// Before the chunk's MLP backward: x_mid = x_in + att Wo^T, then xn2, h13 and act from it.
void recompute_mlp_inputs(Model& m, int l, int64_t t0, int64_t t1, cudaStream_t s) {
    if (m.plan.x_mid == Hold::SHARED) attention_output_forward(m, l, t0, t1, s);
    if (m.plan.norms_mlp == Hold::SHARED) mlp_input_forward(m, l, t0, t1, s);
}
