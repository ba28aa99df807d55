#!/usr/bin/env python3
"""tools/tokenize.py - text to a version-2 token file with documents, for ./train --data.

    python3 tools/tokenize.py (--bytes | --tokenizer PATH) --out FILE [--bos] [--eos]
                              [--doc-per-folder] [--max-doc-bytes N] INPUT...

INPUT is a file (one document), a folder (each file under it a document, in sorted order; with
--doc-per-folder, each subfolder's files concatenated in sorted order as one document), or a
JSON-lines file (*.jsonl: each line an object whose "text" is one document).

Tokenizers:
  --bytes           byte-level: token b for byte b (0..255), and 256 the begin-of-document token;
                    no dependency; any bytes are text
  --tokenizer PATH  a Hugging Face tokenizer.json (the file, or the folder of the checkpoint that
                    ./train --init-from reads), through the `tokenizers` package; the text must be
                    UTF-8
  --bos, --eos      start (end) each document with the tokenizer's begin-of-text (end-of-text)
                    token: --bytes has 256 as its BOS and no EOS; a tokenizer's come from
                    tokenizer_config.json beside tokenizer.json

The output (format: README, "Checkpoints and data") is written to a temporary file beside FILE
and renamed when complete. A progress line with tokens/s goes to stderr on large inputs, and a
summary (documents, tokens, the length distribution) at the end. The standard library only,
`tokenizers` only for --tokenizer.

Inputs are untrusted. Bad input gets a one-line message naming the file (or the flag) and exit
status 2, in bounded time and memory:
  - Only regular files are read. A FIFO, a device or a socket is refused by name before it is
    opened: opening a FIFO blocks, and a device may act on being opened (/dev/zero would never
    end). Inside a folder, hidden entries and links to folders are left out; a folder that cannot
    be listed is an error naming it.
  - A document is read whole into memory and tokenized there, so one over --max-doc-bytes
    (default 2^31 bytes) is refused rather than read: a file by its size, a JSON line once it
    passes the bound, a --doc-per-folder subfolder by its files' total. 2 GiB is far more than
    a training window holds (a million tokens is a few MiB of text) and still fits in memory
    beside its tokens (4 bytes each); a .jsonl file itself may be of any size, read line by line.
  - A JSON line must be UTF-8 (a byte-order mark on the first line is allowed). One nested
    deeper than Python's parser goes (about a thousand levels), one with a number of over 4300
    digits (Python's default bound on converting one), and a "text" holding a lone surrogate
    (\\ud800 has no UTF-8) are refused.
  - --out must be a new file or a regular one (it is replaced: /dev/null must not be) in a
    folder that can be written. The output file and its temporary are never read back, known by
    their identity (st_dev, st_ino) rather than their names: inside an input folder they are
    left out with a note; named as an INPUT, refused.
The summary goes to stdout before the output file is put in place: a stdout that cannot take
it (closed, or full: > /dev/full) fails the run (exit status 1). Other exit statuses: 1 an
internal error (a bug, said in one line), 3 out of memory, 130 interrupted (128 + the signal for
SIGTERM and SIGHUP); no output file is left behind by any of them. A stderr that cannot be
written is passed over: the exit status still tells.
"""
import os
import sys

# This file is named tokenize.py. Run as a script, its folder comes first on sys.path, and the
# standard library's `import tokenize` (linecache's, so traceback's and every error report's)
# would find this file instead: the folder goes before anything else is imported.
HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != HERE]

import argparse
import array
import errno
import json
import signal
import stat
import struct
import time
import traceback

BYTES_BOS = 256
MAX_TOKEN = 2**32 - 1       # token ids are uint32
MAX_DOC_BYTES = 2**31       # --max-doc-bytes' default (the docstring says why)
MAX_NUMBER_DIGITS = 4300    # in a JSON line (the docstring says why)
MAX_CONFIG_BYTES = 2**26    # tokenizer_config.json: a few KiB in practice
READ_CHUNK = 2**20
KINDS = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


class InputError(Exception):
    """Bad input or usage: the message names the file (or the flag); exit status 2."""


class StdoutError(Exception):
    """The summary could not be written to stdout: the run fails, exit status 1."""


