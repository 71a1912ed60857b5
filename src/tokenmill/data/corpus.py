"""The embedded corpus: the ``.py`` sources of the running Python's standard library.

Present on every machine with no download (about 11 MB in ~670 files on CPython 3.11). Prepared
on first use into a cache folder keyed by Python version, file list and tokenizer, then reused.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import uuid
from pathlib import Path

from tokenmill import atomic
from tokenmill.errors import DataError

from .meta import META_NAME
from .stdlib import embedded_corpus_files, stdlib_root  # noqa: F401 (re-exported)


def cache_root(cache_dir: str | None = None) -> Path:
    """``cache_dir``, else $TOKENMILL_CACHE, else ~/.cache/tokenmill."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("TOKENMILL_CACHE"):
        return Path(os.environ["TOKENMILL_CACHE"]).expanduser()
    return Path.home() / ".cache" / "tokenmill"


def corpus_key(tokenizer: str, vocab_size: int, files: list[Path]) -> str:
    """Cache folder name: Python version, a fingerprint of the file list (paths and sizes), tokenizer."""
    root = stdlib_root()
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(root).as_posix()}:{f.stat().st_size}\n".encode())
    v = sys.version_info
    tok = f"bpe{vocab_size}" if tokenizer == "bpe" else tokenizer
    return f"stdlib-py{v.major}.{v.minor}.{v.micro}-{h.hexdigest()[:10]}-{tok}"


def _is_valid(folder: Path) -> bool:
    from .dataset import open_token_data

    if not (folder / META_NAME).is_file():
        return False
    try:
        for split in ("train", "val"):
            open_token_data(folder, split, validate="quick")
    except DataError:
        return False
    return True


def ensure_embedded_corpus(data_cfg, progress: bool = True, max_files: int | None = None) -> Path:
    """The prepared embedded-corpus folder for ``data_cfg`` (tokenizer, bpe_vocab_size, cache_dir).

    Prepared on first use (one line on stderr says so and where); later calls only check and return
    it. Concurrent callers each prepare into a private temporary folder and rename it into place; a
    caller that finds the place taken uses the folder already there.
    """
    tokenizer = data_cfg.tokenizer
    vocab_size = data_cfg.bpe_vocab_size
    files = embedded_corpus_files(max_files)
    root = cache_root(getattr(data_cfg, "cache_dir", None))
    final = root / corpus_key(tokenizer, vocab_size, files)
    if _is_valid(final):
        return final

    root.mkdir(parents=True, exist_ok=True)
    v = sys.version_info
    tok = f"bpe, {vocab_size} ids" if tokenizer == "bpe" else tokenizer
    print(
        f"tokenmill: preparing the embedded corpus (Python {v.major}.{v.minor}.{v.micro} standard library, "
        f"{len(files)} files, tokenizer {tok}) into {final} (first use only)",
        file=sys.stderr,
        flush=True,
    )
    from .prepare import prepare  # the caller is above prepare (prepare lists files from .stdlib)

    tmp = atomic.tmp_name(final)  # a folder, renamed into place whole
    try:
        prepare(None, tmp, tokenizer=tokenizer, vocab_size=vocab_size, progress=progress, max_files=max_files)
        try:
            os.rename(tmp, final)
        except OSError:
            if _is_valid(final):  # another process finished first: use its folder
                return final
            stale = root / f".{final.name}.stale-{uuid.uuid4().hex[:8]}"
            os.rename(final, stale)
            os.rename(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
