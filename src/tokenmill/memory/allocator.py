"""CUDA caching-allocator settings: the one place where ``memory.expandable_segments`` is applied.

The allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` when CUDA initialises, so :func:`apply_allocator_settings`
runs first thing in ``train()``. If CUDA is already initialised in this process (e.g. a notebook that
touched the GPU before), the setting is applied at run time through the allocator's settings hook when
this PyTorch has it (it affects new segments only), otherwise a warning says it had no effect.
"""

from __future__ import annotations

import os
import warnings

import torch

from tokenmill.config import MemoryConfig

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
