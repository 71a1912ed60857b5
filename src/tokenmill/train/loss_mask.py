"""The loss over the learned tokens of a step's global batch (``data.loss_mask``: chat data), defined once.

With a loss mask the targets of tokens not learned are -100 (``WindowDataset(loss_mask=True)``), and a step's loss
is the per-token mean over the learned targets of the whole global batch: the sum of their losses over every
micro-batch and data-parallel rank, divided by ``L``, their number. Each micro-batch's loss is its sum
(``reduction='sum'``, the full and the chunked loss alike: a micro-batch without a learned token adds 0 and no
gradient) times ``dp / L``; DDP and FSDP average the gradients over the ``dp`` ranks, which leaves the gradients of
that mean. So every split of the same global batch (micro-batch size, accumulation steps, processes) gives the same
loss and gradients, which a mean per micro-batch averaged over micro-batches would not (micro-batches hold different
numbers of learned tokens).

``L`` is counted from the step's micro-batches, which :class:`StepBatches` takes from the loader together, before the
step's first forward; the count goes to the device and is all-reduced once per step, never read back by the host
(no synchronisation). Without a mask nothing changes: each micro-batch's mean divided by the accumulation steps.

Chat windows (:class:`~tokenmill.data.chat_windows.ChatWindows`, ``data.chat_packing``) also count a step's padded
inputs, on the host from the step's global sample indices (the same on every rank, no communication): the step's
:attr:`StepBatches.learned` is then ``[learned, padding]``, which the metrics log as ``learned_frac`` and
``padding_frac``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import torch

from tokenmill.data.dataset import IGNORE_INDEX
from tokenmill.errors import ConfigError
from tokenmill.parallel.world import World, global_mean


def step_weight(batches: list[tuple[torch.Tensor, torch.Tensor]], world: World) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dp / L, L)`` (device tensors) for this rank's micro-batches ``[(x, y), ...]`` of one step, on the host or
    the device; ``L``: the learned targets of the whole global batch."""
    learned = sum((y != IGNORE_INDEX).sum() for _, y in batches).to(world.device, non_blocking=True)
    if world.distributed:  # tensor-parallel copies hold equal counts: the mean keeps them once
        learned = (global_mean(learned.double(), world) * world.dp_size).round().long()
    return world.dp_size / learned.clamp(min=1).float(), learned


class StepBatches:
    """The trainer's micro-batches and how their loss is reduced. With a loss mask a step's ``n`` micro-batches are
    taken together at its first ``next``, :attr:`weight` / :attr:`learned` are that step's (:func:`step_weight`) and
    :attr:`loss_kw` asks the model for the sum; without one each batch is passed on as it comes, both stay None and
    the model's loss is its default mean. A mask under pipeline parallelism is refused (its schedule averages per
    pipeline micro-batch)."""

    def __init__(self, batches: Iterator, n: int, world: World, masked: bool, loader: Any = None):
        if masked and world.pp > 1:
            raise ConfigError("data.loss_mask is on (the folder holds chat data), but parallel.pp > 1 averages the "
                              "loss per pipeline micro-batch, not over the step's learned tokens. Fix: parallel.pp 1, "
                              "or --data.loss_mask false to learn every token.")
        self.batches, self.n, self.world, self.masked = batches, n, world, masked
        self.loss_kw: dict[str, str] = {"reduction": "sum"} if masked else {}
        self.ahead: list[Any] = []
        self.weight: Optional[torch.Tensor] = None
        self.learned: Optional[torch.Tensor] = None
        sampler, dataset = getattr(loader, "batch_sampler", None), getattr(loader, "dataset", None)
        self.padding_of = dataset.padding if masked and hasattr(dataset, "padding") else None  # chat windows
        self.first, self.global_batch = (sampler.start_sample, sampler.global_batch) if self.padding_of else (0, 0)

    def __iter__(self) -> StepBatches:
        return self

    def __next__(self) -> Any:
        if not self.masked:
            return next(self.batches)
        if not self.ahead:
            self.ahead = [next(self.batches) for _ in range(self.n)]
            self.weight, self.learned = step_weight(self.ahead, self.world)
            if self.padding_of is not None:  # the step's padded inputs, from its global sample indices
                pad = self.padding_of(range(self.first, self.first + self.global_batch))
                self.first += self.global_batch
                self.learned = torch.stack((self.learned, self.learned.new_full((), pad)))
        return self.ahead.pop(0)


def eval_terms(loss: torch.Tensor, y: torch.Tensor, masked: bool) -> torch.Tensor:
    """What one validation batch adds to the running total: ``[mean loss, 0]``, or with a mask ``[summed loss,
    learned targets]`` (the model's ``reduction='sum'``)."""
    count = (y != IGNORE_INDEX).sum().float() if masked else torch.zeros((), device=loss.device)
    return torch.stack([loss.float(), count])


def eval_mean(total: torch.Tensor, n_batches: int, masked: bool, world: World) -> float:
    """The validation loss from the total of :func:`eval_terms` over ``n_batches``: the mean of the batches'
    means over the ranks, or with a mask the mean over every rank's learned targets (0 when there is none)."""
    if not masked:
        return global_mean(total[0] / max(n_batches, 1), world).item()
    loss_sum, learned = global_mean(total, world).tolist()  # both divided by the ranks: their ratio is kept
    return loss_sum / learned if learned > 0 else 0.0

