"""Tensor parallelism (``parallel.tp``): each block's matrices split over the ranks of the ``tp`` mesh.

Megatron-style, with DTensor's ``parallelize_module``. The model declares the plan
(``GPT.tp_plan``: module path -> 'colwise' | 'rowwise' | 'per_head', per block; it also refuses a model
that does not split into whole heads); this module only turns the names into parallel styles and
applies them:

- 'colwise': the projections into heads (q, k, v: each rank computes ``n_head / tp`` query heads and
  ``n_kv_head / tp`` key/value heads, so with grouped-query attention each rank holds the key/value
  heads its query heads read) and into the MLP's hidden units (GELU's ``c_fc``, SwiGLU's gate and
  up) split by output features;
- 'rowwise': the projections back to the residual stream (attention and MLP ``c_proj``) split by input
  features; one all-reduce sums them;
- 'per_head': a module applied to each head of this rank's q or k (Qwen3's q/k norm), whose weight is
  whole on every rank: its gradient on a rank sums over that rank's heads only, so a hook sums it over
  the tp ranks in backward (:class:`PerHead`; one small all-reduce per such weight and backward).

So a block costs two all-reduces in forward and two in backward, and its activations inside attention
and the MLP are 1/tp of the full size. The block input and output stay whole (replicated) tensors;
embeddings, norms, the rotary tables and the head are replicated (every TP rank computes them, with
identical gradients). Not done here: sequence parallelism of the norms and a vocabulary-parallel head
and loss.

A mixture of experts (``model/moe.py``): each block gets its own plan, the entries for modules it has; a
sparse layer's attention splits as a dense layer's, its MoE (router, routed and shared experts) is
replicated: its input is the whole residual stream on every tp rank, so every rank routes the same tokens
to the same experts and computes the same output and gradients (no communication, the experts' memory
not divided by tp; ``parallel.ep`` shards experts).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from tokenmill.parallel.world import World


def _sum_over(grad: torch.Tensor, group) -> torch.Tensor:
    out = grad.clone()
    dist.all_reduce(out, group=group)
    return out


def _per_head_style():
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class PerHead(ParallelStyle):
        """'per_head': the module's parameters stay plain tensors, whole on every tp rank; each one the
        forward uses gets (once) a gradient hook summing its gradient over the tp ranks. The hook is put
        on the tensor the forward actually reads, so under FSDP it is FSDP's unsharded parameter and the
        sum happens before FSDP's reduce-scatter; under activation checkpointing the recomputation finds
        the hook in place."""

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            hook = functools.partial(_sum_over, group=device_mesh.get_group())

            def pre_forward(mod: nn.Module, args):
                for p in mod.parameters(recurse=False):
                    if p.requires_grad and not getattr(p, "_tokenmill_tp_sum", False):
                        p.register_hook(hook)
                        p._tokenmill_tp_sum = True

            module.register_forward_pre_hook(pre_forward)
            return module

    return PerHead


def styles(plan: dict[str, str]) -> dict:
    """``parallelize_module`` plan: the model's names turned into parallel styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kinds = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "per_head": _per_head_style()}
    return {path: kinds[kind]() for path, kind in plan.items()}


def apply_tensor_parallel(model: nn.Module, world: World) -> nn.Module:
    """Split every block of ``model`` over the ``tp`` mesh dimension (in place; tp == 1: unchanged)."""
    if world.tp == 1:
        return model
    model.tp_plan(world.tp)  # the model's checks: whole heads per rank
    from torch.distributed.tensor.parallel import parallelize_module

    tp_mesh = world.mesh["tp"]
    for _, block in model.present_blocks():
        parallelize_module(block, tp_mesh, styles(block_plan(block)))
    return model


def block_plan(block: nn.Module) -> dict[str, str]:
    """The block's own plan (:meth:`Block.tp_plan`), the modules it does not have left out: a sparse
    layer has no dense MLP projections, so its mixture of experts stays whole (replicated)."""
    names = {name for name, _ in block.named_modules()}
    return {path: kind for path, kind in block.tp_plan().items() if path in names}
