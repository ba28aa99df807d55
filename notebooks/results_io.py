"""notebooks/results_io.py - what every notebook shares: where results/ and ./train are, reading
and checking the results files, running ./train --plan, and showing a figure.

A results file that is missing or malformed stops the notebook with the file, the line and what is
wrong (ValueError). Paths are printed relative to the repository ("results/ladder/..."), so a
notebook's text outputs are the same wherever it runs; `make notebooks` compares them with the
committed ones.
"""
import io
import json
import math
import os
import re
import statistics
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The results folder: $RESULTS (`make notebooks RESULTS=DIR`), else the repository's results/.
RESULTS = Path(os.environ.get("RESULTS", HERE.parent / "results")).resolve()
FIGURES = RESULTS / "figures"
# The program: $TRAIN, else the repository's ./train (`make train` builds it; --plan needs no GPU).
TRAIN = Path(os.environ.get("TRAIN", HERE.parent / "train")).resolve()

GiB, M, K = 2**30, 2**20, 2**10  # 3M tokens = 3 x 2^20, as in the README
CATEGORIES = ["model", "attention", "other", "comm", "workspace", "runtime"]
# Fixed colours per memory category, the same in every notebook.
COLOURS = {"model": "#4C72B0", "attention": "#DD8452", "other": "#55A868", "comm": "#C44E52",
           "workspace": "#8172B3", "runtime": "#937860", "host": "#d62728"}


def rel(path):
    """A results path as the reader finds it: results/ladder/x.jsonl (whatever $RESULTS is)."""
    try:
        return "results/" + Path(path).resolve().relative_to(RESULTS).as_posix()
    except ValueError:
        return Path(path).name


def fail(where, why):
    raise ValueError(f"{rel(where) if isinstance(where, Path) else where}: {why}")


def number(rec, key, where, nullable=False):
    """rec[key] as a finite number (None allowed where nullable); anything else fails loudly."""
    v = rec.get(key) if isinstance(rec, dict) else None
    if v is None and nullable:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        fail(where, f"'{key}' should be a number, not {v!r}")
    return v


def string(rec, key, where):
    v = rec.get(key) if isinstance(rec, dict) else None
    if not isinstance(v, str):
        fail(where, f"'{key}' missing or not a string")
    return v


def items(rec, key, where):
    """rec[key] as a non-empty list; anything else fails loudly."""
    v = rec.get(key) if isinstance(rec, dict) else None
    if not isinstance(v, list) or not v:
        fail(where, f"'{key}' should be a non-empty list")
    return v


def categories(rec, key, names, where):
    """rec[key] as {category: GiB} with every one of `names`."""
    d = rec.get(key) if isinstance(rec, dict) else None
    if not isinstance(d, dict):
        fail(where, f"'{key}' should be an object of GiB per category, not {d!r}")
    return {c: number(d, c, f"{where} ({key})") for c in names}


def tokens(n):
    """3145728 -> '3M', 11264 -> '11K'."""
    if n >= M:
        return f"{n / M:.2f}".rstrip("0").rstrip(".") + "M"
    return f"{n / K:.0f}K" if n >= K else str(n)


def seq_tokens(text):
    """'3M' -> 3145728, '64K' -> 65536, '4096' -> 4096 (./train's --seq-len suffixes)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KM]?)", str(text).strip())
    if not m:
        raise ValueError(f"{text!r}: a token count such as 3M, 64K or 4096")
    return int(float(m.group(1)) * {"": 1, "K": K, "M": M}[m.group(2)])


def read_json(path):
    """A JSON file's value; a missing or malformed file fails with its name."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        fail(path, f"cannot read it ({e.__class__.__name__}: {e})")


