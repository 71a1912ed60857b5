"""A model of PyTorch's CUDA caching allocator: from a sequence of allocations and frees, the peak
*allocated* and the peak *reserved* memory.

What it reproduces (c10/cuda/CUDACachingAllocator.cpp, default settings): requests are rounded up to
512 bytes; requests up to 1 MiB come from the small pool (2 MiB segments), larger ones from the large
pool (20 MiB segments for requests under 10 MiB, else a segment of the request rounded up to 2 MiB);
a request takes the smallest cached free block of its pool that fits (best fit), which is split when
the rest is at least 512 bytes (small pool) or over 1 MiB (large pool), otherwise handed out whole
(the allocated figure counts the whole block, as PyTorch's does); freed blocks merge with free
neighbours of the same segment. When a new segment would pass ``capacity``, the cached free segments
are released first (as PyTorch does before reporting out of memory).

With ``expandable_segments`` each pool is one segment whose mapped size grows and shrinks in 2 MiB
pages at its end, so memory freed at the end is given back and the reserved figure follows the
highest block in use rather than every segment ever needed.

``max_split_size`` (``memory.max_split_size_mb``): blocks of that size or more are never split; a
request under it never takes such a block, a request over it takes one only when no more than 20 MiB
would be wasted. ``gc_threshold`` (``memory.gc_threshold``): before a new segment would take the
reserved memory past that fraction of ``capacity``, the cached free segments are released.

Streams: every block belongs to the stream it was allocated on, and a free block serves only requests made
on that stream (``BlockPool``'s ordering compares the stream first; ``get_free_block`` looks up a key with
the request's stream), so memory one stream frees stays reserved for that stream. ``malloc(..., stream=s)``
(0: the default stream; FSDP's buffers and gradient shards come from its own streams, :mod:`.fsdp`). With
expandable segments each stream's pools have their own segment. Releasing cached segments frees every
stream's. Not modelled: the order in which PyTorch's garbage collection picks blocks (it frees the oldest
unused first; here, all).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

MiB = 1 << 20
SMALL = 1 * MiB  # largest request served by the small pool
SMALL_SEGMENT = 2 * MiB
LARGE_SEGMENT = 20 * MiB
MIN_LARGE_ALLOC = 10 * MiB  # requests from here get a segment of their own size
ROUND_LARGE = 2 * MiB
PAGE = 2 * MiB  # expandable segments map memory in pages of this size
LARGE_BUFFER = 20 * MiB  # max_split_size: most waste accepted when an oversize block is reused


def round_size(n: int) -> int:
    """A request's block size: at least 512 bytes, a multiple of 512."""
    return 512 if n < 512 else (n + 511) // 512 * 512


