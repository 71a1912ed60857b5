"""Linear head + cross-entropy in chunks of tokens: the (tokens x vocab) logits never exist at once.

The model's own loss, used by :class:`~tokenmill.model.gpt.GPT` when ``model.loss_impl='chunked'``. For each chunk of
``chunk_size`` tokens the forward pass computes the logits, their log-sum-exp and the loss, and at
once the gradient of the summed loss with respect to the logits (``softmax - one_hot``), which it
turns into the chunk's gradient for the hidden states and adds into the head-weight gradient; then
the chunk's logits are freed. Backward only scales those two saved gradients by ``grad_out``.
So the peak extra memory is one chunk of logits plus a hidden-state-sized and a weight-sized (fp32)
gradient, instead of the full fp32 logits and their gradient: the head weight is cast to the hidden states' dtype
once for the loop (autocast's fp32 weight), each chunk's weight gradient is added in slices of vocabulary rows (no
weight-sized product), and backward scales the fp32 sum straight into the weight's dtype.

The math is the same as ``F.cross_entropy(h @ W[:vocab].T, targets, reduction=...)``: a target equal to
``ignore_index`` (-100, ``data.loss_mask``'s tokens not learned) adds nothing to the loss and gets no
gradient; ``reduction='mean'`` divides by the targets that count (a batch with none: 0, not NaN),
``'sum'`` does not. Only the summation order of the head-weight gradient changes (fp32 rounding).

Under ``torch.compile`` the loop is one operator, ``tokenmill::chunked_cross_entropy`` (a
``torch.library.custom_op`` with a fake and its autograd), so Dynamo records one call instead of
unrolling the loop once per chunk: compile time does not grow with the number of chunks (128-192 chunks
of 1,024 tokens took minutes to compile when unrolled), and the graph does not break. Eagerly the same
loop runs in an ``autograd.Function`` (every ATen operation visible to the estimator's recorder and the
profiler, as before).
"""

from __future__ import annotations

from typing import Optional

import torch


def _chunk_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (h @ w.t()).float()


