"""``tokenmill prepare --format chat``: reading conversation records in pieces, rendering and masking them in the
tokenizer processes, and writing the token and loss-mask shards (see :mod:`tokenmill.data.chat` for the records,
the rendering, the mask and the stored format). Unlike a text prepare, an interrupted chat prepare starts over."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokenmill import atomic
from tokenmill.errors import DataError

from .build import BuildLock, build_folder, clear_build, swap_into_place
from .chat import (
    LEARN,
    LEARN_BIT,
    MASK_FORMAT,
    OVERFLOW,
    START_BIT,
    TEMPLATE_FILE,
    BadConversation,
    ChatSettings,
    ChatTemplate,
    conversation_sequences,
    mask_split_name,
    new_counts,
    to_conversation,
)
from .chunking import CHUNK_BYTES
from .meta import DTYPES, FORMAT, META_NAME, VERSION, dtype_for_vocab, sha256_file
from .pipeline import _W, is_val, pool
from .progress import Progress
from .readers import iter_pieces, report_bad
from .shards import SHARD_TOKENS, SplitWriter
from .sources import collect_inputs, missing_input
from .tokenizers import TOKENIZER_FILE, load_hf_tokenizer_file

# ----------------------------------------------------------------------------------------------
# Reading records (in the tokenizer processes)


def chat_pieces(inp, index: int):
    """The pieces of one input file: byte ranges of JSON Lines, single row groups / record batches."""
    if inp.kind == "jsonl":
        yield from iter_pieces(inp, index, [0, 0], CHUNK_BYTES, True, "text")
    elif inp.kind in ("parquet", "arrow"):
        yield from _columnar_pieces(inp, index)
    else:
        raise DataError(f"'{inp.path}' is a {inp.kind} file; --format chat reads JSON Lines, Parquet or Arrow records "
                        "(one conversation each). Fix: leave it out (e.g. --glob '*.jsonl').")


def _columnar_pieces(inp, index: int):
    from .columnar import _batches, _open_parquet, _pyarrow
    from .sources import Piece

    pa, _ = _pyarrow()
    try:
        if inp.kind == "parquet":
            meta = _open_parquet(inp).metadata
            rows = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        else:
            rows = [b.num_rows for b in _batches(inp)[1]]
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise missing_input(inp) from None
        yield Piece(index, [0, 0], None, (0, 0), disk=inp.size, error=f"is not a readable {inp.kind} file ({e})")
        return
    done = 0
    for i, n in enumerate(rows):
        yield Piece(index, [i, done], None if i == len(rows) - 1 else [i + 1, done + n], (i, i + 1),
                    disk=inp.size // max(1, len(rows)))
        done += n


def piece_records(inp, piece) -> tuple[list, list[int], list]:
    """(records, record numbers from 1, bad records) of a piece."""
    if piece.error is not None:
        return [], [], [(piece.start[1] + 1, piece.error)]
    if inp.kind in ("parquet", "arrow"):
        return _columnar_records(inp, piece)
    if piece.data is not None:
        data = piece.data
    else:
        with open(inp.path, "rb") as f:
            f.seek(piece.span[0])
            data = f.read(piece.span[1] - piece.span[0])
    objs, numbers, bad = [], [], []
    for i, line in enumerate(data.split(b"\n")):
        n = piece.start[1] + i + 1
        if not line.strip():
            continue
        try:
            objs.append(json.loads(line.decode("utf-8-sig" if n == 1 else "utf-8")))
            numbers.append(n)
        except UnicodeDecodeError as e:
            bad.append((n, f"is not UTF-8 (bad byte {line[e.start]:#04x} at column {e.start + 1})"))
        except ValueError as e:
            if n == 1 and line.lstrip().startswith(b"["):
                raise DataError(f"'{inp.path}' is one JSON array, not JSON Lines (one object per line). Fix: "
                                f"convert it, e.g. `jq -c '.[]' {inp.path.name} > {inp.path.stem}.jsonl`.") from None
            bad.append((n, f"is not a JSON object ({str(e)[:80]})"))
    return objs, numbers, bad


def _columnar_records(inp, piece) -> tuple[list, list[int], list]:
    from .columnar import _batches, _open_parquet, _pyarrow

    pa, _ = _pyarrow()
    a = piece.span[0]
    try:
        if inp.kind == "parquet":
            rows = _open_parquet(inp).read_row_group(a).to_pylist()
        else:
            rows = next(b for i, b in enumerate(_batches(inp)[1]) if i == a).to_pylist()
    except (pa.ArrowException, OSError, StopIteration, UnicodeDecodeError) as e:
        return [], [], [(piece.start[1] + 1, f"row group / batch {a} cannot be read ({e})")]
    return rows, [piece.start[1] + i + 1 for i in range(len(rows))], []


@dataclass
class ChatEncoded:
    """A piece's sequences per split ``(ids, mask, start of each sequence within ids, learned tokens)``,
    its bad records ``(record, reason)`` and the counts of what was dropped."""

    splits: dict
    bad: list
    counts: dict = field(default_factory=dict)


def encode_chat_piece(piece) -> ChatEncoded:
    """Read, render, tokenize and mask one piece's conversations (in a tokenizer process)."""
    inp, ct, st = _W["inputs"][piece.file], _W["tok"], _W["settings"]
    objs, numbers, bad = piece_records(inp, piece)
    counts = new_counts()
    parts = {"train": [], "val": []}
    for obj, n in zip(objs, numbers):
        try:
            conv = to_conversation(obj)
            seqs = conversation_sequences(ct, conv, st, counts)
        except BadConversation as e:
            if n == 1 and str(e).startswith("has none of the fields"):
                raise DataError(f"'{inp.path}': record 1 {e}. Fix: --format chat reads OpenAI 'messages', ShareGPT "
                                "'conversations' or Alpaca 'instruction' / 'input' / 'output' records.") from None
            bad.append((n, str(e)))
            continue
        counts["conversations"] += 1
        split = "val" if is_val(st.seed, f"{inp.key}#{n}", st.val_fraction) else "train"
        parts[split] += seqs
    dtype = np.dtype(st.dtype)
    splits = {}
    for s, seqs in parts.items():
        ids = np.concatenate([i for i, _ in seqs]) if seqs else np.empty(0, np.uint32)
        if len(ids) and int(ids.max()) >= st.vocab_size:
            raise DataError(f"the chat tokenizer produced id {int(ids.max())}, beyond its {st.vocab_size} ids. Fix: "
                            "pass a model folder whose tokenizer.json holds every added token.")
        mask = np.concatenate([m for _, m in seqs]) if seqs else np.empty(0, np.uint8)
        starts = np.cumsum([0] + [len(i) for i, _ in seqs[:-1]]).tolist() if seqs else []
        splits[s] = (ids.astype(dtype), mask, starts, int((mask & LEARN_BIT).astype(bool).sum()))
    return ChatEncoded(splits, bad, counts)


