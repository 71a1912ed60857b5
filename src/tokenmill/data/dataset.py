"""Opening and checking token files, and the global data stream.

The global stream: sample ``k`` is a pure function of ``(seed, k)``. For optimizer step ``s`` with
micro-batch ``B``, gradient accumulation ``A`` and data-parallel size ``D``, the global batch holds
``G = B*A*D`` samples with indices ``s*G .. s*G+G-1``; micro-step ``m`` of rank ``r`` takes
``s*G + (m*D + r)*B + b`` for ``b`` in ``[0, B)`` (:func:`global_indices`). So a step sees the same
samples whatever the layout of B, A and D, and a resumed run continues with the exact next batch.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from tokenmill.errors import DataError

from .meta import DTYPES, META_NAME, PREPARE_HINT, read_meta
from .shards import ShardedTokens, split_shards

_M64 = (1 << 64) - 1
IGNORE_INDEX = -100  # a target the loss skips (F.cross_entropy's default ignore_index)
STREAM_LENGTH = 2**62  # __len__ of the stream datasets: indices are unbounded in practice
_SCAN_TOKENS = 1 << 22


class TokenFile:
    """One split of a prepared folder: ``tokens`` (read-only, memory-mapped: an ``np.memmap`` for a
    one-file split, a :class:`~tokenmill.data.shards.ShardedTokens` over the shards otherwise; nothing
    is loaded), ``meta``, ``vocab_size``, ``path`` (the folder), ``files`` (its token files), ``file``
    (the one file, or for a sharded split the pattern of its names, for messages), ``split``. Pickles
    without its tokens (reopened on access), so DataLoader workers started with spawn do not copy them."""

    def __init__(self, path: Path, split: str, file: Path, meta: dict[str, Any]):
        self.path, self.split, self.file, self.meta = path, split, file, meta
        self.vocab_size: int = meta["vocab_size"]
        self.dtype = DTYPES[meta["dtype"]]
        self.n_tokens: int = meta["splits"][split]["tokens"]
        self.shards = split_shards(meta["splits"][split])
        self.files = [Path(path) / s["file"] for s in self.shards]
        self._tokens = None
        chat = meta.get("chat")  # a `prepare --format chat` folder: uint8 loss-mask shards beside the tokens
        self.mask_shards = chat["splits"][split]["shards"] if chat else None
        self._masks = None

    @property
    def masks(self):
        """The split's loss-mask bytes (one per token: bit 0 learned, bit 1 a sequence starts; see
        :mod:`tokenmill.data.chat`), memory-mapped like the tokens; None for a folder without masks."""
        if self._masks is None and self.mask_shards is not None:
            files = [Path(self.path) / s["file"] for s in self.mask_shards]
            counts = [s["tokens"] for s in self.mask_shards]
            self._masks = np.empty(0, np.uint8) if self.n_tokens == 0 else (
                np.memmap(files[0], dtype=np.uint8, mode="r", shape=(counts[0],)) if len(files) == 1
                else ShardedTokens(files, counts, np.dtype(np.uint8)))
        return self._masks

    @property
    def tokens(self):
        if self._tokens is None:
            if self.n_tokens == 0:  # np.memmap cannot map an empty file
                self._tokens = np.empty(0, dtype=self.dtype)
            elif len(self.files) == 1:
                self._tokens = np.memmap(self.files[0], dtype=self.dtype, mode="r", shape=(self.n_tokens,))
            else:
                self._tokens = ShardedTokens(self.files, [s["tokens"] for s in self.shards], self.dtype)
        return self._tokens

    def __len__(self) -> int:
        return self.n_tokens

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None, "_masks": None}

    def __repr__(self) -> str:
        return f"TokenFile({str(self.file)!r}, tokens={self.n_tokens}, vocab_size={self.vocab_size})"


def open_token_data(
    path: str | Path, split: str, model_vocab_size: int | None = None, validate: str = "full"
) -> TokenFile:
    """Open and check one split of a prepared folder; every problem is a :class:`DataError`.

    Always: meta.json present, parsable, tokenmill format with the needed keys; dtype uint16/uint32
    and wide enough for the vocabulary; every token file's size == its tokens * itemsize; data vocab
    <= model_vocab_size. ``validate='full'`` also scans the files: sha256 and every id < vocab_size.
    """
    if validate not in ("full", "quick"):
        raise ValueError(f"validate must be 'full' or 'quick', got {validate!r}")
    folder = Path(path)
    meta = read_meta(folder)
    meta_path = folder / META_NAME
    if split not in meta["splits"]:
        raise DataError(
            f"'{meta_path}' has no '{split}' split (splits: {sorted(meta['splits'])}). Fix: prepare the "
            f"folder again ({PREPARE_HINT})."
        )
    entry = meta["splits"][split]
    n = entry["tokens"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise DataError(
            f"'{meta_path}': splits.{split}.tokens must be an integer >= 0, got {n!r}. Fix: {PREPARE_HINT}."
        )
    shards = split_shards(entry)
    for shard in shards:
        if not (folder / shard["file"]).is_file():
            raise DataError(
                f"'{folder / shard['file']}' ({split} split named in '{meta_path}') is missing. Fix: prepare the "
                f"folder again ({PREPARE_HINT})."
            )
    vocab = meta["vocab_size"]
    if model_vocab_size is not None and vocab > model_vocab_size:
        raise DataError(
            f"the data in '{folder}' has vocab_size {vocab} (tokenizer "
            f"{meta['tokenizer'].get('name')!r}) but "
            f"model.vocab_size is {model_vocab_size}: ids up to {vocab - 1} would index past the embedding. "
            f"Fix: raise model.vocab_size to >= {vocab} (e.g. --model.vocab_size {vocab}) or leave it unset "
            "to take it from the data."
        )
    file = folder / shards[0]["file"] if len(shards) == 1 else folder / f"{split}-*.bin"
    tf = TokenFile(folder, split, file, meta)
    for shard, f in zip(shards, tf.files):
        _check_size(f, shard["tokens"], meta["dtype"])
    for shard in tf.mask_shards or []:  # loss masks: one byte per token
        _check_mask(folder / shard["file"], shard["tokens"], shard.get("sha256"), validate == "full")
    if validate == "full":
        for shard, f in zip(shards, tf.files):
            _scan(f, shard["tokens"], tf.dtype, vocab, shard.get("sha256"))
    return tf


def _check_mask(file: Path, n: int, sha: str | None, full: bool) -> None:
    fix = f"Fix: prepare the folder again ({PREPARE_HINT})."
    if not file.is_file() or file.stat().st_size != n:
        size = file.stat().st_size if file.is_file() else None
        raise DataError(f"loss-mask file '{file}' is {'missing' if size is None else f'{size} bytes'}, but meta.json "
                        f"says {n} bytes (one per token). {fix}")
    if full and sha is not None:
        h = hashlib.sha256()
        with open(file, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
        if h.hexdigest() != sha:
            raise DataError(f"loss-mask file '{file}': sha256 checksum mismatch; it changed after preparation. {fix}")


def _check_size(file: Path, n: int, name: str) -> None:
    size, item = file.stat().st_size, DTYPES[name].itemsize
    fix = f"Fix: prepare the folder again ({PREPARE_HINT})."
    if size % item:
        raise DataError(
            f"'{file}' is {size} bytes, not a multiple of {item} ({name} tokens): the file is truncated "
            f"or was written with another dtype. {fix}"
        )
    if size == n * item:
        return
    other = "uint32" if name == "uint16" else "uint16"
    if n and size == n * DTYPES[other].itemsize:
        raise DataError(
            f"'{file}' is {size} bytes = {n} tokens of {other}, but meta.json says dtype {name} "
            f"({n * item} bytes): the file was written with the wrong dtype. {fix}"
        )
    what = "truncated" if size < n * item else "longer than described"
    raise DataError(
        f"'{file}' is {what}: {size} bytes ({size // item} {name} tokens), but meta.json says "
        f"{n} tokens ({n * item} bytes). {fix}"
    )


def _scan(file: Path, n: int, dtype: np.dtype, vocab: int, expected_sha: str | None) -> None:
    """One pass over one token file: sha256 and the first id >= vocab_size."""
    h = hashlib.sha256()
    bad = None
    arr = np.memmap(file, dtype=dtype, mode="r", shape=(n,)) if n else np.empty(0, dtype)
    for i in range(0, len(arr), _SCAN_TOKENS):
        chunk = np.ascontiguousarray(arr[i : i + _SCAN_TOKENS])
        h.update(chunk.data)
        if bad is None and int(chunk.max()) >= vocab:
            j = int(np.argmax(chunk >= vocab))
            bad = (i + j, int(chunk[j]))
    digest = h.hexdigest()
    if bad is not None:
        also = " (its sha256 no longer matches meta.json either)" if digest != expected_sha else ""
        raise DataError(
            f"'{file}': token id {bad[1]} at position {bad[0]:,} is >= vocab_size {vocab}{also}: the file "
            f"is corrupted or was made with another tokenizer. Fix: prepare the folder again "
            f"({PREPARE_HINT})."
        )
    if digest != expected_sha:
        raise DataError(
            f"'{file}': sha256 checksum mismatch (file {digest[:16]}..., meta.json "
            f"{str(expected_sha)[:16]}...): "
            "the file changed after preparation or is corrupted. Fix: prepare the folder again, or pass "
            "--data.validate quick to skip the scan."
        )


# ----------------------------------------------------------------------------------------------
# The global stream


def global_indices(
    step: int, micro_step: int, rank: int, batch_size: int, grad_accum: int, dp_size: int
) -> range:
    """Global sample indices of micro-step ``micro_step`` of optimizer step ``step`` on DP rank ``rank``."""
    if not (0 <= micro_step < grad_accum and 0 <= rank < dp_size and step >= 0):
        raise ValueError(
            f"need step >= 0, 0 <= micro_step < grad_accum ({grad_accum}), 0 <= rank < dp_size ({dp_size}); "
            f"got step={step}, micro_step={micro_step}, rank={rank}"
        )
    g = batch_size * grad_accum * dp_size
    start = step * g + (micro_step * dp_size + rank) * batch_size
    return range(start, start + batch_size)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def sample_key(seed: int, k: int) -> int:
    """A 64-bit hash of (seed, k): the per-sample random state (same on every platform and process)."""
    return _splitmix64(_splitmix64(seed & _M64) ^ (k & _M64))


_CLOCK = time.thread_time if time.get_clock_info("thread_time").resolution <= 1e-6 else time.perf_counter


def burn_cpu(ms: float, salt: int = 0) -> int:
    """Spend ``ms`` milliseconds of this thread's CPU time in pure-Python arithmetic (holds the GIL)."""
    end = _CLOCK() + ms / 1000.0
    x = salt & 0x7FFFFFFF
    while _CLOCK() < end:
        for _ in range(100):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
    return x


