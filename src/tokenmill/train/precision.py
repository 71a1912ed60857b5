"""Numeric precision: where ``train.precision`` and ``train.tf32`` are applied to the process (TF32,
autocast, the GradScaler); the pure-bf16 cast of the model is ``tokenmill.model.build.apply_precision``.

- ``fp32``: plain float32.
- ``train.tf32``: TF32 tensor-core matmuls for fp32 math (CUDA only).
- ``bf16-autocast``: bf16 compute under ``torch.autocast``, fp32 weights, gradients and optimizer state.
- ``bf16``: the whole model cast to bf16 (weights, gradients, optimizer state); no autocast. The loss
  is still computed in fp32 inside the model.
- ``fp16-autocast``: fp16 autocast with a ``GradScaler`` (dynamic loss scaling).
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from tokenmill.config import TrainConfig
from tokenmill.errors import PrecisionError


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` runs bf16 on tensor cores (what ``train.precision='auto'`` asks; CUDA only)."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def check_supported(cfg: TrainConfig, device: torch.device) -> None:
    if device.type == "cuda" and cfg.precision in ("bf16", "bf16-autocast"):
        if not torch.cuda.is_bf16_supported():
            raise PrecisionError(
                f"train.precision={cfg.precision!r}: this GPU ({torch.cuda.get_device_name(device)}) has no "
                "bf16 support; use --train.precision fp16-autocast (or fp32 with --train.tf32 true)."
            )


def apply_tf32(cfg: TrainConfig, device: torch.device) -> None:
    """Set the float32 matmul precision ('high' allows TF32) for this process."""
    if cfg.tf32 and device.type != "cuda":
        warnings.warn(f"train.tf32 has no effect on {device.type}; running plain fp32 matmuls.", stacklevel=2)
        return
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    torch.backends.cudnn.allow_tf32 = cfg.tf32
    torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")


def autocast(cfg: TrainConfig, device: torch.device):
    if cfg.precision == "bf16-autocast":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if cfg.precision == "fp16-autocast":
        return torch.autocast(device_type=device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def grad_scaler(cfg: TrainConfig, device: torch.device):
    """A GradScaler for fp16 autocast, else None."""
    if cfg.precision != "fp16-autocast":
        return None
    return torch.amp.GradScaler(device.type)
