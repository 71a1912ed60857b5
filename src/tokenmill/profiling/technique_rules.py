"""Doctor rules that ask the estimator about a technique the run does not use: selective activation
checkpointing where whole blocks are recomputed, LoRA where a full fine-tune fills the GPU, QLoRA where a
LoRA fine-tune still fills it.

Both apply only to a CUDA run whose GPU memory is known and tight (the peak at least
:data:`~tokenmill.profiling.findings.TIGHT_MEMORY` of it: where memory is not tight, ``activation_recompute``
and the memory rules speak), and each runs ``tokenmill estimate`` on the run's config with the switch, on
the run's GPU with its measured memory: a finding only when the estimate says the switch fits."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from tokenmill.profiling.facts import Run, typed
from tokenmill.profiling.findings import Finding, _clamp, pct, switch

FITS = 0.9  # an estimate fits when its peak reserved memory is at most this share of the GPU
LORA_RANK = 16


def _tight(run: Run) -> Optional[float]:
    """The peak's share of the GPU when memory is tight (at least rules.TIGHT_MEMORY of it), else None."""
    from tokenmill.profiling.findings import TIGHT_MEMORY

    fill = run.memory_fill()
    return fill if fill is not None and fill >= TIGHT_MEMORY else None


def _config(run: Run, overrides: dict[str, Any]):
    """The run's config with ``overrides``, validated (a copy)."""
    from tokenmill import config as C

    return C.validate(C.apply_overrides(C.from_dict(run.config.to_dict()), overrides))


def _estimate(run: Run, overrides: dict[str, Any]):
    """``tokenmill estimate`` of the run's config with ``overrides`` on the run's GPU (its measured memory),
    or None when the config or the estimate does not work out here."""
    from tokenmill.errors import TokenmillError
    from tokenmill.estimate import GPUS, estimate, gpu_spec

    try:
        config = _config(run, overrides)
        try:
            g = gpu_spec(run.gpu_name)
        except TokenmillError:
            g = GPUS["h100-sxm"]
        gpu = dataclasses.replace(g, memory_mb=run.memory.device_total_mb)  # the run's GPU, all its specs
        return estimate(config, gpu, run.world_size)
    except (TokenmillError, ValueError, KeyError, TypeError, RuntimeError):
        return None


@typed
def selective_recompute(run: Run) -> Optional[Finding]:
    """Whole blocks recomputed (``activation_checkpointing_policy = 'full'``) while memory is tight, where
    the estimate says the selective policy, which keeps the matmul outputs and recomputes only the
    element-wise ops, still fits: most of the recompute time back for a little memory."""
    mem = run.config.memory
    every, share, fill = mem.activation_checkpointing, run.timing.recompute_share, _tight(run)
    if not every or mem.activation_checkpointing_policy != "full" or fill is None:
        return None
    if share is None or share < 0.05:
        return None
    sel = _estimate(run, {"memory.activation_checkpointing_policy": "save-matmuls"})
    full = _estimate(run, {})
    none = _estimate(run, {"memory.activation_checkpointing": 0})
    cap = run.memory.device_total_mb or 0.0
    if sel is None or full is None or sel.peak_reserved_mb > FITS * cap:
        return None
    recompute = (full.step_ms - none.step_ms) if none is not None else 0.0
    saved = (full.step_ms - sel.step_ms) / recompute if recompute > 0 else 0.5
    ev = [f"memory.activation_checkpointing = {every}, policy 'full': backward recomputes the whole forward of "
          + ("every block" if every == 1 else f"every {every}th block")
          + f"; recompute {run.timing.recompute_ms or 0.0:.1f} ms of {run.timing.step_ms or 0.0:.1f} ms per step "
          f"({pct(share)})",
          f"memory is tight ({pct(fill)} of the GPU), so checkpointing is needed, but the estimate with the "
          f"selective policy is {sel.peak_reserved_mb / 1024:.1f} GB peak reserved of {cap / 1024:.1f} GB "
          f"(whole blocks: {full.peak_reserved_mb / 1024:.1f} GB), and it saves about {pct(max(0.0, saved))} of "
          "the recompute time (estimated)"]
    sug = [switch("memory.activation_checkpointing_policy", "save-matmuls",
                  "selective checkpointing: keep the matmul and attention outputs, recompute only element-wise ops")]
    return Finding(_clamp(0.9 * share * max(0.0, min(1.0, saved))),
                   "whole-block recompute where selective checkpointing fits", ev, sug)


