"""Where ``prepare`` builds a folder before it is put in place, and its journal (for resuming).

The folder is built in ``.NAME.prepare`` beside the output folder ``NAME`` (inside it when the parent
is not writable), locked while a prepare works in it. Every few seconds the prepare makes what it has
written durable and appends a line to ``journal.jsonl`` there: the position reached in the input
files and the state of each split. A prepare that is interrupted (Ctrl-C, a kill, a crash, a full
disk) leaves the build folder; the same command run again finds it, checks that the settings and
the input files before the recorded position are unchanged, cuts the shards back to the last
journal line and goes on from there. The output folder is only ever replaced by a complete build
(meta.json last), so it never looks complete when it is not.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from tokenmill.atomic import fsync_dir
from tokenmill.errors import DataError

from .meta import META_NAME
from .shards import is_output_name

JOURNAL = "journal.jsonl"
LOCK = ".lock"


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


def prefix_digest(identities: list[list]) -> list[str]:
    """sha256 of the identities of files 0..i, for each i (what a journal line was written against)."""
    h, out = hashlib.sha256(), []
    for ident in identities:
        h.update(json.dumps(ident).encode())
        out.append(h.copy().hexdigest())
    return out


class Journal:
    """``journal.jsonl``: a header with the settings, then one line per commit."""

    def __init__(self, build: Path):
        self.path = build / JOURNAL

    def read(self, settings: dict) -> list[dict]:
        """The commit lines of a journal written with ``settings`` (empty: none, or other settings)."""
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            return []
        out = []
        for i, line in enumerate(lines):
            try:
                rec = json.loads(line)
            except ValueError:
                break  # a line cut by the interruption: the ones before it stand
            if i == 0 and rec.get("settings") != settings:
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


def clear_build(build: Path, keep: tuple[str, ...] = (LOCK,)) -> None:
    """Empty the build folder (a fresh start), keeping ``keep``."""
    for p in build.iterdir():
        if p.name not in keep:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _outputs(folder: Path) -> list[Path]:
    from .tokenizers import TOKENIZER_FILE

    return [p for p in folder.iterdir() if is_output_name(p.name) or p.name in (TOKENIZER_FILE, META_NAME)]


def swap_into_place(build: Path, out: Path) -> None:
    """Put the complete folder ``build`` in place of ``out``. An existing ``out`` is renamed aside,
    ``build`` renamed to ``out``, and files of the old folder that a preparation does not write (the
    user's) moved back in; where folders cannot be renamed (a mount point, ``build`` inside ``out``)
    the files are replaced one by one, meta.json removed first and written last."""
    for name in (JOURNAL, LOCK):
        (build / name).unlink(missing_ok=True)
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

    return (TOKENIZER_FILE, META_NAME)
