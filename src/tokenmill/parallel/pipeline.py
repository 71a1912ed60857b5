"""Pipeline parallelism (``parallel.pp``): consecutive blocks on consecutive ranks, fed micro-batches.

:func:`apply_pipeline_split` turns the full GPT (built and initialised identically on every rank, so
the weights equal the single-process run's) into this rank's stage by removing what other stages
hold (the model says how: ``GPT.keep_stage``; blocks outside the stage become ``nn.Identity``, so
parameter names, and checkpoints, are those of the full model). Blocks are divided as evenly as
possible, earlier stages taking one more when they do not divide.

:class:`Pipeline` drives a stage with ``torch.distributed.pipelining``: each ``train.batch_size``
batch is cut into ``parallel.pp_microbatches`` micro-batches that flow through the stages under the
GPipe (all forwards, then all backwards) or 1F1B (one forward, one backward, so at most ``pp``
micro-batches' activations are alive) schedule. The last stage's loss function applies the head and
cross-entropy (:meth:`GPT.head_loss`) to each micro-batch and divides by micro-batches x accumulation
steps, so the accumulated gradients are those of the batch mean, as without a pipeline.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.config import ParallelConfig
from tokenmill.parallel.world import ParallelError, World


def stage_layers(n_layer: int, pp: int) -> list[range]:
    """The block indices of each stage: as even as possible, earlier stages one more."""
    base, extra = divmod(n_layer, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def apply_pipeline_split(model: nn.Module, world: World) -> nn.Module:
    """Keep only this rank's stage of ``model`` (in place; pp == 1: unchanged); what a stage keeps is
    the model's to say (``model.keep_stage``)."""
    if world.pp == 1:
        return model
    stage = world.pp_rank
    model.keep_stage(stage_layers(len(model.blocks), world.pp)[stage], first=stage == 0, last=stage == world.pp - 1)
    return model


class Pipeline:
    """One stage's side of the pipeline schedule. Every rank calls :meth:`train_step` (and
    :meth:`eval_loss`) with the same whole batch; the first stage feeds the token ids in, the last
    stage uses the targets."""

    def __init__(self, model: nn.Module, world: World, cfg: ParallelConfig, grad_accum_steps: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.model, self.world = model, world
        self.n_microbatches = cfg.pp_microbatches or world.pp
        self.loss_scale = self.n_microbatches * grad_accum_steps
        stage = PipelineStage(model, world.pp_rank, world.pp, world.device, group=world.mesh.get_group("pp"))
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[cfg.pp_schedule]
        self.schedule = schedule(stage, self.n_microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _, loss = self.model.head_loss(hidden, targets)
        return loss / self.loss_scale

    def _run(self, run: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Run the schedule on one batch; the batch's mean loss on the last stage, 0 elsewhere."""
        losses: list[torch.Tensor] = []
        first, last = self.world.pp_rank == 0, self.world.is_last_stage
        if first:
            run(x)
        elif last:
            run(target=y, losses=losses)
        else:
            run()
        if not last:
            return torch.zeros((), device=x.device)
        return torch.stack([v.detach().float() for v in losses]).sum() * (self.loss_scale / self.n_microbatches)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch (gradients accumulate into the stage's parameters)."""
        return self._run(self.schedule.step, x, y)

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward only; the batch's mean loss on the last stage, 0 elsewhere."""
        if not hasattr(self.schedule, "eval"):
            raise ParallelError(
                f"evaluation under pipeline parallelism needs PipelineSchedule.eval (torch >= 2.9; this is "
                f"{torch.__version__}): set --train.eval_batches 0."
            )
        return self._run(self.schedule.eval, x, y)
