"""From a config to a model, below everything that needs one: building (on a device or on ``meta``),
the parameter counts, and the model-level switches that change neither the parameters nor the math
of one process: the precision cast, activation checkpointing and compile.

The trainer (``train/parallelize.py``) applies them in its fixed order, between the pipeline split,
tensor parallelism and data parallelism; the estimator (``estimate/trace.py``) applies the same
functions to the model it traces on ``meta``, so both see one implementation of each switch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from tokenmill import config as C
from tokenmill.model.gpt import GPT

__all__ = ["ParamCounts", "apply_activation_checkpointing", "apply_compile", "apply_precision", "build_gpt",
           "checkpointed_blocks", "count_params", "param_counts"]


def build_gpt(cfg: C.ModelConfig, vocab_size: int, device: torch.device | str, dtype: torch.dtype | None = None) -> GPT:
    """The GPT of ``cfg`` on ``device``, initialised from the current torch seed. With ``dtype``
    (pure bf16) it is allocated in that dtype at once: no fp32 copy inflating reserved memory."""
    if dtype is None:
        with torch.device(device):
            return GPT(cfg, vocab_size)
    with torch.device("meta"):
        model = GPT(cfg, vocab_size)
    model.to(dtype).to_empty(device=device)
    model.init_weights()
    return model


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a whole model by part (a tied head is the token embedding and counts once)."""

    total: int
    token_embedding: int  # padded rows included
    position_embedding: int  # 0 with rotary embeddings
    untied_head: int  # 0 when tied; padded rows included
    per_block: int


def param_counts(cfg: C.ModelConfig, vocab_size: int) -> ParamCounts:
    """Counted on a one-block model on ``meta`` (every block has the same parameters), so any depth
    counts at once and nothing is allocated."""
    one = C.ModelConfig(**{**cfg.__dict__, "n_layer": 1,
                           "norm": "native" if cfg.norm == "triton" else cfg.norm})  # same parameters
    with torch.device("meta"):
        model = GPT(one, vocab_size)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    wpe = model.wpe.weight.numel() if model.wpe is not None else 0
    head = 0 if cfg.tie_embeddings else model.lm_head.weight.numel()
    return ParamCounts(model.num_params() + (cfg.n_layer - 1) * block, model.wte.weight.numel(), wpe, head, block)


def count_params(cfg: C.ModelConfig, vocab_size: int) -> int:
    """Parameters of the whole model (every stage and shard)."""
    return param_counts(cfg, vocab_size).total


def apply_precision(model: nn.Module, cfg: C.TrainConfig) -> nn.Module:
    """``train.precision='bf16'``: cast the whole model (pure bf16); other modes keep fp32 weights."""
    if cfg.precision == "bf16":
        model.to(torch.bfloat16)
    return model


def checkpointed_blocks(n_layer: int, every_n: int) -> list[bool]:
    """Which blocks ``memory.activation_checkpointing = every_n`` wraps: 0, n, 2n, ... (0 = none)."""
    return [every_n > 0 and i % every_n == 0 for i in range(n_layer)]


def apply_activation_checkpointing(model: nn.Module, every_n: int) -> nn.Module:
    """``memory.activation_checkpointing``: wrap blocks 0, n, 2n, ... so that their activations are
    recomputed in backward instead of stored (non-reentrant ``torch.utils.checkpoint``; 0 = off). The
    wrapper strips its prefix from state dicts, so checkpoints keep the plain parameter names."""
    wrap = checkpointed_blocks(len(model.blocks), every_n)
    for i, block in model.present_blocks():
        if wrap[i]:
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return model


def apply_compile(model: nn.Module, cfg: C.CompileConfig) -> nn.Module:
    """``compile.*``: torch.compile in place (``nn.Module.compile``), so parameter names and checkpoints
    never carry ``_orig_mod.`` prefixes; ``compile.scope='block'`` compiles each block separately;
    ``compile.loss_outside`` compiles the trunk and leaves the head and the loss eager."""
    if not cfg.enabled:
        return model
    kwargs = {"mode": cfg.mode, "fullgraph": cfg.fullgraph, "dynamic": cfg.dynamic}
    if cfg.loss_outside:  # the seed's form: compile up to the final norm, head and loss run eagerly
        model.trunk = torch.compile(model.trunk, **kwargs)
    elif cfg.scope == "block":
        for _, block in model.present_blocks():
            block.compile(**kwargs)
    else:
        model.compile(**kwargs)
    return model
