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

Every input file carries a stable key (its path relative to the folder or pattern it came from), which
decides its documents' train/val split, and its size and modification time (what a resumed prepare
compares).
"""

from __future__ import annotations

import glob as globmod
import json
import sys
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
    ``compression`` (None, 'gzip', 'zstd'), ``size`` (bytes on disk), ``mtime_ns``."""

    path: Path
    key: str
    kind: str
    compression: str | None
    size: int
    mtime_ns: int

    def identity(self) -> list:
        """What must be unchanged for a resumed prepare to reuse this file's tokens."""
        return [self.key, self.size, self.mtime_ns]


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
    kind, compression = kind_of(path, fmt)
    if kind in ("parquet", "arrow") and compression:
        raise DataError(
            f"'{path}': a compressed {kind} file cannot be read in pieces. Fix: decompress it (Parquet and "
            "Arrow compress their own columns)."
        )
    st = path.stat()
    return InputFile(path, key, kind, compression, st.st_size, st.st_mtime_ns)


def hf_dataset_files(folder: Path) -> list[Path] | None:
    """The ``.arrow`` files of a Hugging Face ``save_to_disk`` folder, in order (None: not one)."""
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"'{folder / 'dataset_dict.json'}' cannot be read ({e}).") from None
        out = []
        for split in splits:
            files = hf_dataset_files(folder / str(split))
            if files is None:
                raise DataError(f"'{folder}': split folder '{split}' of dataset_dict.json is not a saved dataset.")
            out += files
        return out
    if not (folder / "state.json").is_file():
        return None
    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        names = [d["filename"] for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"'{folder / 'state.json'}' is not a Hugging Face datasets state file ({e}).") from None
    return [folder / n for n in names]


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
    if path.is_file():
        key = path.as_posix() if prefix else path.name
        return [_input_file(path, key, fmt)], f"file {path.resolve()}"
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
    ``disk``: the file bytes it accounts for (progress); ``error``: a problem found while cutting."""

    file: int
    start: list
    end: list | None
    span: tuple[int, int]
    data: bytes | None = None
    disk: int = 0
    error: str | None = None

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
