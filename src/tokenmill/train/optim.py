"""AdamW with GPT-2 weight-decay groups, and the learning-rate schedule.

Applied switches: ``optim.impl`` (for-loop / foreach / fused), ``optim.decay_groups``,
``optim.schedule``/``warmup_steps``/``min_lr``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.config import OptimConfig

_IMPL_KWARGS = {
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


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The one place where ``optim.impl`` is applied."""
    return torch.optim.AdamW(
        param_groups(model, cfg),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **_IMPL_KWARGS[cfg.impl],
    )


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate for 0-based optimizer step ``step``: linear warm-up, then constant or cosine."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
    base = cfg.lr if cfg.lr > 0 else 1.0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg, max_steps) / base)


def load_scheduler_state(scheduler, state: dict) -> None:
    """``scheduler.load_state_dict`` that also takes the state of a run whose optimizer grouped the
    parameters differently (tensor parallelism splits the groups, see :func:`param_groups`): every group
    follows the same schedule, so the per-group lists are the first entry repeated."""
    n = len(scheduler.optimizer.param_groups)
    state = dict(state)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        if isinstance(state.get(key), list) and len(state[key]) != n:
            state[key] = state[key][:1] * n
    scheduler.load_state_dict(state)
