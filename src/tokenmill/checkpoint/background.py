"""Asynchronous checkpoints (``checkpoint.async_save``): the write of step k runs while training goes on.

At the save step the state is *staged*: every tensor is copied to host memory (pinned on CUDA, the
device-to-host copies queued on the current stream behind the step that produced the values, and waited
for by the writer, not by training), so the optimizer may update the live tensors at once. A writer
thread then does the same atomic write as a synchronous save (temporary name, fsync, rename) and the
rotation. Sharded (DCP) checkpoints go through ``torch.distributed.checkpoint.async_save`` (its own
staging) on a separate gloo group, so the background collectives never interleave with training's.

At most one save is in flight: the next save, :func:`wait` and :func:`~tokenmill.checkpoint.set_aside`
wait for it first. A background failure is kept and raised (a :class:`CheckpointError` with the path) by
the next of those calls; the files are as after a failed synchronous save (no partial file under a real
name; the previous checkpoint loads). A process that ends with a write in flight finishes it first (the
writer is not a daemon), and a failure nobody collected is printed as a warning at exit.

``PENDING.write`` is the function that writes a staged state to its path (:func:`atomic_torch_save`):
the tests replace it to simulate a slow or failing disk.
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tokenmill.checkpoint.files import atomic_torch_save, first_line
from tokenmill.errors import CheckpointError, TokenmillError


def stage(obj: Any, cache: dict | None = None, key: str = "") -> Any:
    """A copy of ``obj`` (nested dicts/lists/tuples of tensors and plain values) whose tensors live in host
    memory and no longer alias the live ones: pinned buffers for CUDA tensors (reused from ``cache`` across
    saves when the shape and dtype match; the copies are asynchronous, see :meth:`Pending.start`), clones for
    CPU tensors. Other values are shared (they are not mutated in place by training)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device.type != "cuda":
            return t.clone()
        buf = cache.get(key) if cache is not None else None
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            if cache is not None:
                cache[key] = buf
        return buf.copy_(t, non_blocking=True)
    if isinstance(obj, dict):
        return {k: stage(v, cache, f"{key}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(stage(v, cache, f"{key}/{i}") for i, v in enumerate(obj))
    return obj


class Pending:
    """The one save in flight in this process (a writer thread or a DCP future) and its error."""

    def __init__(self) -> None:
        self.write: Callable[[Any, Path], None] = atomic_torch_save
        self.pinned: dict[str, torch.Tensor] = {}  # staging buffers, reused from save to save
        self._thread: threading.Thread | None = None
        self._future = None
        self._path: Path | None = None
        self._error: BaseException | None = None
        self._group = None  # DCP's background process group
        self._stager = None  # DCP's staging to pinned memory (CUDA), reused from save to save

    def busy(self) -> bool:
        return (self._thread is not None and self._thread.is_alive()) or (
            self._future is not None and not self._future.done())

    def start(self, state: dict[str, Any], path: Path, after: Callable[[], None] | None = None) -> None:
        """Stage ``state`` now and write it to ``path`` in the background, then run ``after`` (rotation)."""
        self.wait()
        staged = stage(state, self.pinned)
        event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event()
            event.record()  # the staging copies were queued on the current stream

        def work() -> None:
            if event is not None:
                event.synchronize()
            self.write(staged, path)
            if after is not None:
                after()

        self._run(work, path)

    def start_dcp(self, state: dict[str, Any], tmp: Path, commit: Callable[[], None] | None) -> None:
        """``dcp.async_save`` of ``state`` into folder ``tmp`` (every rank); on the rank that passes
        ``commit``, a thread waits for the save of every rank (the coordinator's future completes once all
        shards and the metadata are written) and then commits (rename, extra.pt, rotation)."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.wait()
        if self._group is None:  # a collective: every rank saves at the same step
            self._group = dist.new_group(backend="gloo")
        if self._stager is None and torch.cuda.is_available():  # kept for the process: its pinned buffers
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(True, False, False, False))  # pinned, synchronous
        future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group, async_stager=self._stager)
        future = getattr(future, "upload_completion", future)  # an AsyncSaveResponse in some versions
        if commit is None:
            self._future, self._path = future, tmp
            return

        def work() -> None:
            future.result()
            commit()

        self._run(work, tmp)

    def _run(self, work: Callable[[], None], path: Path) -> None:
        def target() -> None:
            try:
                work()
            except BaseException as e:  # noqa: BLE001 - kept for the main thread, raised at the next save
                self._error = e

        self._path, self._error = path, None
        self._thread = threading.Thread(target=target, name="tokenmill-checkpoint-writer", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the save in flight; raise its error (:class:`CheckpointError` naming the path)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if self._future is not None:
            future, self._future = self._future, None
            try:
                future.result()
            except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException)
                error = e
        if error is None:
            return
        if isinstance(error, TokenmillError):
            msg = str(error)
        else:
            msg = f"could not write checkpoint {self._path} ({type(error).__name__}: {first_line(error)})"
        raise CheckpointError(f"the background save failed: {msg} The previous checkpoint is intact; "
                              "continue the run with --resume.") from None

    def warn_at_exit(self) -> None:
        try:
            self.wait()
        except CheckpointError as e:
            print(f"tokenmill: warning: {e}", file=sys.stderr, flush=True)


PENDING = Pending()
atexit.register(PENDING.warn_at_exit)


def wait() -> None:
    """Wait for this process's background save, if one is in flight; raise its error."""
    PENDING.wait()
