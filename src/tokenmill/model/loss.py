"""Linear head + cross-entropy in chunks of tokens: the (tokens x vocab) logits never exist at once.

The model's own loss, used by :class:`~tokenmill.model.gpt.GPT` when ``model.loss_impl='chunked'``. For each chunk of
``chunk_size`` tokens the forward pass computes the logits, their log-sum-exp and the loss, and at
once the gradient of the summed loss with respect to the logits (``softmax - one_hot``), which it
turns into the chunk's gradient for the hidden states and adds into the head-weight gradient; then
the chunk's logits are freed. Backward only scales those two saved gradients by ``grad_out / N``.
So the peak extra memory is one chunk of logits plus a hidden-state-sized and a weight-sized
gradient, instead of the full fp32 logits and their gradient.

The math is the same as ``F.cross_entropy(h @ W[:vocab].T, targets)`` (mean over tokens); only the
summation order of the head-weight gradient changes (fp32 rounding).
"""

from __future__ import annotations

import torch


def _chunk_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (h @ w.t()).float()


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``loss = mean_i CE(h_i @ W[:V].T, t_i)`` with gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, h, weight, targets, vocab_size: int, chunk_size: int):
        n = h.size(0)
        w = weight[:vocab_size]
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, n, chunk_size):
            hc, tc = h[s : s + chunk_size], targets[s : s + chunk_size]
            logits = _chunk_logits(hc, w)
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
            g = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            g[torch.arange(g.size(0), device=g.device), tc] -= 1.0
            g = g.to(h.dtype)
            if grad_h is not None:
                grad_h[s : s + chunk_size] = g @ w.to(h.dtype)
            if grad_w is not None:
                grad_w[:vocab_size] += (g.t() @ hc).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.n, ctx.w_dtype = n, weight.dtype
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_out / ctx.n
        gh = grad_h * scale.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * scale).to(ctx.w_dtype) if grad_w is not None else None
        return gh, gw, None, None, None


def chunked_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, chunk_size: int
) -> torch.Tensor:
    """Mean cross-entropy of ``h (N, C) @ weight[:vocab_size].T`` against ``targets (N,)``, in chunks.

    Without autograd (evaluation) the chunks are only reduced to the loss; with it, see the module doc.
    """
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return ChunkedLinearCrossEntropy.apply(h, weight, targets, vocab_size, chunk_size)
    w = weight[:vocab_size]
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for s in range(0, h.size(0), chunk_size):
        logits = _chunk_logits(h[s : s + chunk_size], w)
        tc = targets[s : s + chunk_size]
        total += (torch.logsumexp(logits, -1) - logits.gather(1, tc[:, None]).squeeze(1)).sum()
    return total / h.size(0)
