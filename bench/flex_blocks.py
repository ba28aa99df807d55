#!/usr/bin/env python3
"""bench/flex_blocks.py - FlexAttention's block mask for packed documents, made from the
documents' lengths instead of by evaluating the mask on every pair.

torch's create_block_mask finds which 128 x 128 blocks a mask_mod touches by calling it on all S x S
pairs: at S = 1M that is 10^12 calls, and the bench of FlexAttention on documents did not get past
it in 150 s. The blocks follow from the boundaries directly, as our kernels find them
(kernels/documents.cuh, docs/attention.md). For query block i (rows 128 i .. 128 i + 127), let s0 be
the start of its first row's document and s1 that of its last row's:

    the blocks with an allowed pair are f = s0 // 128 .. i (a row r of a document that starts at s
    sees keys s .. r, and the rows' ranges join up to one range from s0 to the block's end);
    if s0 == s1 (every row in one document), the blocks from ceil(s0 / 128) to i - 1 are full
    (every pair allowed, no mask_mod needed); block f is partial when s0 is not on a block edge,
    and the diagonal block i is partial (causal);
    if the block holds the start of a later document, every block f .. i is partial: that
    document's rows see none of the keys before its start.

One document of S tokens is the causal mask. document_lengths() and pair_share() give a sequence's
documents and the share of causal's pairs they allow (bench/throughput.py uses them too). block_rows() returns each query block's partial
blocks as an arithmetic run (first, step, count) and its full blocks as a range (first, count);
block_mask() turns them into torch's BlockMask.from_kv_blocks on the GPU. The pure-Python part
is checked against a pair-by-pair classification (`python3 bench/flex_blocks.py --check`, run by
test_cli); bench/attention_vs_torch.py checks block_mask() against create_block_mask at the
lengths where that finishes.
"""
import bisect
import sys

BLOCK = 128


def document_lengths(lengths, S):
    """The documents of an S-token sequence: `lengths` repeating, the last one cut off at S (as
    bench/attention.cu's --docs)."""
    docs, at = [], 0
    while at < S:
        n = min(lengths[len(docs) % len(lengths)], S - at)
        docs.append(n)
        at += n
    return docs


def pair_share(docs, S):
    """Of causal's S^2/2 pairs, the share the documents allow (n^2/2 for a document of n)."""
    return sum(n * n / 2 for n in docs) / (S * S / 2)


def document_starts(docs):
    """Each document's first token, from the documents' lengths."""
    starts, at = [], 0
    for n in docs:
        starts.append(at)
        at += n
    return starts


def block_rows(docs, S, block=BLOCK):
    """For each query block: (partial first, partial step, partial count, full first, full count)."""
    if S % block or sum(docs) != S or min(docs) <= 0:
        raise ValueError(f"documents {docs[:8]}... should be positive and add up to S = {S}, a multiple of {block}")
    starts = document_starts(docs)

    def start_of(row):
        return starts[bisect.bisect_right(starts, row) - 1]
    rows = []
    for i in range(S // block):
        s0, s1 = start_of(i * block), start_of(i * block + block - 1)
        f = s0 // block
        if s0 != s1:  # a document starts inside the block: every touched block is partial
            rows.append((f, 1, i - f + 1, 0, 0))
            continue
        full_first = -(-s0 // block)
        full_count = max(0, i - full_first)
        partial = (f, i - f, 2) if s0 % block and f < i else (i, 1, 1)
        rows.append(partial + (full_first if full_count else 0, full_count))
    return rows


def block_mask(docs, S, mask_mod, device="cuda"):
    """torch's BlockMask for these documents (B = H = 1: one mask for the batch and every head)."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask
    nb = S // BLOCK
    t = torch.tensor(block_rows(docs, S), dtype=torch.int32, device=device)
    col = torch.arange(nb, dtype=torch.int32, device=device)

    def dense(first, step, count):  # [1, 1, nb] counts and [1, 1, nb, nb] indices (past the count: ignored)
        idx = (first[:, None] + step[:, None] * col[None, :]).clamp_(0, nb - 1)
        return count[None, None].contiguous(), idx[None, None].contiguous()
    kv_num, kv_idx = dense(t[:, 0], t[:, 1], t[:, 2])
    full_num, full_idx = dense(t[:, 3], torch.ones_like(t[:, 3]), t[:, 4])
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(S, S))


def classify(docs, S, block):
    """Pair by pair: for each query block, {key block: 'partial' or 'full'} (blocks with no allowed pair left out)."""
    starts = document_starts(docs)
    doc_start = [starts[bisect.bisect_right(starts, r) - 1] for r in range(S)]
    out = []
    for i in range(S // block):
        row = {}
        for j in range(i + 1):
            allowed = sum(1 for r in range(i * block, i * block + block)
                          for k in range(j * block, j * block + block) if doc_start[r] <= k <= r)
            if allowed:
                row[j] = "full" if allowed == block * block else "partial"
        out.append(row)
    return out


def check():
    """block_rows against the pair-by-pair classification, on documents that stress the edges."""
    b = 16  # small blocks keep the pair-by-pair count quick; the logic does not depend on the size
    cases = {
        "one document (causal)": [256],
        "one-token documents": [1] * 40 + [216],
        "starts on block edges": [16, 32, 48, 160],
        "a block holding three starts": [5, 3, 9, 30, 209],
        "a document longer than many blocks, then short ones": [200, 1, 2, 3, 50],
        "the mix, scaled down": [4, 16, 1, 32, 8, 2] * 4 + [4],
    }
    failed = 0
    for name, docs in cases.items():
        S = sum(docs)
        want = classify(docs, S, b)
        got = []
        for pf, ps, pc, ff, fc in block_rows(docs, S, b):
            row = {pf + ps * n: "partial" for n in range(pc)}
            row.update({ff + n: "full" for n in range(fc)})
            got.append(row)
        if got != want:
            failed += 1
            bad = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
            print(f"{name}: query block {bad}: got {got[bad]}, pair by pair {want[bad]}")
        else:
            print(f"{name}: {S // b} query blocks agree")
    return failed


if __name__ == "__main__":
    if sys.argv[1:] != ["--check"]:
        sys.exit("usage: python3 bench/flex_blocks.py --check")
    sys.exit(1 if check() else 0)
