"""What to tell the user when a run stops: out of memory, or a loss that is no longer finite."""

from __future__ import annotations

import torch

from tokenmill import config as C
from tokenmill.train.device import memory_stats


def oom_message(cfg: C.Config, device: torch.device, err: BaseException) -> str:
    """The out-of-memory message: the batch, the peak memory, and the switches that reduce memory."""
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


def nan_message(cfg: C.Config, value: float, step: int, last_good: str | None) -> str:
    """The message of a run stopped by a non-finite loss."""
    keep = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was written before it"
    hints = ["--optim.lr (lower it)", "--optim.grad_clip 1.0", "--optim.warmup_steps (longer)"]
    if cfg.train.precision == "fp16-autocast":
        hints.append("--train.precision bf16-autocast (fp16 overflows)")
    return (f"loss became {value} at step {step}; the run was stopped and {keep} (resume with --resume after "
            f"changing a setting). Try: {', '.join(hints)}.")
