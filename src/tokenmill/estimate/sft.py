"""What a chat fine-tune's tokens/s is worth: the shares of padding and of learned targets in its windows.

A config whose ``data.path`` is a chat folder learned through its loss mask trains on
:class:`~tokenmill.data.chat_windows.ChatWindows` (``data.chat_packing``): a padded position costs what a real one
costs, so the step time (and tokens/s) is that of full windows, and what the run learns from is its learned
targets only. From the folder's train split: the expected padding share of a window (exact: the windows are
planned as the trainer plans them) and the learned share (the split's learned targets spread over its windows;
exact unless conversations longer than the window are cut), hence learned tokens/s = tokens/s x learned share.

Packed windows (``data.chat_packing='pack'``, :func:`packs_chat`) keep their conversations apart as
``data.document_mask`` keeps documents apart, positions restarting: the estimator counts the same mask
(:func:`tokenmill.estimate.techniques.docmask_bytes`: FlexAttention's block mask, or the explicit (B, 1, T, T)
mask and its slower kernel where that path is used); padded windows need none.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional

from tokenmill import config as C
from tokenmill.data.chat_windows import ChatWindows
from tokenmill.data.dataset import open_token_data
from tokenmill.data.meta import read_meta
from tokenmill.errors import TokenmillError


@functools.lru_cache(maxsize=16)
def _chat_folder(path: str) -> bool:
    """Whether ``path`` holds a prepared chat folder (its meta.json has a ``chat`` entry); False when unreadable."""
    try:
        return isinstance(read_meta(Path(path)).get("chat"), dict)
    except (TokenmillError, OSError):
        return False


def packs_chat(cfg: C.Config) -> bool:
    """Whether ``cfg`` trains on packed chat windows (as ``train/parallelize.packs_chat`` decides): a chat folder
    learned through its mask with ``data.chat_packing='pack'``."""
    d = cfg.data
    if d.chat_packing != "pack" or d.loss_mask is False or d.mixture or d.source != "tokens" or d.path is None:
        return False
    return _chat_folder(str(d.path))


def chat_shares(cfg: C.Config) -> Optional[dict[str, Any]]:
    """``{"packing", "padding_share", "learned_share"}`` of the config's chat windows; None for other data."""
    d = cfg.data
    if d.path is None or d.mixture or d.source != "tokens" or d.loss_mask is False:
        return None
    meta = read_meta(Path(d.path))
    if not isinstance(meta.get("chat"), dict):
        return None
    tf = open_token_data(d.path, "train", None, "quick")
    T = cfg.model.block_size
    ds = ChatWindows(tf, T, d.chat_packing)
    learned = meta["chat"]["splits"]["train"].get("learned", 0)
    kept = int(ds.used.sum()) / max(len(tf), 1)  # the share of the split the windows hold (long ones are cut)
    return {"packing": d.chat_packing, "padding_share": ds.padding_share(),
            "learned_share": learned * kept / ds.n_windows / T}


WINDOWS_READ = 512  # packed windows whose documents are read, evenly spread over the split


def packed_tile_share(cfg: C.Config) -> float:
    """Share of the causal attention tiles FlexAttention computes on the config's packed chat windows
    (:func:`tokenmill.estimate.attention.flex_tile_share` over up to ``WINDOWS_READ`` of them, planned as the
    trainer plans them); 1.0 for other data (its documents are not read)."""
    if not packs_chat(cfg):
        return 1.0
    return _tile_share(str(cfg.data.path), cfg.model.block_size)


@functools.lru_cache(maxsize=16)
def _tile_share(path: str, block_size: int) -> float:
    import numpy as np

    from tokenmill.data.chat_windows import plan_windows, sequence_starts
    from tokenmill.estimate.attention import flex_tile_share

    tf = open_token_data(path, "train", None, "quick")
    starts = sequence_starts(tf)
    offsets, used = plan_windows(starts, len(tf), block_size + 1, "pack")
    picks = np.unique(np.linspace(0, len(offsets) - 1, min(WINDOWS_READ, len(offsets))).astype(np.int64))
    windows = []
    for j in picks.tolist():
        off, u = int(offsets[j]), min(int(used[j]), block_size)
        inside = starts[(starts >= off) & (starts < off + u)] - off  # the window's sequence starts (the inputs)
        windows.append(np.diff(np.append(inside, u)).tolist())
    return flex_tile_share(windows, block_size)


def add_learned_rate(est: Any, cfg: C.Config) -> None:
    """``est.chat`` (:func:`chat_shares`, with ``learned_tokens_per_sec``) for a chat fine-tune; else unchanged."""
    shares = chat_shares(cfg)
    if shares is not None:
        est.chat = {**shares, "learned_tokens_per_sec": est.tokens_per_sec * shares["learned_share"]}


def format_chat(est: Any) -> list[str]:
    """The report's lines for a chat fine-tune (none otherwise)."""
    c = getattr(est, "chat", None)
    if not c:
        return []
    return [f"  chat windows ({c['packing']}): {100 * c['padding_share']:.0f}% padding, {100 * c['learned_share']:.0f}% "
            f"learned targets -> {c['learned_tokens_per_sec']:,.0f} learned tokens/s"
            + (" (data.chat_packing pack: less padding)" if c["packing"] == "pad" and c["padding_share"] > 0.2 else "")]
