#!/usr/bin/env python3
"""bench/learning_seeds.py - bench/learning_text.sh's seeds in one table: for each seed the
held-out loss after the 16K training, the 16K model read at 64K, and after the 64K training its
loss by position on the held-out kernel text and on the other source (Python's standard library):
the first bucket, the last, and whether the loss falls from one to the other; then the median and
the range over the seeds.

    python3 bench/learning_seeds.py DIR     # DIR holds seed1/, seed2/, ... (OUT of learning_text.sh)
"""
import glob
import json
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


def seed_row(d):
    pre, at64, trained, other = (last_eval(os.path.join(d, f)) for f in
                                 ("pre16k.jsonl", "ck16k_at_64k.jsonl", "64k_stage0.jsonl", "other_at_64k.jsonl"))
    return {"seed": os.path.basename(d)[4:], "16K": pre and pre[0], "16K model at 64K": at64 and at64[0],
            "64K": trained and trained[0],
            "64K first": trained and trained[1][0][1], "64K last": trained and trained[1][-1][1],
            "other first": other and other[1][0][1], "other last": other and other[1][-1][1]}


def main():
    rows = [seed_row(d) for d in sorted(glob.glob(os.path.join(sys.argv[1], "seed*")), key=lambda d: int(d[len(os.path.join(sys.argv[1], "seed")):]))]
    keys = ["16K", "16K model at 64K", "64K", "64K first", "64K last", "other first", "other last"]
    print("| seed | " + " | ".join(keys) + " | falls at 64K | falls on other |")
    print("|---" * (len(keys) + 3) + "|")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"
    for r in rows:
        falls = lambda a, b: "-" if r[a] is None or r[b] is None else ("yes" if r[b] < r[a] else "NO")
        print(f"| {r['seed']} | " + " | ".join(fmt(r[k]) for k in keys) +
              f" | {falls('64K first', '64K last')} | {falls('other first', 'other last')} |")
    for name, f in (("median", statistics.median), ("min", min), ("max", max)):
        vals = [[r[k] for r in rows if r[k] is not None] for k in keys]
        print(f"| {name} | " + " | ".join(fmt(f(v)) if v else "-" for v in vals) + " | | |")


if __name__ == "__main__":
    main()
