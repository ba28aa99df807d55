#!/usr/bin/env python3
"""tests/fuzz/fuzz_tokenize.py - a mutation fuzzer of tools/tokenize.py, one suite of `make test`.

    python3 tests/fuzz/fuzz_tokenize.py [--seconds S] [--seed N]   (default: FUZZ_SECONDS, else 40)
    python3 tests/fuzz/fuzz_tokenize.py --replay SEED:N            case N of the run with SEED

Each case is made by a random generator seeded with the run's seed and the case's number, so
those two make it again exactly. A case is one to three INPUTs built from the committed seeds
(tests/fuzz/seeds/tokenize/): JSON-lines files and text files mutated byte by byte and in their
JSON (deep nesting, numbers of thousands of digits, lone surrogates, bytes that are not UTF-8,
lines over the bound); folder trees with hidden entries, links, FIFOs, sockets, links to
devices, folders that cannot be listed, names that are not UTF-8, and the output file inside
(new, stale, or hard-linked); odd files named as INPUTs; and the flags (--bos, --doc-per-folder,
a small --max-doc-bytes) and --out, some of them bad.

The case also knows what the tool must do, from the rules its docstring states rather than from
its code: the documents it must write, or that it must refuse, and which file (or flag) the
message names. Each run must end within 10 s with exit status 0 or 2 and no traceback. On 0 the
file must read back (header, size, document starts ascending from 0, byte tokens below 257)
holding exactly the expected documents; on 2 the last line of stderr must name the expected
file; no temporary file may be left, nor a new output after a refusal (a stale one unchanged).
Most cases run in this process: the tool imported, its main called under an alarm, its read
size varied from 1 byte to 1 MiB so that lines and files cross chunk boundaries everywhere. One
case in sixteen, and one in four of those naming an odd file as an INPUT, runs as a user runs
it: a subprocess with 2 GiB of address space; one in four of those with its stdout /dev/full,
where a run the rules accept must fail with exit status 1, saying so, and leave no output.

Ends with the line tests/run_tests.sh counts: TESTCOUNTS passed=1 when nothing was found;
failed=1 at the first failure, its case kept under build/fuzz/ with the line that replays it.
"""
import argparse
import array
import contextlib
import importlib.util
import io
import itertools
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "tokenize.py")
SEEDS = os.path.join(ROOT, "tests", "fuzz", "seeds", "tokenize")
TIME_LIMIT = 10          # seconds, a run
MEMORY_LIMIT = 2 << 30   # bytes of address space, a subprocess run
MAX_DIGITS = 4300        # the tool's bound on a JSON number's digits
BOS = 256
AS_ROOT = os.geteuid() == 0  # permissions do not bind root: no folder it cannot list


def load_tool():
    # Not under the name `tokenize`: the standard library's module of that name is in use.
    spec = importlib.util.spec_from_file_location("tokenize_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shown(text):
    """text as the tool's messages show it (its unprintable characters escaped)."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


# ---------------------------------------------------------------------------------------------
# Mutations of bytes and of JSON lines.
DICTIONARY = [b"\\ud800", b"\\udfff", b"\\ud83d\\ude00", b"\xed\xa0\x80", b"\xff", b"\xc3", b"\xef\xbb\xbf",
              b"\x00", b"\n", b"\r\n", b"\r", b"\t", b"\x0b", b'"', b"\\", b"{", b"}", b"[", b"]", b",", b":",
              b'"text"', b'"text": ', b'{"text": ""}', b'{"text": "x"}', b"null", b"true", b"NaN", b"-Infinity",
              b"1e999999", b"-0", b'"\\u0000"', b"\\n", b"\xe2\x80\xa8"]


def big_piece(rng):
    """A piece at or past a bound: nesting, a number's digits, a long run of one byte."""
    k = rng.choice([1, 2, 50, 99, 500, 999, 1000, 5000, 100000])
    digits = rng.choice([1, 20, MAX_DIGITS - 1, MAX_DIGITS, MAX_DIGITS + 1, 10000])
    return rng.choice([b"[" * k, b"]" * k, b'{"a":' * k, b"[" * k + b"]" * k, b"1" * digits,
                       b"-" + b"7" * digits, b"0." + b"5" * digits, b"x" * k])


def mutate(rng, data, seeds):
    data = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 3, 8])):
        at = rng.randint(0, len(data))
        op = rng.randrange(9)
        if op == 0 and data:
            data[at % len(data)] ^= 1 << rng.randrange(8)
        elif op == 1 and data:
            data[at % len(data)] = rng.randrange(256)
        elif op == 2:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 3:
            del data[at:at + rng.randint(1, 64)]
        elif op == 4:
            data[at:at] = rng.choice(DICTIONARY)
        elif op == 5:
            data[at:at] = big_piece(rng)
        elif op == 6:
            data[at:at] = data[at:at + rng.randint(1, 64)] * rng.randint(1, 50)
        elif op == 7:
            other = rng.choice(seeds)
            start = rng.randint(0, len(other))
            data[at:at] = other[start:start + rng.randint(1, 256)]
        else:
            del data[at:]
    return bytes(data[:2 << 20])


