"""When a ladder run is compared with the seeds' reference figures: shared by the report
(:mod:`tokenmill.bench.report`) and the figure (:mod:`tokenmill.bench.plot`), which both sit above it."""

from __future__ import annotations

from typing import Any


def on_gpu(rung: dict[str, Any]) -> bool:
    """Whether the rung trained on a CUDA device (the trainer's summary says)."""
    return (rung.get("summary") or {}).get("device") == "cuda"


def compares_references(doc: dict[str, Any]) -> bool:
    """Seed figures are compared (and drawn) only for a real run on a CUDA GPU, never for --smoke or CPU runs."""
    return not doc["smoke"] and any(on_gpu(r) for r in doc["rungs"])
