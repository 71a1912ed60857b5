"""The embedded corpus's source files: the ``.py`` sources of the running Python's standard library
(listed here, below both ``prepare`` and ``corpus``)."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from tokenmill.errors import DataError

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})


def stdlib_root() -> Path:
    """The standard-library folder of the running Python."""
    return Path(sysconfig.get_paths()["stdlib"])


def embedded_corpus_files(max_files: int | None = None) -> list[Path]:
    """The corpus files: stdlib ``*.py`` outside site-packages, test(s) folders and idlelib, sorted by
    relative path (the first ``max_files`` when given)."""
    root = stdlib_root()
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        files.extend(Path(folder) / n for n in names if n.endswith(".py"))
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise DataError(
            f"the embedded corpus is empty: no .py files under '{root}' (a Python without its stdlib "
            "sources?). Fix: prepare your own text with `tokenmill prepare INPUT --out DIR` and set "
            "data.path."
        )
    return files[:max_files] if max_files is not None else files
