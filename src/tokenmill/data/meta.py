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
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.errors import DataError
from tokenmill.filecheck import get, read_json, shown
from tokenmill.paths import inside

FORMAT = "tokenmill-tokens"
VERSION = 2
META_NAME = "meta.json"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
PREPARE_HINT = "run `tokenmill prepare INPUT --out DIR` and point data.path at DIR"
_FIX = f" Fix: prepare the folder again ({PREPARE_HINT})."


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
    meta = read_json(meta_path, "", DataError, kind=None, fix=_FIX)
    where = f"'{meta_path}'"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise DataError(
            f"{where} is not a tokenmill token folder description (format is {shown(found)}, expected "
            f"{FORMAT!r}). Fix: {PREPARE_HINT}."
        )
    version = get(meta, "version", int, where, default=None, fix=_FIX)
    if version is None or version > VERSION:
        raise DataError(
            f"{where} has format version {version!r}; this tokenmill reads version <= {VERSION}. "
            f"Fix: upgrade tokenmill or prepare the folder again with this version."
        )
    missing = [k for k in ("vocab_size", "dtype", "splits", "tokenizer") if k not in meta]
    if missing:
        raise DataError(f"{where} lacks the key(s) {missing}. Fix: prepare the folder again ({PREPARE_HINT}).")
    vocab = get(meta, "vocab_size", int, where, lo=1, fix=_FIX)
    dtype = get(meta, "dtype", str, where, fix=_FIX)
    if dtype not in DTYPES:
        raise DataError(
            f"{where}: dtype {shown(dtype)} is not supported; token files are 'uint16' or 'uint32'. Fix: {PREPARE_HINT}."
        )
    if dtype == "uint16" and vocab > 2**16:
        raise DataError(
            f"{where}: dtype uint16 cannot hold vocab_size {vocab} (ids up to {vocab - 1}); it must be "
            f"'uint32'. Fix: prepare the folder again ({PREPARE_HINT})."
        )
    _check_tokenizer(where, get(meta, "tokenizer", dict, where, fix=_FIX), vocab)
    for name, entry in get(meta, "splits", dict, where, fix=_FIX).items():
        _check_split(meta_path, name, entry)
    if "chat" in meta:
        _check_chat(meta_path, meta)
    return meta


def _check_tokenizer(where: str, info: dict, vocab: int) -> None:
    """meta.json's ``tokenizer`` object: a name, its vocabulary size and an end-of-text id inside the data's
    vocabulary (every field optional but typed)."""
    where = f"{where}: tokenizer"
    get(info, "name", str, where, default=None, fix=_FIX)
    get(info, "vocab_size", int, where, lo=1, default=None, fix=_FIX)
    get(info, "eot_id", int, where, lo=0, hi=vocab - 1, default=None, fix=_FIX)


def _check_chat(meta_path: Path, meta: dict) -> None:
    """``chat`` (a ``prepare --format chat`` folder): per split, loss-mask shards (uint8) inside the folder that
    hold as many entries as the split has tokens (see :mod:`tokenmill.data.chat`)."""
    chat, fix = meta["chat"], f"Fix: prepare the folder again ({PREPARE_HINT})."
    if not isinstance(chat, dict) or chat.get("dtype") != "uint8" or not isinstance(chat.get("splits"), dict):
        raise DataError(f"'{meta_path}': 'chat' must describe uint8 loss-mask shards per split. {fix}")
    for name, split in meta["splits"].items():
        entry = chat["splits"].get(name)
        shards = entry.get("shards") if isinstance(entry, dict) else None
        if not isinstance(shards, list) or not shards:
            raise DataError(f"'{meta_path}': chat.splits.{name} lacks its loss-mask 'shards'. {fix}")
        for shard in shards:
            _check_file_entry(meta_path, f"{name} (loss mask)", shard)
        if sum(s["tokens"] for s in shards) != split.get("tokens"):
            raise DataError(f"'{meta_path}': the loss-mask shards of split '{name}' do not cover its tokens. {fix}")


def _check_split(meta_path: Path, name: str, entry: Any) -> None:
    """A split entry: one file (version 1) or a list of shards (version 2), each a file in the folder."""
    where = f"'{meta_path}': splits.{name}"
    if not isinstance(entry, dict):
        raise DataError(f"{where} must be an object, got {shown(entry)}. Fix: prepare the folder again ({PREPARE_HINT}).")
    if "shards" in entry:
        shards = get(entry, "shards", list, where, fix=_FIX)
        total = get(entry, "tokens", int, where, lo=0, fix=_FIX)
        if not shards:
            raise DataError(f"{where}.shards is empty. Fix: prepare the folder again ({PREPARE_HINT}).")
        counts = [_check_file_entry(meta_path, name, shard) for shard in shards]
        if sum(counts) != total:
            raise DataError(
                f"'{meta_path}': the shards of split '{name}' hold {counts[:4]}... tokens, which do not add up to its "
                f"{total} tokens. Fix: prepare the folder again ({PREPARE_HINT})."
            )
        return
    _check_file_entry(meta_path, name, entry)


def _check_file_entry(meta_path: Path, name: str, entry: Any) -> int:
    """A token file entry (``file``, ``tokens``, ``sha256``), its file inside the folder; its token count."""
    need = [k for k in ("file", "tokens", "sha256") if not isinstance(entry, dict) or k not in entry]
    if need:
        raise DataError(
            f"'{meta_path}': split '{name}' lacks {need}. Fix: prepare the folder again ({PREPARE_HINT})."
        )
    inside(meta_path.parent, entry["file"], f"'{meta_path}': split '{name}' (its 'file')", DataError)
    get(entry, "sha256", str, f"'{meta_path}': split '{name}'", nullable=True, fix=_FIX)
    return get(entry, "tokens", int, f"'{meta_path}': split '{name}'", lo=0, fix=_FIX)
