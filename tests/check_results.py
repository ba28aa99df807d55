#!/usr/bin/env python3
"""tests/check_results.py - results/ holds what the reader's documents show, and nothing else.

README.md and docs/results.md show the figures and tables; results/README.md is the index of
results/, one row per file or folder. The checks:

  1. every file under results/ is referenced by one of the three (a folder covers its files);
  2-4. every results path README.md, docs/results.md and results/README.md cite exists;
  5. results/README.md's index lists only what README.md and docs/results.md show: every file an
     index row names is referenced by one of them.

A reference is a `results/...` path anywhere in the text (also `../results/...`), a path in a
table's cell whose column header names a results folder (docs/results.md's "file
(`results/ladder/`)": the cell's `ladder_llama3.1-8b_3M.jsonl` is results/ladder/...), or, in
results/README.md, the path of an index row (first column, relative to results/). `*` globs,
and must match a file. Standard library only; run from anywhere. Ends with the line
`TESTCOUNTS passed=N failed=M skipped=0` that tests/run_tests.sh counts.
"""
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "docs/results.md"]   # what the reader sees
INDEX = "results/README.md"                # the index of results/
PATH = r"[A-Za-z0-9_.*/-]+"


def clean(path):
    """A cited path as a path under the repository root: no '../' before results/, no trailing '.'."""
    path = path.rstrip(".,;:")
    while path.startswith("../"):
        path = path[3:]
    return os.path.normpath(path) + ("/" if path.endswith("/") else "")


def table_cells(line):
    """A markdown table row's cells; `\\|` inside a cell is not a border."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def references(doc, index=False):
    """The results paths `doc` cites, as (line number, path under the root)."""
    out, header_dirs = [], {}
    lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().splitlines()
    for n, line in enumerate(lines, 1):
        in_table = line.lstrip().startswith("|")
        is_header = in_table and n < len(lines) and re.match(r"^\s*\|[\s|:-]+\|\s*$", lines[n])
        if not in_table:
            header_dirs = {}
        if is_header:  # a column's folder: "file (`results/ladder/`)"; not a reference itself
            header_dirs = {}
            for i, cell in enumerate(table_cells(line)):
                m = re.search(r"`(results/(?:" + PATH + r"/)?)`", cell)
                if m:
                    header_dirs[i] = clean(m.group(1))
            continue
        if re.match(r"^\s*\|[\s|:-]+\|\s*$", line):
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
        return [os.path.relpath(os.path.join(d, f), ROOT)
                for d, _, fs in os.walk(full) for f in fs]
    return []


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
    print(f"TESTCOUNTS passed={passed} failed={failed} skipped=0")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
