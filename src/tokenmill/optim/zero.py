"""ZeRO-1: optimizer state sharded over data-parallel ranks, the model replicated by DDP.

``ZeroRedundancyOptimizer`` gives each rank the AdamW state of a subset of the parameters; after the
step it broadcasts the updated parameters. Its ``state_dict()`` is the full, consolidated AdamW
state dict (gathered to rank 0 by :func:`consolidated_state_dict`), so checkpoints look like those of
a single process and resume under any layout.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from tokenmill.config import OptimConfig
from tokenmill.optim.adamw import adamw_kwargs, param_groups
from tokenmill.parallel.world import World


def build_zero1_optimizer(model: nn.Module, cfg: OptimConfig, world: World) -> torch.optim.Optimizer:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(
        param_groups(model, cfg),
        optimizer_class=torch.optim.AdamW,
        process_group=world.mesh.get_group("dp_replicate"),
        **adamw_kwargs(cfg),
    )


def consolidated_state_dict(optimizer: torch.optim.Optimizer, world: World) -> dict | None:
    """The full optimizer state dict on rank 0 (None elsewhere); a collective for ZeRO-1. A ZeRO-1 optimizer exists
    only once ``torch.distributed.optim`` is imported: a run without one does not import it (half a second a save)."""
    zero = getattr(sys.modules.get("torch.distributed.optim"), "ZeroRedundancyOptimizer", None)
    if zero is not None and isinstance(optimizer, zero):
        optimizer.consolidate_state_dict(to=0)
    return optimizer.state_dict() if world.is_rank0 else None