def read_jsonl(path):
    """The records of a JSON-lines file, each with 'file:line' for error messages."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        fail(path, f"cannot read it ({e.__class__.__name__})")
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{rel(path)}:{i}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            fail(where, f"not JSON ({e})")
        if not isinstance(rec, dict):
            fail(where, "not a JSON object")
        out.append((where, rec))
    if not out:
        fail(path, "empty file")
    return out


def glob_results(folder, pattern):
    """The files of results/FOLDER matching PATTERN, sorted; none fails."""
    files = sorted((RESULTS / folder).glob(pattern))
    if not files:
        raise FileNotFoundError(f"no results/{folder}/{pattern}")
    return files


# ---------------------------------------------------------------------------------------------
# The measured ladder: results/ladder/ladder_<config>_<seq>.jsonl (`make ladder`).

LADDER_RUN_KEYS = {"command": str, "gpu": str, "commit": str, "config": str}
LADDER_STAGE_KEYS = {"adds": str, "outcome": str, "longest_confirmed": str}


def load_ladder(path):
    """One ladder file: the run's header and its stages 0-7 (refused ones keep only 'refused')."""
    path = Path(path)
    (where, run), *rest = read_jsonl(path)
    if run.get("type") != "ladder_run":
        fail(where, "the first line should be the 'ladder_run' header")
    for key, t in LADDER_RUN_KEYS.items():
        if not isinstance(run.get(key), t):
            fail(where, f"'{key}' missing or not a {t.__name__}")
    for key in ["seq_len", "gpus", "cap_gib", "measure_layers", "layers"]:
        number(run, key, where)
    run["file"], run["path"], run["stages"] = path.name, rel(path), []
    for where, s in rest:
        if s.get("type") != "ladder_measured":
            fail(where, f"expected a 'ladder_measured' line, not type {s.get('type')!r}")
        k = number(s, "stage", where)
        if k not in range(8) or k in [t["stage"] for t in run["stages"]]:
            fail(where, f"stage {k!r} is not one of 0..7 or appears twice")
        if "refused" in s:
            if not isinstance(s.get("adds"), str) or not isinstance(s["refused"], str):
                fail(where, "a refused stage should have 'adds' and 'refused' strings")
            run["stages"].append(s)
            continue
        if (s.get("config"), s.get("seq_len")) != (run["config"], run["seq_len"]):
            fail(where, "config or seq_len differs from the header's")
        for key, t in LADDER_STAGE_KEYS.items():
            if not isinstance(s.get(key), t):
                fail(where, f"'{key}' missing or not a {t.__name__}")
        if not isinstance(s.get("fits"), bool):
            fail(where, "'fits' should be true or false")
        s["memory_gib"] = categories(s, "memory_gib", CATEGORIES, where)
        for key in ["total_gib", "host_gib", "longest_context", "exit_code"]:
            number(s, key, where)
        for key in ["plan_gib_at_measured_depth", "driver_gib", "step_time_s"]:
            number(s, key, where, nullable=True)
        total = sum(s["memory_gib"].values())
        if abs(total - s["total_gib"]) > 0.01 * s["total_gib"] + 0.01:
            fail(where, f"the categories add up to {total:.2f} GiB, total_gib is {s['total_gib']:.2f}")
        run["stages"].append(s)
    if sorted(s["stage"] for s in run["stages"]) != list(range(8)):
        fail(path, "should have one line for each stage 0..7 (was the run cut short?)")
    run["stages"].sort(key=lambda s: s["stage"])
    return run


def ladder_stage(config, seq, stage):
    """Stage `stage` of results/ladder/ladder_<config>_<seq>.jsonl, with its file's header as 'run'."""
    path = RESULTS / "ladder" / f"ladder_{config}_{seq}.jsonl"
    if not path.exists():
        return None
    run = load_ladder(path)
    s = dict(run["stages"][stage])
    s["run"] = run
    return s


def print_ladder_stage(s):
    """What the measured ladder recorded for one stage, as a few lines."""
    run = s["run"]
    print(f"{run['path']} (commit {run['commit']}, {run['gpu']}, {run['gpus']} GPUs"
          f"{' emulated' if run.get('emulated') else ''}, cap {run['cap_gib']:.0f} GiB), stage {s['stage']} ({s['adds']}):")
    if "refused" in s:
        print(f"  refused: {s['refused']}")
        return
    m = s["memory_gib"]
    print("  planned at full depth: " + ", ".join(f"{c} {m[c]:.2f}" for c in CATEGORIES)
          + f"; total {s['total_gib']:.2f} GiB, host {s['host_gib']:.2f} GiB")
    if s["driver_gib"] is not None:
        print(f"  allocated on the GPU: the driver counted {s['driver_gib']:.2f} GiB against the plan's "
              f"{s['plan_gib_at_measured_depth']:.2f} at {run['measure_layers']} of {run['layers']} layers "
              f"(the plan less the NCCL buffers an emulated rank does not hold)")
    else:
        print(f"  allocation refused: {s['outcome']}")
    print(f"  longest context under the cap: {tokens(s['longest_context'])} ({s['longest_confirmed']})")


