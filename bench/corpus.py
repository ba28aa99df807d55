#!/usr/bin/env python3
"""bench/corpus.py - a real long-context corpus from Debian's linux-source: a training and a
held-out token file of documents from 100 KB to 10 MB (make data).

    python3 bench/corpus.py [--out data/linux] [--source FILE.tar.xz] [--text-only]
                            [--min-bytes N] [--max-bytes N]

The Linux kernel's source is long, real text that a fresh Debian machine can get with no
registry but Debian's own: `apt-get download linux-source-<version>`. A document is a folder's
files concatenated in sorted order of their path, each file after a line `==> path <==`: the
code of one subsystem, whose identifiers, types and conventions repeat across its files, so a
model that remembers the start of the document predicts its end better.

Folders become documents top down: a folder holding at most --max-bytes (10 MB) is one document
if it holds at least --min-bytes (100 KB); a larger folder gives its own files as documents of
consecutive files up to --max-bytes (those that reach --min-bytes), and its subfolders are split
the same way. What falls below --min-bytes is left out, and counted.

The training documents come from TRAIN_DIRS, the held-out ones from other directories
(HELDOUT_DIRS): no file is in both, and the held-out code is another part of the kernel.

Steps, each skipped when its output is there:
  1. the source: --source, else /usr/src/linux-source-*.tar.xz, else apt-get download of the
     candidate of the `linux-source` package, into --out
  2. --out/text.tar.xz: the documents as text files, train/*.txt and heldout/*.txt (about
     21 MiB, within what the device tool carries to a GPU machine that reaches no registry)
  3. --out/train.tok and --out/heldout.tok: tools/tokenize.py --bytes --bos (vocabulary 257; the
     `mini-bytes` config reads them). On a machine without the source (the GPU machine), carry
     text.tar.xz and run this script: it starts at step 3.
--text-only stops after step 2.

Text from a source the corpus never drew on: --out/other.tar.xz and --out/other.tok, the Python
standard library's sources (a Debian machine's /usr/lib/python3.*, or --other DIR), a folder's .py
files one document by the same rule. Python, not C, and another project: a model that learned to
copy from earlier in a document should still gain from the context there, not only recall the
kernel. Built beside the others (carry other.tar.xz too).
"""
import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

MIN_BYTES = 100_000
MAX_BYTES = 10_000_000
TRAIN_DIRS = ["fs", "net", "kernel", "mm", "lib", "block", "ipc", "init"]
HELDOUT_DIRS = ["sound", "crypto", "security"]
SKIP_SUFFIXES = (".o", ".a", ".so", ".bin", ".fw", ".png", ".jpg", ".gz", ".xz", ".bz2", ".zst")
OTHER_GLOB = "/usr/lib/python3.*"  # the other source: the Python standard library's sources
ONLY_SUFFIX = None                 # a document's files: all text files, or (the other source) .py only
SKIP_FOLDERS = ("__pycache__", "site-packages", "dist-packages")
HERE = os.path.dirname(os.path.abspath(__file__))


class CorpusError(Exception):
    """A step could not run: the message says which and why; exit status 2."""


def run(cmd, **kw):
    try:
        subprocess.run(cmd, check=True, **kw)
    except (OSError, subprocess.CalledProcessError) as e:
        raise CorpusError(f"{' '.join(cmd)}: {e}")


# ---------------------------------------------------------------------------------------------
# Step 1: the source tarball.
def find_source(out, given):
    if given:
        if not os.path.isfile(given):
            raise CorpusError(f"{given}: no such file")
        return given
    found = sorted(glob.glob("/usr/src/linux-source-*.tar.xz")) + sorted(glob.glob(os.path.join(out, "linux-source-*.tar.xz")))
    if found:
        return found[-1]
    return download_source(out)