_NP_IDS = {torch.int64: np.int64, torch.int32: np.int32, torch.uint16: np.uint16}


def id_dtype(vocab_size: int, narrow: bool) -> torch.dtype:
    """The dtype token ids travel in from the data loader to the device (``data.narrow_ids``):
    int64 when not narrow; else uint16 when every id fits (vocab_size <= 65536), else int32. Narrow
    ids are widened to int64 on the device (:func:`tokenmill.data.loader.to_device`)."""
    if not narrow:
        return torch.int64
    return torch.uint16 if vocab_size <= 2**16 else torch.int32


def _index(k) -> int:
    k = int(k)
    if k < 0:
        raise IndexError(f"sample index must be >= 0, got {k}")
    return k


class WindowDataset(Dataset):
    """Training windows of a token file. ``ds[k] = (x, y)``: int64 tensors of ``block_size`` tokens,
    ``y`` = ``x`` shifted by one.

    sampling='random': window start drawn from a hash of (seed, k), uniform over all
    ``len - block_size`` starts. 'sequential': non-overlapping window ``k mod n_windows`` (seed unused).
    ``cpu_work_ms`` > 0 burns that much CPU per sample (GIL held; the tokens are unchanged).
    ``ids``: the tensors' dtype (int64, or a narrow type from :func:`id_dtype`; same values).
    ``loss_mask``: targets whose token is not learned (the folder's loss mask, ``prepare --format chat``) are
    ``IGNORE_INDEX`` (-100), which the loss skips; ``y`` is then int64, or int32 with narrow ids.
    """

    def __init__(
        self,
        token_file: TokenFile,
        block_size: int,
        sampling: str = "random",
        seed: int = 0,
        cpu_work_ms: float = 0.0,
        ids: torch.dtype = torch.int64,
        loss_mask: bool = False,
    ):
        if sampling not in ("random", "sequential"):
            raise ValueError(f"sampling must be 'random' or 'sequential', got {sampling!r}")
        n = len(token_file)
        if n < block_size + 1:
            raise DataError(
                f"'{token_file.file}' ({token_file.split} split) has {n} tokens, but block_size {block_size} "
                f"needs at least {block_size + 1} (one window plus the shifted target). Fix: lower "
                "model.block_size, "
                "or prepare more text (for a short val split: a larger --val-fraction)."
            )
        self.token_file, self.block_size, self.sampling = token_file, block_size, sampling
        self.seed, self.cpu_work_ms = seed, cpu_work_ms
        self.vocab_size = token_file.vocab_size
        self.ids = ids
        if loss_mask and token_file.mask_shards is None:
            raise DataError(f"'{token_file.path}' has no loss mask (it was not prepared with --format chat). Fix: "
                            "prepare chat data with `tokenmill prepare FILES --format chat --tokenizer-from HFDIR`.")
        self.loss_mask = loss_mask
        self.n_starts = n - block_size  # random starts 0 .. n-block_size-1
        self.n_windows = (n - 1) // block_size  # non-overlapping sequential windows

    def __len__(self) -> int:
        return STREAM_LENGTH

    def start(self, k: int) -> int:
        """Token offset of sample ``k``'s window."""
        if self.sampling == "random":
            return sample_key(self.seed, k) % self.n_starts
        return (k % self.n_windows) * self.block_size

    def window(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of the window starting at token ``start``."""
        buf = torch.from_numpy(self.token_file.tokens[start : start + self.block_size + 1].astype(_NP_IDS[self.ids]))
        if not self.loss_mask:
            return buf[:-1], buf[1:]
        learned = np.asarray(self.token_file.masks[start + 1 : start + self.block_size + 1]) & 1
        y = buf[1:].to(torch.int64 if self.ids == torch.int64 else torch.int32, copy=True)  # x shares buf
        y[torch.from_numpy(learned == 0)] = IGNORE_INDEX
        return buf[:-1], y

    def __getitem__(self, k) -> tuple[torch.Tensor, torch.Tensor]:
        k = _index(k)
        if self.cpu_work_ms > 0:
            burn_cpu(self.cpu_work_ms, k)
        return self.window(self.start(k))


class SyntheticDataset(Dataset):
    """Uniformly random ids in ``[0, vocab_size)``; ``ds[k]`` a pure function of (seed, k).
    ``ids``: the tensors' dtype (int64, or a narrow type from :func:`id_dtype`; same values)."""

    def __init__(self, vocab_size: int, block_size: int, seed: int = 0, cpu_work_ms: float = 0.0,
                 ids: torch.dtype = torch.int64):
        if vocab_size < 1 or block_size < 1:
            raise ValueError(f"need vocab_size >= 1 and block_size >= 1, got {vocab_size}, {block_size}")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.seed, self.cpu_work_ms = seed, cpu_work_ms
        self.ids = ids

    def __len__(self) -> int:
        return STREAM_LENGTH

    def __getitem__(self, k) -> tuple[torch.Tensor, torch.Tensor]:
        k = _index(k)
        if self.cpu_work_ms > 0:
            burn_cpu(self.cpu_work_ms, k)
        rng = np.random.Generator(np.random.PCG64(sample_key(self.seed, k)))
        ids = rng.integers(0, self.vocab_size, size=self.block_size + 1, dtype=np.int64)
        buf = torch.from_numpy(ids if self.ids == torch.int64 else ids.astype(_NP_IDS[self.ids]))
        return buf[:-1], buf[1:]