def _chunk_loop(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, chunk_size: int,
                ignore_index: int, need_h: bool, need_w: bool
                ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The summed loss (fp32) over all chunks, targets ``ignore_index`` skipped, and when asked the
    gradients of that sum for ``h`` (in its dtype) and for ``weight`` (fp32, its whole shape: padded rows
    stay 0)."""
    w = weight[:vocab_size].to(h.dtype)  # one copy for the whole loop when the weight is wider (autocast's fp32)
    grad_h = torch.empty_like(h) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for s in range(0, h.size(0), chunk_size):
        hc, tc = h[s : s + chunk_size], targets[s : s + chunk_size]
        keep = tc != ignore_index
        tc = torch.where(keep, tc, 0)  # an ignored row looks up column 0, then counts for nothing
        logits = _chunk_logits(hc, w)
        lse = torch.logsumexp(logits, dim=-1)
        total += torch.where(keep, lse - logits.gather(1, tc[:, None]).squeeze(1), 0.0).sum()
        if not (need_h or need_w):
            continue
        # softmax in place of the logits, 0 on an ignored row (its log-sum-exp taken as +inf): no extra pass
        g = logits.sub_(torch.where(keep, lse, torch.inf)[:, None]).exp_()
        g[torch.arange(g.size(0), device=g.device), tc] -= keep.to(g.dtype)
        g = g.to(h.dtype)
        if grad_h is not None:
            grad_h[s : s + chunk_size] = g @ w
        if grad_w is not None:
            _add_weight_grad(grad_w, g, hc, chunk_size)
    return total, grad_h, grad_w


def _add_weight_grad(grad_w: torch.Tensor, g: torch.Tensor, hc: torch.Tensor, chunk_size: int) -> None:
    """``grad_w[:V] += g.T @ hc`` (fp32 += the product in ``hc``'s dtype), over slices of vocabulary rows each
    no larger than the chunk's fp32 logits: no weight-sized product, nor its fp32 copy, exists at once."""
    vocab = g.size(1)
    rows = max(1, chunk_size * vocab * 4 // (hc.size(1) * hc.element_size()))
    for v in range(0, vocab, rows):
        end = min(v + rows, vocab)  # the padded rows past the vocabulary stay 0
        grad_w[v:end].add_(g[:, v:end].t() @ hc)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``loss = sum_i CE(h_i @ W[:V].T, t_i)`` over the targets that count, with its gradients computed
    chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, h, weight, targets, vocab_size: int, chunk_size: int, ignore_index: int):
        total, grad_h, grad_w = _chunk_loop(h, weight, targets, vocab_size, chunk_size, ignore_index,
                                            ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.save_for_backward(grad_h, grad_w)
        ctx.w_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return (*_scaled(grad_h, grad_w, grad_out, ctx.w_dtype), None, None, None, None)


def _scaled(grad_h, grad_w, grad_out, w_dtype: torch.dtype):
    """The saved gradients of the summed loss, times ``grad_out``."""
    gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
    gw = None
    if grad_w is not None:  # scaled straight into the weight's dtype: no second fp32 copy of the weight's size
        gw = torch.mul(grad_w, grad_out, out=torch.empty(grad_w.shape, dtype=w_dtype, device=grad_w.device))
    return gh, gw


# -- the loop as one operator, for torch.compile ----------------------------------------------------------


@torch.library.custom_op("tokenmill::chunked_cross_entropy", mutates_args=())
def _chunked_op(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, chunk_size: int,
                ignore_index: int, need_h: bool, need_w: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(summed loss, grad_h, grad_w)`` of the summed loss; a gradient not asked for is an empty tensor
    (an operator returns tensors only)."""
    total, grad_h, grad_w = _chunk_loop(h, weight, targets, vocab_size, chunk_size, ignore_index, need_h, need_w)
    grad_h = grad_h if grad_h is not None else h.new_empty(0, dtype=torch.float32)  # two tensors: an
    grad_w = grad_w if grad_w is not None else h.new_empty(0, dtype=torch.float32)  # operator's outputs never alias
    return total, grad_h, grad_w


@_chunked_op.register_fake
def _(h, weight, targets, vocab_size, chunk_size, ignore_index, need_h, need_w):
    loss = h.new_empty((), dtype=torch.float32)
    grad_h = torch.empty_like(h) if need_h else h.new_empty(0, dtype=torch.float32)
    grad_w = weight.new_empty(weight.shape, dtype=torch.float32) if need_w else h.new_empty(0, dtype=torch.float32)
    return loss, grad_h, grad_w


def _op_setup(ctx, inputs, output) -> None:
    _, weight, _, _, _, _, need_h, need_w = inputs
    _, grad_h, grad_w = output
    ctx.mark_non_differentiable(grad_h, grad_w)
    ctx.save_for_backward(grad_h if need_h else None, grad_w if need_w else None)
    ctx.w_dtype = weight.dtype


def _op_backward(ctx, grad_out, _grad_h, _grad_w):
    grad_h, grad_w = ctx.saved_tensors
    return (*_scaled(grad_h, grad_w, grad_out, ctx.w_dtype), None, None, None, None, None, None)


_chunked_op.register_autograd(_op_backward, setup_context=_op_setup)


def chunked_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, chunk_size: int,
    reduction: str = "mean", ignore_index: int = -100,
) -> torch.Tensor:
    """Cross-entropy of ``h (N, C) @ weight[:vocab_size].T`` against ``targets (N,)``, in chunks: the mean
    over the targets other than ``ignore_index`` (0 when there is none), or with ``reduction='sum'`` the sum.

    Without autograd (evaluation) the chunks are only reduced to the loss; with it, see the module doc.
    Traced by ``torch.compile``: one operator call, whatever the number of chunks.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    grad = torch.is_grad_enabled()
    need_h, need_w = grad and h.requires_grad, grad and weight.requires_grad
    args = (h, weight, targets, vocab_size, chunk_size, ignore_index)
    if torch.compiler.is_compiling():
        total = _chunked_op(*args, need_h, need_w)[0]
    elif need_h or need_w:
        total = ChunkedLinearCrossEntropy.apply(*args)
    else:
        total = _chunk_loop(*args, False, False)[0]
    if reduction == "sum":
        return total
    return total / (targets != ignore_index).sum().clamp(min=1)
