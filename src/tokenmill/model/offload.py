"""Activation offloading (``memory.offload_activations``): the tensors autograd saves for backward leave the
GPU during the forward and come back for backward, the copies running beside the compute.

What moves: every saved tensor on the device except the model's own parameters and buffers (and views of them),
which stay on the GPU anyway; copying them would only add traffic and a second device copy in backward (a
checkpointed or compiled region saves its weights). :func:`keeps` is that choice, read by the estimator too.

How it moves, on CUDA: each saved tensor is copied to pinned host memory on a side stream that first waits for
the compute stream, so the copy runs while the next layers compute; the device tensor is held until its copy has
read it, then let go. At most ``IN_FLIGHT`` copies run at once: saving one more waits (the host thread) for the
oldest, so the device memory offloading saves is saved even when the host link is slower than the compute (the
forward then runs at the link's pace). When the forward ends, the tensors whose copy is still running stay on the device for
backward, which asks for the last ones first (bringing them back would only make it wait). In backward, asking
for a tensor starts bringing back the ones saved just before it (backward asks for them next), up to as many
bytes as the one asked for, on the same side stream; the compute stream waits for its own copy only. Where there
is no CUDA stream (another accelerator, or CPU tensors in the tests) the copies are synchronous ``.to()`` calls.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # one side stream per device, kept for the process
IN_FLIGHT = 2  # copies to the host in flight at most: the forward runs at most this many saved tensors ahead


def storages(model: nn.Module) -> frozenset:
    """The storages of ``model``'s parameters and buffers (what :func:`keeps` keeps on the device)."""
    return frozenset(r for r in map(_storage, [*model.parameters(), *model.buffers()]) if r is not None)


def _storage(t: torch.Tensor) -> Optional[StorageWeakRef]:
    if type(t) not in (torch.Tensor, nn.Parameter):
        return None  # a tensor subclass (an NF4 or FP8 weight, a DTensor): its storage is not its data
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def keeps(t: torch.Tensor, kept: frozenset) -> bool:
    """Whether a saved tensor stays on the device: a parameter, a buffer or a view of one, or a tensor subclass
    (quantized and sharded weights, DTensor activations), which has no plain storage to copy."""
    ref = _storage(t)
    return ref is None or ref in kept


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that move what ``model``'s forward saves off ``device`` (module doc). The host copies
    live as long as the autograd graph holds them (a second backward over a retained graph reads them again)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.kept = storages(model)
        self.stream = None
        if device.type == "cuda":
            self.stream = _STREAMS.get(device) or _STREAMS.setdefault(device, torch.cuda.Stream(device))
        self.saved: list[tuple[torch.Tensor, torch.device, int]] = []  # host copy, its device, its bytes
        self.pending: list[tuple[int, torch.Tensor, torch.cuda.Event]] = []  # device tensors still being copied
        self.resident: dict[int, torch.Tensor] = {}  # not down when the forward ended: backward reads these
        self.stayed = 0  # how many stayed on the device when the forward ended
        self.back: dict[int, tuple[torch.Tensor, Optional[torch.cuda.Event]]] = {}  # on their way back
        self.lowest = None  # the lowest index brought back so far: prefetching goes down from there
        self.moved = 0  # bytes copied to the host
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> ActivationOffload:
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        """The forward has ended: a tensor whose copy is still running stays on the device (backward needs the
        last ones first; bringing them back would only make it wait)."""
        super().__exit__(*exc)
        self._landed()
        for i, t, _ in self.pending:
            t.record_stream(self.stream)  # its copy still reads it: its block waits for that once backward frees it
            self.resident[i] = t
        self.stayed = len(self.pending)
        self.pending.clear()

    def _landed(self) -> None:
        while self.pending and (len(self.pending) > IN_FLIGHT or self.pending[0][2].query()):  # in order: one stream
            self.pending[0][2].synchronize()  # at once when it has landed
            self.pending.pop(0)  # its copy is on the host: the device block can go

    def _pack(self, t: torch.Tensor):
        if t.device.type == "meta" or (t.device.type == "cpu" and self.stream is not None) or keeps(t, self.kept):
            return t
        size = t.numel() * t.element_size()
        self.moved += size
        if self.stream is None:
            self.saved.append((t.to("cpu", copy=True), t.device, size))
            return len(self.saved) - 1
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.saved.append((host, t.device, size))
        self.pending.append((len(self.saved) - 1, t, done))  # held until its copy has read it
        self._landed()
        return len(self.saved) - 1

    def _unpack(self, index):
        if isinstance(index, torch.Tensor):
            return index
        if index in self.resident:  # read once; a second read (a retained graph) comes from the host copy
            self._prefetch(index, 1)  # the next one at least
            return self.resident.pop(index)
        out, done = self.back.pop(index, None) or self._fetch(index)
        self._prefetch(index, self.saved[index][2])
        if done is not None:  # the compute stream waits for this copy only, not for the prefetches
            stream = torch.cuda.current_stream(out.device)
            stream.wait_event(done)
            out.record_stream(stream)
        return out

    def _fetch(self, index: int) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
        host, device, _ = self.saved[index]
        self.lowest = index if self.lowest is None else min(self.lowest, index)
        if self.stream is None:
            return host.to(device), None
        with torch.cuda.stream(self.stream):
            out = host.to(device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    def _prefetch(self, index: int, budget: int) -> None:
        """Start bringing back the tensors saved just before ``index`` (backward asks for them next) while
        fewer than ``budget`` bytes (``index``'s own) are on their way."""
        ahead = sum(self.saved[i][2] for i in self.back)
        i = min(index, self.lowest if self.lowest is not None else index) - 1
        while i >= 0 and ahead < budget:
            if i not in self.resident:
                self.back[i] = self._fetch(i)
                ahead += self.saved[i][2]
            i -= 1