# ---------------------------------------------------------------------------------------------
# The other results files the notebooks read.

def step_runs(path):
    """results/multi_gpu/fsdp_ulysses_3b_64k.json: per run its label, plan per category, last step."""
    data = read_json(path)
    where = rel(path)
    string(data, "gpu", where)
    out = []
    for i, r in enumerate(items(data, "runs", where)):
        w = f"{where} (run {i})"
        string(r, "label", w)
        setup = r.get("setup")
        steps = [s for s in r.get("steps", []) if isinstance(s, dict) and s.get("type") == "step"]
        if not isinstance(setup, dict) or not steps:
            fail(w, "a run should have its 'setup' record and at least one step")
        plan_gib = categories(setup, "plan_gib", ["model", "attention", "other", "comm", "workspace"], w)
        last = steps[-1]
        out.append({"label": r["label"], "command": string(r, "command", w), "plan_gib": plan_gib,
                    "world": number(setup, "world", w), "simulated": bool(setup.get("simulated")),
                    "runtime_gib": number(setup, "runtime_gib", w), "nccl_gib": number(setup, "nccl_gib", w),
                    "driver_gib": number(last, "driver_gib", w), "step_time_s": number(last, "step_time_s", w)})
    return data, out


def techniques():
    """results/steps/techniques_h200.json: part_a (checkpointing and offload, runs' logs) and part_b (chunking)."""
    path = RESULTS / "steps" / "techniques_h200.json"
    data = read_json(path)
    where = rel(path)
    a, b = data.get("part_a"), data.get("part_b")
    if not isinstance(a, dict) or not isinstance(a.get("logs"), dict) or not isinstance(b, dict):
        fail(where, "'part_a' with its 'logs' and 'part_b' expected")
    runs_a = {}
    for name, recs in a["logs"].items():
        w = f"{where} (part_a, {name})"
        steps = [r for r in recs if isinstance(r, dict) and r.get("type") == "step"] if isinstance(recs, list) else []
        if not steps or not isinstance(recs[0], dict) or recs[0].get("type") != "setup":
            fail(w, "a setup record, then its steps")
        runs_a[name] = {"command": string(recs[0], "command", w),
                        "memory_gib": categories(steps[-1], "memory_gib", ["model", "attention", "other", "comm",
                                                                          "workspace", "host_pinned"], w),
                        "driver_gib": number(steps[-1], "driver_gib", w),
                        # the median of the steps after the first, as bench/summarize.py gives it
                        "step_time_s": statistics.median(number(s, "step_time_s", w) for s in steps[1:] or steps)}
    table = items(b, "table", f"{where} (part_b)")
    for i, row in enumerate(table):
        w = f"{where} (part_b, row {i})"
        string(row, "run", w)
        for key in ["step_s", "other_gib", "driver_gib"]:
            number(row, key, w)
    longest = b.get("longest_context_under_80gib")
    if not isinstance(longest, list):
        fail(where, "'part_b' should hold 'longest_context_under_80gib'")
    for i, row in enumerate(longest):
        number(row, "tokens", f"{where} (longest, row {i})")
    return {"commit": data.get("commit"), "gpu": string(data, "gpu", where), "part_a": runs_a,
            "part_b": table, "longest": longest}


TRACE_CATS = ["model", "attention", "other", "comm", "workspace"]
TRACE_POINTS = {"start", "fwd", "head", "bwd", "end"}


