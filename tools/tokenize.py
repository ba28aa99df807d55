#!/usr/bin/env python3
"""tools/tokenize.py - text to a version-2 token file with documents, for ./train --data.

    python3 tools/tokenize.py (--bytes | --tokenizer PATH) --out FILE [--bos] [--eos]
                              [--doc-per-folder] INPUT...

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
summary (documents, tokens, the length distribution) at the end. Bad input gets a message naming
the file and exit status 2; the standard library only, `tokenizers` only for --tokenizer.
"""
import argparse
import array
import json
import os
import struct
import sys
import time

BYTES_BOS = 256
MAX_TOKEN = 2**32 - 1  # token ids are uint32


class InputError(Exception):
    """Bad input: the message names the file; exit status 2."""


# ---------------------------------------------------------------------------------------------
# Documents: (name, bytes) in order, from files, folders and JSON lines.
def files_under(folder):
    """Every regular file under folder, in sorted order of its path (hidden entries skipped)."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(os.path.join(root, f) for f in sorted(files) if not f.startswith("."))
    return sorted(found)


def read_file(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror})")


def jsonl_documents(path):
    data = read_file(path)
    for n, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"{path}:{n}: not a JSON object ({e})")
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise InputError(f"{path}:{n}: a JSON object with a string \"text\" expected")
        yield f"{path}:{n}", obj["text"].encode("utf-8")


def documents(inputs, doc_per_folder):
    for item in inputs:
        if os.path.isdir(item):
            if not doc_per_folder:
                for path in files_under(item):
                    yield path, read_file(path)
                continue
            for entry in sorted(os.listdir(item)):
                path = os.path.join(item, entry)
                if entry.startswith("."):
                    continue
                if os.path.isdir(path):
                    yield path, b"".join(read_file(p) for p in files_under(path))
                else:
                    yield path, read_file(path)
        elif item.endswith(".jsonl"):
            yield from jsonl_documents(item)
        elif os.path.exists(item):
            yield item, read_file(item)
        else:
            raise InputError(f"{item}: no such file or folder")


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
            raise InputError(f"{path}: no tokenizer.json")
        try:
            self.tok = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # the package's own error types
            raise InputError(f"{file}: not a tokenizer ({e})")
        self.vocab = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos = self.special(file, "bos_token")
        self.eos = self.special(file, "eos_token")

    def special(self, file, key):
        """The id of tokenizer_config.json's bos_token or eos_token, if both are there."""
        config = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        if not os.path.isfile(config):
            return None
        try:
            with open(config, encoding="utf-8") as f:
                value = json.load(f).get(key)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"{config}: unreadable ({e})")
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
class TokenFileWriter:
    def __init__(self, path):
        self.path, self.tmp = path, f"{path}.tmp{os.getpid()}"
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise InputError(f"{path}: no folder {folder}")
        self.f = open(self.tmp, "wb")
        self.f.write(b"\0" * 32)
        self.tokens, self.starts = 0, array.array("Q")

    def add(self, ids):
        self.starts.append(self.tokens)
        arr = ids if isinstance(ids, array.array) else array.array("I", ids)
        if sys.byteorder != "little":
            arr.byteswap()
        arr.tofile(self.f)
        self.tokens += len(arr)

    def commit(self):
        if sys.byteorder != "little":
            self.starts.byteswap()
        self.starts.tofile(self.f)
        self.f.seek(0)
        self.f.write(b"LLTOKENS" + struct.pack("<IIQQ", 2, 4, self.tokens, len(self.starts)))
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)

    def abandon(self):
        self.f.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


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
        sys.stderr.write(f"\r  {docs} documents, {nbytes / 2**20:.1f} MiB read, {tokens} tokens, {rate:,.0f} tokens/s   ")
        sys.stderr.flush()

    def done(self):
        if self.shown:
            sys.stderr.write("\n")


def summary(lengths, tokens, skipped, seconds, out):
    lengths = sorted(lengths)
    pick = lambda q: lengths[min(len(lengths) - 1, int(q * len(lengths)))]
    print(f"{out}: {len(lengths)} documents, {tokens} tokens ({tokens / max(seconds, 1e-9):,.0f} tokens/s)"
          + (f"; {skipped} empty documents left out" if skipped else ""))
    print(f"  document length in tokens: min {lengths[0]}, median {pick(0.5)}, 90% {pick(0.9)}, "
          f"max {lengths[-1]}, mean {tokens / len(lengths):.1f}")


def run(args):
    tok = ByteTokenizer() if args.bytes else HfTokenizer(args.tokenizer)
    for flag, value, what in (("--bos", tok.bos, "begin"), ("--eos", tok.eos, "end")):
        if getattr(args, flag[2:]) and value is None:
            raise InputError(f"{flag}: this tokenizer has no {what}-of-text token"
                             + (" (--bytes: only the begin-of-document token 256)" if args.bytes else ""))
    writer = TokenFileWriter(args.out)
    try:
        progress, lengths, skipped, nbytes, t0 = Progress(), [], 0, 0, time.monotonic()
        for name, data in documents(args.inputs, args.doc_per_folder):
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
        writer.commit()
    except BaseException:
        writer.abandon()
        raise
    summary(lengths, writer.tokens, skipped, time.monotonic() - t0, args.out)
    print(f"  vocabulary {tok.vocab} (a --config with at least that many tokens reads it)")


def main():
    p = argparse.ArgumentParser(description="Text to a version-2 token file with documents (./train --data).")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--bytes", action="store_true", help="byte-level tokens 0..255, 256 the begin-of-document token")
    which.add_argument("--tokenizer", metavar="PATH", help="a Hugging Face tokenizer.json, or the folder holding it")
    p.add_argument("--out", required=True, metavar="FILE", help="the token file to write")
    p.add_argument("--bos", action="store_true", help="each document starts with the begin-of-text token")
    p.add_argument("--eos", action="store_true", help="each document ends with the end-of-text token")
    p.add_argument("--doc-per-folder", action="store_true", help="a folder's subfolders are the documents")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files, folders, or .jsonl files")
    args = p.parse_args()
    try:
        run(args)
    except InputError as e:
        print(f"tokenize.py: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
