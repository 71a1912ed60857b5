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

The two launches are the operators ``tokenmill::layer_norm_fwd`` / ``_bwd`` (``torch.library.triton_op``
on torch >= 2.6, ``custom_op`` before; autograd joins them), so ``torch.compile`` keeps every norm in the
model's one graph (tests/test_kernels.py counts 0 graph breaks).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from functools import lru_cache
from typing import Any, Optional

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


def _ln_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, wrap: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward kernel on ``x`` (M, C): ``(y, mean, rstd)``, new tensors (the operators' body)."""
    check_device(x.device)
    fwd = _wrap(_kernels()[0], wrap)
    M, C = x.shape
    x = x.contiguous()
    y = torch.empty_like(x)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    w = weight.contiguous()
    b = bias.contiguous() if bias is not None else w  # unused without HAS_BIAS
    if M:
        with _on(x.device):
            fwd[(M,)](x, y, w, b, mean, rstd, x.stride(0), C, eps, HAS_BIAS=bias is not None, BLOCK=_block(C))
    return y, mean, rstd


def _ln_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                 wrap: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernel: ``(dx, dweight, dbias)`` for ``x`` (M, C) (the operators' body)."""
    bwd = _wrap(_kernels()[1], wrap)
    M, C = x.shape
    x, dy, w = x.contiguous(), dy.contiguous(), weight.contiguous()
    dx = torch.empty_like(x)
    P = _programs(x, M)
    dw_part = torch.zeros(P, C, dtype=torch.float32, device=x.device)
    db_part = torch.zeros(P, C, dtype=torch.float32, device=x.device)
    if M:
        with _on(x.device):
            bwd[(P,)](dy, x, w, mean, rstd, dx, dw_part, db_part, x.stride(0), M, C, P,
                      ROWS=triton_cdiv(M, P), BLOCK=_block(C))
    return dx, dw_part.sum(0).to(w.dtype), db_part.sum(0).to(w.dtype)


def _wrap(kernel: Any, wrap: bool) -> Any:
    """``kernel`` as torch.compile should see it: in a ``triton_op``, ``torch.library.wrap_triton(kernel)``
    (the launch becomes a node of the graph); the kernel itself otherwise."""
    return torch.library.wrap_triton(kernel) if wrap else kernel


# torch.library.triton_op (torch >= 2.6): an operator whose body Inductor sees (the kernel launches
# become graph nodes it schedules with the rest); before, torch.library.custom_op: one opaque operator
# with a fake (shape) function. Either way torch.compile keeps the norm inside the compiled graph: no
# graph break at each norm, as there was when dynamo traced into the launch of an autograd.Function.
# Under Triton's CPU interpreter the custom_op form too: AOT tracing runs a triton_op's body on fake
# tensors, which the interpreter cannot launch. Both forms can live in one process (the tests run both).
_TRITON_OP = hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")
_OPS: dict[bool, tuple[Any, Any]] = {}  # triton_op form or not -> (forward, backward) operators


def triton_op_form() -> bool:
    """Whether operators made now are ``triton_op``s (torch >= 2.6, outside ``TRITON_INTERPRET=1``)."""
    return _TRITON_OP and not _interpret()


def _fake_forward(x, weight, bias, eps):
    M = x.shape[0]
    return torch.empty_like(x), x.new_empty(M, dtype=torch.float32), x.new_empty(M, dtype=torch.float32)


def _fake_backward(dy, x, weight, mean, rstd):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(mean, rstd)


def _register(triton: bool) -> tuple[Any, Any]:
    """``tokenmill::layer_norm_fwd`` / ``_bwd`` (``..._opaque`` for the custom_op form) with their fakes
    and autograd."""

    def forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _ln_forward(x, weight, bias, eps, triton)

    def backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _ln_backward(dy, x, weight, mean, rstd, triton)

    make, suffix = (torch.library.triton_op, "") if triton else (torch.library.custom_op, "_opaque")
    fwd = make(f"tokenmill::layer_norm_fwd{suffix}", forward, mutates_args=())
    bwd = make(f"tokenmill::layer_norm_bwd{suffix}", backward, mutates_args=())
    # shapes without running the body: a triton_op's own fake is its body on fake tensors (the same shapes)
    fwd.register_fake(_fake_forward)
    bwd.register_fake(_fake_backward)

    def grads(ctx, dy, _dmean, _drstd):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = bwd(dy, x, weight, mean, rstd)
        return dx, dw, db if ctx.has_bias else None, None

    fwd.register_autograd(grads, setup_context=_setup_context)
    return fwd, bwd


def _ops(triton: bool) -> tuple[Any, Any]:
    """The operators of one form, registered once per process on first use (at model build: never
    inside a traced region)."""
    if triton not in _OPS:
        _OPS[triton] = _register(triton)
    return _OPS[triton]


def triton_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5,
                      triton_op: Optional[bool] = None) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x`` with the Triton kernels (autograd-aware; one operator
    that torch.compile keeps in its graph). ``triton_op``: which form (default :func:`triton_op_form`)."""
    fwd = _ops(triton_op_form() if triton_op is None else triton_op)[0]
    y, _, _ = fwd(x.reshape(-1, x.shape[-1]), weight, bias, float(eps))
    return y.view(x.shape)


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
        self.triton_op = triton_op_form()  # the operators' form, chosen and registered at build, not traced
        _ops(self.triton_op)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(ndim))
        if bias:
            self.bias = nn.Parameter(torch.zeros(ndim))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return triton_layer_norm(x, self.weight, self.bias, self.eps, self.triton_op)
