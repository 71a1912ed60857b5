"""Checkpoints under every layout: one file for replicated models, DCP for sharded ones.

- Single process, DDP and ZeRO-1: rank 0 writes the usual single ``step_XXXXXXXX.pt`` file (ZeRO-1 first
  gathers the optimizer state to rank 0), exactly as a single-process run does.
- FSDP / HSDP (``dp_shard > 1``): ``torch.distributed.checkpoint`` (DCP) writes a folder
  ``step_XXXXXXXX.dcp/`` in which each rank saves its own shards in parallel, plus ``extra.pt`` (rank 0:
  scheduler, scaler, step, data position, RNG, config). The folder is written under a temporary name and
  renamed once every rank has finished, so a crash never leaves a half-written checkpoint under a real name.

Loading picks the newest checkpoint of either kind. A DCP checkpoint loads under any world size and
layout (DCP reshards on load: FSDP on 2 ranks -> 1 process, DDP, FSDP on 4 ranks ...); model and
optimizer state are keyed by parameter name (``get_state_dict``/``set_state_dict``). A single-file
checkpoint loads under single, DDP and ZeRO-1 layouts.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from tokenmill.parallel.data_parallel import unwrap
from tokenmill.parallel.world import ParallelError, World, barrier
from tokenmill.parallel.zero import consolidated_state_dict
from tokenmill.train import checkpoint as ckpt

_DCP_NAME = re.compile(r"^step_(\d{8})\.dcp$")


def list_all(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Every checkpoint of ``run_dir`` (single files and DCP folders), oldest first."""
    found = list(ckpt.list_checkpoints(run_dir))
    d = ckpt.checkpoint_dir(run_dir)
    if d.is_dir():
        for p in d.iterdir():
            m = _DCP_NAME.match(p.name)
            if m and (p / "extra.pt").exists():
                found.append((int(m.group(1)), p))
    return sorted(found)


def global_batch(cfg, world: World) -> int:
    """Samples of the global data stream consumed per optimizer step (micro-batch x accumulation x
    data-parallel degree)."""
    return cfg.train.batch_size * cfg.train.grad_accum_steps * world.dp_size


def data_position(step: int, global_samples: int | None, cfg, world: World) -> dict[str, int]:
    """Where the global data stream stands after ``step`` steps: ``global_samples`` consumed (default:
    every step at the current global batch), and the global batch of the run that saved it.
    ``global_batch`` marks the entry as complete (older checkpoints stored ``global_samples`` without
    the data-parallel degree; :func:`saved_global_samples` ignores those)."""
    g = global_batch(cfg, world)
    samples = step * g if global_samples is None else global_samples
    return {"step": step, "global_samples": samples, "global_batch": g}


def saved_global_samples(extra: dict[str, Any]) -> int | None:
    """The number of global samples a checkpoint had consumed, or None for a checkpoint that did not
    record it reliably (resume then starts at ``step`` x the current global batch)."""
    pos = extra.get("data_position") or {}
    if "global_batch" not in pos or "global_samples" not in pos:
        return None
    return int(pos["global_samples"])


def _extra(scheduler, scaler, cfg, world: World, step, global_samples=None) -> dict[str, Any]:
    return {
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else {},
        "step": step,
        "data_position": data_position(step, global_samples, cfg, world),
        "rng": ckpt.rng_state(world.device),
        "config": cfg.to_dict(),
    }


def save_checkpoint(run_dir, step, model, optimizer, scheduler, scaler, cfg, world: World,
                    global_samples: int | None = None) -> Path:
    """Save step ``step`` (a collective under torchrun: every rank must call it). ``global_samples``:
    samples of the global data stream consumed so far (default ``step`` x the current global batch;
    a resumed run whose global batch changed passes the true count)."""
    d = ckpt.checkpoint_dir(run_dir)
    if world.sharded:
        path = _save_dcp(d, step, model, optimizer, world)
        if world.is_rank0:
            extra = _extra(scheduler, scaler, cfg, world, step, global_samples)
            ckpt.atomic_torch_save(extra, path / "extra.pt")
    else:
        path = d / f"step_{step:08d}.pt"
        optim_sd = consolidated_state_dict(optimizer, world)
        if world.is_rank0:
            state = _extra(scheduler, scaler, cfg, world, step, global_samples)
            state["model"] = ckpt.clean_state_dict(unwrap(model).state_dict())
            state["optimizer"] = optim_sd
            d.mkdir(parents=True, exist_ok=True)
            ckpt.atomic_torch_save(state, path)
    if world.is_rank0:
        for _, old in list_all(run_dir)[: -cfg.checkpoint.keep_last]:
            shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)
    barrier(world)
    return path


def _save_dcp(d: Path, step: int, model, optimizer, world: World) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = d / f"step_{step:08d}.dcp"
    tmp = d / f".step_{step:08d}.dcp.tmp"
    if world.is_rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(world)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
    barrier(world)
    if world.is_rank0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        ckpt._fsync_dir(d)
    barrier(world)
    return final


def load_latest(run_dir, model, optimizer, world: World, check=None) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest checkpoint into ``model`` and ``optimizer`` (already parallelised) and return
    ``(path, extra)`` with the scheduler/scaler/RNG/step/config entries, or None when there is none.
    ``check(extra)`` runs before any weight is loaded (e.g. refuse a different model shape)."""
    found = list_all(run_dir)
    if not found:
        return None
    path = found[-1][1]
    if path.is_dir():
        extra = torch.load(path / "extra.pt", map_location=world.device, weights_only=True)
        if check is not None:
            check(extra)
        _load_dcp(path, model, optimizer)
        return path, extra
    if world.sharded:
        raise ParallelError(
            f"{path} is a single-file checkpoint; resuming it with sharded parameters (FSDP, TP or PP) is not "
            "supported. Resume it with one process or DDP (parallel.dp_shard=1, tp=1, pp=1)."
        )
    state = ckpt.load_checkpoint(path, map_location=world.device)
    if check is not None:
        check(state)
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return path, state


def _load_dcp(path: Path, model, optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise ParallelError(f"{path} is a sharded (DCP) checkpoint; resume it without parallel.zero1.")
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_options())


def load_model_weights(path: Path, model) -> dict[str, torch.Tensor]:
    """The model weights of DCP checkpoint ``path``, read whole in one process (no process group),
    as a state dict for ``model`` (a plain GPT of the run's shape): for sampling and export."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path))
    return state["model"]


def _options():
    """Optimizer state keyed by parameter name, hyperparameters included (``param_groups.<name>.lr``):
    so a checkpoint loads into any grouping of the parameters (tensor parallelism splits the groups
    by mesh, see ``train/optim.py``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)
