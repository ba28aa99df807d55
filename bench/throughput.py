#!/usr/bin/env python3
"""bench/throughput.py - full-depth tokens/s per GPU from bench/throughput.sh's few-layer runs.

For each NAME it reads NAME.plan.txt (the full-depth plan), NAME.log (the short run's own plan),
NAME.jsonl (its step time) and NAME.trace.json (its marks, ./train --trace; NAME.timeline.json for the
runs committed before it). Both plans say, in
their "selective checkpointing" line, what each layer does with its attention output and block
input (train.cpp), so every layer is of one kind:

    host      its attention output kept on the host, fetched before its backward with its input
    rebuilt   the same, but its block input rebuilt from the layer below's (offload.cu)
    device    its attention output kept on the device (only its input is fetched)
    slot      the last layer: its output stays in the staging slot (only its input is fetched)
    rerun     its backward runs the attention forward again (plain --ckpt)

throughput.sh picks the short run's layers, host budget and --rebuild-inputs so that it has one
layer of each kind the full depth has (a rerun or device layer whose input is rebuilt, at most
one, is timed as its kind plus a rebuild). The full-depth step is then

    (short step - its layers) + sum over kinds of (layers of that kind) x (the run's layer of it)

and tokens/s per GPU = tokens on the GPU / that. A device layer is timed by the slot layer and the
other way round (the same work). A kind the run lacks is estimated, and the output says so
(estimated_kinds): a host layer as the slot layer plus one attention output fetched at the run's
block-input fetch rate; a rebuilt layer as its base kind plus the kept layer's mlp forward and
one such fetch. Runs older than the kinds (two layers: rerun, slot) go through the same path.

Each layer's time is also taken apart from the marks inside it: the attention kernels, the
all-to-alls (with their bytes), the MLP, and the rest (projections, norms, deltas, waits). Under
--sim-world an all-to-all is a local copy; on a node each would take about its bytes / the
NVLink all-to-all bandwidth (--nvlink-gbs, per GPU), so the node's step is estimated as the
emulated one with the copies' time replaced by that. Past one node (more GPUs than
--gpus-per-node), the share of each all-to-all that goes to the other nodes' GPUs crosses the
network at --cross-node-gbs per GPU, and the all-to-all takes the longer of its two parts. FSDP's collectives and offload's copies run
on their own streams; their busy time per layer is printed beside the layer's compute.

What bounds it: the attention kernels' rates in the step (causal FLOPs: forward 2 S^2 d Hq/N per
layer, backward 2.5 times that), and the tokens/s the same step would reach with attention at
other rates (the issue's targets, 650 / 590 TFLOP/s, and the dense peak, 989), within the host
budget and with every layer's attention output kept.

The GPU's SM clock and power in the forward and the backward layers: medians of NAME.gpu.csv
(nvidia-smi every 10 s), placed by the step record's end time and NAME.clockref (runs before
these were logged have none). This is the clock nvidia-smi reports; at the power cap the SMs
count about 8-10% fewer cycles per second (docs/results.md), so it compares machines, not cycles.

Writes NAME.throughput.json beside the logs and prints three tables: tokens/s beside the Untied
Ulysses paper's figures (Llama3-8B, 8 x H100), where a layer's time goes, and the bounds.

python3 bench/throughput.py --run-shape PLAN prints the short run a full-depth plan asks for:
its layer count, how many block inputs and attention outputs it keeps on the host."""
import argparse, datetime, json, os, re, statistics

import flex_blocks

# The Untied Ulysses paper's tokens/s per GPU: Llama3-8B on 8 H100s, Qwen3-32B on 16 (two nodes).
PAPER = {"llama3.1-8b": {"3M": "UPipe 166, Ulysses 162, FPDT 153", "4M": "UPipe 126, FPDT 120", "5M": "UPipe 98"},
         "qwen3-32b": {"1M": "UPipe 113.3, Ulysses 117.0, FPDT 95.9", "2M": "UPipe 59.6, Ulysses 60.0, FPDT 55.4",
                       "3M": "UPipe 40.4, FPDT 38.9 (Ulysses OOM)", "4M": "UPipe 30.0, FPDT 27.7", "5M": "UPipe OOM"}}
