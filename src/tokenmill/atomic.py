"""Atomic writes: the one way tokenmill writes a file that a reader, a crash, a full disk or a signal may
catch half-done (configs, summaries, metrics rewritten on resume, reports, tokenizers, checkpoints,
exported weights, prepared data's ``meta.json``).

Every write goes to a temporary sibling (same folder, so the rename cannot cross file systems), named
``.NAME.tmp-PID-XXXXXXXX``, and is renamed over the real name only once complete: ``os.replace`` is
atomic, so a reader sees the old file or the whole new one, never a part. On any failure (an ``OSError``,
Ctrl-C, a writer's own exception) the temporary file is removed and the real name is untouched.
``durable=True`` also fsyncs the file and its folder, so the rename survives a power cut (checkpoints).
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def tmp_name(path: Path) -> Path:
    """A unique temporary sibling of ``path`` (same folder, so ``os.replace`` is atomic)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def replacing(path: str | Path, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` for the caller to write (by any means: ``torch.save``,
    safetensors, a tokenizer's own ``save``); when the body ends normally it replaces ``path``."""
    path = Path(path)
    tmp = tmp_name(path)
    try:
        yield tmp
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    if durable:
        fsync_dir(path.parent)


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | Path, doc: Any, **dumps: Any) -> None:
    """Write ``doc`` as indented JSON (and a final newline) to ``path`` atomically; ``dumps`` go to
    ``json.dumps`` (e.g. ``default=str``, or ``indent`` in place of the default 2)."""
    write_text(path, json.dumps(doc, **({"indent": 2} | dumps)) + "\n")


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside ``path`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on folders
        pass
    finally:
        os.close(fd)
