#!/usr/bin/env python3
"""Shared-memory wavefronts and warp instructions by SASS opcode, from profile_bwd.sh's source_sass.csv.

    python3 bench/ncu_wavefronts.py DIR/source_sass.csv --kernel 'dkdv_kernel<(bool)1>' --steps 16785408

Nsight Compute's source page counts, for every SASS instruction, the warp instructions executed
and the shared-memory wavefronts (cycles of the 128-byte shared-memory data pipe) its executions
took, with the ideal count beside it (no bank conflicts). This sums them by opcode (HGMMA by its
shape) over one kernel and divides by --steps, the kernel's loop iterations (for the dK/dV
kernels: the (key block, query tile) pairs they walk), to give a per-step budget to set beside
the cycles a step takes. The TMA unit's reads and writes of shared memory are not in these
counts.
"""
import argparse
import collections
import csv
import sys


def number(s):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def kernel_rows(path, kernel):
    """The rows of the first section whose "Kernel Name" line contains `kernel`."""
    section, found = [], False
    with open(path, newline="") as f:
        for line in f:
            if line.startswith('"Kernel Name"'):
                if found:
                    break
                found = kernel in line
                continue
            if found:
                section.append(line)
    if not section:
        sys.exit(f"ncu_wavefronts.py: no kernel matching '{kernel}' in {path}")
    rows = list(csv.reader(section))
    head = rows[0]
    need = ["Source", "Instructions Executed", "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal"]
    missing = [n for n in need if n not in head]
    if missing:
        sys.exit(f"ncu_wavefronts.py: {path} lacks the columns {missing} (profile with --set full)")
    ix = {n: head.index(n) for n in need}
    return [r for r in rows[1:] if len(r) == len(head)], ix


def opcode(source):
    words = [w for w in source.strip().split(" ") if w and not w.startswith("@")]
    if not words:
        return ""
    op = words[0]
    return op.split(".")[0] if not op.startswith("HGMMA") else ".".join(op.split(".")[:2])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="source_sass.csv from bench/profile_bwd.sh")
    ap.add_argument("--kernel", required=True, help="a substring of the kernel's name line")
    ap.add_argument("--steps", type=float, default=1.0, help="divide by this (loop iterations of the kernel)")
    a = ap.parse_args()
    rows, ix = kernel_rows(a.csv, a.kernel)
    waves, ideal, insts = collections.Counter(), collections.Counter(), collections.Counter()
    for r in rows:
        op = opcode(r[ix["Source"]])
        waves[op] += number(r[ix["L1 Wavefronts Shared"]])
        ideal[op] += number(r[ix["L1 Wavefronts Shared Ideal"]])
        insts[op] += number(r[ix["Instructions Executed"]])
    print(f"| opcode | shared-memory wavefronts per step | ideal | warp instructions per step |")
    print(f"|---|---|---|---|")
    for op, w in waves.most_common():
        if w == 0:
            break
        print(f"| {op} | {w / a.steps:.1f} | {ideal[op] / a.steps:.1f} | {insts[op] / a.steps:.2f} |")
    total, total_ideal = sum(waves.values()), sum(ideal.values())
    print(f"| all | {total / a.steps:.1f} | {total_ideal / a.steps:.1f} | {sum(insts.values()) / a.steps:.2f} |")


if __name__ == "__main__":
    main()
