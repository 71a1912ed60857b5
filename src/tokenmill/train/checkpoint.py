"""Checkpoints: atomic writes, keep-last-K, and safe loading.

A checkpoint is one ``torch.save`` file of plain tensors and Python containers, written to a
temporary name, fsync'ed and renamed into place (``os.replace`` is atomic), so a crash mid-save
never leaves a half-written file under a real name. Loading uses ``weights_only=True``: nothing is
unpickled but tensors and primitive containers.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^step_(\d{8})\.pt$")
_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "module.")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def clean_state_dict(sd: dict[str, Any]) -> dict[str, Any]:
    """Drop wrapper prefixes (compile, activation checkpointing, DDP) from parameter names."""
    out = {}
    for k, v in sd.items():
        for p in _PREFIXES:
            k = k.replace(p, "")
        out[k] = v
    return out


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step_{step:08d}.pt"
    atomic_torch_save(state, path)
    for _, old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    return torch.load(path, map_location=map_location, weights_only=True)


def load_latest(run_dir: str | Path, map_location: Any = "cpu") -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads; an unreadable one is reported and skipped, never deleted."""
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            return path, load_checkpoint(path, map_location)
        except Exception as e:  # noqa: BLE001 - report and fall back to the previous one
            warnings.warn(f"checkpoint {path} could not be loaded ({e}); trying the previous one.", stacklevel=2)
    return None


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
