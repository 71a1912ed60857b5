"""The run directory: created safely, locked while a run writes to it, and self-contained.

- **Locked**: one ``tokenmill train`` at a time writes to a run directory; a second one stops with an
  error naming the first (``fcntl.flock`` on ``RUN/.lock``: the lock goes with the process, so a killed
  run never leaves it held).
- **Self-contained**: ``config.toml`` records the data folder (or a mixture's folders) as absolute paths,
  and the tokenizer (``meta.json`` and its files; a mixture's folders share one) is copied into
  ``RUN/tokenizer/``, so ``sample`` and ``--resume`` work from any directory and after the data folder has
  moved.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
from pathlib import Path
from typing import Optional

from tokenmill import config as C
from tokenmill.checkpoint import TOKENIZER_DIR
from tokenmill.data.mixture import absolute_mixture, mixture_paths
from tokenmill.errors import TrainingError
from tokenmill.paths import check_output, check_text

LOCK_NAME = ".lock"


def open_run_dir(run_dir: Path, cfg: Optional[C.Config] = None) -> Path:
    """Create ``run_dir`` (and its parents) or check the existing one is a folder; never one that overlaps
    what the run reads (``cfg``'s data folder, the folders of its data mixture, or its fine-tuning source)."""
    if cfg is None:
        check_text(run_dir, "--run-dir")  # check_output checks it too: torch's profiler writes under text paths only
    else:
        check_output(run_dir, {"data.path": cfg.data.path, **mixture_paths(cfg.data.mixture),
                               "train.init_from": cfg.train.init_from}, "--run-dir")
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainingError(f"run directory {run_dir} exists and is not a folder; choose another --run-dir.")
    run_dir.mkdir(parents=True, exist_ok=True)  # OS errors (permission, read-only) are reported by the CLI
    return run_dir


@contextlib.contextmanager
def locked(run_dir: Path, enabled: bool = True):
    """Hold the run directory's lock for the duration; yields None when held, else the pid of the process
    that holds it (nothing is held then). Rank 0 of a job takes it; other ranks pass ``enabled=False``."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no advisory locks
        enabled = False
    if not enabled:
        yield None
        return
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        try:
            yield None
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def in_use_message(run_dir: Path, holder: str | None) -> str:
    who = f"pid {holder}" if holder else "see rank 0"
    return (f"run directory {run_dir} is in use by another tokenmill process ({who}); wait for it to finish, "
            "or choose another --run-dir.")


def recorded_config(cfg: C.Config) -> C.Config:
    """The config as the run directory records it: the data folder (or the mixture's folders) as absolute paths."""
    out = copy.deepcopy(cfg)
    if out.data.path:
        out.data.path = str(Path(out.data.path).expanduser().resolve())
    if out.data.mixture:
        out.data.mixture = absolute_mixture(out.data.mixture)
    if out.data.cache_dir:
        out.data.cache_dir = str(Path(out.data.cache_dir).expanduser().resolve())
    return out


def save_tokenizer(run_dir: Path, data_dir: Optional[Path]) -> None:
    """Copy the data folder's ``meta.json``, tokenizer files and chat template into ``RUN/tokenizer/`` (once): the
    run keeps what ``sample``, ``chat`` and ``export`` need when the data folder moves."""
    if data_dir is None:
        return
    dst = run_dir / TOKENIZER_DIR
    if (dst / "meta.json").is_file():
        return
    tmp = run_dir / f".{TOKENIZER_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for p in Path(data_dir).iterdir():
        if p.is_file() and p.suffix in (".json", ".jinja"):  # meta.json, tokenizer.json, ..., chat_template.jinja
            shutil.copy2(p, tmp / p.name)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
