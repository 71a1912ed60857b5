"""The on-disk format of a prepared token folder, and small file helpers.

A prepared folder holds each split's tokens (flat little-endian token-id arrays, cut into shards
of ``shard_tokens`` tokens: see :mod:`tokenmill.data.shards`) and a ``meta.json`` describing them::

    {"format": "tokenmill-tokens", "version": 2,
     "tokenizer": {"name": "bpe", "vocab_size": 4096, "eot_id": 0},
     "vocab_size": 4096, "dtype": "uint16",
     "splits": {"train": {"tokens": 123, "documents": 4, "shard_tokens": 134217728,
                          "shards": [{"file": "train.bin", "tokens": 123, "sha256": "..."}]},
                "val": {...}},
     "source": "a description of the input", "prepare": {...}}

Version 1 (still read) described a split as one file: ``{"file": "train.bin", "tokens": 123,
"sha256": "..."}``. ``meta.json`` is written last, so a folder without it is incomplete.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.errors import DataError

FORMAT = "tokenmill-tokens"
VERSION = 2
META_NAME = "meta.json"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
PREPARE_HINT = "run `tokenmill prepare INPUT --out DIR` and point data.path at DIR"


def dtype_for_vocab(vocab_size: int) -> str:
    """'uint16' when every id fits in 16 bits (vocab_size <= 65536), else 'uint32'."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def sha256_file(path: Path, chunk_bytes: int = 1 << 24) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def read_meta(folder: str | Path) -> dict[str, Any]:
    """Read and check ``folder/meta.json``; raise :class:`DataError` naming the problem and the fix."""
    folder = Path(folder)
    if not folder.exists():
        raise DataError(f"data folder '{folder}' does not exist. Fix: {PREPARE_HINT}.")
    if not folder.is_dir():
        raise DataError(
            f"data path '{folder}' is a file, not a prepared token folder. Fix: {PREPARE_HINT} "
            f"(e.g. `tokenmill prepare {folder} --out DIR`)."
        )
    meta_path = folder / META_NAME
    if not meta_path.is_file():
        raise DataError(
            f"'{meta_path}' is missing: '{folder}' is not a prepared token folder, or its preparation "
            f"was interrupted (meta.json is written last). Fix: {PREPARE_HINT}."
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(
            f"'{meta_path}' is not valid JSON ({e}). Fix: prepare the folder again ({PREPARE_HINT})."
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise DataError(
            f"'{meta_path}' is not a tokenmill token folder description (format is {found!r}, expected "
            f"{FORMAT!r}). Fix: {PREPARE_HINT}."
        )
    version = meta.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise DataError(
            f"'{meta_path}' has format version {version!r}; this tokenmill reads version <= {VERSION}. "
            f"Fix: upgrade tokenmill or prepare the folder again with this version."
        )
    missing = [k for k in ("vocab_size", "dtype", "splits", "tokenizer") if k not in meta]
    if missing:
        raise DataError(
            f"'{meta_path}' lacks the key(s) {missing}. Fix: prepare the folder again ({PREPARE_HINT})."
        )
    vocab = meta["vocab_size"]
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise DataError(
            f"'{meta_path}': vocab_size must be a positive integer, got {vocab!r}. Fix: {PREPARE_HINT}."
        )
    dtype = meta["dtype"]
    if dtype not in DTYPES:
        raise DataError(
            f"'{meta_path}': dtype {dtype!r} is not supported; token files are 'uint16' or 'uint32'. "
            f"Fix: {PREPARE_HINT}."
        )
    if dtype == "uint16" and vocab > 2**16:
        raise DataError(
            f"'{meta_path}': dtype uint16 cannot hold vocab_size {vocab} (ids up to {vocab - 1}); it must be "
            f"'uint32'. Fix: prepare the folder again ({PREPARE_HINT})."
        )
    if not isinstance(meta["splits"], dict):
        raise DataError(f"'{meta_path}': 'splits' must be an object. Fix: {PREPARE_HINT}.")
    for name, entry in meta["splits"].items():
        _check_split(meta_path, name, entry)
    return meta


def _check_split(meta_path: Path, name: str, entry: Any) -> None:
    """A split entry: one file (version 1) or a list of shards (version 2), each a file in the folder."""
    if isinstance(entry, dict) and "shards" in entry:
        shards = entry["shards"]
        if not isinstance(shards, list) or not shards or "tokens" not in entry:
            raise DataError(
                f"'{meta_path}': split '{name}' must have 'tokens' and a non-empty 'shards' list. Fix: prepare "
                f"the folder again ({PREPARE_HINT})."
            )
        for shard in shards:
            _check_file_entry(meta_path, name, shard)
        counts = [s["tokens"] for s in shards]
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts) or (
                sum(counts) != entry["tokens"]):
            raise DataError(
                f"'{meta_path}': the shards of split '{name}' hold {counts[:4]}... tokens, which do not add up to its "
                f"{entry['tokens']!r} tokens. Fix: prepare the folder again ({PREPARE_HINT})."
            )
        return
    _check_file_entry(meta_path, name, entry)


def _check_file_entry(meta_path: Path, name: str, entry: Any) -> None:
    need = [k for k in ("file", "tokens", "sha256") if not isinstance(entry, dict) or k not in entry]
    if need:
        raise DataError(
            f"'{meta_path}': split '{name}' lacks {need}. Fix: prepare the folder again ({PREPARE_HINT})."
        )
    file = entry["file"]
    if not isinstance(file, str) or not file or Path(file).name != file or file in (".", ".."):
        raise DataError(  # a token file lives in the folder itself: never read a path elsewhere
            f"'{meta_path}': split '{name}' names the file {file!r}; it must be a file name inside the "
            f"folder (e.g. '{name}.bin'). Fix: prepare the folder again ({PREPARE_HINT})."
        )
