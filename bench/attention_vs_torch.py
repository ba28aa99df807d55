"""PyTorch SDPA (flash and cuDNN backends) on the shapes of bench/attention.cu, same GPU, same
FLOP convention: forward 4*S*S*d*H/2 (causal), backward 2.5x forward. Median of CUDA-event
timings after warm-up; forward and backward alternate, as in bench/attention.cu (and training),
so both benches time each kernel at the clocks it gets right after the other one.

    python3 bench/attention_vs_torch.py [--seqs 8192,16384,65536,131072] [--shapes 3B,8B] [--reps 10] [--separate] [--json FILE]

Shapes as bench/attention.cu's: 3B (24 query / 8 KV heads), 8B (32 / 8), and 3B-U8, 8B-U8 (their
heads on one of eight Ulysses ranks: 3 / 1, 4 / 1).
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


SHAPES = {"3B": ("3B 24/8", 24, 8), "8B": ("8B 32/8", 32, 8), "3B-U8": ("3B-U8 3/1", 3, 1), "8B-U8": ("8B-U8 4/1", 4, 1)}


def tokens(text):
    """8192, 8K (x 1024) or 1M (x 1024^2), as the C++ benches take them."""
    mult = {"K": 1024, "M": 1024 * 1024}.get(text[-1:].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def time_one(fn):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def time_pair(fwd, bwd, reps, separate, warmup=2):
    """Median ms of fwd and of bwd, called alternately after `warmup` pairs (separate: all the
    forwards, then all the backwards, each after `warmup` calls of its own)."""
    if separate:
        return tuple(statistics.median([time_one(fn) for _ in range(warmup + reps)][warmup:]) for fn in (fwd, bwd))
    tf, tb = [], []
    for r in range(warmup + reps):
        f, b = time_one(fwd), time_one(bwd)
        if r >= warmup:
            tf.append(f), tb.append(b)
    return statistics.median(tf), statistics.median(tb)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="8192,16384,65536,131072")
    ap.add_argument("--shapes", default="3B,8B", help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default="")
    ap.add_argument("--separate", action="store_true", help="time the forwards, then the backwards (not alternating)")
    args = ap.parse_args()
    unknown = [k for k in args.shapes.split(",") if k not in SHAPES]
    if unknown:
        ap.error(f"--shapes takes a list of {', '.join(SHAPES)}, got {unknown[0]!r}")
    rows = []
    print(f"PyTorch {torch.__version__} SDPA on {torch.cuda.get_device_name()}, bf16, causal, head dim 128")
    print(f"{'backend':8} {'shape':10} {'seq':>8} {'fwd ms':>9} {'fwd TF/s':>9} {'bwd ms':>9} {'bwd TF/s':>9}")
    for name, hq, hkv in (SHAPES[k] for k in args.shapes.split(",")):
        for S in (tokens(s) for s in args.seqs.split(",")):
            d = 128
            q = torch.randn(1, hq, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, hkv, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(1, hkv, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            flops = 4 * S * S * d * hq / 2
            for backend_name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel(backend):
                        # GQA by repeating K/V heads (what the flash backend needs; cuDNN takes enable_gqa).
                        kk = k.repeat_interleave(hq // hkv, dim=1) if backend_name == "flash" else k
                        vv = v.repeat_interleave(hq // hkv, dim=1) if backend_name == "flash" else v
                        kw = {} if backend_name == "flash" else {"enable_gqa": True}
                        out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, **kw)
                        g = torch.randn_like(out)
                        fwd, bwd = time_pair(lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=True, **kw),
                                             lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True), args.reps,
                                             args.separate)
                except Exception as e:  # a backend that refuses the shape
                    print(f"{backend_name:8} {name:10} {S:8}  unavailable: {str(e).splitlines()[0][:60]}")
                    continue
                r = dict(backend=backend_name, shape=name, seq=S, timing="separate" if args.separate else "alternating", fwd_ms=fwd, fwd_tflops=flops / fwd / 1e9,
                         bwd_ms=bwd, bwd_tflops=2.5 * flops / bwd / 1e9, gpu=torch.cuda.get_device_name())
                rows.append(r)
                print(f"{backend_name:8} {name:10} {S:8} {fwd:9.3f} {r['fwd_tflops']:9.1f} {bwd:9.3f} {r['bwd_tflops']:9.1f}")
            del q, k, v
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
