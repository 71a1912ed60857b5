"""The learning-rate schedule: linear warm-up, then constant or cosine decay to ``optim.min_lr``.

Applied switches: ``optim.schedule``, ``optim.warmup_steps``, ``optim.min_lr``, ``optim.decay_steps``.
"""

from __future__ import annotations

import math

import torch

from tokenmill.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate for 0-based optimizer step ``step``: linear warm-up, then constant or cosine."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, (cfg.decay_steps or max_steps) - cfg.warmup_steps)
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


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's settings (everything but the parameters), as built from the current config."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def reapply_hyperparameters(optimizer: torch.optim.Optimizer, scheduler, built: list[dict], cfg: OptimConfig,
                            max_steps: int) -> None:
    """After a checkpoint was loaded: the current config's settings win over the saved ones (learning rate
    and schedule, weight decay, betas, eps), so what a user passes on resume takes effect; the step count
    and the optimizer moments stay as loaded. A group built with another peak than ``optim.lr`` (Muon's
    ``optim.muon_lr``) keeps its ratio to it."""
    groups = optimizer.param_groups
    base = cfg.lr if cfg.lr > 0 else 1.0
    scales = [1.0] * len(groups)
    if len(built) == len(groups):
        for i, (g, b) in enumerate(zip(groups, built)):
            for k in ("weight_decay", "betas", "eps", "momentum"):
                if k in b:
                    g[k] = b[k]
            if cfg.lr > 0:
                scales[i] = b.get("initial_lr", base) / base
    scheduler.base_lrs = [base * s for s in scales]
    lr = lr_at(scheduler.last_epoch, cfg, max_steps)
    for g, s in zip(groups, scales):
        g["initial_lr"] = base * s
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr * s)
        else:
            g["lr"] = lr * s
    scheduler._last_lr = [lr * s for s in scales]