LEAVES = ["attention forward", "attention backward", "all-to-all", "wo and mlp forward", "wo and mlp backward",
          "input rebuild"]
# The marks' names before the Wo projection was named with the MLP in them (the committed runs).
OLD_NAMES = {"mlp forward": "wo and mlp forward", "mlp backward": "wo and mlp backward"}


EPS_MS = 1e-3  # a microsecond: far below any mark, far above the trace's rounding (ts and dur to the nanosecond)


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
            # A mark that ends with the layer may read a nanosecond past its end (ts + dur, each rounded).
            if e["layer"] != layer or e["start_ms"] < t0 - EPS_MS or e["end_ms"] > t1 + EPS_MS:
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


KINDS = ["host", "rebuilt", "device", "slot", "rerun", "device+rebuilt", "rerun+rebuilt"]


def layer_range(text):
    """'none' -> [], '3' -> [3], '0-25' -> [0, .., 25]."""
    if text == "none":
        return []
    a, _, b = text.partition("-")
    return list(range(int(a), int(b or a) + 1))


def layer_kinds(text):
    """Each layer's kind, from a plan's or run log's text (train.cpp's print_attention_plan)."""
    layers = int(re.search(r"^model \S+: (\d+) layers", text, re.M).group(1))
    m = re.search(r"attention kept for \d+ of \d+ layers \((\S+) on the host, (?:(\S+) on the device, )?"
                  r"\d+ in its slot\), rerun for (?:layers? )?([^;\s]+)(.*)", text)
    if not m:  # without --offload, selective checkpointing keeps every output on the device; --ckpt reruns all
        return ["device"] * (layers - 1) + ["slot"] if "--ckpt=selective" in text else ["rerun"] * layers
    kinds = ["slot"] * layers
    for kind, group in (("host", 1), ("device", 2), ("rerun", 3)):
        for l in layer_range(m.group(group) or "none"):
            kinds[l] = kind
    r = re.search(r"rebuilt for layers? (?:1, 3, \.\., |1 and )?(\d+)", m.group(4))
    for l in range(1, int(r.group(1)) + 1, 2) if r else []:
        kinds[l] = "rebuilt" if kinds[l] == "host" else kinds[l] + "+rebuilt"  # at most one, layer 2n - 1
    return kinds


def run_shape(full_kinds, run_rebuilt=True):
    """The short run for a full-depth plan: one layer of each kind it has, in the plan's order
    (host, rebuilt, rerun, slot; a device layer is timed by the slot layer, a rerun or device
    layer whose input is rebuilt by its kind plus a rebuild), and what its host budget must hold:
    the block inputs of every layer but the rebuilt, the attention outputs of the host and rebuilt
    layers. (A rebuilt layer is layer 1 or later, and the layers before it are host layers, as in
    the plan: its input is rebuilt from layer 0's.) Without run_rebuilt, a rebuilt layer is not run
    but estimated from the host layer (summarize): one layer less, for a run with a time limit."""
    bases = {k.split("+")[0] for k in full_kinds}  # a "rerun+rebuilt" layer is timed by a rerun layer
    need = [k for k in ("host", "rebuilt", "rerun") if k in bases and (run_rebuilt or k != "rebuilt")]
    # Plain --ckpt (stage 6) reruns every layer, the last too: two rerun layers, each a check on the other.
    shape = need + (["rerun"] if bases == {"rerun"} else ["slot"])
    inputs = sum(k != "rebuilt" for k in shape)
    outputs = sum(k in ("host", "rebuilt") for k in shape)
    return shape, inputs, outputs


