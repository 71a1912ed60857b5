"""The device: which one to use, synchronising it, its memory counters, and the CUDA caching-allocator
settings (the one place where ``memory.expandable_segments``, ``memory.max_split_size_mb`` and
``memory.gc_threshold`` are applied), and activation offloading (``memory.offload_activations``).

The allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` when CUDA initialises, so :func:`apply_allocator_settings`
runs first thing in ``train()``. If CUDA is already initialised in this process (e.g. a notebook that
touched the GPU before), the setting is applied at run time through the allocator's settings hook when
this PyTorch has it (it affects new segments only), otherwise a warning says it had no effect.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch

from tokenmill.config import MemoryConfig
from tokenmill.errors import TrainingError


def allocator_settings(cfg: MemoryConfig) -> dict[str, str]:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` entries asked for by ``memory.expandable_segments``,
    ``memory.max_split_size_mb`` and ``memory.gc_threshold`` (0 = not set)."""
    out = {}
    if cfg.expandable_segments:
        out["expandable_segments"] = "True"
    if cfg.max_split_size_mb:
        out["max_split_size_mb"] = str(cfg.max_split_size_mb)
    if cfg.gc_threshold:
        out["garbage_collection_threshold"] = f"{cfg.gc_threshold:g}"
    return out


def apply_allocator_settings(cfg: MemoryConfig) -> bool:
    """Put the allocator settings into ``PYTORCH_CUDA_ALLOC_CONF`` (before CUDA initialises); a key the
    environment already sets is left as it is, with a warning when it differs. Returns True when every
    asked setting is (or will be) in effect; False when none was asked or one could not apply."""
    wanted = allocator_settings(cfg)
    if not wanted:
        return False
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    entries = dict(e.split(":", 1) for e in current.split(",") if ":" in e)
    ok, new = True, {}
    for key, value in wanted.items():
        if key in entries:
            if entries[key] != value:
                warnings.warn(f"PYTORCH_CUDA_ALLOC_CONF={current!r} already sets {key}; leaving it.", stacklevel=2)
                ok = False
            continue
        new[key] = value
    if not new:
        return ok
    value = ",".join([current] * bool(current) + [f"{k}:{v}" for k, v in new.items()])
    if not torch.cuda.is_initialized():
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = value
        return ok
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is not None:
        setter(",".join(f"{k}:{v}" for k, v in new.items()))
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = value
        return ok
    warnings.warn(
        f"memory allocator settings ({', '.join(new)}): CUDA was already initialised in this process, so they "
        f"cannot change; set PYTORCH_CUDA_ALLOC_CONF={value} before starting Python.",
        stacklevel=2,
    )
    return False


def offload_activations(cfg: MemoryConfig, device: torch.device):
    """``memory.offload_activations``: the tensors autograd saves for backward go to (pinned) CPU memory
    during the forward and come back in backward (``torch.autograd.graph.save_on_cpu``); a no-op
    context when off."""
    if not cfg.offload_activations:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")


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
    return (f"tokenmill: note: this run asks for {want} CPU threads ({per} per process x {procs}) but the machine "
            f"has {cores} cores with a load average of {load:.1f} (about {free:.1f} free): oversubscribed threads "
            f"wait on each other and the run can be several times slower. Set OMP_NUM_THREADS={fit} (or run when "
            "the machine is idle); `tokenmill doctor --try` measures it.")
