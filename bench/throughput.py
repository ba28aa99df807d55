#!/usr/bin/env python3
"""bench/throughput.py - full-depth tokens/s per GPU from bench/throughput.sh's two-layer runs.

For each NAME it reads NAME.plan.txt (the full-depth plan: layers, and how many keep their
attention output), NAME.jsonl (the two-layer step's time) and NAME.timeline.json (the step's
marks, timeline.cu). Layer 0 of the run reran attention in its backward; layer 1, the last, kept
its output. The full-depth step is then

    (two-layer step - both layers) + kept x layer 1 + (layers - kept) x layer 0

and tokens/s per GPU = tokens on the GPU / that. The kept layer of the run is the last, whose
attention output never leaves the device; a layer that keeps its output on the host fetches it
before its backward, exposed, so each of those (the plan's "on the host") adds one such fetch at
the rate the run's block-input fetches had. Where the plan rebuilds n block inputs instead of
keeping them on the host (offload.cu), each costs one more Wo and MLP forward of a layer and one
more attention output fetched; the two layers have no rebuilt input (a layer's input is rebuilt
from the layer below's, never the last's), so each is estimated from the kept layer's "mlp
forward" and that fetch, and added n times.

Each layer's time is also taken apart from the marks inside it: the attention kernels, the
all-to-alls (with their bytes), the MLP, and the rest (projections, norms, deltas, waits). Under
--sim-world an all-to-all is a local copy; on a node each would take about its bytes / the
NVLink all-to-all bandwidth (--nvlink-gbs, per GPU), so the node's step is estimated as the
emulated one with the copies' time replaced by that. FSDP's collectives and offload's copies run
on their own streams; their busy time per layer is printed beside the layer's compute.

What bounds it: the attention kernels' rates in the step (causal FLOPs: forward 2 S^2 d Hq/N per
layer, backward 2.5 times that), and the tokens/s the same step would reach with attention at
other rates (the issue's targets, 650 / 590 TFLOP/s, and the dense peak, 989), within the host
budget and with every layer's attention output kept.

Writes NAME.throughput.json beside the logs and prints three tables: tokens/s beside the Untied
Ulysses paper's figures (Llama3-8B, 8 x H100), where a layer's time goes, and the bounds."""
import argparse, json, os, re

PAPER = {"3M": "UPipe 166, Ulysses 162, FPDT 153", "4M": "UPipe 126, FPDT 120", "5M": "UPipe 98"}
LEAVES = ["attention forward", "attention backward", "all-to-all", "mlp forward", "mlp backward"]


def layer_parts(marks, direction, layer):
    """Seconds of each kind of mark inside one layer's forward or backward, and the other streams' busy time."""
    outer = [e for e in marks if e["stream"] == "compute" and e["what"] == direction and e["layer"] == layer]
    if len(outer) != 1:
        raise ValueError(f"{len(outer)} '{direction}' marks for layer {layer}")
    t0, t1 = outer[0]["start_ms"], outer[0]["end_ms"]
    parts = {"total": (t1 - t0) / 1000.0, "all-to-all bytes": 0}
    for e in marks:
        if e is outer[0]:
            continue
        if e["stream"] == "compute":  # this layer's marks inside its forward or backward
            if e["layer"] != layer or e["start_ms"] < t0 or e["end_ms"] > t1:
                continue
            secs = (e["end_ms"] - e["start_ms"]) / 1000.0
            key = e["what"]
        else:  # "copy", "fsdp": busy time while the layer ran, whichever layer the work is for
            secs = max(0.0, min(e["end_ms"], t1) - max(e["start_ms"], t0)) / 1000.0
            key = e["stream"]
        parts[key] = parts.get(key, 0.0) + secs
        if e["what"] == "all-to-all":
            parts["all-to-all bytes"] += e.get("bytes", 0)
    parts["other"] = parts["total"] - sum(parts.get(k, 0.0) for k in LEAVES)
    return parts


