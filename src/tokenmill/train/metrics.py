"""Metrics: records fanned out to the loggers (``metrics.jsonl`` always, TensorBoard, Weights & Biases; see
:mod:`tokenmill.train.loggers`), progress display.

Throughput is measured over windows between log steps; the clock is read only after a device
synchronisation at those steps, and steps before ``log.timing_warmup_steps`` (compilation,
allocator warm-up) and time spent in evaluation/checkpointing are excluded.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch.profiler import record_function

from tokenmill.config import Config, LogConfig
from tokenmill.train.loggers import build_loggers
from tokenmill.train.timing import PHASES, PhaseTimer


class MetricsWriter:
    """Sends each record to the run's loggers (:mod:`tokenmill.train.loggers`: ``metrics.jsonl`` always,
    TensorBoard, Weights & Biases). ``enabled=False`` (ranks other than 0) writes nothing."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, enabled: bool = True,
                 log_cfg: Optional[LogConfig] = None, config: Optional[dict[str, Any]] = None):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        log_cfg = log_cfg if log_cfg is not None else LogConfig(tensorboard=tensorboard)
        self.loggers = build_loggers(run_dir, log_cfg, config) if enabled else []

    @classmethod
    def for_run(cls, run_dir: Path, cfg: Config, enabled: bool = True) -> MetricsWriter:
        """The writer of a run: the loggers its ``[log]`` section asks for (W&B gets the config)."""
        return cls(run_dir, cfg.log.tensorboard, enabled, cfg.log, cfg.to_dict() if cfg.log.wandb else None)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {k: plain(v) for k, v in record.items()}
        for logger in self.loggers:
            logger.log(record)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
        self.loggers = []


def plain(value: Any) -> Any:
    """A one-element tensor as a Python number (e.g. the learning rate of an optimizer that keeps it as
    a tensor, like torchao's AdamW8bit), so that JSON can hold it; anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def read_metrics(run_dir: str | Path, skipped: Optional[list[tuple[int, str]]] = None) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``, each checked (:func:`check_metrics_row`); a line that is not one
    (torn by a killed process, damaged: not UTF-8, not JSON, nested too deep, not an object, a wrong value)
    is skipped, and (its line number, why: one line naming the file, the line and the field) appended to
    ``skipped``."""
    from tokenmill.errors import DataError
    from tokenmill.filecheck import parse_json

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for i, line in enumerate(path.read_bytes().splitlines(), 1):
        where = f"'{path}' line {i}"
        try:
            if line.strip():
                rows.append(check_metrics_row(parse_json(line.decode("utf-8"), where), where))
        except (UnicodeDecodeError, DataError) as e:
            if skipped is not None:
                skipped.append((i, str(e) if isinstance(e, DataError) else f"{where} is not UTF-8 text."))
    return rows


def check_metrics_row(row: Any, where: str) -> dict[str, Any]:
    """A metrics.jsonl record as the trainer writes it: an object whose ``step`` is an integer >= 0,
    ``event`` a string and every other value a finite number or null; else a DataError naming ``where``."""
    from tokenmill.errors import DataError
    from tokenmill.filecheck import Number, get, shown

    if not isinstance(row, dict):
        raise DataError(f"{where} must hold an object (a metric record), got {shown(row)}.")
    if "step" in row:
        get(row, "step", int, where, lo=0)  # never null
    for key in row:
        get(row, key, str if key == "event" else float, where, nullable=True)
    return {k: float(v) if isinstance(v, Number) else v for k, v in row.items()}  # plain floats, as written


