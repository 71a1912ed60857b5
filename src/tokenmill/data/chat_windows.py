"""Windows of a chat folder (``data.loss_mask`` on a ``prepare --format chat`` folder), by ``data.chat_packing``.

A chat split is a run of stored sequences (conversations, or pieces of one), each marked by the start bit of the
loss mask (:mod:`tokenmill.data.chat`). A window holds ``W = block_size + 1`` tokens (the inputs and, shifted by
one, the targets) and always begins at a sequence's start:

- ``'pad'``: one sequence per window, then padding;
- ``'pack'``: as many whole sequences as fit, in file order (next fit: a sequence that does not fit starts the
  next window), then padding. So every window is one contiguous range of the split, and the input id of each
  sequence's first token carries :data:`~tokenmill.config.data.SEQUENCE_START_FLAG`, which the model strips to
  keep attention within each sequence and restart its positions (``GPT.keep_documents_apart(start_flag=...)``).

A sequence longer than ``W`` is cut to it (alone in its window). Padding inputs are id 0 with targets -100 (as
every target the mask does not learn, and, packed, every target that is the next sequence's first token), so
they add nothing to the loss; packed, the padding is a sequence of its own. Item ``j`` is a window; sample ``k``
is item ``hash(seed, k) mod n`` ('random', with replacement, as the text windows) or ``k mod n``
('sequential'): a pure function of ``(seed, k)``, so resume and every layout read the same stream.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from tokenmill.config.data import SEQUENCE_START_FLAG
from tokenmill.errors import DataError

from .chat import LEARN_BIT, START_BIT
from .dataset import _NP_IDS, IGNORE_INDEX, STREAM_LENGTH, TokenFile, _index, burn_cpu, sample_key

_SCAN = 1 << 24
PACKING = ("pad", "pack")


def sequence_starts(token_file: TokenFile) -> np.ndarray:
    """The token offsets where the split's sequences start (its mask's start bits), int64, read in chunks."""
    masks, n, out = token_file.masks, len(token_file), []
    for a in range(0, n, _SCAN):
        out.append(np.flatnonzero(np.asarray(masks[a : a + _SCAN]) & START_BIT) + a)
    starts = np.concatenate(out) if out else np.empty(0, np.int64)
    if n and (not len(starts) or starts[0] != 0):  # a mask written by prepare starts with a sequence
        starts = np.concatenate([[0], starts])
    return starts.astype(np.int64)


def plan_windows(starts: np.ndarray, n_tokens: int, width: int, packing: str) -> tuple[np.ndarray, np.ndarray]:
    """``(offset, used)`` of each window: its first token and how many of its ``width`` tokens hold data (the rest
    is padding). 'pad': one sequence each; 'pack': consecutive whole sequences while they fit (next fit)."""
    lengths = np.diff(np.append(starts, n_tokens))
    if packing == "pad":
        return starts.copy(), np.minimum(lengths, width)
    offsets, used = [], []
    cur_off, cur = 0, 0
    for off, n in zip(starts.tolist(), lengths.tolist()):
        if cur and cur + n <= width:
            cur += n
            continue
        if cur:
            offsets.append(cur_off)
            used.append(cur)
        cur_off, cur = off, min(n, width)
    if cur:
        offsets.append(cur_off)
        used.append(cur)
    return np.asarray(offsets, np.int64), np.asarray(used, np.int64)


class ChatWindows(Dataset):
    """A chat split's windows (see the module docstring). ``ds[k] = (x, y)`` as :class:`WindowDataset`'s: ``x``
    the inputs (ids of ``ids``' dtype; packed, the sequence starts flagged), ``y`` the targets (-100 where not
    learned or padding). :meth:`window` ``(j)``: item ``j``; :meth:`padding` the padded inputs of samples."""

    def __init__(self, token_file: TokenFile, block_size: int, packing: str = "pad", sampling: str = "random",
                 seed: int = 0, cpu_work_ms: float = 0.0, ids: torch.dtype = torch.int64):
        if packing not in PACKING or sampling not in ("random", "sequential"):
            raise ValueError(f"packing must be one of {PACKING} and sampling 'random' or 'sequential', got "
                             f"{packing!r}, {sampling!r}")
        if ids == torch.uint16:  # a flagged id needs bit 30
            ids = torch.int32
        if token_file.vocab_size > SEQUENCE_START_FLAG:
            raise DataError(f"'{token_file.path}' has {token_file.vocab_size} ids: chat windows flag ids with bit 30, "
                            "so they hold at most 2^30 ids.")
        self.token_file, self.block_size, self.packing, self.sampling = token_file, block_size, packing, sampling
        self.seed, self.cpu_work_ms, self.ids = seed, cpu_work_ms, ids
        self.vocab_size, self.loss_mask = token_file.vocab_size, True
        starts = sequence_starts(token_file)
        self.n_sequences = len(starts)
        if not self.n_sequences:
            raise DataError(f"'{token_file.path}' ({token_file.split} split) holds no conversation. Fix: prepare "
                            "more chat data (for a short val split: a larger --val-fraction).")
        self.offsets, self.used = plan_windows(starts, len(token_file), block_size + 1, packing)
        self.n_cut = int((np.diff(np.append(starts, len(token_file))) > block_size + 1).sum())

    def __len__(self) -> int:
        return STREAM_LENGTH

    @property
    def n_windows(self) -> int:
        return len(self.offsets)

    def item(self, k: int) -> int:
        """The window of sample ``k``."""
        if self.sampling == "random":
            return sample_key(self.seed, k) % self.n_windows
        return k % self.n_windows

    def padding(self, samples: range) -> int:
        """Padded input positions of the windows of ``samples`` (sample indices)."""
        used = self.used[[self.item(k) for k in samples]]
        return int(np.maximum(self.block_size - used, 0).sum())

    def padding_share(self) -> float:
        """The expected share of padding among the input positions (windows drawn uniformly)."""
        return float(np.maximum(self.block_size - self.used, 0).mean() / self.block_size)

    def window(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of window ``j``."""
        T, off, u = self.block_size, int(self.offsets[j]), int(self.used[j])
        tokens = np.asarray(self.token_file.tokens[off : off + u]).astype(np.int64)
        mask = np.asarray(self.token_file.masks[off : off + u])
        x = np.zeros(T, np.int64)
        x[: min(u, T)] = tokens[:T]
        y = np.full(T, IGNORE_INDEX, np.int64)
        learn = ((mask[1:] & LEARN_BIT) != 0) & ((mask[1:] & START_BIT) == 0)  # never across a boundary
        y[: u - 1] = np.where(learn, tokens[1:], IGNORE_INDEX)
        if self.packing == "pack":
            x[: min(u, T)] |= np.where(mask[:T] & START_BIT, SEQUENCE_START_FLAG, 0)
            x[0] |= SEQUENCE_START_FLAG
            if u < T:  # the padding: a sequence of its own
                x[u] = SEQUENCE_START_FLAG
        y_dtype = torch.int64 if self.ids == torch.int64 else torch.int32
        return torch.from_numpy(x.astype(_NP_IDS[self.ids])), torch.from_numpy(y).to(y_dtype)

    def __getitem__(self, k) -> tuple[torch.Tensor, torch.Tensor]:
        k = _index(k)
        if self.cpu_work_ms > 0:
            burn_cpu(self.cpu_work_ms, k)
        return self.window(self.item(k))
