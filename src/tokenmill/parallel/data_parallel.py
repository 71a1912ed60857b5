"""Data parallelism: DDP, FSDP2 (ZeRO-2/3, HSDP) and gradient-sync control during accumulation.

Order (torchtitan style), applied by :func:`apply_data_parallel` after the model-level switches
(pipeline split -> precision -> tensor parallel -> activation checkpointing -> compile) and before the
optimizer is built:

- ``dp_shard > 1``: :func:`apply_fsdp` -- ``fully_shard`` on every block, on the untied embeddings and on the
  final norm with the head (the model's ``edge_units``), then on the root (what is left: a tied embedding and
  head); a 2-D mesh ``(dp_replicate, dp_shard)`` gives HSDP.
- ``dp_replicate > 1`` only: :func:`apply_ddp` (with tensor or pipeline parallelism use FSDP/HSDP).
"""

from __future__ import annotations

import contextlib

from torch import nn

from tokenmill.config import ParallelConfig
from tokenmill.parallel.world import ParallelError, World


def apply_ddp(model: nn.Module, world: World, cfg: ParallelConfig) -> nn.Module:
    """Wrap in DistributedDataParallel over the ``dp_replicate`` mesh dimension."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(
        model,
        device_ids=[world.device.index] if world.device.type == "cuda" else None,
        process_group=world.mesh.get_group("dp_replicate"),
        bucket_cap_mb=cfg.ddp_bucket_mb,
        gradient_as_bucket_view=cfg.ddp_grad_as_bucket_view,
    )


def fsdp_kwargs(world: World, cfg: ParallelConfig) -> dict:
    """Keyword arguments of ``fully_shard`` from the config: mesh, mixed precision, CPU offload."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    mesh = world.mesh["dp_replicate", "dp_shard"] if world.dp_replicate > 1 else world.mesh["dp_shard"]
    kw: dict = {"mesh": mesh}
    if cfg.fsdp_mixed_precision == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.fsdp_cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    return kw


def apply_fsdp(model: nn.Module, world: World, cfg: ParallelConfig) -> nn.Module:
    """``fully_shard`` each transformer block, the model's edge units (untied embeddings; the final norm with
    the head: ``GPT.edge_units``), then the root (in place; returns ``model``).

    ``fsdp_reshard_after_forward``: True = ZeRO-3; False = ZeRO-2-like. The root is never resharded after
    forward (its parameters are needed again at once by backward), as torchtitan does.
    """
    from torch.distributed.fsdp import fully_shard

    kw = fsdp_kwargs(world, cfg)
    for _, block in model.present_blocks():
        fully_shard(block, reshard_after_forward=cfg.fsdp_reshard_after_forward, **kw)
    for modules, may_free in model.edge_units():  # the embeddings; the final norm with the head
        fully_shard(modules, reshard_after_forward=may_free and cfg.fsdp_reshard_after_forward, **kw)
    fully_shard(model, reshard_after_forward=False, **kw)
    return model


def apply_data_parallel(model: nn.Module, world: World, cfg: ParallelConfig) -> nn.Module:
    """DDP / FSDP / HSDP per the resolved degrees; a world of one returns ``model`` unchanged (except
    FSDP asked for with ``parallel.dp_shard -1`` under a one-process torchrun: a 1-rank mesh)."""
    if world.fsdp and not world.distributed:
        return apply_fsdp(model, world, cfg)
    if not world.distributed:
        if cfg.fsdp_cpu_offload or cfg.zero1:
            raise ParallelError("parallel.fsdp_cpu_offload / parallel.zero1 need a multi-process (torchrun) run.")
        return model
    if world.dp_shard > 1:
        if cfg.fsdp_cpu_offload and world.device.type != "cuda":
            raise ParallelError("parallel.fsdp_cpu_offload moves shards between GPU and host: it needs CUDA.")
        return apply_fsdp(model, world, cfg)
    if cfg.fsdp_mixed_precision != "none" or cfg.fsdp_cpu_offload:
        raise ParallelError("parallel.fsdp_* switches need parallel.dp_shard > 1 (FSDP).")
    if world.dp_replicate == 1:
        return model  # tensor / pipeline parallel only
    if world.tp > 1 or world.pp > 1:
        raise ParallelError(
            f"data parallelism over {world.dp_replicate} replicas with parallel.tp/pp runs through FSDP: set "
            f"--parallel.dp_shard {world.dp_replicate} --parallel.dp_replicate 1 (or HSDP with both > 1)."
        )
    return apply_ddp(model, world, cfg)


def unwrap(model: nn.Module) -> nn.Module:
    """The GPT inside a DDP wrapper (FSDP2 shards in place, so that model is the GPT itself)."""
    return getattr(model, "module", model)


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool):
    """Reduce gradients across ranks only when ``enabled`` (the last micro-step of an accumulation):
    DDP ``no_sync()``; FSDP2 ``set_requires_gradient_sync``. A plain model: nothing to do."""
    if hasattr(model, "no_sync"):  # DDP
        with contextlib.nullcontext() if enabled else model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        yield
    else:
        yield
