"""What ``tokenmill prepare`` reads: the input files, their kind, and a description of the source.

Inputs (any number, in the order given; each expands in sorted order):

* a file; its kind from its name: ``.jsonl`` / ``.json`` / ``.ndjson`` (JSON Lines: one object per
  line, the text in ``--text-field``), ``.parquet`` (the ``--text-field`` column), ``.arrow`` (an Arrow
  IPC stream or file, as Hugging Face ``datasets`` writes), anything else UTF-8 text (the whole file
  is one document). ``.gz`` / ``.zst`` after the name mean gzip / Zstandard compression
  (``notes.txt.gz``, ``shard-00001.jsonl.zst``). ``--format`` overrides the kind for every file;
* a folder: a Hugging Face ``datasets`` folder (``save_to_disk`` output: ``state.json`` naming its
  ``.arrow`` files, or ``dataset_dict.json`` naming split folders, each read in turn), else the files
  matching ``--glob`` (default: every file of a known kind, recursively);
* a glob pattern (quote it: ``'data/**/*.jsonl.gz'``), matched recursively.

* a pipe: process substitution (``<(zcat corpus.jsonl.gz)``), ``/dev/stdin`` or a named FIFO. It is read
  once, as a stream; its kind comes from its name when that tells it, else from its first bytes (gzip or
  Zstandard magic, then a first line that is a JSON object: JSON Lines; Parquet or Arrow magic; else
  text). What needs two passes (training a BPE) or random access (Parquet, Arrow) reads a copy that
  :func:`spool` writes first.

Every input file carries a stable key (its path relative to the folder or pattern it came from), which
decides its documents' train/val split, and its size (0 for a pipe: unknown).
"""

from __future__ import annotations

import codecs
import glob as globmod
import hashlib
import json
import os
import stat
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from tokenmill.errors import DataError
from tokenmill.paths import check_glob, check_text

from .stdlib import embedded_corpus_files, stdlib_root

KINDS = ("text", "jsonl", "parquet", "arrow")
COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_KIND_OF_SUFFIX = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
# the files a folder contributes when --glob is not given
DEFAULT_PATTERNS = tuple(
    f"**/*{s}{c}" for s in (".txt", ".jsonl", ".json", ".ndjson") for c in ("", ".gz", ".zst")
) + ("**/*.parquet", "**/*.arrow")
DEFAULT_GLOB_HELP = "*.txt, *.jsonl, *.json, *.ndjson (each also .gz / .zst), *.parquet, *.arrow, recursively"


@dataclass(frozen=True)
class InputFile:
    """One input file: ``key`` (stable name for splits and reports), ``kind`` (one of :data:`KINDS`),
    ``compression`` (None, 'gzip', 'zstd'), ``size`` (bytes on disk; 0 for a pipe), ``mtime_ns``, ``pipe``
    (read once, as a stream: see :func:`open_pipe`)."""

    path: Path
    key: str
    kind: str
    compression: str | None
    size: int
    mtime_ns: int
    pipe: bool = False


