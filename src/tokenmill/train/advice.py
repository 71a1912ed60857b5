"""What to tell the user when a run stops: out of memory (also before anything is allocated, for a size
that cannot fit), or a loss that is no longer finite."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from tokenmill import config as C
from tokenmill.errors import TrainingError
from tokenmill.parallel.world import World
from tokenmill.train.device import memory_stats


def oom_message(cfg: C.Config, device: torch.device, err: BaseException) -> str:
    """The out-of-memory message: the batch, the peak memory, and the switches that reduce memory."""
    peak = memory_stats(device).get("peak_alloc_mb")
    peak_s = f"{peak:,.0f} MB" if peak is not None else "unknown"
    t, m = cfg.train, cfg.model
    from tokenmill.config.memory_switches import flags, getter, memory_switches

    tips = [f"{flags(sw)} ({sw.why})" for sw in memory_switches(getter(cfg)) if not sw.several_gpus]
    lines = "\n".join(f"  {x}" for x in tips)
    estimate = ""
    if device.type == "cuda":  # the estimator's figure for this config and GPU, and the switch that fits
        from tokenmill.estimate import memory_advice

        nproc = int(os.environ.get("WORLD_SIZE", "1"))
        estimate = f"Estimate: {memory_advice(cfg, torch.cuda.get_device_name(device), nproc)}.\n"
    return (
        f"out of memory on {device} at batch_size={t.batch_size}, block_size={m.block_size} "
        f"(peak allocated {peak_s}).\nSwitches that reduce memory:\n{lines}\n{estimate}"
        f"Find the largest batch that fits with `tokenmill bench max-batch`. ({str(err).splitlines()[0]})"
    )



def nan_stop(cfg: C.Config, run_dir, rank0: bool, value: float, step: int) -> str:
    """Stop a run whose loss at ``step`` is ``value`` (not finite): the checkpoint at ``step - 1`` (and any
    later) holds the weights that produced it and is set aside (rank 0), so the message and ``--resume``
    name the newest checkpoint whose next step was finite."""
    from tokenmill import checkpoint

    aside = checkpoint.set_aside(run_dir, step - 1) if rank0 else []
    good = checkpoint.list_checkpoints(run_dir)
    return nan_message(cfg, value, step, str(good[-1][1]) if good else None, aside)


def nan_message(cfg: C.Config, value: float, step: int, last_good: str | None, aside: list | None = None) -> str:
    """The message of a run stopped by a non-finite loss (``aside``: checkpoints set aside, whose weights
    produced it; ``last_good``: the newest checkpoint whose next step was finite)."""
    keep = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was written before it"
    if aside:
        keep += (f" ({', '.join(str(p) for p in aside)} holds the weights that produced it and was set aside, "
                 "kept but never loaded)")
    hints = ["--optim.lr (lower it)", "--optim.grad_clip 1.0", "--optim.warmup_steps (longer)"]
    if cfg.train.precision == "fp16-autocast":
        hints.append("--train.precision bf16-autocast (fp16 overflows)")
    return (f"loss became {value} at step {step}; the run was stopped and {keep} (resume with --resume after "
            f"changing a setting). Try: {', '.join(hints)}.")


# ------------------------------------------------------------------------------------------------
# Before anything is allocated: can the training state fit at all?


def state_bytes(cfg: C.Config, n_params: int, world: World, n_trainable: Optional[int] = None) -> tuple[int, int]:
    """A lower bound of this rank's training state (weights, gradients, AdamW moments; activations and
    temporaries not counted): ``(device bytes, host bytes)``. Sharding (FSDP, TP, PP, ZeRO-1) divides it;
    offloading moves parts to the host; on a CPU run everything is host memory. ``n_trainable``: the
    parameters that get gradients and moments (LoRA's adapters; default all)."""
    mem, par = cfg.memory, cfg.parallel
    per = 2 if cfg.train.precision == "bf16" else 4  # bytes per weight (and per gradient)
    shard = max(1, world.dp_shard) * max(1, world.tp) * max(1, world.pp)
    n = n_params / shard
    t = (n_params if n_trainable is None else n_trainable) / shard
    weights, grads = n * per, t * per
    moments = t * (2 if mem.optimizer_8bit else 2 * per)
    if par.zero1:
        moments /= max(1, world.dp_size)
    if world.device.type != "cuda":
        return 0, int(weights + grads + moments)
    if par.fsdp_cpu_offload:
        return 0, int(weights + grads + moments)
    if mem.optimizer_offload:  # fp32 master weights and moments on the host; gradients too with offload_gradients
        host = t * 4 + t * 8 + (grads if mem.offload_gradients else 0)
        return int(weights + (0 if mem.offload_gradients else grads)), int(host)
    return int(weights + grads + moments), 0


def available_memory(device: torch.device) -> tuple[Optional[int], Optional[int]]:
    """Free bytes ``(on the device, in host RAM)``; None where this system does not say (then no check)."""
    dev = None
    if device.type == "cuda":
        try:
            dev = torch.cuda.mem_get_info(device)[0]
        except (RuntimeError, AssertionError):  # pragma: no cover - a broken driver: let the run report it
            dev = None
    host = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                host = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):  # not Linux
        host = None
    return dev, host


