"""The device: which one to use, synchronising it, its memory counters, and the CUDA caching-allocator
settings (the one place where ``memory.expandable_segments`` is applied).

The allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` when CUDA initialises, so :func:`apply_allocator_settings`
runs first thing in ``train()``. If CUDA is already initialised in this process (e.g. a notebook that
touched the GPU before), the setting is applied at run time through the allocator's settings hook when
this PyTorch has it (it affects new segments only), otherwise a warning says it had no effect.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from tokenmill.config import MemoryConfig
from tokenmill.errors import TrainingError

_KEY = "expandable_segments"


def apply_allocator_settings(cfg: MemoryConfig) -> bool:
    """Turn on expandable segments if asked; returns True when the setting is (or will be) in effect."""
    if not cfg.expandable_segments:
        return False
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if _KEY in current:
        if f"{_KEY}:True" not in current:
            warnings.warn(f"PYTORCH_CUDA_ALLOC_CONF={current!r} already sets {_KEY}; leaving it.", stacklevel=2)
        return f"{_KEY}:True" in current
    value = f"{current},{_KEY}:True" if current else f"{_KEY}:True"
    if not torch.cuda.is_initialized():
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = value
        return True
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is not None:
        setter(f"{_KEY}:True")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = value
        return True
    warnings.warn(
        "memory.expandable_segments: CUDA was already initialised in this process, so the allocator setting "
        "cannot change; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting Python.",
        stacklevel=2,
    )
    return False


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
