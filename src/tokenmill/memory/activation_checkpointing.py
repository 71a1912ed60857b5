"""Activation checkpointing: the one place where ``memory.activation_checkpointing`` is applied.

Every n-th transformer block is wrapped so that its activations are recomputed in backward instead
of being stored (non-reentrant ``torch.utils.checkpoint``). The wrapper strips its prefix from state
dicts, so checkpoints keep the plain parameter names.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper


def apply_activation_checkpointing(model: nn.Module, every_n: int) -> nn.Module:
    """Wrap blocks 0, n, 2n, ... of ``model.blocks`` (every_n=1: all blocks; 0: none)."""
    if every_n <= 0:
        return model
    for i, block in model.present_blocks():
        if i % every_n == 0:
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return model
