"""Reading input files in bounded pieces, and the documents of a piece.

The main process walks each input file (:func:`iter_pieces`) and cuts it into pieces of about
:data:`~tokenmill.data.chunking.CHUNK_BYTES` of text: byte ranges of a plain file (cut at line
starts for JSON Lines, at safe points for text), the bytes themselves for a compressed stream
(decompressed here, once), groups of Parquet row groups or of Arrow record batches. A tokenizer
process turns a piece into documents (:func:`piece_documents`). Each piece knows the position where
the next one starts (``[unit, record]``: byte offset, row group or batch index, and the number of
records before it), so a resumed prepare can start a file in the middle.

Problems with a record (not JSON, not UTF-8, the text field missing or not a string, a compressed
stream or Arrow file that ends early, an unreadable Parquet file) are returned as bad records
``(record number, reason)``, never raised, except where the input as a whole is wrong (no such
column in a Parquet/Arrow file, a column that is not text, a first record without the field):
those raise :class:`DataError` naming the fix.
"""

from __future__ import annotations

import codecs
import gzip
import json
import sys
import zlib
from collections.abc import Iterator

from tokenmill.errors import DataError

from .chunking import CHUNK_BYTES, next_cut
from .sources import InputFile, Piece, missing_input, open_pipe

READ_BYTES = 1 << 18  # compressed bytes read at a time



MAX_WARNINGS = 10  # bad records reported one by one (the rest are counted)


def report_bad(msg: str, on_bad: str, counts: dict) -> None:
    """A bad record (``--on-bad-record``): 'stop' raises naming it; 'skip' counts it (``counts['bad']``, the first
    in ``counts['first_bad']``) and warns for the first :data:`MAX_WARNINGS`."""
    if on_bad == "stop":
        raise DataError(f"{msg}. Fix: repair or remove it, or pass --on-bad-record skip to count and skip bad records.")
    counts["bad"] += 1
    counts["first_bad"] = counts["first_bad"] or msg
    if counts["bad"] <= MAX_WARNINGS:
        print(f"tokenmill: warning: {msg}; skipped", file=sys.stderr, flush=True)

def _open(inp: InputFile):
    if inp.pipe:
        return open_pipe(inp)
    try:
        return open(inp.path, "rb")
    except FileNotFoundError:
        raise missing_input(inp) from None


def iter_pieces(inp: InputFile, index: int, start: list, chunk: int = CHUNK_BYTES,
                cut_text: bool = True, text_field: str = "text") -> Iterator[Piece]:
    """The pieces of ``inp`` from position ``start`` on (see the module docstring). ``cut_text``: text
    documents may be cut (the tokenizer is chunkable); else a plain text file is one piece."""
    if inp.kind in ("parquet", "arrow"):
        from .columnar import iter_columnar_pieces

        yield from iter_columnar_pieces(inp, index, start, chunk, text_field)
    elif inp.compression or inp.pipe:  # read once, in order: the pieces carry their bytes
        yield from _stream_pieces(inp, index, start, chunk, cut_text)
    else:
        yield from _range_pieces(inp, index, start, chunk if cut_text or inp.kind == "jsonl" else 1 << 62)


def _range_pieces(inp: InputFile, index: int, start: list, chunk: int) -> Iterator[Piece]:
    """Byte ranges of a plain file, found by reading a bounded window at a time (no memory map, so the
    main process's resident memory does not grow with the file)."""
    size = inp.size
    if start[0] >= size:
        return
    with _open(inp) as f:
        if inp.kind == "text" and start[0] == 0:
            bad = _utf8_problem(f, size)
            if bad is not None:
                yield Piece(index, [0, 0], None, (0, 0), disk=size, error=bad)
                return
        pos, record = start
        while pos < size:
            cut, lines = _range_cut(f, inp.kind, pos, size, chunk)
            end = [cut, record + lines] if cut < size else None
            yield Piece(index, [pos, record], end, (pos, cut), disk=cut - pos)
            pos, record = cut, record + lines


