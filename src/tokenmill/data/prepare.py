"""``tokenmill prepare``: text files -> a token folder (train.bin, val.bin, meta.json[, tokenizer.json]).

Every input file is one document. Documents are tokenized in parallel (a process pool over files,
large files cut into ~1 MiB chunks at line starts, where cutting does not change the tokenization)
and concatenated in sorted path order, each followed by the tokenizer's end-of-text id (a newline
for ``bytes``). The train/val split is by document: a document goes to val when a stable hash of
(seed, its relative path) falls below ``val_fraction``, so the split does not depend on the machine,
the worker count or the other files. With a single document, its last ``val_fraction`` of tokens is
the validation split.

Files are written under temporary names and renamed into place; ``meta.json`` comes last, so a
folder with a meta.json is complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import multiprocessing as mp
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tokenmill.errors import DataError

from .meta import (
    DTYPES,
    FORMAT,
    META_NAME,
    VERSION,
    dtype_for_vocab,
    fsync_dir,
    sha256_file,
    tmp_name,
    write_text_atomic,
)
from .stdlib import embedded_corpus_files, stdlib_root
from .tokenizers import (
    TOKENIZER_FILE,
    BpeTokenizer,
    get_tokenizer,
    train_bpe,
)

DEFAULT_GLOB = "**/*.txt"
CHUNK_BYTES = 1 << 20
_WHITESPACE = b" \t\n\r\x0b\x0c"


def _collect_input(
    input: str | Path | None, glob: str, max_files: int | None
) -> tuple[list[tuple[Path, str]], str]:
    """(path, stable key) per document, sorted, and a description of the source."""
    if input is None:
        root = stdlib_root()
        files = embedded_corpus_files(max_files)
        docs = [(f, f.relative_to(root).as_posix()) for f in files]
        v = sys.version_info
        ver = f"{v.major}.{v.minor}.{v.micro}"
        return docs, f"embedded corpus: Python {ver} standard library ({len(docs)} .py files in {root})"
    path = Path(input)
    if path.is_file():
        return [(path, path.name)], f"file {path.resolve()}"
    if path.is_dir():
        files = sorted(
            (p for p in path.glob(glob) if p.is_file()), key=lambda p: p.relative_to(path).as_posix()
        )
        if max_files is not None:
            files = files[:max_files]
        if not files:
            raise DataError(
                f"input folder '{path}' has no files matching --glob '{glob}'. Fix: pass a different "
                "--glob (e.g. '**/*.md'), or a single text file."
            )
        return [(f, f.relative_to(path).as_posix()) for f in files], (
            f"folder {path.resolve()} (glob {glob!r}, {len(files)} files)"
        )
    raise DataError(
        f"input '{path}' does not exist. Fix: pass a text file or a folder of text files, or no INPUT for "
        "the embedded corpus."
    )


def _is_val(keys: list[str], val_fraction: float, seed: int) -> list[bool]:
    """Per document: in the validation split? Deterministic; >= 1 doc per split when len(keys) >= 2."""
    if len(keys) < 2 or val_fraction <= 0:
        return [False] * len(keys)
    u = [int.from_bytes(hashlib.sha256(f"{seed}:{k}".encode()).digest()[:8], "little") / 2**64 for k in keys]
    flags = [x < val_fraction for x in u]
    if not any(flags):
        flags[min(range(len(u)), key=u.__getitem__)] = True
    if all(flags):
        flags[max(range(len(u)), key=u.__getitem__)] = False
    return flags


def _chunks(path: Path, size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges covering the file, cut after a newline that has non-whitespace on both sides
    (a cut there leaves GPT-2-style pre-tokenization unchanged and never splits a UTF-8 char)."""
    if size <= chunk_bytes:
        return [(0, size)]
    cuts = [0]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = chunk_bytes
        while pos < size:
            i = mm.find(b"\n", pos)
            while i != -1 and i + 1 < size and (mm[i - 1] in _WHITESPACE or mm[i + 1] in _WHITESPACE):
                i = mm.find(b"\n", i + 1)
            if i == -1 or i + 1 >= size:
                break
            cuts.append(i + 1)
            pos = i + 1 + chunk_bytes
    cuts.append(size)
    return list(zip(cuts[:-1], cuts[1:]))


_WORKER_TOKENIZER = None


