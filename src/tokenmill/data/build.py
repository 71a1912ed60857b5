"""Where ``prepare`` builds a folder before it is put in place, and its journal (for resuming).

The folder is built in ``.NAME.prepare`` beside the output folder ``NAME`` (inside it when the parent
is not writable), locked while a prepare works in it. Every few seconds the prepare makes what it has
written durable and appends a line to ``journal.jsonl`` there: the position reached in the input
files and the state of each split. A prepare that is interrupted (Ctrl-C, a kill, a crash, a full
disk) leaves the build folder; the same command run again finds it, checks that the settings and
the bytes of the input files before the recorded position are unchanged (:class:`ContentChain`), cuts
the shards back to the last journal line that agrees and goes on from there. The output folder is only ever replaced by a complete build
(meta.json last), so it never looks complete when it is not.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

from tokenmill.atomic import fsync_dir
from tokenmill.errors import DataError
from tokenmill.filecheck import get, parse_json, shown

from .meta import META_NAME
from .shards import is_output_name

JOURNAL = "journal.jsonl"
LOCK = ".lock"
SPOOL = "spool"  # copies of pipe inputs that are read twice or out of order


def build_folder(out: Path) -> Path:
    """The build folder of ``out`` (created if needed): beside it, or inside it when the parent is not
    writable."""
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    name = f".{out.name}.prepare"
    for p in parent.glob(f".{out.name}.prepare-*"):  # left by an older tokenmill
        shutil.rmtree(p, ignore_errors=True)
    try:
        (parent / name).mkdir(exist_ok=True)
        return parent / name
    except PermissionError:  # a writable folder in a read-only parent: build inside it
        out.mkdir(exist_ok=True)
        (out / name).mkdir(exist_ok=True)
        return out / name


class BuildLock:
    """An exclusive lock on a build folder (released when the process ends, however it ends)."""

    def __init__(self, build: Path):
        self.path, self.fd = build / LOCK, None

    def __enter__(self) -> BuildLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # pragma: no cover - no fcntl (Windows): no lock
            pass
        except OSError:
            os.close(self.fd)
            self.fd = None
            raise DataError(
                f"another `tokenmill prepare` is writing to the same output right now (it holds '{self.path}'). Fix: "
                "wait for it to finish, or choose another --out."
            ) from None
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class ContentChain:
    """What a journal line was written against: a blake2b digest of the input files' bytes on disk read so
    far, in order (each file's key, then its bytes: the whole file for the files before a position, the
    first ``n`` bytes for the file it is in). A resumed prepare reads the done part once more (at disk speed,
    no tokenizing) and keeps a line only when the digests agree, so an edit anywhere in what was already
    read (in place, same size and modification time included) is found. Every byte is hashed, not samples
    plus the size: resuming costs one read of the done part, and no edit between samples slips through. A
    pipe cannot be read again: a line at or after one never agrees (the rerun starts from the pipe)."""

    def __init__(self, inputs):
        self.inputs, self.f = inputs, None
        self._reset()

    def _reset(self) -> None:
        self.close()
        self.chain, self.i = hashlib.blake2b(digest_size=20), 0
        self.h, self.n, self.whole = hashlib.blake2b(digest_size=20), 0, False

    def at(self, i: int, n: int | None) -> str:
        """The digest of files ``0..i-1`` whole and the first ``n`` bytes of file ``i`` (None: all of it).
        Positions are asked in order; an earlier one starts the reading over."""
        if i < self.i or (i == self.i and n is not None and (self.whole or n < self.n)):
            self._reset()
        while self.i < i:
            self._hash_to(None)
            self.chain.update(self._file_digest())
            self.close()
            self.i, self.h, self.n, self.whole = self.i + 1, hashlib.blake2b(digest_size=20), 0, False
        if any(f.pipe for f in self.inputs[: i + 1]):
            return f"pipe-{uuid.uuid4().hex}"
        self._hash_to(n)
        c = self.chain.copy()
        c.update(self._file_digest())
        return c.hexdigest()

    def _file_digest(self) -> bytes:
        return json.dumps([self.inputs[self.i].key, "whole" if self.whole else self.n]).encode() + self.h.digest()

    def _hash_to(self, n: int | None) -> None:
        """Hash file ``self.i`` on to byte ``n`` (None: its end)."""
        inp = self.inputs[self.i]
        if inp.pipe or self.whole:
            return
        if self.f is None:
            try:
                self.f = open(inp.path, "rb")
            except FileNotFoundError:
                from .sources import missing_input

                raise missing_input(inp) from None
            self.f.seek(self.n)
        while n is None or self.n < n:
            block = self.f.read(HASH_BLOCK if n is None else min(HASH_BLOCK, n - self.n))
            if not block:
                break
            self.h.update(block)
            self.n += len(block)
        self.whole = n is None

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


HASH_BLOCK = 1 << 20


class Journal:
    """``journal.jsonl``: a header with the settings, then one line per commit."""

    def __init__(self, build: Path):
        self.path = build / JOURNAL

    def read(self, settings: dict) -> list[dict]:
        """The commit lines of a journal written with ``settings`` (empty: none, or other settings). A line
        that is not a journal record (cut, not UTF-8, invalid JSON, a wrong field) ends it: the lines before
        it stand, and a note names it unless it is a last line cut by the interruption."""
        try:
            raw = self.path.read_bytes()
        except OSError:
            return []
        lines, out = raw.splitlines(), []
        for i, line in enumerate(lines):
            where = f"'{self.path}' line {i + 1}"
            try:
                rec = _journal_record(parse_json(line.decode("utf-8"), where), i == 0, where)
            except (UnicodeDecodeError, DataError) as e:
                if i + 1 < len(lines) or raw.endswith(b"\n"):  # not just cut by the interruption
                    why = str(e) if isinstance(e, DataError) else f"{where} is not UTF-8 text"
                    print(f"tokenmill: note: {why.rstrip('.')}; the interrupted prepare "
                          f"{'starts over' if i == 0 else 'resumes from before that line'}.", file=sys.stderr)
                break
            if i == 0 and rec["settings"] != settings:
                return []
            if i > 0:
                out.append(rec)
        return out

    def start(self, settings: dict, records: list[dict] = ()) -> None:
        """A new journal: the settings header, then ``records`` (those a resumed run keeps)."""
        self._write("".join(json.dumps(r) + "\n" for r in [{"settings": settings}, *records]), "w")

    def append(self, record: dict) -> None:
        self._write(json.dumps(record) + "\n", "a")

    def _write(self, text: str, mode: str) -> None:
        with open(self.path, mode, encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def _journal_record(rec: object, header: bool, where: str) -> dict:
    """A journal line checked (DataError naming ``where`` and the field): the settings header, the trained
    tokenizer's line, or a commit (position, split states, counts) as ``prepare`` writes them."""
    if header:
        get(rec, "settings", dict, where)
        return rec
    if "tokenizer_sha256" in rec if isinstance(rec, dict) else False:
        get(rec, "tokenizer_sha256", str, where)
        get(rec, "content", str, where)
        return rec
    get(rec, "file", int, where, lo=0)
    get(rec, "n", int, where, lo=0, nullable=True)
    get(rec, "content", str, where)
    get(rec, "bytes", int, where, lo=0)
    pos, doc = get(rec, "pos", list, where, nullable=True), get(rec, "open_doc", list, where, nullable=True)
    for name, value in (("pos", pos), ("open_doc", doc)):
        if value is not None and len(value) != 2:
            raise DataError(f"{where}: '{name}' must be a pair, got {shown(value)}.")
    for p in pos or ():
        get({"pos": p}, "pos", int, where, lo=0)
    if doc is not None and (doc[0] not in ("train", "val") or get({"open_doc": doc[1]}, "open_doc", int, where, lo=0) < 0):
        raise DataError(f"{where}: 'open_doc' must be a split ('train' or 'val') and a position, got {shown(doc)}.")
    counts = get(rec, "counts", dict, where)
    for key in ("bad", "empty", "text_chars"):
        get(counts, key, int, f"{where}: counts", lo=0)
    get(counts, "first_bad", str, f"{where}: counts", nullable=True)
    for split, state in get(rec, "splits", dict, where).items():
        at = f"{where}: splits.{split}"
        for key in ("tokens", "documents"):
            get(state, key, int, at, lo=0)
        get(state, "last_doc", int, at, lo=0, nullable=True)
        for k, digest in get(state, "done", dict, at).items():
            if not k.isdigit():
                raise DataError(f"{at}: 'done' has the key {shown(k)}, which is not a shard number.")
            get({f"done.{k}": digest}, f"done.{k}", str, at)
    return rec