def segment_size(n: int) -> int:
    """The segment cudaMalloc'ed for a block of ``n`` bytes that no cached block can serve."""
    if n <= SMALL:
        return SMALL_SEGMENT
    if n < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return (n + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


@dataclass
class _Block:
    seg: int
    addr: int  # offset in the segment
    size: int
    free: bool = True
    prev: Optional[_Block] = None
    next: Optional[_Block] = None


class CachingAllocator:
    """Feed it ``malloc(key, nbytes)`` / ``free(key)``; read ``peak_allocated`` and ``peak_reserved``."""

    def __init__(self, expandable_segments: bool = False, capacity: Optional[int] = None,
                 max_split_size: Optional[int] = None, gc_threshold: Optional[float] = None):
        self.expandable = expandable_segments
        self.capacity = capacity
        self.max_split = max_split_size or None
        self.gc_limit = int(gc_threshold * capacity) if (gc_threshold and capacity) else None
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.out_of_memory = False
        self._blocks: dict[object, _Block] = {}
        # a pool is (small?, stream): its free blocks as (size, seg, addr)
        self._free: dict[tuple[bool, int], list[tuple[int, int, int]]] = {}
        self._by_key: dict[tuple[int, int], _Block] = {}  # (seg, addr) -> free block
        self._segments: dict[int, tuple[tuple[bool, int], int]] = {}  # seg -> (pool, size)
        self._head: dict[int, _Block] = {}
        self._next_seg = 0
        self._expand: dict[tuple[bool, int], int] = {}  # pool -> its expandable segment

    # public ---------------------------------------------------------------------------------
    def malloc(self, key: object, nbytes: int, stream: int = 0) -> int:
        """Returns the size of the block handed out (what the allocated figure counts); ``stream``: the
        CUDA stream it is allocated on (its own pools)."""
        size = round_size(nbytes)
        pool = (size <= SMALL, stream)
        block = self._best_fit(pool, size)
        if block is None:
            block = self._grow(pool, size)
        self._take(block, size, pool)
        self._blocks[key] = block
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block.size

    def free(self, key: object) -> None:
        block = self._blocks.pop(key)
        self.allocated -= block.size
        block.free = True
        pool = self._segments[block.seg][0]
        for other in (block.next, block.prev):  # merge with free neighbours
            if other is not None and other.free:
                self._unlist(other, pool)
                if other is block.next:
                    block.size += other.size
                    block.next = other.next
                    if other.next:
                        other.next.prev = block
                else:
                    other.size += block.size
                    other.next = block.next
                    if block.next:
                        block.next.prev = other
                    block = other
        self._list(block, pool)
        if self.expandable and block.next is None:
            self._shrink(block, pool)

    # internals ------------------------------------------------------------------------------
    def _list(self, b: _Block, pool: tuple[bool, int]) -> None:
        bisect.insort(self._free.setdefault(pool, []), (b.size, b.seg, b.addr))
        self._by_key[(b.seg, b.addr)] = b

    def _unlist(self, b: _Block, pool: tuple[bool, int]) -> None:
        lst = self._free[pool]
        i = bisect.bisect_left(lst, (b.size, b.seg, b.addr))
        del lst[i]
        del self._by_key[(b.seg, b.addr)]

    def _best_fit(self, pool: tuple[bool, int], size: int) -> Optional[_Block]:
        small = pool[0]
        lst = self._free.get(pool, [])
        i = bisect.bisect_left(lst, (size, -1, -1))
        if i == len(lst):
            return None
        found = lst[i][0]
        if self.max_split and not small:
            if size < self.max_split and found >= self.max_split:
                return None  # oversize blocks are kept for oversize requests
            if size >= self.max_split and found >= size + LARGE_BUFFER:
                return None
        b = self._by_key[(lst[i][1], lst[i][2])]
        self._unlist(b, pool)
        return b

    def _take(self, b: _Block, size: int, pool: tuple[bool, int]) -> None:
        small = pool[0]
        rest = b.size - size
        if self.max_split and not small and size >= self.max_split:
            rest = 0  # an oversize request keeps its whole block
        if rest >= (512 if small else SMALL + 1):  # split: the remainder stays cached
            tail = _Block(b.seg, b.addr + size, rest, True, b, b.next)
            if b.next:
                b.next.prev = tail
            b.next = tail
            b.size = size
            self._list(tail, pool)
        b.free = False

    def _new_segment(self, pool: tuple[bool, int], size: int) -> _Block:
        if self.gc_limit is not None and self.reserved + size > self.gc_limit:
            self._release_cached()
        if self.capacity is not None and self.reserved + size > self.capacity:
            self._release_cached()
            if self.reserved + size > self.capacity:
                self.out_of_memory = True
        seg = self._next_seg
        self._next_seg += 1
        self._segments[seg] = (pool, size)
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        b = _Block(seg, 0, size)
        self._head[seg] = b
        return b

    def _grow(self, pool: tuple[bool, int], size: int) -> _Block:
        if not self.expandable:
            return self._new_segment(pool, segment_size(size))
        seg = self._expand.get(pool)
        if seg is None:
            b = self._new_segment(pool, _pages(size))
            self._expand[pool] = b.seg
            return b
        # extend the pool's one segment at its end (joining a free last block)
        last = self._head[seg]
        while last.next is not None:
            last = last.next
        need = size - (last.size if last.free else 0)
        grow = _pages(need)
        if self.capacity is not None and self.reserved + grow > self.capacity:
            self.out_of_memory = True
        self.reserved += grow
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self._segments[seg] = (pool, self._segments[seg][1] + grow)
        if last.free:
            self._unlist(last, pool)
            last.size += grow
            return last
        b = _Block(seg, last.addr + last.size, grow, True, last, None)
        last.next = b
        return b

    def _shrink(self, last: _Block, pool: tuple[bool, int]) -> None:
        """Expandable segments: unmap the whole pages of a free block at the segment's end."""
        pages = last.size // PAGE * PAGE
        if pages == 0:
            return
        self._unlist(last, pool)
        last.size -= pages
        self.reserved -= pages
        self._segments[last.seg] = (pool, self._segments[last.seg][1] - pages)
        if last.size:
            self._list(last, pool)
        elif last.prev is not None:
            last.prev.next = None
        else:  # the whole segment is free: it is gone
            del self._head[last.seg]
            del self._segments[last.seg]
            self._expand.pop(pool, None)

    def _release_cached(self) -> None:
        """Give back every segment that is entirely free (before reporting out of memory)."""
        for seg, (pool, size) in list(self._segments.items()):
            head = self._head[seg]
            if head.free and head.next is None and head.size == size:
                self._unlist(head, pool)
                del self._segments[seg]
                del self._head[seg]
                self.reserved -= size
                if self._expand.get(pool) == seg:
                    del self._expand[pool]


def _pages(n: int) -> int:
    return max(PAGE, (n + PAGE - 1) // PAGE * PAGE)