def _init_worker(tokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer


def _encode_unit(unit: tuple[str, int, int, int, bool, str]) -> tuple[int, bool, np.ndarray, int]:
    """Tokenize one byte range of one file -> (doc index, last chunk of the doc?, ids, bytes read)."""
    path, start, end, doc, last, dtype = unit
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    try:
        text = data.decode("utf-8-sig" if start == 0 else "utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"'{path}' is not UTF-8 text (bad byte {data[e.start]:#04x} at byte offset {start + e.start}). "
            "Fix: convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or exclude it with --glob."
        ) from None
    return doc, last, _WORKER_TOKENIZER.encode_array(text, DTYPES[dtype]), end - start


@contextlib.contextmanager
def _pool(workers: int, tokenizer) -> Iterator[mp.pool.Pool]:
    """A process pool holding the tokenizer (fork where available: no re-import, no pickling)."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    # HF tokenizers warns (and disables its threads) in forked children once it has used threads; the
    # workers are the parallelism, so switch its threads off in them explicitly.
    had = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = mp.get_context(method).Pool(workers, initializer=_init_worker, initargs=(tokenizer,))
    finally:
        if had is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = had
    with pool:
        yield pool


def prepare(
    input: str | Path | None,
    out_dir: str | Path,
    tokenizer="bpe",
    vocab_size: int = 4096,
    val_fraction: float = 0.1,
    workers: int | None = None,
    seed: int = 0,
    progress: bool = True,
    glob: str = DEFAULT_GLOB,
    max_files: int | None = None,
    tokenizer_from: str | None = None,
) -> Path:
    """Tokenize ``input`` into the token folder ``out_dir`` and return its path.

    input: a UTF-8 text file, a folder (files matching ``glob``, sorted by relative path), or None for
      the embedded corpus (this Python's standard-library sources).
    tokenizer: 'bpe' (trained here on the training documents to ``vocab_size`` ids, saved as
      tokenizer.json), 'bytes', 'gpt2', or a tokenizer object (name, vocab_size, eot_id, encode_array).
    workers: tokenizer processes (None: one per CPU, at most one per chunk; 1: in this process).
    max_files: use only the first N files (folders and the embedded corpus).
    tokenizer_from: where a reused tokenizer came from (see :func:`tokenizer_from`); recorded in
      meta.json as ``tokenizer.from``.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}. Fix: e.g. --val-fraction 0.1.")
    given = Path(out_dir)
    if given.exists() and not given.is_dir():
        raise DataError(f"--out '{given}' exists and is not a folder. Fix: choose another --out, or move the file "
                        "away.")
    # the folder itself (a link: the folder it points to, the link stays), as an absolute path
    out = given.resolve() if given.is_symlink() else Path(os.path.abspath(given))
    docs, source = _collect_input(input, glob, max_files)
    docs = [(p, k, p.stat().st_size) for p, k in docs]
    docs = [d for d in docs if d[2] > 0]
    if not docs:
        raise DataError(f"input {source} holds only empty files. Fix: pass files with text.")
    is_val = _is_val([k for _, k, _ in docs], val_fraction, seed)

    # Everything is written into a temporary folder and swapped into place once complete: a failure
    # (bad input, interrupt, full disk) leaves an existing ``out`` exactly as it was.
    build = _build_folder(out)
    try:
        _prepare_into(build, docs, is_val, source, tokenizer, vocab_size, val_fraction, workers, seed, progress,
                      tokenizer_from)
        _swap_into_place(build, out)
    finally:
        if build.exists():
            shutil.rmtree(build, ignore_errors=True)
    return given


def _prepare_into(out: Path, docs, is_val, source, tokenizer, vocab_size, val_fraction, workers, seed, progress,
                  tokenizer_from) -> None:
    """Tokenize ``docs`` into the (new, empty) folder ``out``: the body of :func:`prepare`."""
    if isinstance(tokenizer, str) and tokenizer == "bpe":
        train_docs = [p for (p, _, _), v in zip(docs, is_val) if not v]
        tok = train_bpe(train_docs, vocab_size, out / TOKENIZER_FILE)
    elif isinstance(tokenizer, str):
        tok = get_tokenizer(tokenizer)
    else:
        tok = tokenizer
    dtype = dtype_for_vocab(tok.vocab_size)
    # documents end with the end-of-text id; without one, with the ids of a newline
    sep_ids = [tok.eot_id] if tok.eot_id is not None else (list(tok.encode_array("\n")) or [10])
    sep = np.asarray(sep_ids, dtype=DTYPES[dtype]).tobytes()

    units = [
        (str(p), a, b, i, b == size, dtype)
        for i, (p, _, size) in enumerate(docs)
        for a, b in _chunks(p, size, CHUNK_BYTES)
    ]
    if workers is None:
        workers = os.cpu_count() or 1
    workers = max(1, min(workers, len(units)))
    tmp = {split: tmp_name(out / f"{split}.bin") for split in ("train", "val")}
    ndocs = {"train": 0, "val": 0}
    try:
        with contextlib.ExitStack() as stack:
            files = {s: stack.enter_context(open(p, "wb")) for s, p in tmp.items()}
            bar = stack.enter_context(
                tqdm(
                    total=sum(d[2] for d in docs),
                    unit="B",
                    unit_scale=True,
                    desc="tokenizing",
                    disable=not progress,
                    file=sys.stderr,
                    dynamic_ncols=True,
                )
            )
            if workers == 1:
                _init_worker(tok)
                results = map(_encode_unit, units)
            else:
                pool = stack.enter_context(_pool(workers, tok))
                results = pool.imap(_encode_unit, units, chunksize=max(1, len(units) // (workers * 16)))
            for doc, last, ids, nbytes in results:
                split = "val" if is_val[doc] else "train"
                files[split].write(ids.tobytes())
                if last:
                    files[split].write(sep)
                    ndocs[split] += 1
                bar.update(nbytes)
        if len(docs) == 1 and val_fraction > 0:
            _move_tail(tmp["train"], tmp["val"], val_fraction, DTYPES[dtype].itemsize)
        splits = {}
        for split in ("train", "val"):
            nbytes = tmp[split].stat().st_size
            splits[split] = {
                "file": f"{split}.bin",
                "tokens": nbytes // DTYPES[dtype].itemsize,
                "sha256": sha256_file(tmp[split]),
                "documents": ndocs[split],
            }
        if isinstance(tok, BpeTokenizer):
            if tok.path is None or Path(tok.path).resolve() != (out / TOKENIZER_FILE).resolve():
                tok.save(out / TOKENIZER_FILE)  # a BPE tokenizer passed in: keep a copy beside the data
        for split in ("train", "val"):
            os.replace(tmp[split], out / f"{split}.bin")
    finally:
        for p in tmp.values():
            p.unlink(missing_ok=True)
    info = {"name": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id}
    if tok.name == "bpe":
        info["file"] = TOKENIZER_FILE
    if tokenizer_from is not None:
        info["from"] = str(tokenizer_from)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": info,
        "vocab_size": tok.vocab_size,
        "dtype": dtype,
        "splits": splits,
        "source": source,
        "prepare": {"val_fraction": val_fraction, "seed": seed, "documents": len(docs)},
    }
    write_text_atomic(out / META_NAME, json.dumps(meta, indent=2) + "\n")


# files a preparation writes; anything else in an existing output folder is the user's and is kept
_OUTPUTS = ("train.bin", "val.bin", TOKENIZER_FILE, META_NAME)


def _build_folder(out: Path) -> Path:
    """A new temporary folder beside ``out`` (inside it when its parent is not writable); stale ones
    left by a killed ``prepare`` of the same folder are removed first."""
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out.name}.prepare-"
    for p in parent.glob(prefix + "*"):
        pid = p.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
    name = f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        (parent / name).mkdir()
        return parent / name
    except PermissionError:  # a writable folder in a read-only parent: build inside it
        out.mkdir(exist_ok=True)
        (out / name).mkdir()
        return out / name


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _swap_into_place(build: Path, out: Path) -> None:
    """Put the complete folder ``build`` in place of ``out``. An existing ``out`` is renamed aside,
    ``build`` renamed to ``out``, and files of the old folder that a preparation does not write (the
    user's) moved back in; where folders cannot be renamed (a mount point, ``build`` inside ``out``)
    the files are replaced one by one, meta.json removed first and written last."""
    parent = out.parent
    cwd = Path.cwd().resolve()
    holds_cwd = cwd == out.resolve() or out.resolve() in cwd.parents  # never rename the working directory away
    if build.parent == parent and not holds_cwd:
        if not out.exists():
            os.replace(build, out)
            fsync_dir(parent)
            return
        old = parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.replace(out, old)
        except OSError:
            old = None
        if old is not None:
            os.replace(build, out)
            for p in old.iterdir():
                if p.name not in _OUTPUTS:
                    os.replace(p, out / p.name)
            shutil.rmtree(old, ignore_errors=True)
            fsync_dir(parent)
            return
    (out / META_NAME).unlink(missing_ok=True)  # the folder is incomplete until the new meta.json lands
    for name in _OUTPUTS:
        if name != META_NAME:
            if (build / name).exists():
                os.replace(build / name, out / name)
            else:
                (out / name).unlink(missing_ok=True)  # e.g. a stale tokenizer.json of an earlier bpe folder
    os.replace(build / META_NAME, out / META_NAME)
    fsync_dir(out)


def _move_tail(train: Path, val: Path, val_fraction: float, itemsize: int) -> None:
    """Single document: move the last ceil(n * val_fraction) tokens of the train file to val."""
    n = train.stat().st_size // itemsize
    n_val = min(n - 1, math.ceil(n * val_fraction)) if n > 1 else 0
    with open(train, "rb") as f:
        f.seek((n - n_val) * itemsize)
        tail = f.read()
    val.write_bytes(tail)
    os.truncate(train, (n - n_val) * itemsize)
