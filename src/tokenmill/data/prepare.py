"""``tokenmill prepare``: text, JSON Lines, Parquet or Arrow input -> a token folder (sharded token
files, meta.json[, tokenizer.json]).

Every document (a text file, a JSON Lines record, a Parquet/Arrow row) ends with the tokenizer's
end-of-text id (a newline for ``bytes``). Documents go to the validation split when a stable hash of
(seed, the document's key) falls below ``val_fraction`` (key: the file's relative path, plus ``#N``
for record N of a record file), so the split depends neither on the machine nor on the worker count
nor on the other files. When no document falls in one split, the last document of the other moves
there; a single document gives its last ``val_fraction`` of tokens to val.

The input is streamed (:mod:`tokenmill.data.readers`, :mod:`tokenmill.data.pipeline`): memory stays
flat however large the corpus is (about ``workers x 2`` pieces of ~1 MiB of text in flight, plus each
process's tokenizer). The output is written in shards of ``shard_tokens`` tokens
(:mod:`tokenmill.data.shards`) into a build folder that a complete run swaps into place and an
interrupted run resumes (:mod:`tokenmill.data.build`).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from tokenmill import atomic
from tokenmill.errors import DataError

from .bpe import train_bpe
from .build import SPOOL, BuildLock, ContentChain, Journal, build_folder, clear_build, swap_into_place
from .chunking import CHUNK_BYTES
from .meta import DTYPES, FORMAT, META_NAME, VERSION, dtype_for_vocab, sha256_file
from .pipeline import EncodeSettings, is_val, run
from .progress import Progress
from .readers import iter_pieces, piece_documents, report_bad
from .shards import SHARD_TOKENS, SplitWriter
from .sources import collect_inputs, spool
from .tokenizers import TOKENIZER_FILE, BpeTokenizer, get_tokenizer

DEFAULT_GLOB = None  # a folder: every file of a known kind (sources.DEFAULT_PATTERNS)
COMMIT_SECONDS = 5.0  # how often the journal records the position reached
ON_BAD = ("skip", "stop")


def prepare(
    input,
    out_dir: str | Path,
    tokenizer="bpe",
    vocab_size: int = 4096,
    val_fraction: float = 0.1,
    workers: int | None = None,
    seed: int = 0,
    progress: bool = True,
    glob: str | None = DEFAULT_GLOB,
    max_files: int | None = None,
    tokenizer_from: str | None = None,
    text_field: str = "text",
    fmt: str = "auto",
    on_bad_record: str = "skip",
    shard_tokens: int = SHARD_TOKENS,
    tokenizer_sample: int | None = None,
    dtype: str = "auto",
) -> Path:
    """Tokenize ``input`` into the token folder ``out_dir`` and return its path.

    input: a file, a folder, a glob pattern, a list of them (see :mod:`tokenmill.data.sources`), or
      None for the embedded corpus (this Python's standard-library sources).
    tokenizer: 'bpe' (trained here on the training documents to ``vocab_size`` ids, saved as
      tokenizer.json; from at most ``tokenizer_sample`` bytes of them when given), 'bytes', 'gpt2', or
      a tokenizer object (name, vocab_size, eot_id, encode_array[, encode_batch, chunkable]).
    workers: tokenizer processes (None: one per CPU; 1: in this process).
    max_files: use only the first N files. text_field: the JSON field / column holding the text.
    fmt: 'auto' (kind from the file name) or the kind of every file: 'text', 'jsonl', 'parquet', 'arrow'.
    on_bad_record: 'skip' (count, report the first ones, go on) or 'stop' (raise at the first).
    shard_tokens: tokens per output shard. dtype: 'auto' (uint16 when the vocabulary fits), 'uint16', 'uint32'.
    tokenizer_from: where a reused tokenizer came from; recorded in meta.json as ``tokenizer.from``.
    """
    _check_options(val_fraction, on_bad_record, shard_tokens, dtype, tokenizer_sample)
    given = Path(out_dir)
    if given.exists() and not given.is_dir():
        raise DataError(f"--out '{given}' exists and is not a folder. Fix: choose another --out, or move the file "
                        "away.")
    # the folder itself (a link: the folder it points to, the link stays), as an absolute path
    out = given.resolve() if given.is_symlink() else Path(os.path.abspath(given))
    inputs, source = collect_inputs(input, glob, max_files, fmt)
    inputs = [f for f in inputs if f.size > 0 or f.pipe]
    if not inputs:
        raise DataError(f"input {source} holds only empty files: the corpus is empty. Fix: pass files with text.")
    opts = dict(tokenizer=tokenizer, vocab_size=vocab_size, val_fraction=val_fraction, workers=workers, seed=seed,
                progress=progress, tokenizer_from=tokenizer_from, text_field=text_field, on_bad=on_bad_record,
                shard_tokens=shard_tokens, sample=tokenizer_sample, dtype=dtype, source=source, fmt=fmt)
    build = build_folder(out)
    with BuildLock(build):
        try:
            inputs = _spool_pipes(inputs, build, two_passes=tokenizer == "bpe")
            _Build(build, inputs, opts).run()
            swap_into_place(build, out)
        except DataError as e:
            if not getattr(e, "resumable", False):
                shutil.rmtree(build, ignore_errors=True)  # bad input: leave nothing behind
            raise
    return given


def _spool_pipes(inputs, build: Path, two_passes: bool) -> list:
    """Pipe inputs read once, as streams, except where prepare needs them twice (``two_passes``: a BPE trained
    here reads the corpus, then tokenizes it) or out of order (Parquet, Arrow): those are copied into the
    build folder first (one pass over the pipe), and the copy is read."""
    out = []
    for f in inputs:
        if f.pipe and (two_passes or f.kind in ("parquet", "arrow")):
            why = "a BPE is trained on it first" if two_passes else f"{f.kind} is read out of order"
            print(f"tokenmill: note: input '{f.path}' is a pipe and {why}: copying it to {build / SPOOL} (the copy "
                  "is removed at the end)", file=sys.stderr, flush=True)
            f = spool(f, build / SPOOL)
        out.append(f)
    return out


def _check_options(val_fraction, on_bad, shard_tokens, dtype, sample) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}. Fix: e.g. --val-fraction 0.1.")
    if on_bad not in ON_BAD:
        raise DataError(f"--on-bad-record must be one of {list(ON_BAD)}, got {on_bad!r}.")
    if not isinstance(shard_tokens, int) or shard_tokens < 1024:
        raise DataError(f"--shard-tokens must be an integer >= 1024, got {shard_tokens!r}.")
    if dtype not in ("auto", *DTYPES):
        raise DataError(f"--dtype must be 'auto', 'uint16' or 'uint32', got {dtype!r}.")
    if sample is not None and sample < 1:
        raise DataError(f"--tokenizer-sample must be >= 1 byte, got {sample}.")


def _tokenizer_spec(tokenizer, vocab_size: int, sample) -> str:
    """What identifies the tokenizer in the journal (a resumed prepare must use the same one)."""
    if isinstance(tokenizer, str):
        return f"bpe:{vocab_size}:{sample}" if tokenizer == "bpe" else tokenizer
    fp = getattr(tokenizer, "fingerprint", None)
    return fp() if fp is not None else f"{type(tokenizer).__name__}:{tokenizer.name}:{tokenizer.vocab_size}"


class _Build:
    """One preparation into the build folder (fresh or resumed)."""

    def __init__(self, build: Path, inputs, opts: dict):
        self.build, self.inputs, self.o = build, inputs, opts
        self.settings = {
            "tokenizer": _tokenizer_spec(opts["tokenizer"], opts["vocab_size"], opts["sample"]),
            **{k: opts[k] for k in ("val_fraction", "seed", "text_field", "shard_tokens", "dtype", "fmt")},
        }
        self.journal = Journal(build)
        self.content = ContentChain(inputs)  # what each journal line was written against
        self.counts = {"bad": 0, "empty": 0, "first_bad": None, "text_chars": 0}
        self.open_doc = None  # [split, start] of a text document cut into pieces, while it is written

    def run(self) -> None:
        records = self._verified(self.journal.read(self.settings))
        if not records:
            clear_build(self.build)
            self.journal.start(self.settings)
        self.tok = self._tokenizer(records)
        self.dtype = self._dtype()
        eot = self.tok.eot_id
        self.sep = (eot,) if eot is not None else tuple(int(i) for i in self.tok.encode_array("\n", np.int64)) or (10,)
        self.writers = {s: SplitWriter(self.build, s, DTYPES[self.dtype], self.o["shard_tokens"]) for s in ("train", "val")}
        start = self._restore(records + self._trained)
        self._tokenize(start)
        self._finish()

    # -- the tokenizer

    def _tokenizer(self, records: list[dict]):
        tok = self.o["tokenizer"]
        self._trained: list[dict] = []
        if not isinstance(tok, str):
            return tok
        if tok != "bpe":
            return get_tokenizer(tok)
        path = self.build / TOKENIZER_FILE
        done = [r["tokenizer_sha256"] for r in records if "tokenizer_sha256" in r]
        if done and path.is_file() and sha256_file(path) == done[-1]:
            return BpeTokenizer.load(path)  # trained before the interruption
        bar = Progress(sum(f.size for f in self.inputs), self.o["progress"], label="training the BPE")
        try:
            trained = train_bpe(self._training_texts(bar), self.o["vocab_size"], path)
        finally:
            bar.close()
        content = ContentChain(self.inputs).at(len(self.inputs) - 1, None)  # the corpus it was trained on
        self._trained = [{"tokenizer_sha256": sha256_file(path), "content": content}]
        self.journal.append(self._trained[0])
        return trained

    def _training_texts(self, bar: Progress):
        """The training documents' texts in bounded pieces (all of them, or a hashed sample of about
        ``tokenizer_sample`` bytes); every document when none is in the training split (one document)."""
        n = 0
        for text in self._texts(True, bar):
            n += 1
            yield text
        if n == 0:
            yield from self._texts(False, bar)

    def _texts(self, skip_val: bool, bar: Progress):
        """Training texts; with a sample, pieces are kept with probability ``q`` (all of a small corpus) and
        their documents with ``rate / q``, both by hashes, so about ``rate`` of the text is read and kept."""
        seed, frac, sample = self.o["seed"], self.o["val_fraction"], self.o["sample"]
        total = sum(f.size for f in self.inputs)
        rate = 1.0 if not sample or sample >= total else sample / total
        q = 1.0 if total <= 64 * CHUNK_BYTES else min(1.0, 8 * rate)
        taken = 0
        for i, inp in enumerate(self.inputs):
            for piece in iter_pieces(inp, i, [0, 0], CHUNK_BYTES, True, self.o["text_field"]):
                if q < 1 and not is_val(seed + 1, f"{inp.key}@{piece.start[0]}", q):
                    continue  # not in the sample (is_val: a hash below q)
                texts, numbers, _ = piece_documents(inp, piece, self.o["text_field"])
                bar.update(piece.disk, 0, len(texts))
                for text, n in zip(texts, numbers):
                    key = inp.key if inp.kind == "text" else f"{inp.key}#{n}"
                    if skip_val and is_val(seed, key, frac):
                        continue
                    if rate < 1 and not is_val(seed + 2, f"{key}@{piece.start[0]}", rate / q):
                        continue
                    yield text
                    taken += len(text)
                    if sample and taken >= sample:
                        return

    def _dtype(self) -> str:
        vocab, want = self.tok.vocab_size, self.o["dtype"]
        if want == "auto":
            return dtype_for_vocab(vocab)
        if vocab > 2 ** (8 * DTYPES[want].itemsize):
            raise DataError(
                f"--dtype {want} holds ids below {2 ** (8 * DTYPES[want].itemsize):,}, but the tokenizer has "
                f"{vocab:,} ids. Fix: --dtype uint32 (or leave --dtype auto)."
            )
        return want

    # -- tokenizing

    def _verified(self, records: list[dict]) -> list[dict]:
        """The journal lines whose input bytes are unchanged: the commits up to the first whose digest
        (:class:`ContentChain`) disagrees, and the trained tokenizer's line when the whole corpus agrees
        (else nothing: the tokenizer is trained again on the new corpus and everything is made again)."""
        probe, commits = ContentChain(self.inputs), []
        try:
            for r in (r for r in records if "file" in r):
                ok = isinstance(r["file"], int) and 0 <= r["file"] < len(self.inputs)
                if not ok or probe.at(r["file"], r.get("n")) != r.get("content"):
                    self._changed(r["file"] if ok else None)
                    break
                commits.append(r)
            trained = [r for r in records if "tokenizer_sha256" in r][-1:]
            if trained and probe.at(len(self.inputs) - 1, None) != trained[0].get("content"):
                self._changed(None, "the tokenizer trained on them is trained again")
                return []
        finally:
            probe.close()
        return trained + commits

    def _changed(self, i: int | None, what: str = "") -> None:
        pipes = [f for f in self.inputs[: i + 1] if f.pipe] if i is not None else []
        inp = pipes[0] if pipes else self.inputs[i] if i is not None else None
        if pipes:
            why = f"input '{inp.path}' is a pipe, which cannot be read again: it is read from its start"
        else:
            where = f"input '{inp.path}'" if inp is not None else "an input file"
            why = f"{where} changed since the interrupted prepare read it: {what or 'its tokens are made again'}"
        print(f"tokenmill: note: {why}", file=sys.stderr, flush=True)

    def _restore(self, records: list[dict]) -> tuple[int, list]:
        """Where to start: after the last journal line whose input files are unchanged (the shards cut back
        to it). The journal is rewritten to end at that line, so lines of abandoned work never count again."""
        keep = [r for r in records if "tokenizer_sha256" in r]
        commits = [r for r in records if "file" in r]
        for rec in reversed(commits):
            try:
                for s, w in self.writers.items():
                    w.restore(rec["splits"][s])
            except (ValueError, KeyError):
                continue
            self.counts.update(rec["counts"])
            self.open_doc = rec["open_doc"]
            self.done_bytes = rec["bytes"]
            self.journal.start(self.settings, keep + [rec])
            return (rec["file"] + 1, [0, 0]) if rec["pos"] is None else (rec["file"], rec["pos"])
        for w in self.writers.values():
            w.truncate(0)
        self.done_bytes = 0
        self.journal.start(self.settings, keep)
        return 0, [0, 0]

    def _pieces(self, start: tuple[int, list]):
        first, pos = start
        for i in range(first, len(self.inputs)):
            yield from iter_pieces(self.inputs[i], i, pos if i == first else [0, 0], CHUNK_BYTES,
                                   getattr(self.tok, "chunkable", True), self.o["text_field"])

    def _tokenize(self, start: tuple[int, list]) -> None:
        if start[0] > 0 or start[1] != [0, 0]:
            print(f"tokenmill: resuming an interrupted prepare at input file {start[0] + 1} of {len(self.inputs)} "
                  f"({self.inputs[min(start[0], len(self.inputs) - 1)].path})", file=sys.stderr, flush=True)
        total = sum(f.size for f in self.inputs)
        self.bar = Progress(total, self.o["progress"], done=self.done_bytes)
        settings = EncodeSettings(self.o["text_field"], self.o["seed"], self.o["val_fraction"], self.dtype, self.sep,
                                  self.tok.vocab_size)
        workers = self.o["workers"] or os.cpu_count() or 1
        if not any(f.pipe for f in self.inputs):  # a pipe's size is unknown
            workers = max(1, min(workers, (total - self.done_bytes) // CHUNK_BYTES + 1))
        self.last_commit = time.monotonic()
        try:
            run(self._pieces(start), workers, self.inputs, self.tok, settings, self._take)
        finally:
            self.bar.close()
            self.content.close()

    def _take(self, piece, enc) -> None:
        """Write one tokenized piece (in input order), count and report its bad records, commit now and then."""
        inp = self.inputs[piece.file]
        self._report(inp, enc.bad)
        self.counts["empty"] += enc.empty
        self.counts["text_chars"] += enc.text_chars
        tokens = docs = 0
        if inp.kind == "text":
            docs = self._take_text(inp, piece, enc)
        for split, (ids, ended, last) in enc.splits.items():
            w = self.writers[split]
            base = w.tokens
            w.write(ids)
            tokens += len(ids)
            if inp.kind != "text" and ended:
                w.documents += ended - 1
                w.end_document(base + last)
                docs += ended
        self.bar.update(piece.disk, tokens, docs)
        if time.monotonic() - self.last_commit >= COMMIT_SECONDS:
            self._commit(piece)

    def _take_text(self, inp, piece, enc) -> int:
        """A piece of a text document: where it starts, and its end (also after a bad piece)."""
        split = "val" if is_val(self.o["seed"], inp.key, self.o["val_fraction"]) else "train"
        if piece.first and piece.error is None:
            self.open_doc = [split, self.writers[split].tokens]
        if piece.end is None and self.open_doc is not None:
            w = self.writers[self.open_doc[0]]
            if piece.error is not None:
                w.write(np.asarray(self.sep, dtype=DTYPES[self.dtype]))  # the document ends where reading stopped
            w.end_document(self.open_doc[1])
            self.open_doc = None
            return 1
        return 0

    def _report(self, inp, bad: list) -> None:
        for record, reason in bad:
            where = f"'{inp.path}'" if inp.kind == "text" else f"'{inp.path}' record {record}"
            report_bad(f"{where} {reason}" if inp.kind == "text" else f"{where}: {reason}", self.o["on_bad"], self.counts)

    def _commit(self, piece) -> None:
        for w in self.writers.values():
            w.sync()
        inp = self.inputs[piece.file]
        n = None if piece.end is None or inp.kind in ("parquet", "arrow") else piece.raw or piece.end[0]
        self.journal.append({"file": piece.file, "pos": piece.end, "n": n, "content": self.content.at(piece.file, n),
                             "splits": {s: w.state() for s, w in self.writers.items()},
                             "counts": self.counts, "open_doc": self.open_doc, "bytes": self.bar.bytes})
        self.last_commit = time.monotonic()

    # -- the end

    def _finish(self) -> None:
        tr, va = self.writers["train"], self.writers["val"]
        if tr.documents + va.documents == 0:
            first = self.counts["first_bad"]
            why = f"; {self.counts['bad']} bad record(s) skipped, the first: {first}" if first else ""
            raise DataError(f"input {self.o['source']} holds no document to tokenize (the corpus is empty{why}). "
                            "Fix: pass files with text (and --text-field naming the field that holds it).")
        _balance(tr, va, self.o["val_fraction"])
        splits = {s: w.finish() for s, w in self.writers.items()}
        tok = self.tok
        if isinstance(tok, BpeTokenizer):
            if tok.path is None or Path(tok.path).resolve() != (self.build / TOKENIZER_FILE).resolve():
                tok.save(self.build / TOKENIZER_FILE)  # a BPE tokenizer passed in: keep a copy beside the data
        info = {"name": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id}
        if tok.name == "bpe":
            info["file"] = TOKENIZER_FILE
        if self.o["tokenizer_from"] is not None:
            info["from"] = str(self.o["tokenizer_from"])
        prep = {"val_fraction": self.o["val_fraction"], "seed": self.o["seed"],
                "documents": tr.documents + va.documents,
                "inputs": len(self.inputs), "text_field": self.o["text_field"],
                "bad_records": self.counts["bad"], "first_bad_record": self.counts["first_bad"],
                "empty_records": self.counts["empty"], "text_chars": self.counts["text_chars"]}
        meta = {"format": FORMAT, "version": VERSION, "tokenizer": info, "vocab_size": tok.vocab_size,
                "dtype": self.dtype, "splits": splits, "source": self.o["source"], "prepare": prep}
        atomic.write_json(self.build / META_NAME, meta)


def _move(src: SplitWriter, dst: SplitWriter, start: int) -> None:
    """Move tokens ``[start, end)`` of ``src`` to the end of ``dst``."""
    for block in src.read(start, src.tokens):
        dst.write(block)
    src.truncate(start)


def _balance(tr: SplitWriter, va: SplitWriter, val_fraction: float) -> None:
    """At least one document in each split when there are two; one document: its tail is val."""
    if val_fraction <= 0:
        return
    if tr.documents == 0 and va.documents >= 1:  # everything hashed into val: its last document trains
        start = va.last_doc if va.documents >= 2 else 0
        _move(va, tr, start)
        tr.end_document(0)
        va.documents -= 1
        va.last_doc = None
    if va.documents == 0 and tr.documents >= 2:
        _move(tr, va, tr.last_doc)
        va.end_document(0)
        tr.documents -= 1
        tr.last_doc = None
    elif va.documents == 0 and va.tokens == 0 and tr.tokens > 1:  # one document
        n = tr.tokens
        _move(tr, va, n - min(n - 1, math.ceil(n * val_fraction)))