def clear_build(build: Path, keep: tuple[str, ...] = (LOCK, SPOOL)) -> None:
    """Empty the build folder (a fresh start), keeping ``keep``."""
    for p in build.iterdir():
        if p.name not in keep:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _outputs(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if is_output_name(p.name) or p.name in _names_written()]


def swap_into_place(build: Path, out: Path) -> None:
    """Put the complete folder ``build`` in place of ``out``. An existing ``out`` is renamed aside,
    ``build`` renamed to ``out``, and files of the old folder that a preparation does not write (the
    user's) moved back in; where folders cannot be renamed (a mount point, ``build`` inside ``out``)
    the files are replaced one by one, meta.json removed first and written last."""
    for name in (JOURNAL, LOCK):
        (build / name).unlink(missing_ok=True)
    shutil.rmtree(build / SPOOL, ignore_errors=True)
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
                if not (is_output_name(p.name) or p.name in _names_written()):
                    os.replace(p, out / p.name)
            shutil.rmtree(old, ignore_errors=True)
            fsync_dir(parent)
            return
    (out / META_NAME).unlink(missing_ok=True)  # the folder is incomplete until the new meta.json lands
    for p in _outputs(out):
        if p.name != META_NAME and not (build / p.name).exists():
            p.unlink()  # e.g. a stale tokenizer.json of an earlier bpe folder, or shards of a larger split
    for p in _outputs(build):
        if p.name != META_NAME:
            os.replace(p, out / p.name)
    os.replace(build / META_NAME, out / META_NAME)
    fsync_dir(out)
    shutil.rmtree(build, ignore_errors=True)


def _names_written() -> tuple[str, ...]:
    from .tokenizers import TOKENIZER_FILE

    return (TOKENIZER_FILE, META_NAME, "chat_template.jinja")  # the last: chat data's template (data/chat.py)
