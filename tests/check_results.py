#!/usr/bin/env python3
"""tests/check_results.py - results/ holds what the reader's documents show, and each figure is
what its file says.

README.md and docs/results.md show the figures and tables; results/README.md is the index of
results/, one row per file or folder. The checks:

  1. every file under results/ is referenced by one of the three (a folder covers its files);
  2-4. every results path README.md, docs/results.md and results/README.md cite exists;
  5. results/README.md's index lists only what README.md and docs/results.md show: every file an
     index row names is referenced by one of them;
  6. README.md's results table, row by row: the row's GPU column names the GPUs its files record,
     and every number of its figure cell is what the row's extractor below computes from the
     files its file column cites, formatted as the table prints it, in the same order;
  7. a self-check: each row of a copy of that table, with one number (or its GPU) changed in
     memory, fails check 6;
  8. README.md's printed `make run` output is a step record of the file the table's `make run`
     row cites, and the paragraph before it names that file's GPU;
  9. every row of docs/results.md's tables names its machine: its own machine ("machine" or
     "where") column, or, for a table without one, the paragraph that introduces it; the GPUs
     named are those the cited files record;
 10. docs/results.md stays under 400 lines.

A reference is a `results/...` path anywhere in the text (also `../results/...`), a path in a
table's cell whose column header names a results folder (docs/results.md's "file
(`results/ladder/`)": the cell's `ladder_llama3.1-8b_3M.jsonl` is results/ladder/...), or, in
results/README.md, the path of an index row (first column, relative to results/). `*` globs,
and must match a file.

A file's GPU is what it records itself ("gpu": "NVIDIA H200", "GPU: NVIDIA H100 80GB HBM3"),
else its name (`_h100`), else a `gpu.txt` beside it; Markdown files record none (a README names
the papers' H100s too). A file that records none is named in the output, not guessed.

Standard library only; run from anywhere; takes about a second. Ends with the line
`TESTCOUNTS passed=N failed=M skipped=0` that tests/run_tests.sh counts.
"""
import fnmatch
import glob
import json
import math
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "docs/results.md"]   # what the reader sees
INDEX = "results/README.md"                # the index of results/
RESULTS_MD = "docs/results.md"
RESULTS_MD_MAX_LINES = 400
PATH = r"[A-Za-z0-9_.*/-]+"
SEPARATOR = re.compile(r"^\s*\|[\s|:-]+\|\s*$")


def clean(path):
    """A cited path as a path under the repository root: no '../' before results/, no trailing '.'."""
    path = path.rstrip(".,;:")
    while path.startswith("../"):
        path = path[3:]
    return os.path.normpath(path) + ("/" if path.endswith("/") else "")


