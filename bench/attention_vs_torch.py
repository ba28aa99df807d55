"""PyTorch SDPA (flash and cuDNN backends) on the shapes of bench/attention.cu, same GPU, same
FLOP convention: forward 4*S*S*d*H/2 (causal), backward 2.5x forward. Median of CUDA-event
timings after warm-up; forward and backward alternate, as in bench/attention.cu (and training),
so both benches time each kernel at the clocks it gets right after the other one.

    python3 bench/attention_vs_torch.py [--seqs 8192,16384,65536,131072] [--shapes 3B,8B] [--reps 10] [--separate] [--docs LIST [--flex-only]] [--json FILE]

Shapes as bench/attention.cu's: 3B (24 query / 8 KV heads), 8B (32 / 8), and 3B-U8, 8B-U8 (their
heads on one of eight Ulysses ranks: 3 / 1, 4 / 1).

--docs LIST (e.g. 4K,16K,1K,32K,8K,2K): packed documents, as bench/attention.cu --docs builds
them: the sequence is documents of these lengths, repeating, the last cut off at S. For every
shape and length it adds two FlexAttention rows (torch.compile'd flex_attention with a block
mask) to the SDPA ones: "flex-documents", a token attending only to earlier tokens of its own
document, at TFLOP/s over the pairs the documents allow (a document of n tokens counts n^2/2, as
causal counts S^2/2: the causal FLOPs times pair_share); and "flex-causal", the same tokens as one
causal sequence, with how many times the documents' time it takes. Without FlexAttention in this
PyTorch those rows are skipped, with a line saying so. --flex-only leaves out the SDPA rows (at 1M
they take minutes).
"""
import argparse
import json
import statistics

import flex_blocks
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError as e:  # an older PyTorch: the SDPA rows only
    create_block_mask = flex_attention = None
    FLEX_MISSING = str(e)


CHECK_TOKENS = 128 * 1024  # block masks up to this length are checked against create_block_mask
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


def causal_mask(b, h, q_idx, kv_idx):
    """FlexAttention mask_mod: a query sees itself and the keys before it."""
    return q_idx >= kv_idx


def document_mask(doc_ids):
    """FlexAttention mask_mod: causal, and within the query's own document. doc_ids is the
    per-token document number, an int tensor on the GPU (indexed inside the compiled kernel)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[q_idx] == doc_ids[kv_idx])
    return mask_mod


def block_mask(docs, S, mask_mod):
    """The BlockMask for these documents on S x S, made once per (shape, S, docs), outside the
    timing: from the documents' lengths (bench/flex_blocks.py), since create_block_mask evaluates
    mask_mod on all S x S pairs (10^12 at 1M). One mask for the batch and every head, per 128 x 128
    block. Up to CHECK_TOKENS it is checked against create_block_mask (compiled: run eagerly that
    materializes the [S, S] booleans): the same partial and full blocks, or the bench stops."""
    mask = flex_blocks.block_mask(docs, S, mask_mod)
    if S <= CHECK_TOKENS:
        ref = torch.compile(create_block_mask)(mask_mod, B=None, H=None, Q_LEN=S, KV_LEN=S, device="cuda")
        for what in ("kv_num_blocks", "full_kv_num_blocks"):
            if not torch.equal(getattr(mask, what).flatten(), getattr(ref, what).flatten()):
                raise SystemExit(f"bench/flex_blocks.py: {what} differs from create_block_mask's at S = {S}")
        if not torch.equal(mask.to_dense(), ref.to_dense()):
            raise SystemExit(f"bench/flex_blocks.py: the blocks differ from create_block_mask's at S = {S}")
    return mask


def sdpa_rows(name, S, q, k, v, args, width):
    """PyTorch SDPA, flash and cuDNN backends, causal: one table row each (its dict, for --json)."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[3]
    flops = 4 * S * S * d * hq / 2
    rows = []
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
            print(f"{backend_name:{width}} {name:10} {S:8}  unavailable: {str(e).splitlines()[0][:60]}")
            continue
        r = dict(backend=backend_name, shape=name, seq=S, timing="separate" if args.separate else "alternating", fwd_ms=fwd, fwd_tflops=flops / fwd / 1e9,
                 bwd_ms=bwd, bwd_tflops=2.5 * flops / bwd / 1e9, gpu=torch.cuda.get_device_name())
        rows.append(r)
        print(f"{backend_name:{width}} {name:10} {S:8} {fwd:9.3f} {r['fwd_tflops']:9.1f} {bwd:9.3f} {r['bwd_tflops']:9.1f}")
    return rows


def time_flex(flex, q, k, v, mask, args):
    """Median ms of FlexAttention's forward and backward with this block mask, timed as the SDPA
    rows are: the forward re-run each time (building its graph, as in training), the backward
    through one forward's graph, kept (retain_graph), alternating unless --separate. The first
    calls (warm-up) compile the kernels."""
    out = flex(q, k, v, block_mask=mask, enable_gqa=True)
    g = torch.randn_like(out)
    return time_pair(lambda: flex(q, k, v, block_mask=mask, enable_gqa=True),
                     lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True), args.reps, args.separate)