def phase_clocks(d, name, marks, step_record):
    """Median SM clock (MHz) and power (W) of the samples in NAME.gpu.csv that fall inside the
    step's forward layers and inside its backward layers; None without the logs to place them."""
    ref_path, csv_path = os.path.join(d, name + ".clockref"), os.path.join(d, name + ".gpu.csv")
    if "end_unix_s" not in step_record or not os.path.exists(ref_path) or not os.path.exists(csv_path):
        return None

    def local_s(stamp):  # nvidia-smi's and date's local time, as seconds of a UTC clock
        day, time = stamp.split()
        t = datetime.datetime.strptime(day + " " + time[:15], "%Y/%m/%d %H:%M:%S.%f")
        return t.replace(tzinfo=datetime.timezone.utc).timestamp()
    day, time, unix = open(ref_path).read().split()
    offset = float(unix) - local_s(day + " " + time)  # local -> Unix seconds
    samples = []
    for line in open(csv_path).read().splitlines()[1:]:
        f = [x.strip() for x in line.split(",")]
        try:
            samples.append((local_s(f[0]) + offset, float(f[2].split()[0]), float(f[3].split()[0])))
        except (ValueError, IndexError):
            continue
    last_ms = max(e["end_ms"] for e in marks)  # the step's end, in the timeline's time

    def unix(ms):
        return step_record["end_unix_s"] - (last_ms - ms) / 1000.0
    out = {}
    for direction in ("forward", "backward"):
        outer = [e for e in marks if e["stream"] == "compute" and e["what"] == direction]
        t0, t1 = unix(min(e["start_ms"] for e in outer)), unix(max(e["end_ms"] for e in outer))
        inside = [s for s in samples if t0 <= s[0] <= t1]
        if inside:
            out[direction] = {"samples": len(inside), "median_sm_mhz": statistics.median(s[1] for s in inside),
                              "median_power_w": statistics.median(s[2] for s in inside)}
    return out or None


def read_marks(d, name):
    """The marks of a run's last step: NAME.trace.json (./train --trace, Chrome's trace-event
    format: each complete event carries its stream as "cat" and what, layer or unit and bytes in
    "args"), or NAME.timeline.json (--timeline, the runs committed before --trace), as
    {stream, what, layer, start_ms, end_ms, bytes}."""
    trace = os.path.join(d, name + ".trace.json")
    if not os.path.exists(trace):
        marks = json.load(open(os.path.join(d, name + ".timeline.json")))
        for e in marks:
            e["what"] = OLD_NAMES.get(e["what"], e["what"])
        return marks
    marks = []
    for e in json.load(open(trace))["traceEvents"]:
        if e.get("ph") != "X":
            continue
        a = e["args"]
        marks.append({"stream": e["cat"], "what": OLD_NAMES.get(a["what"], a["what"]), "layer": a.get("layer", a.get("unit")),
                      "start_ms": e["ts"] / 1000.0, "end_ms": (e["ts"] + e["dur"]) / 1000.0, "bytes": a["bytes"]})
    return marks


def pair_share(command, seq):
    """Of causal attention's pairs, the share a run's attention computes: 1 without --doc-mask;
    with --doc-lengths L,L (documents of L tokens from the window's start, the last cut off) the
    sum of n^2 over its documents / seq^2; None for documents the logs do not give (drawn
    lengths, --data's files)."""
    if "--doc-mask" not in command.split():
        return 1.0
    m = re.search(r"--doc-lengths (\d+[KM]?),(\d+[KM]?)(?:\s|$)", command)
    if not m or m.group(1) != m.group(2):
        return None
    n = int(m.group(1).rstrip("KM")) * {"K": 1024, "M": 1024 * 1024}.get(m.group(1)[-1], 1)
    return flex_blocks.pair_share(flex_blocks.document_lengths([n], seq), seq)


def paper(name):
    """The paper's figures for a run NAME (config_length, e.g. qwen3-32b_3M), or ''."""
    config, seq = name.rsplit("_", 1)
    return PAPER.get(config, {}).get(seq, "")


