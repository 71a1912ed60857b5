"""The global gradient norm when parameters are split by tensor or pipeline parallelism.

``torch.nn.utils.clip_grad_norm_`` needs all gradients of one kind (all plain tensors, or DTensors on
one mesh) and sees only this rank's pipeline stage. Here every rank adds up the squares of the
gradient values it holds, each divided by how many ranks hold the same values (a plain tensor is held
by all data- and tensor-parallel ranks of its stage, a DTensor shard by fewer), and one all-reduce
over the world gives the squared norm of the whole model's gradient.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tokenmill.parallel.world import World


def _is_shard(placement) -> bool:
    """True when ``placement`` splits the tensor over its mesh dimension (each rank holds a different part).

    ``Shard`` answers ``is_shard()``. ``_StridedShard`` (FSDP2's placement on the FSDP mesh dimension of a
    weight that TP already shards on the same tensor dimension) is a ``Shard`` subclass in older torch but
    a separate class whose ``is_shard()`` is False in newer ones (2.13), so it is recognised by class, and
    any other placement with a tensor ``dim`` that is neither replicated nor partial counts as a shard too.
    """
    if placement.is_shard():
        return True
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        _StridedShard = None
    if _StridedShard is not None and isinstance(placement, _StridedShard):
        return True
    return (isinstance(getattr(placement, "dim", None), int)
            and not placement.is_replicate() and not placement.is_partial())


def _local_and_copies(grad: torch.Tensor, world: World) -> tuple[torch.Tensor, int]:
    """(the values this rank holds, the number of ranks holding the same values)."""
    from torch.distributed.tensor import DTensor

    shards = 1
    if isinstance(grad, DTensor):
        for dim, placement in enumerate(grad.placements):
            if _is_shard(placement):
                shards *= grad.device_mesh.size(dim)
        grad = grad.to_local()
    return grad, world.size // world.pp // shards


@torch.no_grad()
def clip_grad_norm(params, max_norm: float, world: World) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most ``max_norm`` (``inf``: only
    measure); returns the norm before clipping (a plain tensor, the same on every rank).

    Gradients are grouped by (copies, dtype, device), so each group costs one foreach norm and one
    foreach multiply instead of a kernel per parameter."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g, copies = _local_and_copies(p.grad, world)
            groups.setdefault((copies, g.dtype, g.device), []).append(g)
    total = torch.zeros((), dtype=torch.float32, device=world.device)
    for (copies, _, _), grads in groups.items():
        norms = torch.stack(torch._foreach_norm(grads)).float()
        total += norms.pow(2).sum().to(total.device) / copies
    if world.distributed:
        dist.all_reduce(total)
    norm = total.sqrt()
    if not math.isinf(max_norm):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for (_, dtype, device), grads in groups.items():
            torch._foreach_mul_(grads, coef.to(device=device, dtype=dtype))
    return norm
