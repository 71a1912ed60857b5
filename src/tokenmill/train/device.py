"""The device: which one to use, synchronising it, its memory counters, and the CUDA caching-allocator
settings (the one place where ``memory.expandable_segments``, ``memory.max_split_size_mb`` and
``memory.gc_threshold`` are applied), and activation offloading (``memory.offload_activations``).

The allocator reads ``PYTORCH_ALLOC_CONF`` (torch >= 2.9; ``PYTORCH_CUDA_ALLOC_CONF`` when that is unset,
and on older torch) when CUDA initialises, so :func:`apply_allocator_settings` runs first thing in ``train()``
and writes the merged settings to both. If CUDA is already initialised in this process (e.g. a notebook that
touched the GPU before), the setting is applied at run time through the allocator's settings hook when
this PyTorch has it (it affects new segments only), otherwise a warning says it had no effect.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Mapping
from typing import Any, Optional

import torch

from tokenmill.config import MemoryConfig
from tokenmill.errors import TrainingError
from tokenmill.model.offload import ActivationOffload


def allocator_settings(cfg: MemoryConfig) -> dict[str, str]:
    """The allocator entries (``PYTORCH_ALLOC_CONF``) asked for by ``memory.expandable_segments``,
    ``memory.max_split_size_mb`` and ``memory.gc_threshold`` (0 = not set)."""
    out = {}
    if cfg.expandable_segments:
        out["expandable_segments"] = "True"
    if cfg.max_split_size_mb:
        out["max_split_size_mb"] = str(cfg.max_split_size_mb)
    if cfg.gc_threshold:
        out["garbage_collection_threshold"] = f"{cfg.gc_threshold:g}"
    return out


# The variables the caching allocator reads its settings from, in its order: torch >= 2.9 reads
# PYTORCH_ALLOC_CONF and, only when that is unset, PYTORCH_CUDA_ALLOC_CONF; older torch reads the second only.
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def _entries(value: str) -> dict[str, str]:
    return dict(e.strip().split(":", 1) for e in value.split(",") if ":" in e)


def allocator_conf(environ: Optional[Mapping[str, str]] = None) -> tuple[dict[str, str], dict[str, str]]:
    """The allocator entries the environment sets (``key -> value``), both variables merged, a key in
    ``PYTORCH_ALLOC_CONF`` over the same key in ``PYTORCH_CUDA_ALLOC_CONF`` (what torch >= 2.9 reads first),
    and for each key the variable that set it. An empty variable counts as unset."""
    env = os.environ if environ is None else environ
    entries: dict[str, str] = {}
    source: dict[str, str] = {}
    for var in reversed(ALLOC_CONF_VARS):  # the legacy variable first, the one read first overrides
        for key, value in _entries(env.get(var, "")).items():
            entries[key], source[key] = value, var
    return entries, source


def apply_allocator_settings(cfg: MemoryConfig) -> bool:
    """Put the allocator settings into the environment (before CUDA initialises): the entries of both
    ``PYTORCH_ALLOC_CONF`` and ``PYTORCH_CUDA_ALLOC_CONF`` merged with the asked ones, written to both, so
    whichever this torch reads holds all of them. A key the environment already sets is left as it is,
    with a warning when it differs. Returns True when every asked setting is (or will be) in effect;
    False when none was asked or one could not apply."""
    wanted = allocator_settings(cfg)
    if not wanted:
        return False
    entries, source = allocator_conf()
    ok, new = True, {}
    for key, value in wanted.items():
        if key in entries:
            if entries[key] != value:
                var = source[key]
                warnings.warn(f"{var}={os.environ[var]!r} already sets {key}; leaving it.", stacklevel=2)
                ok = False
            continue
        new[key] = value
    if not new:
        return ok
    value = ",".join(f"{k}:{v}" for k, v in {**entries, **new}.items())
    if not torch.cuda.is_initialized():
        os.environ.update(dict.fromkeys(ALLOC_CONF_VARS, value))
        return ok
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is not None:
        setter(",".join(f"{k}:{v}" for k, v in new.items()))
        os.environ.update(dict.fromkeys(ALLOC_CONF_VARS, value))
        return ok
    warnings.warn(
        f"memory allocator settings ({', '.join(new)}): CUDA was already initialised in this process, so they "
        f"cannot change; set PYTORCH_ALLOC_CONF={value} (PYTORCH_CUDA_ALLOC_CONF before torch 2.9) before "
        "starting Python.",
        stacklevel=2,
    )
    return False


def offload_activations(cfg: MemoryConfig, device: torch.device, model: torch.nn.Module):
    """``memory.offload_activations``: what ``model``'s forward saves for backward (its parameters aside) goes to
    pinned host memory on a side stream beside the compute and comes back, one tensor ahead, in backward
    (``tokenmill.model.offload``); a no-op context when off or on a CPU run (no device memory to free)."""
    if not cfg.offload_activations or device.type == "cpu":
        return contextlib.nullcontext()
    return ActivationOffload(model, device)


def resolve_device(name: str, option: str = "--train.device") -> torch.device:
    """``name``: 'auto' = cuda, else mps, else cpu; an unknown or unavailable device is a clear error
    naming ``option``."""
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (index and not index.isdigit()):
        raise TrainingError(f"{option} {name!r} is not a device; use auto, cpu, cuda or mps.")
    if kind == "cuda" and not torch.cuda.is_available():
        raise TrainingError(f"{option} {name}: no CUDA GPU is visible; use {option} auto or cpu.")
    if kind == "cuda" and index and int(index) >= torch.cuda.device_count():
        raise TrainingError(f"{option} {name}: this machine has {torch.cuda.device_count()} CUDA device(s).")
    if kind == "mps" and not mps:
        raise TrainingError(f"{option} mps: MPS is not available; use {option} auto or cpu.")
    return torch.device(name)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak allocated and reserved device memory in MB since the last reset (CUDA only)."""
    if device.type != "cuda":
        return {}
    mb = 1024**2
    return {
        "peak_alloc_mb": torch.cuda.max_memory_allocated(device) / mb,
        "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / mb,
    }


