"""LayerNorm as two fused Triton kernels (``model.norm = "triton"``).

Forward, one program per row of ``x`` viewed as (M, C): load the row once, mean and biased variance
in fp32, ``y = (x - mean) * rstd * w + b`` stored in the input dtype; the row's ``mean`` and ``rstd``
(fp32, 8 bytes a row) are kept for backward instead of the normalised activations.

Backward, a fixed number of programs P, each over rows ``p, p + P, p + 2P, ...``: with
``xhat = (x - mean) * rstd`` and ``g = w * dy``,
``dx = rstd * (g - mean_C(g * xhat) * xhat - mean_C(g))``; each program also sums ``dy * xhat`` and
``dy`` over its rows into one fp32 row of a (P, C) buffer, and those P partial rows are summed into the
weight and bias gradients afterwards (no atomics, deterministic).

All statistics are fp32 whatever the input dtype, as in PyTorch's own kernel, so the switch keeps
the math of ``nn.LayerNorm`` (tests/test_kernels.py compares forward and gradients under the
interpreter). The kernels are built on first use, so ``TRITON_INTERPRET`` is read then.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from functools import lru_cache
from typing import Any

import torch
import torch.nn as nn

from tokenmill.errors import ConfigError

MAX_WIDTH = 16384  # one row lives in registers: wider rows would spill (GPT widths are <= 12288)


def triton_available() -> bool:
    """Whether the ``triton`` package is importable here."""
    return importlib.util.find_spec("triton") is not None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_device(device: torch.device | str) -> None:
    """Raise a :class:`ConfigError` unless the Triton kernels can run on ``device`` (CUDA, or any
    device under ``TRITON_INTERPRET=1``) and triton is installed."""
    if not triton_available():
        raise ConfigError(
            "model.norm='triton' needs the triton package, which is not installed: pip install triton "
            "(CUDA builds of PyTorch ship it), or use --model.norm native."
        )
    if torch.device(device).type != "cuda" and not _interpret():
        raise ConfigError(
            f"model.norm='triton' runs Triton kernels, which need a CUDA GPU; this run is on "
            f"'{torch.device(device).type}'. Use --model.norm native (PyTorch's fused LayerNorm), or set "
            "TRITON_INTERPRET=1 to run the kernels in Triton's (slow) CPU interpreter."
        )


@lru_cache(maxsize=1)
def _kernels() -> tuple[Any, Any]:
    """Build (jit) the forward and backward kernels; once per process.

    Only builtins are used: row sums are ``tl.reduce(..., tl.standard._sum_combine)`` (what ``tl.sum``
    does for fp32) and ``tl.full`` stands for ``tl.zeros``, because those two are jit functions: under ``TRITON_INTERPRET=1`` it only runs
    they only run if triton.language was first imported in interpreter mode (torch.compile imports
    it earlier); the interpreter recognises ``_sum_combine`` and sums with numpy.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def ln_fwd(X, Y, W, B, Mean, Rstd, stride, C, eps, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < C
        x = tl.load(X + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.reduce(x, 0, tl.standard._sum_combine) / C
        d = tl.where(mask, x - mean, 0.0)
        var = tl.reduce(d * d, 0, tl.standard._sum_combine) / C
        rstd = tl.rsqrt(var + eps)
        y = d * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * stride + cols, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(Mean + row, mean)
        tl.store(Rstd + row, rstd)

    @triton.jit
    def ln_bwd(DY, X, W, Mean, Rstd, DX, DWp, DBp, stride, M, C, n_prog, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < C
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.full((BLOCK,), 0.0, tl.float32)
        db = tl.full((BLOCK,), 0.0, tl.float32)
        # rows pid, pid + n_prog, ...: ROWS = ceil(M / n_prog) iterations, a compile-time bound (Triton's
        # interpreter before 3.9 takes no runtime value as a range bound), the rows past M masked off
        for i in range(0, ROWS):
            row = pid + i * n_prog
            rmask = mask & (cols * 0 + row < M)  # the row's columns, none past the last row
            safe = tl.minimum(row, M - 1)  # a row that exists, for the per-row statistics
            x = tl.load(X + row * stride + cols, mask=rmask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride + cols, mask=rmask, other=0.0).to(tl.float32)
            mean = tl.load(Mean + safe)
            rstd = tl.load(Rstd + safe)
            xhat = tl.where(rmask, (x - mean) * rstd, 0.0)
            g = w * dy
            c1 = tl.reduce(g * xhat, 0, tl.standard._sum_combine) / C
            c2 = tl.reduce(g, 0, tl.standard._sum_combine) / C
            dx = (g - (xhat * c1 + c2)) * rstd
            tl.store(DX + row * stride + cols, dx.to(DX.dtype.element_ty), mask=rmask)
            dw += dy * xhat
            db += dy
        tl.store(DWp + pid * C + cols, dw, mask=mask)
        tl.store(DBp + pid * C + cols, db, mask=mask)

    return ln_fwd, ln_bwd


def triton_cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints (the rows each backward program walks)."""
    return -(-a // b)


def _block(C: int) -> int:
    if C > MAX_WIDTH:
        raise ConfigError(f"model.norm='triton' supports widths up to {MAX_WIDTH}, got n_embd={C}; use --model.norm native.")
    return max(16, 1 << (C - 1).bit_length())  # next power of two


@functools.cache
def _sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (read once: not inside traced code each call)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(x: torch.Tensor, rows: int) -> int:
    """Backward programs: a few per SM on a GPU (each sums its rows' weight gradients); 4 otherwise."""
    if x.is_cuda:
        return max(1, min(rows, 4 * _sm_count(x.device.index if x.device.index is not None else
                                                torch.cuda.current_device())))
    return max(1, min(rows, 4))


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it ``device`` for the launch."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
        fwd, _ = _kernels()
        C = x.shape[-1]
        x2 = x.reshape(-1, C).contiguous()
        M = x2.size(0)
        y = torch.empty_like(x2)
        mean = torch.empty(M, dtype=torch.float32, device=x.device)
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
        w = weight.contiguous()
        b = bias.contiguous() if bias is not None else w  # unused without HAS_BIAS
        if M:
            with _on(x.device):
                fwd[(M,)](x2, y, w, b, mean, rstd, x2.stride(0), C, eps, HAS_BIAS=bias is not None, BLOCK=_block(C))
        ctx.save_for_backward(x2, w, mean, rstd)
        ctx.has_bias, ctx.shape = bias is not None, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        _, bwd = _kernels()
        x2, w, mean, rstd = ctx.saved_tensors
        M, C = x2.shape
        dy2 = dy.reshape(-1, C).contiguous()
        dx = torch.empty_like(x2)
        P = _programs(x2, M)
        dw_part = torch.zeros(P, C, dtype=torch.float32, device=x2.device)
        db_part = torch.zeros(P, C, dtype=torch.float32, device=x2.device)
        if M:
            with _on(x2.device):
                bwd[(P,)](dy2, x2, w, mean, rstd, dx, dw_part, db_part, x2.stride(0), M, C, P,
                          ROWS=triton_cdiv(M, P), BLOCK=_block(C))
        dw = dw_part.sum(0).to(w.dtype)
        db = db_part.sum(0).to(w.dtype) if ctx.has_bias else None
        return dx.view(ctx.shape), dw, db, None


def triton_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x`` with the Triton kernels (autograd-aware)."""
    check_device(x.device)
    return _LayerNormFn.apply(x, weight, bias, eps)


class TritonLayerNorm(nn.Module):
    """``model.norm='triton'``: LayerNorm with the Triton kernels of this module; the same parameters
    (``weight``, ``bias``) and math as ``nn.LayerNorm`` (fp32 statistics, output in the input dtype).

    Raises :class:`ConfigError` when built without triton installed, and in forward on a device the
    kernels cannot run on (not CUDA, outside ``TRITON_INTERPRET=1``).
    """

    def __init__(self, ndim: int, bias: bool = True, eps: float = 1e-5):
        super().__init__()
        if not triton_available():
            check_device("cuda")  # raises the "install triton" error
        _block(ndim)  # width check, at build time
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(ndim))
        if bias:
            self.bias = nn.Parameter(torch.zeros(ndim))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return triton_layer_norm(x, self.weight, self.bias, self.eps)
