// chunked.cu - chunked sequence training (--chunked, ladder stage 5; the talk at 09:33; ALST,
// arXiv 2506.13996): tiled MLP, chunked element-wise work, and a fused chunked LM head +
// cross-entropy.
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
// reads every key), their gradients dqkv, datt and delta, the residual gradient dres, x_mid when
// it is kept per layer (no --ckpt), and the per-token losses, tokens and targets. Everything
// else is C rows.
//
// Memory, per GPU, for T local tokens (bytes; the "other" category):
//   without --chunked: MLP work 2 T (2D + 3F) + 8 T and its gradients 2 T (D + 3F);
//                      logits 2 T V (their gradient overwrites them)
//   with --chunked:    the same with T replaced by C (MLP) and C_loss (logits)
// e.g. Llama 3.1 8B, T = 393216 (3M tokens over 8 GPUs): logits 94 GiB -> 1 GiB, MLP work and
// its gradients 72 GiB -> 0.75 GiB (C = 4096, C_loss = 4096).
// Cost: without --ckpt, the chunk's norm, up projection and activation run again in the
// backward, 4 D F of the MLP's 18 D F FLOPs per token (about 2/9 more in the MLP); with --ckpt
// they are recomputed anyway, so chunking adds no FLOPs. Smaller GEMMs run a little slower.
//
// Chunk sizes: C defaults to the hidden size (ALST's choice: a tile of D tokens keeps the MLP's
// GEMMs large enough to run at full speed); C_loss keeps one chunk's bf16 logits near 1 GiB
// (4096 tokens for a 128K vocabulary). Neither needs to divide T.
//
// The plain model already walks its tokens this way, in one chunk of all T tokens (the loops
// for_each_token_chunk and for_each_loss_chunk, llama.cu); --chunked only makes the chunks smaller.
#include <algorithm>

#include "llama.h"

// Tokens of a layer's chunk: --chunk-tokens, or the hidden size.
static int64_t chunk_rows_for(const LlamaConfig& c, const StepOptions& o, int64_t T) {
    int64_t k = o.chunk_tokens > 0 ? o.chunk_tokens : c.dim;
    return std::max<int64_t>(1, std::min(k, T));
}

// Tokens of a chunk of the LM head and loss: --loss-chunk-tokens, or bf16 logits over the whole
// vocabulary near 1 GiB.
static int64_t loss_chunk_rows_for(const LlamaConfig& c, const StepOptions& o, int64_t T) {
    int64_t k = o.loss_chunk_tokens;
    if (k <= 0) k = std::max<int64_t>(256, ((1LL << 30) / (2LL * c.vocab)) / 256 * 256);
    return std::max<int64_t>(1, std::min(k, T));
}

void chunked_plan(Model& m) {
    if (!m.opt.chunked) return;
    const int64_t T = m.shape.tokens();
    m.plan.chunk_rows = chunk_rows_for(m.cfg, m.opt, T);
    m.plan.loss_rows = loss_chunk_rows_for(m.cfg, m.opt, T);
    m.plan.norms_mlp = Hold::RECOMPUTED;  // one chunk's worth, rebuilt in the backward
}