def random_text(rng, seeds, clean=False):
    """A "text": from a seed, random code points, or nothing; unless clean, maybe with a lone
    surrogate."""
    r = rng.randrange(5)
    if r == 0:
        return ""
    if r == 1:
        return rng.choice(seeds).decode("utf-8", "replace")[:rng.randint(0, 300)]
    if r == 2 and not clean:
        return chr(rng.choice([0xD800, 0xDBFF, 0xDC00, 0xDFFF]))
    top = rng.choice([0x7F, 0xFF, 0xFFFF, 0x10FFFF])
    points = (rng.randint(0, top) for _ in range(rng.randint(1, 40)))
    return "".join(chr(c) for c in points if not (clean and 0xD800 <= c < 0xE000))


def random_value(rng, seeds, depth=0):
    r = rng.randrange(7 if depth < 3 else 4)
    if r == 0:
        return rng.choice([None, True, False, 0, -1, 2**64, 1.5e300, float("nan")])
    if r == 1:
        return random_text(rng, seeds)
    if r == 2:
        return rng.randint(-10**30, 10**30)
    if r == 3:
        return rng.random()
    if r == 4:
        return [random_value(rng, seeds, depth + 1) for _ in range(rng.randint(0, 4))]
    return {random_text(rng, seeds): random_value(rng, seeds, depth + 1) for _ in range(rng.randint(0, 4))}


