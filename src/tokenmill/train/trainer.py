"""The training loop. Read top to bottom: set up, then one optimizer step per loop iteration.

Every switch is applied by one named function, in this order:
``apply_allocator_settings`` -> ``init_world`` (torchrun: process group + device mesh) ->
``apply_pipeline_split`` -> ``apply_precision`` -> ``apply_tensor_parallel`` ->
``apply_activation_checkpointing`` -> ``apply_compile`` -> ``apply_data_parallel`` (DDP / FSDP2) ->
``Pipeline`` (pipeline schedule) -> ``make_optimizer`` (ZeRO-1, memory switches or AdamW).

Under torchrun each rank trains its slice of the same global batch (see ``data/loader.py``); the
logged loss is the global batch's (all-reduced), and rank 0 alone writes metrics, config.toml,
summary.json and single-file checkpoints (sharded checkpoints are written by all ranks, see
``parallel/checkpointing.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.profiler import record_function

from tokenmill import config as C
from tokenmill.data import build_datasets, build_train_loader, to_device, val_batches
from tokenmill.errors import TrainingError
from tokenmill.memory.activation_checkpointing import apply_activation_checkpointing
from tokenmill.memory.allocator import apply_allocator_settings
from tokenmill.memory.optimizers import CPUOffloadOptimizer, OptimizerInBackward, build_memory_optimizer
from tokenmill.model import GPT, flops_per_token, math_mode, peak_flops
from tokenmill.parallel import checkpointing as pckpt
from tokenmill.parallel.data_parallel import apply_data_parallel, grad_sync, unwrap
from tokenmill.parallel.grad_norm import clip_grad_norm
from tokenmill.parallel.pipeline import Pipeline, apply_pipeline_split
from tokenmill.parallel.tensor_parallel import apply_tensor_parallel
from tokenmill.parallel.world import (
    World,
    barrier,
    global_mean,
    init_world,
    is_elastic_restart,
    rank0_first,
    shutdown,
)
from tokenmill.parallel.zero import build_zero1_optimizer
from tokenmill.train import checkpoint as ckpt
from tokenmill.train.compile import apply_compile
from tokenmill.train.metrics import MetricsWriter, Progress, ThroughputMeter, read_metrics
from tokenmill.train.optim import build_optimizer, build_scheduler, load_scheduler_state
from tokenmill.train.precision import apply_precision, apply_tf32, autocast, check_supported, grad_scaler
from tokenmill.train.timing import PHASES, PhaseTimer


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device='cuda' but no CUDA GPU is visible; use --train.device auto or cpu.")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise TrainingError("train.device='mps' but MPS is not available; use --train.device auto or cpu.")
    return torch.device(name)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def build_model(cfg: C.Config, vocab_size: int, device: torch.device, world: Optional[World] = None) -> GPT:
    """The model with every model-level switch applied, on ``device`` (this rank's pipeline stage and
    tensor-parallel shards under ``world``)."""
    torch.manual_seed(cfg.train.seed)
    with torch.device(device):
        model = GPT(cfg.model, vocab_size)
    world = world or World(device=device)
    apply_pipeline_split(model, world)
    apply_precision(model, cfg.train)
    apply_tensor_parallel(model, world)
    apply_activation_checkpointing(model, cfg.memory.activation_checkpointing)
    apply_compile(model, cfg.compile)
    return model


_RESUME_SEED_STRIDE = 1_000_003  # > any data-parallel degree: (rank, step) pairs get distinct seeds


def seed_dropout(seed: int, dp_rank: int, start_step: int = 0) -> None:
    """Give each data-parallel rank its own dropout masks (call once the model is built and
    initialised, identically on every rank, from ``seed``).

    DP rank 0 keeps the RNG as it is (as build_model left it, or restored from the checkpoint), so a
    single process is unchanged and resumes bit-exactly. Rank r > 0 is reseeded from ``seed``, r and
    ``start_step`` (a checkpoint holds rank 0's RNG state only). Tensor-parallel ranks and pipeline
    stages of one DP group share the DP rank, hence the masks (TP's replicated activations need
    equal masks)."""
    if dp_rank > 0:
        torch.manual_seed(seed + dp_rank + _RESUME_SEED_STRIDE * start_step)


def model_size(cfg: C.Config, vocab_size: int) -> tuple[int, int]:
    """(parameters, parameters without position embeddings) of the whole model, counted on ``meta``."""
    with torch.device("meta"):
        model = GPT(cfg.model, vocab_size)
    return model.num_params(), model.num_params(exclude_position=True)


def memory_stats(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    mb = 1024**2
    return {
        "peak_alloc_mb": torch.cuda.max_memory_allocated(device) / mb,
        "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / mb,
    }


def device_info(device: torch.device) -> dict[str, Any]:
    info = {"device": device.type, "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        info["gpu_name"] = torch.cuda.get_device_name(device)
    return info


def oom_message(cfg: C.Config, device: torch.device, err: BaseException) -> str:
    peak = memory_stats(device).get("peak_alloc_mb")
    peak_s = f"{peak:,.0f} MB" if peak is not None else "unknown"
    t, m = cfg.train, cfg.model
    tips = [
        f"--train.batch_size {max(1, t.batch_size // 2)} --train.grad_accum_steps {t.grad_accum_steps * 2} "
        "(same global batch, half the activations)",
    ]
    if cfg.memory.activation_checkpointing != 1:
        tips.append("--memory.activation_checkpointing 1 (recompute activations in backward)")
    if t.precision == "fp32":
        tips.append("--train.precision bf16-autocast (half-size activations)")
    if m.attention == "manual":
        tips.append("--model.attention sdpa (no T x T attention matrix)")
    if m.loss_impl == "full":
        tips.append("--model.loss_impl chunked (no full vocabulary logits)")
    if cfg.optim.impl != "for-loop":
        tips.append("--optim.impl for-loop (smaller optimizer temporaries)")
    lines = "\n".join(f"  {x}" for x in tips)
    return (
        f"out of memory on {device} at batch_size={t.batch_size}, block_size={m.block_size} "
        f"(peak allocated {peak_s}).\nSwitches that reduce memory:\n{lines}\n"
        f"Find the largest batch that fits with `tokenmill bench max-batch`. ({str(err).splitlines()[0]})"
    )


def _clean_metrics(run_dir: Path, upto_step: int) -> None:
    """On resume, drop metric lines of steps after the checkpoint (they will be trained again)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    rows = [r for r in read_metrics(run_dir) if r.get("step", 0) <= upto_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


@torch.no_grad()
def evaluate(model: nn.Module, batches, cfg: C.Config, world: World, pipeline: Optional[Pipeline] = None) -> float:
    """Mean loss over ``batches`` (averaged over data-parallel ranks)."""
    device = world.device
    model.eval()
    total = torch.zeros((), device=device)
    n = 0
    for batch in batches:
        x, y = to_device(batch, device, cfg.data.non_blocking)
        with autocast(cfg.train, device):
            loss = pipeline.eval_loss(x, y) if pipeline is not None else model(x, y)[1]
        total += loss.float()
        n += 1
    model.train()
    return global_mean(total / max(n, 1), world).item()


def make_optimizer(model: nn.Module, cfg: C.Config, world: World) -> torch.optim.Optimizer:
    """The one place where the optimizer is chosen: ZeRO-1, a memory switch, or plain AdamW."""
    if cfg.parallel.zero1:
        return build_zero1_optimizer(model, cfg.optim, world)
    return build_memory_optimizer(model, cfg, world.distributed) or build_optimizer(model, cfg.optim)


def optimizer_step(optimizer, scaler, params, grad_clip: float, want_norm: bool,
                   world: Optional[World] = None) -> Optional[torch.Tensor]:
    """Unscale (fp16), clip / measure the gradient norm, step, zero the gradients; returns the norm
    (None when neither clipping nor logging asked for it, or the optimizer stepped in backward)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = None
    if not isinstance(optimizer, OptimizerInBackward) and (grad_clip > 0 or want_norm):
        max_norm = grad_clip if grad_clip > 0 else float("inf")
        if isinstance(optimizer, CPUOffloadOptimizer) and optimizer.offload_grads:  # gradients on the CPU
            grad_norm = optimizer.clip_grad_norm_(max_norm)
        elif world is not None and (world.tp > 1 or world.pp > 1):  # parameters split over ranks
            grad_norm = clip_grad_norm(params, max_norm, world)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def train(
    cfg: C.Config,
    run_dir: str | Path,
    resume: bool = False,
    on_step_end: Optional[Callable[[int], None]] = None,
    quiet: bool = False,
) -> dict[str, Any]:
    """Train ``cfg`` into ``run_dir``; returns the run summary (also written as summary.json).

    Under torchrun every rank calls this; the process group is joined here (and left at the end when
    this call created it). A worker restarted by torchrun (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes
    from the newest checkpoint.
    """
    apply_allocator_settings(cfg.memory)  # before anything initialises CUDA
    world = init_world(cfg.parallel, resolve_device(cfg.train.device))
    try:
        return _train(cfg, Path(run_dir), world, resume or is_elastic_restart(), on_step_end, quiet)
    finally:
        shutdown(world)


def _train(cfg: C.Config, run_dir: Path, world: World, resume: bool, on_step_end, quiet: bool) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume and pckpt.list_all(run_dir):
        raise TrainingError(
            f"run directory {run_dir} already holds checkpoints; pass --resume to continue that run, "
            "or choose another --run-dir."
        )
    device, rank0 = world.device, world.is_rank0
    check_supported(cfg.train, device)
    apply_tf32(cfg.train, device)

    t = cfg.train
    with rank0_first(world):  # rank 0 prepares and caches the embedded corpus first
        data = build_datasets(cfg.data, cfg.model.block_size, t.seed, cfg.model.vocab_size,
                              with_val=t.eval_batches > 0, progress=not quiet and rank0)
    vocab_size = cfg.model.vocab_size or data.vocab_size
    model = build_model(cfg, vocab_size, device, world)
    n_params, n_flop_params = model_size(cfg, vocab_size)
    fpt = flops_per_token(cfg.model, n_flop_params, cfg.model.block_size)
    model = apply_data_parallel(model, world, cfg.parallel)
    pipeline = Pipeline(model, world, cfg.parallel, t.grad_accum_steps) if world.pp > 1 else None
    optimizer = make_optimizer(model, cfg, world)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.max_steps)
    scaler = grad_scaler(cfg.train, device)

    start_step, rng_to_restore, start_sample = 0, None, None
    if resume:
        start_step, rng_to_restore, start_sample = _resume(run_dir, model, optimizer, scheduler, scaler, cfg,
                                                           world, quiet)
    if rank0:
        C.save(cfg, run_dir / "config.toml")

    # global batch = micro-batch x accumulation x data-parallel degree; every rank reads its slice
    global_batch = pckpt.global_batch(cfg, world)
    tokens_per_step = global_batch * cfg.model.block_size
    if start_sample is None:  # a fresh run, or a checkpoint without a reliable data position
        start_sample = start_step * global_batch
    info = {**device_info(device), "world_size": world.size, "layout": world.layout()}
    peak = peak_flops(info.get("gpu_name", "cpu"), math_mode(t.precision, t.tf32))
    peak = peak * world.size if peak else peak  # MFU of the whole job
    loader = build_train_loader(data.train, cfg.data, t.batch_size, t.grad_accum_steps, start_step,
                                t.max_steps, world.dp_rank, world.dp_size, device.type, start_sample)
    val = val_batches(data.val, t.batch_size, t.eval_batches) if (data.val is not None and t.eval_batches) else []

    writer = MetricsWriter(run_dir, cfg.log.tensorboard, enabled=rank0)
    progress = Progress(cfg.log.progress, t.max_steps, start_step, enabled=not quiet and rank0)
    progress.log(
        f"tokenmill: {n_params / 1e6:.2f}M parameters on {info.get('gpu_name', device.type)} x {world.size} "
        f"({world.layout()}), {tokens_per_step:,} tokens/step, steps {start_step}->{t.max_steps}, run dir {run_dir}"
    )
    meter = ThroughputMeter(tokens_per_step, cfg.log.timing_warmup_steps, start_step)
    timer = PhaseTimer(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    params = [p for p in model.parameters() if p.requires_grad]
    pending: list[torch.Tensor] = []  # per-step losses since the last log (read with one sync)
    last = {"loss": None, "val_loss": None}
    it = iter(loader)  # may draw from the global RNG (worker seeds): restore the RNG after it
    if rng_to_restore is not None:
        ckpt.set_rng_state(rng_to_restore, device)
    seed_dropout(t.seed, world.dp_rank, start_step)
    meter.mark(start_step)
    timer.reset()
    model.train()
    try:
        for step in range(start_step, t.max_steps):
            done = step + 1
            is_log = done % cfg.log.every_steps == 0 or done == t.max_steps
            loss_sum = torch.zeros((), device=device)
            for micro in range(t.grad_accum_steps):
                t0 = time.perf_counter()
                with record_function("data"):
                    batch = next(it)
                timer.add_host("data", time.perf_counter() - t0)
                with timer.phase("h2d"):
                    x, y = to_device(batch, device, cfg.data.non_blocking)
                with grad_sync(model, enabled=micro == t.grad_accum_steps - 1):  # no_sync until the last
                    if pipeline is not None:  # forwards and backwards interleaved by the schedule
                        with timer.phase("forward"), autocast(t, device):
                            loss_sum += pipeline.train_step(x, y)
                        continue
                    with timer.phase("forward"), autocast(t, device):
                        _, loss = model(x, y)
                    loss_sum += loss.detach().float()
                    with timer.phase("backward"):
                        scaled = loss / t.grad_accum_steps
                        (scaler.scale(scaled) if scaler is not None else scaled).backward()
            with timer.phase("optimizer"):
                grad_norm = optimizer_step(optimizer, scaler, params, cfg.optim.grad_clip, is_log, world)
                lr = scheduler.get_last_lr()[0]
                scheduler.step()
            pending.append(loss_sum / t.grad_accum_steps)
            meter.step_done()
            timer.step_done()
            progress.update()
            if on_step_end is not None:
                on_step_end(done)

            if is_log:
                sync(device)
                tps = meter.close_window()
                losses = _global_losses(pending, done, run_dir, writer, cfg, world)
                phases, nsteps = timer.collect()  # the steps of the meter's window (same resets)
                rec = {
                    "step": done,
                    "loss": losses[-1],
                    "lr": _as_float(lr),  # a tensor under some optimizers (torchao's AdamW8bit)
                    "grad_norm": _as_float(grad_norm),
                    "tokens_per_sec": tps,
                    "mfu": (fpt * tps / peak) if (tps and peak) else None,
                    **{f"{p}_ms": 1000 * phases.get(p, 0.0) / max(1, nsteps) for p in PHASES},
                    **memory_stats(device),
                }
                if tps:
                    step_ms = 1000 * tokens_per_step / tps
                    rec["step_ms"] = step_ms
                    rec["other_ms"] = _other_ms(step_ms, sum(rec[f"{p}_ms"] for p in PHASES))
                writer.write(rec)
                last["loss"] = losses[-1]
                progress.log(_format(rec))

            did_work = False
            if val and t.eval_every_steps and done % t.eval_every_steps == 0 and done != t.max_steps:
                last["val_loss"] = _eval_and_log(model, pipeline, val, cfg, world, done, writer, progress)
                did_work = True
            if cfg.checkpoint.every_steps and done % cfg.checkpoint.every_steps == 0 and done != t.max_steps:
                if not is_log:  # never save a model whose losses were not checked
                    _global_losses(pending, done, run_dir, writer, cfg, world)
                pckpt.save_checkpoint(run_dir, done, model, optimizer, scheduler, scaler, cfg, world,
                                      start_sample + (done - start_step) * global_batch)
                did_work = True
            if is_log or did_work or done == meter.timing_from:
                if done == meter.timing_from:
                    sync(device)
                meter.mark(done)
                timer.reset()  # phases cover the meter's window: no warm-up, eval or checkpoint steps
    except torch.OutOfMemoryError as e:
        raise TrainingError(oom_message(cfg, device, e)) from None
    finally:
        progress.close()

    if start_step < t.max_steps:
        if val:
            last["val_loss"] = _eval_and_log(model, pipeline, val, cfg, world, t.max_steps, writer, progress)
        if cfg.checkpoint.save_final:
            pckpt.save_checkpoint(run_dir, t.max_steps, model, optimizer, scheduler, scaler, cfg, world,
                                  start_sample + (t.max_steps - start_step) * global_batch)
    writer.close()

    summary = {
        "steps": t.max_steps,
        "start_step": start_step,
        "final_loss": last["loss"],
        "val_loss": last["val_loss"],
        "params": n_params,
        "flops_per_token": fpt,
        "tokens_per_step": tokens_per_step,
        **meter.summary(),
        **memory_stats(device),
        **info,
        "peak_flops": peak,
    }
    summary["mfu"] = fpt * summary["tokens_per_sec"] / peak if (summary["tokens_per_sec"] and peak) else None
    if rank0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if t.sample_at_end and data.data_dir is not None and not quiet and rank0 and not world.sharded:
        from tokenmill.train.sample import sample_text

        text = sample_text(unwrap(model), data.data_dir, t.sample_prompt, t.sample_tokens, device=device,
                           seed=t.seed)
        print(f"\n--- sample ({t.sample_tokens} tokens, prompt {t.sample_prompt!r}) ---\n{text}\n---")
        summary["sample"] = text
    if not quiet and rank0 and summary["tokens_per_sec"]:
        mfu = f", MFU {100 * summary['mfu']:.1f}%" if summary["mfu"] else ""
        print(f"tokenmill: steady-state {summary['tokens_per_sec']:,.0f} tokens/s{mfu}; final loss {last['loss']:.4f}")
    return summary


def _resume(run_dir, model, optimizer, scheduler, scaler, cfg, world, quiet) -> tuple[int, Any, Optional[int]]:
    """Load the newest checkpoint (any layout); returns (start step, RNG state to restore, global samples
    consumed: where the data stream goes on, None when the checkpoint did not record it)."""
    found = pckpt.load_latest(run_dir, model, optimizer, world,
                              check=lambda saved: _check_same_model(saved.get("config", {}), cfg))
    if found is None:  # e.g. a torchrun restart before the first checkpoint: start over, cleanly
        if world.is_rank0:
            _clean_metrics(run_dir, 0)
        barrier(world)
        return 0, None, None
    path, state = found
    load_scheduler_state(scheduler, state["scheduler"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    start_step = int(state["step"])
    start_sample = pckpt.saved_global_samples(state)
    if world.is_rank0:
        _clean_metrics(run_dir, start_step)
        if not quiet:
            print(f"tokenmill: resumed from {path} at step {start_step}")
            old, new = (state.get("data_position") or {}).get("global_batch"), pckpt.global_batch(cfg, world)
            if start_sample is not None and old != new:
                print(f"tokenmill: the global batch changed from {old} to {new} samples per step; the data "
                      f"stream continues at sample {start_sample} (nothing replayed or skipped)")
    barrier(world)
    return start_step, state["rng"], start_sample


def _global_losses(pending, done, run_dir, writer, cfg, world) -> list[float]:
    """The per-step losses of the whole global batch since the last call (one all-reduce, one sync);
    stops the run on every rank alike if one is not finite. Clears ``pending``."""
    if not pending:
        return []
    losses = global_mean(torch.stack(pending), world).tolist()
    pending.clear()
    for i, v in enumerate(losses):
        if not math.isfinite(v):
            _stop_on_nan(run_dir, writer, done - len(losses) + 1 + i, v, cfg)
    return losses


def _other_ms(step_ms: float, phases_ms: float) -> float:
    """The step time outside the timed phases. Phases are timed inside the step-time window, so only
    clock noise can make it negative: up to 1% of the step is rounded to 0; more stays visible."""
    other = step_ms - phases_ms
    return 0.0 if -0.01 * step_ms < other < 0.0 else other


def _as_float(x) -> Optional[float]:
    if x is None:
        return None
    if hasattr(x, "full_tensor"):  # a DTensor norm (FSDP)
        x = x.full_tensor()
    return float(x)


def _format(rec: dict[str, Any]) -> str:
    s = f"step {rec['step']:>6} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e}"
    if rec.get("tokens_per_sec"):
        s += f" | {rec['tokens_per_sec']:,.0f} tok/s"
    if rec.get("mfu"):
        s += f" | MFU {100 * rec['mfu']:.1f}%"
    if rec.get("peak_alloc_mb"):
        s += f" | peak {rec['peak_alloc_mb']:,.0f} MB"
    if rec.get("data_ms") is not None:
        s += f" | data {rec['data_ms']:.1f} ms"
    return s


def _eval_and_log(model, pipeline, val, cfg, world, step, writer, progress) -> float:
    v = evaluate(model, val, cfg, world, pipeline)
    writer.write({"step": step, "val_loss": v})
    progress.log(f"step {step:>6} | val_loss {v:.4f}")
    return v


def _stop_on_nan(run_dir, writer, step, value, cfg) -> None:
    writer.write({"step": step, "event": "non_finite_loss", "loss": None})
    good = pckpt.list_all(run_dir)
    keep = f"the last good checkpoint is {good[-1][1]}" if good else "no checkpoint was written before it"
    hints = ["--optim.lr (lower it)", "--optim.grad_clip 1.0", "--optim.warmup_steps (longer)"]
    if cfg.train.precision == "fp16-autocast":
        hints.append("--train.precision bf16-autocast (fp16 overflows)")
    raise TrainingError(
        f"loss became {value} at step {step}; the run was stopped and {keep} (resume with --resume after "
        f"changing a setting). Try: {', '.join(hints)}."
    )


def _check_same_model(saved: dict[str, Any], cfg: C.Config) -> None:
    saved_model = saved.get("model", {})
    now = dataclasses.asdict(cfg.model)
    diff = [k for k in now if k in saved_model and saved_model[k] != now[k] and k in _SHAPE_FIELDS]
    if diff:
        pairs = ", ".join(f"model.{k}: checkpoint {saved_model[k]!r} vs now {now[k]!r}" for k in diff)
        keep = " ".join(f"--model.{k} {_cli_value(saved_model[k])}" for k in diff)
        hint = (f"The model's shape switches cannot change on resume: resume with the checkpoint's values "
                f"({keep}), or start a new run.")
        if {"fused_qkv", "tie_embeddings"} & set(diff):
            hint += (" Tensor parallelism needs --model.fused_qkv false and pipeline parallelism "
                     "--model.tie_embeddings false; to use them later, train from the start with those.")
        raise TrainingError(f"cannot resume: the model differs from the checkpoint's ({pairs}). {hint}")


def _cli_value(v: Any) -> str:
    """A config value as written on the command line (``true``, ``64``)."""
    return str(v).lower() if isinstance(v, bool) else str(v)


_SHAPE_FIELDS = {
    "vocab_size", "vocab_pad_multiple", "block_size", "n_layer", "n_head", "n_embd",
    "bias", "qkv_bias", "tie_embeddings", "fused_qkv",
}