def kind_of(path: Path, fmt: str = "auto") -> tuple[str, str | None]:
    """(kind, compression) of a file from its name (``fmt`` other than 'auto' forces the kind)."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = COMPRESSION.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    if fmt != "auto":
        return fmt, compression
    return _KIND_OF_SUFFIX.get(suffixes[-1] if suffixes else "", "text"), compression


def _input_file(path: Path, key: str, fmt: str) -> InputFile:
    check_text(path, "input file")  # its key goes into meta.json, the journal and the split hash
    if is_pipe(path):
        return _pipe_input(path, key, fmt)
    kind, compression = kind_of(path, fmt)
    if kind in ("parquet", "arrow") and compression:
        raise DataError(
            f"'{path}': a compressed {kind} file cannot be read in pieces. Fix: decompress it (Parquet and "
            "Arrow compress their own columns)."
        )
    st = path.stat()
    return InputFile(path, key, kind, compression, st.st_size, st.st_mtime_ns)


def is_pipe(path: Path) -> bool:
    """Whether ``path`` is a pipe (a FIFO: process substitution, ``/dev/stdin`` fed by a pipe, ``mkfifo``)."""
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


class PipeReader:
    """A pipe opened once, with the bytes already read to tell its kind (``head``) given back first."""

    def __init__(self, path: Path):
        try:  # not blocking: opening a FIFO nobody writes to would wait forever
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            raise DataError(f"input pipe '{path}' cannot be opened ({e.strerror}).") from None
        self.name, self.taken = str(path), False
        first = _first_bytes(fd, path)
        self.head = first or b""
        os.set_blocking(fd, True)
        self.f = os.fdopen(fd, "rb", buffering=0)
        ended = first == b""
        while not ended and len(self.head) < SNIFF_BYTES and b"\n" not in self.head:
            more = self.f.read(SNIFF_BYTES - len(self.head))
            ended = not more
            self.head += more

    def read(self, n: int = -1) -> bytes:
        if self.head:
            out, self.head = self.head, b""
            return out
        return self.f.read(n) if n > 0 else self.f.readall()

    def __enter__(self) -> PipeReader:
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


SNIFF_BYTES = 1 << 16  # read from a pipe to tell its kind: up to the first newline
WRITER_WAIT_S = 10.0  # how long a named FIFO may wait for its writer


def _first_bytes(fd: int, path: Path) -> bytes | None:
    """The first bytes of a pipe opened without blocking: None while its writer has written nothing yet, b''
    for one that ends at once. A named FIFO with no writer yet gets :data:`WRITER_WAIT_S` for one to appear,
    then a :class:`DataError`."""
    try:
        anonymous = os.readlink(path).startswith("pipe:")  # /dev/fd/N of a shell's <(...): its writer ran
    except OSError:
        anonymous = False
    deadline = time.monotonic() + WRITER_WAIT_S
    while True:
        try:
            data = os.read(fd, SNIFF_BYTES)
        except BlockingIOError:  # a writer, no bytes yet
            return None
        if data or anonymous:
            return data
        if time.monotonic() > deadline:
            os.close(fd)
            raise DataError(f"input '{path}' is a pipe (FIFO) that nobody wrote to within {WRITER_WAIT_S:.0f} s. "
                            "Fix: start the program that writes to it first, or pass a file.")
        time.sleep(0.05)
_PIPES: dict[str, PipeReader] = {}  # the pipes opened by collect_inputs, until read


def _pipe_input(path: Path, key: str, fmt: str) -> InputFile:
    reader = _PIPES.get(str(path))
    if reader is None or reader.taken:  # not yet opened, or read by an earlier prepare in this process
        reader = _PIPES[str(path)] = PipeReader(path)
    kind, compression = kind_of(path, fmt)
    named = any(s.lower() in _KIND_OF_SUFFIX or s.lower() in COMPRESSION for s in path.suffixes)
    if not named:
        compression = _MAGIC.get(reader.head[:4]) or _MAGIC.get(reader.head[:2])
        if fmt == "auto":
            kind = _sniff_kind(reader.head, compression)
    return InputFile(path, key, kind, compression, 0, 0, pipe=True)


_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd"}


def _sniff_kind(head: bytes, compression: str | None) -> str:
    """The kind of a pipe from its first bytes: Parquet, Arrow, JSON Lines (a first line that is a JSON
    object) or text."""
    if compression == "gzip":
        head = zlib.decompressobj(wbits=31).decompress(head, SNIFF_BYTES)
    elif compression == "zstd":
        try:
            import zstandard

            head = zstandard.ZstdDecompressor().decompressobj().decompress(head)[:SNIFF_BYTES]
        except (ImportError, Exception):  # zstd's own errors: read as text, the reader reports them
            return "text"
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"ARROW1") or head.startswith(b"\xff\xff\xff\xff"):
        return "arrow"
    first = head.removeprefix(codecs.BOM_UTF8).split(b"\n", 1)[0].strip()
    try:
        return "jsonl" if first.startswith(b"{") and isinstance(json.loads(first), dict) else "text"
    except (ValueError, RecursionError):  # not JSON, or nested too deep: text (a JSON reader would refuse it)
        return "text"


def open_pipe(inp: InputFile) -> PipeReader:
    """The pipe of ``inp``, opened when the inputs were collected; a second read is refused (a pipe's bytes
    are gone once read)."""
    reader = _PIPES.get(str(inp.path))
    if reader is None or reader.taken:
        raise DataError(f"input '{inp.path}' is a pipe and was read already: a pipe can be read only once. Fix: "
                        "save it to a file and pass the file.")
    reader.taken = True
    return reader


def spool(inp: InputFile, folder: Path) -> InputFile:
    """A copy of pipe ``inp`` in ``folder`` (for a BPE trained on it, read twice, or Parquet / Arrow, read
    out of order), read in one pass; the input file that reads the copy, with the pipe's key and kind."""
    folder.mkdir(exist_ok=True)
    dest = folder / f"{hashlib.sha256(inp.key.encode()).hexdigest()[:16]}-{inp.path.name}"  # the same each run
    with open_pipe(inp) as src, open(dest, "wb") as out:
        while chunk := src.read(1 << 20):
            out.write(chunk)
    st = dest.stat()
    return InputFile(dest, inp.key, inp.kind, inp.compression, st.st_size, st.st_mtime_ns)


