"""``tokenmill profile``: a short training run under ``torch.profiler``, then the analysis files.

The profiler follows a ``wait / warmup / active`` schedule driven by the trainer's ``on_step_end``
callback (one ``prof.step()`` per optimizer step). The run trains ``wait + warmup + active + 1``
steps unless ``train.max_steps`` is given: the extra step keeps the end-of-training log, evaluation
and checkpoint out of the profiled window. Files written into the run directory:

- ``trace.json``: Chrome/Perfetto trace of the active steps (open in https://ui.perfetto.dev);
- ``tensorboard_trace/`` with ``--tensorboard``: the same trace under the file name of
  ``torch.profiler.tensorboard_trace_handler`` (``tensorboard --logdir RUN_DIR/tensorboard_trace``
  with the torch-tb-profiler plugin);
- CUDA only: ``memory_snapshot.pickle`` (https://pytorch.org/memory_viz);
- with ``--with-stack``: ``memory_timeline.json`` (memory by category: parameters, optimizer state,
  activations, gradients, ...) and on CUDA ``memory_timeline.html``;
- ``profile.json``, ``profile.md``, ``profile.png`` (see :mod:`tokenmill.profiling.report`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from tokenmill import atomic
from tokenmill import config as C
from tokenmill.profiling import analysis, hooks, memory
from tokenmill.profiling.trace import Trace


@dataclasses.dataclass
class ProfileOptions:
    """Profiler switches of ``tokenmill profile``."""

    wait: int = 2
    warmup: int = 2
    active: int = 4
    per_block: bool = False
    tensorboard: bool = False
    with_stack: bool = False

    def total_steps(self) -> int:
        return self.wait + self.warmup + self.active + 1


def prepare_config(cfg: C.Config, opts: ProfileOptions, given: set[str]) -> C.Config:
    """Set the run length from the schedule unless ``train.max_steps`` was given (``given`` holds the
    keys set on the command line); no final checkpoint unless asked for."""
    if min(opts.wait, opts.warmup) < 0 or opts.active < 1:
        raise C.ConfigError("--wait and --warmup must be >= 0 and --active >= 1.")
    if "train.max_steps" not in given:
        cfg.train.max_steps = opts.total_steps()
    elif cfg.train.max_steps < opts.total_steps() - 1:
        raise C.ConfigError(
            f"train.max_steps={cfg.train.max_steps} is shorter than the profiler schedule "
            f"(wait {opts.wait} + warmup {opts.warmup} + active {opts.active}); raise it or drop it."
        )
    if "checkpoint.save_final" not in given:
        cfg.checkpoint.save_final = False
    return cfg


def run_profile(cfg: C.Config, run_dir: str | Path, opts: ProfileOptions, quiet: bool = False) -> dict[str, Any]:
    """Train ``cfg`` under the profiler into ``run_dir``; returns the ``profile.json`` content."""
    from tokenmill.train.device import apply_allocator_settings, resolve_device
    from tokenmill.train.trainer import Callbacks, train

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise C.ConfigError("tokenmill profile runs in one process; start it without torchrun.")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.train.device)
    cuda = device.type == "cuda"
    notes: list[str] = []
    state: dict[str, Any] = {"model": None, "alloc_before": {}, "ready": False}

    def built(model):
        state["model"] = model
        if opts.per_block:
            if cfg.compile.enabled:
                notes.append("--per-block skipped: hooks would be traced into the compiled graph.")
            else:
                hooks.add_block_regions(model)

    on_ready = _trace_writer(run_dir, opts, cuda, state, notes)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sched = schedule(wait=opts.wait, warmup=opts.warmup, active=opts.active, repeat=1)
    if cuda:
        apply_allocator_settings(cfg.memory)  # before the memory history initialises the CUDA allocator
        memory.start_memory_history()
    try:
        with profile(
            activities=activities, schedule=sched, on_trace_ready=on_ready, record_shapes=True,
            profile_memory=True, with_stack=opts.with_stack,
        ) as prof:

            def on_step_end(done: int) -> None:
                if cuda and done == opts.wait + opts.warmup:
                    state["alloc_before"] = memory.allocator_counters()
                prof.step()

            train(cfg, run_dir, quiet=quiet, callbacks=Callbacks(on_model_built=built, on_step_end=on_step_end))
    finally:
        if cuda:
            memory.stop_memory_history()
    if not state["ready"]:
        raise C.ConfigError("the profiler schedule did not complete: train.max_steps is too short.")
    return _write_reports(run_dir, cfg, opts, cuda, state, notes)


def _trace_writer(run_dir: Path, opts: ProfileOptions, cuda: bool, state: dict[str, Any], notes: list[str]):
    """The profiler's ``on_trace_ready``: the trace (and its TensorBoard copy), on CUDA the allocator's
    counters and the memory snapshot, the memory timeline with ``--with-stack``; sets ``state["ready"]``."""

    def on_ready(prof) -> None:
        prof.export_chrome_trace(str(run_dir / "trace.json"))  # a trace can be saved only once:
        if opts.tensorboard:  # copy it under the name TensorBoard's trace handler would use
            tb = run_dir / "tensorboard_trace"
            tb.mkdir(exist_ok=True)
            name = f"{socket.gethostname()}_{os.getpid()}.{time.time_ns() // 1_000_000}.pt.trace.json"
            shutil.copyfile(run_dir / "trace.json", tb / name)
        if cuda:
            state["allocator"] = memory.allocator_summary(state["alloc_before"], opts.active)
            err = memory.dump_snapshot(run_dir / "memory_snapshot.pickle")
            if err:
                notes.append(err)
        if opts.with_stack:
            dev = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
            notes.extend(memory.export_timeline(prof, run_dir, dev, html=cuda))
        elif cuda:
            notes.append("memory_timeline.html not written: the profiler's memory timeline needs --with-stack.")
        state["ready"] = True

    return on_ready


def _write_reports(run_dir: Path, cfg: C.Config, opts: ProfileOptions, cuda: bool, state: dict[str, Any],
                   notes: list[str]) -> dict[str, Any]:
    """Analyse the saved trace and write profile.json, profile.md and profile.png; returns the result."""
    from tokenmill.profiling import report

    trace = Trace.load(run_dir / "trace.json")
    result = analyse(trace, cfg, state["model"], opts, cuda, state.get("allocator"))
    if result["memory"] and (run_dir / "memory_timeline.json").exists():
        result["memory"]["categories_at_peak_mb"] = memory.categories_at_peak(run_dir / "memory_timeline.json")
    result["notes"] = notes + result["notes"]
    png_note = report.write_png(result, trace, run_dir / "profile.png")
    if png_note:
        result["notes"].append(png_note)
    result["files"] = _files(run_dir)
    atomic.write_json(run_dir / "profile.json", result)
    report.write_markdown(result, run_dir / "profile.md")
    return result


def analyse(
    trace: Trace, cfg: C.Config, model, opts: ProfileOptions, cuda: bool, allocator: Optional[dict] = None
) -> dict[str, Any]:
    """Everything ``profile.json`` holds, from a loaded trace."""
    t, m = cfg.train, cfg.model
    vocab = getattr(model, "vocab_size", None) or m.vocab_size or 0
    padded = getattr(model, "padded_vocab", vocab)
    bt = t.batch_size * m.block_size
    # logits-sized blocks are only recognisable when the vocabulary is wider than every other activation:
    # the MLP's hidden units and the query heads (wider than n_embd where a model declares its head_dim)
    numels = (bt * vocab, bt * padded) if vocab > max(m.mlp_width, m.n_head * m.head_width, m.n_embd) else ()
    out: dict[str, Any] = {
        "version": 1,
        "device": "cuda" if cuda else "cpu",
        "schedule": {"wait": opts.wait, "warmup": opts.warmup, "active": opts.active},
        "tokens_per_step": bt * t.grad_accum_steps,
        "breakdown": analysis.breakdown(trace),
        "host_busy": analysis.host_busy(trace),
        "device_busy": analysis.device_breakdown(trace) if cuda else None,
        "top_ops": analysis.top_ops(trace),
        "top_kernels": analysis.top_kernels(trace) if cuda else [],
        "syncs": analysis.syncs(trace),
        "memory": memory.memory_peak(trace, numels),
        "allocator": allocator,
        # null when not asked for, or when the hooks were skipped (compile): unknown, not zero
        "per_block": _per_block(trace) if opts.per_block and not cfg.compile.enabled else None,
        "files": {},
        "notes": [],
    }
    if cuda:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        out["gpu"] = {"name": props.name, "capability": [props.major, props.minor],
                      "total_mb": props.total_memory / memory.MB}
    else:
        out["notes"].append(
            "CPU run, skipped: the device timeline (the busy fraction is the main thread's ATen-operator "
            "time instead), the CUDA memory snapshot, the HTML memory timeline and the allocator "
            "statistics. Syncs are the operators that would block on an accelerator; memory figures "
            "count only allocations made while profiling."
        )
    return out


def _per_block(trace: Trace) -> Optional[dict[str, float]]:
    """Forward time per step of all ``blockN.attn`` and ``blockN.mlp`` regions; None when the trace
    has none (no hooks ran), so that a missing measurement never reads as zero time."""
    n = max(1, len(trace.steps))
    out = {"attn_ms_per_step": 0.0, "mlp_ms_per_step": 0.0}
    seen = False
    for s in trace.in_window(trace.host):
        if s.cat == "user_annotation" and s.name.startswith("block") and "." in s.name:
            part = s.name.rsplit(".", 1)[1]
            if f"{part}_ms_per_step" in out:
                out[f"{part}_ms_per_step"] += s.dur / n / 1000
                seen = True
    return out if seen else None


def _files(run_dir: Path) -> dict[str, str]:
    """The files of the profile that exist (profile.md and profile.json are written last)."""
    names = {
        "trace": "trace.json", "tensorboard": "tensorboard_trace", "memory_snapshot": "memory_snapshot.pickle",
        "memory_timeline": "memory_timeline.html", "memory_categories": "memory_timeline.json",
        "figure": "profile.png",
    }
    out = {k: v for k, v in names.items() if (run_dir / v).exists()}
    return {**out, "report": "profile.md", "json": "profile.json"}