def summarize(d, name, commit, nvlink_gbs, out_dir):
    plan = open(os.path.join(d, name + ".plan.txt")).read()
    layers = int(re.search(r"^model \S+: (\d+) layers", plan, re.M).group(1))
    m = re.search(r"attention kept for (\d+) of (\d+) layers", plan)
    kept = int(m.group(1)) if m else 0  # without selective checkpointing every layer reruns
    m = re.search(r"\((\S+) on the host", plan)  # "0-25", "0" or "none"
    on_host = 0 if not m or m.group(1) == "none" else int(m.group(1).split("-")[-1]) + 1
    m = re.search(r"block inputs? rebuilt for layers? (?:1, 3, \.\., |1 and )?(\d+)", plan)
    rebuilt = (int(m.group(1)) + 1) // 2 if m else 0  # layers 1, 3, .., 2n - 1
    tokens = int(re.search(r", (\d+) on each GPU", plan).group(1))
    heads, head_dim = map(int, re.search(r"heads (\d+)/\d+ x (\d+)", plan).group(1, 2))
    gpus = int(re.search(r"^run: (\d+) GPU", plan, re.M).group(1))
    sequences, seq = map(int, re.search(r"step: \d+ tokens \((\d+) x (\d+) per sequence\)", plan).group(1, 2))
    if sequences != 1:
        raise ValueError(f"{sequences} sequences a step: the attention FLOP count here assumes one")
    simulated = "simulated" in re.search(r"^run: .*", plan, re.M).group(0)
    lines = [json.loads(l) for l in open(os.path.join(d, name + ".jsonl"))]
    steps = [l for l in lines if l.get("type") == "step"]
    run = lines[0]
    step = steps[-1]["step_time_s"]
    marks = json.load(open(os.path.join(d, name + ".timeline.json")))
    kinds = {"rerun": 0, "kept": 1}  # layer 0 reruns attention, layer 1 (the last) keeps it
    parts = {k: {dr: layer_parts(marks, dr, l) for dr in ("forward", "backward")} for k, l in kinds.items()}
    for k, reruns in (("rerun", True), ("kept", False)):  # the host budget made them so
        if (parts[k]["backward"].get("attention forward", 0) > 0) != reruns:
            raise ValueError(f"layer {kinds[k]} should {'' if reruns else 'not '}rerun attention in its backward")
    per_layer = {k: p["forward"]["total"] + p["backward"]["total"] for k, p in parts.items()}

    def a2a(k, what):  # seconds (or bytes) of one kind of mark in a layer of kind k, both directions
        return sum(parts[k][dr].get(what, 0) for dr in ("forward", "backward"))
    # The fetch of an attention output from the host (and its lse), at the block inputs' fetch rate.
    fetches = [e for e in marks if e["stream"] == "copy" and e["what"] == "x_in to device"]
    fetch_s_per_byte = min((e["end_ms"] - e["start_ms"]) / 1000.0 / e["bytes"] for e in fetches) if fetches else 0.0
    att_fetch_s = (tokens * heads * head_dim * 2 + heads // gpus * seq * 4) * fetch_s_per_byte
    fixed = step - per_layer["rerun"] - per_layer["kept"]
    # A rebuilt input: the layer below's Wo and MLP forward again, and its attention output fetched once more.
    rebuild_s = parts["kept"]["forward"].get("mlp forward", 0.0) + att_fetch_s
    outside = fixed + on_host * att_fetch_s + rebuilt * rebuild_s  # what does not scale with the layers' kinds
    count = {"kept": kept, "rerun": layers - kept}
    full = outside + sum(count[k] * per_layer[k] for k in kinds)

    # A node: the emulated all-to-alls (local copies) replaced by their bytes over NVLink. (On a
    # real node the marks time NVLink itself: nothing to replace.)
    node_extra = 0.0
    if simulated:
        node_extra = sum(count[k] * (a2a(k, "all-to-all bytes") / (nvlink_gbs * 1e9) - a2a(k, "all-to-all"))
                         for k in kinds)
    # What bounds it: the attention kernels at other rates, everything else as measured. One
    # layer's causal attention forward on this GPU is 2 S^2 d Hq/N FLOPs, its backward 2.5 times
    # that; a layer that reruns attention computes the forward twice.
    flops = 2.0 * seq * seq * head_dim * heads / gpus
    kept_fwd = parts["kept"]["forward"]["attention forward"]
    kept_bwd = parts["kept"]["backward"]["attention backward"]
    rates = {"forward": flops / kept_fwd / 1e12, "backward": 2.5 * flops / kept_bwd / 1e12}

    def tokens_per_s(fwd_tflops, bwd_tflops, kept_layers):
        att = {k: (flops / fwd_tflops + 2.5 * flops / bwd_tflops) / 1e12 for k in kinds}
        att["rerun"] += flops / fwd_tflops / 1e12
        rest = {k: per_layer[k] - (a2a(k, "attention forward") + a2a(k, "attention backward")) for k in kinds}
        n = {"kept": kept_layers, "rerun": layers - kept_layers}
        return tokens / (outside + sum(n[k] * (att[k] + rest[k]) for k in kinds))
    cases = {"measured rates": (rates["forward"], rates["backward"]), "650/590": (650, 590), "peak 989/989": (989, 989)}
    bounds = {"measured_attention_tflops": rates,
              "tokens_per_s_per_gpu_if_attention_at": {
                  label: {"host budget": tokens_per_s(f, b, kept), "every layer kept": tokens_per_s(f, b, layers)}
                  for label, (f, b) in cases.items()}}
    out = {"name": name, "commit": commit, "command": run.get("command", ""), "layers": layers,
           "layers_keeping_attention": kept, "attention_on_host": on_host, "attention_fetch_s": att_fetch_s,
           "inputs_rebuilt": rebuilt, "input_rebuild_s_estimate": rebuild_s,
           "tokens_per_gpu": tokens, "two_layer_step_s": step,
           "layer_s": parts, "outside_layers_s": fixed, "full_depth_step_s": full,
           "tokens_per_s_per_gpu": tokens / full, "bounds": bounds,
           "node_estimate": {"nvlink_all_to_all_gbs_per_gpu": nvlink_gbs if simulated else None,
                             "full_depth_step_s": full + node_extra, "tokens_per_s_per_gpu": tokens / (full + node_extra)},
           "method": "two layers at the real length, one that reruns attention and one that keeps it; "
                     "the full depth is the step outside the layers once plus each kind of layer times "
                     "how many the full-depth plan has, plus, for each layer that keeps its attention "
                     "output on the host, one exposed fetch of it before its backward (attention_fetch_s, "
                     "at the run's block-input fetch rate), which the two layers do not see: their kept "
                     "layer is the last, whose output stays on the device. A rebuilt block input is "
                     "estimated (input_rebuild_s_estimate): the kept layer's mlp forward plus one such fetch"}
    os.makedirs(out_dir, exist_ok=True)
    json.dump(out, open(os.path.join(out_dir, name + ".throughput.json"), "w"), indent=1)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--nvlink-gbs", type=float, default=330.0, help="all-to-all GB/s per GPU on the node")
    ap.add_argument("--out", help="where NAME.throughput.json goes (default: --dir)")
    ap.add_argument("names", nargs="+")
    a = ap.parse_args()
    results = []
    print("| run | layers without rerun | layer s, rerun / kept | outside the layers (s) | full-depth step (s) "
          "| tokens/s per GPU | on a node, NVLink all-to-alls | paper (tokens/s per GPU) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in a.names:
        try:
            r = summarize(a.dir, name, a.commit, a.nvlink_gbs, a.out or a.dir)
        except (OSError, KeyError, AttributeError, ValueError, IndexError) as e:
            print(f"| {name} | (no result: {type(e).__name__}: {e}) | | | | | | |")
            continue
        results.append(r)
        seq = name.rsplit("_", 1)[-1]
        L = r["layer_s"]
        per = {k: L[k]["forward"]["total"] + L[k]["backward"]["total"] for k in L}
        rebuilt = f" ({r['inputs_rebuilt']} inputs rebuilt, {r['input_rebuild_s_estimate']:.2f} s each)" if r["inputs_rebuilt"] else ""
        print(f"| {name} | {r['layers_keeping_attention']} of {r['layers']}{rebuilt} | {per['rerun']:.1f} / {per['kept']:.1f} | "
              f"{r['outside_layers_s']:.1f} | {r['full_depth_step_s']:.0f} | **{r['tokens_per_s_per_gpu']:.1f}** | "
              f"{r['node_estimate']['tokens_per_s_per_gpu']:.1f} | "
              f"{PAPER.get(seq, '') if name.startswith('llama3.1-8b') else ''} |")
    print()
    print("| run, layer | direction | total s | attention kernels | all-to-alls (GiB sent; s emulated) "
          "| MLP | other | offload copies busy | FSDP busy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for k in ("rerun", "kept"):
            for dr in ("forward", "backward"):
                p = r["layer_s"][k][dr]
                att = p.get("attention forward", 0) + p.get("attention backward", 0)
                mlp = p.get("mlp forward", 0) + p.get("mlp backward", 0)
                print(f"| {r['name']}, {k} | {dr} | {p['total']:.2f} | {att:.2f} ({100 * att / p['total']:.1f}%) | "
                      f"{p['all-to-all bytes'] / 2**30:.2f}; {p.get('all-to-all', 0):.3f} | {mlp:.2f} | "
                      f"{p['other']:.2f} | {p.get('copy', 0):.2f} | {p.get('fsdp', 0):.3f} |")
    print()
    print("| run | attention TFLOP/s in the step, forward / backward | tokens/s per GPU with attention at "
          "(forward / backward TFLOP/s): within the host budget; with every layer's attention kept |")
    print("|---|---|---|")
    for r in results:
        b = r["bounds"]
        rt = b["measured_attention_tflops"]
        cases = "; ".join(f"{k}: {v['host budget']:.1f}, {v['every layer kept']:.1f}"
                          for k, v in b["tokens_per_s_per_gpu_if_attention_at"].items())
        print(f"| {r['name']} | {rt['forward']:.0f} / {rt['backward']:.0f} | {cases} |")


if __name__ == "__main__":
    main()