# ----------------------------------------------------------------------------------------------
# The build (main process)


def prepare_chat(input, out_dir: str | Path, template: ChatTemplate, learn: str = "assistant", overflow: str = "split",
                 block_size: int | None = None, val_fraction: float = 0.1, workers: int | None = None, seed: int = 0,
                 progress: bool = True, glob: str | None = None, max_files: int | None = None,
                 on_bad_record: str = "skip", shard_tokens: int = SHARD_TOKENS, dtype: str = "auto") -> Path:
    """Render, tokenize and mask the conversations of ``input`` into the token folder ``out_dir`` (tokens and
    their loss-mask shards, meta.json, tokenizer.json, chat_template.jinja); return its path. An existing
    folder is replaced only by a complete one; an interrupted chat prepare starts over when run again."""
    from .prepare import _check_options

    _check_options(val_fraction, on_bad_record, shard_tokens, dtype, None)
    if learn not in LEARN or overflow not in OVERFLOW:
        raise DataError(f"--chat-learn must be one of {list(LEARN)} and --chat-overflow one of {list(OVERFLOW)}, "
                        f"got {learn!r} and {overflow!r}.")
    if block_size is not None and block_size < 2:
        raise DataError(f"--block-size must be >= 2 tokens, got {block_size}.")
    given = Path(out_dir)
    if given.exists() and not given.is_dir():
        raise DataError(f"--out '{given}' exists and is not a folder. Fix: choose another --out.")
    out = given.resolve() if given.is_symlink() else Path(os.path.abspath(given))
    inputs, source = collect_inputs(input, glob, max_files, "auto")
    inputs = [f for f in inputs if f.size > 0]
    if not inputs:
        raise DataError(f"input {source} holds only empty files: no conversation. Fix: pass files with records.")
    opts = dict(learn=learn, overflow=overflow, block_size=block_size, val_fraction=val_fraction, workers=workers,
                seed=seed, progress=progress, on_bad=on_bad_record, shard_tokens=shard_tokens, dtype=dtype,
                source=source)
    build = build_folder(out)
    with BuildLock(build):
        try:
            clear_build(build)
            _ChatBuild(build, inputs, template, opts).run()
            swap_into_place(build, out)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)  # no resume for chat data: leave nothing half-built
            raise
    return given


