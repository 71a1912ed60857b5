"""How sure the doctor is of each finding: the finding's effect against the spread of the run's own windows.

The windows are the trainer's log windows (``metrics.jsonl``: one row per window of steps between two
synchronised log steps, the windows ``summary.json``'s tokens/s is the median of) or the profiled steps
(``profile.json``: ``breakdown.each_step_ms``). :func:`window_set` leaves out a window whose step took
at least :data:`SPIKE` times the median step (the machine was busy with something else: such a window
would drag every share towards its own compute time) and says which windows it used.

A timed rule fires when a phase's share of the step crosses a threshold (:data:`TIMED`). Its confidence
is the distance of the share from that threshold in standard errors of the share over the windows used
(``z = (share - threshold) / (stdev / sqrt(n))``): ``high`` from :data:`HIGH`, ``medium`` from
:data:`ENOUGH`, below that **too noisy to judge** (the doctor does not name it as the bottleneck and says
how to get a clearer run). With one window there is no spread to judge by (``unknown``), nor for timed rules
without per-window figures (:data:`UNWINDOWED`; on CUDA the device-idle rules). Rules that read counts, the
config or memory (syncs per step, FLOPs per operator, threads, the memory peak) are ``not timed``: machine
load does not move them.

The windows are a :class:`~tokenmill.profiling.facts.Windows` (``Run.timing.windows``), a rating a
:class:`Confidence`: read by attribute, so a misspelt one is an ``AttributeError``; :meth:`Confidence.to_json`
gives the keys ``tokenmill doctor --json`` prints.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Optional

from tokenmill.profiling.facts import Run, Windows

SPIKE = 3.0  # a window this many times slower than the median window is left out
HIGH, ENOUGH = 4.0, 2.0  # standard errors between the share and the rule's threshold
NOISY = "too noisy to judge"
# rule -> (the phase whose share of the step it reads, the share at which it fires)
TIMED = {"data_bound": ("data", 0.15), "copy_bound": ("h2d", 0.08), "optimizer_impl": ("optimizer", 0.15)}
# timed rules without a per-window series (what they time), and the rules that time the device's idle on CUDA
UNWINDOWED = {"activation_recompute": "the recompute inside backward", "selective_recompute": "the recompute "
              "inside backward", "outside_steady_state": "wall-clock time outside the steps"}
DEVICE_IDLE = ("launch_overhead", "compile_off", "micro_batch", "host_sync")
CLEARER = ("more steps (more log windows), a quieter machine, and OMP_NUM_THREADS set to the cores that are "
           "free (`uptime` shows the load)")


def window_set(step_ms: list[float], phase_ms: dict[str, list[float]], kind: str) -> Windows:
    """The windows to judge by, each phase's share of the step in each of them, and which were used.
    ``kind`` names a window ("log window", "profiled step"). A phase without a figure per window is left out."""
    n = len(step_ms)
    mid = statistics.median(step_ms) if n else 0.0
    keep = [i for i, s in enumerate(step_ms) if s > 0 and not (n > 2 and s >= SPIKE * mid)]
    phases = {p: v for p, v in phase_ms.items() if len(v) == n}
    return Windows(kind=kind, total=n, used=tuple(i + 1 for i in keep),
                   left_out=tuple(i + 1 for i in range(n) if i not in keep), step_ms=tuple(step_ms[i] for i in keep),
                   phase_ms={p: tuple(v[i] for i in keep) for p, v in phases.items()},
                   shares={p: tuple(v[i] / step_ms[i] for i in keep) for p, v in phases.items()},
                   median_step_ms=mid)


def _ranges(idx: tuple[int, ...]) -> str:
    """``(1, 2, 3, 5)`` -> ``1-3, 5``."""
    parts, start = [], None
    for i, v in enumerate(idx):
        if start is None:
            start = v
        if i + 1 == len(idx) or idx[i + 1] != v + 1:
            parts.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ", ".join(parts)


def describe(w: Optional[Windows]) -> str:
    """``log windows 1-3, 5-8 of 8 (window 4 left out: >= 3x the median step)``."""
    if w is None or not w.total:
        return "no windows"
    text = f"{w.kind}s {_ranges(w.used)} of {w.total}"
    if w.left_out:
        plural = "s" if len(w.left_out) > 1 else ""
        text += f" ({w.kind}{plural} {_ranges(w.left_out)} left out: >= {SPIKE:g}x the median step, machine busy)"
    return text


@dataclass(frozen=True)
class Confidence:
    """How sure the doctor is of one finding: ``level`` ("high", "medium", :data:`NOISY`, "unknown", "not
    timed") and ``why``; for a timed rule the phase's ``effect`` (its share of the step), the rule's ``threshold``,
    the number of ``windows`` judged over; with a spread, ``z`` (standard errors between the two; None when the
    windows do not vary), the lowest and highest share (``spread``) and the ``phase``."""

    level: str
    why: str
    windows: Optional[int] = None
    effect: Optional[float] = None
    threshold: Optional[float] = None
    z: Optional[float] = None
    spread: Optional[tuple[float, float]] = None
    phase: Optional[str] = None

    @property
    def noisy(self) -> bool:
        """Within the run's own noise: not named as the bottleneck."""
        return self.level == NOISY

    def label(self) -> str:
        """One line for the terminal: ``confidence high: data 70% of the step vs ...``."""
        return f"confidence {self.level}: {self.why}"

    def to_json(self) -> dict[str, Any]:
        """The keys ``tokenmill doctor --json`` prints: ``level`` and ``why`` for an untimed (or unwindowed)
        rule; with windows, ``effect``, ``threshold`` and ``windows``; with a spread, ``z``, ``spread`` and
        ``phase`` too."""
        if self.windows is None:
            return {"level": self.level, "why": self.why}
        if self.spread is None:
            return {"level": self.level, "windows": self.windows, "effect": self.effect,
                    "threshold": self.threshold, "why": self.why}
        return {"level": self.level, "effect": self.effect, "threshold": self.threshold, "z": self.z,
                "windows": self.windows, "spread": list(self.spread), "phase": self.phase, "why": self.why}

    @staticmethod
    def of_json(doc: dict[str, Any]) -> Confidence:
        """A rating from its :meth:`to_json` keys (a key this class lacks is a ``TypeError``)."""
        spread = doc.get("spread")
        return Confidence(**{**doc, "spread": tuple(spread) if spread is not None else None})


def phase_share(run: Run, phase: str) -> Optional[float]:
    """``phase``'s share of the step, from the typed run (the data wait and the copy are :class:`Data`'s)."""
    part = run.data if phase in ("data", "h2d") else run.timing
    return getattr(part, f"{phase}_share")


def rate(finding: dict[str, Any], run: Run | dict[str, Any]) -> Confidence:
    """The confidence of ``finding`` (a ranked finding dict with its rule's ``key``) from the typed run (or its
    flat facts, typed here) and its windows (``run.timing.windows``)."""
    run = run if isinstance(run, Run) else Run.of(run)
    key = finding["key"]
    basis = TIMED.get(key)
    if basis is None and (key in UNWINDOWED or (key in DEVICE_IDLE and run.device == "cuda")):
        return Confidence("unknown", f"timed ({UNWINDOWED.get(key, 'device idle time')}), but without "
                          "per-window figures: its spread is not known; `tokenmill doctor --try` measures the switch")
    if basis is None:
        return Confidence("not timed", "read from counts, the config or memory, which load does not move")
    phase, threshold = basis
    share = phase_share(run, phase)
    w = run.timing.windows
    shares = w.shares.get(phase, ()) if w is not None else ()
    if share is None or len(shares) < 2:
        return Confidence("unknown", "fewer than two windows: no spread to judge by; train more steps to know",
                          windows=len(shares), effect=share, threshold=threshold)
    se = statistics.stdev(shares) / math.sqrt(len(shares))
    z = (share - threshold) / se if se > 0 else math.inf
    level = "high" if z >= HIGH else "medium" if z >= ENOUGH else NOISY
    why = (f"{phase} {100 * share:.0f}% of the step vs the {100 * threshold:.0f}% threshold: "
           + ("no spread over" if z == math.inf else f"{z:.1f} standard errors over")
           + f" {len(shares)} windows ({100 * min(shares):.0f}-{100 * max(shares):.0f}%)")
    if level == NOISY:
        why += f"; within the noise. For a clearer run: {CLEARER}"
    return Confidence(level, why, windows=len(shares), effect=share, threshold=threshold,
                      z=z if math.isfinite(z) else None, spread=(min(shares), max(shares)), phase=phase)


def label(c: Confidence) -> str:
    """One line for the terminal: ``confidence high: data 70% of the step vs ...``."""
    return c.label()
