"""torch.compile: the one place where the ``compile.*`` switches are applied.

Compilation is in place (``nn.Module.compile``), so parameter names and checkpoints never carry
``_orig_mod.`` prefixes.
"""

from __future__ import annotations

from torch import nn

from tokenmill.config import CompileConfig


def apply_compile(model: nn.Module, cfg: CompileConfig) -> nn.Module:
    if not cfg.enabled:
        return model
    kwargs = {"mode": cfg.mode, "fullgraph": cfg.fullgraph, "dynamic": cfg.dynamic}
    if cfg.scope == "block":
        for _, block in model.present_blocks():
            block.compile(**kwargs)
    else:
        model.compile(**kwargs)
    return model
