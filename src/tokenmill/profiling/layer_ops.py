"""The operators a slow layer form adds, counted on the run's own model: a narrow copy of it runs one
forward + backward in each form under a dispatch counter (what ``tokenmill doctor``'s hand-written
layers rule weighs; see :func:`layer_form_ops`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

from tokenmill import config as C
from tokenmill.profiling import rules
from tokenmill.profiling.facts import as_config


def layer_form_ops(config: C.Config | dict[str, Any], cuda: bool = False) -> dict[str, dict[str, int]]:
    """For each slow layer form the run uses (:func:`rules.slow_forms`): the operators of one
    forward + backward of a narrow copy of the run's model (same family, layers and forms, width 4 per
    head, 4 tokens), and how many of them the fast form would not run: ``{field: {"total", "matmul",
    "extra"}}``. Counted, not typed in: the same code as the run's model. ``cuda``: count the native
    RMSNorm as CUDA runs it (torch's fused rms_norm, one forward and one backward kernel; on a CPU it is
    the same operators as the hand-written one)."""
    config = as_config(config)
    slow = {k: rules.LAYER_FORMS[k][1] for k in rules.slow_forms(config)}
    if not slow:
        return {}
    model = dataclasses.asdict(config.model)  # the typed model section's fields (hashable values: the cache key)
    counted = _count_ops(tuple(sorted(model.items())), cuda)
    out = {}
    for key, fast in slow.items():
        n = _count_ops(tuple(sorted({**model, key.split(".", 1)[1]: fast}.items())), cuda)
        if counted and n is not None:
            out[key] = {"total": counted[0], "matmul": counted[1], "extra": max(0, counted[0] - n[0])}
    return out


class _OpCount:
    """Operators dispatched while counting (all, matrix products)."""

    n, matmul = 0, 0


def _as_cuda_runs_it(model) -> None:
    """Count the native RMSNorm as CUDA runs it: torch's fused rms_norm, one forward and one backward
    kernel (on a CPU nn.RMSNorm dispatches the same operators as the hand-written form). Each
    ``nn.RMSNorm`` of ``model`` then counts two operators and computes the same values uncounted."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    def rms(x, w, eps):
        return torch.nn.functional.rms_norm(x, (x.size(-1),), w, eps)

    class FusedRMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, eps):
            _OpCount.n += 1
            ctx.save_for_backward(x, weight)
            ctx.eps = eps
            with _disable_current_modes():
                return rms(x, weight, eps)

        @staticmethod
        def backward(ctx, grad):
            _OpCount.n += 1
            with _disable_current_modes(), torch.enable_grad():
                x, w = (t.detach().requires_grad_() for t in ctx.saved_tensors)
                gx, gw = torch.autograd.grad(rms(x, w, ctx.eps), (x, w), grad)
            return gx, gw, None

    for mod in model.modules():
        if isinstance(mod, torch.nn.RMSNorm):
            mod.forward = lambda x, m=mod: FusedRMSNorm.apply(x, m.weight, m.eps)


@functools.cache
def _count_ops(model_items: tuple, cuda: bool = False) -> Optional[tuple[int, int]]:
    """(all, matrix-product) ATen operators dispatched by one forward + backward of a narrow copy of
    the model (None when the copy cannot be built here, e.g. a GPU-only kernel)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from tokenmill.model.gpt import GPT

    run = C.ModelConfig(**dict(model_items))
    heads = run.n_head
    narrow = dataclasses.replace(  # same family, layers and forms; width 4 per head, 4 tokens
        run, n_embd=4 * heads, block_size=4, dropout=0.0, vocab_size=16, vocab_pad_multiple=1, sdpa_backend="auto",
        head_dim=4 if run.head_dim else None, intermediate_size=16 * heads if run.intermediate_size else None,
        norm=run.norm if run.norm in ("native", "manual") else "native")  # a GPU kernel (triton) counts as native

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _OpCount.n += 1
            _OpCount.matmul += is_matmul(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    _OpCount.n = _OpCount.matmul = 0
    try:
        model = GPT(narrow, 16)
        if cuda:
            _as_cuda_runs_it(model)
        idx = torch.zeros(1, 4, dtype=torch.long)
        with Count():
            _, loss = model(idx, idx)
            loss.backward()
    except Exception:  # a form this machine cannot build: no count, no estimate
        return None
    return _OpCount.n, _OpCount.matmul


def is_matmul(name: str) -> bool:
    """Whether an operator name (``aten.addmm``, ``aten::bmm``) is a matrix product or fused attention."""
    op = name.replace("::", ".").split(".")[-1] if name.startswith("aten") else name
    return op in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear") or "scaled_dot_product" in op \
        or "flash_attention" in op or "efficient_attention" in op
