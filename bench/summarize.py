"""Summarize ./train --log files as one markdown table.

    python3 bench/summarize.py LABEL=FILE.jsonl [LABEL=FILE.jsonl ...]

Per run: median step time of the steps after the first, tokens/s, TFLOP/s, the planned memory
per category, the driver's view of device memory, and the host's peak RSS.
"""
import json
import statistics
import sys


def main():
    rows = []
    for arg in sys.argv[1:]:
        label, path = arg.rsplit("=", 1)
        try:
            recs = [json.loads(l) for l in open(path) if l.strip()]
        except FileNotFoundError:
            rows.append(f"| {label} | (no log: the run failed or was out of memory) |")
            continue
        setup = next((r for r in recs if r["type"] == "setup"), None)
        steps = [r for r in recs if r["type"] == "step"]
        if not steps:
            rows.append(f"| {label} | (no step) |")
            continue
        later = steps[1:] or steps
        t = statistics.median(r["step_time_s"] for r in later)
        tok = statistics.median(r["tokens_per_s"] for r in later)
        tf = statistics.median(r["tflops"] for r in later)
        mem = steps[-1]["memory_gib"]
        rows.append(
            f"| {label} | {t:.3f} | {tok:,.0f} | {tf:.1f} | {mem['model']:.2f} | {mem['attention']:.2f} | "
            f"{mem['other']:.2f} | {mem.get('comm', 0):.2f} | {steps[-1]['driver_gib']:.2f} | {mem.get('host_pinned', 0):.2f} | "
            f"{steps[-1]['host_gib']:.2f} | {steps[-1]['loss']:.4f} |")
    print("| run | step s | tokens/s | TFLOP/s | model GiB | attention GiB | other GiB | comm GiB | driver GiB | pinned GiB | host RSS GiB | last loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
