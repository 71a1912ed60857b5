"""Reading a Chrome trace written by ``torch.profiler`` (``export_chrome_trace``).

The trace is a list of events. Host work is a set of complete spans (``ph == "X"``) per thread,
nested by time: ``user_annotation`` spans are ``record_function`` regions (``ProfilerStep#N`` from
``prof.step()``, the trainer's phases), ``cpu_op`` spans are ATen operators, ``cuda_runtime`` spans
are CUDA API calls. Device work (``kernel``, ``gpu_memcpy``, ``gpu_memset``) lives on the GPU's
streams and is tied to the launching runtime (or driver) call by ``args.correlation``; the
``gpu_user_annotation`` copies of the regions on the device streams are ignored. Allocator activity is
the instant events named ``[memory]``.

:class:`Trace` indexes all of that once: parents of every host span, the profiled steps, the phase
region that was open at any moment, and the launch of every kernel.
"""

from __future__ import annotations

import bisect
import json
import re
from pathlib import Path
from typing import Any, Optional

from tokenmill.train.timing import PHASES

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # host calls that launch device work
STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
DATA_PREFIX = "enumerate(DataLoader)"  # the DataLoader iterator's own record_function
OUTSIDE = "outside phases"  # host time in a step that no phase region covers (logging, loop)


def phase_of(name: str) -> Optional[str]:
    """The phase a region name belongs to ('data', 'h2d', ...), or None for any other name."""
    if name in PHASES:
        return name
    if name.startswith(DATA_PREFIX):
        return "data"
    return None


class Span:
    """One complete event: name, category, thread, start and duration in microseconds."""

    __slots__ = ("name", "cat", "pid", "tid", "ts", "dur", "args", "parent", "children_dur")

    def __init__(self, ev: dict[str, Any]):
        self.name: str = ev.get("name", "")
        self.cat: str = ev.get("cat", "")
        self.pid = ev.get("pid")
        self.tid = ev.get("tid")
        self.ts: float = float(ev["ts"])
        self.dur: float = float(ev.get("dur", 0.0))
        self.args: dict[str, Any] = ev.get("args") or {}
        self.parent: Optional[Span] = None
        self.children_dur = 0.0

    @property
    def end(self) -> float:
        return self.ts + self.dur

    @property
    def self_time(self) -> float:
        return max(0.0, self.dur - self.children_dur)

    def ancestors(self):
        p = self.parent
        while p is not None:
            yield p
            p = p.parent


class Trace:
    """An indexed torch.profiler Chrome trace."""

    def __init__(self, doc: dict[str, Any]):
        self.doc = doc
        events = doc.get("traceEvents", [])
        spans = [Span(e) for e in events if e.get("ph") == "X" and isinstance(e.get("tid"), int)]
        self.device = [s for s in spans if s.cat in DEVICE_CATS]
        self.host = [s for s in spans if s.cat not in DEVICE_CATS and not s.cat.startswith("gpu_")]
        self.memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
        self._by_thread: dict[tuple, list[Span]] = {}
        self._starts: dict[tuple, list[float]] = {}
        for s in sorted(self.host, key=lambda s: (str(s.pid), s.tid, s.ts, -s.dur)):
            self._by_thread.setdefault((s.pid, s.tid), []).append(s)
        for key, lst in self._by_thread.items():
            _link_parents(lst)
            self._starts[key] = [s.ts for s in lst]
        self.steps = sorted(
            (s for s in self.host if s.cat == "user_annotation" and STEP_RE.match(s.name)), key=lambda s: s.ts
        )
        self.main = (self.steps[0].pid, self.steps[0].tid) if self.steps else None
        self.regions = sorted(
            (s for s in self._by_thread.get(self.main, []) if s.cat == "user_annotation" and phase_of(s.name)),
            key=lambda s: s.ts,
        )
        self._region_starts = [s.ts for s in self.regions]
        self.launches = {
            s.args["correlation"]: s for s in self.host if s.cat in LAUNCH_CATS and "correlation" in s.args
        }

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        with open(path) as f:
            return cls(json.load(f))

    # ------------------------------------------------------------------------------------------

    @property
    def window(self) -> tuple[float, float]:
        """(start, end) of the profiled steps on the host clock, in microseconds."""
        if not self.steps:
            return (0.0, 0.0)
        return self.steps[0].ts, max(s.end for s in self.steps)

    def step_at(self, ts: float) -> Optional[int]:
        """Index (0-based, among the profiled steps) of the step containing ``ts``."""
        for i, s in enumerate(self.steps):
            if s.ts <= ts < s.end:
                return i
        return None

    def region_at(self, ts: float) -> str:
        """The innermost trainer phase open at ``ts`` (e.g. 'forward'), else :data:`OUTSIDE`."""
        i = bisect.bisect_right(self._region_starts, ts) - 1
        while i >= 0:
            r = self.regions[i]
            if r.ts <= ts < r.end:
                return phase_of(r.name) or OUTSIDE
            if r.end < ts - 1e7:  # regions are short: stop scanning far back
                break
            i -= 1
        return OUTSIDE

    def span_at(self, pid, tid, ts: float) -> Optional[Span]:
        """The innermost host span of thread (pid, tid) open at ``ts``."""
        starts = self._starts.get((pid, tid))
        if not starts:
            return None
        i = bisect.bisect_right(starts, ts) - 1
        if i < 0:
            return None
        s = self._by_thread[(pid, tid)][i]
        while s is not None and not (s.ts <= ts <= s.end):
            s = s.parent
        return s

    def launch_of(self, kernel: Span) -> Optional[Span]:
        """The CUDA runtime call that launched a device event."""
        return self.launches.get(kernel.args.get("correlation"))

    def region_of_device(self, kernel: Span) -> str:
        """Trainer phase of the host code that launched a device event."""
        launch = self.launch_of(kernel)
        return self.region_at(launch.ts) if launch is not None else OUTSIDE

    def in_window(self, spans, slack_end: float = 0.0):
        start, end = self.window
        return [s for s in spans if start <= s.ts < end + slack_end]

    def device_window(self) -> tuple[float, float]:
        """Window for device activity: from the first step's start to the end of the last device
        event launched during the profiled steps (kernels run after their launch)."""
        start, end = self.window
        kernels = self.device_in_window()
        return start, max([end] + [k.end for k in kernels])

    def device_in_window(self) -> list[Span]:
        """Device events launched during the profiled steps."""
        start, end = self.window
        out = []
        for k in self.device:
            launch = self.launch_of(k)
            t = launch.ts if launch is not None else k.ts
            if start <= t < end:
                out.append(k)
        return out


def _link_parents(spans: list[Span]) -> None:
    """Set ``parent`` and ``children_dur`` of spans of one thread sorted by (start, -duration)."""
    stack: list[Span] = []
    for s in spans:
        while stack and not (s.ts >= stack[-1].ts and s.end <= stack[-1].end + 1e-3):
            stack.pop()
        if stack:
            s.parent = stack[-1]
            stack[-1].children_dur += s.dur
        stack.append(s)


def union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Total length covered by ``intervals`` clipped to [lo, hi]."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total