def load_trace(path):
    """One --mem-trace file: the header and its points, in time order."""
    path = Path(path)
    (where, run), *rest = read_jsonl(path)
    if run.get("type") != "mem_trace_run":
        fail(where, "the first line should be the 'mem_trace_run' header")
    for key in ["command", "gpu", "config", "flags"]:
        string(run, key, where)
    number(run, "seq_len", where)
    run["file"], run["path"], run["points"] = path.name, rel(path), []
    for where, p in rest:
        if p.get("type") != "mem_trace" or p.get("point") not in TRACE_POINTS:
            fail(where, f"expected a 'mem_trace' line with a point in {sorted(TRACE_POINTS)}")
        for key in ["layer", "t_ms", "host_gib", "arena_gib", "driver_gib"]:
            number(p, key, where)
        p["live_gib"] = categories(p, "live_gib", TRACE_CATS, where)
        if run["points"] and p["t_ms"] < run["points"][-1]["t_ms"]:
            fail(where, "t_ms goes backwards")
        run["points"].append(p)
    if len(run["points"]) < 2:
        fail(path, "fewer than two trace points")
    return run


SWEEP_PLAN = ["model", "attention", "other", "comm", "workspace", "runtime", "total"]


def load_sweep(path):
    """results/memory/untied_sweep_*.json: its rows checked, plain Ulysses (K = 0) first, then K ascending."""
    path = Path(path)
    sweep, where = read_json(path), rel(path)
    if not isinstance(sweep, dict):
        fail(where, "not a JSON object")
    for key in ["command", "gpu", "commit", "config"]:
        string(sweep, key, where)
    for key in ["seq_len", "sim_world", "measure_layers"]:
        number(sweep, key, where)
    for i, row in enumerate(items(sweep, "rows", where)):
        w = f"{where} (row {i})"
        string(row, "label", w)
        for key in ["untied_k", "step_time_s", "tokens_per_s_per_gpu", "longest_context"]:
            number(row, key, w)
        row["full_depth_plan_gib"] = categories(row, "full_depth_plan_gib", SWEEP_PLAN, w)
        row["memory_gib_measured_depth"] = categories(row, "memory_gib_measured_depth", TRACE_CATS, w)
    if len({r["untied_k"] for r in sweep["rows"]}) != len(sweep["rows"]):
        fail(where, "two rows with the same untied_k")
    sweep["rows"].sort(key=lambda r: r["untied_k"])
    sweep["file"], sweep["path"] = path.name, rel(path)
    return sweep


def run_log(path):
    """A --log file of one run: its setup record, and its 'allocated' and 'step' records."""
    recs = [r for _, r in read_jsonl(path)]
    where = rel(path)
    if recs[0].get("type") != "setup":
        fail(where, "the first line should be the run's setup record")
    categories(recs[0], "plan_gib", TRACE_CATS, where)
    steps = [r for r in recs if r.get("type") == "step"]
    for s in steps:
        number(s, "step_time_s", where)
        number(s, "driver_gib", where)
    allocated = next((r for r in recs if r.get("type") == "allocated"), None)
    return {"setup": recs[0], "allocated": allocated, "steps": steps, "path": where}


def throughput_runs(call):
    """The runs of one call of results/throughput/throughput_h200.json, by name."""
    path = RESULTS / "throughput" / "throughput_h200.json"
    data = read_json(path)
    runs = data.get(call, {}).get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, dict) or not runs:
        fail(path, f"'{call}' should hold 'runs'")
    for name, r in runs.items():
        number(r, "tokens_per_s_per_gpu", f"{rel(path)} ({call}, {name})")
    return runs


def learning_steps(name, folder="learning"):
    """results/learning/NAME.jsonl: the setup record, steps and losses."""
    path = RESULTS / folder / f"{name}.jsonl"
    recs = [r for _, r in read_jsonl(path)]
    if recs[0].get("type") != "setup":
        fail(path, "the first line should be the run's setup record")
    out = [r for r in recs if r.get("type") == "step"]
    if not out:
        fail(path, "no step records")
    for r in out:
        number(r, "loss", rel(path))
    return recs[0], [r["step"] for r in out], [r["loss"] for r in out]


def last_eval(name, folder):
    """results/FOLDER/NAME.jsonl: the last evaluation record, its labels and losses by position."""
    path = RESULTS / folder / f"{name}.jsonl"
    recs = [r for _, r in read_jsonl(path)]
    evals = [r for r in recs if r.get("type") == "eval"]
    if recs[0].get("type") != "setup" or not evals:
        fail(path, "a setup record first, and at least one eval record")
    e = evals[-1]
    if not isinstance(e.get("positions"), list) or not e["positions"]:
        fail(path, "an eval record without losses by position")
    labels = [string(p, "label", rel(path)) for p in e["positions"]]
    losses = [number(p, "loss", rel(path)) for p in e["positions"]]
    number(e, "loss", rel(path))
    return recs[0], e, labels, losses


