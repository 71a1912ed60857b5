"""Memory: the peak of the profiled steps from the profiler's allocator events, and CUDA allocator tools.

``[memory]`` events carry the allocator's running total after each allocation or free (``Total
Allocated``), the size (``Bytes``, negative for a free), the address and the device. On CUDA the total
is the caching allocator's allocated bytes (absolute). On CPU it only counts blocks allocated while
the profiler ran, so the CPU figures are relative to the start of profiling.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import torch

from tokenmill.profiling.trace import Trace

MB = 1024**2
CUDA_DEVICE_TYPE = 1


def memory_peak(trace: Trace, logits_numels: tuple[int, ...] = (), top: int = 8) -> Optional[dict[str, Any]]:
    """The allocation peak within the profiled steps: size, when in the step, the phase and operator
    running at that moment, and the largest blocks alive then (with the operator that allocated them).

    ``logits_numels`` (batch x length x vocabulary, padded or not) mark live blocks of 2 or 4 bytes per
    such element: the logits, their fp32 copies, log-softmax, their gradients."""
    events = trace.memory
    if not events or not trace.steps:
        return None
    cuda = any(e["args"].get("Device Type") == CUDA_DEVICE_TYPE for e in events)
    dev = CUDA_DEVICE_TYPE if cuda else 0
    events = [e for e in events if e["args"].get("Device Type", 0) == dev]
    lo, hi = trace.window
    live: dict[Any, tuple[int, dict]] = {}
    best, best_live = None, None
    for e in events:
        a = e["args"]
        if e["ts"] >= hi:
            break
        b = a.get("Bytes", 0)
        if b > 0:
            live[a.get("Addr")] = (b, e)
        elif b < 0:
            live.pop(a.get("Addr"), None)
        if e["ts"] >= lo and (best is None or a.get("Total Allocated", 0) > best["args"].get("Total Allocated", 0)):
            best, best_live = e, dict(live)
    if best is None:
        return None
    ts = best["ts"]
    step = trace.step_at(ts)
    step_span = trace.steps[step] if step is not None else trace.steps[0]
    op = trace.span_at(best["pid"], best["tid"], ts)
    peak = best["args"].get("Total Allocated", 0)
    blocks = _group_blocks(trace, best_live.values())
    start = _total_at(events, step_span.ts)
    out = {
        "basis": "CUDA caching allocator (absolute)" if cuda else "CPU allocations made while profiling (relative)",
        "device": "cuda" if cuda else "cpu",
        "peak_mb": peak / MB,
        "step_start_mb": start / MB,
        "transient_mb": max(0, peak - start) / MB,
        "peak_step": int(step_span.name.split("#")[1]) + 1,
        "peak_at_ms": (ts - step_span.ts) / 1000,
        "peak_at_fraction": (ts - step_span.ts) / step_span.dur if step_span.dur else None,
        "peak_region": trace.region_at(ts),
        "peak_op": _op_chain(op),
        "top_live": blocks[:top],
    }
    if logits_numels:
        out["vocab_sized_mb"] = sum(b for b, _ in best_live.values() if _vocab_sized(b, logits_numels)) / MB
    return out


def _vocab_sized(nbytes: int, numels: tuple[int, ...]) -> bool:
    return any(n > 0 and nbytes in (2 * n, 4 * n) for n in numels)


def _total_at(events: list[dict], ts: float) -> int:
    """Allocator total just before ``ts`` (events are sorted by time)."""
    total = None
    for e in events:
        a = e["args"]
        if e["ts"] >= ts:
            if total is None:  # nothing earlier: the total before this event
                total = a.get("Total Allocated", 0) - a.get("Bytes", 0)
            break
        total = a.get("Total Allocated", 0)
    return total or 0


def _group_blocks(trace: Trace, blocks) -> list[dict[str, Any]]:
    """Live blocks grouped by (allocating operator, phase), largest first."""
    groups: dict[tuple, list[float]] = defaultdict(lambda: [0, 0])
    for b, e in blocks:
        op = trace.span_at(e["pid"], e["tid"], e["ts"])
        ts = e["ts"]
        key = (_op_chain(op), trace.region_at(ts) if ts >= trace.window[0] else "before the profiled steps")
        groups[key][0] += b
        groups[key][1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return [{"op": op, "region": region, "mb": b / MB, "blocks": n} for (op, region), (b, n) in rows]


def _op_chain(span) -> str:
    """'outer > inner' names of the operators/regions open at a moment (at most three, innermost last)."""
    names = []
    while span is not None and len(names) < 3:
        if not span.name.startswith("ProfilerStep#"):
            names.append(span.name)
        span = span.parent
    return " > ".join(reversed(names)) if names else "(no operator)"


# The column order of ``export_memory_timeline``'s JSON (``[times, [sizes by category]]``): a leading
# unused column, then torch.profiler._memory_profiler's categories, then uncategorised memory.
TIMELINE_COLUMNS = ("_", "parameter", "optimizer_state", "input", "temporary", "activation", "gradient",
                    "autograd_detail", "unknown")


def export_timeline(prof, run_dir: Path, device: str, html: bool) -> list[str]:
    """Write ``memory_timeline.json`` (and ``.html`` when asked) from the profiler's memory profile,
    which sorts every tensor into a category; needs record_shapes, profile_memory and with_stack.
    Returns notes on what failed."""
    import warnings

    notes = []
    names = ["memory_timeline.json"] + (["memory_timeline.html"] if html else [])
    for name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                prof.export_memory_timeline(str(run_dir / name), device=device)
        except Exception as e:  # the memory profile is best-effort in PyTorch
            notes.append(f"{name} not written ({type(e).__name__}: {str(e)[:160]})")
    return notes


def categories_at_peak(path: Path) -> Optional[dict[str, float]]:
    """MB per category (parameter, optimizer_state, activation, gradient, ...) at the timeline's peak."""
    import json

    try:
        _times, sizes = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not sizes:
        return None
    row = max(sizes, key=sum)
    return {name: v / MB for name, v in zip(TIMELINE_COLUMNS, row) if name != "_"}


