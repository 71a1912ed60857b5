"""The cheap, always-on per-step time breakdown (no profiler, no per-step synchronisation).

Phases: ``data`` (host time blocked waiting for the next batch), ``h2d`` (host-to-device copy),
``forward``, ``backward``, ``optimizer``. On CUDA each phase is bracketed by CUDA events that are
only read at log steps, after the trainer's device synchronisation, so the breakdown costs no extra
sync; the events measure device time. On CPU (and MPS) work is timed with the host clock around
each phase. ``other`` is the rest of the wall-clock step time (logging, Python overhead, device
idle while the host is busy elsewhere).

The timer also counts the steps it covers (:meth:`PhaseTimer.step_done`), so the per-step phases
are averaged over exactly the steps they were measured in. The trainer calls :meth:`PhaseTimer.reset`
wherever it starts a throughput window (after the timing warm-up, after evaluation and
checkpointing), so the phases cover the same steps as ``step_ms`` and ``other_ms`` = ``step_ms`` -
the phases is the real rest.
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
        self.steps = 0  # optimizer steps since the last reset / collect

    def reset(self) -> None:
        """Drop everything measured so far (unread CUDA events included): a new window starts."""
        self.host.clear()
        self.events.clear()
        self.steps = 0

    def step_done(self) -> None:
        self.steps += 1

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

    def collect(self) -> tuple[dict[str, float], int]:
        """(seconds per phase, steps counted) since the last reset or collect; then resets.
        Call only after a device synchronisation."""
        out = dict(self.host)
        for name, start, end in self.events:
            out[name] = out.get(name, 0.0) + start.elapsed_time(end) / 1000.0
        steps = self.steps
        self.reset()
        return out, steps
