"""Optimizers: the one place where the optimizer is chosen (:func:`build_optimizer`) and stepped
(:func:`optimizer_step`); no other module knows the kinds.

- ``adamw``: AdamW with GPT-2 weight-decay groups (``optim.impl``, ``optim.decay_groups``).
- ``muon``: Muon for the hidden matrices with AdamW for the rest (``optim.name``).
- ``memory``: optimizer in backward, CPU offload (optionally of gradients), 8-bit AdamW.
- ``zero``: ZeRO-1 (optimizer state sharded over data-parallel ranks).
- ``grad_norm``: the global gradient norm when parameters are split over ranks (TP, PP).
- ``schedule``: the learning-rate schedule.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tokenmill.config import Config
from tokenmill.errors import ConfigError, MemoryOptionError
from tokenmill.optim.adamw import adamw, build_adamw, param_groups
from tokenmill.optim.grad_norm import clip_grad_norm
from tokenmill.optim.memory import CPUOffloadOptimizer, OptimizerInBackward, build_adamw_8bit
from tokenmill.optim.muon import MuonWithAdamW, build_muon
from tokenmill.optim.schedule import (
    build_scheduler,
    hyperparameters,
    load_scheduler_state,
    lr_at,
    reapply_hyperparameters,
)
from tokenmill.optim.zero import build_zero1_optimizer, consolidated_state_dict
from tokenmill.parallel.world import World

__all__ = [
    "MuonWithAdamW", "adamw", "build_adamw", "build_optimizer", "build_scheduler", "consolidated_state_dict",
    "hyperparameters", "load_scheduler_state", "lr_at", "optimizer_step", "param_groups", "reapply_hyperparameters",
]

MEMORY_OPTIMIZERS = ("optimizer_in_backward", "optimizer_offload", "optimizer_8bit")


def build_optimizer(model: nn.Module, cfg: Config, world: Optional[World] = None) -> torch.optim.Optimizer:
    """Muon with AdamW (``optim.name='muon'``), ZeRO-1 (``parallel.zero1``), a memory switch
    (``memory.optimizer_*``), or the plain AdamW."""
    world = world or World(device=next(model.parameters()).device)
    mem = cfg.memory
    if cfg.optim.name == "muon":
        taken = [k for k, on in (("parallel.zero1", cfg.parallel.zero1),
                                 *((f"memory.{k}", getattr(mem, k)) for k in MEMORY_OPTIMIZERS)) if on]
        if taken:
            raise ConfigError(f"optim.name='muon' does not combine with {', '.join(taken)} (each is its own AdamW); "
                              "drop it, or use --optim.name adamw.")
        return build_muon(model, cfg.optim)
    if cfg.parallel.zero1:
        return build_zero1_optimizer(model, cfg.optim, world)
    if world.distributed and (mem.optimizer_in_backward or mem.optimizer_offload):
        raise MemoryOptionError(
            "memory.optimizer_in_backward / memory.optimizer_offload are single-process switches; for several "
            "GPUs shard instead (parallel.dp_shard, parallel.fsdp_cpu_offload, parallel.zero1)."
        )
    if mem.optimizer_in_backward:
        return OptimizerInBackward(model, cfg.optim)
    if mem.optimizer_offload:
        return CPUOffloadOptimizer(model, cfg.optim, offload_grads=mem.offload_gradients)
    if mem.optimizer_8bit:
        return build_adamw_8bit(model, cfg.optim)
    return build_adamw(model, cfg.optim)


def optimizer_step(optimizer, scaler, params, grad_clip: float, want_norm: bool,
                   world: Optional[World] = None, zero: bool = True) -> Optional[torch.Tensor]:
    """Unscale (fp16), clip / measure the gradient norm, step, and (``zero``) free the gradients; returns
    the norm (None when neither clipping nor logging asked for it, or the optimizer stepped in backward).
    ``zero=False`` (``optim.zero_grad='after_forward'``): the caller frees them after the next forward."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = None
    if not isinstance(optimizer, OptimizerInBackward) and (grad_clip > 0 or want_norm):
        max_norm = grad_clip if grad_clip > 0 else float("inf")
        if isinstance(optimizer, CPUOffloadOptimizer) and optimizer.offload_grads:  # gradients on the CPU
            grad_norm = optimizer.clip_grad_norm_(max_norm)
        elif world is not None and (world.tp > 1 or world.pp > 1 or world.ep > 1):  # parameters split over ranks
            grad_norm = clip_grad_norm(params, max_norm, world)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if zero or isinstance(optimizer, CPUOffloadOptimizer):  # offload: its CPU buffers track the step
        optimizer.zero_grad(set_to_none=True)
    return grad_norm