def download_source(out):
    """apt-get download needs no root: the .deb goes to a temporary folder, its tarball to out."""
    try:
        policy = subprocess.run(["apt-cache", "depends", "linux-source"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise CorpusError(f"apt-cache depends linux-source: {e} (give --source FILE.tar.xz instead)")
    names = [w for line in policy.splitlines() for w in line.split() if w.startswith("linux-source-")]
    if not names:
        raise CorpusError("apt-cache: the linux-source package depends on no linux-source-<version> (give --source)")
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        print(f"downloading {names[0]} (about 140 MB)")
        run(["apt-get", "download", names[0]], cwd=tmp)
        debs = glob.glob(os.path.join(tmp, "*.deb"))
        if not debs:
            raise CorpusError(f"apt-get download {names[0]}: no .deb came")
        run(["dpkg-deb", "-x", debs[0], tmp])
        tarballs = glob.glob(os.path.join(tmp, "usr", "src", "linux-source-*.tar.xz"))
        if not tarballs:
            raise CorpusError(f"{debs[0]}: no usr/src/linux-source-*.tar.xz inside")
        target = os.path.join(out, os.path.basename(tarballs[0]))
        shutil.move(tarballs[0], target)
    return target


# ---------------------------------------------------------------------------------------------
# Step 2: documents from folders.
def text_files(folder):
    """Every regular text file directly in folder, sorted."""
    names = sorted(os.listdir(folder))
    return [os.path.join(folder, n) for n in names
            if not n.startswith(".") and not n.endswith(SKIP_SUFFIXES) and (not ONLY_SUFFIX or n.endswith(ONLY_SUFFIX))
            and os.path.isfile(os.path.join(folder, n)) and not os.path.islink(os.path.join(folder, n))]


def subfolders(folder):
    return [os.path.join(folder, n) for n in sorted(os.listdir(folder))
            if not n.startswith(".") and n not in SKIP_FOLDERS and os.path.isdir(os.path.join(folder, n)) and not os.path.islink(os.path.join(folder, n))]


def tree_size(folder):
    return sum(os.path.getsize(f) for f in text_files(folder)) + sum(tree_size(s) for s in subfolders(folder))


def tree_files(folder):
    return text_files(folder) + [f for s in subfolders(folder) for f in tree_files(s)]


def split_into_documents(folder, left_out):
    """[(folder, [files])]: the folder whole if it fits in MAX_BYTES, else its own files and its
    subfolders split the same way; a piece under MIN_BYTES goes to left_out (a byte count)."""
    size = tree_size(folder)
    if size <= MAX_BYTES:
        if size >= MIN_BYTES:
            return [(folder, tree_files(folder))]
        left_out[0] += size
        return []
    docs = own_documents(folder, left_out)
    for sub in subfolders(folder):
        docs += split_into_documents(sub, left_out)
    return docs


def own_documents(folder, left_out):
    """A folder's own files, in runs of consecutive files of at most MAX_BYTES (a file larger
    than that alone); a run under MIN_BYTES goes to left_out."""
    runs, run, size = [], [], 0
    for f in text_files(folder):
        n = os.path.getsize(f)
        if run and size + n > MAX_BYTES:
            runs.append((run, size))
            run, size = [], 0
        run.append(f)
        size += n
    if run:
        runs.append((run, size))
    docs = []
    for files, size in runs:
        if size >= MIN_BYTES:
            docs.append((folder, files))
        else:
            left_out[0] += size
    return docs


def write_document(root, folder, files, dest):
    """The files of one document, each after a line naming it, as dest/<folder with __>.txt."""
    rel = os.path.relpath(folder, root).replace(os.sep, "__")
    if rel == ".":  # the source's top folder (the other source's own files)
        rel = os.path.basename(os.path.normpath(root))
    path, part = os.path.join(dest, rel + ".txt"), 1
    while os.path.exists(path):  # a folder's own files in several runs
        part += 1
        path = os.path.join(dest, f"{rel}.{part}.txt")
    with open(path, "wb") as out:
        for f in files:
            out.write(f"==> {os.path.relpath(f, root)} <==\n".encode())
            with open(f, "rb") as src:
                out.write(src.read())
    return os.path.getsize(path)


def anonymous(info):
    """The same archive from the same source anywhere: no owner, no time."""
    info.uid = info.gid = info.mtime = 0
    info.uname = info.gname = ""
    return info


def build_text(source, out):
    archive = os.path.join(out, "text.tar.xz")
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        print(f"extracting {', '.join(TRAIN_DIRS + HELDOUT_DIRS)} from {source}")
        with tarfile.open(source) as tar:
            top = tar.next().name.split("/")[0]
        run(["tar", "-xJf", source, "-C", tmp, "--no-same-owner"] + [f"{top}/{d}" for d in TRAIN_DIRS + HELDOUT_DIRS])
        root = os.path.join(tmp, top)
        text = os.path.join(tmp, "text")
        for split, dirs in (("train", TRAIN_DIRS), ("heldout", HELDOUT_DIRS)):
            dest = os.path.join(text, split)
            os.makedirs(dest)
            left_out, sizes = [0], []
            for d in dirs:
                if not os.path.isdir(os.path.join(root, d)):
                    raise CorpusError(f"{source}: no {d}/ inside")
                for folder, files in split_into_documents(os.path.join(root, d), left_out):
                    sizes.append(write_document(root, folder, files, dest))
            sizes.sort()
            print(f"  {split}: {len(sizes)} documents, {sum(sizes) / 1e6:.1f} MB, from {sizes[0] / 1e3:.0f} KB "
                  f"to {sizes[-1] / 1e6:.1f} MB (median {sizes[len(sizes) // 2] / 1e6:.2f} MB); "
                  f"{left_out[0]} bytes in pieces under {MIN_BYTES} bytes left out")
        tmp_archive = archive + ".tmp"
        with tarfile.open(tmp_archive, "w:xz", preset=6) as tar:
            tar.add(text, arcname="text", filter=anonymous)
        os.replace(tmp_archive, archive)
    print(f"{archive}: {os.path.getsize(archive) / 2**20:.1f} MiB")
    return archive


def build_other(source, out):
    """other.tar.xz: the documents of another source (a folder), its .py files only."""
    global ONLY_SUFFIX
    archive = os.path.join(out, "other.tar.xz")
    if not source or not os.path.isdir(source):
        raise CorpusError(f"the other source: no folder {source or OTHER_GLOB} (give --other DIR)")
    ONLY_SUFFIX = ".py"
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        dest = os.path.join(tmp, "text", "other")
        os.makedirs(dest)
        left_out = [0]
        sizes = sorted(write_document(source, folder, files, dest)
                       for folder, files in split_into_documents(source, left_out))
        if not sizes:
            raise CorpusError(f"{source}: no document of at least {MIN_BYTES} bytes of .py files")
        print(f"  other ({source}): {len(sizes)} documents, {sum(sizes) / 1e6:.1f} MB, median {sizes[len(sizes) // 2] / 1e6:.2f} MB")
        with tarfile.open(archive + ".tmp", "w:xz", preset=6) as tar:
            tar.add(os.path.join(tmp, "text"), arcname="text", filter=anonymous)
        os.replace(archive + ".tmp", archive)
    ONLY_SUFFIX = None
    return archive


# ---------------------------------------------------------------------------------------------
# Step 3: token files.
def tokenize(archive, out, splits=("train", "heldout")):
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        for split in splits:
            folder = os.path.join(tmp, "text", split)
            if not os.path.isdir(folder):
                raise CorpusError(f"{archive}: no text/{split}/ inside")
            run([sys.executable, os.path.join(HERE, "..", "tools", "tokenize.py"), "--bytes", "--bos",
                 "--out", os.path.join(out, f"{split}.tok"), folder])


def main():
    global MIN_BYTES, MAX_BYTES
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--out", default="data/linux", help="the folder for the tarball, text.tar.xz and the token files")
    p.add_argument("--source", metavar="FILE", help="a linux-source-*.tar.xz already here")
    p.add_argument("--text-only", action="store_true", help="stop after text.tar.xz and other.tar.xz")
    p.add_argument("--other", metavar="DIR", help="the other source's folder (default: the newest %s)" % OTHER_GLOB)
    p.add_argument("--min-bytes", type=int, default=MIN_BYTES, help="the smallest document (default %(default)s)")
    p.add_argument("--max-bytes", type=int, default=MAX_BYTES, help="the largest document but a single file (default %(default)s)")
    args = p.parse_args()
    MIN_BYTES, MAX_BYTES = args.min_bytes, args.max_bytes
    try:
        os.makedirs(args.out, exist_ok=True)
        archive = os.path.join(args.out, "text.tar.xz")
        if not os.path.isfile(archive):
            archive = build_text(find_source(args.out, args.source), args.out)
        other = os.path.join(args.out, "other.tar.xz")
        if not os.path.isfile(other):
            other = build_other(args.other or (sorted(glob.glob(OTHER_GLOB)) or [None])[-1], args.out)
        if args.text_only:
            return 0
        if all(os.path.isfile(os.path.join(args.out, f"{s}.tok")) for s in ("train", "heldout", "other")):
            print(f"{args.out}/train.tok, heldout.tok and other.tok are there (delete them to build them again)")
            return 0
        if not all(os.path.isfile(os.path.join(args.out, f"{s}.tok")) for s in ("train", "heldout")):
            tokenize(archive, args.out)
        tokenize(other, args.out, ("other",))
    except (CorpusError, OSError, tarfile.TarError) as e:
        print(f"bench/corpus.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
