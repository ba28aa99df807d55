#!/usr/bin/env python3
"""bench/throughput.py - full-depth tokens/s per GPU from bench/throughput.sh's two-layer runs.

For each NAME it reads NAME.plan.txt (the full-depth plan: layers, and how many keep their
attention output), NAME.jsonl (the two-layer step's time) and NAME.timeline.json (each layer's
forward and backward compute). Layer 0 of the run reran attention in its backward; layer 1, the
last, kept its output. The full-depth step is then

    (two-layer step - both layers) + kept x layer 1 + (layers - kept) x layer 0

and tokens/s per GPU = tokens on the GPU / that. Writes NAME.throughput.json beside the logs
and prints a table beside the Untied Ulysses paper's figures (Llama3-8B, 8 x H100)."""
import argparse, json, os, re

PAPER = {"3M": "UPipe 166, Ulysses 162, FPDT 153", "4M": "UPipe 126, FPDT 120", "5M": "UPipe 98"}


def layer_times(timeline):
    t = {}
    for e in timeline:
        if e["stream"] == "compute":
            t[(e["what"], e["layer"])] = (e["end_ms"] - e["start_ms"]) / 1000.0
    return t


def summarize(d, name, commit):
    plan = open(os.path.join(d, name + ".plan.txt")).read()
    layers = int(re.search(r"^model \S+: (\d+) layers", plan, re.M).group(1))
    m = re.search(r"attention kept for (\d+) of (\d+) layers", plan)
    kept = int(m.group(1)) if m else 0  # without selective checkpointing every layer reruns
    tokens = int(re.search(r", (\d+) on each GPU", plan).group(1))
    steps = [json.loads(l) for l in open(os.path.join(d, name + ".jsonl")) if '"type": "step"' in l]
    run = json.loads(open(os.path.join(d, name + ".jsonl")).readline())
    step = steps[-1]["step_time_s"]
    t = layer_times(json.load(open(os.path.join(d, name + ".timeline.json"))))
    rerun = t[("forward", 0)] + t[("backward", 0)]
    keep = t[("forward", 1)] + t[("backward", 1)]
    fixed = step - rerun - keep
    full = fixed + kept * keep + (layers - kept) * rerun
    out = {"name": name, "commit": commit, "command": run.get("command", ""), "layers": layers,
           "layers_keeping_attention": kept, "tokens_per_gpu": tokens, "two_layer_step_s": step,
           "rerun_layer_s": {"forward": t[("forward", 0)], "backward": t[("backward", 0)]},
           "kept_layer_s": {"forward": t[("forward", 1)], "backward": t[("backward", 1)]},
           "outside_layers_s": fixed, "full_depth_step_s": full, "tokens_per_s_per_gpu": tokens / full,
           "method": "two layers at the real length, one of each kind; the rest of the step added once"}
    json.dump(out, open(os.path.join(d, name + ".throughput.json"), "w"), indent=1)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("names", nargs="+")
    a = ap.parse_args()
    print("| run | layers without rerun | layer, rerun / kept (s) | outside the layers (s) | full-depth step (s) "
          "| tokens/s per GPU | paper (tokens/s per GPU) |")
    print("|---|---|---|---|---|---|---|")
    for name in a.names:
        try:
            r = summarize(a.dir, name, a.commit)
        except (OSError, KeyError, AttributeError, ValueError, IndexError) as e:
            print(f"| {name} | (no result: {type(e).__name__}: {e}) | | | | | |")
            continue
        seq = name.rsplit("_", 1)[-1]
        rr, kk = r["rerun_layer_s"], r["kept_layer_s"]
        print(f"| {name} | {r['layers_keeping_attention']} of {r['layers']} | "
              f"{rr['forward'] + rr['backward']:.1f} / {kk['forward'] + kk['backward']:.1f} | "
              f"{r['outside_layers_s']:.1f} | {r['full_depth_step_s']:.0f} | **{r['tokens_per_s_per_gpu']:.0f}** | "
              f"{PAPER.get(seq, '') if name.startswith('llama3.1-8b') else ''} |")


if __name__ == "__main__":
    main()
