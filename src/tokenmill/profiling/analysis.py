"""Figures read from a profiled window: time per phase, device busy fraction, top operators, host syncs.

All functions take a :class:`~tokenmill.profiling.trace.Trace` and return plain dicts (the body of
``profile.json``). Times are milliseconds per profiled step unless a name says otherwise.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from tokenmill.profiling.trace import OUTSIDE, Span, Trace, phase_of, union_length
from tokenmill.train.timing import PHASES

BREAKDOWN = (*PHASES, "idle")

# ATen operators that read device memory back to the host, so the host waits for the device.
SYNC_OPS = frozenset({
    "aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::is_nonzero",
    "aten::equal", "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_consecutive",
    "aten::nonzero_static", "aten::repeat_interleave",
})
# CUDA runtime calls that block the host until the device (or a stream) has caught up.
SYNC_RUNTIME = frozenset({
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
})
# torch.optim keeps step counters on the host (unless capturable/fused): their .item() reads host memory.
HOST_SCALAR_PARENTS = ("Optimizer.step#",)
GEMM_WORDS = ("gemm", "matmul", "cutlass", "sm80_xmma", "sm90_xmma", "nvjet", "cublas")
ATTENTION_WORDS = ("flash", "fmha", "attention", "efficient_attention", "cudnn_sdpa")
# Forward operators of the model's layers that no backward formula calls: found inside a backward
# region they are the forward recomputed under activation checkpointing; outside every phase region
# they are a forward pass that is not training (an evaluation).
FORWARD_OPS = frozenset({
    "aten::linear", "aten::layer_norm", "aten::rms_norm", "aten::gelu", "aten::silu",
    "aten::scaled_dot_product_attention", "aten::softmax", "aten::embedding", "aten::cross_entropy_loss",
})


def breakdown(trace: Trace) -> dict[str, Any]:
    """Host time per step in each trainer phase; 'idle' is the rest of the step (no phase open).

    Only outermost phase regions count, so a nested alias (a 'data' region around the DataLoader's
    own region) is not counted twice."""
    n = max(1, len(trace.steps))
    totals = defaultdict(float)
    for r in trace.regions:
        if any(phase_of(a.name) for a in r.ancestors() if a.cat == "user_annotation"):
            continue
        if trace.step_at(r.ts) is not None:
            totals[phase_of(r.name)] += r.dur
    step_us = sum(s.dur for s in trace.steps) / n
    per_step = {p: totals[p] / n / 1000 for p in PHASES}
    per_step["idle"] = max(0.0, step_us / 1000 - sum(per_step.values()))
    per_step["step"] = step_us / 1000
    share = {k: (v / per_step["step"] if per_step["step"] else 0.0) for k, v in per_step.items() if k != "step"}
    steps = [int(s.name.split("#")[1]) + 1 for s in trace.steps]  # ProfilerStep#N is training step N+1
    return {"steps": steps, "ms_per_step": per_step, "share": share, "each_step_ms": each_step(trace),
            "recompute": recompute(trace), "outside": outside_phases(trace)}


def each_step(trace: Trace) -> dict[str, list[float]]:
    """Host ms of every phase (and of the whole step) in each profiled step: the run's own noise."""
    out = {p: [0.0] * len(trace.steps) for p in PHASES}
    for r in trace.regions:
        if any(phase_of(a.name) for a in r.ancestors() if a.cat == "user_annotation"):
            continue
        i = trace.step_at(r.ts)
        if i is not None:
            out[phase_of(r.name)][i] += r.dur / 1000
    out["step"] = [s.dur / 1000 for s in trace.steps]
    return out


def _outermost_forward_ops(trace: Trace, spans) -> list[Span]:
    return [s for s in spans if s.cat == "cpu_op" and s.name in FORWARD_OPS
            and not any(a.name in FORWARD_OPS for a in s.ancestors())]


