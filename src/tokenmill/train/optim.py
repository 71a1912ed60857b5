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
    """GPT-2 style: decay matrices (embeddings included), never biases or norm weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not cfg.decay_groups:
        return [{"params": params, "weight_decay": cfg.weight_decay}]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


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
