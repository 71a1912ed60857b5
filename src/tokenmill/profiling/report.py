"""Human-readable output of ``tokenmill profile``: ``profile.md`` and ``profile.png``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from tokenmill import atomic
from tokenmill.profiling.analysis import BREAKDOWN
from tokenmill.profiling.trace import Trace

PHASE_LABELS = {
    "data": "data wait", "h2d": "host-to-device copy", "forward": "forward", "backward": "backward",
    "optimizer": "optimizer", "idle": "idle (no phase open)",
}
COLORS = {
    "data": "#d62728", "h2d": "#9467bd", "forward": "#1f77b4", "backward": "#2ca02c",
    "optimizer": "#ff7f0e", "idle": "#bbbbbb",
}


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def markdown(p: dict[str, Any]) -> str:
    """The report as Markdown text."""
    b = p["breakdown"]
    ms, share = b["ms_per_step"], b["share"]
    gpu = p.get("gpu") or {}
    lines = [
        "# tokenmill profile",
        "",
        f"Device: {gpu.get('name', p['device'])}; profiled training steps {b['steps']} (schedule wait "
        f"{p['schedule']['wait']}, warmup {p['schedule']['warmup']}, active {p['schedule']['active']}); "
        f"{p['tokens_per_step']:,} tokens per step. Times include the profiler's own overhead, which is "
        "largest for many small operators.",
        "",
        "## Time per step",
        "",
        "Host time inside the trainer's `record_function` regions of each `ProfilerStep#N`; idle is the "
        "rest of the step (logging, the Python loop, waiting on the device outside a region).",
        "",
    ]
    rows = [[PHASE_LABELS[k], f"{ms[k]:.2f}", _pct(share[k])] for k in BREAKDOWN]
    lines += _table(["phase", "ms / step", "share"], rows + [["**step**", f"{ms['step']:.2f}", "100%"]])
    lines += _within_step_lines(b)
    lines += ["", *_busy_lines(p), "", "## Top operators by self time", ""]
    lines += _table(
        ["operator", "ms / step", "share", "calls / step"],
        [[f"`{r['name'][:80]}`", f"{r['self_ms_per_step']:.3f}", _pct(r["share"]), f"{r['calls_per_step']:.0f}"]
         for r in p["top_ops"][:10]],
    )
    if p.get("top_kernels"):
        lines += ["", "## Top device kernels", ""]
        lines += _table(
            ["kernel", "ms / step", "share", "calls / step"],
            [[f"`{r['name'][:80]}`", f"{r['self_ms_per_step']:.3f}", _pct(r["share"]), f"{r['calls_per_step']:.0f}"]
             for r in p["top_kernels"][:10]],
        )
    lines += ["", *_sync_lines(p["syncs"]), "", *_memory_lines(p)]
    if p.get("per_block"):
        pb = p["per_block"]
        lines += ["", "## Per-block regions (forward, and its recomputation under activation checkpointing)", "",
                  f"attention {pb['attn_ms_per_step']:.2f} ms / step, MLP {pb['mlp_ms_per_step']:.2f} ms / step."]
    lines += ["", "## Files", ""] + [f"- `{v}` ({k})" for k, v in p.get("files", {}).items()]
    if p.get("notes"):
        lines += ["", "## Notes and skipped parts", ""] + [f"- {n}" for n in p["notes"]]
    return "\n".join(lines) + "\n"


def _within_step_lines(b: dict[str, Any]) -> list[str]:
    """Recompute inside backward and an evaluation between the steps, when the trace shows them."""
    out = []
    rec = b.get("recompute") or {}
    if rec.get("ops_per_step"):
        dev = rec.get("device_ms_per_step")
        out.append(f"Forward recomputed in backward (activation checkpointing): {rec['host_ms_per_step']:.2f} ms / step "
                   "on the host" + (f", {dev:.2f} ms / step on the device" if dev is not None else "")
                   + f" ({rec['ops_per_step']:.0f} forward operators per step inside backward, scaled to the whole "
                   "forward).")
    ev = b.get("outside") or {}
    if ev.get("steps_with_eval"):
        out.append(f"Evaluation between the training phases in {ev['steps_with_eval']} profiled step(s): "
                   f"{ev['eval_ms_per_step']:.2f} ms / step (part of idle).")
    return ["", *out] if out else []


def _busy_lines(p: dict[str, Any]) -> list[str]:
    d, h = p.get("device_busy"), p["host_busy"]
    out = ["## Busy and idle", ""]
    if d:
        out.append(
            f"Device busy {_pct(d['busy_fraction'])} of the profiled window ({d['basis']}); "
            f"{d['kernels_per_step']:.0f} kernels per step, mean {d['mean_kernel_us']:.1f} us; "
            f"matmul kernels {_pct(d['gemm_share'])} of kernel time."
        )
        out += ["", "Device time per step by the phase that launched it:", ""]
        out += _table(["phase", "device ms / step"],
                      [[k, f"{v:.2f}"] for k, v in d["ms_per_step_by_launching_phase"].items()])
        out.append("")
    else:
        out.append("Device timeline: n/a (no CUDA device in this run).")
    out.append(
        f"Host: the main thread ran ATen operators {_pct(h['busy_fraction'])} of the window "
        f"({h['ops_per_step']:.0f} operators per step, mean self time {h['mean_op_us']:.1f} us)."
    )
    return out


def _sync_lines(s: dict[str, Any]) -> list[str]:
    out = ["## Host-device synchronisations", "", f"{s['per_step']:.2f} per step ({s['basis']})."]
    if s["sources"]:
        out.append("")
        out += _table(
            ["call", "sync operator", "parent", "phase", "python", "per step"],
            [[f"`{r['call']}`", f"`{r['op']}`" if r["op"] else "", r["parent"], r["region"], r["python"],
              f"{r['per_step']:.2f}"] for r in s["sources"][:12]],
        )
    return out


def _memory_lines(p: dict[str, Any]) -> list[str]:
    m = p.get("memory")
    out = ["## Memory peak", ""]
    if not m:
        return out + ["n/a: the trace holds no allocator events."]
    frac = "" if m["peak_at_fraction"] is None else f", {_pct(m['peak_at_fraction'])} into the step"
    out.append(
        f"Peak {m['peak_mb']:.1f} MB ({m['basis']}) in step {m['peak_step']}, {m['peak_at_ms']:.2f} ms{frac}, "
        f"during **{m['peak_region']}**, operator `{m['peak_op']}`. Allocated at that step's start: "
        f"{m['step_start_mb']:.1f} MB; transient growth within the step: {m['transient_mb']:.1f} MB."
    )
    if m.get("vocab_sized_mb") is not None:
        out.append(f"Vocabulary-sized blocks (logits, their copies and gradients) alive at the peak: "
                   f"{m['vocab_sized_mb']:.1f} MB.")
    out += ["", "Largest blocks alive at the peak, by the operator that allocated them:", ""]
    out += _table(["allocated by", "phase", "MB", "blocks"],
                  [[f"`{r['op'][:90]}`", r["region"], f"{r['mb']:.2f}", r["blocks"]] for r in m["top_live"]])
    a = p.get("allocator")
    if a:
        d = a["during_profiled_steps"]
        out += [
            "",
            f"CUDA allocator over the profiled steps: {d['num_device_alloc']} cudaMalloc, "
            f"{d['num_device_free']} cudaFree, {d['num_alloc_retries']} allocation retries, {d['num_ooms']} OOMs; "
            f"reserved {a['reserved_mb']:.0f} MB vs allocated {a['allocated_mb']:.0f} MB "
            f"(reserved minus allocated {a['reserved_minus_allocated_mb']:.0f} MB); peak reserved "
            f"{a['peak_reserved_mb']:.0f} MB of {a['device_total_mb']:.0f} MB.",
        ]
    return out


def write_markdown(p: dict[str, Any], path: Path) -> None:
    atomic.write_text(path, markdown(p))


def write_png(p: dict[str, Any], trace: Trace, path: Path) -> Optional[str]:
    """Step breakdown bar and the allocator total over the profiled window; returns a note when
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "profile.png not written: matplotlib is not installed (pip install matplotlib)."
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), gridspec_kw={"height_ratios": [1, 2]})
    ms = p["breakdown"]["ms_per_step"]
    left = 0.0
    for k in BREAKDOWN:
        ax1.barh(["host"], [ms[k]], left=left, color=COLORS[k], label=PHASE_LABELS[k])
        left += ms[k]
    d = p.get("device_busy")
    if d:
        ax1.barh(["device"], [d["busy_ms_per_step"]], color="#333333", label="device busy")
        ax1.barh(["device"], [max(0.0, d["window_ms_per_step"] - d["busy_ms_per_step"])],
                 left=d["busy_ms_per_step"], color="#eeeeee", label="device idle")
    ax1.set_xlabel("ms per step")
    ax1.set_title("Time per profiled step")
    ax1.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    _plot_memory(ax2, p, trace)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def _plot_memory(ax, p: dict[str, Any], trace: Trace) -> None:
    m = p.get("memory")
    lo, hi = trace.window
    dev = 1 if (m and m["device"] == "cuda") else 0
    pts = [(e["ts"], e["args"].get("Total Allocated", 0)) for e in trace.memory
           if lo <= e["ts"] < hi and e["args"].get("Device Type", 0) == dev]
    if not pts:
        ax.text(0.5, 0.5, "no allocator events", ha="center", transform=ax.transAxes)
        return
    ax.step([(t - lo) / 1000 for t, _ in pts], [v / 1024**2 for _, v in pts], where="post", lw=0.8)
    for s in trace.steps:
        ax.axvline((s.ts - lo) / 1000, color="#999999", lw=0.5, ls="--")
    if m:
        t = next((e["ts"] for e in trace.memory if e["args"].get("Total Allocated", 0) / 1024**2 == m["peak_mb"]
                  and e["args"].get("Device Type", 0) == dev and lo <= e["ts"] < hi), None)
        if t is not None:
            ax.annotate(f"peak {m['peak_mb']:.1f} MB\n{m['peak_region']}", ((t - lo) / 1000, m["peak_mb"]),
                        fontsize=8, xytext=(5, -25), textcoords="offset points")
    ax.set_xlabel("ms since the first profiled step (dashed: step starts)")
    ax.set_ylabel("allocated MB" + ("" if dev else " (since profiling began)"))
    ax.set_title("Allocator total over the profiled steps")
