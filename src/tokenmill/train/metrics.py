"""Metrics: ``metrics.jsonl`` (always), TensorBoard (when installed and enabled), progress display.

Throughput is measured over windows between log steps; the clock is read only after a device
synchronisation at those steps, and steps before ``log.timing_warmup_steps`` (compilation,
allocator warm-up) and time spent in evaluation/checkpointing are excluded.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                print("tokenmill: tensorboard is not installed (pip install tensorboard); skipping it.")

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {k: plain(v) for k, v in record.items()}
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
        if self.tb is not None:
            step = record.get("step", 0)
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def plain(value: Any) -> Any:
    """A one-element tensor as a Python number (e.g. the learning rate of an optimizer that keeps it as
    a tensor, like torchao's AdamW8bit), so that JSON can hold it; anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Progress:
    """A tqdm bar with ETA on a terminal, plain log lines otherwise."""

    def __init__(self, mode: str, total: int, initial: int, enabled: bool = True):
        self.enabled = enabled
        use_bar = mode == "bar" or (mode == "auto" and sys.stderr.isatty())
        self.bar = None
        if enabled and use_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def log(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class ThroughputMeter:
    """Steady-state tokens/s from windows between synchronised log steps."""

    def __init__(self, tokens_per_step: int, warmup_steps: int, start_step: int):
        self.tokens_per_step = tokens_per_step
        self.timing_from = start_step + warmup_steps  # first step counted
        self.window_start: float | None = None
        self.window_steps = 0
        self.windows: list[float] = []  # tokens/s per window
        self.step_times: list[float] = []  # seconds per step per window

    def mark(self, completed_steps: int) -> None:
        """Call after a device sync, with no untimed work pending: starts a new window."""
        if completed_steps >= self.timing_from:
            self.window_start = time.perf_counter()
            self.window_steps = 0

    def step_done(self) -> None:
        if self.window_start is not None:
            self.window_steps += 1

    def close_window(self) -> float | None:
        """Call at a log step after a device sync; returns this window's tokens/s."""
        if self.window_start is None or self.window_steps == 0:
            return None
        dt = time.perf_counter() - self.window_start
        tps = self.window_steps * self.tokens_per_step / dt
        self.windows.append(tps)
        self.step_times.append(dt / self.window_steps)
        self.window_start = None
        return tps

    def summary(self) -> dict[str, Any]:
        if not self.windows:
            return {"tokens_per_sec": None, "tokens_per_sec_windows": [], "step_time_ms": None}
        return {
            "tokens_per_sec": statistics.median(self.windows),
            "tokens_per_sec_min": min(self.windows),
            "tokens_per_sec_max": max(self.windows),
            "tokens_per_sec_windows": self.windows,
            "step_time_ms": 1000 * statistics.median(self.step_times),
        }