def hf_dataset_files(folder: Path) -> list[Path] | None:
    """The ``.arrow`` files of a Hugging Face ``save_to_disk`` folder, in order (None: not one). Every split
    and data file its JSON names must lie inside ``folder`` (:func:`tokenmill.paths.inside`)."""
    from tokenmill.filecheck import get, read_json
    from tokenmill.paths import inside

    if (folder / "dataset_dict.json").is_file():
        where = f"'{folder / 'dataset_dict.json'}'"
        splits = get(read_json(folder / "dataset_dict.json", "", DataError), "splits", list, where)
        out = []
        for i, split in enumerate(splits):
            files = hf_dataset_files(inside(folder, split, f"{where}: splits[{i}]", DataError))
            if files is None:
                raise DataError(f"'{folder}': split folder '{split}' of dataset_dict.json is not a saved dataset.")
            out += files
        return out
    if not (folder / "state.json").is_file():
        return None
    where = f"'{folder / 'state.json'}'"
    entries = get(read_json(folder / "state.json", "Hugging Face datasets state file", DataError), "_data_files",
                  list, where)
    return [inside(folder, get(d, "filename", str, f"{where}: _data_files[{i}]"), f"{where}: _data_files[{i}].filename",
                   DataError) for i, d in enumerate(entries)]


def _folder_files(path: Path, glob: str | None, fmt: str) -> tuple[list[Path], str]:
    hf = hf_dataset_files(path)
    if hf is not None and glob is None:
        missing = [p.name for p in hf if not p.is_file()]
        if missing:
            raise DataError(f"Hugging Face dataset folder '{path}' lacks {missing}. Fix: save the dataset again.")
        return hf, f"Hugging Face dataset folder {path.resolve()} ({len(hf)} arrow files)"
    patterns = [glob] if glob is not None else list(DEFAULT_PATTERNS)
    found = {p for pat in patterns for p in path.glob(pat) if p.is_file()}
    files = sorted(found, key=lambda p: p.relative_to(path).as_posix())
    if not files:
        shown = glob if glob is not None else DEFAULT_GLOB_HELP
        raise DataError(
            f"input folder '{path}' has no files matching --glob '{shown}'. Fix: pass a different --glob "
            "(e.g. '**/*.md'), or a single file."
        )
    return files, f"folder {path.resolve()} (glob {glob or DEFAULT_GLOB_HELP!r}, {len(files)} files)"


def _pattern_files(pattern: str) -> tuple[list[Path], Path]:
    """The files a glob pattern matches (recursively with ``**``), and the folder before its first wildcard."""
    parts = Path(pattern).parts
    fixed = next(i for i, p in enumerate(parts) if any(c in p for c in "*?["))
    root = Path(*parts[:fixed]) if fixed else Path(".")
    files = sorted(Path(p) for p in globmod.glob(pattern, recursive=True) if Path(p).is_file())
    if not files:
        raise DataError(f"the pattern '{pattern}' matches no file. Fix: check the path (and quote the pattern).")
    return files, root