def _range_cut(f, kind: str, pos: int, size: int, chunk: int) -> tuple[int, int]:
    """(end of the piece starting at ``pos``, records in it): after the first newline from ``pos + chunk``
    on (JSON Lines), or at a safe cut for text (:func:`next_cut`), reading more while none is found."""
    if kind == "text" and size - pos <= chunk:
        return size, 0
    want = min(size - pos, chunk + (1 << 16) if kind == "jsonl" else 2 * chunk)
    while True:
        f.seek(pos)
        buf = f.read(want)
        if len(buf) < want:
            raise DataError(f"input file '{f.name}' shrank while prepare was reading it. Fix: run again.")
        final = pos + want >= size
        if kind == "jsonl":
            nl = buf.find(b"\n", min(chunk, len(buf)) - 1)
            cut = len(buf) if nl == -1 and final else (nl + 1 if nl != -1 else None)
        else:
            cut = next_cut(buf, 0, chunk, len(buf), final=final)
        if cut is not None:
            lines = buf.count(b"\n", 0, cut) + (buf[cut - 1] != 0x0A) if kind == "jsonl" else 0
            return pos + cut, lines
        want = min(size - pos, 2 * want)


def _utf8_problem(f, size: int) -> str | None:
    """None when the file is UTF-8; else the reason, with the first bad byte's offset."""
    dec = codecs.getincrementaldecoder("utf-8")()
    step, a = 1 << 22, 0
    f.seek(0)
    while a < size:
        block = f.read(min(step, size - a))
        try:
            dec.decode(block, final=a + len(block) >= size)
        except UnicodeDecodeError as e:
            off = max(0, a + e.start - len(dec.getstate()[0]))
            f.seek(off)
            return f"is not UTF-8 text (bad byte {f.read(1)[0]:#04x} at byte offset {off})"
        a += len(block)
    return None


class _Stream:
    """Decompressed bytes of a gzip / Zstandard file (or the bytes of an uncompressed pipe) read in steps;
    ``raw`` = file bytes read. Raises EOFError when the compressed stream ends before its end marker (a
    truncated file)."""

    def __init__(self, f, compression: str | None):
        self.f, self.compression, self.raw = f, compression, 0
        self.done = False
        if compression is None:
            self.d = None
        elif compression == "gzip":
            self.d = zlib.decompressobj(wbits=31)
        else:
            try:
                import zstandard
            except ImportError:
                raise DataError(
                    "reading .zst files needs the zstandard package. Fix: `pip install 'tokenmill[corpora]'` "
                    "(or `pip install zstandard`)."
                ) from None
            self._zstd = zstandard.ZstdDecompressor()
            self.d = self._zstd.decompressobj()

    def read(self) -> bytes:
        """The next decompressed bytes (b'' at the end)."""
        while not self.done:
            raw = self.f.read(READ_BYTES)
            self.raw += len(raw)
            if not raw:
                self.done = True
                if self.d is not None and not self.d.eof:
                    raise EOFError("the compressed stream ends before its end marker (a truncated file)")
                return b""
            out = self._feed(raw)
            if out:
                return out
        return b""

    def _feed(self, raw: bytes) -> bytes:
        if self.d is None:
            return raw
        out = self.d.decompress(raw)
        while self.d.eof and self.d.unused_data:  # another member / frame follows
            rest = self.d.unused_data
            self.d = zlib.decompressobj(wbits=31) if self.compression == "gzip" else self._zstd.decompressobj()
            out += self.d.decompress(rest)
        return out


def _stream_pieces(inp: InputFile, index: int, start: list, chunk: int, cut_text: bool) -> Iterator[Piece]:
    skip, record = start
    with _open(inp) as f:
        stream = _Stream(f, inp.compression)
        buf, offset, disk, error = bytearray(), 0, 0, None  # offset: decompressed position of buf[0]
        decoder = codecs.getincrementaldecoder("utf-8")() if inp.kind == "text" else None
        while True:
            try:
                data = stream.read()
            except (EOFError, OSError, zlib.error, gzip.BadGzipFile, Exception) as e:  # zstd errors too
                data, error = b"", f"{e} (after {offset + len(buf):,} decompressed bytes)"
            eof = not data
            if skip > offset:  # resuming: drop what was done before
                drop = min(len(data), skip - offset)
                data, offset = data[drop:], offset + drop
            if decoder is not None and data and error is None:
                try:
                    decoder.decode(bytes(data), final=eof)
                except UnicodeDecodeError:
                    error = f"is not UTF-8 text (a bad byte within decompressed bytes {offset + len(buf):,}.."
                    error += f"{offset + len(buf) + len(data):,}); the document ends before them"
                    data, eof = b"", True
            buf += data
            while buf:
                cut = _stream_cut(buf, inp.kind, chunk, eof, cut_text)
                if cut is None:
                    break
                lines = buf.count(b"\n", 0, cut) + (buf[cut - 1] != 0x0A) if inp.kind == "jsonl" else 0
                last = eof and cut == len(buf) and error is None
                piece = Piece(index, [offset, record], None if last else [offset + cut, record + lines], (0, cut),
                              data=bytes(buf[:cut]), disk=stream.raw - disk, raw=stream.raw)
                disk = stream.raw
                del buf[:cut]
                offset, record = offset + cut, record + lines
                yield piece
            if eof:
                if error is not None:
                    yield Piece(index, [offset, record], None, (0, 0), disk=stream.raw - disk, error=error)
                return


