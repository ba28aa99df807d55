"""Plain PyTorch baseline for issue 23: Llama 3.1 8B (or 3.2 3B) trained on one H200 with what a
PyTorch user would reach for first, so that ./train's tokens/s can be compared with it in the same
device call. transformers' LlamaForCausalLM built from its config (random weights), fp32 master
weights, bf16 autocast, full activation checkpointing (every decoder layer), fused AdamW (lr 3e-4,
betas 0.9/0.95, weight decay 0.1), gradient clipping at 1.0, batch 1 of random tokens, and the loss
computed in chunks of --loss-chunk tokens, each checkpointed, so no more than one chunk's
[chunk, vocab] logits is ever held.

    python3 bench/torch_train.py --config llama3.1-8b --seq-len 8K --json out.json

Prints one summary line; --json writes {config, seq_len, steps, step_s, median_s, tokens_per_s,
peak_alloc_gib, peak_reserved_gib, losses (every step's, warm-up first), torch, transformers, gpu,
attn, ...}. On CUDA out-of-memory it prints a line saying so, writes {"oom": true, ...} and exits 3.
Memory to expect for 8B: 8.03e9 parameters x 16 bytes (weights, gradients, two Adam moments, all
fp32) = 119.7 GiB before any activation. Needs PyTorch and transformers (written for PyTorch 2.11,
transformers 5.17); --attn flash_attention_2 also needs the flash_attn package.
"""
import argparse
import importlib.util
import json
import statistics
import sys

import torch
import torch.nn.functional as F
import transformers
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig, LlamaForCausalLM

COMMON = dict(num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
              max_position_embeddings=131072, hidden_act="silu", attention_bias=False, mlp_bias=False)
CONFIGS = {
    "llama3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=14336,
                        tie_word_embeddings=False, rope_factor=8.0),
    "llama3.2-3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, intermediate_size=8192,
                        tie_word_embeddings=True, rope_factor=32.0),
}
GIB = 1024 ** 3


def tokens(text):
    """8192, 8K (x 1024) or 1M (x 1024^2), as the C++ tools take them."""
    mult = {"K": 1024, "M": 1024 * 1024}.get(text[-1:].upper(), 1)
    try:
        n = int(text[:-1] if mult > 1 else text) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 8192, 8K, 1M)")
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return n


def llama_config(name, attn):
    kw = dict(CONFIGS[name])
    factor = kw.pop("rope_factor")
    cfg = LlamaConfig(**kw, **COMMON, use_cache=False,
                      rope_scaling=dict(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=8192))
    cfg._attn_implementation = attn  # as tests/hf_parity.py sets it
    return cfg


def train(args, result):
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialise the weights on the GPU, in fp32
        model = LlamaForCausalLM(llama_config(args.config, args.attn)).float()
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    result["params"] = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    S, C = args.seq_len, args.loss_chunk
    ids = torch.randint(0, model.config.vocab_size, (1, S + 1), device="cuda")  # one batch, every step
    x, y = ids[:, :-1], ids[0, 1:]

    def chunk_ce(h, t):  # the only [chunk, vocab] logits alive; recomputed in the backward
        return F.cross_entropy(model.lm_head(h).float(), t, reduction="sum")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = model.model(input_ids=x).last_hidden_state[0]  # [S, D]: hidden states, not logits
            loss = sum(checkpoint(chunk_ce, h[i:i + C], y[i:i + C], use_reentrant=False)
                       for i in range(0, S, C)) / S
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for i in range(args.warmup_steps + args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        loss = step()
        end.record()
        torch.cuda.synchronize()
        result["losses"].append(loss.item())
        if i >= args.warmup_steps:
            result["step_s"].append(start.elapsed_time(end) / 1e3)
        print(f"step {i + 1}{' (warm-up)' if i < args.warmup_steps else ''}: loss {loss.item():.4f}, "
              f"{start.elapsed_time(end) / 1e3:.3f} s", flush=True)


def main():
    ap = argparse.ArgumentParser(description="Plain PyTorch Llama training baseline (one GPU).")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="llama3.1-8b")
    ap.add_argument("--seq-len", type=tokens, default=tokens("8K"), help="tokens per step: 8192, 8K, 1M")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first")
    ap.add_argument("--loss-chunk", type=tokens, default=4096, help="tokens per chunk of the loss")
    ap.add_argument("--attn", choices=["sdpa", "flash_attention_2"], default="sdpa")
    ap.add_argument("--json", default="", help="write the result here")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup_steps < 0:
        ap.error("--steps must be at least 1 and --warmup-steps at least 0")
    if not torch.cuda.is_available():
        sys.exit("no GPU: this baseline needs CUDA")
    if args.attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        sys.exit("--attn flash_attention_2 needs the flash_attn package, which is not installed")

    gpu = torch.cuda.get_device_name()
    result = dict(config=args.config, seq_len=args.seq_len, steps=args.steps, warmup_steps=args.warmup_steps,
                  loss_chunk=args.loss_chunk, attn=args.attn, gpu=gpu, torch=torch.__version__,
                  transformers=transformers.__version__, step_s=[], losses=[], oom=False)
    code = 0
    try:
        train(args, result)
        med = statistics.median(result["step_s"])
        result.update(median_s=med, tokens_per_s=args.seq_len / med)
    except torch.cuda.OutOfMemoryError as e:
        result["oom"], result["error"], code = True, (str(e).splitlines() or [""])[0], 3
    result.update(peak_alloc_gib=torch.cuda.max_memory_allocated() / GIB,
                  peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
    mem = f"peak {result['peak_alloc_gib']:.1f} GiB allocated, {result['peak_reserved_gib']:.1f} GiB reserved"
    head = f"torch {torch.__version__} {args.config} seq {args.seq_len} {args.attn} on {gpu}"
    if code:
        print(f"OUT OF MEMORY: {head} after {len(result['losses'])} step(s); {mem}: {result['error']}")
    else:
        print(f"{head}: median step {result['median_s']:.3f} s over {args.steps}, "
              f"{result['tokens_per_s']:.0f} tokens/s, {mem}, loss {result['losses'][0]:.3f} -> "
              f"{result['losses'][-1]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    sys.exit(code)


if __name__ == "__main__":
    main()
