#!/usr/bin/env python3
"""bench/learning_seeds.py - bench/learning_text.sh's seeds in one table, the figures README's
real-text row gives: for each seed the held-out loss after the 16K training; after the 64K
training its loss at 1K-2K and at 32K-64K on the held-out kernel text and on the other source
(Python's standard library), and whether it falls there (32K-64K below both the first bucket and
1K-2K); the 16K model read at 64K, at 32K-64K; then the median and the range over the seeds.

    python3 bench/learning_seeds.py DIR     # DIR holds seed1/, seed2/, ... (OUT of learning_text.sh)

For bench/learning.sh's seeds (folders with pre4k.jsonl, the induction task) the table is the
training losses instead: the last at 4K, the first and last at 16K and at 64K under stage 0, the
last under the other stages where a seed ran them ("=" where bit for bit stage 0's), and whether
the seed ends below a guess that knows which tokens the first half holds (ln of half the length).
"""
import glob
import json
import math
import os
import statistics
import sys


def last_eval(path):
    """The last evaluation of a --log file: (mean loss, [(label, loss) by position]), or None."""
    if not os.path.exists(path):
        return None
    evals = [r for r in map(json.loads, open(path)) if r.get("type") == "eval"]
    if not evals:
        return None
    e = evals[-1]
    return e["loss"], [(p["label"], p["loss"]) for p in e["positions"]]


def bucket(evaluation, label):
    return evaluation and dict(evaluation[1])[label]


def falls(evaluation):
    """Whether the loss by position falls from the first bucket and from 1K-2K to 32K-64K."""
    if evaluation is None:
        return "-"
    by = dict(evaluation[1])
    return "yes" if by["32K-64K"] < min(evaluation[1][0][1], by["1K-2K"]) else "NO"


def seed_row(d):
    pre, at64, trained, other = (last_eval(os.path.join(d, f)) for f in
                                 ("pre16k.jsonl", "ck16k_at_64k.jsonl", "64k_stage0.jsonl", "other_at_64k.jsonl"))
    return {"seed": os.path.basename(d)[4:], "16K": pre and pre[0],
            "64K 1K-2K": bucket(trained, "1K-2K"), "64K 32K-64K": bucket(trained, "32K-64K"),
            "other 1K-2K": bucket(other, "1K-2K"), "other 32K-64K": bucket(other, "32K-64K"),
            "16K model at 64K, 32K-64K": bucket(at64, "32K-64K"),
            "falls at 64K": falls(trained), "falls on other": falls(other)}


def losses(path):
    """A --log file's training losses by step, and its sequence length; None if it is missing."""
    if not os.path.exists(path):
        return None
    records = list(map(json.loads, open(path)))
    return [r["loss"] for r in records if r.get("type") == "step"], records[0]["seq_len"]


def induction_table(dirs):
    print("| seed | 4K, last | 16K, first / last | 64K stage 0, first / last | 64K stages 3 / 4 / 5 / 6, last "
          "| below a guess at 64K |")
    print("|---" * 6 + "|")
    for d in dirs:
        runs = [losses(os.path.join(d, f"{n}.jsonl")) for n in ("pre4k", "pre16k", "64k_stage0")]
        if None in runs:  # a seed whose 16K or 64K run did not happen
            print(f"| {os.path.basename(d)[4:]} | {runs[0][0][-1]:.4f} | missing: see its logs | | | |")
            continue
        (pre, _), (mid, _), (base, length) = runs
        stages = []
        for k in (3, 4, 5, 6):
            run = losses(os.path.join(d, f"64k_stage{k}.jsonl"))
            stages.append("-" if run is None else "=" if run[0] == base else f"{run[0][-1]:.2f}")
        guess = math.log(length / 2)
        print(f"| {os.path.basename(d)[4:]} | {pre[-1]:.4f} | {mid[0]:.2f} / {mid[-1]:.2f} | {base[0]:.2f} / "
              f"{base[-1]:.2f} | {' / '.join(stages)} | {'yes' if base[-1] < guess else 'no'} ({guess:.2f}) |")


def main():
    dirs = sorted(glob.glob(os.path.join(sys.argv[1], "seed*")), key=lambda d: int(os.path.basename(d)[4:]))
    if dirs and all(os.path.exists(os.path.join(d, "pre4k.jsonl")) for d in dirs):
        return induction_table(dirs)
    rows = [seed_row(d) for d in dirs]
    keys = ["16K", "64K 1K-2K", "64K 32K-64K", "other 1K-2K", "other 32K-64K", "16K model at 64K, 32K-64K"]
    print("| seed | " + " | ".join(keys) + " | falls at 64K | falls on other |")
    print("|---" * (len(keys) + 3) + "|")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"
    for r in rows:
        print(f"| {r['seed']} | " + " | ".join(fmt(r[k]) for k in keys) + f" | {r['falls at 64K']} | {r['falls on other']} |")
    for name, f in (("median", statistics.median), ("min", min), ("max", max)):
        vals = [[r[k] for r in rows if r[k] is not None] for k in keys]
        print(f"| {name} | " + " | ".join(fmt(f(v)) if v else "-" for v in vals) + " | | |")


if __name__ == "__main__":
    main()