def _stream_cut(buf: bytearray, kind: str, chunk: int, eof: bool, cut_text: bool) -> int | None:
    if kind == "jsonl":
        if len(buf) < chunk and not eof:
            return None
        nl = buf.rfind(b"\n")
        return len(buf) if eof else (nl + 1 if nl != -1 else None)
    if not cut_text:
        return len(buf) if eof else None
    return next_cut(buf, 0, chunk, len(buf), final=eof)


# ----------------------------------------------------------------------------------------------
# The documents of a piece (run in the tokenizer processes)


def piece_documents(inp: InputFile, piece: Piece, text_field: str) -> tuple[list[str], list[int], list]:
    """(texts, record numbers, bad records) of ``piece``. Text: one piece of one document (record 0).
    Bad records: ``(record number, reason)``, record numbers counted from 1."""
    if piece.error is not None:
        return [], [], [(piece.start[1] + 1, piece.error)]
    if inp.kind in ("parquet", "arrow"):
        from .columnar import columnar_documents

        return columnar_documents(inp, piece, text_field)
    data = piece.data if piece.data is not None else _read_range(inp, *piece.span)
    bom = len(codecs.BOM_UTF8) if piece.first and data.startswith(codecs.BOM_UTF8) else 0
    data = data[bom:]  # a byte-order mark (Windows editors write one) is not text
    if inp.kind == "text":
        try:  # Windows line ends read as "\n", as Python's text files do: the same tokens as the LF copy
            return [data.decode("utf-8").replace("\r\n", "\n")], [1], []
        except UnicodeDecodeError as e:
            return [], [], [(1, f"is not UTF-8 text (bad byte at byte offset {piece.start[0] + bom + e.start})")]
    return _jsonl_documents(data, piece.start[1], text_field, inp)


def _read_range(inp: InputFile, a: int, b: int) -> bytes:
    with _open(inp) as f:
        f.seek(a)
        return f.read(b - a)


def _jsonl_documents(data: bytes, first: int, field: str, inp: InputFile) -> tuple[list[str], list[int], list]:
    texts, numbers, bad = [], [], []
    for i, line in enumerate(data.split(b"\n")):
        n = first + i + 1
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            bad.append((n, f"is not UTF-8 (bad byte {line[e.start]:#04x} at column {e.start + 1})"))
            continue
        except RecursionError:  # arrays/objects nested beyond what Python reads
            bad.append((n, "is nested too deep to read (JSON arrays/objects inside each other)"))
            continue
        except ValueError as e:
            if n == 1 and line.lstrip().startswith(b"["):
                raise DataError(
                    f"'{inp.path}' is one JSON array, not JSON Lines (one object per line). Fix: convert it, e.g. "
                    f"`jq -c '.[]' {inp.path.name} > {inp.path.stem}.jsonl`."
                ) from None
            bad.append((n, f"is not a JSON object ({str(e)[:80]})"))
            continue
        text = obj.get(field) if isinstance(obj, dict) else None
        if isinstance(text, str):
            texts.append(text)
            numbers.append(n)
            continue
        if n == 1 and isinstance(obj, dict) and field not in obj:
            raise DataError(
                f"'{inp.path}': record 1 has no field '{field}' (its fields: {sorted(obj)[:12]}). Fix: pass "
                "--text-field with the field that holds the text."
            )
        what = "is not a JSON object" if not isinstance(obj, dict) else (
            f"has no field '{field}'" if field not in obj else f"field '{field}' is {type(text).__name__}, not text")
        bad.append((n, what))
    return texts, numbers, bad
