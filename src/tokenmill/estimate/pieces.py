"""What a traced piece is (:class:`Round`, :class:`PieceTrace`): shared by the eager trace (:mod:`.trace`) and
the compiled one (:mod:`.compiled`), below both."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from tokenmill.estimate.recorder import OpCost

__all__ = ["PieceTrace", "Round"]


@dataclass
class Round:
    """One forward and backward of a piece: events (``fwd`` then ``bwd``) and op costs."""

    fwd: list[tuple]
    bwd: list[tuple]
    fwd_costs: list[OpCost]
    bwd_costs: list[OpCost]
    grads: dict[str, int]  # parameter name -> storage id of its gradient after this round
    x: Optional[int] = None  # boundary storages (see PieceTrace)
    y: Optional[int] = None
    gy: Optional[int] = None
    gx: Optional[int] = None
    fwd_ops: int = 0  # ATen operations dispatched (views included): the host's work in eager mode
    bwd_ops: int = 0
    compiled: bool = False  # the costs are an Inductor graph's kernels (:mod:`.compiled`)


@dataclass
class PieceTrace:
    """A traced piece (see the module doc). Each round's boundary storage ids: ``x`` (its input; None
    for the embeddings), ``y`` (its output: hidden states, or the logits of the head), ``gy`` (the
    gradient of its output, made by the harness), ``gx`` (the gradient of its input). ``rounds[0]``:
    gradients created; ``rounds[1]``: gradients accumulated."""

    name: str
    rounds: list[Round]
    sizes: dict[int, int]
    param_bytes: dict[str, int] = field(default_factory=dict)
    param_dtype: dict[str, torch.dtype] = field(default_factory=dict)
    param_shape: dict[str, tuple] = field(default_factory=dict)
    param_trainable: dict[str, bool] = field(default_factory=dict)  # False: frozen (LoRA's base)
    harness: set[int] = field(default_factory=set)  # storages made by the harness, not the model
    buffer_bytes: int = 0
    host_sizes: list[int] = field(default_factory=list)  # memory.offload_activations: what one forward moves, in order
    nf4_sizes: list[tuple[int, int]] = field(default_factory=list)  # QLoRA: (elements, bytes each) per NF4 weight
    param_nf4: set[str] = field(default_factory=set)  # QLoRA: the parameters stored as NF4 (traced at their width)
    nf4_traced: bool = False  # every NF4 product's dequantisation is in the trace (eager, pure precision)

    @property
    def host_bytes(self) -> int:
        """Bytes of the saved tensors moved to the host by memory.offload_activations, per forward."""
        return sum(self.host_sizes)


def nf4_names(params: dict, nf4: list) -> set[str]:
    """The keys of ``params`` (a traced piece's parameters by name) that are among ``nf4``, the weights its module
    holds as NF4 (QLoRA: ``model/lora.py`` :func:`~tokenmill.model.lora.nf4_params`)."""
    ids = {id(t) for t in nf4}
    return {n for n, p in params.items() if id(p) in ids}
