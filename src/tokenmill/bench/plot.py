"""``ladder.png``: throughput per rung (left) and peak memory per rung (right), side by side; a run
without memory figures (CPU) gets the throughput panel alone, not an empty half.

The left panel shows tokens/s, or the time for the ladder's samples when that is the headline, with the
spread over the rung's timed windows as min-max error bars, on a value axis that fits bars, bars'
maxima and references (:func:`value_axis`);
skipped and failed rungs keep their row, labelled, so the ladder's shape stays visible. The seed's
reference figures (hollow diamonds) are drawn only for a real run on a CUDA GPU: beside --smoke or
CPU figures they would only flatten the bars. A ladder predicted with ``--estimate`` draws the
estimates as the bars (hatched), always beside the references. matplotlib is optional: without it
the PNG is skipped with a note.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from tokenmill.bench.references import compares_references

_LEGEND = {"loc": "lower left", "bbox_to_anchor": (0.0, 1.0), "ncol": 3, "fontsize": 8, "frameon": False}


def _reference_points(rungs: list[dict[str, Any]], ys: list[int], key: str, show: bool) -> list[tuple[int, float]]:
    if not show:
        return []
    return [(y, r["reference"][key]) for y, r in zip(ys, rungs) if key in r["reference"]]


def _figures(r: dict[str, Any], estimated: bool) -> dict[str, Any]:
    """A rung's figures: its estimate (``--estimate``) or its measured metrics."""
    return (r.get("estimate") if estimated else r.get("metrics")) or {}


def write_png(doc: dict[str, Any], path: Path) -> Optional[str]:
    """Write the figure; returns None, or a note saying why no PNG was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no ladder.png"
    fig = figure(doc)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def figure(doc: dict[str, Any]):
    """The ladder's matplotlib figure: the throughput panel, and the memory panel when there are memory
    figures (a CPU run has none: one panel, not an empty half)."""
    import matplotlib.pyplot as plt

    rungs = doc["rungs"]
    ys = list(range(len(rungs)))[::-1]  # first rung on top
    estimated = doc.get("mode") == "estimated"
    show_refs = estimated or compares_references(doc)
    what, hatch = ("estimated", "//") if estimated else ("measured", None)
    alloc = [_figures(r, estimated).get("peak_alloc_mb") for r in rungs]
    reserved = [_figures(r, estimated).get("peak_reserved_mb") for r in rungs]
    has_memory = any(v is not None for v in alloc + reserved)
    fig, axes = plt.subplots(1, 2 if has_memory else 1, figsize=(14 if has_memory else 8, 1.6 + 0.45 * len(rungs)),
                             sharey=True, squeeze=False)
    _throughput_panel(axes[0][0], doc, ys, what, hatch, show_refs)
    axes[0][0].set_yticks(ys, [f"{r['index']} {r['name']}" for r in rungs])
    if has_memory:
        _memory_panel(axes[0][1], rungs, ys, alloc, reserved, what, hatch, show_refs)
    smoke = " [smoke: tiny shapes]" if doc["smoke"] else (" [estimated, nothing run]" if estimated else "")
    fig.suptitle(f"tokenmill ladder '{doc['ladder']['name']}' on {doc['gpu']}, torch {doc['torch']}{smoke}")
    fig.tight_layout()
    return fig


def _throughput_panel(left, doc: dict[str, Any], ys: list[int], what: str, hatch, show_refs: bool) -> None:
    """tokens/s (or the time for the samples) per rung, with the spread over the timed windows (min-max
    error bars) and the seed's references; the value axis fits them (:func:`value_axis`)."""
    rungs, estimated = doc["rungs"], doc.get("mode") == "estimated"
    time_headline = doc["ladder"]["headline"] == "time_for_samples"
    key = "time_for_samples_s" if time_headline else "tokens_per_sec"
    vals = [_figures(r, estimated).get(key) for r in rungs]
    spans = [window_span(_figures(r, estimated), key) for r in rungs]
    left.barh(ys, [v or 0 for v in vals], color="#4C72B0", label=what, hatch=hatch)
    bars = [(y, v, lo, hi) for y, v, (lo, hi) in zip(ys, vals, spans) if v is not None and lo is not None]
    if bars:
        left.errorbar([b[1] for b in bars], [b[0] for b in bars], fmt="none", ecolor="black", capsize=3,
                      xerr=[[v - lo for _, v, lo, _ in bars], [hi - v for _, v, _, hi in bars]],
                      label="spread over the timed windows (min-max)")
    refs = _reference_points(rungs, ys, key, show_refs)
    if refs:
        source = doc["ladder"]["reference"].get("hardware") or "seed"
        left.scatter([v for _, v in refs], [y for y, _ in refs], marker="D", s=22, facecolors="none",
                     edgecolors="black", zorder=3, label=f"seed reference ({source})")
    if refs or bars:
        left.legend(**_LEGEND)
    lo_x, hi_x = value_axis(vals, [hi for _, hi in spans], [v for _, v in refs])
    for y, r, v in zip(ys, rungs, vals):
        if v is None:
            left.text(hi_x * 0.01, y, r["status"] or "", va="center", fontsize=8, color="#B22222")
            continue
        m = _figures(r, estimated)
        text = f"{v:,.2f} s" if time_headline else f"{v:,.0f}"
        if m.get("speedup_vs_baseline"):
            text += f"  (x{m['speedup_vs_baseline']:.2f})"
        left.text(v, y, " " + text, va="center", fontsize=8)
    samples = doc["ladder"]["samples"]
    left.set_xlabel(f"time for {samples:,} samples (s), lower is better" if time_headline
                    else "tokens/s (estimated), higher is better" if estimated
                    else "tokens/s (median of timed windows, bars: min-max), higher is better")
    left.set_xlim(lo_x, hi_x)


