"""AdamW with GPT-2 weight-decay groups: the one place where an AdamW is built (:func:`adamw`).

Applied switches: ``optim.impl`` (for-loop / foreach / fused) and ``optim.decay_groups``. Every other
optimizer of tokenmill (in backward, CPU offload, ZeRO-1) builds its AdamW here.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import OptimConfig

IMPL_KWARGS = {
    "for-loop": {"foreach": False, "fused": False},
    "foreach": {"foreach": True, "fused": False},
    "fused": {"foreach": False, "fused": True},
}


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """GPT-2 style: decay matrices (embeddings included), never biases or norm weights.

    Under tensor parallelism a model mixes plain tensors and DTensors (and FSDP x TP, DTensors on two
    meshes), which one foreach/fused kernel cannot take together: each group is then split by kind.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not cfg.decay_groups:
        groups = [{"params": params, "weight_decay": cfg.weight_decay}]
    else:
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
    return [part for g in groups for part in _split_by_mesh(g)]


def _split_by_mesh(group: dict) -> list[dict]:
    by_mesh: dict = {}
    for p in group["params"]:
        by_mesh.setdefault(getattr(p, "device_mesh", None), []).append(p)
    if len(by_mesh) <= 1:
        return [group]
    return [{**group, "params": ps} for ps in by_mesh.values()]


def adamw_kwargs(cfg: OptimConfig) -> dict:
    """AdamW's keyword arguments for ``cfg``: hyperparameters and the ``optim.impl`` kernel choice."""
    return {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, **IMPL_KWARGS[cfg.impl]}


def adamw(params, cfg: OptimConfig, **kw) -> torch.optim.AdamW:
    """An AdamW over ``params`` (tensors or param groups) with ``cfg``'s settings (``kw`` adds to them)."""
    return torch.optim.AdamW(params, **{**adamw_kwargs(cfg), **kw})


def build_adamw(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """The plain optimizer: AdamW over the model's GPT-2 parameter groups."""
    return adamw(param_groups(model, cfg), cfg)