def seed_evals(folder="learning/linux_h100"):
    """results/learning/linux_h100/seedN/: for each seed (in order) {name: every eval record} of
    the files it holds (pre16k, ck16k_at_64k, 64k_stage0, other_at_64k), each record checked."""
    out = {}
    for d in sorted((RESULTS / folder).glob("seed*"), key=lambda d: int(d.name[4:])):
        runs = {}
        for path in sorted(d.glob("*.jsonl")):
            recs = [r for _, r in read_jsonl(path)]
            evals = [r for r in recs if r.get("type") == "eval"]
            if recs[0].get("type") != "setup" or not evals:
                fail(path, "a setup record first, and at least one eval record")
            for e in evals:
                number(e, "loss", rel(path))
                for p in e.get("positions") or fail(path, "an eval record without losses by position"):
                    number(p, "loss", rel(path))
            runs[path.stem] = evals
        out[int(d.name[4:])] = runs
    if not out:
        fail(RESULTS / folder, "no seed folders")
    return out


def attention_bench():
    """results/attention/attention_h200.json: its header, and the series drawn, each row checked."""
    path = RESULTS / "attention" / "attention_h200.json"
    data, where = read_json(path), rel(path)
    for key in ["command", "gpu", "commit"]:
        string(data, key, where)
    if not isinstance(data.get("reference"), dict):
        fail(where, "'reference' should be an object with 'rows'")

    def rows_of(d, key, w, backend=None):
        out = []
        for i, r in enumerate(items(d, key, w)):
            wi = f"{w} ({key}[{i}])"
            if not isinstance(r, dict) or not isinstance(r.get("shape"), str):
                fail(wi, "a row should be an object with a 'shape'")
            if backend is not None and r.get("backend") != backend:
                continue
            for k in ["seq", "fwd_tflops", "bwd_tflops"]:
                number(r, k, wi)
            out.append(r)
        if not out:
            fail(w, f"no rows in '{key}'" + (f" for backend {backend}" if backend else ""))
        return out

    series = {
        "ours (attention_hopper.cu)": rows_of(data, "hopper", where),
        "ours, fused backward": rows_of(data, "fused", where),
        "ours, reference (attention.cu)": rows_of(data["reference"], "rows", where + " reference"),
        "PyTorch cuDNN": rows_of(data, "torch", where, "cudnn"),
        "PyTorch flash": rows_of(data, "torch", where, "flash"),
    }
    for r in series["ours (attention_hopper.cu)"] + series["ours, fused backward"]:  # checked before timing
        errs = r.get("rel_err")
        if r.get("checked") is not True or not isinstance(errs, list) or len(errs) != 5 or max(errs[:1] + errs[2:]) >= 1e-2:
            fail(where, f"row {r['shape']} {r['seq']} lacks a passing check against the reference")
    return data, series


# ---------------------------------------------------------------------------------------------
# ./train --plan: the memory plan per GPU, no GPU needed.