def json_line(rng, seeds, seed_lines, clean):
    """One line of a JSON-lines file: a seed's, a new object, or (unless clean) one that is hostile."""
    if clean:
        obj = {"text": random_text(rng, seeds, True), "id": rng.randint(-10**30, 10**30)}
        return rng.choice(seed_lines) if rng.random() < 0.3 else json.dumps(obj, ensure_ascii=rng.random() < 0.5).encode()
    r = rng.randrange(7)
    if r == 0:
        return rng.choice(seed_lines)
    if r <= 2:
        obj = {"text": random_text(rng, seeds) if rng.random() < 0.9 else random_value(rng, seeds)}
        for _ in range(rng.randint(0, 3)):
            obj[random_text(rng, seeds)] = random_value(rng, seeds)
        if rng.random() < 0.1:
            obj = rng.choice([[obj], "text", None, 5])
        ascii_only = rng.random() < 0.5
        # A lone surrogate: a \ud800 escape, or (not ASCII) the bytes UTF-8 refuses to have.
        return json.dumps(obj, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    if r == 3:
        digits = rng.choice([MAX_DIGITS - 1, MAX_DIGITS, MAX_DIGITS + 1])
        number = rng.choice([b"", b"-"]) + b"1" * digits + rng.choice([b"", b".5", b"e5"])
        return b'{"text": "a", "n": ' + rng.choice([number, big_piece(rng)]) + b"}"
    if r == 4:
        k = rng.choice([10, 99, 1000, 100000])
        return b'{"text": "deep", "x": ' + b"[" * k + b"]" * k + b"}"
    if r == 5:  # lines of a byte or two, blank or not; a byte-order mark where only the first may have one
        return rng.choice([b"5", b"{", b" ", b"\r", b"\x0c", b"{}", b"[]", b'""', b"\xef\xbb\xbf" + rng.choice(seed_lines)])
    return mutate(rng, rng.choice(seed_lines), seeds)


# ---------------------------------------------------------------------------------------------
# What the tool must do. An INPUT gives events in the order the tool meets them: ("doc", bytes),
# ("refuse", names: the message names one of them), ("unsure",): from there any outcome is
# right (nesting deep enough for Python's parser to give up depends on the stack).
def nesting(line):
    """The deepest nesting of [ and { outside strings (over, never under, in a line that is not
    JSON)."""
    if line.count(b"[") + line.count(b"{") < 100:
        return 0
    brackets = re.sub(rb'"(?:[^"\\]|\\.)*"', b"", line, flags=re.S).translate(None, bytes(set(range(256)) - set(b"[]{}")))
    return max(itertools.accumulate(1 if c in b"[{" else -1 for c in brackets), default=0)


def line_event(line, where):
    """The event of one nonblank JSON line, by the rules: UTF-8, an object, a string "text" that
    is Unicode text, no number over MAX_DIGITS digits."""
    def bounded_int(digits):
        if len(digits.lstrip("-")) > MAX_DIGITS:
            raise ValueError("too many digits")
        return int(digits)
    if nesting(line) >= 100:
        return ("unsure",)
    try:
        obj = json.loads(line.decode("utf-8"), parse_int=bounded_int)
        if isinstance(obj, dict) and isinstance(obj.get("text"), str):
            return ("doc", obj["text"].encode("utf-8"))
    except (ValueError, RecursionError):
        pass
    return ("refuse", (f"{where}:",))


def jsonl_events(path, data, limit):
    lines = data.split(b"\n")
    events = []
    for n, line in enumerate(lines, 1):
        if len(line) > limit:
            return events + [("refuse", (f"{path}:{n}:",))]
        if n == 1 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        if line.strip():
            events.append(line_event(line, f"{path}:{n}"))
    return events


def file_event(path, entry, limit):
    kind, payload = entry
    if kind == "own":
        return []
    if kind == "file":
        return [("doc", payload)] if len(payload) <= limit else [("refuse", (path,))]
    return [("refuse", (path,))]  # a FIFO, a socket, a device, a broken link


def walk(top, node):
    """(files under top as (path, entry) sorted by path, the folders that cannot be listed)."""
    files, locked = [], []
    for name, entry in node.items():
        path = top + "/" + name
        if entry[0] == "dir":
            more, also = walk(path, entry[1])
            files += more
            locked += also
        elif entry[0] == "locked":
            locked.append(path)
        elif entry[0] not in ("hidden", "link-dir"):
            files.append((path, entry))
    return sorted(files, key=lambda f: f[0]), locked


def folder_events(top, node, limit, per_folder):
    if not per_folder:
        files, locked = walk(top, node)
        if locked:  # the walk lists every folder before any file is read
            return [("refuse", tuple(locked))]
        return [e for path, entry in files for e in file_event(path, entry, limit)]
    events = []
    for name in sorted(node):
        path, (kind, payload) = top + "/" + name, node[name]
        if kind == "hidden":
            continue
        if kind == "locked":
            return events + [("refuse", (path,))]
        if kind not in ("dir", "link-dir"):
            events += file_event(path, (kind, payload), limit)
            continue
        files, locked = walk(path, payload)
        if locked:
            return events + [("refuse", tuple(locked))]
        joined = b""
        for file, entry in files:
            if entry[0] == "file":
                joined += entry[1]
                if len(joined) > limit:  # named by the folder, the document
                    return events + [("refuse", (path,))]
            elif entry[0] != "own":
                return events + file_event(file, entry, limit)
        events.append(("doc", joined))
    return events


class Expected:
    """The outcome the rules give: the documents (empty ones dropped), or the names one of
    which the refusal names, or unsure."""

    def __init__(self, events):
        self.docs, self.refused, self.unsure = [], None, False
        for event in events:
            if event[0] == "doc":
                if event[1]:
                    self.docs.append(event[1])
                continue
            self.refused, self.unsure = (event[1], False) if event[0] == "refuse" else (None, True)
            return
        if not self.docs:
            self.refused = ("an empty corpus",)


# ---------------------------------------------------------------------------------------------
# A case: its files on disk, its command line and what the tool must do with it.
class Case:
    def __init__(self, seed, number, scratch, seeds):
        self.rng = rng = random.Random(f"{seed}:{number}")
        self.seeds, self.dir = seeds, os.path.join(scratch, str(number))
        os.mkdir(self.dir)
        self.seed_lines = [line for line in seeds[0].split(b"\n") if line]  # docs.jsonl's
        self.locked, self.folders, self.names, self.size = [], [], 0, 0
        self.lengths = []  # of the documents and lines made: --max-doc-bytes is set at one of them, give or take a byte
        self.in_subprocess = rng.random() < 1 / 16
        self.bos = rng.random() < 0.3
        self.per_folder = rng.random() < 0.3
        self.items = [self.make_item() for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        r = rng.random()
        if r < 0.15 and self.lengths:
            self.limit = max(1, rng.choice(self.lengths) + rng.choice([-1, 0, 1]))
        else:
            self.limit = rng.choice([1, 16, 100, 1000, 4096, 65536]) if r < 0.25 else None
        self.chunk = rng.choice([1, 2, 3, 7, 64, 4096, 1 << 20] if self.size < 2**16 else [4096, 1 << 20])
        self.out, self.out_event, self.stale = self.place_output()
        self.argv = ["--bytes", "--out", self.out] + ["--bos"] * self.bos + ["--doc-per-folder"] * self.per_folder
        if self.limit:
            self.argv += ["--max-doc-bytes", str(self.limit)]
        if rng.random() < 0.02:
            self.argv.append("--eos")
        self.argv += [path for path, _ in self.items]
        for path in self.locked:
            os.chmod(path, 0)
        # A run in a subprocess, one in four: its stdout /dev/full, which cannot take the summary.
        self.full_stdout = self.in_subprocess and rng.random() < 0.25

    def expected(self):
        limit = self.limit or 2**31
        if "--eos" in self.argv:
            return Expected([("refuse", ("--eos",))])
        if self.out_event:
            return Expected([self.out_event])
        return Expected([e for _, events in self.items for e in events(limit)])

    def name(self, ext=""):
        """A new name: plain, with spaces, not ASCII, not UTF-8 at all, or with a newline."""
        self.names += 1
        stem = self.rng.choice(["n"] * 5 + ["with space", "café", "東京", os.fsdecode(b"raw\xff\xfe"), "new\nline"])
        return f"{stem}{self.names}{ext}"

    def path(self, ext=""):
        return os.path.join(self.dir, self.name(ext))

    def make_item(self):
        kind = self.rng.choice(["jsonl"] * 4 + ["file"] * 2 + ["folder"] * 3 + ["odd"])
        return getattr(self, f"make_{kind}")()

    def make_jsonl(self):
        rng, path, clean = self.rng, self.path(".jsonl"), self.rng.random() < 0.5
        lines = [json_line(rng, self.seeds, self.seed_lines, clean) for _ in range(rng.randint(0, 12))]
        if rng.random() < 0.05:  # lines past the 1 MiB chunks of a default read
            lines += [rng.choice(self.seed_lines) for _ in range(rng.randint(5000, 20000))]
        data = b"\n".join(lines) + (b"\n" if rng.random() < 0.7 else b"")
        if not clean and rng.random() < 0.3:
            data = mutate(rng, data, self.seeds)
        if rng.random() < 0.1:
            data = b"\xef\xbb\xbf" + data
        if rng.random() < 0.05:  # a last line of a byte, with no newline
            data += rng.choice([b"5", b"{", b" ", b"}"])
        self.write(path, data)
        self.lengths += [len(line) for line in data.split(b"\n")]
        return path, lambda limit: jsonl_events(path, data, limit)

    def file_data(self):
        rng = self.rng
        data = rng.choice(self.seeds) if rng.random() < 0.2 else mutate(rng, rng.choice(self.seeds), self.seeds)
        return b"" if rng.random() < 0.1 else data

    def make_file(self):
        path, data = self.path(".txt"), self.file_data()
        self.write(path, data)
        self.lengths.append(len(data))
        return path, lambda limit: file_event(path, ("file", data), limit)

    def make_folder(self):
        path = self.path()
        node = self.make_tree(path, 0, clean=self.rng.random() < 0.5, placeable=True)
        for name, (kind, payload) in node.items():  # the documents of --doc-per-folder
            if kind in ("dir", "link-dir"):
                self.lengths.append(sum(len(e[1]) for _, e in walk(path + "/" + name, payload)[0] if e[0] == "file"))
        return path, lambda limit: folder_events(path, node, limit, self.per_folder)

    def make_tree(self, top, depth, clean, placeable):
        """A folder on disk and its model: name -> (kind, payload). placeable: the output may go
        there (not under a folder that cannot be listed)."""
        rng, node = self.rng, {}
        os.mkdir(top)
        if placeable:
            self.folders.append((top, node))
        kinds = ["file"] * 30 + ["dir"] * (8 if depth < 3 else 0) + ["hidden"] * 4 + ["link-file"] * 3 + ["link-dir"] * 2
        if not clean:
            kinds += ["broken", "fifo", "socket", "device"] + ["locked"] * (not AS_ROOT)
        for _ in range(rng.randint(0, 6)):
            kind = rng.choice(kinds)
            name = self.name(rng.choice(["", ".txt", ".jsonl"]))
            path = os.path.join(top, name)
            if kind == "hidden":
                name = "." + name
                path = os.path.join(top, name)
                if rng.random() < 0.5:
                    odd_file(path, "fifo", rng)
                else:
                    self.write(path, b"hidden")
                node[name] = ("hidden", None)
            elif kind in ("dir", "locked"):
                sub = self.make_tree(path, depth + 1, clean, placeable and kind == "dir")
                node[name] = (kind, sub)
                if kind == "locked":
                    self.locked.append(path)
            elif kind == "link-dir":  # to a folder outside the tree
                target = self.path()
                os.symlink(target, path)
                node[name] = ("link-dir", self.make_tree(target, 3, True, placeable))
            elif kind == "file":
                data = self.file_data()
                self.write(path, data)
                self.lengths.append(len(data))
                node[name] = ("file", data)
            elif kind == "link-file":  # to a file outside the tree
                data, target = self.file_data(), self.path()
                self.write(target, data)
                os.symlink(target, path)
                node[name] = ("file", data)
            else:
                odd_file(path, kind, rng)
                node[name] = ("odd", None)
        return node

    def make_odd(self):
        """A file that is no document named as an INPUT (run in a subprocess, one time in four)."""
        self.in_subprocess = self.in_subprocess or self.rng.random() < 0.25
        kind = self.rng.choice(["fifo", "socket", "device", "/dev/zero", "missing", "under a file", "broken"])
        path = self.path(".jsonl" if self.rng.random() < 0.3 else "")
        if kind == "/dev/zero":
            path = "/dev/zero"
        elif kind == "under a file":
            self.write(path, b"x")
            path = os.path.join(path, "x")
        elif kind != "missing":
            odd_file(path, kind, self.rng)
        return path, lambda limit: [("refuse", (path,))]

    def place_output(self):
        """(--out, the event where --out itself is refused, the stale output's bytes or None)."""
        rng, out = self.rng, os.path.join(self.dir, "out.bin")
        r = rng.randrange(20)
        if r == 0:
            bad = rng.choice(["", self.dir, os.path.join(self.dir, "missing", "out.bin"), "fifo", "/dev/null"])
            if bad in ("fifo", "/dev/null"):
                odd_file(out, "fifo" if bad == "fifo" else "device", rng)
                bad = out
            return bad, ("refuse", ("--out",)), None
        stale = None
        if r < 6 and self.folders:  # inside an input folder, to be left out
            top, node = rng.choice(self.folders)
            out = os.path.join(top, "out.bin")
            node["out.bin"] = ("own", None)
        if r < 3 or 6 <= r < 9:
            stale = mutate(rng, b"LLTOKENS stale", self.seeds)
            self.write(out, stale)
            if self.folders and rng.random() < 0.5:  # a hard link to it, to be left out too
                top, node = rng.choice(self.folders)
                os.link(out, os.path.join(top, "hardlink.bin"))
                node["hardlink.bin"] = ("own", None)
            if rng.random() < 0.2:  # the output named as an INPUT
                self.items.insert(rng.randint(0, len(self.items)), (out, lambda limit: [("refuse", (out,))]))
        return out, None, stale

    def write(self, path, data):
        with open(path, "wb") as f:
            f.write(data)
        self.size += len(data)


def odd_file(path, kind, rng):
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":  # bound where it is: a socket's path is short
        folder, name = os.path.split(path)
        here = os.getcwd()
        os.chdir(folder)
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(name)
        finally:
            os.chdir(here)
    elif kind == "device":
        os.symlink(rng.choice(["/dev/zero", "/dev/null", "/dev/urandom"]), path)
    elif kind == "broken":
        os.symlink(path + ".nowhere", path)


# ---------------------------------------------------------------------------------------------
# Running a case, and judging the run.
class Timeout(BaseException):
    """Raised by the alarm: a BaseException, so that no handler of the tool's takes it."""


def on_alarm(signum, frame):
    raise Timeout()


def run_in_process(tool, case):
    """(exit status or "timeout", stdout, stderr and the traceback of any exception that escaped)."""
    tool.READ_CHUNK = case.chunk
    out, err, escaped = io.StringIO(), io.StringIO(), ""
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            tool.main(case.argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Timeout:
        code = "timeout"
    except BaseException:
        code, escaped = "an exception", traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return code, out.getvalue(), err.getvalue() + escaped


def run_subprocess(case):
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    try:
        with open("/dev/full" if case.full_stdout else os.devnull, "wb") as full:
            p = subprocess.run([sys.executable, TOOL] + case.argv, stdin=subprocess.DEVNULL,
                               stdout=full if case.full_stdout else subprocess.PIPE, stderr=subprocess.PIPE,
                               timeout=TIME_LIMIT, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        return "timeout", "", ""
    return p.returncode, (p.stdout or b"").decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")


def read_back(path):
    """The documents of a token file as token arrays, or a string saying what is wrong with it."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 32 or data[:8] != b"LLTOKENS":
        return "no LLTOKENS header"
    version, width, n, m = struct.unpack_from("<IIQQ", data, 8)
    if (version, width) != (2, 4) or len(data) != 32 + 4 * n + 8 * m:
        return f"header {version}, {width}, {n} tokens, {m} documents for {len(data)} bytes"
    tokens, starts = array.array("I", data[32:32 + 4 * n]), array.array("Q", data[32 + 4 * n:])
    if sys.byteorder != "little":
        tokens.byteswap()
        starts.byteswap()
    if m == 0 or starts[0] != 0 or starts[-1] >= n or any(b <= a for a, b in zip(starts, starts[1:])):
        return f"document starts {list(starts[:10])}... not ascending from 0 below {n}"
    if max(tokens) > BOS:
        return f"token {max(tokens)} of a byte-level file"
    ends = list(starts[1:]) + [n]
    return [tokens[a:b] for a, b in zip(starts, ends)]


def judge_temporary(case):
    folder = os.path.dirname(case.out) or "."
    temporary = os.path.basename(case.out) + ".tmp"
    if case.out and os.path.isdir(folder) and any(n.startswith(temporary) for n in os.listdir(folder)):
        return "a temporary file left behind"
    return None


def judge_full_stdout(case, code, stderr):
    """What is wrong with a run whose stdout was /dev/full and that did not refuse its input: it
    must fail (exit status 1) for want of a stdout, saying so, and leave the output as it was."""
    want = case.expected()
    if code != 1:
        return f"exit status {code} with stdout full"
    if want.refused is not None and not want.unsure:
        return "failed for stdout where the input was to be refused"
    if not stderr.endswith("cannot write the summary to stdout (No space left on device): no output written\n"):
        return "a stdout that is full, not said"
    if case.out_event is None and (read_file(case.out) if os.path.lexists(case.out) else None) != case.stale:
        return "an output left although the run failed"
    return None


def judge(case, code, stdout, stderr):
    """What is wrong with a run (None: nothing)."""
    if code == "timeout":
        return f"took over {TIME_LIMIT} s"
    if "Traceback" in stderr:
        return "a traceback"
    if case.full_stdout and code != 2:
        return judge_full_stdout(case, code, stderr) or judge_temporary(case)
    if code not in (0, 2):
        return f"exit status {code}"
    if judge_temporary(case):
        return judge_temporary(case)
    want = case.expected()
    if code == 2:
        last = stderr.rstrip("\n").split("\n")[-1]
        if not last.startswith("tokenize.py: "):
            return "exit status 2 without a message"
        if want.unsure:
            return None
        if want.refused is None:
            return "refused input the rules accept"
        if not any(shown(name) in last for name in want.refused):
            return f"the message names none of {[shown(n) for n in want.refused]}"
        if case.out_event is None:
            after = read_file(case.out) if os.path.lexists(case.out) else None
            if after != case.stale:
                return "the output changed although refused"
        return None
    if want.refused is not None:
        return f"accepted input the rules refuse (naming one of {[shown(n) for n in want.refused]})"
    docs = read_back(case.out)
    if isinstance(docs, str):
        return f"the output: {docs}"
    expect = [array.array("I", ([BOS] if case.bos else []) + list(d)) for d in want.docs]
    if not want.unsure and docs != expect:
        return f"{len(docs)} documents written, {len(expect)} expected (or their tokens differ)"
    if f"{len(docs)} documents" not in stdout:
        return "no summary"
    return None


def read_file(path):
    with open(path, "rb") as f:
        return f.read()


def unlock(case):
    for path in reversed(case.locked):  # a folder's own before those inside it
        os.chmod(path, 0o755)


# ---------------------------------------------------------------------------------------------
def keep(case, seed, number, problem, result):
    """The failing case's regular files under build/fuzz/, a note of the others, the replay line."""
    unlock(case)
    dest = os.path.join(ROOT, "build", "fuzz", f"tokenize-{seed}-{number}")
    shutil.rmtree(dest, ignore_errors=True)
    odd = []
    for top, dirs, files in os.walk(case.dir):
        rel = os.path.relpath(top, case.dir)
        os.makedirs(os.path.join(dest, rel), exist_ok=True)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            src = os.path.join(top, name)
            st = os.lstat(src)
            if stat.S_ISREG(st.st_mode):
                shutil.copyfile(src, os.path.join(dest, rel, name))
            else:
                target = f" -> {os.readlink(src)}" if stat.S_ISLNK(st.st_mode) else ""
                odd.append(f"{os.path.join(rel, name)!r}: mode {st.st_mode:o}{target}")
    code, stdout, stderr = result
    with open(os.path.join(dest, "case.txt"), "w", encoding="utf-8", errors="backslashreplace") as f:
        f.write(f"argv (under {case.dir}): {case.argv!r}\nproblem: {problem}\nexit status: {code}\n"
                f"stdout:\n{stdout}\nstderr:\n{stderr}\nfiles that are not regular:\n" + "\n".join(odd) + "\n")
    return dest


def replay(spec):
    """Makes case SEED:N again and runs it both ways, showing everything; 1 if a run is wrong."""
    seed, number = (int(x) for x in spec.split(":"))
    tool, seeds = load_tool(), load_seeds()
    scratch, bad = tempfile.mkdtemp(prefix="fuzz_tokenize_"), False
    try:
        for how in ("in this process", "in a subprocess"):
            case = Case(seed, number, scratch, seeds)  # afresh: a run may change the files
            if how == "in this process":
                want = case.expected()
                print(f"argv: {case.argv!r}\nread size {case.chunk}; expected: {len(want.docs)} documents, "
                      f"refused naming one of {want.refused}" + (", or anything" if want.unsure else ""))
            case.full_stdout = case.full_stdout and how == "in a subprocess"  # in this process stdout is a buffer
            code, stdout, stderr = run_in_process(tool, case) if how == "in this process" else run_subprocess(case)
            problem = judge(case, code, stdout, stderr)
            bad = bad or problem is not None
            print(f"--- {how}: exit status {code}: {problem or 'as expected'}\nstdout:\n{stdout}stderr:\n{stderr}")
            unlock(case)
            shutil.rmtree(case.dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if bad else 0


def load_seeds():
    """The seeds' bytes, docs.jsonl first."""
    names = sorted(os.listdir(SEEDS), key=lambda name: name != "docs.jsonl")
    return [read_file(os.path.join(SEEDS, name)) for name in names]


def fuzz(seconds, seed):
    tool, seeds = load_tool(), load_seeds()
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # a tmpfs: no disk writes
    scratch = tempfile.mkdtemp(prefix="fuzz_tokenize_", dir=shm)
    counts, reasons = {"in this process": 0, "in a subprocess": 0, 0: 0, 1: 0, 2: 0}, {}
    start, number = time.monotonic(), 0
    print(f"fuzz_tokenize: seed {seed}, {seconds} s, {len(seeds)} seeds")
    try:
        while time.monotonic() - start < seconds:
            case = Case(seed, number, scratch, seeds)
            how = "in a subprocess" if case.in_subprocess else "in this process"
            result = run_subprocess(case) if case.in_subprocess else run_in_process(tool, case)
            problem = judge(case, *result)
            if problem:
                dest = keep(case, seed, number, problem, result)
                print(f"fuzz_tokenize: case {number} ({how}): {problem}\n{result[2][-3000:]}")
                print(f"fuzz_tokenize: case kept in {dest}; replay: python3 {os.path.relpath(__file__, ROOT)} --replay {seed}:{number}")
                print("TESTCOUNTS passed=0 failed=1 skipped=0")
                return 1
            counts[how] += 1
            counts[result[0]] += 1
            if result[0] == 2:
                reason = re.sub(r" /.*", "", result[2].rstrip("\n").split("\n")[-1].split(" (")[0].split(": ")[-1])[:40]
                reasons[reason] = reasons.get(reason, 0) + 1
            unlock(case)
            shutil.rmtree(case.dir)
            number += 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    seconds_run = time.monotonic() - start
    print(f"fuzz_tokenize: {number} cases in {seconds_run:.0f} s ({counts['in this process']} in this process, "
          f"{counts['in a subprocess']} in a subprocess): {counts[0]} written, {counts[2]} refused, "
          f"{counts[1]} failed for a full stdout; nothing found")
    top = sorted(reasons.items(), key=lambda kv: -kv[1])[:12]
    print("fuzz_tokenize: refusals by reason: " + "; ".join(f"{r} {n}" for r, n in top))
    print("TESTCOUNTS passed=1 failed=0 skipped=0")
    return 0


def main():
    p = argparse.ArgumentParser(description="A mutation fuzzer of tools/tokenize.py.")
    p.add_argument("--seconds", type=float, default=float(os.environ.get("FUZZ_SECONDS") or 40))
    p.add_argument("--seed", type=int, default=None, help="default: from the clock (printed)")
    p.add_argument("--replay", metavar="SEED:N", help="make case N of the run with SEED again, and run it")
    args = p.parse_args()
    if args.replay:
        sys.exit(replay(args.replay))
    sys.exit(fuzz(args.seconds, args.seed if args.seed is not None else int(time.time()) % 100000))


if __name__ == "__main__":
    main()
