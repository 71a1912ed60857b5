"""Token shards: writing a split in fixed-size shard files, and reading them back as one array.

A split of ``N`` tokens with shard size ``S`` is ``ceil(N / S)`` files; every shard but the last
holds exactly ``S`` tokens, so token ``t`` of the split is token ``t % S`` of shard ``t // S`` (a
mixture of several folders can find any token from meta.json alone). A split that fits in one shard
is one file named ``train.bin`` / ``val.bin`` (as in version-1 folders), else ``train-00000.bin``,
``train-00001.bin``, ... meta.json lists the files with their token counts and sha256 digests.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

SHARD_TOKENS = 1 << 27  # 134M tokens: 256 MiB of uint16, 512 MiB of uint32
_READ_TOKENS = 1 << 22


def shard_name(split: str, k: int) -> str:
    return f"{split}-{k:05d}.bin"


def is_output_name(name: str) -> bool:
    """Whether ``name`` is a token file a preparation writes (train.bin, val-00003.bin, ...; also the loss-mask
    files of chat data: train.mask.bin, train.mask-00001.bin, ...)."""
    return re.fullmatch(r"(train|val)(\.mask)?(-\d{5})?\.bin", name) is not None


class SplitWriter:
    """Appends token ids to the shards of one split in ``folder``, hashing each shard as it is written.

    ``state()`` / ``restore(state)`` save and restore the position (a resumed prepare truncates the
    files back to it), ``truncate(n)`` drops every token from ``n`` on, ``finish()`` closes the split and
    returns its meta.json entry."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int = SHARD_TOKENS):
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
        self.folder, self.split, self.dtype, self.S = Path(folder), split, np.dtype(dtype), shard_tokens
        self.tokens = self.documents = 0
        self.last_doc: int | None = None  # where the last complete document started
        self.done: dict[int, str] = {}  # complete shard -> sha256
        self._f = self._h = self._k = None

    def _path(self, k: int) -> Path:
        return self.folder / shard_name(self.split, k)

    def write(self, ids: np.ndarray) -> None:
        buf = memoryview(np.ascontiguousarray(ids, dtype=self.dtype)).cast("B")
        item = self.dtype.itemsize
        while len(buf):
            k, off = divmod(self.tokens, self.S)
            if self._k != k:
                self._open(k, rehash=False)
            n = min(len(buf) // item, self.S - off)
            part = buf[: n * item]
            self._f.write(part)
            self._h.update(part)
            self.tokens += n
            buf = buf[n * item :]
            if self.tokens % self.S == 0:
                self._seal()

    def end_document(self, start: int) -> None:
        """A document that started at token ``start`` ended here."""
        self.documents += 1
        self.last_doc = start

    def _open(self, k: int, rehash: bool) -> None:
        self._close()
        self._k, self._h = k, hashlib.sha256()
        path = self._path(k)
        if rehash and path.exists():
            with open(path, "rb") as f:
                while block := f.read(1 << 24):
                    self._h.update(block)
        self._f = open(path, "ab")

    def _seal(self) -> None:
        self.done[self._k] = self._h.hexdigest()
        self._close()

    def _close(self) -> None:
        if self._f is not None:
            self._f.close()
        self._f = self._h = self._k = None

    def sync(self) -> None:
        """Make what was written durable (before the journal records it)."""
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())

    def state(self) -> dict:
        return {"tokens": self.tokens, "documents": self.documents, "last_doc": self.last_doc,
                "done": {str(k): v for k, v in self.done.items()}}

    def restore(self, state: dict) -> None:
        """Continue from ``state`` (see :meth:`state`); ValueError when the files are shorter than it says."""
        n = int(state["tokens"])
        full, rem = divmod(n, self.S)
        item = self.dtype.itemsize
        for k in range(full + (1 if rem else 0)):
            need = self.S * item if k < full else rem * item
            if not self._path(k).is_file() or self._path(k).stat().st_size < need:
                raise ValueError(f"{self._path(k).name} is shorter than the journal says")
        self.done = {int(k): v for k, v in state["done"].items() if int(k) < full}
        if len(self.done) != full:
            raise ValueError(f"{self.split}: the journal lacks shard digests")
        self.documents, self.last_doc = int(state["documents"]), state["last_doc"]
        self.truncate(n)

    def truncate(self, n: int) -> None:
        """Drop every token from ``n`` on (whole shards deleted, the last one cut)."""
        self._close()
        full, rem = divmod(n, self.S)
        for p in self.folder.glob(f"{self.split}-*.bin"):
            k = int(p.stem.rsplit("-", 1)[1])
            if k > full or (k == full and rem == 0):
                p.unlink()
            elif k == full:
                os.truncate(p, rem * self.dtype.itemsize)
        self.done = {k: v for k, v in self.done.items() if k < full}
        self.tokens = n
        if rem:
            self._open(full, rehash=True)

    def read(self, a: int, b: int) -> Iterator[np.ndarray]:
        """Tokens ``[a, b)`` of the split, in bounded blocks."""
        self.sync()
        while a < b:
            k, off = divmod(a, self.S)
            n = min(b - a, self.S - off, _READ_TOKENS)
            yield np.fromfile(self._path(k), dtype=self.dtype, count=n, offset=off * self.dtype.itemsize)
            a += n

    def finish(self) -> dict:
        """Close the split; its meta.json entry (a single shard is renamed to ``{split}.bin``)."""
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._seal()
        count = -(-self.tokens // self.S)
        shards = [{"file": shard_name(self.split, k), "tokens": min(self.S, self.tokens - k * self.S),
                   "sha256": self.done[k]} for k in range(count)]
        if count <= 1:
            single = self.folder / f"{self.split}.bin"
            if count == 0:
                single.write_bytes(b"")
                shards = [{"file": single.name, "tokens": 0, "sha256": hashlib.sha256(b"").hexdigest()}]
            else:
                os.replace(self._path(0), single)
                shards[0]["file"] = single.name
        return {"tokens": self.tokens, "documents": self.documents, "shard_tokens": self.S, "shards": shards}


def split_shards(entry: dict) -> list[dict]:
    """The token files of a meta.json split entry: its ``shards`` (version 2), or the one ``file``."""
    if "shards" in entry:
        return entry["shards"]
    return [{"file": entry["file"], "tokens": entry["tokens"], "sha256": entry.get("sha256")}]


class ShardedTokens:
    """Several token files read as one 1-D array (memory-mapped, each opened on first use): ``len``,
    ``dtype``, ``shape``, ``t[i]``, ``t[a:b]`` (an ndarray; a view when it lies in one shard)."""

    ndim = 1

    def __init__(self, files: list[Path], counts: list[int], dtype: np.dtype):
        self.files, self.counts, self.dtype = list(files), list(counts), np.dtype(dtype)
        self.starts = [0]
        for c in counts:
            self.starts.append(self.starts[-1] + c)
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def _map(self, k: int) -> np.ndarray:
        if k not in self._maps:
            self._maps[k] = np.memmap(self.files[k], dtype=self.dtype, mode="r", shape=(self.counts[k],))
        return self._maps[k]

    def __getitem__(self, idx):
        n = len(self)
        if isinstance(idx, slice):
            a, b, step = idx.indices(n)
            if step != 1:
                return np.asarray(self)[idx]
            parts = []
            while a < b:
                k = bisect.bisect_right(self.starts, a) - 1
                take = min(b, self.starts[k + 1]) - a
                parts.append(self._map(k)[a - self.starts[k] : a - self.starts[k] + take])
                a += take
            return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.empty(0, self.dtype)
        i = int(idx) + (n if int(idx) < 0 else 0)
        if not 0 <= i < n:
            raise IndexError(f"index {idx} out of range for {n} tokens")
        k = bisect.bisect_right(self.starts, i) - 1
        return self._map(k)[i - self.starts[k]]

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate([self._map(k) for k in range(len(self.files))]) if self.files else np.empty(0, self.dtype)
        return out if dtype is None else out.astype(dtype)

    def astype(self, dtype) -> np.ndarray:
        return np.asarray(self).astype(dtype)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}}
