"""Tensor parallelism (``parallel.tp``): each block's matrices split over the ranks of the ``tp`` mesh.

Megatron-style, with DTensor's ``parallelize_module``. The model declares the plan
(``GPT.tp_plan``: module path -> 'colwise' | 'rowwise', per block; it also refuses a model that does
not split into whole heads); this module only turns the names into DTensor styles and applies them:

- 'colwise': the projections into heads (q, k, v: each rank computes ``n_head / tp`` query heads and
  ``n_kv_head / tp`` key/value heads) and into the MLP's hidden units (GELU's ``c_fc``, SwiGLU's gate and
  up) split by output features;
- 'rowwise': the projections back to the residual stream (attention and MLP ``c_proj``) split by input
  features; one all-reduce sums them.

So a block costs two all-reduces in forward and two in backward, and its activations inside attention
and the MLP are 1/tp of the full size. The block input and output stay whole (replicated) tensors;
embeddings, norms and the head are replicated (every TP rank computes them, with identical gradients).
Not done here: sequence parallelism of the norms and a vocabulary-parallel head and loss.
"""

from __future__ import annotations

from torch import nn

from tokenmill.parallel.world import World


def styles(plan: dict[str, str]) -> dict:
    """``parallelize_module`` plan: the model's names turned into DTensor styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kinds = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {path: kinds[kind]() for path, kind in plan.items()}


def apply_tensor_parallel(model: nn.Module, world: World) -> nn.Module:
    """Split every block of ``model`` over the ``tp`` mesh dimension (in place; tp == 1: unchanged)."""
    if world.tp == 1:
        return model
    plan = model.tp_plan(world.tp)
    from torch.distributed.tensor.parallel import parallelize_module

    tp_mesh = world.mesh["tp"]
    for _, block in model.present_blocks():
        parallelize_module(block, tp_mesh, styles(plan))
    return model
