#!/usr/bin/env python3
"""notebooks/outputs.py COMMITTED FRESH - do a freshly executed notebook's text outputs equal the
committed notebook's?

`make notebooks` runs each notebook into a temporary copy, then this: the text outputs of every
code cell (streams, text/plain results, errors), in order, compared line by line; images,
execution counts and metadata are not compared. Prints the first difference (cell, line, both
texts) and exits 1; exits 0 when they agree. Standard library only.
"""
import json
import sys


def text(value):
    return "".join(value) if isinstance(value, list) else (value or "")


def cell_texts(path):
    """[(cell number, source's first line, text outputs)] for every code cell."""
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    out = []
    for n, cell in enumerate(nb.get("cells", []), 1):
        if cell.get("cell_type") != "code":
            continue
        parts = []
        for o in cell.get("outputs", []):
            kind = o.get("output_type")
            if kind == "stream":
                parts.append(text(o.get("text")))
            elif kind in ("execute_result", "display_data"):
                parts.append(text(o.get("data", {}).get("text/plain")) + "\n")
            elif kind == "error":
                parts.append(f"{o.get('ename')}: {o.get('evalue')}\n")
        first = text(cell.get("source")).split("\n", 1)[0]
        out.append((n, first, "".join(parts)))
    return out


def main(committed, fresh):
    a, b = cell_texts(committed), cell_texts(fresh)
    if len(a) != len(b):
        print(f"{committed}: {len(a)} code cells committed, {len(b)} in the fresh run")
        return 1
    for (n, first, old), (_, _, new) in zip(a, b):
        if old == new:
            continue
        old_lines, new_lines = old.split("\n"), new.split("\n")
        i = next((i for i, (x, y) in enumerate(zip(old_lines, new_lines)) if x != y), min(len(old_lines), len(new_lines)))
        show = lambda lines: repr(lines[i]) if i < len(lines) else "(no such line)"
        print(f"{committed}: cell {n} ({first[:60]}), output line {i + 1} differs:\n"
              f"  committed: {show(old_lines)}\n  fresh:     {show(new_lines)}")
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