def recompute(trace: Trace) -> dict[str, Any]:
    """Forward work repeated inside ``backward`` regions (activation checkpointing), per step.

    Found by the outermost forward operators of the layers (``aten::linear``, ``layer_norm``/``rms_norm``,
    ``gelu``/``silu``, ``scaled_dot_product_attention``, ...; no backward formula calls them) that run inside
    backward. They are only part of a forward (residual adds, reshapes and dropout come between
    them), so their time is scaled by the forward phase's own ratio of its whole time to the time of
    the same operators in it. With device events, the same for the device time of the kernels they
    launched."""
    n = max(1, len(trace.steps))
    main = [s for s in trace.in_window(trace.host) if (s.pid, s.tid) == trace.main]
    ops = _outermost_forward_ops(trace, main)
    where = {id(s): trace.region_at(s.ts) for s in ops}
    again = [s for s in ops if where[id(s)] == "backward"]
    first = [s for s in ops if where[id(s)] == "forward"]
    fwd_ms = sum(r.dur for r in trace.regions if r.name == "forward" and trace.step_at(r.ts) is not None) / 1000
    host_ops = sum(s.dur for s in again) / 1000
    scale = fwd_ms / (sum(s.dur for s in first) / 1000) if first else 1.0
    out: dict[str, Any] = {"basis": "outermost forward operators (linear, norms, gelu/silu, attention, ...) inside "
                           "backward regions, scaled by the forward phase's time over the same operators' time in it",
                           "ops_per_step": len(again) / n, "ops_host_ms_per_step": host_ops / n,
                           "host_ms_per_step": host_ops * scale / n, "device_ms_per_step": None}
    if trace.device:
        dev = {"forward": 0.0, "backward": 0.0}
        ids = {id(s): where[id(s)] for s in again + first}
        fwd_dev = 0.0
        for k in trace.device_in_window():
            launch = trace.launch_of(k)
            if launch is None:
                continue
            phase = next((ids[id(a)] for a in launch.ancestors() if id(a) in ids), None)
            if phase:
                dev[phase] += k.dur
            if trace.region_at(launch.ts) == "forward":
                fwd_dev += k.dur
        dscale = fwd_dev / dev["forward"] if dev["forward"] else 1.0
        out["device_ms_per_step"] = dev["backward"] * dscale / n / 1000
    return out


def eval_spans(trace: Trace) -> dict[int, tuple[float, float]]:
    """Per profiled step (index), the span from the first to the last forward operator that ran
    outside every phase region: an evaluation."""
    main = [s for s in trace.in_window(trace.host) if (s.pid, s.tid) == trace.main]
    spans: dict[int, tuple[float, float]] = {}
    for s in _outermost_forward_ops(trace, main):
        i = trace.step_at(s.ts)
        if i is not None and trace.region_at(s.ts) == OUTSIDE:
            lo, hi = spans.get(i, (s.ts, s.end))
            spans[i] = (min(lo, s.ts), max(hi, s.end))
    return spans


def outside_phases(trace: Trace) -> dict[str, Any]:
    """What the host did outside every phase region within the profiled steps: a forward pass there is
    an evaluation (counted from its first to its last forward operator in each step; the trainer
    opens no region around it), the rest is logging and the loop."""
    n = max(1, len(trace.steps))
    spans = eval_spans(trace)
    return {"basis": "first to last forward operator outside the phase regions, per step",
            "eval_ms_per_step": sum(hi - lo for lo, hi in spans.values()) / n / 1000,
            "steps_with_eval": len(spans)}


def device_breakdown(trace: Trace) -> dict[str, Any] | None:
    """CUDA only: device time per step by the phase that launched it, and the busy fraction."""
    kernels = trace.device_in_window()
    if not kernels:
        return None
    n = max(1, len(trace.steps))
    lo, hi = trace.device_window()
    busy = union_length([(k.ts, k.end) for k in kernels], lo, hi)
    by_region = defaultdict(float)
    for k in kernels:
        by_region[trace.region_of_device(k)] += k.dur
    only_kernels = [k for k in kernels if k.cat == "kernel"]
    mean_us = sum(k.dur for k in only_kernels) / len(only_kernels) if only_kernels else 0.0
    return {
        "basis": "CUDA kernels, memcpys and memsets launched in the profiled steps (union of intervals)",
        "busy_fraction": busy / (hi - lo) if hi > lo else None,
        "busy_ms_per_step": busy / n / 1000,
        "window_ms_per_step": (hi - lo) / n / 1000,
        "ms_per_step_by_launching_phase": {k: v / n / 1000 for k, v in sorted(by_region.items())},
        "kernels_per_step": len(only_kernels) / n,
        "mean_kernel_us": mean_us,
        "gemm_share": _share(only_kernels, GEMM_WORDS),
        "attention_kernel_share": _share(only_kernels, ATTENTION_WORDS),
    }


def host_busy(trace: Trace) -> dict[str, Any]:
    """Fraction of the profiled window in which the main thread ran an ATen operator."""
    lo, hi = trace.window
    ops = [s for s in trace.in_window(trace.host) if (s.pid, s.tid) == trace.main and s.cat == "cpu_op"]
    busy = union_length([(s.ts, s.end) for s in ops], lo, hi)
    n = max(1, len(trace.steps))
    return {
        "basis": "ATen operators on the main thread (union of intervals over the profiled steps)",
        "busy_fraction": busy / (hi - lo) if hi > lo else None,
        "ops_per_step": len(ops) / n,
        "mean_op_us": sum(s.self_time for s in ops) / len(ops) if ops else 0.0,
    }


