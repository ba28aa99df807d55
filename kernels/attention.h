// kernels/attention.h - flash attention as the step calls it, and the two kernel sets behind it:
// the fast Hopper kernels (kernels/attention_hopper.cu) and the readable reference ones
// (kernels/attention.cu). docs/attention.md explains both.
#pragma once

#include "kernels/kernels.h"

// ---------------------------------------------------------------------------------------------
// Flash attention: causal, grouped-query, bf16 in/out, fp32 accumulation and
// log-sum-exp. Never materializes the S x S matrix; all offsets 64-bit.
//
// q, k, v: rows of B*S tokens; head h of token t is at q[t*ldq + h*head_dim] (so q, k, v can be
// column slices of one fused QKV buffer). out likewise with ldo. lse: [B, Hq, S] fp32 natural log.
struct AttentionShape {
    int batch;
    int64_t seq;
    int n_heads, n_kv_heads, head_dim;
};
// Packed documents of one call (--doc-mask): the ascending starts of its documents in the call's
// flat token order ([batch][seq]; every sequence's first token starts one). A query sees the keys
// of its own document up to itself. Without starts: one document per sequence, plain causal.
// kernels/documents.cuh reads them, for every kernel alike.
struct AttentionDocs {
    const int64_t* start = nullptr;  // device memory
    int64_t count = 0;
};

struct AttentionForwardArgs {
    const bf16 *q, *k, *v;
    int64_t ldq, ldk, ldv;
    bf16* out;
    int64_t ldo;
    float* lse;
    AttentionDocs docs = {};
};
struct AttentionBackwardArgs {
    const bf16 *q, *k, *v, *out, *dout;  // out = nullptr: delta is given, not computed
    int64_t ldq, ldk, ldv, ldo, lddo;
    const float* lse;
    bf16 *dq, *dk, *dv;
    int64_t lddq, lddk, lddv;
    float* delta;  // [B, Hq, S]: rowsum(dout * out), computed here unless out is nullptr
    bool accumulate_dkv = false;  // dk, dv += this call's (Untied Ulysses sums a KV group's chunks)
    // Fused backward (--attention fused): attention_dq_accum_floats(shape) floats of fp32 workspace.
    // Given, the fast kernels add dQ inside the dK/dV kernel (5 products instead of 7; the adds go
    // in a fixed order, so still bit-reproducible); nullptr, they run the dK/dV and dQ kernels.
    float* dq_accum = nullptr;
    AttentionDocs docs = {};
};
int64_t attention_dq_accum_floats(const AttentionShape& sh);  // the fused backward's workspace
// The training step calls these two: the fast Hopper kernels (attention_hopper.cu: head dim
// 128 on an sm_90 GPU, 16-byte aligned inputs) unless the reference ones are selected or the
// call is outside what the fast ones do; then attention.cu's kernels.
void attention_forward(const AttentionForwardArgs& a, const AttentionShape& sh, cudaStream_t s);
void attention_backward(const AttentionBackwardArgs& a, const AttentionShape& sh, cudaStream_t s);
// Select attention.cu's kernels for every call (--attention reference; tests and benches).
void attention_use_reference(bool on);
bool attention_uses_hopper(const AttentionShape& sh);  // what the dispatch picks for this shape
// The FLOPs of causal attention, the convention of docs/reference.md: forward 4*S*S*d*Hq/2 per sequence,
// backward 2.5 x forward.
double attention_forward_flops(const AttentionShape& sh);
// attention.cu: the readable reference kernels (mma.sync; head dim 64 or 128; any GPU since
// sm_80) and the test oracle on the GPU; delta = rowsum(dout * out) alone.
void attention_forward_reference(const AttentionForwardArgs& a, const AttentionShape& sh, cudaStream_t s);
void attention_backward_reference(const AttentionBackwardArgs& a, const AttentionShape& sh, cudaStream_t s);
void attention_delta(const AttentionBackwardArgs& a, const AttentionShape& sh, cudaStream_t s);
// attention_hopper.cu: wgmma + TMA, warp-specialized (head dim 128, sm_90; the backward needs
// delta given, out == nullptr). The backward's options say what it runs and how; the dispatch
// above takes the defaults, benches and tests set them.
struct HopperBackwardOptions {
    int parts = 3;                    // bit 0: the dK/dV kernel, bit 1: the dQ kernel (with dq_accum: the
                                      // fused kernel, then the conversion of its sums)
    int64_t kv_major_from_tiles = 0;  // blocks KV head by KV head from sequences of this many 128-row tiles,
                                      // else tile by tile across the heads (0: 128 tiles, 16K tokens)
    bool unreachable_dq_counts = false;  // the fused kernel's counts of dQ adds start at -1, a value its
                                         // order never reaches: its blocks wait until the waits' time limit
                                         // ends the launch with an error (what a test checks)
};
void attention_forward_hopper(const AttentionForwardArgs& a, const AttentionShape& sh, cudaStream_t s);
void attention_backward_hopper(const AttentionBackwardArgs& a, const AttentionShape& sh, cudaStream_t s,
                               const HopperBackwardOptions& opt = {});
