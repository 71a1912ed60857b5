"""LoRA (``lora.*``): low-rank adapters on chosen projections of every block, every other weight frozen.

A projection ``W`` (out x in) with an adapter computes ``W x + b + (alpha / r) B A dropout(x)``: ``A`` (r x in)
starts Kaiming-uniform (as ``nn.Linear`` draws its weight), ``B`` (out x r) starts at zero, so a model with
fresh adapters computes exactly what its base computes. Only ``A`` and ``B`` train: the base weights
(embeddings, norms, head, biases, every ``W``) get ``requires_grad = False``, hence no gradients and no
optimizer state (the optimizer is built from the parameters that require gradients, ``optim/adamw.py``).

The block names its projections by role (:meth:`tokenmill.model.layers.Block.projections`): q, k, v, o,
gate, up, down. With the fused q/k/v matrix, q, k and v are row ranges of one Linear and each role gets its
own adapter there too, so the adapters (and their random draws) are the same for fused and separate
q/k/v. The adapted module keeps the base's parameter names (``weight``, ``bias``) and adds
``lora_A.<role>``/``lora_B.<role>``, so a checkpoint's base weights keep their names.

:func:`merge_lora` folds the adapters into the base weights (``W + (alpha / r) B A``, computed in fp32),
giving a plain model: what ``sample``, ``eval`` and ``export`` load.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import LoraConfig, lora_roles
from tokenmill.errors import ConfigError

__all__ = ["LoRALinear", "apply_lora", "merge_lora"]


class LoRALinear(nn.Linear):
    """A Linear (the frozen base's own ``weight`` and ``bias``) with adapters on row ranges of its output.

    ``parts``: role -> (first output row, rows); the rows of a role get ``(alpha / rank) B_role A_role
    dropout(x)`` added. The adapters start uninitialised: :func:`apply_lora` draws them (:meth:`reset_adapter`)
    or a checkpoint loads them."""

    def __init__(self, base: nn.Linear, parts: dict[str, tuple[int, int]], rank: int, alpha: float,
                 dropout: float = 0.0):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_parameter("weight", base.weight)
        self.register_parameter("bias", base.bias)
        self.rank, self.scale = rank, alpha / rank
        w = base.weight
        self.lora_A = nn.ParameterDict({r: nn.Parameter(torch.empty(rank, self.in_features, dtype=w.dtype,
                                                                    device=w.device)) for r in parts})
        self.lora_B = nn.ParameterDict({r: nn.Parameter(torch.empty(n, rank, dtype=w.dtype, device=w.device))
                                        for r, (_, n) in parts.items()})
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # the output split into consecutive segments, each adapted by one role or by none
        self.segments: list[tuple[int, str | None]] = []
        pos = 0
        for role, (start, n) in sorted(parts.items(), key=lambda kv: kv[1][0]):
            if start > pos:
                self.segments.append((start - pos, None))
            self.segments.append((n, role))
            pos = start + n
        if pos < self.out_features:
            self.segments.append((self.out_features - pos, None))

    @torch.no_grad()
    def reset_adapter(self, role: str) -> None:
        """``A`` ~ Kaiming-uniform (``nn.Linear``'s draw, a = sqrt(5)), ``B`` = 0."""
        nn.init.kaiming_uniform_(self.lora_A[role], a=math.sqrt(5))
        self.lora_B[role].zero_()

    def delta(self, h: torch.Tensor, role: str) -> torch.Tensor:
        return F.linear(F.linear(h, self.lora_A[role]), self.lora_B[role]) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        h = self.lora_dropout(x)
        if len(self.segments) == 1:
            return y + self.delta(h, self.segments[0][1])
        outs = list(y.split([n for n, _ in self.segments], dim=-1))
        for i, (_, role) in enumerate(self.segments):
            if role is not None:
                outs[i] = outs[i] + self.delta(h, role)
        return torch.cat(outs, dim=-1)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """``W + (alpha / r) B A`` on the adapted rows, computed in fp32, in ``W``'s dtype."""
        w = self.weight.detach().float().clone()
        start = 0
        for n, role in self.segments:
            if role is not None:
                w[start:start + n] += self.scale * (self.lora_B[role].float() @ self.lora_A[role].float())
            start += n
        return w.to(self.weight.dtype)

    def extra_repr(self) -> str:
        roles = ", ".join(r for _, r in self.segments if r is not None)
        return f"{super().extra_repr()}, lora rank={self.rank}, scale={self.scale:g}, roles=[{roles}]"


def apply_lora(model: nn.Module, cfg: LoraConfig, init: bool = True) -> nn.Module:
    """``lora.rank > 0``: freeze every parameter of ``model`` (a GPT, before any wrapper), then give the
    projections ``lora.targets`` names in every block it holds an adapter (see the module doc). ``init``:
    draw the adapters (in block order, then role order: the same draws for fused and separate q/k/v); False
    leaves them to be loaded. Returns ``model``."""
    if cfg.rank == 0:
        return model
    roles = lora_roles(cfg.targets, model.cfg.mlp)
    for p in model.parameters():
        p.requires_grad_(False)
    for _, block in model.present_blocks():
        proj = block.projections()
        missing = [r for r in roles if r not in proj]
        if missing:
            raise ConfigError(f"lora.targets names {', '.join(missing)}, which this model's blocks do not have "
                              f"(they have {', '.join(proj)}).")
        by_module: dict[str, dict[str, tuple[int, int]]] = {}
        for role in roles:
            path, start, rows = proj[role]
            by_module.setdefault(path, {})[role] = (start, rows)
        adapted = {}
        for path, parts in by_module.items():
            parent, _, name = path.rpartition(".")
            holder = block.get_submodule(parent)
            adapted[path] = LoRALinear(getattr(holder, name), parts, cfg.rank, cfg.alpha, cfg.dropout)
            setattr(holder, name, adapted[path])
        if init and not next(iter(adapted.values())).weight.is_meta:  # on meta: nothing to draw
            for role in roles:
                adapted[proj[role][0]].reset_adapter(role)
    return model


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every :class:`LoRALinear` of ``model`` by a plain ``nn.Linear`` holding its merged weight
    (``W + (alpha / r) B A``) and bias; every parameter requires gradients again, as in a model built
    without LoRA. Returns ``model`` (changed in place)."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, LoRALinear):
            continue
        plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                          device="meta", dtype=module.weight.dtype)
        plain.weight = nn.Parameter(module.merged_weight())
        if module.bias is not None:
            plain.bias = nn.Parameter(module.bias.detach().clone())
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, plain)
    for p in model.parameters():
        p.requires_grad_(True)
    return model
