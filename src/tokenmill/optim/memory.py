"""Optimizers that save device memory: ``memory.optimizer_in_backward``, ``memory.optimizer_offload`` (with
``memory.offload_gradients``) and ``memory.optimizer_8bit``, chosen in :func:`tokenmill.optim.build_optimizer`.

Each returns an object that the training loop drives like any optimizer (``step``, ``zero_grad``,
``param_groups`` for the learning-rate schedule, ``state_dict``), so the loop does not change.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.config import OptimConfig
from tokenmill.errors import MemoryOptionError
from tokenmill.optim.adamw import adamw, param_groups


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
                opt = adamw([p], cfg, weight_decay=group["weight_decay"])
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

    ``offload_grads`` (``memory.offload_gradients``): each gradient goes down to its CPU buffer inside
    backward, as soon as it is complete (post-accumulate-grad hook), and the device copy is freed, so
    the full set of gradients never exists on the device. Micro-batches of gradient accumulation are
    summed in the CPU buffer. Clipping then runs on the CPU gradients (:meth:`clip_grad_norm_`).

    ``state_dict`` is an ordinary AdamW state dict (checkpoints interchange with the plain optimizer);
    on load the masters are refreshed from the model's weights, so load the model first.
    """

    def __init__(self, model: nn.Module, cfg: OptimConfig, offload_grads: bool = False):
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        # a pinned buffer in the parameter's dtype per low-precision CUDA parameter: the fp32 master is
        # converted on the CPU into it, then copied up asynchronously (a dtype-changing copy from the
        # CPU would make a pageable temporary and synchronise once per parameter)
        self.stages: list[torch.Tensor | None] = []
        self.grad_bufs: list[torch.Tensor] = []  # pinned CPU gradient buffer of each master
        self.got_grad: list[bool] = []  # this step, did parameter i get a gradient (offload_grads)?
        self.offload_grads = offload_grads
        self._gathered = False  # this step's gradients are in the CPU buffers (clip, then step)
        master_groups = []
        for group in param_groups(model, cfg):
            masters = []
            for p in group["params"]:
                pin = p.device.type == "cuda"
                m = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
                m.copy_(p.detach())
                masters.append(m)
                if offload_grads:
                    p.register_post_accumulate_grad_hook(self._make_hook(len(self.pairs)))
                self.pairs.append((p, m))
                self.stages.append(torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                                   if pin and p.dtype != torch.float32 else None)
                self.grad_bufs.append(torch.empty_like(m, pin_memory=pin))
                self.got_grad.append(False)
            master_groups.append({"params": masters, "weight_decay": group["weight_decay"]})
        self.cpu = adamw(master_groups, cfg)
        super().__init__([m for _, m in self.pairs], {"lr": cfg.lr})
        self.param_groups = self.cpu.param_groups
        self.state = self.cpu.state

    def _make_hook(self, i: int):
        @torch.no_grad()
        def hook(param: torch.Tensor) -> None:
            buf = self.grad_bufs[i]
            if not self.got_grad[i]:  # first micro-batch of the step: copy (asynchronous from CUDA)
                buf.copy_(param.grad, non_blocking=True)
                self.got_grad[i] = True
            else:  # accumulation: a blocking copy (earlier async copies have landed), summed on the CPU
                buf.add_(param.grad.to("cpu"))
            param.grad = None  # the device gradient is freed now, not at the end of backward

        return hook

    @torch.no_grad()
    def _gather_grads(self) -> None:
        """Point each master's ``.grad`` at its CPU buffer holding this step's gradient (None if none)."""
        if self._gathered:
            return
        self._gathered = True
        cuda = False
        for i, (p, m) in enumerate(self.pairs):
            if not self.offload_grads and p.grad is not None:
                self.grad_bufs[i].copy_(p.grad, non_blocking=True)
                self.got_grad[i] = True
            cuda |= p.device.type == "cuda"
            m.grad = self.grad_bufs[i] if self.got_grad[i] else None  # AdamW skips parameters without one
        if cuda:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm (and clipping) over the CPU gradients: used when they left the device."""
        self._gather_grads()
        return torch.nn.utils.clip_grad_norm_([m for _, m in self.pairs], max_norm)

    @torch.no_grad()
    def step(self, closure=None):
        self._gather_grads()
        self.cpu.step()
        for (p, m), stage in zip(self.pairs, self.stages):
            if stage is not None:
                stage.copy_(m)
                m = stage
            p.copy_(m, non_blocking=True)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for i, (p, m) in enumerate(self.pairs):
            p.grad = None
            m.grad = None
            self.got_grad[i] = False
        self._gathered = False

    def state_dict(self) -> dict[str, Any]:
        return self.cpu.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.cpu.load_state_dict(state_dict)
        with torch.no_grad():  # the model was loaded first: masters restart from its weights
            for p, m in self.pairs:
                m.copy_(p.detach())
        self.param_groups, self.state = self.cpu.param_groups, self.cpu.state  # loading made new objects


def build_adamw_8bit(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    from tokenmill.model.nf4 import torchao_quietly

    try:
        with torchao_quietly():
            from torchao.optim import AdamW8bit
    except ImportError as e:
        raise MemoryOptionError(
            f"memory.optimizer_8bit needs torchao's AdamW8bit, which could not be imported ({e}): "
            "`pip install torchao`, or drop --memory.optimizer_8bit (the plain AdamW)."
        ) from None
    return AdamW8bit(param_groups(model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