class _ChatBuild:
    def __init__(self, build: Path, inputs, template: ChatTemplate, opts: dict):
        self.build, self.inputs, self.ct, self.o = build, inputs, template, opts
        self.bpe = load_hf_tokenizer_file(template.folder / TOKENIZER_FILE)
        vocab = self.bpe.vocab_size
        self.dtype = dtype_for_vocab(vocab) if opts["dtype"] == "auto" else opts["dtype"]
        if vocab > 2 ** (8 * DTYPES[self.dtype].itemsize):
            raise DataError(f"--dtype {self.dtype} cannot hold the tokenizer's {vocab:,} ids. Fix: --dtype uint32.")
        self.settings = ChatSettings(opts["seed"], opts["val_fraction"], self.dtype, vocab, opts["learn"],
                                     opts["overflow"], opts["block_size"])
        S = opts["shard_tokens"]
        self.tokens = {s: SplitWriter(build, s, DTYPES[self.dtype], S) for s in ("train", "val")}
        self.masks = {s: SplitWriter(build, mask_split_name(s), np.dtype(np.uint8), S) for s in ("train", "val")}
        self.counts = {**new_counts(), "bad": 0, "first_bad": None, "learned": {"train": 0, "val": 0}}

    def run(self) -> None:
        from .pipeline import init_worker

        total = sum(f.size for f in self.inputs)
        self.bar = Progress(total, self.o["progress"])
        pieces = (p for i, inp in enumerate(self.inputs) for p in chat_pieces(inp, i))
        workers = self.o["workers"] or os.cpu_count() or 1
        workers = max(1, min(workers, total // CHUNK_BYTES + 1))
        try:
            if workers <= 1:
                init_worker(self.inputs, self.ct, self.settings)
                for piece in pieces:
                    self._take(piece, encode_chat_piece(piece))
            else:
                self._run_pool(pieces, workers)
        finally:
            self.bar.close()
        self._finish()

    def _run_pool(self, pieces, workers: int) -> None:
        import collections
        import dataclasses

        with pool(workers, self.inputs, self.ct, self.settings) as p:
            pending: collections.deque = collections.deque()
            for piece in pieces:
                pending.append((dataclasses.replace(piece, data=None), p.apply_async(encode_chat_piece, (piece,))))
                while len(pending) >= 2 * workers + 2:
                    done, res = pending.popleft()
                    self._take(done, res.get())
            while pending:
                done, res = pending.popleft()
                self._take(done, res.get())

    def _take(self, piece, enc: ChatEncoded) -> None:
        self._report(self.inputs[piece.file], enc.bad)
        for k, v in enc.counts.items():
            self.counts[k] += v
        tokens = seqs = 0
        for split, (ids, mask, starts, learned) in enc.splits.items():
            tw, mw = self.tokens[split], self.masks[split]
            base = tw.tokens
            tw.write(ids)
            mw.write(mask)
            for s in starts:
                tw.end_document(base + s)
                mw.end_document(base + s)
            self.counts["learned"][split] += learned
            tokens, seqs = tokens + len(ids), seqs + len(starts)
        self.bar.update(piece.disk, tokens, seqs)

    def _report(self, inp, bad: list) -> None:
        for record, reason in bad:
            report_bad(f"'{inp.path}' record {record}: {reason}", self.o["on_bad"], self.counts)

    def _finish(self) -> None:
        tr, va = self.tokens["train"], self.tokens["val"]
        if tr.documents + va.documents == 0:
            first = self.counts["first_bad"]
            why = f"; {self.counts['bad']} bad record(s) skipped, the first: {first}" if first else ""
            raise DataError(f"input {self.o['source']} holds no conversation with a reply to learn{why}. Fix: pass "
                            "chat records (docs/data.md, Chat data).")
        self._balance()
        splits = {s: w.finish() for s, w in self.tokens.items()}
        masks = {s: w.finish() for s, w in self.masks.items()}
        self.bpe.save(self.build / TOKENIZER_FILE)
        atomic.write_text(self.build / TEMPLATE_FILE, self.ct.template)
        meta = {"format": FORMAT, "version": VERSION, "vocab_size": self.bpe.vocab_size, "dtype": self.dtype,
                "tokenizer": {"name": "bpe", "vocab_size": self.bpe.vocab_size, "eot_id": None, "file": TOKENIZER_FILE,
                              "from": str(self.ct.folder)},
                "splits": splits, "source": self.o["source"], "chat": self._chat_meta(masks),
                "prepare": {"format": "chat", "val_fraction": self.o["val_fraction"], "seed": self.o["seed"],
                            "documents": tr.documents + va.documents, "inputs": len(self.inputs),
                            "bad_records": self.counts["bad"], "first_bad_record": self.counts["first_bad"]}}
        atomic.write_json(self.build / META_NAME, meta)

    def _chat_meta(self, masks: dict) -> dict:
        c = self.counts
        return {"format": MASK_FORMAT, "version": 1, "dtype": "uint8", "bits": {"learn": LEARN_BIT, "start": START_BIT},
                "learn": self.o["learn"], "overflow": self.o["overflow"], "block_size": self.o["block_size"],
                "template": TEMPLATE_FILE, "template_sha256": sha256_file(self.build / TEMPLATE_FILE),
                "template_from": self.ct.template_from, "end_of_turn": self.ct.eot,
                "end_of_turn_id": self.ct.tok.convert_tokens_to_ids(self.ct.eot),
                "splits": {s: {"sequences": self.tokens[s].documents, "learned": c["learned"][s],
                               "shards": e["shards"]} for s, e in masks.items()},
                "counts": {k: c[k] for k in ("conversations", "too_long", "split", "exchanges_dropped", "no_learned")}}

    def _balance(self) -> None:
        """At least one sequence in each split when there are two or more and val_fraction > 0."""
        if self.o["val_fraction"] <= 0:
            return
        for a, b in (("val", "train"), ("train", "val")):  # (empty split, the one to take from)
            if self.tokens[a].documents == 0 and self.tokens[b].documents >= 2:
                start = self.tokens[b].last_doc
                for ws in (self.tokens, self.masks):
                    _move(ws[b], ws[a], start)
                    ws[a].end_document(0)
                    ws[b].documents -= 1
                    ws[b].last_doc = None
                learned = int(sum(int((blk & LEARN_BIT).astype(bool).sum()) for blk in self.masks[a].read(0, self.masks[a].tokens)))
                self.counts["learned"][a] += learned
                self.counts["learned"][b] -= learned
                return


def _move(src: SplitWriter, dst: SplitWriter, start: int) -> None:
    for block in src.read(start, src.tokens):
        dst.write(block)
    src.truncate(start)


def chat_summary(meta: dict) -> str:
    """The lines ``tokenmill prepare --format chat`` prints after its usual summary."""
    c = meta["chat"]
    n = c["counts"]
    learned = sum(s["learned"] for s in c["splits"].values())
    tokens = sum(meta["splits"][s]["tokens"] for s in c["splits"])
    window = f"window {c['block_size']} tokens ({c['overflow']})" if c["block_size"] else "no window limit"
    return (f"chat: {n['conversations']:,} conversation(s) -> {sum(s['sequences'] for s in c['splits'].values()):,} "
            f"sequence(s); learned {learned:,} of {tokens:,} tokens ({c['learn']}; end of turn {c['end_of_turn']!r}); "
            f"{window}: {n['too_long']:,} too long dropped, {n['split']:,} split, {n['exchanges_dropped']:,} "
            f"exchange(s) longer than the window dropped, {n['no_learned']:,} sequence(s) with nothing to learn dropped")