def flex_rows(name, S, q, k, v, lengths, args, width):
    """FlexAttention on the documents of `lengths` (flex-documents), then on the same tokens as one
    causal sequence (flex-causal): one table row each (its dict, for --json)."""
    if flex_attention is None:  # said once, under the header
        return []
    # A fresh compile cache for each shape and length: each (shape, S, mask) is a compile of its
    # own, and past dynamo's recompile limit a call falls back to eager FlexAttention, which builds
    # the whole S x S score matrix.
    torch._dynamo.reset()
    flex = torch.compile(flex_attention)
    hq, d = q.shape[1], q.shape[3]
    causal_flops = 4 * S * S * d * hq / 2
    docs = flex_blocks.document_lengths(lengths, S)
    doc_ids = torch.repeat_interleave(torch.arange(len(docs), dtype=torch.int32),
                                      torch.tensor(docs)).to("cuda")  # per token, its document's number
    rows, doc_times = [], None
    for kernels, mask_mod, blocks, share in (("flex-documents", document_mask(doc_ids), docs, flex_blocks.pair_share(docs, S)),
                                             ("flex-causal", causal_mask, [S], 1.0)):
        n_docs = len(blocks)
        try:
            fwd, bwd = time_flex(flex, q, k, v, block_mask(blocks, S, mask_mod), args)
        except Exception as e:  # a compile or launch that fails: say so, and go on
            print(f"{kernels:{width}} {name:10} {S:8}  unavailable: {str(e).splitlines()[0][:60]}")
            continue
        flops = causal_flops * share
        r = dict(kernels=kernels, shape=name, seq=S, timing="separate" if args.separate else "alternating",
                 fwd_ms=fwd, fwd_tflops=flops / fwd / 1e9, bwd_ms=bwd, bwd_tflops=2.5 * flops / bwd / 1e9,
                 documents=n_docs, pair_share=share, gpu=torch.cuda.get_device_name())
        rows.append(r)
        if kernels == "flex-documents":
            note, doc_times = f"{n_docs} documents, pair share {share:.4f}", (fwd, bwd)
        else:
            note = (f"takes {fwd / doc_times[0]:.2f}x (fwd), {bwd / doc_times[1]:.2f}x (bwd) the documents' time"
                    if doc_times else "")
        print(f"{kernels:{width}} {name:10} {S:8} {fwd:9.3f} {r['fwd_tflops']:9.1f} {bwd:9.3f} {r['bwd_tflops']:9.1f}  {note}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="8192,16384,65536,131072")
    ap.add_argument("--shapes", default="3B,8B", help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default="")
    ap.add_argument("--separate", action="store_true", help="time the forwards, then the backwards (not alternating)")
    ap.add_argument("--flex-only", action="store_true", help="with --docs: the FlexAttention rows only")
    ap.add_argument("--docs", default="", help="packed documents of these lengths, repeating (e.g. 4K,16K,1K,32K,8K,2K): "
                    "adds FlexAttention rows, documents and causal")
    args = ap.parse_args()
    unknown = [k for k in args.shapes.split(",") if k not in SHAPES]
    if unknown:
        ap.error(f"--shapes takes a list of {', '.join(SHAPES)}, got {unknown[0]!r}")
    lengths = [tokens(s) for s in args.docs.split(",")] if args.docs else []
    if args.flex_only and not lengths:
        ap.error("--flex-only times FlexAttention on --docs: give --docs")
    if any(n <= 0 for n in lengths):
        ap.error(f"--docs takes positive lengths, got {args.docs!r}")
    width = 14 if lengths else 8  # the first column fits "flex-documents"
    rows = []
    print(f"PyTorch {torch.__version__} SDPA on {torch.cuda.get_device_name()}, bf16, causal, head dim 128")
    if lengths:
        print(f"FlexAttention (torch.compile) on documents of {args.docs} tokens, repeating: TF/s over the pairs "
              "they allow; flex-causal: the same tokens as one causal sequence")
        if flex_attention is None:
            print(f"FlexAttention unavailable in PyTorch {torch.__version__} ({FLEX_MISSING}): its rows are skipped")
    print(f"{'backend':{width}} {'shape':10} {'seq':>8} {'fwd ms':>9} {'fwd TF/s':>9} {'bwd ms':>9} {'bwd TF/s':>9}")
    for name, hq, hkv in (SHAPES[k] for k in args.shapes.split(",")):
        for S in (tokens(s) for s in args.seqs.split(",")):
            d = 128
            q = torch.randn(1, hq, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, hkv, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(1, hkv, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            if not args.flex_only:
                rows += sdpa_rows(name, S, q, k, v, args, width)
            if lengths:
                rows += flex_rows(name, S, q, k, v, lengths, args, width)
            del q, k, v
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
