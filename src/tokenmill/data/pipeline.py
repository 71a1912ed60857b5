"""Tokenizing pieces in parallel, in order, with bounded memory.

The main process cuts the input into pieces (:mod:`tokenmill.data.readers`) and hands them to a pool
of tokenizer processes, at most ``2 x workers + 2`` pieces in flight; results are taken back in piece
order, so the output is the same for any number of workers. Each tokenizer process reads its piece
(a byte range or row groups of a file; the bytes themselves for a compressed stream), parses the
documents, decides each document's split by a hash of (seed, its key) and encodes a piece's
documents with one batch call of the tokenizer.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import multiprocessing as mp
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from tokenmill import signals
from tokenmill.errors import DataError

from .chunking import CHUNK_BYTES, cut_text
from .readers import Piece, piece_documents


@dataclass(frozen=True)
class EncodeSettings:
    """What a tokenizer process needs besides the tokenizer and the input list."""

    text_field: str
    seed: int
    val_fraction: float
    dtype: str
    sep: tuple[int, ...]  # the ids that end every document
    vocab_size: int


def is_val(seed: int, key: str, val_fraction: float) -> bool:
    """Whether the document with ``key`` goes to the validation split (a stable hash, any machine)."""
    if val_fraction <= 0:
        return False
    u = int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little") / 2**64
    return u < val_fraction


@dataclass
class Encoded:
    """A tokenized piece: per split ``(ids, documents ended, start of the last one within ids)``, the bad
    records ``(record, reason)``, empty records skipped, and the characters of text read."""

    splits: dict
    bad: list
    empty: int
    text_chars: int


_W: dict = {}
STOP_WAIT_S = 3.0  # how long an interrupted prepare waits for its pool to end before killing the workers


def init_worker(inputs, tok, settings: EncodeSettings) -> None:
    if mp.parent_process() is not None:  # a tokenizer process: Ctrl-C and SIGTERM are its parent's to act on
        signals.quiet_worker()
    _W.update(inputs=inputs, tok=tok, settings=settings)


def _encode_texts(tok, texts: list[str], dtype) -> list[np.ndarray]:
    """Each text's ids, long texts cut into bounded parts when the tokenizer allows it."""
    if not texts:
        return []
    parts, owner = [], []
    chunkable = getattr(tok, "chunkable", True)
    for i, t in enumerate(texts):
        for p in cut_text(t, CHUNK_BYTES) if chunkable and len(t) > CHUNK_BYTES // 4 else [t]:
            parts.append(p)
            owner.append(i)
    batch = getattr(tok, "encode_batch", None)
    arrays = batch(parts, dtype) if batch is not None else [tok.encode_array(p, dtype) for p in parts]
    if len(parts) == len(texts):
        return arrays
    out: list[list[np.ndarray]] = [[] for _ in texts]
    for i, a in zip(owner, arrays):
        out[i].append(a)
    return [np.concatenate(a) if len(a) > 1 else a[0] for a in out]


def encode_piece(piece: Piece) -> Encoded:
    """Tokenize one piece (in a tokenizer process, or in the main process with one worker)."""
    inp, tok, st = _W["inputs"][piece.file], _W["tok"], _W["settings"]
    texts, numbers, bad = piece_documents(inp, piece, st.text_field)
    text_doc = inp.kind == "text"
    keep = [i for i, t in enumerate(texts) if t or text_doc]
    empty = len(texts) - len(keep)
    texts, numbers = [texts[i] for i in keep], [numbers[i] for i in keep]
    dtype = np.dtype(st.dtype)
    arrays = _encode_texts(tok, texts, np.uint32)  # checked against the vocabulary, then narrowed
    sep = np.asarray(st.sep, dtype=np.uint32)
    parts: dict = {"train": [], "val": []}
    ended = {"train": 0, "val": 0}
    last = {"train": None, "val": None}
    sizes = {"train": 0, "val": 0}
    for n, ids in zip(numbers, arrays):
        split = "val" if is_val(st.seed, inp.key if text_doc else f"{inp.key}#{n}", st.val_fraction) else "train"
        if len(ids) and int(ids.max()) >= st.vocab_size:
            raise DataError(_id_error(tok, int(ids.max()), st.vocab_size))
        ends = not text_doc or piece.end is None
        if ends:
            last[split] = sizes[split] if not text_doc else None
            ended[split] += 1
        parts[split] += [ids, sep] if ends else [ids]
        sizes[split] += len(ids) + (len(sep) if ends else 0)
    splits = {s: (np.concatenate(parts[s]).astype(dtype) if parts[s] else np.empty(0, dtype), ended[s], last[s])
              for s in parts}
    return Encoded(splits, bad, empty, sum(len(t) for t in texts))


def _id_error(tok, top: int, vocab: int) -> str:
    return (
        f"tokenizer {getattr(tok, 'name', type(tok).__name__)!r} produced id {top}, but its vocabulary has {vocab} "
        "ids: the ids would not fit the token files. Fix: use a tokenizer whose vocab_size covers every id "
        "it produces (for a tokenizer.json: its added tokens included)."
    )


@contextlib.contextmanager
def pool(workers: int, inputs, tok, settings: EncodeSettings) -> Iterator[mp.pool.Pool]:
    """A process pool holding the tokenizer (fork where available: no re-import, no pickling)."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    # HF tokenizers warns (and disables its threads) in forked children once it has used threads; the
    # workers are the parallelism, so switch its threads off in them explicitly.
    had = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    p = None
    try:
        with signals.deferred():  # built whole (a signal raises after): only the built pool ends its workers
            p = mp.get_context(method).Pool(workers, initializer=init_worker, initargs=(inputs, tok, settings))
    except BaseException:
        if p is not None:
            stop_pool(p)
        raise
    finally:
        if had is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = had
    try:
        yield p
    except BaseException:  # Ctrl-C, SIGTERM or an error: end the workers now, never wait on them unbounded
        stop_pool(p)
        raise
    p.close()
    p.join()


def stop_pool(p: mp.pool.Pool, wait_s: float = STOP_WAIT_S) -> None:
    """Terminate ``p`` within about ``wait_s`` seconds. ``Pool.terminate`` waits for the task queue's lock,
    which a worker killed while waiting for a task (a SIGTERM sent to the whole process group) holds
    forever: it runs in a thread, and after ``wait_s`` the workers left are killed and abandoned to it."""
    t = threading.Thread(target=p.terminate, name="tokenmill-pool-stop", daemon=True)
    t.start()
    t.join(wait_s)
    if not t.is_alive():
        return
    for w in list(getattr(p, "_pool", ())):  # the pool's worker processes (no public list)
        if w.exitcode is None:
            w.kill()
        w.join(wait_s)


def run(pieces: Iterable[Piece], workers: int, inputs, tok, settings: EncodeSettings,
        on_result: Callable[[Piece, Encoded], None]) -> None:
    """Tokenize ``pieces`` with ``workers`` processes (1: in this process) and call ``on_result`` for
    each, in order."""
    if workers <= 1:
        init_worker(inputs, tok, settings)
        for piece in pieces:
            on_result(piece, encode_piece(piece))
        return
    window = 2 * workers + 2
    with pool(workers, inputs, tok, settings) as p:
        pending: collections.deque = collections.deque()
        for piece in pieces:
            pending.append((dataclasses.replace(piece, data=None), p.apply_async(encode_piece, (piece,))))
            while len(pending) >= window:
                done, res = pending.popleft()
                on_result(done, res.get())
        while pending:
            done, res = pending.popleft()
            on_result(done, res.get())