@typed
def lora_finetune(run: Run) -> Optional[Finding]:
    """A full fine-tune (``train.init_from``, no LoRA) that fills the GPU, where the estimate says LoRA
    (frozen base: no gradients or AdamW state for it) fits with room."""
    if not run.config.train.init_from or run.config.lora.rank:
        return None
    fill = _tight(run)
    if fill is None:
        return None
    lora = _estimate(run, {"lora.rank": LORA_RANK})
    full = _estimate(run, {})
    cap = run.memory.device_total_mb or 0.0
    if lora is None or lora.peak_reserved_mb > FITS * cap:
        return None
    state = (run.memory.grad_mb or 0.0) + (run.memory.optimizer_state_mb or 0.0)
    ev = [f"a full fine-tune (train.init_from, every weight trains) fills {pct(fill)} of the GPU"
          + (f"; gradients and AdamW state of every weight are about {state / 1024:.1f} GB of it" if state else ""),
          f"with LoRA rank {LORA_RANK} (the base frozen: gradients and optimizer state for the adapters only) the "
          f"estimate is {lora.peak_reserved_mb / 1024:.1f} GB peak reserved of {cap / 1024:.1f} GB"
          + (f" (this config: {full.peak_reserved_mb / 1024:.1f} GB)" if full is not None else "")]
    sug = [switch("lora.rank", LORA_RANK, "LoRA: low-rank adapters on every projection; the merged export loads "
                  "in transformers as the base does (a different fine-tune: compare the validation loss)")]
    gain = 1.0 - lora.peak_reserved_mb / full.peak_reserved_mb if full is not None else 0.5
    return Finding(_clamp(0.4 * fill * max(0.0, gain)), "a full fine-tune fills the GPU where LoRA fits",
                   ev, sug, measure="memory")


@typed
def qlora_finetune(run: Run) -> Optional[Finding]:
    """A LoRA fine-tune over an unquantised base that fills the GPU, where the estimate says QLoRA (the
    blocks' projection weights stored as NF4, about 4.1 bits per weight) fits."""
    lo = run.config.lora
    if not lo.rank or (lo.quantize_base or "none") != "none":
        return None
    fill = _tight(run)
    lora = _estimate(run, {}) if fill is not None else None
    qlora = _estimate(run, {"lora.quantize_base": "nf4"}) if lora is not None else None
    if qlora is None:
        return None
    q = qlora.peak_reserved_mb
    cap = run.memory.device_total_mb or 0.0
    if q > FITS * cap:
        return None
    ev = [f"a LoRA fine-tune (lora.rank {lo.rank}, the base frozen in its full width) fills "
          f"{pct(fill)} of the GPU",
          f"with the blocks' projection weights stored as NF4 (4-bit, about 4.1 bits per weight) the "
          f"estimate is {q / 1024:.1f} GB peak reserved of {cap / 1024:.1f} GB (this config: "
          f"{lora.peak_reserved_mb / 1024:.1f} GB)"]
    sug = [switch("lora.quantize_base", "nf4", "QLoRA: the frozen base stored as 4-bit NF4 (torchao), dequantised "
                  "in each matmul; the export merges the adapters into the dequantised base (compare the "
                  "validation loss: the base itself changes by the quantisation)")]
    gain = 1.0 - q / lora.peak_reserved_mb
    return Finding(_clamp(0.4 * fill * max(0.0, gain)), "a LoRA fine-tune fills the GPU where QLoRA fits",
                   ev, sug, measure="memory")
