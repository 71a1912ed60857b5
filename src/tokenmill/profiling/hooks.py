"""Per-block ``record_function`` regions added from outside the model with forward hooks.

``blockN.attn`` and ``blockN.mlp`` regions bracket the forward of ``model.blocks[N].attn`` / ``.mlp``
(and their recomputation in backward under activation checkpointing). Backward operators are not
bracketed: autograd runs them outside any module call. The hooks only open and close profiler
regions; they never touch tensors.
"""

from __future__ import annotations

from torch import nn
from torch.profiler import record_function


def add_block_regions(model: nn.Module) -> list:
    """Register the hooks on every block's ``attn`` and ``mlp``; returns the hook handles."""
    handles = []
    for i, block in enumerate(getattr(model, "blocks", [])):
        for part in ("attn", "mlp"):
            module = getattr(block, part, None)
            if module is not None:
                handles += _bracket(module, f"block{i}.{part}")
    return handles


def _bracket(module: nn.Module, name: str) -> list:
    open_regions: list[record_function] = []

    def pre(_mod, _args):
        region = record_function(name)
        region.__enter__()
        open_regions.append(region)

    def post(_mod, _args, _out):
        if open_regions:
            open_regions.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