def table_cells(line):
    """A markdown table row's cells; `\\|` inside a cell is not a border."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def read_lines(doc):
    return open(os.path.join(ROOT, doc), encoding="utf-8").read().splitlines()


def references(doc, index=False):
    """The results paths `doc` cites, as (line number, path under the root)."""
    out, header_dirs = [], {}
    lines = read_lines(doc)
    for n, line in enumerate(lines, 1):
        in_table = line.lstrip().startswith("|")
        is_header = in_table and n < len(lines) and SEPARATOR.match(lines[n])
        if not in_table:
            header_dirs = {}
        if is_header:  # a column's folder: "file (`results/ladder/`)"; not a reference itself
            header_dirs = {}
            for i, cell in enumerate(table_cells(line)):
                m = re.search(r"`(results/(?:" + PATH + r"/)?)`", cell)
                if m:
                    header_dirs[i] = clean(m.group(1))
            continue
        if SEPARATOR.match(line):
            continue
        for m in re.finditer(r"(?<![A-Za-z0-9_./-])((?:\.\./)*results/" + PATH + ")", line):
            out.append((n, clean(m.group(1))))
        if not in_table:
            continue
        for i, cell in enumerate(table_cells(line)):
            base = header_dirs.get(i)
            if index and i == 0:
                base = "results/"
            if base is None:
                continue
            for m in re.finditer(r"`(" + PATH + r")`", cell):
                p = m.group(1)
                if p.startswith(("results/", "../")) or not ("." in p or p.endswith("/")):
                    continue  # a full path (counted above), or a key such as `hopper`
                out.append((n, clean(base + p)))
    return out


def files_under(path):
    """The files a reference names: the file, a folder's files, or a glob's matches."""
    full = os.path.join(ROOT, path)
    if "*" in path:
        found = [f for m in glob.glob(full) for f in (files_under(os.path.relpath(m, ROOT)) or [])]
        return found
    if os.path.isfile(full):
        return [os.path.relpath(full, ROOT)]
    if os.path.isdir(full):
        return sorted(os.path.relpath(os.path.join(d, f), ROOT)
                      for d, _, fs in os.walk(full) for f in fs)
    return []


def tables(doc):
    """Each markdown table of `doc`: a dict with the header's line number and cells, its rows as
    (line number, cells), and the paragraph just before it (its caption: text and line numbers)."""
    lines, out, n = read_lines(doc), [], 0
    while n < len(lines):
        if lines[n].lstrip().startswith("|") and n + 1 < len(lines) and SEPARATOR.match(lines[n + 1]):
            start, caption = n, []
            k = n - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            while k >= 0 and lines[k].strip() and not lines[k].lstrip().startswith(("|", "#")):
                caption.insert(0, lines[k])
                k -= 1
            rows, n = [], n + 2
            while n < len(lines) and lines[n].lstrip().startswith("|"):
                rows.append((n + 1, table_cells(lines[n])))
                n += 1
            out.append({"line": start + 1, "header": table_cells(lines[start]), "rows": rows,
                        "caption": " ".join(caption), "caption_lines": range(k + 2, start + 1)})
        else:
            n += 1
    return out


# ---------------------------------------------------------------------------------------------
# The GPU a results file records

GPU_NAME = re.compile(r"(?<![A-Za-z0-9])H(100|200)(?![0-9])")
_gpu_cache = {}


def gpus_named(text):
    """The GPUs a piece of prose names: {"H100", "H200"} or part of it."""
    return {"H" + g for g in GPU_NAME.findall(text)}


def gpu_records(path):
    """The GPUs results file `path` records (see the module's docstring); empty if none."""
    if path not in _gpu_cache:
        found = set()
        if not path.endswith((".md", ".png")):
            with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
                found = {"H" + g for g in re.findall(r"NVIDIA H(100|200)(?![0-9])", f.read(1 << 20))}
            if not found:
                found = {"H" + g for g in re.findall(r"_h(100|200)(?![0-9])", os.path.basename(path).lower())}
            beside = os.path.join(os.path.dirname(path), "gpu.txt")
            if not found and os.path.isfile(os.path.join(ROOT, beside)) and beside != path:
                found = gpu_records(beside)
        _gpu_cache[path] = found
    return _gpu_cache[path]


def gpus_of(paths):
    """The GPUs the files under `paths` record, and the files that record none (not .md, .png)."""
    found, silent = set(), []
    for p in paths:
        for f in files_under(p):
            g = gpu_records(f)
            found |= g
            if not g and not f.endswith((".md", ".png")):
                silent.append(f)
    return found, silent


# ---------------------------------------------------------------------------------------------
# The numbers of a figure cell

NUMBER = re.compile(r"(?<![\w.])(?:(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?([A-Za-z%]*)|(OOM)\b)")
STAGE_LABEL = re.compile(r"\bstages?\s+\d+(?:\s*(?:,|and|or)\s*\d+)*")


def figure_numbers(cell):
    """The figures of a table cell, in order, as (text, start, end) of the cell: numbers as
    printed ("3,861", "0.0104", "4.48M"; "1.07x" and "98%" without their sign) and "OOM".
    Not figures: link targets, `code`, stage numbers ("stage 6", "stages 3 and 4"), lengths
    such as 3M, 64K or 1K-2K (whole numbers with K or M), and words with digits (8B, Qwen3)."""
    masked = re.sub(r"\]\([^)]*\)", lambda m: " " * len(m.group(0)), cell)
    masked = re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), masked)
    masked = STAGE_LABEL.sub(lambda m: " " * len(m.group(0)), masked)
    out = []
    for m in NUMBER.finditer(masked):
        whole, frac, suffix, oom = m.groups()
        if oom:
            out.append(("OOM", m.start(), m.end()))
        elif suffix in ("", "x", "%") or (suffix in ("K", "M") and frac):
            text = whole + (frac or "") + (suffix if suffix in ("K", "M") else "")
            out.append((text, m.start(), m.start() + len(whole) + len(frac or "")))
    return out


# ---------------------------------------------------------------------------------------------
# Reading results files, and printing figures as the tables do

class FigureError(Exception):
    """A row's files do not give its figures (missing, unreadable, or a claim they contradict)."""


