"""Op policies for selective recomputation (``torch.utils.checkpoint`` with a ``context_fn``), one list of the
ops they treat as products: ``memory.activation_checkpointing_policy = 'save-matmuls'`` (:func:`save_matmuls_policy`,
applied in ``model/build.py``) and QLoRA's compiled NF4 products (:func:`recompute_all_but_products`, applied in
``model/nf4.py``); and :func:`quiet_context_fn_note`, which drops the note torch.compile logs for every such
checkpoint (a reminder about in-place ops, which these regions do not hold) that a user cannot act on.
"""

from __future__ import annotations

import logging

import torch
from torch.utils.checkpoint import CheckpointPolicy

__all__ = ["MATMUL_OPS", "quiet_context_fn_note", "recompute_all_but_products", "save_matmuls_policy"]

_ATEN = torch.ops.aten
# what 'save-matmuls' keeps: matrix products (FP8's _scaled_mm too; the routed experts' _grouped_mm where this torch
# has it) and the fused attention kernels of every backend
MATMUL_OPS = frozenset(getattr(_ATEN, n).default for n in (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable", "_grouped_mm") if hasattr(_ATEN, n))


def save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The 'save-matmuls' op policy: keep the outputs of matrix products and fused attention (the costly
    kernels to recompute), recompute everything else (norms, activations, RoPE, dropout, adds: cheap,
    memory-bound). A fused attention with dropout is recomputed too: it draws random numbers, and
    skipping it in the recomputation would shift the random stream of every dropout after it (the
    recomputation must draw what the forward drew, in the same order)."""
    if op not in MATMUL_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" in names:
        i = names.index("dropout_p")
        p = kwargs.get("dropout_p", args[i] if i < len(args) else 0.0)
        if p:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def recompute_all_but_products(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """QLoRA's compiled NF4 product: everything recomputed (the weight's dequantisation above all), the product's
    output saved where the backward reads it (as without the checkpoint)."""
    return CheckpointPolicy.PREFER_SAVE if op in MATMUL_OPS else CheckpointPolicy.MUST_RECOMPUTE


_NOTE = "context_fn is passed to torch.utils.checkpoint under torch.compile"


class _DropNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _NOTE not in record.getMessage()


def quiet_context_fn_note() -> None:
    """Drop torch.compile's note about a checkpoint's ``context_fn`` (logged once per process, at WARNING, by
    ``torch._higher_order_ops.wrap``); every other record of that logger still shows. Idempotent."""
    log = logging.getLogger("torch._higher_order_ops.wrap")
    if not any(isinstance(f, _DropNote) for f in log.filters):
        log.addFilter(_DropNote())