def device_info(device: torch.device) -> dict[str, Any]:
    info = {"device": device.type, "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        info["gpu_name"] = torch.cuda.get_device_name(device)
    return info


def thread_settings() -> dict[str, int]:
    """This process's torch threads, the cores it may use and the processes on this node (summary.json)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads(), "cpu_count": cores,
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))}


def cpu_contention(threads: dict[str, int], load: float | None = None) -> str | None:
    """A note when a CPU run asks for more threads than the cores that are free: ``intra_op`` threads x the
    processes on this node against the cores less the load average of the last minute (other work on the
    machine; ``load``: default ``os.getloadavg()[0]``). Oversubscribed, torch's threads wait on each other:
    with other work on the cores, fewer threads are usually faster. None when it fits."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # not available on this platform
            return None
    cores, procs, per = threads["cpu_count"], threads["local_world_size"], threads["intra_op"]
    free = max(cores - load, 0.0)
    want = per * procs
    if want <= max(free, 1.0) + 0.5:
        return None
    fit = max(1, int(free // procs)) if free >= procs else 1
    if fit >= per:  # already at (or below) the threads that fit: the setting would change nothing
        return None
    return (f"tokenmill: note: this run asks for {want} CPU threads ({per} per process x {procs}) but the machine "
            f"has {cores} cores with a load average of {load:.1f} (about {free:.1f} free): oversubscribed threads "
            f"wait on each other and the run can be several times slower. Set OMP_NUM_THREADS={fit} (or run when "
            "the machine is idle); `tokenmill doctor --try` measures it.")


NOTED_ENV = "TOKENMILL_THREADS_NOTED"  # set once the note was said: processes started after it stay quiet


def contention_note(threads: dict[str, int] | None = None) -> str | None:
    """:func:`cpu_contention`'s note (for this process's :func:`thread_settings` unless ``threads``), once per
    process tree: saying it sets :data:`NOTED_ENV`, which the processes started afterwards inherit (a ladder
    says it once and passes it to its rungs), so it is never repeated. None when it was said or does not
    apply."""
    if os.environ.get(NOTED_ENV):
        return None
    note = cpu_contention(threads or thread_settings())
    if note is not None:
        os.environ[NOTED_ENV] = "1"
    return note