def run_train(args):
    """./train ARGS, its standard output; a missing program or a failure stops the notebook."""
    if not TRAIN.exists():
        raise FileNotFoundError(f"{TRAIN.name} not found at the repository's root: `make train` builds it "
                                "(the notebooks run ./train --plan, which needs no GPU)")
    r = subprocess.run([str(TRAIN)] + [str(a) for a in args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"./train {' '.join(map(str, args))}: exit code {r.returncode}\n{r.stdout}{r.stderr}")
    return r.stdout


def plan(config, seq, gpus, stage=None, flags=(), show=False):
    """./train --plan for one stage (or flags) as rank 0 of `gpus`: its text, parsed.

    Returns {'text', 'command', 'model': {dims}, 'gib': {category: GiB, 'total', 'host'},
    'buffers': [(GiB, category, name)], 'chunk', 'loss_chunk', 'local_tokens'}.
    """
    args = ["--plan", "--config", config, "--seq-len", seq, "--sim-world", gpus]
    if stage is not None:
        args += ["--stage", stage]
    args += list(flags)
    text = run_train(args)
    if show:
        print("$ ./train " + " ".join(map(str, args)))
        print(text, end="")
    where = "./train " + " ".join(map(str, args))
    m = re.search(r"^model (\S+): (\d+) layers, dim (\d+), heads (\d+)/(\d+) x (\d+), ffn (\d+), vocab (\d+), "
                  r"(tied|untied) embeddings", text, re.M)
    if not m:
        fail(where, "no 'model ...' line")
    model = dict(zip(["L", "D", "Hq", "Hkv", "d", "F", "V"], map(int, m.groups()[1:8])))
    model["tied"] = m.group(9) == "tied"
    gib = {}
    for cat in CATEGORIES + ["total", "host"]:
        c = re.search(rf"^  {cat}\s+([\d.]+) GiB", text, re.M)
        if c:
            gib[cat] = float(c.group(1))
    gib.setdefault("host", 0.0)
    if set(CATEGORIES + ["total"]) - set(gib):
        fail(where, "the memory plan lacks a category")
    buffers = [(float(b.group(1)), b.group(2), b.group(3)) for b in
               re.finditer(r"^\s+([\d.]+) GiB  (\w+)\s+(.+)$", text.split("largest buffers:")[-1], re.M)]
    chunks = re.search(r"chunks of (\d+) tokens, loss (\d+)", text)
    local = re.search(r", (\d+) on each GPU", text)
    return {"text": text, "command": where, "model": model, "gib": gib, "buffers": buffers,
            "chunk": int(chunks.group(1)) if chunks else None, "loss_chunk": int(chunks.group(2)) if chunks else None,
            "local_tokens": int(local.group(1)) if local else None}


def beside_plan(pencil, p):
    """The pencil's GiB per category beside the plan's, and their difference."""
    print(f"{'category':<11}{'pencil GiB':>12}{'plan GiB':>11}{'difference':>12}")
    for cat, value in pencil.items():
        planned = p["gib"][cat]
        diff = round(value / GiB - planned, 3) + 0.0  # no "-0.000"
        print(f"{cat:<11}{value / GiB:>12.3f}{planned:>11.3f}{diff:>+12.3f}")


# ---------------------------------------------------------------------------------------------
# The pencil: the config's sizes, and one printed line per term.

def model_numbers(p):
    """The sizes of the plan's model line, and the counts the pencil builds on them."""
    m = dict(p["model"])
    D, F, V, Hq, Hkv, d = (m[k] for k in ("D", "F", "V", "Hq", "Hkv", "d"))
    m["qkv"], m["QD"] = (Hq + 2 * Hkv) * d, Hq * d
    m["layer"] = D * m["qkv"] + m["QD"] * D + 3 * D * F + 2 * D  # Wqkv, Wo, W1|W3, W2, two norms' gains
    m["P"] = (1 if m["tied"] else 2) * V * D + m["L"] * m["layer"] + D
    m["U"] = max(V * D, m["layer"])  # FSDP's largest unit: a table of the vocabulary, or a layer
    return m


def term(what, formula, value):
    """Prints one term of a pencil sum (bytes, shown in GiB) and returns it."""
    print(f"  {what:<46}{formula:<34}{value / GiB:>11.3f} GiB")
    return value


def total(what, value, planned=None):
    """Prints a pencil sum, and the plan's figure beside it."""
    tail = "" if planned is None else f"   (the plan: {planned:.3f})"
    print(f"  {'= ' + what:<80}{value / GiB:>11.3f} GiB{tail}")
    return value


# ---------------------------------------------------------------------------------------------
# Figures: written to results/figures/NAME (when named) and shown in the notebook.

def show(fig, name=None, dpi=110):
    """Shows `fig` as the cell's image output; with a name, also writes results/figures/NAME."""
    import matplotlib.pyplot as plt
    from IPython.display import Image, display
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    if name:
        FIGURES.mkdir(parents=True, exist_ok=True)
        (FIGURES / name).write_bytes(buf.getvalue())
        print("wrote", rel(FIGURES / name))
    display(Image(data=buf.getvalue()))
    plt.close(fig)
