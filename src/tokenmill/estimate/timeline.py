"""A timeline of allocations and frees for one rank, and its replay through a memory model.

:class:`Timeline` holds the events (with how many holders each storage has: a block's output is held by
the next block and, when it keeps it for backward, by itself); :meth:`Timeline.replay` feeds them to the
caching-allocator model (:mod:`.allocator`) on CUDA, or counts them as they are on a CPU, and returns the
peaks and the breakdown by category at the allocated peak. :func:`play_forward` / :func:`play_backward`
copy a traced piece's events (:mod:`.trace`) into the timeline, mapping its boundary storages (input,
output, gradients) onto the neighbouring pieces'. :mod:`.step` builds whole training steps from them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch

from tokenmill import config as C
from tokenmill.estimate.allocator import CachingAllocator
from tokenmill.estimate.trace import PieceTrace
from tokenmill.model.nf4 import nf4_bytes

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "logits and loss", "temporaries",
              "communication buffers", "batch")


@dataclass
class Layout:
    """One rank's view of the parallel layout."""

    nproc: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        parts = []
        if self.dp_shard > 1:
            parts.append(f"FSDP x{self.dp_shard}" + (f" (HSDP, {self.dp_replicate} replicas)" if self.dp_replicate > 1 else ""))
        elif self.dp_replicate > 1:
            parts.append(f"DDP x{self.dp_replicate}")
        if self.tp > 1:
            parts.append(f"TP x{self.tp}")
        if self.pp > 1:
            parts.append(f"PP x{self.pp}")
        return ", ".join(parts) or "single process"


