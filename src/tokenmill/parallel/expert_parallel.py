"""Expert parallelism (``parallel.ep``): the routed experts of every mixture-of-experts layer split over
``ep`` data-parallel ranks, tokens sent to their experts' rank and back by all-to-all.

The ranks form a second device mesh ``("dp_mod_ep", "ep")`` over the data-parallel ranks (built in
:mod:`tokenmill.parallel.world`): ranks ``ep`` apart in the flat data-parallel order hold the same experts
(``dp_mod_ep``), neighbours hold different ones (``ep``). The model says what is split: a module with a
``shard_experts(index, parts, dispatch)`` method keeps its shard and returns the module holding it; each of
that module's parameters becomes a DTensor sharded on dimension 0 over ``ep`` (its global shape is the
whole layer's, so a DCP checkpoint holds every expert under its usual name and loads under any layout).

One forward of a layer (:class:`Dispatch`): the expert-sorted rows are counted per destination rank, the
counts exchanged (one small all-to-all and one host read of the split sizes), the rows sent (all-to-all with
split sizes), regrouped by local expert, run, put back in arrival order and sent home. Dropless: every row
reaches its expert. Both all-to-alls are differentiable (:class:`_AllToAll`, its backward the reverse
exchange), on gloo and nccl.

Gradients of the experts: a rank's expert gradient already sums the contributions of its ``ep`` group's
tokens (the all-to-all's backward brings them); the ranks holding the same experts (``dp_mod_ep``) then
average it: FSDP2 over ``dp_mod_ep`` for the experts (when the run uses FSDP), else an all-reduce hook on
each expert parameter (DDP, which is told to leave them alone). Every other gradient is averaged over all
data-parallel ranks, so the experts' carries a factor ``1 / ep`` more: applied in the backward of the
combine (and undone in the backward of the dispatch, so the gradient of the activations is exact).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tokenmill.config import ParallelConfig
from tokenmill.parallel.world import World

__all__ = ["Dispatch", "apply_expert_parallel", "expert_parameter_names", "shard_experts"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes along dimension 0; backward: the reverse exchange, times ``scale``."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group, scale: float):
        ctx.splits, ctx.group, ctx.scale = (out_splits, in_splits), group, scale
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        g = _exchange(grad, in_splits, out_splits, ctx.group)
        return (g if ctx.scale == 1 else g * ctx.scale), None, None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class Dispatch:
    """The dispatch hook of one rank: ``(rows sorted by expert, counts per expert of the E, run) -> outputs``,
    ``run(rows of this rank's experts sorted by expert, their counts)`` being the local experts' forward."""

    def __init__(self, group, parts: int):
        self.group, self.parts = group, parts

    def __call__(self, xs: torch.Tensor, counts: torch.Tensor, run: Callable) -> torch.Tensor:
        ep, n = self.parts, counts.numel() // self.parts
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts.contiguous(), group=self.group)  # row i: rank i's counts for my experts
        host = torch.cat([counts, recv]).tolist()  # the split sizes, read once
        send = [sum(host[j * n:(j + 1) * n]) for j in range(ep)]
        got = [sum(host[counts.numel() + i * n:counts.numel() + (i + 1) * n]) for i in range(ep)]
        rows = _AllToAll.apply(xs, got, send, self.group, float(ep))  # backward: undo the combine's 1 / ep
        order, local_counts = regroup(recv.view(ep, n), rows.size(0))
        y = run(rows[order], local_counts)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _AllToAll.apply(y[back], send, got, self.group, 1.0 / ep)


def regroup(recv: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that arrived source by source (``recv[i, e]``: rows from source i for local expert e, each source's
    rows sorted by expert) -> (the order that groups them by expert, sources in order within an expert; the
    rows per local expert)."""
    ep, n = recv.shape
    block = torch.repeat_interleave(torch.arange(ep * n, device=recv.device), recv.reshape(-1), output_size=total)
    key = (block % n) * ep + block // n  # (expert, source) of each arrived row
    return torch.argsort(key, stable=True), recv.sum(0)


def _sharded_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if callable(getattr(m, "shard_experts", None))]


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Names (in ``model``) of the parameters expert parallelism split: those of each sharded module."""
    held = {id(p) for m in model.modules() if getattr(m, "dispatch", None) is not None
            for p in m.parameters(recurse=False)}
    return [name for name, p in model.named_parameters() if id(p) in held]


def apply_expert_parallel(model: nn.Module, world: World, cfg: ParallelConfig) -> nn.Module:
    """``parallel.ep``: shard each MoE layer's routed experts over the ``ep`` mesh dimension and set its
    dispatch; the experts' gradients averaged over ``dp_mod_ep`` (FSDP2 there under FSDP, else a hook, with
    DDP told to skip them); the logged expert loads summed over the ranks. ``ep`` 1: ``model`` unchanged."""
    if world.ep == 1:
        return model
    mesh = world.ep_mesh
    held = []
    for m in _sharded_modules(model):
        held.append(shard_experts(m, mesh["ep"]))
        if hasattr(m, "count_reducer"):
            m.count_reducer = _sum_over_ranks
    if world.fsdp:
        _shard_experts_fsdp(held, world, cfg)
    else:
        _reduce_by_hook(held, mesh.get_group("dp_mod_ep"), mesh.size(0))
        model._ddp_params_and_buffers_to_ignore = expert_parameter_names(model)  # DDP's own attribute
    return model


def shard_experts(module: nn.Module, ep_mesh) -> nn.Module:
    """Keep ``module``'s share of the experts for this rank of the 1-D mesh ``ep_mesh`` and set its dispatch
    over that mesh; its experts' weights become DTensors sharded on dimension 0. Returns the experts' module."""
    from torch.distributed.tensor import DTensor, Shard

    parts = ep_mesh.size()
    experts = module.shard_experts(ep_mesh.get_local_rank(), parts, Dispatch(ep_mesh.get_group(), parts))
    for name, p in list(experts.named_parameters(recurse=False)):
        d = DTensor.from_local(p.data, ep_mesh, [Shard(0)], run_check=False)
        setattr(experts, name, nn.Parameter(d, requires_grad=p.requires_grad))
    return experts


def _shard_experts_fsdp(held: list[nn.Module], world: World, cfg: ParallelConfig) -> None:
    """FSDP2 on each experts module over ``dp_mod_ep`` (the ranks holding the same experts), before
    :func:`~tokenmill.parallel.data_parallel.apply_fsdp` wraps the blocks (FSDP skips modules it already
    manages), with the run's FSDP settings."""
    from torch.distributed.fsdp import fully_shard

    from tokenmill.parallel.data_parallel import fsdp_kwargs

    kw = fsdp_kwargs(world, cfg) | {"mesh": world.ep_mesh["dp_mod_ep"]}
    for experts in held:
        fully_shard(experts, reshard_after_forward=cfg.fsdp_reshard_after_forward, **kw)


def _reduce_by_hook(held: list[nn.Module], group, copies: int) -> None:
    """Without FSDP: each expert gradient averaged over the ``copies`` ranks holding the same experts as it
    is produced (every micro-batch: a mean of sums is the sum of means)."""
    if copies == 1:
        return
    from torch.distributed.tensor import DTensor

    def hook(grad):
        local = grad.to_local().clone()
        dist.all_reduce(local, group=group)  # gloo has no AVG
        local /= copies
        return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)

    for experts in held:
        for p in experts.parameters(recurse=False):
            if p.requires_grad:
                p.register_hook(hook)


def _sum_over_ranks(counts: torch.Tensor) -> torch.Tensor:
    """The routed slots per expert of every rank (the logged load is the whole batch's)."""
    out = counts.clone()
    dist.all_reduce(out)
    return out