def top_ops(trace: Trace, k: int = 15) -> list[dict[str, Any]]:
    """Host operators by self time (all threads), per step."""
    agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for s in trace.in_window(trace.host):
        if s.cat == "cpu_op":
            agg[s.name][0] += s.self_time
            agg[s.name][1] += 1
    return _rank(agg, len(trace.steps), k)


def top_kernels(trace: Trace, k: int = 15) -> list[dict[str, Any]]:
    """Device kernels (and copies) by total time, per step."""
    agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for s in trace.device_in_window():
        agg[s.name][0] += s.dur
        agg[s.name][1] += 1
    return _rank(agg, len(trace.steps), k)


def _rank(agg, steps: int, k: int) -> list[dict[str, Any]]:
    n = max(1, steps)
    total = sum(v[0] for v in agg.values()) or 1.0
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:k]
    return [
        {"name": name, "self_ms_per_step": t / n / 1000, "share": t / total, "calls_per_step": c / n}
        for name, (t, c) in rows
    ]


def _share(kernels: list[Span], words) -> float:
    total = sum(k.dur for k in kernels) or 1.0
    return sum(k.dur for k in kernels if any(w in k.name.lower() for w in words)) / total


def syncs(trace: Trace) -> dict[str, Any]:
    """Host-device synchronisations per step and where they come from.

    With device events in the trace (CUDA), the blocking CUDA runtime calls are counted and each is
    traced up to the operator and phase that issued it. Without them (CPU), the operators that would
    block on an accelerator (``aten::item``, ``nonzero``, ...) are counted instead; scalar reads
    inside ``torch.optim`` steps are left out (their step counters live on the host). Syncs of an
    evaluation inside the profiled steps (outside the phases, from its first forward operator on) are
    counted apart, in ``in_evaluation_per_step``."""
    n = max(1, len(trace.steps))
    cuda = bool(trace.device)
    evals = eval_spans(trace)
    in_eval = 0
    counts: dict[tuple, int] = defaultdict(int)
    times: dict[tuple, float] = defaultdict(float)  # us inside the sync calls (CUDA: the host blocked)
    for s in trace.in_window(trace.host):
        if cuda:
            if s.cat not in ("cuda_runtime", "cuda_driver") or s.name not in SYNC_RUNTIME:
                continue
        else:
            if s.cat != "cpu_op" or s.name not in SYNC_OPS or not _reads_back(s):
                continue
            if any(a.name in SYNC_OPS for a in s.ancestors()):
                continue  # counted at the outermost sync operator (item -> _local_scalar_dense)
            if any(a.name.startswith(HOST_SCALAR_PARENTS) for a in s.ancestors()):
                continue
        src = _source(trace, s)
        i = trace.step_at(s.ts)
        if src[3] == OUTSIDE and i in evals and s.ts >= evals[i][0]:
            in_eval += 1  # the evaluation's read-back (it runs after the step's logging): not a training sync
            continue
        counts[src] += 1
        times[src] += s.dur
    sources = [
        {"call": call, "op": op, "parent": parent, "region": region, "python": py, "per_step": c / n,
         "ms_per_step": times[(call, op, parent, region, py)] / n / 1000}
        for (call, op, parent, region, py), c in sorted(counts.items(), key=lambda kv: -kv[1])
    ]
    return {
        "basis": "blocking CUDA runtime calls" if cuda else "operators that would block on an accelerator",
        "per_step": sum(counts.values()) / n,
        "ms_per_step": sum(times.values()) / n / 1000,
        "sources": sources,
        "in_evaluation_per_step": in_eval / n,
    }


def _reads_back(s: Span) -> bool:
    """Whether an operator of :data:`SYNC_OPS` reads device memory back here. ``repeat_interleave`` does
    only with a tensor of repeats (its output size depends on their values); with an int (grouped-query
    attention repeating its key/value heads) it is an expand and a copy. Told apart by the recorded input
    types where the trace has them, else counted."""
    if s.name == "aten::repeat_interleave":
        types = s.args.get("Input type") or []
        return not (len(types) > 1 and types[1] == "Scalar")
    return True


def _source(trace: Trace, s: Span) -> tuple:
    """(call, outermost sync op, nearest other parent, phase, python frame) for one sync."""
    op = s.name if s.name in SYNC_OPS else ""
    parent, py = "", ""
    for a in s.ancestors():
        if a.name in SYNC_OPS:
            op = a.name
            continue
        if a.cat == "python_function" and not py and "tokenmill" in a.name:
            py = a.name
        if not parent and a.cat in ("cpu_op", "user_annotation") and not a.name.startswith("ProfilerStep#"):
            parent = a.name
    region = trace.region_at(s.ts)
    if region == OUTSIDE and not parent:
        parent = "training loop (logging / loss read-back)"
    return (s.name, op, parent, region, py)