def window_span(m: dict[str, Any], key: str) -> tuple[Optional[float], Optional[float]]:
    """The lowest and highest value of ``key`` over a rung's timed windows (tokens/s: the windows' min and
    max; the time for the samples: samples x block / those); (None, None) when unknown."""
    lo, hi, v = m.get("tokens_per_sec_min"), m.get("tokens_per_sec_max"), m.get(key)
    if not (lo and hi and v) or not lo <= (m.get("tokens_per_sec") or 0) <= hi:  # not a window spread
        return None, None
    if key == "tokens_per_sec":
        return lo, hi
    tps = m.get("tokens_per_sec")
    return (v * tps / hi, v * tps / lo) if tps else (None, None)  # a time: inversely proportional to tokens/s


def value_axis(values: list[Optional[float]], highs: list[Optional[float]] = (),
               refs: list[float] = ()) -> tuple[float, float]:
    """The value axis of the throughput panel: from 0 to the largest bar, window maximum or reference, plus
    35% for the value labels: it fits the data, whatever its scale (CPU or GPU)."""
    top = max([v for v in [*values, *highs, *refs] if v] or [1.0])
    return 0.0, top * 1.35


def _memory_panel(right, rungs, ys, alloc, reserved, what, hatch, show_refs) -> None:
    """Peak allocated and reserved memory per rung (CUDA), with the seed's references."""
    h = 0.38
    right.barh([y + h / 2 for y in ys], [(v or 0) / 1024 for v in alloc], h, label=f"peak allocated ({what})",
               color="#55A868", hatch=hatch)
    right.barh([y - h / 2 for y in ys], [(v or 0) / 1024 for v in reserved], h, label=f"peak reserved ({what})",
               color="#C44E52", alpha=0.7, hatch=hatch)
    for y, v in zip(ys, alloc):
        if v is not None:
            right.text(v / 1024, y + h / 2, f" {v / 1024:.2f}", va="center", fontsize=7)
    mem_top = max(v for v in alloc + reserved if v is not None)
    for key, dy, color in (("peak_alloc_mb", h / 2, "#1E5631"), ("peak_reserved_mb", -h / 2, "#7A1F1F")):
        pts = _reference_points(rungs, ys, key, show_refs)
        if pts:
            right.scatter([v / 1024 for _, v in pts], [y + dy for y, _ in pts], marker="D", s=16,
                          facecolors="none", edgecolors=color, zorder=3, label=f"seed reference ({key.split('_')[1]})")
            mem_top = max([mem_top] + [v for _, v in pts])
    right.set_xlim(0, mem_top / 1024 * 1.15)  # room for the labels, and for references beyond the bars
    right.legend(**_LEGEND)
    right.set_xlabel("GPU memory (GB = 1024^3 bytes)")