def summarize(d, name, commit, nvlink_gbs, out_dir, gpus_per_node=8, cross_node_gbs=50.0):
    plan = open(os.path.join(d, name + ".plan.txt")).read()
    refused = re.findall(r"^(host|cap) .*: OOM$", plan, re.M)
    if refused:
        raise ValueError(f"the full-depth plan does not fit ({', '.join(refused)} memory): no figure")
    full_kinds = layer_kinds(plan)
    layers = len(full_kinds)
    count = {k: full_kinds.count(k) for k in KINDS}
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
    marks = read_marks(d, name)
    run_kinds = layer_kinds(open(os.path.join(d, name + ".log")).read())

    # The run's layers, the first of each kind timing that kind; the rest of the step is fixed.
    run_parts = [{dr: layer_parts(marks, dr, l) for dr in ("forward", "backward")} for l in range(len(run_kinds))]
    parts = {}
    for l, k in enumerate(run_kinds):
        parts.setdefault(k, run_parts[l])
        if (run_parts[l]["backward"].get("attention forward", 0) > 0) != k.startswith("rerun"):
            raise ValueError(f"layer {l} ({k}) should {'' if k.startswith('rerun') else 'not '}rerun attention in its backward")
    fixed = step - sum(p[dr]["total"] for p in run_parts for dr in ("forward", "backward"))

    # The fetch of an attention output from the host (and its lse), at the block inputs' fetch rate:
    # what a host layer adds to a slot layer, where the run has no host layer.
    fetches = [e for e in marks if e["stream"] == "copy" and e["what"] == "x_in to device"]
    fetch_s_per_byte = min((e["end_ms"] - e["start_ms"]) / 1000.0 / e["bytes"] for e in fetches) if fetches else 0.0
    att_fetch_s = (tokens * heads * head_dim * 2 + heads // gpus * seq * 4) * fetch_s_per_byte
    extra = {k: 0.0 for k in KINDS}  # seconds added to the timed layer a kind is taken from
    source = {}  # kind -> the run's kind it is timed by
    estimated = []
    fetches_input_only = next((k for k in ("slot", "device") if k in parts), None)  # the same work
    for k in KINDS:
        if count[k] == 0 and k not in parts:
            continue
        if k in parts:
            source[k] = k
        elif k in ("device", "slot") and fetches_input_only:
            source[k] = fetches_input_only
        elif k == "host" and fetches_input_only:
            source[k] = fetches_input_only
            extra[k] = att_fetch_s
            estimated.append("host: the slot layer plus one attention output fetched")
        elif k == "rebuilt" and ("host" in parts or fetches_input_only):
            source[k] = "host" if "host" in parts else fetches_input_only
            kept_mlp = parts[source[k]]["forward"].get("wo and mlp forward", 0.0)
            extra[k] = (att_fetch_s if source[k] != "host" else 0.0) + kept_mlp + att_fetch_s
            estimated.append("rebuilt: a kept layer plus its mlp forward and one attention output fetched")
        elif k.endswith("+rebuilt") and k.split("+")[0] in source:
            # Layer 2n - 1 when it does not keep its attention output on the host: its base kind
            # plus the rebuild (as the run's rebuilt layer took it, or its MLP forward) and the
            # layer below's attention output fetched (its input comes in place of this one's).
            base = k.split("+")[0]
            source[k] = source[base]
            rebuild = parts["rebuilt"]["backward"].get("input rebuild", 0.0) if "rebuilt" in parts else \
                parts[source[base]]["forward"].get("wo and mlp forward", 0.0)
            extra[k] = extra[base] + rebuild + att_fetch_s
            estimated.append(f"{k}: the {base} layer plus a rebuild and one attention output fetched")
        else:
            raise ValueError(f"the run has no layer to time the plan's {count[k]} '{k}' layers by")
    per_layer = {k: parts[s]["forward"]["total"] + parts[s]["backward"]["total"] + extra[k] for k, s in source.items()}
    full = fixed + sum(count[k] * per_layer[k] for k in source)

    def a2a(k, what):  # seconds (or bytes) of one kind of mark in a layer of kind k, both directions
        return sum(parts[source[k]][dr].get(what, 0) for dr in ("forward", "backward"))
    # A node: the emulated all-to-alls (local copies) replaced by their bytes over NVLink. (On a
    # real node the marks time NVLink itself: nothing to replace.)
    # Past one node, the share bound for the other nodes crosses the network: each GPU sends the
    # same bytes to every other, so that share is (GPUs on other nodes) / GPUs.
    across = max(0, gpus - gpus_per_node) / gpus

    def a2a_s(nbytes):
        return max(nbytes * (1 - across) / (nvlink_gbs * 1e9), nbytes * across / (cross_node_gbs * 1e9))
    node_extra = 0.0
    if simulated:
        node_extra = sum(count[k] * (a2a_s(a2a(k, "all-to-all bytes")) - a2a(k, "all-to-all")) for k in source)
    # What bounds it: the attention kernels at other rates, everything else as measured. One
    # layer's causal attention forward on this GPU is 2 S^2 d Hq/N FLOPs, its backward 2.5 times
    # that; a layer that reruns attention computes the forward twice. The rates are those of the
    # run's layers that do not rerun.
    # With --doc-mask the kernels walk only the documents' pairs: the FLOPs are the causal ones
    # times the share of pairs the documents allow (None where the logs do not say the documents).
    share = pair_share(run.get("command", ""), seq)
    flops = 2.0 * seq * seq * head_dim * heads / gpus * (share or 1.0)
    timed = [k for k in parts if not k.startswith("rerun")] or list(parts)
    fwd_s = sum(parts[k]["forward"]["attention forward"] for k in timed)
    bwd_s = sum(parts[k]["backward"]["attention backward"] for k in timed)
    rates = {"forward": len(timed) * flops / fwd_s / 1e12, "backward": len(timed) * 2.5 * flops / bwd_s / 1e12}
    if share is None:
        rates = {"forward": None, "backward": None}

    def tokens_per_s(fwd_tflops, bwd_tflops, n):
        total = fixed
        for k, c in n.items():
            att = (flops / fwd_tflops + 2.5 * flops / bwd_tflops) / 1e12 + (flops / fwd_tflops / 1e12 if k.startswith("rerun") else 0)
            total += c * (per_layer[k] - (a2a(k, "attention forward") + a2a(k, "attention backward")) + att)
        return tokens / total
    plan_n = {k: count[k] for k in source if count[k]}
    all_kept = dict(plan_n)
    reruns = all_kept.pop("rerun", 0)
    if reruns:  # the rerun layers as host layers (more host memory)
        all_kept["host"] = all_kept.get("host", 0) + reruns
    if all_kept.get("rerun+rebuilt") and "rebuilt" in per_layer:
        all_kept["rebuilt"] = all_kept.get("rebuilt", 0) + all_kept.pop("rerun+rebuilt")
    cases = {"measured rates": (rates["forward"], rates["backward"]), "650/590": (650, 590), "peak 989/989": (989, 989)}
    bounds = {"measured_attention_tflops": rates, "pair_share": share,
              "tokens_per_s_per_gpu_if_attention_at": {
                  label: {"host budget": tokens_per_s(f, b, plan_n),
                          "every layer kept": tokens_per_s(f, b, all_kept) if "host" in per_layer else None}
                  for label, (f, b) in cases.items() if f is not None}}
    # Against the paper, like for like (UPipe reruns every attention, as plain --ckpt does): the
    # layer its tokens/s allows, with the step outside the layers as ours, and the average rate over
    # the forward, the rerun and the backward (4.5 forwards of FLOPs) that our attention kernels
    # would need to fit our layer into it, everything else in the layer as measured.
    upipe = re.search(r"UPipe ([\d.]+)", paper(name))
    against = None
    if upipe and share == 1.0 and {k for k in KINDS if count[k]} == {"rerun"}:
        layer, att = per_layer["rerun"], a2a("rerun", "attention forward") + a2a("rerun", "attention backward")
        allowed = (tokens / float(upipe.group(1)) - fixed) / layers
        against = {"paper_tokens_per_s_per_gpu": float(upipe.group(1)), "paper_layer_s": allowed, "layer_s": layer,
                   "attention_s": att, "rest_s": layer - att, "attention_tflops": 4.5 * flops / att / 1e12,
                   "attention_tflops_needed": 4.5 * flops / (allowed - (layer - att)) / 1e12 if allowed > layer - att else None}
    out = {"name": name, "commit": commit, "command": run.get("command", ""), "layers": layers,
           "layers_by_kind": {k: count[k] for k in KINDS if count[k]},
           "layers_keeping_attention": layers - count["rerun"] - count["rerun+rebuilt"],
           "attention_on_host": count["host"] + count["rebuilt"],
           "inputs_rebuilt": sum(n for k, n in count.items() if "rebuilt" in k), "run_layers": run_kinds, "run_step_s": step,
           "layer_s": parts, "layer_total_s": per_layer, "timed_by": source, "estimated_kinds": estimated,
           "attention_fetch_s": att_fetch_s, "outside_layers_s": fixed, "full_depth_step_s": full,
           "tokens_per_s_per_gpu": tokens / full, "bounds": bounds, "against_paper": against,
           "gpu_clock": phase_clocks(d, name, marks, steps[-1]),
           "node_estimate": {"nvlink_all_to_all_gbs_per_gpu": nvlink_gbs if simulated else None,
                             "gpus_per_node": gpus_per_node, "share_across_nodes": across,
                             "cross_node_gbs_per_gpu": cross_node_gbs if simulated and across else None,
                             "full_depth_step_s": full + node_extra, "tokens_per_s_per_gpu": tokens / (full + node_extra)},
           "method": "one step of a few layers at the real length, one layer of each kind the full-depth plan has "
                     "(host, rebuilt, rerun, slot; device layers timed by the slot layer); the full depth is the "
                     "step outside the layers once plus each kind of layer times how many the full-depth plan has. "
                     "Kinds the run lacks are estimated and listed in estimated_kinds"}
    os.makedirs(out_dir, exist_ok=True)
    json.dump(out, open(os.path.join(out_dir, name + ".throughput.json"), "w"), indent=1)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir")
    ap.add_argument("--commit", default="")
    ap.add_argument("--nvlink-gbs", type=float, default=330.0, help="all-to-all GB/s per GPU on the node")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--cross-node-gbs", type=float, default=50.0,
                    help="GB/s per GPU between nodes (400 Gb/s links), for runs of more GPUs than a node")
    ap.add_argument("--out", help="where NAME.throughput.json goes (default: --dir)")
    ap.add_argument("--run-shape", metavar="PLAN", help="print the short run for a full-depth plan: "
                    "layers, block inputs and attention outputs on the host, the kinds (comma-separated)")
    ap.add_argument("--no-rebuilt", action="store_true", help="with --run-shape: no rebuilt layer in the run; "
                    "its kind is estimated from the host layer (bench/throughput.sh's RUN_REBUILT=0)")
    ap.add_argument("names", nargs="*")
    a = ap.parse_args()
    if a.run_shape:
        shape, inputs, outputs = run_shape(layer_kinds(open(a.run_shape).read()), not a.no_rebuilt)
        print(len(shape), inputs, outputs, ",".join(shape))
        return
    if not a.dir or not a.names:
        ap.error("--dir and at least one NAME, or --run-shape PLAN")
    results = []
    print("| run | layers by kind | one layer by kind (s) | outside the layers (s) | full-depth step (s) "
          "| tokens/s per GPU | on the nodes: all-to-alls over NVLink, and across nodes at "
          f"{a.cross_node_gbs:g} GB/s per GPU | paper (tokens/s per GPU) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in a.names:
        try:
            r = summarize(a.dir, name, a.commit, a.nvlink_gbs, a.out or a.dir, a.gpus_per_node, a.cross_node_gbs)
        except (OSError, KeyError, AttributeError, ValueError, IndexError) as e:
            print(f"| {name} | (no result: {type(e).__name__}: {e}) | | | | | | |")
            continue
        results.append(r)
        kinds = ", ".join(f"{n} {k}" for k, n in r["layers_by_kind"].items())
        per = ", ".join(f"{k} {r['layer_total_s'][k]:.1f}" + ("*" if r["timed_by"][k] != k else "")
                        for k in r["layers_by_kind"])
        print(f"| {name} | {kinds} | {per} | {r['outside_layers_s']:.1f} | {r['full_depth_step_s']:.0f} | "
              f"**{r['tokens_per_s_per_gpu']:.1f}** | {r['node_estimate']['tokens_per_s_per_gpu']:.1f} | "
              f"{paper(name)} |")
    print()
    print("(* timed by another kind of layer: " + "; ".join(sorted({e for r in results for e in r["estimated_kinds"]}
                                                                 | {"device: the slot layer"})) + ")")
    print()
    print("| run, layer | direction | total s | attention kernels | all-to-alls (GiB sent; s emulated) "
          "| MLP | input rebuild | other | offload copies busy | FSDP busy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for k, p2 in r["layer_s"].items():
            for dr in ("forward", "backward"):
                p = p2[dr]
                att = p.get("attention forward", 0) + p.get("attention backward", 0)
                mlp = p.get("wo and mlp forward", 0) + p.get("wo and mlp backward", 0)
                print(f"| {r['name']}, {k} (layer {r['run_layers'].index(k)}) | {dr} | {p['total']:.2f} | "
                      f"{att:.2f} ({100 * att / p['total']:.1f}%) | "
                      f"{p['all-to-all bytes'] / 2**30:.2f}; {p.get('all-to-all', 0):.3f} | {mlp:.2f} | "
                      f"{p.get('input rebuild', 0):.2f} | {p['other']:.2f} | {p.get('copy', 0):.2f} | {p.get('fsdp', 0):.3f} |")
    print()
    print("| run | attention TFLOP/s in the step, forward / backward | SM clock (MHz) and power (W), forward / backward "
          "| tokens/s per GPU with attention at (forward / backward TFLOP/s): within the host budget; with every "
          "layer's attention kept |")
    print("|---|---|---|---|")
    for r in results:
        b = r["bounds"]
        rt = b["measured_attention_tflops"]
        if rt["forward"] is None:
            print(f"| {r['name']} | (documents the logs do not give: no FLOP count) | | |")
            continue
        cases = "; ".join(f"{k}: {v['host budget']:.1f}, " + (f"{v['every layer kept']:.1f}" if v["every layer kept"] else "-")
                          for k, v in b["tokens_per_s_per_gpu_if_attention_at"].items())
        c = r["gpu_clock"] or {}
        clock = " / ".join(f"{c[p]['median_sm_mhz']:.0f} MHz, {c[p]['median_power_w']:.0f} W" if p in c else "-"
                           for p in ("forward", "backward")) if c else "not logged"
        print(f"| {r['name']} | {rt['forward']:.0f} / {rt['backward']:.0f} | {clock} | {cases} |")
    like = [r for r in results if r["against_paper"]]
    if like:
        print()
        print("| run (every layer reruns its attention, as UPipe) | one layer: attention kernels + the rest (s) "
              "| the layer the paper's tokens/s allows (s) | attention TFLOP/s over forward, rerun and backward: "
              "ours; needed for the paper's figure |")
        print("|---|---|---|---|")
        for r in like:
            a = r["against_paper"]
            need = f"{a['attention_tflops_needed']:.0f}" if a["attention_tflops_needed"] else "more than any rate"
            print(f"| {r['name']} (paper {a['paper_tokens_per_s_per_gpu']:g}) | {a['layer_s']:.2f} = "
                  f"{a['attention_s']:.2f} + {a['rest_s']:.2f} | {a['paper_layer_s']:.2f} | "
                  f"{a['attention_tflops']:.0f}; {need} |")


if __name__ == "__main__":
    main()
