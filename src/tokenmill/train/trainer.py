"""The training loop. Read top to bottom: :func:`train` sets up a :class:`Trainer`, whose :meth:`~Trainer.fit`
runs one :meth:`~Trainer.train_step` (one optimizer step) per iteration, evaluates and checkpoints.

Setup order: ``apply_allocator_settings`` (before CUDA initialises) -> ``init_world`` (torchrun: process
group + device mesh) -> data -> ``build_model`` (every model-level switch, in the order documented in
``train/parallelize.py``) -> ``Pipeline`` (pipeline schedule) -> ``build_optimizer`` (ZeRO-1, a memory
switch or AdamW) -> scheduler, GradScaler -> resume.

Under torchrun each rank trains its slice of the same global batch (see ``data/loader.py``); the
logged loss is the global batch's (all-reduced), and rank 0 alone writes metrics, config.toml,
summary.json and single-file checkpoints (sharded checkpoints are written by all ranks).

Callers observe or adjust a run through :class:`Callbacks` (the profiler and the tests use them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.profiler import record_function

from tokenmill import atomic, checkpoint
from tokenmill import config as C
from tokenmill.data import build_datasets, build_train_loader, mixture, start_batches, to_device, val_batches
from tokenmill.data.loader import DevicePrefetcher
from tokenmill.errors import AlreadyTrained, TrainingError
from tokenmill.model import balance_experts, flop_params, flops_per_token, math_mode, peak_flops, router_stats
from tokenmill.optim import build_optimizer, build_scheduler, optimizer_step
from tokenmill.parallel import World, grad_sync, init_world, shutdown, unwrap
from tokenmill.parallel.pipeline import Pipeline
from tokenmill.parallel.world import global_mean, rank0_first
from tokenmill.train.advice import check_fits, nan_stop, oom_message
from tokenmill.train.device import (
    apply_allocator_settings,
    contention_note,
    device_info,
    memory_stats,
    offload_activations,
    resolve_device,
    sync,
    thread_settings,
)
from tokenmill.train.init_from import prepare_init_from
from tokenmill.train.loss_mask import StepBatches, eval_mean, eval_terms
from tokenmill.train.metrics import MetricsWriter, Progress, StepMetrics, format_record
from tokenmill.train.parallelize import build_model, count_params, seed_dropout
from tokenmill.train.precision import apply_tf32, autocast, bf16_supported, check_supported, grad_scaler
from tokenmill.train.resume import resume, resume_decision
from tokenmill.train.run_dir import in_use_message, locked, open_run_dir, recorded_config, save_tokenizer
from tokenmill.train.stop import SignalStop
from tokenmill.train.tasks import TaskEval, eval_and_log, evals_due


@dataclass
class Callbacks:
    """Hooks into a run. ``on_model_built(model)``: once the model is built and parallelised, before the
    optimizer (it may wrap or replace methods); ``on_optimizer_built(optimizer)``; ``on_train_start(trainer)``:
    set-up done, before the first step (model, optimizer, loader, ... are the trainer's attributes);
    ``on_step_end(step)``: after each optimizer step, with the number of completed steps."""

    on_model_built: Optional[Callable[[nn.Module], None]] = None
    on_optimizer_built: Optional[Callable[[torch.optim.Optimizer], None]] = None
    on_train_start: Optional[Callable[[Trainer], None]] = None
    on_step_end: Optional[Callable[[int], None]] = None


def train(cfg: C.Config, run_dir: str | Path, resume: bool = False, quiet: bool = False,
          callbacks: Optional[Callbacks] = None) -> dict[str, Any]:
    """Train ``cfg`` into ``run_dir``; returns the run summary (also written as summary.json).

    Under torchrun every rank calls this; the process group is joined here (and left at the end when
    this call created it). A worker restarted by torchrun (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes
    from the newest checkpoint.
    """
    apply_allocator_settings(cfg.memory)  # before anything initialises CUDA
    world = init_world(cfg.parallel, resolve_device(cfg.train.device))
    cfg = C.concrete(cfg, world.device.type, bf16_supported(world.device))  # 'auto' precision and TF32
    try:
        run_dir = open_run_dir(Path(run_dir), cfg)
        with locked(run_dir, enabled=world.is_rank0) as holder:  # rank 0 locks; every rank learns if it did
            if global_mean(torch.tensor(float(holder is not None), device=world.device), world).item() > 0:
                raise TrainingError(in_use_message(run_dir, holder))
            trainer = Trainer(cfg, run_dir, world, resume, quiet, callbacks or Callbacks())
            return trainer.fit()
    except AlreadyTrained as e:
        if world.is_rank0 and not quiet:
            print(f"tokenmill: {e}")
        return {"already_trained": True, "message": str(e)}
    except torch.OutOfMemoryError as e:  # building, resuming, the final evaluation or save
        raise TrainingError(oom_message(cfg, world.device, e)) from None
    finally:
        shutdown(world)


class Trainer:
    """One run: everything built in ``__init__``, trained by :meth:`fit`."""

    def __init__(self, cfg: C.Config, run_dir: Path, world: World, resume_run: bool, quiet: bool,
                 callbacks: Callbacks):
        self.cfg, self.run_dir, self.world, self.quiet, self.cb = cfg, run_dir, world, quiet, callbacks
        t, device, rank0 = cfg.train, world.device, world.is_rank0
        resume_run, has_checkpoints = resume_decision(run_dir, resume_run, rank0)
        cfg, self.init = prepare_init_from(cfg, has_checkpoints, quiet or not rank0)  # the source's model shape
        self.cfg, t = cfg, cfg.train
        check_supported(t, device)
        apply_tf32(t, device)
        with rank0_first(world):  # rank 0 prepares and caches the embedded corpus first
            self.data = build_datasets(cfg.data, cfg.model.block_size, t.seed, cfg.model.vocab_size,
                                       with_val=t.eval_batches > 0, progress=not quiet and rank0)
        vocab_size = cfg.model.vocab_size or self.data.vocab_size
        self.n_params = count_params(cfg.model, vocab_size)  # on meta: nothing allocated
        check_fits(cfg, vocab_size, world, self.n_params)  # an absurd size: the OOM message, not a traceback
        self.model = build_model(cfg, vocab_size, device, world,  # init_from's weights; the data's eot id (document_mask)
                                 self.init and self.init.load(cfg.model, vocab_size, self.data), self.data.data_dir)
        if self.cb.on_model_built:
            self.cb.on_model_built(self.model)
        self.fpt = flops_per_token(cfg.model, flop_params(cfg.model, vocab_size), cfg.model.block_size)
        self.pipeline = Pipeline(self.model, world, cfg.parallel, t.grad_accum_steps) if world.pp > 1 else None
        self.optimizer = build_optimizer(self.model, cfg, world)
        if self.cb.on_optimizer_built:
            self.cb.on_optimizer_built(self.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.max_steps)
        self.scaler = grad_scaler(t, device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]

        self.start_step, rng, start_sample = 0, None, None
        if resume_run:
            self.start_step, rng, start_sample = resume(run_dir, self.model, self.optimizer, self.scheduler,
                                                        self.scaler, cfg, world, quiet)
        if rank0:
            C.save(recorded_config(cfg), run_dir / "config.toml")
            save_tokenizer(run_dir, self.data.data_dir)

        # global batch = micro-batch x accumulation x data-parallel degree; every rank reads its slice
        self.global_batch = checkpoint.global_batch(cfg, world)
        self.tokens_per_step = self.global_batch * cfg.model.block_size
        # a fresh run, or a checkpoint without a reliable data position: every step at this global batch
        self.start_sample = self.start_step * self.global_batch if start_sample is None else start_sample
        self.info = {**device_info(device), "world_size": world.size, "layout": world.layout(),
                     "trainable_params": sum(p.numel() for p in self.params)}  # LoRA: the adapters (this rank's)
        peak = peak_flops(self.info.get("gpu_name", "cpu"), math_mode(t.precision, t.tf32))
        self.peak = peak * world.size if peak else peak  # MFU of the whole job
        self.loader = loader = build_train_loader(self.data.train, cfg.data, t.batch_size, t.grad_accum_steps, self.start_step,
                                    t.max_steps, world.dp_rank, world.dp_size, device.type, self.start_sample)
        self.val = (val_batches(self.data.val, t.batch_size, t.eval_batches)
                    if (self.data.val is not None and t.eval_batches) else [])
        self.tasks = TaskEval.for_run(cfg, world, self.data.data_dir)  # eval.tasks: lm-eval's, checked now (train/tasks.py)
        self.prefetched = cfg.data.cuda_prefetch and device.type == "cuda"  # batches arrive on the device
        self.batches = (DevicePrefetcher(loader, device, cfg.data.non_blocking) if self.prefetched
                        else start_batches(loader))  # may draw from the global RNG (worker seeds): restore the RNG after
        self.batches = StepBatches(self.batches, t.grad_accum_steps, world, self.data.loss_mask, loader)  # data.loss_mask
        if rng is not None:
            checkpoint.set_rng_state(rng, device)
        seed_dropout(t.seed, world.dp_rank, self.start_step)

        self.writer = MetricsWriter.for_run(run_dir, cfg, enabled=rank0)
        self.progress = Progress(cfg.log.progress, t.max_steps, self.start_step, enabled=not quiet and rank0)
        self.metrics = StepMetrics(device, self.tokens_per_step, cfg.log.timing_warmup_steps, self.start_step,
                                   self.fpt, self.peak, compiled=cfg.compile.enabled)
        self.last: dict[str, Optional[float]] = {"loss": None, "val_loss": None}
        self.saved_step: Optional[int] = None  # the last step saved, and how long that took (synchronous saves)
        self.save_s: Optional[float] = None

    # ------------------------------------------------------------------------------------------
    def train_step(self, want_norm: bool) -> tuple[torch.Tensor, Optional[torch.Tensor], float]:
        """One optimizer step over ``train.grad_accum_steps`` micro-batches; returns (mean loss on the device, gradient
        norm or None, the learning rate used). A loss mask's weight: ``train/loss_mask.py``."""
        t, device, m = self.cfg.train, self.world.device, self.metrics
        loss_sum = torch.zeros((), device=device)
        for micro in range(t.grad_accum_steps):
            t0 = time.perf_counter()
            with record_function("data"):
                batch = next(self.batches)
            m.add_host("data", time.perf_counter() - t0)
            with m.phase("h2d"):  # with data.cuda_prefetch the copy ran on a side stream, one batch ahead
                x, y = batch if self.prefetched else to_device(batch, device, self.cfg.data.non_blocking)
            last = micro == t.grad_accum_steps - 1 or self.cfg.parallel.sync_every_microbatch
            with grad_sync(self.model, enabled=last):  # no_sync until the last micro-batch
                if self.pipeline is not None:  # forwards and backwards interleaved by the schedule
                    with m.phase("forward"), autocast(t, device):
                        loss_sum += self.pipeline.train_step(x, y)
                    continue
                with m.phase("forward"), autocast(t, device), offload_activations(self.cfg.memory, device, self.model):
                    loss = self.model(x, y, **self.batches.loss_kw)[1]  # the logits go at once: backward does not need them
                if micro == 0 and self.cfg.optim.zero_grad == "after_forward":  # minGPT's placement
                    self.optimizer.zero_grad(set_to_none=True)
                loss_sum += loss.detach().float()
                with m.phase("backward"):
                    scaled = loss / t.grad_accum_steps if self.batches.weight is None else loss * self.batches.weight
                    (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        with m.phase("optimizer"):
            grad_norm = optimizer_step(self.optimizer, self.scaler, self.params, self.cfg.optim.grad_clip,
                                       want_norm, self.world, zero=self.cfg.optim.zero_grad == "after_step")
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
            if self.cfg.model.moe_bias_update_rate:  # DeepSeek-V3's routing bias (model/moe.py); not on the hot
                balance_experts(self.model)  # path of a model without it
        weight = self.batches.weight  # a loss mask: dp / the step's learned tokens (train/loss_mask.py); else None
        return (loss_sum / t.grad_accum_steps if weight is None else loss_sum * weight), grad_norm, lr

    def evaluate(self) -> float:
        """Mean validation loss over the run's validation batches and data-parallel ranks (a loss mask: over their
        learned tokens); under ``torch.inference_mode`` when ``train.eval_inference_mode``, else ``torch.no_grad``."""
        device = self.world.device
        self.model.eval()
        total = torch.zeros(2, device=device)
        for batch in self.val:
            x, y = to_device(batch, device, self.cfg.data.non_blocking)
            with autocast(self.cfg.train, device), torch.inference_mode(self.cfg.train.eval_inference_mode), \
                    torch.no_grad():
                loss = self.pipeline.eval_loss(x, y) if self.pipeline is not None else self.model(x, y, **self.batches.loss_kw)[1]
            total += eval_terms(loss, y, self.data.loss_mask)
        self.model.train()
        return eval_mean(total, len(self.val), self.data.loss_mask, self.world)

    # ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train from the start (or resumed) step to ``train.max_steps``; returns the summary."""
        cfg, t, device, m = self.cfg, self.cfg.train, self.world.device, self.metrics
        every_log, every_ckpt = cfg.log.every_steps, cfg.checkpoint.every_steps
        self.progress.log(
            f"tokenmill: {self.n_params / 1e6:.2f}M parameters on {self.info.get('gpu_name', device.type)} x "
            f"{self.world.size} ({self.world.layout()}), {self.tokens_per_step:,} tokens/step, steps "
            f"{self.start_step}->{t.max_steps}, run dir {self.run_dir}"
        )
        if device.type == "cpu" and (note := contention_note()):  # once per process tree (a ladder's rungs: never)
            self.progress.log(note)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if self.cb.on_train_start:
            self.cb.on_train_start(self)
        m.restart_window(self.start_step)
        self.model.train()
        stop = SignalStop(self)  # Ctrl-C / SIGTERM: save the last completed step, say how to resume
        try:
            for step in range(self.start_step, t.max_steps):
                done = step + 1
                is_log = done % every_log == 0 or done == t.max_steps
                loss, grad_norm, lr = self.train_step(want_norm=is_log)
                m.step_done(loss, self.batches.learned)
                self.progress.update()
                if self.cb.on_step_end:
                    self.cb.on_step_end(done)
                if is_log:
                    with m.outside("log"):
                        sync(device)
                        losses = self._check_losses(done)
                        rec = m.record(done, losses[-1], lr, grad_norm, memory_stats(device)) | mixture.realised_shares(self.loader, done) | router_stats(self.model)
                        self.writer.write(rec)
                        self.last["loss"] = losses[-1]
                        self.progress.log(format_record(rec) + self.progress.status())
                did_work = False
                if done != t.max_steps and evals_due(self, done):  # the val loss, the eval.tasks scores
                    self._eval_and_log(done)
                    did_work = True
                if every_ckpt and done % every_ckpt == 0 and done != t.max_steps:
                    if not is_log:  # never save a model whose losses were not checked
                        self._check_losses(done)
                    self._save(done)
                    did_work = True
                if is_log or did_work or done == m.timing_from:
                    if done == m.timing_from:
                        sync(device)
                        if device.type == "cuda":  # steady-state peaks: no compile/autotune workspaces
                            m.note_peaks(memory_stats(device))  # the whole run's peaks keep them
                            torch.cuda.reset_peak_memory_stats(device)
                    m.restart_window(done)  # phases cover the window: no warm-up, eval or checkpoint steps
                stop.boundary(done)
        except torch.OutOfMemoryError as e:
            raise TrainingError(oom_message(cfg, device, e)) from None
        finally:
            stop.close()
            self.progress.close()

        if self.start_step < t.max_steps or self.init is not None:  # init_from + 0 steps: saves the loaded model
            self._eval_and_log(t.max_steps)
            if cfg.checkpoint.save_final:
                self._save(t.max_steps)
        self.writer.close()
        return self._summary()

    def _save(self, done: int) -> None:
        samples = self.start_sample + (done - self.start_step) * self.global_batch
        t0 = time.perf_counter()
        with self.metrics.outside("checkpoint"):
            checkpoint.save_checkpoint(self.run_dir, done, self.model, self.optimizer, self.scheduler,
                                       self.scaler, self.cfg, self.world, samples)
        if not self.cfg.checkpoint.async_save:  # a background save's write is not timed here
            self.save_s = time.perf_counter() - t0
        self.saved_step = done

    def _check_losses(self, done: int) -> list[float]:
        """The per-step losses of the whole global batch since the last call (one all-reduce, one sync);
        stops the run on every rank alike if one is not finite."""
        pending = self.metrics.take_losses()
        if not pending:
            return []
        losses = global_mean(torch.stack(pending), self.world).tolist()
        for i, v in enumerate(losses):
            if not math.isfinite(v):
                bad_step = done - len(losses) + 1 + i
                self.writer.write({"step": bad_step, "event": "non_finite_loss", "loss": None})
                raise TrainingError(nan_stop(self.cfg, self.run_dir, self.world.is_rank0, v, bad_step))
        return losses

    def _eval_and_log(self, step: int) -> None:
        eval_and_log(self, step)  # the val loss and the eval.tasks scores that are due (train/tasks.py)

    def _summary(self) -> dict[str, Any]:
        t, device, rank0 = self.cfg.train, self.world.device, self.world.is_rank0
        summary = {
            "steps": t.max_steps,
            "start_step": self.start_step,
            "final_loss": self.last["loss"],
            "val_loss": self.last["val_loss"],
            "params": self.n_params,
            "flops_per_token": self.fpt,
            "tokens_per_step": self.tokens_per_step,
            **self.metrics.summary(memory_stats(device)),
            **memory_stats(device),
            **self.info,
            "peak_flops": self.peak,
            "threads": thread_settings(),
        } | mixture.mixture_summary(self.loader, t.max_steps) | {k: v for k, v in self.last.items() if k.startswith("tasks/")}
        if rank0:
            atomic.write_json(self.run_dir / "summary.json", summary)
        if t.sample_at_end and self.data.data_dir is not None and not self.quiet and rank0 and not self.world.sharded:
            from tokenmill.train.sample import sample_text

            text = sample_text(unwrap(self.model), self.data.data_dir, t.sample_prompt, t.sample_tokens,
                               device=device, seed=t.seed)
            print(f"\n--- sample ({t.sample_tokens} tokens, prompt {t.sample_prompt!r}) ---\n{text}\n---")
            summary["sample"] = text
        if not self.quiet and rank0 and summary["tokens_per_sec"]:
            mfu = f", MFU {100 * summary['mfu']:.1f}%" if summary["mfu"] else ""
            print(f"tokenmill: steady-state {summary['tokens_per_sec']:,.0f} tokens/s{mfu}; "
                  f"final loss {self.last['loss']:.4f}")
        return summary


__all__ = ["Callbacks", "Trainer", "build_model", "seed_dropout", "train"]