@dataclass
class Param:
    name: str
    shape: tuple
    dtype: torch.dtype
    piece: str  # 'embed' | 'block' | 'head'
    block: Optional[int] = None
    trainable: bool = True  # False: frozen (LoRA's base): no gradient, no optimizer state
    nf4: bool = False  # stored as NF4 (QLoRA's frozen base): ``shape`` and ``dtype`` are what it dequantises to

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes as stored: an NF4 weight's codes and scales (``model/nf4.py`` nf4_bytes), else its dtype's."""
        if self.nf4:
            return nf4_bytes(self.numel)
        return self.numel * _size(self.dtype)


def _size(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt).element_size()


@dataclass
class Memory:
    """The replayed step: peaks in bytes, the breakdown at the allocated peak (bytes per category,
    counted as the allocator counts them), and the host memory the switches use."""

    peak_alloc: int
    peak_reserved: int
    breakdown: dict[str, int]
    host: int = 0
    at_peak: str = ""


class Timeline:
    """Allocations ('a', id, bytes, category, stream), frees ('f', id) and markers ('m', text) of one rank
    (``stream``: the CUDA stream allocated on, 0 the default one; FSDP's own: :mod:`.fsdp`)."""

    def __init__(self) -> None:
        self.ev: list[tuple] = []
        self.holders: dict[int, int] = {}
        self._next = 0

    def alloc(self, nbytes: int, category: str, holders: int = 1, stream: int = 0) -> int:
        gid = self._next
        self._next += 1
        self.holders[gid] = holders
        self.ev.append(("a", gid, int(nbytes), category, stream))
        return gid

    def hold(self, gid: int) -> None:
        self.holders[gid] += 1

    def release(self, gid: Optional[int]) -> None:
        """Drop one holder of ``gid``; the storage is freed with the last."""
        if gid is None or gid not in self.holders:
            return
        self.holders[gid] -= 1
        if self.holders[gid] == 0:
            del self.holders[gid]
            self.ev.append(("f", gid))

    def free(self, gid: Optional[int]) -> None:
        if gid is not None and gid in self.holders:
            del self.holders[gid]
            self.ev.append(("f", gid))

    def mark(self, text: str) -> None:
        self.ev.append(("m", text))

    def replay(self, cuda: bool, mem: Optional[C.MemoryConfig] = None, capacity: Optional[int] = None) -> Memory:
        """Peaks and the breakdown at the peak: through the caching-allocator model on CUDA (with the
        allocator settings of ``mem``); on the CPU, storages are counted at their size, nothing cached."""
        mem = mem or C.MemoryConfig()
        alloc = CachingAllocator(mem.expandable_segments, capacity,
                                 mem.max_split_size_mb * 1024 * 1024, mem.gc_threshold) if cuda else None
        live: dict[int, tuple[int, str]] = {}
        by_cat: dict[str, int] = defaultdict(int)
        total = peak = 0
        best: dict[str, int] = {}
        where, mark = "", ""
        malloc, free = (alloc.malloc, alloc.free) if alloc is not None else (None, None)
        for e in self.ev:  # the hot loop of an estimate: kept flat
            kind = e[0]
            if kind == "a":
                _, gid, size, cat, stream = e
                if malloc is not None:
                    size = malloc(gid, size, stream)  # the block the allocator hands out
                live[gid] = (size, cat)
                by_cat[cat] += size
                total += size
                if total > peak:
                    peak, best, where = total, dict(by_cat), mark
            elif kind == "f":
                size, cat = live.pop(e[1])
                by_cat[cat] -= size
                total -= size
                if free is not None:
                    free(e[1])
            else:
                mark = e[1]
        reserved = alloc.peak_reserved if alloc is not None else peak
        return Memory(peak, reserved, {c: best.get(c, 0) for c in CATEGORIES}, at_peak=where)


# ----------------------------------------------------------------------------------------------
# Pieces into the timeline


@dataclass
class _Inst:
    """One use of a piece in the step: its storages' ids in the timeline."""

    trace: PieceTrace
    round: int
    x: Optional[int] = None  # the timeline id of its input
    gy: Optional[int] = None  # ... of its output's gradient
    ids: dict[int, int] = field(default_factory=dict)
    y: Optional[int] = None
    gx: Optional[int] = None
    grads: dict[str, int] = field(default_factory=dict)  # new gradients (round 0)


def _saved(events: list[tuple], exclude: set) -> set[int]:
    """Storages allocated in a forward and still alive at its end."""
    alive: set[int] = set()
    for e in events:
        if e[0] == "a":
            alive.add(e[1])
        elif e[0] == "f":
            alive.discard(e[1])
    return alive - exclude


def _holds_output(trace: PieceTrace, r: int) -> bool:
    rnd = trace.rounds[r]
    return rnd.y is not None and any(e[0] == "f" and e[1] == rnd.y for e in rnd.bwd)


def play_forward(tl: Timeline, inst: _Inst) -> None:
    tr, rnd = inst.trace, inst.trace.rounds[inst.round]
    saved = _saved(rnd.fwd, {rnd.y, rnd.x})
    for e in rnd.fwd:
        if e[0] == "a":
            sid = e[1]
            if sid in (rnd.x,) or sid in tr.harness:
                continue
            if sid == rnd.y:
                if tr.name == "head":  # the logits: the trainer keeps them until the step ends
                    inst.ids[sid] = inst.y = tl.alloc(e[2], "logits and loss")
                else:  # the next piece's input (+1 holder when this piece frees it in its backward)
                    inst.ids[sid] = inst.y = tl.alloc(e[2], "activations", 2 if _holds_output(tr, inst.round) else 1)
                continue
            cat = "logits and loss" if tr.name == "head" else ("activations" if sid in saved else "temporaries")
            inst.ids[sid] = tl.alloc(e[2], cat)
        elif e[0] == "f":
            _free(tl, inst, e[1], backward=False)


def play_backward(tl: Timeline, inst: _Inst, on_grad=None) -> None:
    """``on_grad(name, id)``: called when a new gradient appears (the step-in-backward hooks)."""
    tr, rnd = inst.trace, inst.trace.rounds[inst.round]
    new_grads = {sid: n for n, sid in rnd.grads.items()} if inst.round == 0 else {}
    for e in rnd.bwd:
        if e[0] == "a":
            sid = e[1]
            if sid == rnd.gy or sid in tr.harness:
                continue
            if sid in new_grads:
                gid = inst.ids[sid] = tl.alloc(e[2], "gradients")
                inst.grads[new_grads[sid]] = gid
                if on_grad is not None:
                    on_grad(new_grads[sid], gid)
                continue
            cat = "logits and loss" if tr.name == "head" else "temporaries"
            inst.ids[sid] = tl.alloc(e[2], cat)
        elif e[0] == "f":
            _free(tl, inst, e[1], backward=True)
    if rnd.gx is not None:
        inst.gx = inst.gy if rnd.gx == rnd.gy else inst.ids.get(rnd.gx)


def _free(tl: Timeline, inst: _Inst, sid: int, backward: bool) -> None:
    tr, rnd = inst.trace, inst.trace.rounds[inst.round]
    if sid == rnd.gx or sid in tr.harness:
        return  # the gradient handed on: the previous piece frees it
    if sid == rnd.x:
        tl.release(inst.x)
    elif sid == rnd.gy:
        tl.release(inst.gy)
    elif sid == rnd.y:
        if backward:  # the piece itself kept its output for backward
            tl.release(inst.y)
    elif sid in inst.ids:
        tl.release(inst.ids.pop(sid))