def format_duration(seconds: float) -> str:
    """``3h02m``, ``4m44s``, ``12s``; '?' when unknown."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """A tqdm bar with ETA on a terminal, plain log lines otherwise."""

    def __init__(self, mode: str, total: int, initial: int, enabled: bool = True, unit: str = "step"):
        self.enabled = enabled
        use_bar = mode == "bar" or (mode == "auto" and sys.stderr.isatty())
        self.bar = None
        self.total, self.initial, self.n, self.unit = total, initial, initial, unit
        self.t0 = time.perf_counter()
        if enabled and use_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit=unit, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)

    def status(self) -> str:
        """`` | 120/1000 (12%) | 3.1 step/s | ETA 4m44s`` for a plain log line (a bar shows its own), from the
        wall time of this invocation (compilation and evaluation included: what the user waits for)."""
        if self.bar is not None or self.n <= self.initial:
            return ""
        done, elapsed = self.n - self.initial, time.perf_counter() - self.t0
        rate = done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.n) / rate if rate > 0 else float("inf")
        pct = 100 * self.n / self.total if self.total else 100.0
        speed = f"{rate:,.0f}" if rate >= 100 else f"{rate:.2f}"
        return f" | {self.n}/{self.total} ({pct:.0f}%) | {speed} {self.unit}/s | ETA {format_duration(left)}"

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
        self.window_start = None
        return tps

    def summary(self) -> dict[str, Any]:
        return steady_figures(self.windows, self.tokens_per_step)


def steady_figures(windows: list[float], tokens_per_step: int) -> dict[str, Any]:
    """The one steady-state figure of a run, from its windows' tokens/s: ``tokens_per_sec`` (the median),
    ``step_time_ms`` (tokens per step / that median, so the two agree exactly), the windows' min and max,
    and ``timing_windows`` (how many). Every report (the trainer's summary, the ladder, the doctor) reads
    these."""
    if not windows:
        return {"tokens_per_sec": None, "tokens_per_sec_windows": [], "step_time_ms": None, "timing_windows": 0}
    tps = statistics.median(windows)
    return {
        "tokens_per_sec": tps,
        "tokens_per_sec_min": min(windows),
        "tokens_per_sec_max": max(windows),
        "tokens_per_sec_windows": list(windows),
        "step_time_ms": 1000 * tokens_per_step / tps,
        "timing_windows": len(windows),
    }


class StepMetrics:
    """Everything measured per step, and the log record built from it at log steps.

    Owns the throughput window (:class:`ThroughputMeter`), the phase timer (:class:`PhaseTimer`) and the
    per-step losses not yet read back from the device (read with one synchronisation at log steps).
    :meth:`restart_window` starts a new window for both the meter and the timer, so the phases cover
    exactly the steps of ``step_ms`` (no warm-up, evaluation or checkpoint steps).
    """

    def __init__(self, device: torch.device, tokens_per_step: int, warmup_steps: int, start_step: int,
                 flops_per_token: float, peak_flops: float | None, compiled: bool = False):
        self.meter = ThroughputMeter(tokens_per_step, warmup_steps, start_step)
        # torch's counter is per process: the run's share is the difference (not read uncompiled: an import)
        self.compile0 = compile_seconds() if compiled else None
        self.run_peaks: dict[str, float] = {}  # the peaks before the counters' reset at the first timed step
        self.timer = PhaseTimer(device)
        self.pending: list[torch.Tensor] = []
        self.learned: list[torch.Tensor] = []  # a loss mask: each step's learned tokens (global), not yet read back
        self.learned_windows: list[float] = []  # learned tokens/s of each throughput window
        self.shares: list[list[float]] = []  # each step's [learned_frac] or, chat windows, [learned_frac, padding_frac]
        self.masked = False  # a step reported its learned tokens
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.started = time.perf_counter()
        self.warmup_s: float | None = None
        self.outside_s: dict[str, float] = {"eval": 0.0, "checkpoint": 0.0, "log": 0.0}
        self.outside_n: dict[str, int] = {"eval": 0, "checkpoint": 0, "log": 0}

    @contextlib.contextmanager
    def outside(self, name: str):
        """Time work outside the training steps (``eval``, ``checkpoint``, ``log``): wall seconds and
        count for the summary, and a profiler region of that name."""
        t0 = time.perf_counter()
        with record_function(name):
            yield
        self.outside_s[name] += time.perf_counter() - t0
        self.outside_n[name] += 1

    @property
    def timing_from(self) -> int:
        """The first step counted in steady-state throughput."""
        return self.meter.timing_from

    def phase(self, name: str):
        return self.timer.phase(name)

    def add_host(self, phase: str, seconds: float) -> None:
        self.timer.add_host(phase, seconds)

    def step_done(self, loss: torch.Tensor, learned: Optional[torch.Tensor] = None) -> None:
        """``learned``: the step's learned-token count with a loss mask (``data.loss_mask``), else None; chat windows:
        ``[learned, padded inputs]`` (train/loss_mask.py)."""
        self.pending.append(loss)
        if learned is not None:
            self.learned.append(learned)
            self.masked = True
        self.meter.step_done()
        self.timer.step_done()

    def take_losses(self) -> list[torch.Tensor]:
        """The per-step loss tensors since the last call (cleared)."""
        out, self.pending = self.pending, []
        return out

    def restart_window(self, completed_steps: int) -> None:
        """Call after a device synchronisation with no untimed work pending."""
        if completed_steps == self.timing_from and self.warmup_s is None:  # less the evaluations, checkpoints and
            # logging within it, which the summary counts apart (eval_s, checkpoint_s, log_s): each second once
            self.warmup_s = time.perf_counter() - self.started - sum(self.outside_s.values())
        self.meter.mark(completed_steps)
        self.timer.reset()

    def note_peaks(self, memory: dict[str, float]) -> None:
        """Call with the device's peaks (``memory_stats``) just before its peak counters are reset: the
        whole run's peaks (``peak_*_run`` in the summary) keep them."""
        for key, value in memory.items():
            self.run_peaks[key] = max(self.run_peaks.get(key, 0.0), value)

    def mfu(self, tokens_per_sec: float | None) -> float | None:
        if not tokens_per_sec or not self.peak_flops:
            return None
        return self.flops_per_token * tokens_per_sec / self.peak_flops

    def record(self, step: int, loss: float, lr: Any, grad_norm: Any, memory: dict[str, float]) -> dict[str, Any]:
        """The log record of log step ``step``; call after the device synchronisation."""
        tps = self.meter.close_window()
        phases, nsteps = self.timer.collect()  # the steps of the meter's window (same resets)
        rec = {
            "step": step,
            "loss": loss,
            "lr": as_float(lr),  # a tensor under some optimizers (torchao's AdamW8bit)
            "grad_norm": as_float(grad_norm),
            "tokens_per_sec": tps,
            "mfu": self.mfu(tps),
            **{f"{p}_ms": 1000 * phases.get(p, 0.0) / max(1, nsteps) for p in PHASES},
            **memory,
        }
        if tps:
            step_ms = 1000 * self.tokens_per_step / tps
            rec["step_ms"] = step_ms
            # on CUDA the phases are device times and ``data`` is the host's wait for the batch, which
            # can overlap queued device work: it is reported, but not subtracted
            timed = [p for p in PHASES if not (self.timer.cuda and p == "data")]
            other = step_ms - sum(rec[f"{p}_ms"] for p in timed)
            # phases are timed inside the step-time window: only clock noise makes ``other`` negative,
            # so up to 1% of the step is rounded to 0; more stays visible
            rec["other_ms"] = 0.0 if -0.01 * step_ms < other < 0.0 else other
        return rec | self._learned_share(tps)

    def _learned_share(self, tps: float | None) -> dict[str, Any]:
        """With a loss mask: the logged step's ``learned_tokens`` and ``learned_frac`` (of the step's tokens), and
        the window's learned tokens/s noted for the summary (the window's steps are the last of these)."""
        if not self.learned:
            return {}
        rows, self.learned = torch.stack(self.learned).reshape(len(self.learned), -1).tolist(), []
        counts = [r[0] for r in rows]
        steps = self.meter.window_steps
        if tps and 0 < steps <= len(counts):
            self.learned_windows.append(tps * sum(counts[-steps:]) / (steps * self.tokens_per_step))
        self.shares += [[v / self.tokens_per_step for v in r] for r in rows]
        out = {"learned_tokens": counts[-1], "learned_frac": counts[-1] / self.tokens_per_step}
        return out | ({"padding_frac": rows[-1][1] / self.tokens_per_step} if len(rows[-1]) > 1 else {})

    def summary(self, memory: Optional[dict[str, float]] = None) -> dict[str, Any]:
        """Steady-state throughput and MFU, and where the rest of the wall time went: ``wall_s`` (since
        set-up), ``warmup_s`` (until the first timed step, less the evaluation, checkpoint and logging time
        within it), ``compile_s`` (torch.compile's own time, see
        :func:`compile_seconds`; None when the model is not compiled), ``eval_s``/``evals``,
        ``checkpoint_s``/``checkpoints``, ``log_s``/``logs``; and ``peak_alloc_mb_run`` /
        ``peak_reserved_mb_run``: the whole run's peaks, warm-up and compilation included, from
        ``memory`` (the device's peaks now, since the last reset) and those noted before the reset
        (None off CUDA, where ``memory`` is empty); with a loss mask ``learned_tokens_per_sec`` (the median
        window's) and ``learned_frac`` (with chat windows ``padding_frac`` too: the means over the steps)."""
        out = self.meter.summary()
        now = compile_seconds() if self.compile0 is not None else None
        out["compile_s"] = now - self.compile0 if now is not None and self.compile0 is not None else None
        for key in ("peak_alloc_mb", "peak_reserved_mb"):
            seen = [v for v in ((memory or {}).get(key), self.run_peaks.get(key)) if v is not None]
            out[f"{key}_run"] = max(seen) if seen else None
        if self.masked:  # a loss mask: the median window's learned tokens/s
            out["learned_tokens_per_sec"] = statistics.median(self.learned_windows) if self.learned_windows else None
            for i, key in enumerate(("learned_frac", "padding_frac")[: len(self.shares[0]) if self.shares else 1]):
                out[key] = statistics.fmean(r[i] for r in self.shares) if self.shares else None  # over the steps
        out["timing_from_step"] = self.timing_from  # the windows: every log window after this step
        out["mfu"] = self.mfu(out["tokens_per_sec"])
        out["wall_s"] = time.perf_counter() - self.started
        out["warmup_s"] = self.warmup_s
        for name, plural in (("eval", "evals"), ("checkpoint", "checkpoints"), ("log", "logs")):
            out[f"{name}_s"], out[plural] = self.outside_s[name], self.outside_n[name]
        return out


def compile_seconds() -> float | None:
    """Seconds this process has spent in torch.compile so far: TorchDynamo's own cumulative timers
    (``torch._dynamo.utils.calculate_time_spent``), ``entire_frame_compile`` (Dynamo, AOTAutograd and
    Inductor for each frame, the forward and the joint graph) plus ``entire_backward_compile`` (a backward
    graph compiled lazily at the first backward). None when this torch does not keep them (a private API)."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        spent = calculate_time_spent()
    except Exception:  # noqa: BLE001 - a private API: any failure means "not known"
        return None
    return float(spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0))


def as_float(x: Any) -> float | None:
    """A number, tensor or DTensor (FSDP norms) as a float; None stays None."""
    if x is None:
        return None
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    return float(x)


def format_record(rec: dict[str, Any]) -> str:
    """One log line for the console."""
    s = f"step {rec['step']:>6} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e}"
    if rec.get("tokens_per_sec"):
        s += f" | {rec['tokens_per_sec']:,.0f} tok/s"
    if rec.get("mfu"):
        s += f" | MFU {100 * rec['mfu']:.1f}%"
    if rec.get("peak_alloc_mb"):
        s += f" | peak {rec['peak_alloc_mb']:,.0f} MB"
    if rec.get("data_ms") is not None:
        s += f" | data {rec['data_ms']:.1f} ms"
    if rec.get("moe_load_max") is not None:  # a mixture of experts: the busiest expert's load over the mean
        s += f" | expert load {rec['moe_load_max']:.2f}x"
    return s