def collect_inputs(inputs, glob: str | None = None, max_files: int | None = None,
                   fmt: str = "auto") -> tuple[list[InputFile], str]:
    """The input files (see the module docstring) and a description of the source.

    ``inputs``: None (the embedded corpus: this Python's standard-library sources), a path, or a list
    of paths / glob patterns. ``max_files``: only the first N files."""
    if fmt not in ("auto", *KINDS):
        raise DataError(f"--format must be one of {['auto', *KINDS]}, got {fmt!r}.")
    if max_files is not None and max_files < 1:
        raise DataError(f"--max-files must be >= 1 (the first N files), got {max_files}. Fix: give a positive "
                        "count, or leave it out for every file.")
    if glob is not None:
        check_glob(glob)
    if inputs is None:
        root = stdlib_root()
        files = [_input_file(f, f.relative_to(root).as_posix(), "text") for f in embedded_corpus_files(max_files)]
        v = sys.version_info
        ver = f"{v.major}.{v.minor}.{v.micro}"
        return files, f"embedded corpus: Python {ver} standard library ({len(files)} .py files in {root})"
    items = [inputs] if isinstance(inputs, (str, Path)) else list(inputs)
    if not items:
        raise DataError("no INPUT given. Fix: pass files, folders or quoted glob patterns.")
    out, described = [], []
    for item in items:
        files, desc = _expand(check_text(item, "input"), glob, fmt, prefix=len(items) > 1)
        out += files
        described.append(desc)
    if max_files is not None:
        out = out[:max_files]
    keys = [f.key for f in out]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})[:3]
        raise DataError(f"inputs {dup} are given more than once. Fix: name each file once.")
    return out, "; ".join(described)


def _expand(item, glob: str | None, fmt: str, prefix: bool) -> tuple[list[InputFile], str]:
    path = Path(item)
    if path.is_file() or is_pipe(path):
        key = path.as_posix() if prefix else path.name
        return [_input_file(path, key, fmt)], (f"pipe {path}" if is_pipe(path) else f"file {path.resolve()}")
    if path.is_dir():
        files, desc = _folder_files(path, glob, fmt)
        head = path.resolve().name + "/" if prefix else ""
        return [_input_file(f, head + f.relative_to(path).as_posix(), fmt) for f in files], desc
    if any(c in str(item) for c in "*?["):
        files, root = _pattern_files(str(item))
        rel = [f.relative_to(root).as_posix() if f.is_relative_to(root) else f.as_posix() for f in files]
        head = f"{item}:" if prefix else ""
        return [_input_file(f, head + r, fmt) for f, r in zip(files, rel)], f"pattern {item!r} ({len(files)} files)"
    raise DataError(
        f"input '{path}' does not exist. Fix: pass a text, JSONL or Parquet file, a folder, a quoted glob pattern, "
        "or no INPUT for the embedded corpus."
    )


@dataclass
class Piece:
    """A bounded part of input file ``file`` (its index). ``start``/``end``: positions ``[unit, record]``
    before and after it (``end`` None: the file ends with it); ``span``: the units it covers (a byte
    range, or row groups / record batches [a, b)); ``data``: its bytes when read from a stream;
    ``disk``: the file bytes it accounts for (progress); ``error``: a problem found while cutting; ``raw``:
    for a stream, the file bytes read when it was cut (what a resumed prepare checks are unchanged)."""

    file: int
    start: list
    end: list | None
    span: tuple[int, int]
    data: bytes | None = None
    disk: int = 0
    error: str | None = None
    raw: int | None = None

    @property
    def first(self) -> bool:
        return self.start[0] == 0


def missing_input(inp: InputFile) -> DataError:
    e = DataError(
        f"input file '{inp.path}' was listed when prepare started but is gone now (a shard that vanished "
        "mid-run). Fix: restore it and run the same command again (prepare resumes where it stopped), or "
        "leave it out of INPUT."
    )
    e.resumable = True
    return e
