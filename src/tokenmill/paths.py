"""Paths a command writes: outputs never overlap inputs, and user-chosen names never leave their folder.

Every writing command goes through :func:`check_output` before it writes anything: an output path that
equals, contains or lies inside any input the command reads (a run directory, a checkpoint, a data
folder, a Hugging Face source, a text corpus) is refused, whatever the flags (``--overwrite`` replaces an
earlier output, never an input). Names that become paths (ladder and rung names, run names) go through
:func:`safe_name`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from tokenmill.errors import PathError

__all__ = ["check_output", "overlaps", "safe_name"]


def _real(p: str | os.PathLike) -> Path:
    return Path(os.path.expanduser(os.fspath(p))).resolve()


def overlaps(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` are the same path or one lies inside the other (links resolved)."""
    ra, rb = _real(a), _real(b)
    return ra == rb or ra in rb.parents or rb in ra.parents


def check_output(out: str | os.PathLike, inputs: Mapping[str, Optional[str | os.PathLike]], flag: str = "--out") -> None:
    """Refuse ``out`` when it overlaps one of ``inputs`` (what -> path; None entries are skipped), naming
    both and what to do."""
    for what, path in inputs.items():
        if path is None or os.fspath(path) == "":
            continue
        if overlaps(out, path):
            ra, rb = _real(out), _real(path)
            how = "is" if ra == rb else ("lies inside" if rb in ra.parents else "contains")
            raise PathError(f"{flag} {out} {how} {what} {path}, which this command reads: writing there could "
                            "destroy it. Choose an output folder outside it; nothing was written.")


def safe_name(name: str, what: str) -> str:
    """``name`` when it is a plain file name (no separator, not '.' or '..', no control characters), so
    ``folder / name`` stays in ``folder``; else a :class:`PathError`."""
    bad = (not name or name in (".", "..") or "/" in name or "\\" in name or os.sep in name
           or (os.altsep and os.altsep in name) or any(ord(c) < 32 for c in name))
    if bad:
        raise PathError(f"{what} {name!r} cannot be used as a file name: use letters, digits, '-', '_' or '.' "
                        "without a path separator.")
    return name
