"""A run stopped by Ctrl-C or SIGTERM keeps its last completed step: the policy on top of
:func:`tokenmill.signals.graceful` (the mechanism).

From the end of the run's first step (in this process) the loop runs in graceful mode: the first signal
only records a request. At each step boundary every rank votes (under torchrun: a one-element MAX
all-reduce on a gloo group of its own, started at one boundary and read at the next, so it costs no wait
and no device sync; all ranks read the same result, so all stop after the same step). Then, when the save
fits in :data:`BUDGET_S` seconds from the signal (estimated from the last save's duration, or from the
size of the weights and optimizer state), the step is saved (one line says so, and that a second signal
skips it), the last line names the run directory and the command that resumes it, and the usual
``Interrupted`` / ``Terminated`` ends the command with 130 / 143. A step that does not end within the
budget is abandoned the usual way (no save; the newest checkpoint stays the one to resume).
"""

from __future__ import annotations

import signal
import sys

import torch

from tokenmill import checkpoint, signals
from tokenmill.train.resume import resume_hint

# a scheduler's SIGTERM usually comes 30 s before its SIGKILL (Kubernetes' default grace period, Slurm's
# KillWait, torchrun's agent passing SIGTERM on to its workers): the step and the save must fit before it
BUDGET_S = 25.0
WRITE_BYTES_PER_S = 250e6  # a save's estimate before the run has timed one: a slow disk or network file system
SAVE_OVERHEAD_S = 1.0


class SignalStop:
    """The stop of one :meth:`Trainer.fit`: :meth:`boundary` after every step, :meth:`close` in the loop's
    ``finally``."""

    def __init__(self, trainer) -> None:
        self.t, self.world = trainer, trainer.world
        self.graceful = None  # the graceful() context, entered after the first step
        self.told = False  # the run's last lines were printed
        self.group = self.work = self.flag = None
        if self.world.distributed:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo")  # a collective: every rank builds it here

    def boundary(self, done: int) -> None:
        """The end of step ``done``: from the first one on, a signal waits for a boundary; when every rank
        agrees one came, save (if it fits), say how to resume, raise."""
        if self.graceful is None:
            self.graceful = signals.graceful(BUDGET_S)
            self.graceful.__enter__()
        signum = self._vote(final=done >= self.t.cfg.train.max_steps)
        if signum:
            self._stop(done, signals.take(signum))

    def _vote(self, final: bool) -> int:
        """The signal any rank holds (0: none), as every rank reads it: the vote started at the previous
        boundary (and, at the last step, one more now, waited for)."""
        local = signals.requested() or 0
        if not self.world.distributed:
            return local
        import torch.distributed as dist

        agreed = 0
        if self.work is not None:
            self.work.wait()
            agreed, self.work = int(self.flag.item()), None
        if not agreed:
            self.flag = torch.tensor([float(local)])
            self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            if final:
                self.work.wait()
                agreed, self.work = int(self.flag.item()), None
        return agreed

    def _max(self, value: float) -> float:
        if not self.world.distributed:
            return value
        import torch.distributed as dist

        x = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return float(x.item())

    def _stop(self, done: int, signum: int) -> None:
        t, rank0 = self.t, self.world.is_rank0
        t.progress.close()
        if t.saved_step != done:
            estimate = t.save_s if t.save_s is not None else save_bytes(t.model) / WRITE_BYTES_PER_S + SAVE_OVERHEAD_S
            need = self._max(signals.waited() + estimate)  # every rank decides alike
            if need <= BUDGET_S:
                again = "Ctrl-C" if signum == signal.SIGINT else "signal"
                say(f"tokenmill: saving step {done} before exiting (a second {again} skips it)", rank0)
                t._check_losses(done)  # never save a model whose losses were not checked
                with signals.cleanup_on_force_exit(lambda: checkpoint.clean_stale_tmp(t.run_dir) if rank0 else None):
                    t._save(done)
                    checkpoint.background.wait()
            else:
                say(f"tokenmill: not saving step {done}: it would end about {need:.0f} s after the signal, past the "
                    f"{BUDGET_S:.0f} s a scheduler's SIGTERM usually leaves", rank0)
        self._last_line()
        raise signals.exception(signum)

    def close(self) -> None:
        """In the loop's ``finally``: leave graceful mode (a signal still pending raises now) and the vote.
        A signal's exception (one before the first step ended, a step that did not end within the budget),
        or any other after a signal, leaves with the run's last line, unless :meth:`_stop` printed it."""
        exc = sys.exc_info()[1]
        graceful, self.graceful = self.graceful, None
        if self.work is not None and exc is None:
            self.work.wait()  # every rank started it: it completes
        self.work = None
        try:
            if graceful is not None:
                graceful.__exit__(*sys.exc_info())
        except KeyboardInterrupt:
            self._last_line()
            raise
        if exc is not None and (isinstance(exc, KeyboardInterrupt) or signals.received()):
            self._last_line()

    def _last_line(self) -> None:
        if not self.told:
            self.told = True
            self.t.progress.close()
            say(f"tokenmill: {resume_hint(self.t.run_dir, self.world.size)}", self.world.is_rank0)


def save_bytes(model: torch.nn.Module) -> int:
    """About what a save writes for this rank: its weights, and AdamW's two fp32 moments for each."""
    total = 0
    for p in model.parameters():
        local = getattr(p, "_local_tensor", p)  # a DTensor's shard
        total += local.numel() * (local.element_size() + 8)
    return total


def say(line: str, rank0: bool) -> None:
    if rank0:
        print(line, file=sys.stderr, flush=True)


__all__ = ["BUDGET_S", "SignalStop", "save_bytes"]