# ----------------------------------------------------------------------------------------------
# CUDA-only helpers (callers check torch.cuda.is_available() and the run's device)

ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms", "num_sync_all_streams")


def allocator_counters() -> dict[str, int]:
    """The allocator's cumulative event counters (cudaMalloc/cudaFree calls, retries after a failed
    allocation that forced freeing the cache, OOMs)."""
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS}


def allocator_summary(before: dict[str, int], steps: int) -> dict[str, Any]:
    """Counters over the profiled steps (delta from ``before``) plus reserved/allocated figures."""
    stats = torch.cuda.memory_stats()
    after = allocator_counters()
    delta = {k: after[k] - before.get(k, 0) for k in ALLOCATOR_COUNTERS}
    n = max(1, steps)
    allocated = stats.get("allocated_bytes.all.current", 0)
    reserved = stats.get("reserved_bytes.all.current", 0)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "during_profiled_steps": delta,
        "cuda_malloc_per_step": delta["num_device_alloc"] / n,
        "cuda_free_per_step": delta["num_device_free"] / n,
        "alloc_retries_total": after["num_alloc_retries"],
        "allocated_mb": allocated / MB,
        "reserved_mb": reserved / MB,
        "reserved_minus_allocated_mb": (reserved - allocated) / MB,
        "peak_allocated_mb": stats.get("allocated_bytes.all.peak", 0) / MB,
        "peak_reserved_mb": stats.get("reserved_bytes.all.peak", 0) / MB,
        "inactive_split_mb": stats.get("inactive_split_bytes.all.current", 0) / MB,
        "device_total_mb": props.total_memory / MB,
    }


def start_memory_history() -> bool:
    """Start recording allocator history for a snapshot; False if this torch cannot."""
    try:
        # Python stacks only: C++ stacks make the dump take minutes and the pickle hundreds of MB
        torch.cuda.memory._record_memory_history(max_entries=30000, stacks="python")
        return True
    except Exception:  # pragma: no cover - depends on the torch build
        return False


def dump_snapshot(path: Path) -> Optional[str]:
    """Write the snapshot (open it at https://pytorch.org/memory_viz); returns an error message
    instead of raising."""
    try:
        torch.cuda.memory._dump_snapshot(str(path))
        return None
    except Exception as e:  # pragma: no cover - depends on the torch build
        return f"memory snapshot failed: {e}"


def stop_memory_history() -> None:
    try:
        torch.cuda.memory._record_memory_history(enabled=None)
    except Exception:  # pragma: no cover
        pass
