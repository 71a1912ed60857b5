"""Optimizer-side memory switches: the one place where ``memory.optimizer_in_backward``,
``memory.optimizer_offload`` and ``memory.optimizer_8bit`` are applied (:func:`build_memory_optimizer`).

Each returns an object that the training loop drives like any optimizer (``step``, ``zero_grad``,
``param_groups`` for the learning-rate schedule, ``state_dict``), so the loop does not change.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from tokenmill.config import Config, OptimConfig
from tokenmill.train.optim import _IMPL_KWARGS, param_groups


class MemoryOptionError(RuntimeError):
    """A memory switch that cannot run here; the message says why and what to do."""


def _adamw(params, cfg: OptimConfig, **kw) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kw)


class OptimizerInBackward(torch.optim.Optimizer):
    """One AdamW per parameter, stepped by a post-accumulate-grad hook as soon as that parameter's
    gradient is complete; the gradient is freed right after. ``step`` and ``zero_grad`` are no-ops.

    ``param_groups`` are the per-parameter optimizers' groups (shared dicts), so a learning-rate
    scheduler drives all of them. Same math as one AdamW over all parameters without clipping.
    """

    def __init__(self, model: nn.Module, cfg: OptimConfig):
        self.optimizers: list[torch.optim.AdamW] = []
        for group in param_groups(model, cfg):
            for p in group["params"]:
                opt = _adamw([p], cfg, weight_decay=group["weight_decay"], **_IMPL_KWARGS[cfg.impl])
                self.optimizers.append(opt)
                p.register_post_accumulate_grad_hook(self._make_hook(opt))
        super().__init__([p for o in self.optimizers for p in o.param_groups[0]["params"]], {"lr": cfg.lr})
        self.param_groups = [o.param_groups[0] for o in self.optimizers]

    @staticmethod
    def _make_hook(opt: torch.optim.Optimizer):
        def hook(param: torch.Tensor) -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        return hook

    def step(self, closure=None):  # the work happened in backward
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"per_parameter": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "per_parameter" not in state_dict:
            raise MemoryOptionError(
                "this checkpoint was saved without memory.optimizer_in_backward; resume it with the same setting."
            )
        for o, sd in zip(self.optimizers, state_dict["per_parameter"]):
            o.load_state_dict(sd)
        self.param_groups = [o.param_groups[0] for o in self.optimizers]  # loading made new group dicts


class CPUOffloadOptimizer(torch.optim.Optimizer):
    """AdamW on the CPU over fp32 master copies of the parameters (ZeRO-Offload style, one process).

    ``step``: copy each gradient into a (pinned) CPU buffer, run AdamW on the CPU masters, copy the
    updated masters back into the device parameters. The device holds only the parameters and their
    gradients; the optimizer state (2 x fp32 per parameter) and the masters live in host memory.
    ``state_dict`` is an ordinary AdamW state dict (checkpoints interchange with the plain optimizer);
    on load the masters are refreshed from the model's weights, so load the model first.
    """

    def __init__(self, model: nn.Module, cfg: OptimConfig):
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        master_groups = []
        for group in param_groups(model, cfg):
            masters = []
            for p in group["params"]:
                pin = p.device.type == "cuda"
                m = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
                m.copy_(p.detach())
                m.grad = torch.empty_like(m, pin_memory=pin)
                masters.append(m)
                self.pairs.append((p, m))
            master_groups.append({"params": masters, "weight_decay": group["weight_decay"]})
        kw = dict(_IMPL_KWARGS[cfg.impl])
        self.cpu = _adamw(master_groups, cfg, **kw)
        super().__init__([m for _, m in self.pairs], {"lr": cfg.lr})
        self.param_groups = self.cpu.param_groups
        self.state = self.cpu.state

    @torch.no_grad()
    def step(self, closure=None):
        cuda = False
        for p, m in self.pairs:
            if p.grad is not None:
                m.grad.copy_(p.grad, non_blocking=True)
                cuda |= p.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        self.cpu.step()
        for p, m in self.pairs:
            p.copy_(m, non_blocking=True)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, _ in self.pairs:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.cpu.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.cpu.load_state_dict(state_dict)
        with torch.no_grad():  # the model was loaded first: masters restart from its weights
            for p, m in self.pairs:
                m.copy_(p.detach())
        self.param_groups, self.state = self.cpu.param_groups, self.cpu.state  # loading made new objects


def build_adamw_8bit(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    try:
        from torchao.optim import AdamW8bit
    except ImportError as e:
        raise MemoryOptionError(
            f"memory.optimizer_8bit needs torchao's AdamW8bit, which could not be imported ({e}): "
            "`pip install torchao`, or drop --memory.optimizer_8bit (the plain AdamW)."
        ) from None
    return AdamW8bit(param_groups(model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def build_memory_optimizer(model: nn.Module, cfg: Config, distributed: bool) -> Optional[torch.optim.Optimizer]:
    """The optimizer chosen by a memory switch, or None when none is on (use the plain AdamW)."""
    mem = cfg.memory
    if distributed and (mem.optimizer_in_backward or mem.optimizer_offload):
        raise MemoryOptionError(
            "memory.optimizer_in_backward / memory.optimizer_offload are single-process switches; for several "
            "GPUs shard instead (parallel.dp_shard, parallel.fsdp_cpu_offload, parallel.zero1)."
        )
    if mem.optimizer_in_backward:
        return OptimizerInBackward(model, cfg.optim)
    if mem.optimizer_offload:
        return CPUOffloadOptimizer(model, cfg.optim)
    if mem.optimizer_8bit:
        return build_adamw_8bit(model, cfg.optim)
    return None