class Interrupted(BaseException):
    """SIGTERM or SIGHUP: ends the run as Ctrl-C does, the temporary file removed."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def to_stderr(text):
    """text on stderr, unless stderr is closed or cannot be written."""
    if sys.stderr is None:
        return
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except OSError:
        pass


def say(message):
    """One line on stderr, its unprintable characters (a newline in a file name) escaped."""
    shown = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)
    to_stderr(f"tokenize.py: {shown}\n")


def kind(mode):
    return KINDS.get(stat.S_IFMT(mode), "not a regular file")


def identity(st):
    return st.st_dev, st.st_ino


# ---------------------------------------------------------------------------------------------
# Reading one regular file, bounded.
def open_regular(path):
    """An open descriptor of the regular file at path, and its fstat. The kind is checked before
    opening, so that no FIFO or device is ever opened; O_NONBLOCK keeps even a file swapped for a
    FIFO in between from blocking, and fstat sees it."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{path}: not a regular file ({kind(st.st_mode)})")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror})")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InputError(f"{path}: not a regular file ({kind(st.st_mode)})")
    return fd, st


def read_some(fd, path, n):
    try:
        return os.read(fd, n)
    except OSError as e:  # EIO; EAGAIN from a pseudo-file (/proc) that would block
        raise InputError(f"{path}: cannot read it ({e.strerror})")


def read_bounded(fd, path, size, limit, whole):
    """The file's bytes, read in as few calls as its size allows; over limit bytes, an error
    naming whole (the document). The size is a hint only: a file may grow, a pseudo-file lie."""
    if size > limit:
        raise InputError(f"{whole}: over {limit} bytes, the bound on a document (--max-doc-bytes)")
    parts, total = [], 0
    while True:
        chunk = read_some(fd, path, min(max(size - total, READ_CHUNK), limit + 1 - total))
        if not chunk:
            return b"".join(parts)  # one part: no copy
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            raise InputError(f"{whole}: over {limit} bytes, the bound on a document (--max-doc-bytes)")


def read_regular(path, limit):
    fd, st = open_regular(path)
    try:
        return read_bounded(fd, path, st.st_size, limit, path)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# JSON, parsed with bounds on what Python's parser would otherwise fail on with a traceback.
class NumberTooLong(ValueError):
    pass


def bounded_int(digits):
    if len(digits.lstrip("-")) > MAX_NUMBER_DIGITS:
        raise NumberTooLong()
    return int(digits)


def parse_json(text, where):
    """The value of JSON text; errors name where (the file, or file:line)."""
    try:
        return json.loads(text, parse_int=bounded_int)
    except NumberTooLong:
        raise InputError(f"{where}: a number of over {MAX_NUMBER_DIGITS} digits")
    except RecursionError:
        raise InputError(f"{where}: nested too deeply")
    except ValueError as e:  # JSONDecodeError
        raise InputError(f"{where}: not a JSON object ({e})")


