"""``ladder.png``: throughput per rung (left) and peak memory per rung (right), side by side.

The left panel shows tokens/s, or the time for the ladder's samples when that is the headline;
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
    rungs = doc["rungs"]
    labels = [f"{r['index']} {r['name']}" for r in rungs]
    ys = list(range(len(rungs)))[::-1]  # first rung on top
    time_headline = doc["ladder"]["headline"] == "time_for_samples"
    estimated = doc.get("mode") == "estimated"
    show_refs = estimated or compares_references(doc)
    what = "estimated" if estimated else "measured"
    hatch = "//" if estimated else None
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 1.6 + 0.45 * len(rungs)), sharey=True)

    key = "time_for_samples_s" if time_headline else "tokens_per_sec"
    vals = [_figures(r, estimated).get(key) for r in rungs]
    left.barh(ys, [v or 0 for v in vals], color="#4C72B0", label=what, hatch=hatch)
    refs = _reference_points(rungs, ys, key, show_refs)
    if refs:
        source = doc["ladder"]["reference"].get("hardware") or "seed"
        left.scatter([v for _, v in refs], [y for y, _ in refs], marker="D", s=22, facecolors="none",
                     edgecolors="black", zorder=3, label=f"seed reference ({source})")
        left.legend(**_LEGEND)
    top = max([v for v in vals if v] + [v for _, v in refs] or [1.0])
    for y, r, v in zip(ys, rungs, vals):
        if v is None:
            left.text(top * 0.01, y, r["status"] or "", va="center", fontsize=8, color="#B22222")
            continue
        m = _figures(r, estimated)
        text = f"{v:,.2f} s" if time_headline else f"{v:,.0f}"
        if m.get("speedup_vs_baseline"):
            text += f"  (x{m['speedup_vs_baseline']:.2f})"
        left.text(v, y, " " + text, va="center", fontsize=8)
    samples = doc["ladder"]["samples"]
    left.set_xlabel(f"time for {samples:,} samples (s), lower is better" if time_headline
                    else "tokens/s (estimated), higher is better" if estimated
                    else "tokens/s (median of timed windows), higher is better")
    left.set_xlim(0, top * 1.35)
    left.set_yticks(ys, labels)

    alloc = [_figures(r, estimated).get("peak_alloc_mb") for r in rungs]
    reserved = [_figures(r, estimated).get("peak_reserved_mb") for r in rungs]
    if any(v is not None for v in alloc + reserved):
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
    else:
        right.text(0.5, 0.5, f"no CUDA memory figures (ran on {doc['gpu']})", ha="center", va="center",
                   transform=right.transAxes)
        right.set_xticks([])
    smoke = " [smoke: tiny shapes]" if doc["smoke"] else (" [estimated, nothing run]" if estimated else "")
    fig.suptitle(f"tokenmill ladder '{doc['ladder']['name']}' on {doc['gpu']}, torch {doc['torch']}{smoke}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
