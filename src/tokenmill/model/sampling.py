"""Sampling the next token from a model's logits (temperature, top-k, top-p): used by ``GPT.generate``,
``tokenmill sample`` and the lm-eval adapter's generation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.errors import SampleError

__all__ = ["check_sampling", "sample_next_token"]


def check_sampling(top_k: int | None, top_p: float | None) -> None:
    """Refuse a top-k under 1 or a top-p outside (0, 1], naming the value."""
    if top_k is not None and top_k < 1:
        raise SampleError(f"top_k must be >= 1 (or None for no top-k filtering), got {top_k}.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise SampleError(f"top_p must be in (0, 1] (1 or None: no nucleus filtering), got {top_p}.")


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One id per row of ``logits`` (B, V): (B, 1) long.

    ``temperature`` <= 0: the argmax. Otherwise, on fp32 ``logits / temperature``: ``top_k`` keeps the
    ids whose logit is at least the k-th largest; ``top_p`` then keeps, in order of probability, the
    ids up to and including the first at which the cumulative probability reaches ``top_p`` (always
    at least the most likely); one id is drawn from the renormalised rest.
    """
    check_sampling(top_k, top_p)
    logits = logits.float()
    if not bool(torch.isfinite(logits).all()):
        raise SampleError("the model's logits are not finite (NaN or Inf): its weights diverged. Sample an "
                          "earlier checkpoint (--checkpoint RUN/checkpoints/step_....pt) or retrain from one.")
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        probs, order = torch.sort(F.softmax(logits, dim=-1), dim=-1, descending=True)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely ids
        drop = before >= top_p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)