def json_line_document(line, where):
    """The UTF-8 bytes of one JSON line's "text"."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line)")
    obj = parse_json(text, where)
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        raise InputError(f"{where}: a JSON object with a string \"text\" expected")
    try:
        return obj["text"].encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{where}: \"text\" holds a lone surrogate "
                         f"({ascii(e.object[e.start])[1:-1]}), not Unicode text")


# ---------------------------------------------------------------------------------------------
# Documents: (name, bytes) in order, from files, folders and JSON lines.
class Inputs:
    """The inputs' files: regular ones only, each document bounded, never the output's own.

    own maps the identity (st_dev, st_ino) of the output file and of its temporary to what it
    is: met in a folder, such a file is left out; named as an input, refused."""

    def __init__(self, max_doc_bytes, own):
        self.limit, self.own = max_doc_bytes, own

    def open(self, path, listed):
        """open_regular's (fd, stat), or None for one of the output's own files met in a folder."""
        fd, st = open_regular(path)
        what = self.own.get(identity(st))
        if what is None:
            return fd, st
        os.close(fd)
        if not listed:
            raise InputError(f"{path}: {what} (--out) given as an input")
        say(f"{path}: {what} (--out), left out")
        return None

    def read(self, path, listed, limit=None, whole=None):
        """The bytes of the file at path (None if it is the output's own), at most limit."""
        opened = self.open(path, listed)
        if opened is None:
            return None
        fd, st = opened
        try:
            return read_bounded(fd, path, st.st_size, self.limit if limit is None else limit, whole or path)
        finally:
            os.close(fd)

    def read_joined(self, paths, whole):
        """The files' bytes concatenated as one document, named whole where over the bound."""
        parts, total = [], 0
        for path in paths:
            data = self.read(path, True, self.limit - total, whole)
            if data is not None:
                parts.append(data)
                total += len(data)
        return b"".join(parts)

    def lines(self, path):
        """(number, bytes) of each line of a JSON-lines file, a line over the bound refused. The
        file is read in chunks: only the current line is held, whatever the file's size."""
        fd, _ = self.open(path, listed=False)
        try:
            n, pending, size = 1, [], 0  # the line so far, in pieces, and its length
            while chunk := read_some(fd, path, READ_CHUNK):
                pieces = chunk.split(b"\n")
                for i, piece in enumerate(pieces):
                    pending.append(piece)
                    size += len(piece)
                    if size > self.limit:
                        raise InputError(f"{path}:{n}: a line over {self.limit} bytes, the bound on a document (--max-doc-bytes)")
                    if i < len(pieces) - 1:  # the piece ends at a newline
                        yield n, b"".join(pending)
                        n, pending, size = n + 1, [], 0
            if size:
                yield n, b"".join(pending)
        finally:
            os.close(fd)


def listing(folder):
    """The folder's entries (os.DirEntry) but the hidden ones, sorted by name."""
    try:
        with os.scandir(folder) as it:
            return sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError as e:
        raise InputError(f"{folder}: cannot list it ({e.strerror})")


def is_folder(entry):
    """Whether a folder entry is a folder itself, and whether through a link."""
    try:
        return entry.is_dir(), entry.is_symlink()
    except OSError:  # an entry that cannot be looked at is read as a file, which names the error
        return False, False


def files_under(folder):
    """Every file under folder, sorted by path: hidden entries and links to folders left out (no
    loops), a folder met again through a bind mount walked once, and a folder that cannot be
    listed an error naming it. Any kind of file is listed: reading one refuses what is not
    regular."""
    found, pending, seen = [], [folder], set()
    while pending:
        top = pending.pop()
        for entry in listing(top):
            folder_entry, linked = is_folder(entry)
            if not folder_entry:
                found.append(entry.path)
            elif not linked:
                try:
                    ident = identity(entry.stat(follow_symlinks=False))
                except OSError as e:
                    raise InputError(f"{entry.path}: cannot list it ({e.strerror})")
                if ident not in seen:
                    seen.add(ident)
                    pending.append(entry.path)
    return sorted(found)


def folder_documents(inputs, folder, doc_per_folder):
    if not doc_per_folder:
        for path in files_under(folder):
            data = inputs.read(path, listed=True)
            if data is not None:
                yield path, data
        return
    for entry in listing(folder):
        if is_folder(entry)[0]:
            yield entry.path, inputs.read_joined(files_under(entry.path), entry.path)
        else:
            data = inputs.read(entry.path, listed=True)
            if data is not None:
                yield entry.path, data


def jsonl_documents(inputs, path):
    """Each nonblank line's document, named file:line (a byte-order mark allowed before the first)."""
    for n, line in inputs.lines(path):
        if n == 1 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        if line.strip():
            yield f"{path}:{n}", json_line_document(line, f"{path}:{n}")


def documents(inputs, items, doc_per_folder):
    for item in items:
        try:
            st = os.stat(item)
        except FileNotFoundError:
            raise InputError(f"{item}: no such file or folder")
        except OSError as e:
            raise InputError(f"{item}: cannot read it ({e.strerror})")
        if stat.S_ISDIR(st.st_mode):
            yield from folder_documents(inputs, item, doc_per_folder)
        elif item.endswith(".jsonl"):
            yield from jsonl_documents(inputs, item)
        else:
            yield item, inputs.read(item, listed=False)


# ---------------------------------------------------------------------------------------------
# Tokenizers: encode(name, bytes) -> list of ids; bos, eos: ids or None.
class ByteTokenizer:
    vocab = 257

    def __init__(self):
        self.bos, self.eos = BYTES_BOS, None

    def encode(self, name, data):
        return array.array("I", array.array("B", data))


class HfTokenizer:
    def __init__(self, path):
        try:
            import tokenizers
        except ImportError:
            raise InputError("--tokenizer needs the `tokenizers` package (pip install tokenizers); --bytes needs none")
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise InputError(f"--tokenizer {path}: no tokenizer.json")
        try:
            self.tok = tokenizers.Tokenizer.from_file(file)
        except BaseException as e:  # the package's own errors, and a Rust panic (a BaseException)
            if isinstance(e, (KeyboardInterrupt, SystemExit, Interrupted)):
                raise
            raise InputError(f"--tokenizer {file}: not a tokenizer ({e})")
        self.vocab = self.tok.get_vocab_size(with_added_tokens=True)
        try:
            self.bos = self.special(file, "bos_token")
            self.eos = self.special(file, "eos_token")
        except InputError as e:  # tokenizer_config.json beside it: the flag that led there named
            raise InputError(f"--tokenizer: {e}")

    def special(self, file, key):
        """The id of tokenizer_config.json's bos_token or eos_token, if both are there."""
        config = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        if not os.path.lexists(config):
            return None
        data = read_regular(config, MAX_CONFIG_BYTES)
        try:
            value = parse_json(data.decode("utf-8"), config)
        except UnicodeDecodeError as e:
            raise InputError(f"{config}: not UTF-8 text (byte {e.start + 1})")
        if not isinstance(value, dict):
            raise InputError(f"{config}: not a JSON object")
        value = value.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return self.tok.token_to_id(value) if isinstance(value, str) else None

    def encode(self, name, data):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{name}: not UTF-8 text (byte {e.start}); --bytes reads any bytes")
        return self.tok.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------------------------------------
# The output: header (counts filled in at the end), tokens as they come, then the starts.
def output_identity(path):
    """The identity of --out's existing file (None if there is none yet), or an error where the
    path cannot be an output file."""
    if not path:
        raise InputError("--out: an empty path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InputError(f"--out {path}: no folder {folder}")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InputError(f"--out {path}: cannot write it ({e.strerror})")
    if not stat.S_ISREG(st.st_mode):  # /dev/null would be replaced by the output
        raise InputError(f"--out {path}: {kind(st.st_mode)}, not a file to write")
    return identity(st)


class TokenFileWriter:
    def __init__(self, path):
        self.path, self.tmp = path, f"{path}.tmp{os.getpid()}"
        existing = output_identity(path)
        try:  # O_EXCL: never through a link, never over another's file
            fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise InputError(f"--out {path}: cannot write in {os.path.dirname(os.path.abspath(path))} ({e.strerror})")
        self.own = {identity(os.fstat(fd)): "the output's temporary file"}
        if existing:
            self.own[existing] = "the output file"
        self.f = os.fdopen(fd, "wb")
        self.tokens, self.starts = 0, array.array("Q")
        self.write(b"\0" * 32)

    def failed(self, e):
        return InputError(f"--out {self.path}: cannot write it ({e.strerror})")

    def write(self, data):
        try:
            if isinstance(data, array.array):
                data.tofile(self.f)
            else:
                self.f.write(data)
        except OSError as e:  # a full disk
            raise self.failed(e)

    def add(self, ids):
        self.starts.append(self.tokens)
        arr = ids if isinstance(ids, array.array) else array.array("I", ids)
        if sys.byteorder != "little":
            arr.byteswap()
        self.write(arr)
        self.tokens += len(arr)

    def commit(self):
        if sys.byteorder != "little":
            self.starts.byteswap()
        self.write(self.starts)
        try:
            self.f.seek(0)
            self.f.write(b"LLTOKENS" + struct.pack("<IIQQ", 2, 4, self.tokens, len(self.starts)))
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            os.replace(self.tmp, self.path)
        except OSError as e:
            raise self.failed(e)

    def abandon(self):
        try:
            self.f.close()  # may fail to flush on a full disk: the file goes anyway
        except OSError:
            pass
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


class Progress:
    """A line on stderr every half second once a second has passed: bytes read, tokens, tokens/s."""

    def __init__(self):
        self.start = self.last = time.monotonic()
        self.shown = False

    def update(self, docs, nbytes, tokens):
        now = time.monotonic()
        if now - self.start < 1.0 or now - self.last < 0.5:
            return
        self.last, self.shown = now, True
        rate = tokens / (now - self.start)
        to_stderr(f"\r  {docs} documents, {nbytes / 2**20:.1f} MiB read, {tokens} tokens, {rate:,.0f} tokens/s   ")

    def done(self):
        if self.shown:
            to_stderr("\n")
            self.shown = False


def summary(lengths, tokens, skipped, seconds, out, vocab):
    lengths = sorted(lengths)
    pick = lambda q: lengths[min(len(lengths) - 1, int(q * len(lengths)))]
    return (f"{out}: {len(lengths)} documents, {tokens} tokens ({tokens / max(seconds, 1e-9):,.0f} tokens/s)"
            + (f"; {skipped} empty documents left out" if skipped else "") + "\n"
            + f"  document length in tokens: min {lengths[0]}, median {pick(0.5)}, 90% {pick(0.9)}, "
            f"max {lengths[-1]}, mean {tokens / len(lengths):.1f}\n"
            + f"  vocabulary {vocab} (a --config with at least that many tokens reads it)\n")


def to_stdout(text):
    """text on stdout, flushed: a StdoutError where stdout is closed or cannot take it."""
    try:
        if sys.stdout is None:
            raise OSError(errno.EBADF, "stdout is closed")
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as e:
        raise StdoutError(f"cannot write the summary to stdout ({e.strerror}): no output written")


def silence_stdout():
    """Point a stdout that failed at /dev/null, so that the interpreter's last flush of what it
    still holds does not fail again (a second report, another exit status)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no stdout at all
        pass


def run(args):
    tok = ByteTokenizer() if args.bytes else HfTokenizer(args.tokenizer)
    for flag, value, what in (("--bos", tok.bos, "begin"), ("--eos", tok.eos, "end")):
        if getattr(args, flag[2:]) and value is None:
            raise InputError(f"{flag}: this tokenizer has no {what}-of-text token"
                             + (" (--bytes: only the begin-of-document token 256)" if args.bytes else ""))
    writer = TokenFileWriter(args.out)
    inputs = Inputs(args.max_doc_bytes, writer.own)
    progress, lengths, skipped, nbytes, t0 = Progress(), [], 0, 0, time.monotonic()
    try:
        for name, data in documents(inputs, args.inputs, args.doc_per_folder):
            ids = tok.encode(name, data)
            nbytes += len(data)
            if len(ids) == 0:  # nothing to say: no document, not even its begin and end tokens
                skipped += 1
                continue
            if args.bos:
                ids = array.array("I", [tok.bos]) + array.array("I", ids)
            if args.eos:
                ids = array.array("I", ids) + array.array("I", [tok.eos])
            if max(ids) > MAX_TOKEN:
                raise InputError(f"{name}: token id {max(ids)} does not fit in 4 bytes")
            writer.add(ids)
            lengths.append(len(ids))
            progress.update(len(lengths), nbytes, writer.tokens)
        progress.done()
        if not lengths:
            raise InputError(f"{', '.join(args.inputs)}: an empty corpus (no document holds a token)")
        to_stdout(summary(lengths, writer.tokens, skipped, time.monotonic() - t0, args.out, tok.vocab))
        writer.commit()  # the last step: whatever fails before it leaves no output
    except BaseException:
        progress.done()  # the message starts a line of its own
        writer.abandon()
        raise


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a number of bytes of at least 1 expected, not {text!r}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Text to a version-2 token file with documents (./train --data).")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--bytes", action="store_true", help="byte-level tokens 0..255, 256 the begin-of-document token")
    which.add_argument("--tokenizer", metavar="PATH", help="a Hugging Face tokenizer.json, or the folder holding it")
    p.add_argument("--out", required=True, metavar="FILE", help="the token file to write")
    p.add_argument("--bos", action="store_true", help="each document starts with the begin-of-text token")
    p.add_argument("--eos", action="store_true", help="each document ends with the end-of-text token")
    p.add_argument("--doc-per-folder", action="store_true", help="a folder's subfolders are the documents")
    p.add_argument("--max-doc-bytes", type=positive_int, default=MAX_DOC_BYTES, metavar="N",
                   help=f"refuse a document (a file, a JSON line, a --doc-per-folder subfolder) over N bytes (default {MAX_DOC_BYTES})")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files, folders, or .jsonl files")
    return p.parse_args(argv)


def fail(message, status):
    say(message)
    sys.exit(status)


def main(argv=None):
    if hasattr(sys.stdout, "reconfigure"):  # a file name that is not UTF-8 in the summary
        sys.stdout.reconfigure(errors="backslashreplace")
    args = parse_args(argv)
    try:
        run(args)
    except InputError as e:
        fail(str(e), 2)
    except StdoutError as e:
        silence_stdout()
        fail(str(e), 1)
    except MemoryError:
        fail("out of memory (a smaller --max-doc-bytes bounds one document's share)", 3)
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except Interrupted as e:
        fail(f"interrupted ({signal.Signals(e.signum).name})", 128 + e.signum)
    except Exception as e:  # a bug: said in one line, with the place it happened
        where = traceback.extract_tb(e.__traceback__)[-1]
        fail(f"internal error (a bug): {type(e).__name__}: {e} at {os.path.basename(where.filename)}:{where.lineno}", 1)


def interrupted(signum, frame):
    raise Interrupted(signum)


if __name__ == "__main__":
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupted)
    main()