def load_json(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return json.load(f)


_jsonl_cache = {}


def load_jsonl(path, kind=None):
    """A JSON-lines file's records (of type `kind`), read once however many rows cite it."""
    if path not in _jsonl_cache:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            _jsonl_cache[path] = [json.loads(line) for line in f if line.strip()]
    return [r for r in _jsonl_cache[path] if kind is None or r.get("type") == kind]


def ladder(path):
    """A `make ladder` file's stages: {stage: its ladder_measured record}."""
    return {r["stage"]: r for r in load_jsonl(path, "ladder_measured")}


def steps(path):
    return load_jsonl(path, "step")


def last_eval(path):
    evals = load_jsonl(path, "eval")
    if not evals:
        raise FigureError(f"{path} has no eval record")
    return evals[-1]


def bucket(record, label):
    """An eval record's held-out loss over positions `label` ("1K-2K")."""
    for p in record["positions"]:
        if p["label"] == label:
            return p["loss"]
    raise FigureError(f"no position bucket {label} in the eval record")


def fixed(digits):
    return lambda x: f"{x:.{digits}f}"


def thousands(x):
    return f"{round(x):,}"


def tokens_m(n):
    """A context length in M tokens (2^20), as the ladder prints it: 7,864,320 is 7.50M."""
    return f"{n / 2**20:.2f}M"


def at_most(x, digits):
    """A bound, rounded up: 0.00087 is "within 0.0009"."""
    return f"{math.ceil(x * 10**digits) / 10**digits:.{digits}f}"


def over_seeds(values, fmt):
    """One run's figure; for several runs (one file per seed) the median, then the range's two
    ends, as a cell prints "median X (range A-B)"."""
    if len(values) == 1:
        return [fmt(values[0])]
    return [fmt(statistics.median(values)), fmt(min(values)), fmt(max(values))]


def one_value(values, what):
    """A figure every run must share (the steps of a recipe): printed once."""
    if len(set(values)) != 1:
        raise FigureError(f"the runs differ in {what}: {', '.join(map(str, values))}")
    return str(values[0])


class Files:
    """The files a README row cites (its file column), expanded, and picked by name."""

    def __init__(self, cited):
        self.cited = cited
        self.all = [f for p in cited for f in files_under(p)]

    def every(self, pattern):
        """Every cited file whose path ends in `pattern` (fnmatch), sorted; at least one."""
        found = sorted(f for f in self.all if fnmatch.fnmatch(f, "*/" + pattern))
        if not found:
            raise FigureError(f"none of {', '.join(self.cited)} is a {pattern}")
        return found

    def one(self, pattern):
        found = self.every(pattern)
        if len(found) > 1:
            raise FigureError(f"{pattern}: {len(found)} files match ({', '.join(found)}), the row needs one")
        return found[0]


def figures(source, *texts):
    """Figures (printed text) with the file or folder they come from, for the messages."""
    return [(t, source) for t in texts]


def folder(path):
    return os.path.dirname(path) + "/"


def runs_source(paths):
    """Where figures over several runs come from, for the messages: the file, or the runs."""
    return paths[0] if len(paths) == 1 else f"the {len(paths)} runs {paths[0]}, ..."


# ---------------------------------------------------------------------------------------------
# One extractor per row of README.md's results table: it reads the files the row cites and
# returns the row's figures as the table prints them. The key is the start of the row's "what"
# cell. Runs repeated over seeds: cite one file per seed (in folders of their own), and the
# extractors that say so print "median X (range A-B)".

README_ROWS = []


def readme_row(what):
    def register(extract):
        README_ROWS.append((what, extract))
        return extract
    return register


def ladder_figures(paths, stages, figure):
    """Stage by stage, file by file: figure(record, path) of `make ladder` files' stages."""
    return [(figure(ladder(p)[s], p), p) for s in stages for p in paths]


def total_gib(record, path):
    """A stage's full-depth plan as the tables print it: "62.1", or "OOM" where it does not fit."""
    return f"{record['total_gib']:.1f}" if record["fits"] else "OOM"


def longest_host_bound(record, path):
    """A stage's longest context ("7.50M"); the row calls stage 7's host-bound, so it must be."""
    if record["stage"] == 7 and "host-mem-gib" not in record["longest_confirmed"]:
        raise FigureError(f"{path}: stage 7's longest is not bound by host memory "
                          f"({record['longest_confirmed']}), the row says host-bound")
    return tokens_m(record["longest_context"])


@readme_row("memory per GPU, 8B at 3M / 5M")
def memory_8b(files):
    paths = [files.one(f"ladder_llama3.1-8b_{s}.jsonl") for s in ("3M", "5M")]
    return ladder_figures(paths, (5, 6, 7), total_gib)


@readme_row("longest context, 8B / 3B")
def longest_context(files):
    paths = [files.one(f"ladder_{c}_3M.jsonl") for c in ("llama3.1-8b", "llama3.2-3b")]
    return ladder_figures(paths, (5, 6, 7), longest_host_bound)


@readme_row("tokens/s per GPU, 8B at 3M / 4M / 5M, stage 6")
def throughput_stage6(files):
    """The H100's 3M, 4M and 5M; the H200's 3M from the register split's run, 4M and 5M from the
    run before it; attention's share of the H200's 3M layer."""
    h100 = [f"8b_h100_stage6/llama3.1-8b_{s}.throughput.json" for s in ("3M", "4M", "5M")]
    h200_3m = "8b_stage6_3m_registers/llama3.1-8b_3M.throughput.json"
    out = tokens_per_s(files, h100 + [h200_3m, "8b_stage6_3m_4m_5m/llama3.1-8b_4M.throughput.json",
                                      "8b_stage6_3m_4m_5m/llama3.1-8b_5M.throughput.json"], 1)
    at3 = files.one(h200_3m)
    paper = load_json(at3)["against_paper"]
    return out + figures(at3, f"{100 * paper['attention_s'] / paper['layer_s']:.0f}")


def tokens_per_s(files, patterns, digits):
    out = []
    for pattern in patterns:
        path = files.one(pattern)
        out += figures(path, f"{load_json(path)['tokens_per_s_per_gpu']:.{digits}f}")
    return out


@readme_row("tokens/s per GPU, 8B at 3M / 4M / 5M, stage 7")
def throughput_stage7(files):
    """The H100's 3M, 4M and 5M, then the H200's 3M, 4M and 5M."""
    return tokens_per_s(files, ["8b_h100_stage7/llama3.1-8b_3M.throughput.json",
                                "8b_h100_stage7/llama3.1-8b_4M.throughput.json",
                                "8b_h100_stage7/llama3.1-8b_5M.throughput.json",
                                "8b_3m_q_registers/llama3.1-8b_3M.throughput.json",
                                "8b_3m_4m_5m_stmatrix/llama3.1-8b_4M.throughput.json",
                                "8b_3m_4m_5m_stmatrix/llama3.1-8b_5M.throughput.json"], 0)


@readme_row("tokens/s per GPU, 3B at 3M / 4M / 5M")
def throughput_3b(files):
    return tokens_per_s(files, [f"3b_3m_4m_5m_stmatrix/llama3.2-3b_{s}.throughput.json"
                                for s in ("3M", "4M", "5M")], 0)


@readme_row("Qwen3-32B memory per GPU")
def memory_qwen(files):
    """Stages 6 and 7 at 3M, 4M, 5M, then their longest contexts (the 3M file's)."""
    paths = [files.one(f"ladder_qwen3-32b_{s}.jsonl") for s in ("3M", "4M", "5M")]
    return (ladder_figures(paths, (6, 7), total_gib)
            + ladder_figures(paths[:1], (6, 7), lambda r, p: tokens_m(r["longest_context"])))


def qwen_1m_with_nodes(l1, l2):
    """Qwen3-32B at 1M, rank 0 of 16, from one step of 1 and of 2 layers: tokens/s per GPU at
    full depth, t(1) + 63 (t(2) - t(1)), with the all-to-alls across two nodes of 8 added from
    their bytes as results/throughput/qwen3_32b_1m/README.md models them: per rank and layer
    Q = T x q_dim x 2 bytes and KV = T x 2 kv_dim x 2 bytes, each KV head sent to the 16 / 8
    ranks that read it; forward 2Q + KV, backward 3Q + 2KV, stage 6 reruns the forward; half
    of it crosses the nodes at 50 GB/s per GPU."""
    setup = load_jsonl(l1, "setup")[0]
    t1, t2 = steps(l1)[-1]["step_time_s"], steps(l2)[-1]["step_time_s"]
    layers = 64
    step = t1 + (layers - 1) * (t2 - t1)
    log = open(os.path.join(ROOT, l1[:-len(".jsonl")] + ".log"), encoding="utf-8").read()
    m = re.search(r"heads (\d+)/(\d+) x (\d+)", log)
    if not m:
        raise FigureError(f"{l1[:-6]}.log does not give the heads")
    hq, hkv, d = map(int, m.groups())
    tokens, world = setup["local_tokens"], setup["world"]
    q = tokens * hq * d * 2
    kv = tokens * 2 * hkv * d * 2 * (world // hkv)
    forward, backward = 2 * q + kv, 3 * q + 2 * kv
    per_layer = 2 * forward + backward if "--stage 6" in setup["command"] else forward + backward
    step += layers * per_layer / 2 / 50e9
    return setup["seq_len"] / step / world


@readme_row("tokens/s per GPU, Qwen3-32B at 1M / 3M / 4M")
def throughput_qwen(files):
    out = []
    for stage in ("stage6", "stage7_selective"):
        l1, l2 = files.one(f"qwen3-32b_1M_{stage}_L1.jsonl"), files.one(f"qwen3-32b_1M_{stage}_L2.jsonl")
        out += figures(folder(l1), f"{qwen_1m_with_nodes(l1, l2):.1f}")
        for s in ("3M", "4M"):
            path = files.one(f"qwen3_32b_{s.lower()}/{stage}/qwen3-32b_{s}.throughput.json")
            out += figures(path, f"{load_json(path)['node_estimate']['tokens_per_s_per_gpu']:.1f}")
    return out


@readme_row("attention against cuDNN")
def attention_cudnn(files):
    path = files.one("attention_h200.json")
    d = load_json(path)
    cudnn = {(r["shape"], r["seq"]): r for r in d["torch"] if r["backend"] == "cudnn"}
    fwd = [r["fwd_tflops"] / cudnn[r["shape"], r["seq"]]["fwd_tflops"] for r in d["hopper"] if r["seq"] >= 16384]
    bwd = [r["bwd_tflops"] / cudnn[r["shape"], r["seq"]]["bwd_tflops"] for r in d["fused"] if r["seq"] >= 16384]
    return figures(path, *(f"{x:.2f}" for x in (min(fwd), max(fwd), min(bwd), max(bwd))))


def stage_runs(files, base, stage):
    """{stage-0 run: the run under `stage` in its folder} for the seeds that ran it (the scripts
    run every stage for their first seed only), among the cited files; at least one."""
    beside = {p: os.path.join(os.path.dirname(p), f"64k_stage{stage}.jsonl") for p in base}
    beside = {p: q for p, q in beside.items() if q in files.all}
    if not beside:
        raise FigureError(f"no run under stage {stage} beside {runs_source(base)}")
    return beside


@readme_row("learning at 64K")
def learning_64k(files):
    """Per seed (one 64k_stage0.jsonl each): how many seeds end below a guess that knows which
    tokens the first half holds (ln of half the length), of how many, and that guess; the first
    and last loss at stage 0, the steps, and the last loss at stages 5 and 6 where a seed ran them
    (bench/learning.sh runs every stage for its first seed only); stages 3 and 4 must give stage
    0's losses bit for bit."""
    base = files.every("64k_stage0.jsonl")
    curves = {p: [r["loss"] for r in steps(p)] for p in base}
    length = int(one_value([load_jsonl(p, "setup")[0]["seq_len"] for p in base], "their length"))
    guess = math.log(length / 2)
    out = figures(runs_source(base), str(sum(c[-1] < guess for c in curves.values())), str(len(base)),
                  fixed(2)(guess))
    out += figures(runs_source(base),
                  *over_seeds([c[0] for c in curves.values()], fixed(2)),
                  *over_seeds([c[-1] for c in curves.values()], fixed(2)),
                  one_value([len(c) for c in curves.values()], "their steps"))
    for stage in (3, 4, 5, 6):
        beside = stage_runs(files, base, stage)
        losses = {p: [r["loss"] for r in steps(q)] for p, q in beside.items()}
        if stage in (3, 4):
            for p, c in losses.items():
                if c != curves[p]:
                    raise FigureError(f"{beside[p]}'s losses are not {p}'s bit for bit")
        else:
            out += figures(runs_source(list(beside.values())), *over_seeds([c[-1] for c in losses.values()], fixed(2)))
    return out


@readme_row("real text at 64K over seeds")
def real_text_seeds(files):
    """One folder per seed: how many seeds, the held-out loss after the 16K training, at 64K the
    held-out loss at 1K-2K and at 32K-64K (it must fall from the first bucket to the last, and
    from 1K-2K to 32K-64K, in every seed), the same on the other source (other_at_64k.jsonl),
    and the 16K model read at 64K (ck16k_at_64k.jsonl) at 32K-64K; medians and ranges."""
    pre = [last_eval(p)["loss"] for p in files.every("pre16k.jsonl")]
    out = figures(runs_source(files.every("pre16k.jsonl")), str(len(pre)), *over_seeds(pre, fixed(3)))
    for name, digits in (("64k_stage0.jsonl", 3), ("other_at_64k.jsonl", 3)):
        paths = files.every(name)
        evals = [last_eval(p) for p in paths]
        for p, e in zip(paths, evals):
            first, last = e["positions"][0]["loss"], bucket(e, "32K-64K")
            if not (last < first and last < bucket(e, "1K-2K")):
                raise FigureError(f"{p}: the held-out loss does not fall from the first bucket to 32K-64K")
        out += figures(runs_source(paths), *([] if name.startswith("64k") else [str(len(paths))]),
                       *over_seeds([bucket(e, "1K-2K") for e in evals], fixed(digits)),
                       *over_seeds([bucket(e, "32K-64K") for e in evals], fixed(digits)))
    read = files.every("ck16k_at_64k.jsonl")
    out += figures(runs_source(read), str(len(read)),
                   *over_seeds([bucket(last_eval(p), "32K-64K") for p in read], fixed(2)))
    return out


@readme_row("real text at 64K under every stage")
def real_text_64k(files):
    """Per seed (one 64k_stage0.jsonl each): the held-out loss at 1K-2K and 32K-64K at stage 0,
    the most stages 5 and 6 differ from it in any bucket where a seed ran them (stages 3 and 4:
    bit for bit), and the 16K checkpoint read at 64K (ck16k_at_64k.jsonl) at 32K-64K."""
    base = files.every("64k_stage0.jsonl")
    evals = {p: last_eval(p) for p in base}
    src = runs_source(base)
    out = figures(src, *over_seeds([bucket(e, "1K-2K") for e in evals.values()], fixed(3)),
                  *over_seeds([bucket(e, "32K-64K") for e in evals.values()], fixed(3)))
    spread = 0.0
    for stage in (3, 4, 5, 6):
        for p, q in stage_runs(files, base, stage).items():
            e, other = evals[p], last_eval(q)
            diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(e["positions"], other["positions"])]
            if stage in (3, 4) and (max(diffs) != 0 or e["loss"] != other["loss"]):
                raise FigureError(f"{q}'s held-out losses are not {p}'s bit for bit")
            spread = max(spread, max(diffs))
    out += figures(src, at_most(spread, 4))
    read = files.every("ck16k_at_64k.jsonl")
    out += figures(runs_source(read), *over_seeds([bucket(last_eval(p), "32K-64K") for p in read], fixed(2)))
    return out


@readme_row("attention in packed documents")
def attention_documents(files):
    def rows(pattern):
        path = files.one(pattern)
        return path, {r["kernels"]: r for r in load_jsonl(path)}
    docs_path, docs = rows("docs_3b_128k.jsonl")
    causal_path, causal = rows("docs_causal_3b_128k.jsonl")
    flex_path = files.one("docs_flex_3b_128k.json")
    flex = {r["kernels"]: r for r in load_jsonl(flex_path)}["flex-documents"]
    return (figures(docs_path, f"{docs['hopper']['fwd_tflops']:.0f}", f"{docs['fused']['bwd_tflops']:.0f}")
            + figures(causal_path, f"{causal['hopper']['fwd_tflops']:.0f}", f"{causal['fused']['bwd_tflops']:.0f}")
            + figures(flex_path, f"{docs['hopper']['fwd_tflops'] / flex['fwd_tflops']:.2f}",
                      f"{docs['fused']['bwd_tflops'] / flex['bwd_tflops']:.2f}"))


@readme_row("8B at 3M tokens of 64K-token documents")
def documents_step(files):
    fused = [files.one(f"{d}/llama3.1-8b_3M.throughput.json") for d in ("stage6_fused", "stage6_fused_again")]
    rates = [load_json(p)["tokens_per_s_per_gpu"] for p in fused]
    stage7 = files.one("llama3.1-8b_3M_64k_docs_stage7.throughput.json")
    return (figures(" and ".join(fused), thousands(min(rates)), thousands(max(rates)))
            + figures(stage7, thousands(load_json(stage7)["tokens_per_s_per_gpu"]))
            + tokens_per_s(files, ["8b_stage6_3m_registers/llama3.1-8b_3M.throughput.json",
                                   "8b_3m_q_registers/llama3.1-8b_3M.throughput.json"], 0))


@readme_row("every technique against the plain step")
def techniques(files):
    """No number: the suite's line in the log must say it passed with no failure."""
    path = files.one("suites_*.txt")
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    m = re.search(r"^test_techniques rc=0 TESTCOUNTS passed=(\d+) failed=0", text, re.M)
    if not m or int(m.group(1)) == 0:
        raise FigureError(f"{path} does not record test_techniques passing")
    return []


@readme_row("`make run` over seeds")
def make_run_seeds(files):
    """One file per seed: how many, the last loss, the steps. No step time: these runs shared
    the GPU with others."""
    paths = files.every("*.jsonl")
    runs = [steps(p) for p in paths]
    return figures(runs_source(paths), str(len(runs)), *over_seeds([r[-1]["loss"] for r in runs], fixed(4)),
                   one_value([len(r) for r in runs], "their steps"))


@readme_row("`make run`")
def make_run(files):
    """Per seed (each .jsonl the row cites is one run): the first and last loss, the steps, the
    median step time in ms."""
    paths = files.every("*.jsonl")
    runs = [steps(p) for p in paths]
    return figures(runs_source(paths), *over_seeds([r[0]["loss"] for r in runs], fixed(2)),
                   *over_seeds([r[-1]["loss"] for r in runs], fixed(4)),
                   one_value([len(r) for r in runs], "their steps"),
                   *over_seeds([1000 * statistics.median(s["step_time_s"] for s in r) for r in runs], fixed(1)))


# ---------------------------------------------------------------------------------------------
# README.md's results table

def readme_results_table():
    """README.md's table under "## Results", as a dict: its columns' indices and its rows."""
    lines = read_lines("README.md")
    start = next((i for i, l in enumerate(lines) if l.strip() == "## Results"), None)
    if start is None:
        raise FigureError("README.md has no '## Results' section")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    found = [t for t in tables("README.md") if start < t["line"] <= end]
    if not found:
        raise FigureError("README.md's Results section has no table")
    t = found[0]
    cols = {}
    for i, h in enumerate(t["header"]):
        key = h.lower()
        for name in ("what", "figure", "gpu", "file"):
            if key.startswith(name) and name not in cols:
                cols[name] = i
    missing = [c for c in ("what", "figure", "gpu", "file") if c not in cols]
    if missing:
        raise FigureError(f"README.md's results table has no column {', '.join(missing)}")
    return {"cols": cols, "rows": t["rows"]}


def cited_paths(cell):
    """The results paths of a file cell: `x` relative to results/, or a full `results/x`."""
    out = []
    for p in re.findall(r"`([^`]+)`", cell):
        out.append(clean(p if p.startswith("results/") else "results/" + p))
    return out


def extractor_for(what):
    """The extractor whose key starts the "what" cell; the longest such key ("`make run` over
    seeds" before "`make run`")."""
    found = [(len(key), extract) for key, extract in README_ROWS if what.startswith(key)]
    return max(found, key=lambda f: f[0])[1] if found else None


def row_label(what):
    """A README row's name in messages: its "what" cell, cut at a word near 60 characters."""
    text = what.replace("`", "")
    return text if len(text) <= 64 else text[:60].rsplit(" ", 1)[0] + " ..."


def check_readme_row(cells, cols):
    """Problems of one README row: (label, problems, number of figures checked, None if its
    files could not be read)."""
    what = cells[cols["what"]]
    label = row_label(what)
    cited = cited_paths(cells[cols["file"]])
    if not cited:
        return label, [f"README.md row '{label}': no results file in its file column"], None
    missing = [p for p in cited if not files_under(p)]
    if missing:
        return label, [f"README.md row '{label}': {p} does not exist" for p in missing], None
    problems = []
    recorded, silent = gpus_of(cited)
    named = gpus_named(cells[cols["gpu"]])
    if not recorded:
        problems.append(f"README.md row '{label}': {', '.join(cited)} record no GPU")
    elif named != recorded:
        problems.append(f"README.md row '{label}': GPU column names {', '.join(sorted(named)) or 'none'} "
                        f"but {', '.join(cited)} record {', '.join(sorted(recorded))}")
    extract = extractor_for(what)
    if extract is None:
        return label, problems + [f"README.md row '{label}': no extractor in tests/check_results.py "
                                  "computes its figures"], None
    try:
        expected = extract(Files(cited))
    except (FigureError, OSError, KeyError, ValueError, IndexError, TypeError, ZeroDivisionError) as e:
        return label, problems + [f"README.md row '{label}': its files do not give its figures: "
                                  f"{type(e).__name__}: {e}"], None
    got = [t for t, _, _ in figure_numbers(cells[cols["figure"]])]
    for g, (e, source) in zip(got, expected):
        if g != e:
            problems.append(f"README.md row '{label}': figure {g} but {source} gives {e}")
    if len(got) != len(expected):
        problems.append(f"README.md row '{label}': the cell has {len(got)} figures ({', '.join(got)}), "
                        f"its files give {len(expected)} ({', '.join(e for e, _ in expected)})")
    return label, problems, len(expected)


def mutated(cell):
    """The cell with its first figure's last digit changed, or None if it has no number."""
    for text, start, end in figure_numbers(cell):
        if text != "OOM":
            d = cell[end - 1]
            return cell[:end - 1] + str((int(d) + 1) % 10) + cell[end:]
    return None


def check_make_run_output(table):
    """README's printed `make run` lines against the file its `make run` row cites."""
    row = next((cells for _, cells in table["rows"] if extractor_for(cells[table["cols"]["what"]]) is make_run), None)
    if row is None:
        return ["README.md's results table has no `make run` row"]
    try:
        runs = Files(cited_paths(row[table["cols"]["file"]])).every("*.jsonl")
        records = [{r["step"]: r for r in steps(path)} for path in runs]
    except (FigureError, OSError, ValueError) as e:
        return [f"README.md's `make run` row: {e}"]
    lines = read_lines("README.md")
    printed = [(n, m) for n, l in enumerate(lines, 1) for m in [re.match(
        r"step\s+(\d+)/(\d+)\s+loss\s+(\S+)\s+lr\s+(\S+)\s+grad norm\s+(\S+)\s+\|\s+(\d+) tok/s\s+(\S+) TFLOP/s", l)] if m]
    if not printed:
        return ["README.md prints no `make run` step line"]
    for path, by_step in zip(runs, records):
        problems = []
        for n, m in printed:
            r = by_step.get(int(m.group(1)))
            want = None if r is None else (f"{r['loss']:.4f}", f"{r['lr']:.2e}", f"{r['grad_norm']:.3f}",
                                           f"{r['tokens_per_s']:.0f}", f"{r['tflops']:.1f}")
            if want != m.group(3, 4, 5, 6, 7):
                problems.append(f"README.md:{n}: prints {' '.join(m.group(3, 4, 5, 6, 7))} "
                                f"but {path} gives {' '.join(want) if want else 'no such step'}")
        first = printed[0][0]
        before = " ".join(lines[max(0, first - 8):first - 1])
        gpus, _ = gpus_of([path])
        if gpus_named(before) != gpus:
            problems.append(f"README.md:{first}: the paragraph before the printed output names "
                            f"{', '.join(sorted(gpus_named(before))) or 'no GPU'}, {path} records {', '.join(sorted(gpus))}")
        if not problems:
            return []
    return problems


# ---------------------------------------------------------------------------------------------
# docs/results.md: every row names its machine, the GPU its files record

CPU_MACHINE = re.compile(r"\b(CPU|\d+-core machine)\b")


def check_results_md_machines():
    """Problems, and notes (files that record no GPU). A table with a machine column: each row
    names a GPU (or the CPU machine), "the same" being the row above's, and the GPUs its files
    record are those it names. A table without one: the paragraph before it cites its files and
    names every GPU they record (it may name more: a paper's H100s)."""
    problems, notes = [], []
    refs = {}
    for n, p in references(RESULTS_MD):
        refs.setdefault(n, []).append(p)
    for t in tables(RESULTS_MD):
        col = next((i for i, h in enumerate(t["header"]) if h.lower() in ("machine", "where")), None)
        head = f"{RESULTS_MD}:{t['line']}"
        if col is None:
            named = gpus_named(t["caption"])
            files = [p for n in t["caption_lines"] for p in refs.get(n, [])]
            files += [p for n, _ in t["rows"] for p in refs.get(n, [])]
            recorded, silent = gpus_of(files)
            if not files:
                problems.append(f"{head}: a table without a machine column whose caption cites no results file")
            elif not recorded:
                notes += [f"{head}: {f} records no GPU; the caption's GPU is not checked" for f in silent]
            elif not named:
                problems.append(f"{head}: a table without a machine column whose caption names no GPU")
            elif recorded - named:
                problems.append(f"{head}: the caption names {', '.join(sorted(named))} but "
                                f"{', '.join(files)} record {', '.join(sorted(recorded))}")
            continue
        previous = ""
        for n, cells in t["rows"]:
            where = f"{RESULTS_MD}:{n}"
            machine = cells[col] if col < len(cells) else ""
            if machine.lower().startswith("the same"):
                machine = previous
            previous = machine
            named = gpus_named(machine)
            if not named and not CPU_MACHINE.search(machine):
                problems.append(f"{where}: the machine cell '{cells[col]}' names no GPU")
                continue
            files = refs.get(n, [])
            recorded, silent = gpus_of(files)
            if not recorded:
                notes += [f"{where}: {f} records no GPU; the row's '{machine}' is not checked" for f in silent]
            elif recorded != named:
                problems.append(f"{where}: names {', '.join(sorted(named)) or 'no GPU'} ('{machine}') but "
                                f"{', '.join(files)} record {', '.join(sorted(recorded))}")
    return problems, notes


def check_index_gpus():
    """results/README.md's GPU column: the GPUs its files record; "not recorded ..." where they
    record none, "-" for pictures and READMEs."""
    problems = []
    for t in tables(INDEX):
        col = next((i for i, h in enumerate(t["header"]) if h.lower().startswith("gpu")), None)
        if col is None:
            return [f"{INDEX}: its index has no GPU column"]
        for n, cells in t["rows"]:
            paths = [clean("results/" + p) for p in re.findall(r"`(" + PATH + r")`", cells[0])]
            files = [f for p in paths for f in files_under(p)]
            recorded, _ = gpus_of(paths)
            cell = cells[col] if col < len(cells) else ""
            if recorded and gpus_named(cell) != recorded:
                problems.append(f"{INDEX}:{n}: GPU '{cell}' but the files record {', '.join(sorted(recorded))}")
            elif not recorded and all(f.endswith((".md", ".png")) for f in files) and cell != "-":
                problems.append(f"{INDEX}:{n}: GPU '{cell}' for pictures and READMEs (write -)")
            elif not recorded and not all(f.endswith((".md", ".png")) for f in files) \
                    and not cell.startswith("not recorded"):
                problems.append(f"{INDEX}:{n}: GPU '{cell}' but the files record none (write 'not recorded')")
    return problems


# ---------------------------------------------------------------------------------------------

def main():
    passed = failed = 0

    def check(name, problems, limit=20):
        nonlocal passed, failed
        if problems:
            failed += 1
            print(f"[  FAILED  ] {name}: {len(problems)}")
            for p in problems[:limit]:
                print(f"    {p}")
            if len(problems) > limit:
                print(f"    ... and {len(problems) - limit} more")
        else:
            passed += 1
            print(f"[       OK ] {name}")

    refs = {doc: references(doc) for doc in DOCS}
    refs[INDEX] = references(INDEX, index=True)
    covered = set()
    for doc, rs in refs.items():
        for _, path in rs:
            covered.update(files_under(path))
    every = sorted(files_under("results/"))
    check(f"every file under results/ is referenced by {', '.join(DOCS + [INDEX])} ({len(every)} files)",
          [f"{f}: no reference" for f in every if f not in covered])
    for doc, rs in refs.items():
        check(f"every results path {doc} cites exists ({len(rs)} references)",
              [f"{doc}:{n}: {p}" for n, p in rs if not files_under(p)])
    shown = set(f for doc in DOCS for _, p in refs[doc] for f in files_under(p))
    check(f"{INDEX} lists only what {' and '.join(DOCS)} show",
          [f"{INDEX}:{n}: {p}: {len(set(files_under(p)) - shown)} of its files neither document cites"
           for n, p in refs[INDEX] if set(files_under(p)) - shown])
    check(f"{INDEX}'s GPU column is what each file or folder records", check_index_gpus())

    try:
        table = readme_results_table()
    except FigureError as e:
        check("README.md's results table", [str(e)])
        table = None
    if table:
        cols = table["cols"]
        failing = set()
        for n, cells in table["rows"]:
            label, problems, count = check_readme_row(cells, cols)
            if problems:
                failing.add(n)
            files = ", ".join(cited_paths(cells[cols["file"]]))
            checked = ("its figures" if count is None else f"{count} figures" if count
                       else "its claim (no number)")
            check(f"README.md:{n} '{label}': {checked} and the GPU from {files}", problems)
        caught, missed = 0, []
        for n, cells in table["rows"]:
            if n in failing:
                continue  # already failing above: a change cannot show that it is caught
            gpu = cells[cols["gpu"]]
            # One GPU swapped for the other; where the row names both, one dropped.
            other_gpu = (re.sub(r"H(100|200)\s*,\s*", "", gpu, count=1) if len(gpus_named(gpu)) > 1 else
                         re.sub(r"H(100|200)", lambda m: "H200" if m.group(1) == "100" else "H100", gpu))
            for what, col, new in (("a number", cols["figure"], mutated(cells[cols["figure"]])),
                                   ("the GPU", cols["gpu"], other_gpu)):
                if new is None:
                    continue
                copy = list(cells)
                copy[col] = new
                if check_readme_row(copy, cols)[1]:
                    caught += 1
                else:
                    missed.append(f"README.md:{n}: {what} changed by hand ('{new}') is not caught")
        check(f"self-check: {caught} hand edits of README.md's results table (a number or the GPU of each row) are caught",
              missed)
        check("README.md's printed `make run` output is the cited run's, on its GPU", check_make_run_output(table))

    problems, notes = check_results_md_machines()
    for note in notes:
        print(f"    note: {note}")
    check(f"every row of {RESULTS_MD}'s tables names its machine, the GPU its files record", problems)
    count = len(read_lines(RESULTS_MD))
    check(f"{RESULTS_MD} stays under {RESULTS_MD_MAX_LINES} lines ({count})",
          [] if count < RESULTS_MD_MAX_LINES else [f"{RESULTS_MD} has {count} lines"])
    print(f"TESTCOUNTS passed={passed} failed={failed} skipped=0")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