def check_fits(cfg: C.Config, vocab_size: int, world: World, n_params: Optional[int] = None) -> None:
    """Stop with the out-of-memory message before building a model whose weights, gradients and
    optimizer state alone cannot fit (e.g. ``--model.vocab_size 1000000000000``), instead of an
    allocator traceback or a machine swapping for minutes. ``n_params``: the model's parameters (counted
    on the ``meta`` device when not given)."""
    from tokenmill.model.build import trainable_params
    from tokenmill.train.parallelize import count_params

    n = n_params if n_params is not None else count_params(cfg.model, vocab_size)
    trainable = trainable_params(cfg.model, vocab_size, cfg.lora) if cfg.lora.rank else None
    need_dev, need_host = state_bytes(cfg, n, world, trainable)
    free_dev, free_host = available_memory(world.device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if world.size > 1 else 1  # ranks sharing this host
    where = None
    if free_dev is not None and need_dev > free_dev:
        where, need, free = f"on {world.device}", need_dev, free_dev
    elif free_host is not None and need_host * local > free_host:
        where, need, free = "in this machine's memory", need_host * local, free_host
    if where is None:
        return
    raise TrainingError(too_big_message(cfg, vocab_size, n, need, free, where, world))


def _size(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB", "EB"):
        if abs(b) < 1024 or unit == "EB":
            return f"{b:,.1f} {unit}" if unit != "B" else f"{b:,.0f} B"
        b /= 1024
    return f"{b:,.1f} EB"  # pragma: no cover


def too_big_message(cfg: C.Config, vocab_size: int, n: int, need: int, free: int, where: str, world: World) -> str:
    """The message of :func:`check_fits`: what was asked for, how much it needs, what is free, what to try."""
    m, mem = cfg.model, cfg.memory
    parts = {
        "token embedding": vocab_size * m.n_embd,
        "position embedding": m.block_size * m.n_embd,
        "blocks": max(0, n - vocab_size * m.n_embd - m.block_size * m.n_embd),
    }
    biggest = max(parts, key=parts.get)
    shape = (f"model.vocab_size {vocab_size:,}, block_size {m.block_size:,}, n_layer {m.n_layer}, n_embd "
             f"{m.n_embd:,}")
    tips = ["a smaller model: --model.vocab_size / --model.block_size / --model.n_layer / --model.n_embd "
            f"(the {biggest} alone holds {parts[biggest]:,} parameters)"]
    if cfg.train.precision != "bf16":
        tips.append("--train.precision bf16 (half-size weights, gradients and optimizer state)")
    from tokenmill.config.memory_switches import flags, getter, memory_switches

    tips += [f"{flags(s)} ({s.why})" for s in memory_switches(getter(cfg)) if "lora.rank" in s.overrides]
    if world.device.type == "cuda":
        if not mem.optimizer_8bit and not mem.optimizer_offload:
            tips.append("--memory.optimizer_8bit true (8-bit AdamW state) or --memory.optimizer_offload true "
                        "(AdamW state in CPU memory)")
        if world.dp_shard <= 1:
            tips.append("more GPUs with FSDP: torchrun --nproc-per-node N -m tokenmill train ... "
                        "--parallel.dp_shard -1")
    lines = "\n".join(f"  {t}" for t in tips)
    return (f"out of memory before the first step: the model asked for ({shape}) has {n:,} parameters; its "
            f"weights, gradients and AdamW state alone need at least {_size(need)} {where}, where {_size(free)} "
            f"is available.\nSwitches that reduce memory:\n{lines}")
