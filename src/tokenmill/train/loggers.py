"""Where metric records go: one small interface, three back ends.

A record is one dict the trainer logs (``{"step": 10, "loss": 2.31, "tokens_per_sec": ...}``; eval lines
``{"step": 10, "val_loss": ...}``; events ``{"step": 7, "event": "non_finite_loss", ...}``). Every logger
gets every record through :meth:`Logger.log` and is closed once at the end:

- :class:`JsonlLogger` (always): ``RUN/metrics.jsonl``, one JSON object per line, the record as given
  (non-finite floats written as ``null``); :func:`tokenmill.train.metrics.read_metrics` reads it.
- :class:`TensorBoardLogger` (``log.tensorboard``, when tensorboard is installed): ``RUN/tensorboard``,
  the numbers as scalars under tags grouped by section (:func:`tag`): ``train/loss``,
  ``perf/tokens_per_sec``, ``memory/peak_alloc_mb``, ``eval/val_loss``.
- :class:`WandbLogger` (``log.wandb``; the optional ``wandb`` extra): the same tags and the run config.

A new back end is a class with ``log(record)`` and ``close()``, added in :func:`build_loggers`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Protocol

from tokenmill import config as C
from tokenmill.errors import ConfigError

# the section of each known key; other keys: *_mb -> memory, *_ms -> perf, else train
_SECTIONS = {
    "loss": "train", "lr": "train", "grad_norm": "train",
    "val_loss": "eval", "eval_ms": "eval", "tasks_ms": "eval",
    "tokens_per_sec": "perf", "mfu": "perf", "step_ms": "perf", "other_ms": "perf",
}


def tag(key: str) -> str:
    """The grouped tag of a record key: ``loss`` -> ``train/loss``, ``tokens_per_sec`` ->
    ``perf/tokens_per_sec``, ``forward_ms`` -> ``perf/forward_ms``, ``peak_alloc_mb`` ->
    ``memory/peak_alloc_mb``, ``val_loss`` -> ``eval/val_loss``."""
    if key in _SECTIONS:
        return f"{_SECTIONS[key]}/{key}"
    if key.startswith("tasks/"):  # task scores (train/tasks.py): tasks/TASK/METRIC as they are
        return key
    if key.endswith("_mb"):
        return f"memory/{key}"
    if key.endswith("_ms"):
        return f"perf/{key}"
    return f"train/{key}"


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a record (``step`` and flags excluded) under their grouped tags."""
    out = {}
    for k, v in record.items():
        if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[tag(k)] = float(v)
    return out


class Logger(Protocol):
    """A metrics back end: gets every record, closed once at the end of the run."""

    def log(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    """``RUN/metrics.jsonl``: one JSON object per record, appended (non-finite floats as null)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "metrics.jsonl"

    def log(self, record: Mapping[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """``RUN/tensorboard``: every number of a record as a scalar at its step, under :func:`tag`."""

    def __init__(self, run_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter  # ImportError when tensorboard is absent

        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def log(self, record: Mapping[str, Any]) -> None:
        step = record.get("step", 0)
        for t, v in scalars(record).items():
            self.writer.add_scalar(t, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """Weights & Biases: the run config at start, every record's numbers under :func:`tag` at its step.
    Files go to ``RUN/wandb``; offline mode (``log.wandb_mode='offline'`` or ``WANDB_MODE=offline``)
    needs no network and no account."""

    def __init__(self, run_dir: str | Path, log_cfg: C.LogConfig, config: Optional[dict[str, Any]] = None):
        try:
            import wandb
        except ImportError:
            raise ConfigError("log.wandb needs the wandb package: pip install 'tokenmill[wandb]' (or pip install "
                              "wandb), or drop --log.wandb.") from None
        run_dir = Path(run_dir)
        kwargs: dict[str, Any] = {"project": log_cfg.wandb_project, "name": log_cfg.wandb_name or run_dir.resolve().name,
                                  "dir": str(run_dir), "config": config or {}}
        if log_cfg.wandb_mode != "auto":
            kwargs["mode"] = log_cfg.wandb_mode
        os.makedirs(run_dir / "wandb", exist_ok=True)
        self.run = wandb.init(**kwargs)

    def log(self, record: Mapping[str, Any]) -> None:
        values = scalars(record)
        if values:
            self.run.log(values, step=int(record.get("step", 0)))

    def close(self) -> None:
        self.run.finish()


def build_loggers(run_dir: str | Path, log_cfg: C.LogConfig, config: Optional[dict[str, Any]] = None,
                  warn=print) -> list[Logger]:
    """The loggers a run's ``[log]`` section asks for: JSONL always, then TensorBoard (skipped with a
    note when not installed) and Weights & Biases (a :class:`ConfigError` when asked for and absent)."""
    loggers: list[Logger] = [JsonlLogger(run_dir)]
    if log_cfg.tensorboard:
        try:
            loggers.append(TensorBoardLogger(run_dir))
        except ImportError:
            warn("tokenmill: tensorboard is not installed (pip install tensorboard); skipping it.")
    if log_cfg.wandb:
        loggers.append(WandbLogger(run_dir, log_cfg, config))
    return loggers
