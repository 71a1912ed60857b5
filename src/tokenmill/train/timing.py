"""The cheap, always-on per-step time breakdown (no profiler, no per-step synchronisation).

Phases: ``data`` (host time blocked waiting for the next batch), ``h2d`` (host-to-device copy),
``forward``, ``backward``, ``optimizer``. On CUDA each phase is bracketed by CUDA events that are
only read at log steps, after the trainer's device synchronisation, so the breakdown costs no extra
sync; the events measure device time. On CPU (and MPS) work is timed with the host clock around
each phase. ``other`` is the rest of the wall-clock step time (logging, Python overhead, device
idle while the host is busy elsewhere).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
from torch.profiler import record_function

PHASES = ("data", "h2d", "forward", "backward", "optimizer")


class PhaseTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host = defaultdict(float)  # seconds
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def add_host(self, phase: str, seconds: float) -> None:
        self.host[phase] += seconds

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time ``name`` and label it for torch.profiler traces (``record_function``)."""
        with record_function(name):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
                self.events.append((name, start, end))
            else:
                t0 = time.perf_counter()
                yield
                self.host[name] += time.perf_counter() - t0

    def collect(self) -> dict[str, float]:
        """Seconds per phase since the last call. Call only after a device synchronisation."""
        out = dict(self.host)
        for name, start, end in self.events:
            out[name] = out.get(name, 0.0) + start.elapsed_time(end) / 1000.0
        self.host.clear()
        self.events.clear()
        return out
